"""The equivalence table: each CPU layout against one rank, in float64 and float32, in one run.

    python benchmarks/trainer_equivalence.py      # about 6 minutes on 2 CPUs

Every run is tests/support/trainer_ranks.py (a real `TrainingService` under torchrun, gloo) on the same
committed
batch of the tiny MoE with routing replay on: the full-vocabulary logits before the step, the gradients after
the layout's reductions, the weights the writer publishes as v1, the step's figures. Each layout is compared
with the one-rank run of the same dtype: max |Δ logit|, max |Δ grad|, max |Δ weight|, the loss's relative
difference and whether every step figure agrees (floats to 1e-9 relative; the figures that describe the split
itself — micro-batch count, seconds — left out).

float64 shows whether a layout computes the same function (it does to ~1e-13); float32 shows what users see,
next to the float32 noise floor: the one-rank run itself with another micro-batch size (other matmul shapes,
rounded differently by the CPU kernels). Results: `benchmarks/results/trainer_equivalence.json`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from provenance import git_commit
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "support" / "trainer_ranks.py"
RESULTS = REPO / "benchmarks" / "results" / "trainer_equivalence.json"
LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "TP2+SP (full recompute)": (2, ["--tp", "2", "--recompute", "full"]),
    "EP2 (×DP2)": (2, ["--ep", "2"]),
    "DP2": (2, []),
    "PP2 (full recompute)": (2, ["--pp", "2", "--recompute", "full"]),
    "TP2×EP2×DP2": (4, ["--tp", "2", "--ep", "2", "--recompute", "selective"]),
    "TP2 without replay (control)": (2, ["--tp", "2", "--no-replay"]),
}
LAYOUT_FIGURES = {"micro_batches", "step_seconds", "tokens_per_second", "checkpoint"}


def launch(
    ranks: int, args: list[str], *, tiny: Path, template: Path, root: Path, name: str
) -> dict[str, Any]:
    store = root / name
    shutil.copytree(template, store)
    out = root / f"{name}.pt"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
        str(WORKER), "run", "--tiny", str(tiny), "--store", str(store), "--out", str(out), *args,
    ]  # fmt: skip
    done = subprocess.run(  # noqa: S603 - our interpreter, fixed argv
        command,
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{name}: {done.stderr[-6000:]}")
    result: dict[str, Any] = torch.load(out, weights_only=False)
    weights: dict[str, torch.Tensor] = {}
    for f in sorted((store / "weights" / "v1").glob("*.safetensors")):
        weights.update(load_file(str(f)))
    result["published"] = weights
    return result


def delta(a: dict[Any, torch.Tensor], b: dict[Any, torch.Tensor]) -> float:
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def differing_figures(want: dict[str, Any], got: dict[str, Any]) -> list[str]:
    out = []
    for key in sorted(set(want) | set(got)):
        a, b = want.get(key), got.get(key)
        if key in LAYOUT_FIGURES:
            continue
        if isinstance(a, float) and isinstance(b, float):
            if not (math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12) or (math.isnan(a) and math.isnan(b))):
                out.append(key)
        elif a != b:
            out.append(key)
    return out


def compare(one: dict[str, Any], got: dict[str, Any]) -> dict[str, Any]:
    loss_a, loss_b = one["figures"][1]["loss"], got["figures"][1]["loss"]
    return {
        "max_abs_dlogit": delta(one["logits"], got["logits"]),
        "max_abs_dgrad": delta(one["grads"], got["grads"]),
        "max_abs_dweight": delta(one["published"], got["published"]),
        "loss_rel_diff": abs(loss_a - loss_b) / abs(loss_a),
        "figures_differing": differing_figures(one["figures"][1], got["figures"][1]),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    report: dict[str, Any] = {
        "benchmark": "trainer_equivalence",
        "command": "python benchmarks/trainer_equivalence.py",
    }
    with tempfile.TemporaryDirectory(prefix="legorl-equivalence-") as tmp:
        root = Path(tmp)
        tiny, template = root / "tiny", root / "template"
        subprocess.run(  # noqa: S603 - our interpreter, fixed argv
            [sys.executable, str(WORKER), "make", "--tiny", str(tiny), "--store", str(template)],
            cwd=REPO,
            check=True,
            capture_output=True,
        )
        for dtype in ("float64", "float32"):
            one = launch(1, ["--dtype", dtype], tiny=tiny, template=template, root=root, name=f"one-{dtype}")
            rows: dict[str, dict[str, Any]] = {}
            for name, (ranks, extra) in LAYOUTS.items():
                got = launch(
                    ranks,
                    [*extra, "--dtype", dtype],
                    tiny=tiny,
                    template=template,
                    root=root,
                    name=f"{len(rows)}-{dtype}",
                )
                rows[name] = compare(one, got)
                print(dtype, name, {k: v for k, v in rows[name].items() if k != "figures_differing"})
            floor_args = ["--dtype", dtype, "--micro-tokens", "400"]
            floor = launch(1, floor_args, tiny=tiny, template=template, root=root, name=f"floor-{dtype}")
            rows["one rank, other micro-batch size (noise floor)"] = compare(one, floor)
            report[dtype] = rows
    report["git_commit"] = git_commit()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

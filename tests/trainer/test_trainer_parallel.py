"""The trainer at every layout computes what the one-rank trainer computes: TP+SP, EP, DP, PP, TP×EP×DP.

Real megatron-core on CPU under real torchrun (gloo), the tiny MoE with routing replay on, every run a real
`TrainingService` on its own copy of one committed batch (tests/support/trainer_ranks.py is the rank
program). The
runs are in float64: in float32 this model's logits (up to ~26) move by 1e-5–2e-4 with nothing but the
shape of a micro-batch (CPU matmuls round by shape; measured in docs/trainer.md), which would hide what a
layout itself changes; in float64 a layout that computes the same function agrees to ~1e-13, and a wrong
one — the replay-off control — by whole logits. Compared against the one-rank run: full-vocabulary logits,
the loss and every step figure, every gradient after the layout's reductions (in HF names), the weights the
writer publishes after the step, their HF export as loaded (bit for bit), and a checkpoint saved at one
layout resumed at another.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

pytestmark = [pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "support" / "trainer_ranks.py"
# Layout-dependent by nature: how the rank split its work, and how fast it was.
LAYOUT_FIGURES = {"micro_batches", "step_seconds", "tokens_per_second", "checkpoint"}


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(tiny model, a run store with batches 1 and 2 committed)."""
    root = tmp_path_factory.mktemp("parallel")
    tiny, store = root / "tiny", root / "template"
    subprocess.run(
        [sys.executable, str(WORKER), "make", "--tiny", str(tiny), "--store", str(store)],
        check=True,
        cwd=REPO,
    )
    return tiny, store


Runner = Callable[..., dict[str, Any]]


@pytest.fixture(scope="module")
def launch(template: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runner]:
    tiny, store = template
    root = tmp_path_factory.mktemp("runs")
    cache: dict[tuple[Any, ...], dict[str, Any]] = {}

    def launch(ranks: int, *args: str, name: str | None = None, resume: Path | None = None) -> dict[str, Any]:
        key = (ranks, args, str(resume))
        if key in cache:
            return cache[key]
        run_dir = root / (name or f"r{len(cache)}")
        if run_dir.exists():
            shutil.rmtree(run_dir)
        shutil.copytree(resume or store, run_dir)
        out = run_dir.with_suffix(".pt")
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
            str(WORKER), "run", "--tiny", str(tiny), "--store", str(run_dir), "--out", str(out), *args,
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        done = subprocess.run(
            command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False
        )
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-8000:]
        result: dict[str, Any] = torch.load(out, weights_only=False)
        result["store"] = run_dir
        cache[key] = result
        return result

    yield launch
    # Each launch copies the run store and writes a checkpoint: ~1.8 GB once the module is done.
    shutil.rmtree(root, ignore_errors=True)


def _max_delta(a: dict[Any, torch.Tensor], b: dict[Any, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def _published(store: Path, version: str) -> dict[str, torch.Tensor]:
    files = sorted((store / "weights" / version).glob("*.safetensors"))
    assert files, f"{version} not published under {store}"
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


def _figures_equal(want: dict[str, Any], got: dict[str, Any]) -> list[str]:
    """Names of the step figures that differ (floats beyond 1e-9 relative)."""
    bad = []
    for key in sorted(set(want) | set(got)):
        if key in LAYOUT_FIGURES:
            continue
        a, b = want.get(key), got.get(key)
        if isinstance(a, float) and isinstance(b, float):
            if not (math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12) or (math.isnan(a) and math.isnan(b))):
                bad.append(f"{key}: {a} vs {b}")
        elif a != b:
            bad.append(f"{key}: {a} vs {b}")
    return bad


LAYOUTS = {
    "TP2+SP, full recompute": (2, ("--tp", "2", "--recompute", "full")),
    "EP2 (×DP2)": (2, ("--ep", "2")),
    "DP2": (2, ()),
    "PP2, full recompute": (2, ("--pp", "2", "--recompute", "full")),
    "TP2×EP2×DP2": (4, ("--tp", "2", "--ep", "2", "--recompute", "selective")),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_layout_trains_like_one_rank(launch: Runner, layout: str) -> None:
    ranks, args = LAYOUTS[layout]
    one = launch(1)
    got = launch(ranks, *args)
    assert got["resumed_from"] is None
    assert _max_delta(one["logits"], got["logits"]) <= 1e-5, "logits"
    # Routing parity counts every (token, MoE layer) once at any layout, and agrees (a fifth of the
    # engine's rows were moved in the batch: it is below 1).
    for key in ("routing_compared", "routing_agreement"):
        assert got["scored"][key] == one["scored"][key], key
    assert 0.5 < one["scored"]["routing_agreement"] < 1.0
    want_fig, got_fig = one["figures"][1], got["figures"][1]
    assert math.isclose(want_fig["loss"], got_fig["loss"], rel_tol=1e-6), (want_fig["loss"], got_fig["loss"])
    assert not _figures_equal(want_fig, got_fig)
    assert _max_delta(one["grads"], got["grads"]) <= 1e-5, "gradients"
    # What the writer published as v1, and the per-token training log-probs it stored for the UI.
    assert _max_delta(_published(one["store"], "v1"), _published(got["store"], "v1")) <= 1e-6, "weights"
    assert one["token_logprobs"][1].keys() == got["token_logprobs"][1].keys()
    for key, values in one["token_logprobs"][1].items():
        other = got["token_logprobs"][1][key]
        assert [v is None for v in values] == [v is None for v in other], key
        assert max(abs(a - b) for a, b in zip(values, other, strict=True) if a is not None) <= 1e-9, key
    # The step really moved the weights (the comparison above is not of two unchanged models).
    moved = _max_delta(one["loaded"], _published(one["store"], "v1"))
    assert moved > 1e-4


@pytest.mark.parametrize("layout", ["one rank", *LAYOUTS])
def test_export_is_bit_identical_at_every_layout(
    launch: Runner, template: tuple[Path, Path], layout: str
) -> None:
    """Sharded load (each rank reads its slices), then gathered export, gives back the checkpoint exactly."""
    ranks, args = LAYOUTS.get(layout, (1, ()))
    got = launch(ranks, *args)
    source = load_file(str(template[0] / "model.safetensors"))
    assert got["loaded"].keys() == source.keys()
    for name, tensor in source.items():
        assert torch.equal(got["loaded"][name], tensor.double()), name


def test_replay_off_is_caught(launch: Runner) -> None:
    """The control: the same layout without routing replay routes tokens where the engine did not, and the
    comparison fails by far more than its tolerance."""
    one = launch(1)
    off = launch(2, "--tp", "2", "--no-replay")
    assert _max_delta(one["logits"], off["logits"]) > 1.0
    assert _max_delta(one["grads"], off["grads"]) > 1e-3


@pytest.mark.parametrize(
    ("saved", "resumed"),
    [
        # The first is the TP2 × EP2 × DP2 run of the layout test (the same arguments: one run, reused).
        ((4, ("--tp", "2", "--ep", "2", "--recompute", "selective")), (4, ())),
        ((4, ()), (4, ("--tp", "2", "--ep", "2"))),
    ],
    ids=["TP2xEP2 to DP4", "DP4 to TP2xEP2"],
)
def test_a_checkpoint_resumes_at_another_layout(
    launch: Runner, saved: tuple[int, tuple[str, ...]], resumed: tuple[int, tuple[str, ...]]
) -> None:
    """Step 1 at one layout (checkpoint every step), step 2 resumed from that checkpoint at another: the same
    state as saved (weights, fp32 masters, AdamW moments: bit for bit), and the same v2 as one rank training
    both steps."""
    two = launch(1, "--steps", "2")
    first = launch(saved[0], *saved[1])
    second = launch(resumed[0], *resumed[1], "--steps", "2", resume=first["store"])
    assert second["resumed_from"] == 1
    assert first["state"].keys() == second["loaded_state"].keys()
    for key, fields in first["state"].items():
        for field, tensor in fields.items():
            assert torch.equal(second["loaded_state"][key][field], tensor), (key, field)
    assert _max_delta(_published(two["store"], "v2"), _published(second["store"], "v2")) <= 1e-6
    assert not _figures_equal(two["figures"][2], second["figures"][2])


def test_entropy_kl_and_mini_batches_at_tp2_pp2(launch: Runner) -> None:
    """The loss terms the plain layouts leave out: the entropy bonus (its vocab-parallel gradient), the k3 KL
    to a frozen reference (its own forward-only pass through the pipeline) and two mini-batches (the second
    against log-probs taken before the first update), at TP2 × PP2 on four ranks against one rank."""
    flags = ("--entropy-coef", "0.01", "--kl-coef", "0.05", "--mini-batches", "2")
    one = launch(1, *flags)
    got = launch(4, "--tp", "2", "--pp", "2", *flags)
    assert _max_delta(one["logits"], got["logits"]) <= 1e-5
    assert _max_delta(one["grads"], got["grads"]) <= 1e-5
    assert _max_delta(_published(one["store"], "v1"), _published(got["store"], "v1")) <= 1e-6
    assert not _figures_equal(one["figures"][1], got["figures"][1])
    assert one["figures"][1]["mini_batches"] == 2 and one["figures"][1]["kl_ref"] > 0

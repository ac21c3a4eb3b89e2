"""How long the quick test loop takes on this machine: the unit tier serially and over pytest-xdist workers.

The quick loop is `pytest -m "not slow and not integration"` (README, "Test"): everything but what starts a
real engine, harness, trainer, browser, API server, node, sandboxed trial, helm or megatron-core ranks. This
times that whole command (collection included: it imports torch and megatron-core for the modules that test
them) in two ways, alternating and repeated: serially (`-p no:xdist`, the baseline) and with `-n auto`
(pytest-xdist, one worker per CPU). It also times `-m "not slow"` once (the unit and integration tiers) for
scale. Per run: wall seconds, the tests passed, the exit code.

    python benchmarks/quick_loop.py [--repeats 2] [--out benchmarks/results/quick_loop.json]

Run from the repository root with `.venv` made (`bash scripts/test.sh` once). Bytecode caching is left as
the environment has it and recorded (`PYTHONDONTWRITEBYTECODE`): with it set, every run compiles the
tests and legorl from source again.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
QUICK = "not slow and not integration"
MODES = {
    "serial": ["-p", "no:xdist"],
    "xdist_auto": ["-n", "auto"],
}


def run(marker: str, extra: list[str]) -> dict[str, object]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", marker, *extra]
    started = time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False)  # noqa: S603
    wall = time.perf_counter() - started
    tail = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    passed = re.search(r"(\d+) passed", tail)
    return {
        "command": " ".join(["pytest", "-m", repr(marker), *extra]),
        "wall_seconds": round(wall, 1),
        "passed": int(passed.group(1)) if passed else None,
        "exit_code": done.returncode,
        "summary": tail,
        "failed": [line.split(" ", 1)[1] for line in done.stdout.splitlines() if line.startswith("FAILED ")],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "quick_loop.json")
    args = parser.parse_args()
    runs: dict[str, list[dict[str, object]]] = {mode: [] for mode in MODES}
    for repeat in range(args.repeats):
        order = list(MODES) if repeat % 2 == 0 else list(reversed(MODES))
        for mode in order:
            result = run(QUICK, MODES[mode])
            print(f"{mode}: {result['wall_seconds']} s, {result['summary']}", flush=True)
            runs[mode].append(result)
    wider = run("not slow", MODES["xdist_auto"])
    print(f"not slow, xdist: {wider['wall_seconds']} s, {wider['summary']}", flush=True)
    summary = {}
    for mode, results in runs.items():
        walls = [float(r["wall_seconds"]) for r in results]  # type: ignore[arg-type]
        summary[mode] = {
            "median_wall_seconds": round(statistics.median(walls), 1),
            "min_wall_seconds": min(walls),
            "max_wall_seconds": max(walls),
            "all_passed": all(r["exit_code"] == 0 for r in results),
        }
    out = {
        "what": f'pytest -m "{QUICK}" wall time, serial vs pytest-xdist -n auto, alternating',
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "PYTHONDONTWRITEBYTECODE": os.environ.get("PYTHONDONTWRITEBYTECODE", ""),
        },
        "repeats": args.repeats,
        "summary": summary,
        "runs": runs,
        "not_slow_xdist_auto": wider,
    }
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0 if all(s["all_passed"] for s in summary.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

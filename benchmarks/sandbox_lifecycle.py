"""Benchmark: the local sandbox backend's stage times, with the defenses on and off, in one run.

N trials (default 50) on the bundled tiny-python task set (round-robin over its tasks). Each trial's
scripted agent applies the task's gold patch with `git apply` — a realistic edit that earns reward 1,
so the verify stage runs the full hidden test file. Two variants, interleaved trial by trial so
that machine noise hits both alike:

- defended: the shipped defaults — setup reduces history to one fresh commit and self-tests it,
  every stage runs in bwrap as its own uid with loopback-only networking (the agent's egress
  self-test included), cgroup and rlimit limits, size-limited tmpfs workspaces, and the change set is
  sanitized before verify;
- undefended: `Defenses.off()` — the same stages on plain folders as the calling user: history kept,
  no namespaces, no limits, no self-tests.

Per stage it prints p50 and p95 over the trials (setup, agent start = until the sandbox's self-test
report arrived, agent, verify, and the whole trial) and the ratio defended / undefended of the
p50s. Every trial must earn reward 1 in both variants, or the benchmark fails: timing a broken
trial measures nothing.

Results go to `--out` (default benchmarks/results/sandbox_lifecycle.json): per variant and stage the
p50, p95 and every trial's seconds, the p50 ratios, the machine and the git commit.

Usage: python benchmarks/sandbox_lifecycle.py [--trials 50] [--keep DIR] [--out FILE]
Needs root and bubblewrap (scripts/get-sandbox-tools.sh).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from provenance import git_commit

from legorl.sandbox.bundled import generate
from legorl.sandbox.local import Defenses, LocalBackend
from legorl.sandbox.task import load_jsonl
from legorl.sandbox.trial import TrialOutcome, pristine_tree, run_local_trial

STAGES = ("setup", "agent_start", "agent", "verify", "total")


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=50)
    parser.add_argument("--keep", type=Path, help="keep the run folder here (default: a temp folder)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/sandbox_lifecycle.json"))
    args = parser.parse_args()
    if shutil.which("bwrap") is None or os.geteuid() != 0:
        print("needs root and bubblewrap (bash scripts/get-sandbox-tools.sh)", file=sys.stderr)
        return 2
    root = args.keep or Path(tempfile.mkdtemp(prefix="legorl-bench-"))
    task_set = load_jsonl(generate(root / "tasks"))
    backends = {
        "defended": LocalBackend(root / "defended"),
        "undefended": LocalBackend(root / "undefended", defenses=Defenses.off()),
    }
    # Warm the per-task pristine trees and the page cache, so neither variant pays for them alone.
    for backend in backends.values():
        for task in task_set:
            pristine_tree(backend, task_set, task)
    times: dict[str, dict[str, list[float]]] = {v: {s: [] for s in STAGES} for v in backends}
    print(
        f"{args.trials} trials per variant on {len(task_set)} tasks; {platform.node()}, {os.cpu_count()} CPUs"
    )
    for i in range(args.trials):
        task = task_set.tasks[i % len(task_set)]
        for variant, backend in backends.items():
            started = time.monotonic()
            # The scripted agent receives its edit through the environment.
            out: TrialOutcome = run_local_trial(
                backend,
                task_set,
                task,
                f"{variant}-{i:03d}",
                ["/bin/sh", "-c", 'printf "%s" "$GOLD_PATCH" | git apply -'],
                env={"GOLD_PATCH": task.patch},
                agent_seconds=120,
                verify_seconds=300,
            )
            total = time.monotonic() - started
            if out.reward != 1.0:
                print(
                    f"trial {out.trial} on {task.instance_id}: {out.termination_reason}, reward {out.reward}"
                )
                print(out.error or out.agent_output[-2000:] or out.verify_output[-2000:])
                return 1
            for stage in STAGES[:-1]:
                times[variant][stage].append(out.stage_seconds.get(stage, 0.0))
            times[variant]["total"].append(total)
        if (i + 1) % 10 == 0:
            print(f"  {i + 1}/{args.trials} trials done")
    print()
    header = (
        f"{'stage':<12}"
        + "".join(f"{v + ' p50':>17}{v + ' p95':>17}" for v in backends)
        + f"{'ratio p50':>12}"
    )
    print(header)
    for stage in STAGES:
        row = f"{stage:<12}"
        p50s = []
        for variant in backends:
            values = times[variant][stage]
            p50, p95 = quantile(values, 0.5), quantile(values, 0.95)
            p50s.append(p50)
            row += f"{p50 * 1000:>14.1f} ms{p95 * 1000:>14.1f} ms"
        ratio = p50s[0] / p50s[1] if p50s[1] > 0 else float("inf")
        row += f"{ratio:>11.2f}x" if p50s[1] > 0 else f"{'n/a':>12}"
        print(row)
    defended = statistics.fmean(times["defended"]["total"])
    undefended = statistics.fmean(times["undefended"]["total"])
    print(
        f"\nmean trial: defended {defended:.2f} s, undefended {undefended:.2f} s, "
        f"ratio {defended / undefended:.2f}x"
    )
    medians = {
        variant: {stage: quantile(v, 0.5) for stage, v in per_stage.items()}
        for variant, per_stage in times.items()
    }
    stages = {
        variant: {
            stage: {"p50": medians[variant][stage], "p95": quantile(v, 0.95), "seconds": v}
            for stage, v in per_stage.items()
        }
        for variant, per_stage in times.items()
    }
    report = {
        "benchmark": "sandbox_lifecycle",
        "command": f"python benchmarks/sandbox_lifecycle.py --trials {args.trials}",
        "git_commit": git_commit(),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "trials_per_variant": args.trials,
        "tasks": len(task_set),
        "stages": stages,
        "ratio_p50": {
            stage: medians["defended"][stage] / medians["undefended"][stage]
            for stage in STAGES
            if medians["undefended"][stage] > 0
        },
        "mean_trial_seconds": {"defended": defended, "undefended": undefended},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"results: {args.out}")
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

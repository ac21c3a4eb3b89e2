"""The whole local loop's throughput: trials per minute and where the time goes, Sync against Async.

Runs `legorl run` (in-process, `EmbeddedRun`) on the same workload — the same manifest, tasks and seed —
with `schedule.mode: Sync` (the baseline) and with `Async` (`maxStalenessSteps: 1`), `--repeats` times
each (default 3), interleaved in counterbalanced order (Sync Async, Async Sync, Sync Async, ...) so that a
drift of the machine over the session (page cache, harness start times) falls on both modes alike. Each run
has a fresh run store and its own vLLM. It prints for each run:

- wall time of the loop (engine start excluded) and trials per minute;
- the share of trial time per phase, summed over trials (they overlap): proxy start, sandbox setup, the
  agent stage split into model generation (the proxy's journaled turns: request to answer) and harness
  time (the rest: the harness's own start, its tool calls), and verify;
- the trainer's time per step (train) and the weight sync's, as shares of the loop's wall time, and how
  long the controller waited for the trainer with nothing to run;

then, per mode, the median and range of trials per minute over the repeats, and the Async/Sync ratio of
the medians — called a difference only where the two modes' ranges do not overlap. Usage:

    python benchmarks/loop_throughput.py [--model builtin://tiny-swe] [--steps 3] [--tasks-per-step 2]
        [--group-size 4] [--concurrency 4] [--repeats 3] [--out benchmarks/results/loop_throughput.json]
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from provenance import git_commit

from legorl.api.kinds import RLRun
from legorl.api.store import RunStore
from legorl.embedded.runner import EmbeddedRun
from legorl.proxy.journal import read_journal


def manifest(args: argparse.Namespace, mode: str) -> RLRun:
    schedule: dict[str, Any] = {"mode": mode, "maxConcurrentTrials": args.concurrency}
    if mode == "Async":
        schedule["maxStalenessSteps"] = 1
    return RLRun.model_validate(
        {
            "apiVersion": "legorl.dev/v1alpha1",
            "kind": "RLRun",
            "metadata": {"name": f"bench-{mode.lower()}"},
            "spec": {
                "policy": {"checkpoint": {"uri": args.model}},
                "fleet": {
                    "parallelism": {"gpusPerNode": 0},
                    "settings": {
                        "dtype": "float32",
                        "routedExpertsCapture": "Disabled",
                        "toolCallParser": "hermes",
                        "maxModelLen": 4096,
                    },
                },
                "pool": {"source": {"taskSet": {"uri": "builtin://tiny-python"}}},
                "harness": {"kind": "MiniSweAgent", "maxTurns": 4},
                "tasks": {
                    "source": {"uri": "builtin://tiny-python"},
                    "split": {"heldOutPercent": 0},
                    "seed": 5,
                },
                "algorithm": {
                    "groupSize": args.group_size,
                    "tasksPerStep": args.tasks_per_step,
                    "learningRate": "1e-4",
                    "sampling": {"maxTokensPerTurn": 256},
                },
                "filter": {"zeroVarianceGroups": "Keep"},
                "schedule": schedule,
                "trainer": {"parallelism": {"gpusPerNode": 0}, "dtype": "float32"},
                "stop": {"maxSteps": args.steps},
                "evaluation": {"atStart": "Disabled", "intervalSteps": 1000},
            },
        }
    )


def generation_seconds(journals: Path) -> dict[str, float]:
    """Per trial: the summed time of its model calls, from the proxy's journal."""
    out: dict[str, float] = {}
    for folder in journals.iterdir():
        total = 0.0
        for record in read_journal(folder).records:
            if record.get("type") == "turn":
                total += (
                    (_time(record["ended_at"]) - _time(record["started_at"])) if "ended_at" in record else 0.0
                )
        out[folder.name] = total
    return out


def _time(value: Any) -> float:
    from datetime import datetime  # noqa: PLC0415

    return datetime.fromisoformat(value).timestamp() if isinstance(value, str) else float(value)


def measure(args: argparse.Namespace, mode: str, root: Path) -> dict[str, Any]:
    run = manifest(args, mode)
    out = io.StringIO()
    embedded = EmbeddedRun(run, root=root / mode, out=out)
    code = embedded.run()
    if code != 0:
        sys.stderr.write(out.getvalue()[-4000:])
        raise SystemExit(f"{mode} run failed ({code})")
    assert embedded.controller is not None
    progress = embedded.controller.progress
    store = RunStore(str(root / mode / "store"))
    trials = [t for s in store.committed_steps() for t in store.read_batch(s).trials]
    gen = generation_seconds(root / mode / "work" / "journals")
    phases: dict[str, float] = {
        "proxy_start": 0.0,
        "setup": 0.0,
        "generation": 0.0,
        "harness": 0.0,
        "verify": 0.0,
    }
    for t in trials:
        st = t.stage_seconds
        g = min(gen.get(t.trial, 0.0), st.get("agent", 0.0))
        phases["proxy_start"] += st.get("proxy_start", 0.0)
        phases["setup"] += st.get("setup", 0.0) + st.get("agent_start", 0.0)
        phases["generation"] += g
        phases["harness"] += st.get("agent", 0.0) - g
        phases["verify"] += st.get("verify", 0.0)
    total = sum(phases.values()) or 1.0
    metrics = store.read_metrics()
    train = sum(float(m.get("step_seconds") or 0.0) for m in metrics)
    sync = sum(float(m.get("sync_seconds") or 0.0) for m in metrics)
    wall = progress.elapsed_seconds
    return {
        "mode": mode,
        "trials": len(trials),
        "loop_seconds": wall,
        "trials_per_minute": 60.0 * len(trials) / wall,
        "trial_time_share": {k: v / total for k, v in phases.items()},
        "trial_seconds_mean": {k: v / max(len(trials), 1) for k, v in phases.items()},
        "train_share_of_wall": train / wall,
        "sync_share_of_wall": sync / wall,
        "waiting_for_trainer_share_of_wall": progress.phase_seconds.get("wait_trainer", 0.0) / wall,
        "by_reason": progress.by_reason,
    }


MODES = ("Sync", "Async")


def run_order(repeats: int) -> list[tuple[int, str]]:
    """(repeat, mode) in counterbalanced order: Sync Async, Async Sync, Sync Async, ..."""
    order: list[tuple[int, str]] = []
    for i in range(repeats):
        order += [(i, m) for m in (MODES if i % 2 == 0 else tuple(reversed(MODES)))]
    return order


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per mode: median and range of trials per minute (and of the harness's mean seconds per trial,
    the phase that dominates a trial); the Async/Sync ratio of medians, and whether the two modes'
    ranges are apart (only then is the ratio a difference rather than run-to-run spread)."""
    per_mode: dict[str, Any] = {}
    for mode in MODES:
        rates = [r["trials_per_minute"] for r in results if r["mode"] == mode]
        harness = [r["trial_seconds_mean"]["harness"] for r in results if r["mode"] == mode]
        per_mode[mode] = {
            "trials_per_minute": rates,
            "median": statistics.median(rates),
            "min": min(rates),
            "max": max(rates),
            "harness_seconds_per_trial": harness,
        }
    sync, asynchronous = per_mode["Sync"], per_mode["Async"]
    apart = asynchronous["min"] > sync["max"] or sync["min"] > asynchronous["max"]
    return {
        "per_mode": per_mode,
        "async_over_sync_median": asynchronous["median"] / sync["median"],
        "ranges_apart": apart,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="builtin://tiny-swe")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tasks-per-step", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/loop_throughput.json")
    args = parser.parse_args()
    if args.repeats < 2:
        parser.error("--repeats must be at least 2: one run per mode has no spread to compare against")
    results = []
    with tempfile.TemporaryDirectory(prefix="loop-bench-") as tmp:
        for repeat, mode in run_order(args.repeats):
            started = time.monotonic()
            result = measure(args, mode, Path(tmp) / f"{mode}-{repeat}")
            result["repeat"] = repeat
            result["total_seconds_with_engine_start"] = time.monotonic() - started
            results.append(result)
            print(json.dumps(result, indent=1), flush=True)
    summary = summarize(results)
    print(
        f"\n{'mode':<6} {'run':>3} {'trials':>6} {'loop s':>7} {'trials/min':>10}  phase shares of trial time"
    )
    for r in results:
        shares = ", ".join(f"{k} {v:.0%}" for k, v in r["trial_time_share"].items())
        print(
            f"{r['mode']:<6} {r['repeat']:>3} {r['trials']:>6} {r['loop_seconds']:>7.0f} "
            f"{r['trials_per_minute']:>10.2f}  {shares}"
        )
        print(
            f"{'':<10} train {r['train_share_of_wall']:.1%} of wall, sync {r['sync_share_of_wall']:.1%}, "
            f"controller idle waiting for the trainer {r['waiting_for_trainer_share_of_wall']:.1%}"
        )
    for mode, m in summary["per_mode"].items():
        print(f"{mode}: trials/min median {m['median']:.2f} (range {m['min']:.2f}-{m['max']:.2f})")
    ratio = summary["async_over_sync_median"]
    if summary["ranges_apart"]:
        print(f"Async/Sync trials per minute (medians): {ratio:.2f}x, beyond the run-to-run spread")
    else:
        print(f"Async/Sync medians {ratio:.2f}x, within the run-to-run spread: no difference shown")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps({"args": vars(args), "git_commit": git_commit(), "results": results, **summary}, indent=1)
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""An RLRun on the real node against the same run on the embedded default: start, pods, throughput, sync.

The node run is tests/e2e/test_node_run.py's (`run_on_node`: the contained one-node Kubernetes 1.20 cluster,
the chart installed, `kubectl apply` of an RLRun of builtin://tiny-swe on two bundled tiny-python tasks with
MiniSweAgent, GRPO 2 tasks × 4 trials per step, 2 steps, Sync, its next 4 trials kept warm), and the same
run with no warm trials (`node-cold`: every trial pod starts when its trial is launched). The baseline is the
same RLRun run by `legorl run` (`EmbeddedRun`: local sandboxes, vLLM and the trainer as processes of this
machine) on the same two tasks, model, harness settings and seed. The three alternate (`--repeats` times
each, the order reversed every repeat) so that a drift of the machine falls on all. Per run it records:

- `apply_to_first_agent_seconds`: from `kubectl apply` (the node) or the run's start (embedded) to the first
  trial's agent running (the trial's launch plus its setup stage);
- `trial_start_seconds` p50 / p95 over the run's cold trials: a trial pod's `status.startTime` to its agent
  container running (init containers: tools, harness runtime, workspace setup, egress lock; then the proxy's
  start), the embedded sandbox's setup stage for the baseline;
- `warm_claim_seconds` p50 / p95 over the trials launched by claiming a warm pod (`schedule.warmTrials`:
  the node's run keeps the next 4 trials ready): from the operator's `launch` to the pod's proxy answering
  that the agent has its `go` (`POST /claim`; the agent's `read` on the FIFO returns as the proxy writes);
  a warm pod not ready at its launch counts as a cold start from its claim;
- `pod_stages`: where a trial pod's start goes, per container (from the pod statuses the kubelet wrote):
  seconds from the pod's `startTime` to the container's start, and the init containers' run time, median
  over the cold pods and over the warm ones;
- `trials_per_minute`: trials over the span from the first launch to the last trial's end;
- `sync_seconds` per step: the trainer's weight sync into the running engine (Filesystem: publish, then
  vLLM's pause → update_weights → resume), from the trainer's step figures in the run store.

    python benchmarks/node_run.py [--repeats 1] [--out benchmarks/results/node_run.json]
    python benchmarks/node_run.py --faults [--out benchmarks/results/node_faults.json]

`--faults` runs the node's RLRun once with tests/support/node_faults.py's faults injected while it trains (a
trial
pod deleted, the operator and the trainer killed with SIGKILL, the kubelet restarted, the fleet pod deleted)
and writes the fault table: per fault, when it came, what happened, and from the run store `lost`,
`duplicated` and `orphaned`.

Needs what tests/e2e/test_node_run.py needs (scripts/get-kube.sh, scripts/get-node.sh,
scripts/build-images.sh,
scripts/get-helm.sh, root). Writes the results file; README and docs/real-node.md copy figures from it.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from datetime import datetime
from pathlib import Path
from typing import Any

from provenance import git_commit

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from legorl.api.kinds import RLRun  # noqa: E402
from legorl.api.store import RunStore  # noqa: E402
from tests.e2e import test_node_run as node_run  # noqa: E402


def _time(value: Any) -> float:
    return (
        value.timestamp() if isinstance(value, datetime) else datetime.fromisoformat(str(value)).timestamp()
    )


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def _spread(values: list[float], digits: int) -> dict[str, Any]:
    """p50, p95, min, max and n of VALUES, rounded to DIGITS."""
    return {
        "p50": round(statistics.median(values), digits),
        "p95": round(_quantile(values, 0.95), digits),
        "min": round(min(values), digits),
        "max": round(max(values), digits),
        "n": len(values),
    }


def figures(store: RunStore, records: list[dict[str, Any]], started: float) -> dict[str, Any]:
    """What one run measured, from its trial records and the trainer's step figures."""
    train = [r for r in records if r["split"] == "train"]
    stages = [{s["stage"]: s["seconds"] for s in r["stage_seconds"]} for r in train]
    setup = [s["setup"] for s in stages if "setup" in s and "claim" not in s]
    claims = [s["claim"] for s in stages if "claim" in s]
    agent_at = [_time(r["started_at"]) + s.get("setup", 0.0) for r, s in zip(train, stages, strict=True)]
    first = min(_time(r["started_at"]) for r in train)
    last = max(_time(r["ended_at"]) for r in train)
    return {
        "trials": len(train),
        "by_reason": dict(sorted(Counter(r["termination_reason"] for r in train).items())),
        "apply_to_first_agent_seconds": round(min(agent_at) - started, 1),
        "trial_start_seconds": _spread(setup, 1),
        "warm_claim_seconds": _spread(claims, 4) if claims else None,
        "trials_per_minute": round(60.0 * len(train) / (last - first), 2),
        "sync_seconds": {f.step: round(f.sync_seconds, 2) for f in store.step_figures() if f.sync_seconds},
        "published": store.published_versions(),
    }


INIT_STAGES = ("tools", "harness-runtime", "setup", "egress-lock")


def pod_stages(trained: Any) -> dict[str, Any]:
    """Where a trial pod's start goes: per container, seconds from the pod's `startTime` to the container's
    start and the init containers' run time, median over the cold pods and over the warm ones (made ahead,
    while the trials before them ran), from the pod statuses the kubelet wrote (`kubectl get pods -w`)."""
    last: dict[str, dict[str, Any]] = {}
    for pod in node_run.watched_pods(trained):
        name = pod["metadata"]["name"]
        trial = name.startswith(f"{node_run.RUN}-s") and not name.endswith("-verify")
        if trial and (pod.get("status") or {}).get("containerStatuses"):
            last[name] = pod
    by_kind: dict[str, dict[str, list[tuple[float, float | None]]]] = {"cold": {}, "warm": {}}
    for pod in last.values():
        status = pod["status"]
        start = _time(status["startTime"])
        kind = "warm" if pod["metadata"]["labels"].get("legorl.dev/warm") else "cold"
        for c in (status.get("initContainerStatuses") or []) + status["containerStatuses"]:
            state = c.get("state") or {}
            term = state.get("terminated") or (c.get("lastState") or {}).get("terminated")
            began = (term or state.get("running") or {}).get("startedAt")
            if began:
                ran = _time(term["finishedAt"]) - _time(began) if term and term.get("finishedAt") else None
                by_kind[kind].setdefault(c["name"], []).append((_time(began) - start, ran))
    out: dict[str, Any] = {}
    for kind, containers in by_kind.items():
        out[kind] = {
            name: {
                "started_after_seconds": round(statistics.median(s for s, _ in values), 1),
                **(
                    {"ran_seconds": round(statistics.median(r for _, r in values if r is not None), 1)}
                    if name in INIT_STAGES and any(r is not None for _, r in values)
                    else {}
                ),
                "pods": len(values),
            }
            for name, values in containers.items()
        }
    return out


def on_node(root: Path, helm: str, warm_trials: int | None = None) -> dict[str, Any]:
    with node_run.run_on_node(root, helm, warm_trials=warm_trials) as trained:
        succeeded = trained.condition("Succeeded")
        if not succeeded or succeeded["status"] != "True":
            raise SystemExit(f"the node's run did not succeed:\n{trained.diagnose()}")
        out = figures(RunStore(str(trained.store)), trained.records(), trained.applied_at)
        out["pod_stages"] = pod_stages(trained)
        out["node_start"] = {k: round(v, 1) for k, v in trained.node.timings.items() if k != "stop"}
        out["node_ready_to_apply_seconds"] = round(trained.timings["node_to_applied"], 1)
        out["apply_to_succeeded_seconds"] = round(trained.timings["apply_to_end"], 1)
        return out


def embedded(root: Path) -> dict[str, Any]:
    """The same RLRun on the embedded default: the same model, tasks (a file:// set of the same rows, their
    repositories from the bundled set), harness settings (the embedded default gives mini.yaml itself),
    algorithm, schedule and seed."""
    from legorl.embedded.runner import EmbeddedRun  # noqa: PLC0415
    from legorl.sandbox.bundled import builtin_task_set  # noqa: PLC0415

    manifest = builtin_task_set()
    tasks = manifest.parent.parent / "node-run-tasks"  # beside the bundled set, as `legorl tasks` keeps sets
    shutil.rmtree(tasks, ignore_errors=True)
    tasks.mkdir(parents=True)
    rows = node_run.task_rows()
    (tasks / "tasks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for row in rows:  # each row's repository (a git bundle), copied: the sandbox binds real paths only
        (tasks / row["source"]).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(manifest.parent / row["source"], tasks / row["source"])
    spec = json.loads(json.dumps(node_run.RLRUN["spec"]))
    spec["policy"]["checkpoint"]["uri"] = "builtin://tiny-swe"
    spec["pool"] = {"source": {"taskSet": {"uri": f"file://{tasks / 'tasks.jsonl'}"}}}
    spec["tasks"]["source"]["uri"] = f"file://{tasks / 'tasks.jsonl'}"
    spec["harness"].pop("configMapRef")
    spec.pop("store")
    run = RLRun.model_validate(
        {
            "apiVersion": "legorl.dev/v1alpha1",
            "kind": "RLRun",
            "metadata": {"name": "tiny-embedded"},
            "spec": spec,
        }
    )
    out = io.StringIO()
    started = time.time()
    wall = time.monotonic()
    code = EmbeddedRun(run, root=root / "run", out=out).run()
    if code != 0:
        sys.stderr.write(out.getvalue()[-4000:])
        raise SystemExit(f"the embedded run failed ({code})")
    store_dir = root / "run" / "store"
    result = figures(RunStore(str(store_dir)), node_run.read_records(store_dir), started)
    result["start_to_end_seconds"] = round(time.monotonic() - wall, 1)
    return result


def with_faults(root: Path, helm: str) -> dict[str, Any]:
    """The node's run with the faults injected, and what each did."""
    with node_run.run_on_node(root, helm, faults=True) as trained:
        ended = node_run.ended(trained) or {}
        report = node_run.fault_report(trained)
        status = trained.run().get("status") or {}
        return {
            "ended": {"type": "Succeeded" if trained.condition("Succeeded") == ended else "Failed", **ended},
            "step": status.get("step"),
            "policy_version": status.get("policyVersion"),
            "apply_to_end_seconds": round(trained.timings["apply_to_end"], 1),
            "trials_by_reason": dict(Counter(r["termination_reason"] for r in trained.records())),
            "faults": report.table(),
        }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--out", default="benchmarks/results/node_run.json")
    parser.add_argument("--helm", default=str(REPO / ".cache/tools/bin/helm"))
    parser.add_argument("--faults", action="store_true", help="one node run with faults injected")
    args = parser.parse_args()
    if os.geteuid() != 0:
        parser.error("the node needs root")
    if args.faults:
        out = args.out if args.out != parser.get_default("out") else "benchmarks/results/node_faults.json"
        root = Path(tempfile.mkdtemp(prefix="legorl-bench-faults-"))
        try:
            result = with_faults(root, args.helm)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        result = {
            "what": "the node's RLRun (as benchmarks/node_run.py) with faults injected while it trains "
            "(tests/support/node_faults.py)",
            "command": "python benchmarks/node_run.py --faults",
            "commit": git_commit(),
            "machine": f"{os.cpu_count()} CPUs, {platform.machine()}",
            **result,
        }
        Path(out).write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps(result["faults"], indent=1))
        print(f"wrote {out}")
        return 0
    runs: list[dict[str, Any]] = []
    for i in range(args.repeats):
        order = ("node", "node-cold", "embedded")
        for where in order if i % 2 == 0 else order[::-1]:
            root = Path(tempfile.mkdtemp(prefix=f"legorl-bench-{where}-"))
            try:
                if where == "embedded":
                    result = embedded(root)
                else:  # the node's run as the test runs it, and with no warm trials
                    result = on_node(root, args.helm, warm_trials=0 if where == "node-cold" else None)
            finally:
                shutil.rmtree(root, ignore_errors=True)
            result.update(where=where, repeat=i)
            print(json.dumps(result), flush=True)
            runs.append(result)
    data = {
        "what": "one RLRun (builtin://tiny-swe, 2 bundled tasks, MiniSweAgent, GRPO 2 tasks x 4 trials, "
        "2 steps, Sync) on the contained real node (Kubernetes 1.20, dockershim) and on the embedded default",
        "command": "python benchmarks/node_run.py"
        + (f" --repeats {args.repeats}" if args.repeats != 1 else ""),
        "commit": git_commit(),
        "machine": f"{os.cpu_count()} CPUs, {platform.machine()}",
        "warm_pool": "`node` keeps its next 4 trials ready (schedule.warmTrials: 4), `node-cold` is the "
        "same run with warmTrials 0; warm_claim_seconds is launch -> the agent's go for those claimed "
        "ready, trial_start_seconds the cold starts (and warm pods not ready at their launch, from the "
        "claim); pod_stages says where a pod's start goes",
        "runs": runs,
    }
    Path(args.out).write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

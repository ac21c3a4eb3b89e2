"""An RLRun trains on the real node: `helm install`, `kubectl apply`, every pod of the loop run by a kubelet.

tests/support/kubenode.py starts the contained one-node cluster (tests/e2e/test_real_node.py shows what it
is) and the
chart is installed as tests/e2e/test_node_operator.py does. Then, as a user would:

- the run store is a PersistentVolumeClaim `legorl-store` (ReadWriteMany) in the run's namespace and one of
  the same name in the release's, both bound to one folder of this machine (hostPath PersistentVolumes stand
  in for NFS-like storage); the chart mounts its claim into the operator and the UI (`storeClaims`);
- the policy, `builtin://tiny-swe` as `legorl sft` makes it, is copied onto a PersistentVolume (`models`)
  and named `pvc://models/tiny-swe`;
- the task set is a ConfigMap of the first two bundled tiny-python rows (their task images are built by
  scripts/build-images.sh);
- the harness settings the policy was warm-started with (legorl/controller/harness/mini.yaml: short prompts
  that fit its 2048-token context) are a ConfigMap named by `harness.configMapRef`, as `legorl run` passes
  them to the harness itself;
- `kubectl apply` an RLRun: MiniSweAgent, GRPO with 2 tasks × 4 trials per step, 2 steps, Sync.

The kubelet runs the fleet's vLLM pod (legorl's engine image, CPU build), the pool's pre-pull DaemonSet,
each trial pod (init containers tools, harness-runtime, setup, egress-lock; the proxy; the agent; hold),
each verify pod and the trainer Job's pod (megatron-core on CPU), which publishes v1 and v2 into the store
and loads them into the running engine.

While it trains, tests/support/node_faults.py injects faults, each at its moment: a trial pod deleted while
its agent
works, the operator's and the trainer's processes killed with SIGKILL, the kubelet restarted, the fleet's pod
deleted. The run must still succeed, and the store must show no acknowledged turn lost, no trial counted
twice and nothing of a trial left (`test_the_run_survived_the_faults_and_lost_nothing`).

What is test infrastructure here (docs/real-node.md): the node is Kubernetes 1.20, so pods reach the API
through tests/kube120's Downgrade, which also plays the two 1.21+/1.28+ features the operator renders for:
the trainer's Indexed Job (its pod's index annotation and hostname) and the proxy as a native sidecar (the
first regular container, the others started after its port opened). dnsmasq stands in for CoreDNS.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from legorl.api.labels import POLICY_VERSION_ANNOTATION
from legorl.controller.harness import CONFIG_DIR
from tests.e2e.test_node_operator import (
    FULLNAME,
    RELEASE,
    RELEASE_NS,
    Release,
    chart_for_120,
    helm_cmd,
    install_crds_for_120,
)
from tests.support.kubenode import Node, kubectl_binary, node, skip_unless_node_can_run
from tests.support.node_faults import Fault, FaultDriver

ENGINE = "ghcr.io/legorl/engine:0.1.0"
TRAINER = "ghcr.io/legorl/trainer:0.1.0"
OPERATOR = "ghcr.io/legorl/operator:0.1.0"
PROXY = "ghcr.io/legorl/proxy:0.1.0"
INIT = "ghcr.io/legorl/sandbox-init:0.1.0"
HARNESS = "ghcr.io/legorl/harness-mini-swe-agent:0.1.0"
TASKS = 2
"""The first bundled tasks, whose images scripts/build-images.sh builds (TASK_IMAGES there)."""
NS = "runs"
RUN = "tiny-node"
STEPS, GROUP, TASKS_PER_STEP = 2, 4, 2
RUN_TIMEOUT = 1500.0

skip_unless_node_can_run([ENGINE, TRAINER, OPERATOR, PROXY, INIT, HARNESS])

pytestmark = pytest.mark.slow


def task_rows() -> list[dict[str, Any]]:
    """The bundled tiny-python rows the run trains on (the set is generated as `legorl run` does)."""
    from legorl.sandbox.bundled import builtin_task_set  # noqa: PLC0415 - the manifest, generated once

    lines = builtin_task_set().read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines[:TASKS]]


def policy_checkpoint() -> Path:
    """builtin://tiny-swe, made by `legorl sft` on first use (cached)."""
    from legorl.trainer.warmstart.sft import ensure_tiny_swe  # noqa: PLC0415 - torch: only when this module runs

    return ensure_tiny_swe()


def read_records(run_dir: Path) -> list[dict[str, Any]]:
    """Every trial record in a run's store folder (the trials' Parquet files)."""
    paths = sorted(run_dir.glob("trials/*/*/*.parquet"))
    return [row for path in paths for row in pq.read_table(path).to_pylist()]


RLRUN: dict[str, Any] = {
    "apiVersion": "legorl.dev/v1alpha1",
    "kind": "RLRun",
    "metadata": {"name": RUN, "namespace": NS},
    "spec": {
        "policy": {"checkpoint": {"uri": "pvc://models/tiny-swe"}},
        "fleet": {
            "replicas": 1,
            "parallelism": {"gpusPerNode": 0},
            "settings": {
                "dtype": "float32",
                "routedExpertsCapture": "Disabled",
                "toolCallParser": "hermes",
                "maxModelLen": 2048,
            },
        },
        "pool": {
            "source": {"taskSet": {"uri": "configmap://tiny-python/tasks.jsonl"}},
            # The node's pause image: the default is pulled from registry.k8s.io, which no pod here reaches.
            "prePull": {"pauseImage": "k8s.gcr.io/pause:3.2"},
            "deadlines": {"agentSeconds": 300, "verifySeconds": 180},
        },
        # The prompts the tiny policy was warm-started on (legorl run gives them to the harness itself).
        "harness": {"kind": "MiniSweAgent", "maxTurns": 4, "configMapRef": {"name": "tiny-harness"}},
        "tasks": {
            "source": {"uri": "configmap://tiny-python/tasks.jsonl"},
            "split": {"heldOutPercent": 0},
            "seed": 7,
            "epochs": 4,
        },
        "algorithm": {
            "name": "GRPO",
            "groupSize": GROUP,
            "tasksPerStep": TASKS_PER_STEP,
            "learningRate": "5e-4",
            "sampling": {"maxTokensPerTurn": 128},
        },
        # Four trials run at once; the next four wait ready (warm pods), claimed when they launch.
        "schedule": {"mode": "Sync", "maxConcurrentTrials": 4, "warmTrials": 4},
        "trainer": {"parallelism": {"gpusPerNode": 0}, "dtype": "float32"},
        "store": {"uri": "pvc://legorl-store"},
        "stop": {"maxSteps": STEPS},
        "evaluation": {"atStart": "Disabled", "intervalSteps": STEPS},
    },
}


def host_volume(name: str, path: Path, mode: str, namespace: str, claim: str) -> list[dict[str, Any]]:
    """A hostPath PersistentVolume pre-bound to the claim NAMESPACE/CLAIM, and that claim."""
    volume = {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": name},
        "spec": {
            "capacity": {"storage": "1Gi"},
            "accessModes": [mode],
            "storageClassName": "",
            "persistentVolumeReclaimPolicy": "Retain",
            "hostPath": {"path": str(path), "type": "Directory"},
            "claimRef": {"namespace": namespace, "name": claim},
        },
    }
    pvc = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": claim, "namespace": namespace},
        "spec": {
            "accessModes": [mode],
            "storageClassName": "",
            "volumeName": name,
            "resources": {"requests": {"storage": "1Gi"}},
        },
    }
    return [volume, pvc]


@dataclass
class TrainedRun:
    """The node after the run ended, and what was seen on the way."""

    node: Node
    store: Path
    """The run's folder in the store, on this machine (the PersistentVolume's folder)."""
    watches: dict[str, Path]
    """`kubectl get rlruns -n runs -w` and `... pods ...` as they printed while the run went."""
    timings: dict[str, float] = field(default_factory=dict)
    applied_at: float = 0.0
    """When the RLRun was applied (seconds since the epoch)."""
    faults: FaultDriver | None = None
    """The faults injected while it ran (`run_on_node(faults=True)`)."""

    def get(self, *args: str) -> Any:
        return self.node.get_json(*args)

    def run(self) -> dict[str, Any]:
        body: dict[str, Any] = self.get("rlrun", RUN, "-n", NS)
        return body

    def condition(self, type_: str) -> dict[str, Any] | None:
        conditions = (self.run().get("status") or {}).get("conditions") or []
        return next((c for c in conditions if c["type"] == type_), None)

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = self.get("events", "-n", NS)["items"]
        return [e for e in items if kind is None or e["involvedObject"]["kind"] == kind]

    def records(self) -> list[dict[str, Any]]:
        return read_records(self.store)

    def diagnose(self) -> str:
        k = self.node.kubectl
        parts = [
            k(
                "get", "rlruns,rolloutfleets,sandboxpools,pods,jobs", "-n", NS, "-o", "wide", check=False
            ).stdout,
            json.dumps((self.run().get("status") or {}).get("conditions"), indent=1),
            k("logs", "-n", RELEASE_NS, f"deployment/{FULLNAME}-operator", "--tail=60", check=False).stdout,
            k("logs", "-n", NS, f"job/{RUN}-trainer", "--tail=40", check=False).stdout,
            k("logs", "-n", NS, f"deployment/{RUN}-fleet-engine", "--tail=20", check=False).stdout,
            "\n".join(f"{e['reason']}: {e['message']}" for e in self.events()[-40:]),
        ]
        return "\n---\n".join(parts)

    def wait(self, predicate: Callable[[], Any], what: str, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(2)
        raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}\n{self.diagnose()}")


def _time(value: Any) -> float:
    """A record's timestamp (a datetime from Parquet, or its ISO text) as seconds since the epoch."""
    return (
        value.timestamp() if isinstance(value, datetime) else datetime.fromisoformat(str(value)).timestamp()
    )


def ended(trained: TrainedRun) -> dict[str, Any] | None:
    for type_ in ("Succeeded", "Failed"):
        cond = trained.condition(type_)
        if cond and cond["status"] == "True":
            return cond
    return None


@contextlib.contextmanager
def run_on_node(
    root: Path, helm: str, *, faults: bool = False, warm_trials: int | None = None
) -> Iterator[TrainedRun]:
    """The node started in ROOT, the chart installed, the run's volumes, ConfigMaps and RLRun applied; yields
    once the run has ended (Succeeded or Failed), then stops the node. FAULTS: tests/support/node_faults.py
    injects
    its faults while the run goes. WARM_TRIALS: the run's `schedule.warmTrials` instead of RLRUN's. Also
    used by benchmarks/node_run.py."""
    rlrun = json.loads(json.dumps(RLRUN))
    if warm_trials is not None:
        rlrun["spec"]["schedule"]["warmTrials"] = warm_trials
    store = root / "store"
    store.mkdir()
    os.chown(store, 65532, 65532)  # the operator's and the trainer's uid write it (fsGroup does not apply)
    models = root / "models"
    shutil.copytree(policy_checkpoint(), models / "tiny-swe")
    for path in (models, *models.rglob("*")):
        path.chmod(0o755 if path.is_dir() else 0o644)
    rows = task_rows()
    with node(root / "node", api_downgrade=True) as cluster:
        started = time.monotonic()
        install_crds_for_120(cluster)
        for ns in (RELEASE_NS, NS):
            cluster.create_namespace(ns)
        objects = [
            *host_volume("store-system", store, "ReadWriteMany", RELEASE_NS, "legorl-store"),
            *host_volume("store-runs", store, "ReadWriteMany", NS, "legorl-store"),
            *host_volume("models-runs", models, "ReadOnlyMany", NS, "models"),
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": "tiny-python", "namespace": NS},
                "data": {"tasks.jsonl": "".join(json.dumps(r) + "\n" for r in rows)},
            },
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": "tiny-harness", "namespace": NS},
                "data": {"mini.yaml": (CONFIG_DIR / "mini.yaml").read_text(encoding="utf-8")},
            },
        ]
        cluster.kubectl(
            "apply", "-f", "-", stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": objects})
        )
        chart = root / "chart"
        chart.mkdir()
        helm_cmd(
            cluster, helm, "install", RELEASE, str(chart_for_120(chart)), "--namespace", RELEASE_NS,
            "--skip-crds", "--set", "ui.enabled=true", "--set", "storeClaims={legorl-store}",
        )  # fmt: skip
        # `kubectl apply` once the operator runs: what follows measures the run, not the operator's start.
        release = Release(cluster)
        release.wait(lambda: release.ready_pod("operator"), "the operator pod Ready")
        # `kubectl get rlruns,pods -w`, as two watches: this kubectl watches one resource type at a time.
        # And the pods' statuses as JSON: which containers the kubelet ran (see `_started`).
        watches = {kind: root / f"watch-{kind}.txt" for kind in ("rlruns", "pods")}
        watches["pods-json"] = root / "watch-pods.json"
        with contextlib.ExitStack() as stack:
            for kind, path in watches.items():
                out = stack.enter_context(path.open("w"))
                resource, _, output = kind.partition("-")
                argv = [kubectl_binary(), f"--kubeconfig={cluster.kubeconfig()}", "get", resource]
                argv += ["-n", NS, "-w", *(["-o", output] if output else [])]
                watcher = subprocess.Popen(cluster.inside(*argv), stdout=out, stderr=subprocess.STDOUT)
                stack.callback(watcher.wait, timeout=10)
                stack.callback(watcher.terminate)
            trained = TrainedRun(cluster, store / NS / RUN, watches)
            trained.timings["node_to_applied"] = time.monotonic() - started
            start = time.monotonic()
            trained.applied_at = time.time()
            cluster.kubectl("apply", "-f", "-", stdin=json.dumps(rlrun))
            if faults:
                trained.faults = FaultDriver(
                    cluster, namespace=NS, run=RUN, release_namespace=RELEASE_NS, store=trained.store,
                    records=trained.records, started=trained.applied_at,
                )  # fmt: skip
                trained.faults.start()
                stack.callback(trained.faults.join, 60)
                stack.callback(trained.faults.stop.set)

            def over() -> dict[str, Any] | None:
                if trained.faults is not None:
                    trained.faults.check()  # a failing fault driver fails the run's wait
                return ended(trained)

            trained.wait(over, "the run to end", RUN_TIMEOUT)
            trained.timings["apply_to_end"] = time.monotonic() - start
            if trained.faults is not None:
                trained.faults.stop.set()
                trained.faults.join(60)
            yield trained


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, helm: str) -> Iterator[TrainedRun]:
    with run_on_node(tmp_path_factory.mktemp("node-run"), helm, faults=True) as run:
        yield run


def test_the_run_succeeds_after_two_grpo_steps_of_eight_trials(trained: TrainedRun) -> None:
    print(f"kubectl apply -> run ended: {trained.timings['apply_to_end']:.0f} s")
    succeeded = trained.condition("Succeeded")
    assert succeeded and succeeded["status"] == "True", trained.diagnose()
    status = trained.run()["status"]
    assert status["step"] == STEPS and status["policyVersion"] == f"v{STEPS}", status
    records = trained.records()
    by_step = Counter(r["step"] for r in records if r["split"] == "train")
    assert by_step == {step: GROUP * TASKS_PER_STEP for step in range(1, STEPS + 1)}, by_step
    reasons = Counter(r["termination_reason"] for r in records)
    print(f"trials by termination reason: {dict(reasons)}")
    # Each trial ran in a real pod: the proxy journalled the agent's model calls, the verify pod graded it.
    completed = [r for r in records if r["termination_reason"] == "completed"]
    assert completed, reasons
    assert all(r["num_turns"] > 0 and r["segments"] for r in completed)
    assert all(r["reward"] is not None for r in completed)
    # Warm pods: made ready while the trials before them ran (and step 1 trained), claimed at launch.
    claims = sorted(s["seconds"] for r in records for s in r["stage_seconds"] if s["stage"] == "claim")
    print(f"warm claims (launch -> the agent's go), seconds: {claims}")
    assert len(claims) >= GROUP, claims


def watched_pods(trained: TrainedRun) -> Iterator[dict[str, Any]]:
    """Every pod object `kubectl get pods -w -o json` printed while the run went, in order."""
    text = trained.watches["pods-json"].read_text()
    decoder, at = json.JSONDecoder(), 0
    while (at := _skip_space(text, at)) < len(text):
        pod, at = decoder.raw_decode(text, at)
        yield pod


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at


def _started(trained: TrainedRun, pod_suffix: str = "") -> dict[str, set[str]]:
    """Pod name → the containers the kubelet started, for pods whose name ends so.

    Two witnesses, both the kubelet's: its `Started` Events and the container states in the pod statuses it
    wrote (running or terminated, seen by a watch). Events alone are not enough: the kubelet sends them
    from a queue, and a kubelet stopped mid-flight (the kubelet-restart fault) drops what it had queued, as
    the 2026-12-07 CI run showed (a trial whose agent ran and was graded had no `Started` Event for it)."""
    started: dict[str, set[str]] = {}
    for e in trained.events():
        obj = e["involvedObject"]
        if obj["kind"] == "Pod" and e["reason"] == "Started" and obj["name"].endswith(pod_suffix):
            container = e["message"].removeprefix("Started container ")
            started.setdefault(obj["name"], set()).add(container)
    for pod in watched_pods(trained):
        name = pod["metadata"]["name"]
        status = pod.get("status") or {}
        for c in (status.get("initContainerStatuses") or []) + (status.get("containerStatuses") or []):
            states = (c.get("state") or {}, c.get("lastState") or {})
            if name.endswith(pod_suffix) and any("running" in s or "terminated" in s for s in states):
                started.setdefault(name, set()).add(c["name"])
    return started


def test_every_trial_and_verify_pod_ran_its_stages_on_the_kubelet(trained: TrainedRun) -> None:
    trials = {
        name: containers
        for name, containers in _started(trained).items()
        if name.startswith(f"{RUN}-s") and not name.endswith("-verify")
    }
    verifies = _started(trained, "-verify")
    records = trained.records()
    assert len(trials) == len(records), sorted(trials)
    for name, containers in trials.items():
        # The setup stages, the egress lock, the proxy beside the agent, and `hold` keeping the proxy.
        assert {"tools", "harness-runtime", "setup", "egress-lock", "proxy", "agent", "hold"} <= containers, (
            name,
            containers,
        )
    graded = [r for r in records if r["reward"] is not None]
    # Each graded trial had its verify pod: the task image, pristine, running the hidden tests.
    assert len(verifies) >= len(graded) > 0, (sorted(verifies), len(graded))
    assert all("verify" in containers for containers in verifies.values()), verifies

    # No trial pod, verify pod or trial ConfigMap is left once the run is over (the last ones are being
    # deleted as it ends).
    def left() -> list[str]:
        items = trained.get("pods,configmaps", "-n", NS)["items"]
        return [i["metadata"]["name"] for i in items if i["metadata"]["name"].startswith(f"{RUN}-s")]

    trained.wait(lambda: not left(), "the trials' objects to be deleted", 120)


def test_the_trainer_published_each_version_and_the_fleet_pod_took_them_without_a_restart(
    trained: TrainedRun,
) -> None:
    from legorl.api.store import RunStore  # noqa: PLC0415

    store = RunStore(str(trained.store))
    assert store.published_versions() == [f"v{step}" for step in range(1, STEPS + 1)]
    figures = {f.step: f for f in store.step_figures()}
    assert sorted(figures) == list(range(1, STEPS + 1))
    syncs = {step: f.sync_seconds for step, f in figures.items()}
    print(f"weight sync seconds by step: {syncs}")
    assert all(s is not None and s > 0 for s in syncs.values()), syncs
    # Rollout vs training token probabilities agree at every step, step 1 included: its trials record the
    # engine's startup weights as v0, the version trained then (fp32 engine and trainer on CPU).
    fidelity = {step: (f.fidelity_pearson, f.fidelity_tokens) for step, f in figures.items()}
    print(f"fidelity (Pearson, tokens) by step: {fidelity}")
    kept = ("trials_total", "trials_kept", "dropped_stale", "zero_variance_groups", "fidelity_probe_trials")
    print(f"filter by step: { {step: {k: getattr(f, k) for k in kept} for step, f in figures.items()} }")
    assert all(p is not None and p >= 0.99 and (n or 0) > 0 for p, n in fidelity.values()), fidelity
    # Trials of step 2 were served by v1 (Sync mode: the engine swapped in place between the steps), but
    # those that called the fleet's new pod (a fault deleted the first) before the trainer gave it v1: they
    # saw its startup weights, v0, ended after the fault, and were dropped as stale.
    restart = faults_of(trained)["fleet pod restart"]
    assert restart.at is not None
    step_records = [r for r in trained.records() if r["num_turns"] and r["step"] == STEPS]
    seen = {r["trial"]: set(r["policy_versions"]) for r in step_records}
    print(f"step {STEPS} trials by the versions that served them: {seen}")
    assert all(v <= {"v0", f"v{STEPS - 1}"} for v in seen.values()), seen
    on_v0 = [r for r in step_records if "v0" in r["policy_versions"]]
    assert all(_time(r["ended_at"]) > trained.applied_at + restart.at for r in on_v0), on_v0
    assert figures[STEPS].dropped_stale == len(on_v0), (figures[STEPS].dropped_stale, seen)
    # The engine pod took every sync in place: vllm started once in each pod (the second one is the fault's).
    engine = {n: c for n, c in _started(trained).items() if n.startswith(f"{RUN}-fleet-engine-")}
    starts = [
        e for e in trained.events() if e["involvedObject"]["name"] in engine and e["reason"] == "Started"
    ]
    assert len(engine) == 2 and [e.get("count", 1) for e in starts] == [1, 1], starts
    # The fleet's status followed the syncs: the operator asked the engine pod what it serves and recorded
    # each version on it (the trainer syncs over HTTP and changes no Kubernetes object).
    recorded = {
        (pod["metadata"].get("annotations") or {}).get(POLICY_VERSION_ANNOTATION)
        for pod in watched_pods(trained)
        if pod["metadata"]["name"] in engine
    }
    assert {f"v{step}" for step in range(STEPS + 1)} <= recorded, recorded
    # The trainer Job: the pod killed by the fault failed, its replacement trained to the end.
    job = trained.get("job", f"{RUN}-trainer", "-n", NS)
    assert (job["status"].get("failed"), job["status"].get("succeeded")) == (1, 1), job["status"]
    assert (
        "megatron" in trained.node.kubectl("logs", "-n", NS, f"job/{RUN}-trainer", check=False).stdout.lower()
    )


def test_kubectl_and_the_ui_show_the_run(trained: TrainedRun) -> None:
    table = trained.node.kubectl("get", "rlruns", "-n", NS, "-o", "wide").stdout.splitlines()
    header, row = table[0].split(), table[1].split()
    shown = dict(zip(header, row, strict=False))
    assert shown["NAME"] == RUN and shown["STEP"] == str(STEPS) and shown["POLICY"] == f"v{STEPS}", table
    print("\n".join(table))
    # The UI's own API, read through the API server's service proxy, from the cluster and the store.
    path = f"/api/v1/namespaces/{RELEASE_NS}/services/{FULLNAME}-ui:80/proxy/api/runs"
    runs = json.loads(trained.node.kubectl("get", "--raw", path).stdout)
    names = [r.get("name") for r in runs["runs"]]
    assert RUN in names, runs
    events = {(e["reason"]) for e in trained.events("RLRun")}
    assert {"Valid", "FleetReady", "Stepping"} <= events, events


def test_the_watch_transcript_shows_the_run_and_its_pods(trained: TrainedRun) -> None:
    runs, pods = (trained.watches[kind].read_text() for kind in ("rlruns", "pods"))
    print(runs)
    assert runs.splitlines()[0].split()[:5] == ["NAME", "PHASE", "STEP", "POLICY", "REWARD"], runs
    assert "Succeeded" in runs.splitlines()[-1], runs
    graded = next(r["trial"] for r in trained.records() if r["step"] == 1 and r["reward"] is not None)
    for pod in (f"{RUN}-trainer-", f"{RUN}-fleet-engine-", f"{RUN}-{graded} ", f"{RUN}-{graded}-verify"):
        assert pod in pods, pod


def _message(line: str) -> str:
    """The message of one of the operator's JSON log lines (the line itself if it is not one)."""
    try:
        return str(json.loads(line)["message"])
    except (ValueError, KeyError, TypeError):
        return line


def trainer_logs(trained: TrainedRun) -> str:
    """Every trainer pod's log (`kubectl logs job/...` shows one pod's; the replacement has the rest)."""
    names = [
        p["metadata"]["name"]
        for p in trained.get("pods", "-n", NS)["items"]
        if p["metadata"]["name"].startswith(f"{RUN}-trainer-")
    ]
    return "\n".join(
        trained.node.kubectl("logs", "-n", NS, name, check=False).stdout for name in sorted(names)
    )


def faults_of(trained: TrainedRun) -> dict[str, Any]:
    assert trained.faults is not None
    return trained.faults.faults


@dataclass
class FaultReport:
    """What the faults did (tests/support/node_faults.py), with the facts the table was written from."""

    faults: dict[str, Fault]
    deleted_record: dict[str, Any]
    adopted: list[str]
    """The restarted operator's log lines that name the trials it adopted."""
    job: dict[str, Any]
    """The trainer Job's status."""
    caught_up: list[str]
    """The trainer's log lines of a fleet catch-up."""
    batched: list[str]
    """The trial ids of the committed batches, in order."""

    def table(self) -> list[dict[str, Any]]:
        return [f.row() for f in self.faults.values()]


def fault_report(trained: TrainedRun) -> FaultReport:
    """Account for each injected fault from the run store and the cluster (also benchmarks/node_run.py)."""
    from legorl.api.store import RunStore  # noqa: PLC0415

    assert trained.faults is not None
    store = RunStore(str(trained.store))
    records = trained.records()
    batched = [t.trial for step in store.committed_steps() for t in store.read_batch(step).trials]

    def left() -> list[str]:
        items = trained.get("pods,configmaps", "-n", NS)["items"]
        return [i["metadata"]["name"] for i in items if i["metadata"]["name"].startswith(f"{RUN}-s")]

    def settled() -> bool:  # the last trials' objects deleted, the trainer Job done, as the run ends
        conditions = trained.get("job", f"{RUN}-trainer", "-n", NS)["status"].get("conditions") or []
        done = any(c["type"] in ("Complete", "Failed") and c["status"] == "True" for c in conditions)
        return done and not left()

    with contextlib.suppress(AssertionError):  # what is left after two minutes is orphaned
        trained.wait(settled, "the run's trial objects deleted and its trainer done", 120)
    leftovers = left()
    faults = {f.name: f for f in trained.faults.account(records, leftovers, batched)}
    by_trial = {r["trial"]: r for r in records}
    k = trained.node.kubectl

    deleted = faults["trial pod deleted"]
    record = by_trial.get(deleted.observed.get("trial", ""), {})
    deleted.happened = (
        f"trial {deleted.observed.get('trial')} ended {record.get('termination_reason')} "
        f"({record.get('error')}), not graded; its record kept {record.get('num_turns')} turns, its proxy "
        f"had acknowledged {deleted.observed.get('acknowledged_before')} when the pod was deleted"
    )
    operator = faults["operator kill -9"]
    log = k("logs", "-n", RELEASE_NS, f"deployment/{FULLNAME}-operator", check=False).stdout
    adopted = [_message(line) for line in log.splitlines() if "adopted" in line and "running trial" in line]
    operator.happened = (
        f"the kubelet restarted the container (Ready again after "
        f"{operator.observed.get('operator_ready_again_seconds')} s); the new operator adopted the trial "
        f"pods in flight ({len(operator.in_flight)} with an agent at work), relaunching none: "
        f"{adopted[-1] if adopted else 'no adoption logged'}"
    )
    trainer = faults["trainer kill -9"]
    job = trained.get("job", f"{RUN}-trainer", "-n", NS)["status"]
    trainer.happened = (
        f"killed while training step {trainer.observed.get('training_step')}; the Job replaced the pod "
        f"(failed {job.get('failed')}, succeeded {job.get('succeeded')}), which resumed from the store and "
        f"published {', '.join(store.published_versions())} once each"
    )
    kubelet = faults["kubelet restart"]
    kubelet.happened = (
        f"the kubelet renewed the node's Lease {kubelet.observed.get('lease_renewed_after_seconds')} s after "
        f"the stop; trials in flight ended {kubelet.observed.get('in_flight_reasons')}"
    )
    fleet = faults["fleet pod restart"]
    trainer_log = trainer_logs(trained)
    caught_up = [line for line in trainer_log.splitlines() if "newest published version" in line]
    figures = {f.step: f for f in store.step_figures()}
    stale = figures[STEPS].dropped_stale if STEPS in figures else None
    fleet.happened = (
        f"the Deployment started a new pod from the checkpoint; the trainer gave it v{STEPS - 1} "
        f"({len(caught_up)} catch-up(s) logged); trials in flight ended "
        f"{fleet.observed.get('in_flight_reasons')}; step {STEPS} dropped {stale} stale trial(s)"
    )
    return FaultReport(faults, record, adopted, job, caught_up, batched)


def test_the_run_survived_the_faults_and_lost_nothing(trained: TrainedRun) -> None:
    """Each fault of tests/support/node_faults.py was injected at its moment; the run still succeeded (the
    first
    test); counted from the run store, no acknowledged turn was lost, no trial counted twice, nothing of a
    trial left; and the cluster and the store say what happened."""
    from legorl.api.store import RunStore  # noqa: PLC0415

    report = fault_report(trained)
    faults, record, table = report.faults, report.deleted_record, report.table()
    print(json.dumps(table, indent=1))
    assert all(f.at is not None for f in faults.values()), [f.name for f in faults.values() if f.at is None]
    assert all((f.lost, f.duplicated, f.orphaned) == (0, 0, 0) for f in faults.values()), table
    assert record["termination_reason"] == "sandbox_error" and record["reward"] is None
    assert record["num_turns"] >= faults["trial pod deleted"].observed["acknowledged_before"] > 0
    assert faults["operator kill -9"].observed.get("operator_ready_again_seconds") is not None
    assert report.adopted, "the restarted operator adopted no trial"
    assert (report.job.get("failed"), report.job.get("succeeded")) == (1, 1)
    published = RunStore(str(trained.store)).published_versions()
    assert published == [f"v{step}" for step in range(1, STEPS + 1)]
    assert report.caught_up, "the trainer never gave the new fleet pod the published version"
    assert sorted(set(report.batched)) == sorted(report.batched)

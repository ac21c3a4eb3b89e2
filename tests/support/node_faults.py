"""Faults injected into the real node's RLRun while it trains: tests/e2e/test_node_run.py,
benchmarks/node_run.py.

A thread watches the run and injects each fault once its moment comes, in this order of moments:

1. **trial pod deleted** (`kubectl delete pod`) while its agent works and its proxy has acknowledged a turn;
2. **operator kill -9** (SIGKILL to the operator container's process) while step 1's trials run, after some
   were saved;
3. **trainer kill -9** (SIGKILL to the trainer container's torchrun) while it trains a committed batch whose
   version is not published yet;
4. **kubelet restart** (SIGTERM, started again with the same flags) while step 2's agents work;
5. **fleet pod restart** (`kubectl delete pod` of the vLLM pod) once v1 is served and some of step 2's
   trials were saved: the Deployment's new pod starts from the checkpoint.

What each did is measured afterwards from the run store and the cluster: `lost` (acknowledged turns that no
record kept: counted exactly for the deleted trial from its proxy's own count; for the others, trials in
flight at the fault whose agent ran and whose record holds no turn), `duplicated` (trial ids recorded or
batched twice) and `orphaned` (the run's trial pods and ConfigMaps left once it ended).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tests.support.kubenode import Node

PROXY_PORT = 4000
"""The trial proxy's port in a trial pod (legorl.operator.render.pool.PROXY_PORT)."""


@dataclass
class Fault:
    """One injected fault and what it did."""

    name: str
    moment: str
    """When it is injected."""
    at: float | None = None
    """Seconds after `kubectl apply`; None: its moment never came."""
    in_flight: list[str] = field(default_factory=list)
    """Trials whose agent was running when it was injected."""
    observed: dict[str, Any] = field(default_factory=dict)
    """What was seen at and after the injection (recovery times, the trial, versions)."""
    happened: str = ""
    lost: int | None = None
    duplicated: int | None = None
    orphaned: int | None = None

    def row(self) -> dict[str, Any]:
        return {
            "fault": self.name,
            "moment": self.moment,
            "injected_at_seconds": None if self.at is None else round(self.at, 1),
            "what_happened": self.happened,
            "lost": self.lost,
            "duplicated": self.duplicated,
            "orphaned": self.orphaned,
        }


def _running(pod: dict[str, Any], container: str) -> bool:
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        if status["name"] == container and "running" in (status.get("state") or {}):
            return True
    return False


class FaultDriver(threading.Thread):
    """Injects the faults into a run on NODE in namespace NS (run RUN, store folder STORE)."""

    def __init__(
        self,
        node: Node,
        *,
        namespace: str,
        run: str,
        release_namespace: str,
        store: Path,
        records: Callable[[], list[dict[str, Any]]],
        started: float,
    ) -> None:
        super().__init__(name="faults", daemon=True)
        self.node, self.ns, self.run_name, self.release_ns = node, namespace, run, release_namespace
        self.store, self.records, self.started = store, records, started
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.faults = {
            f.name: f
            for f in (
                Fault("trial pod deleted", "step 1, an agent at work whose proxy acknowledged a turn"),
                Fault("operator kill -9", "step 1, trials running, two or more saved"),
                Fault("trainer kill -9", "training a committed batch, its version not yet published"),
                Fault("kubelet restart", "step 2, agents at work"),
                Fault("fleet pod restart", "step 2, v1 served, two or more of its trials saved"),
            )
        }

    # -- what the run is doing ----------------------------------------------------------------------------

    def pods(self, prefix: str, namespace: str | None = None) -> list[dict[str, Any]]:
        items = self.node.get_json("pods", "-n", namespace or self.ns)["items"]
        return [p for p in items if p["metadata"]["name"].startswith(prefix)]

    def trial_pods(self, step: int) -> list[dict[str, Any]]:
        return [
            p
            for p in self.pods(f"{self.run_name}-s{step}-")
            if not p["metadata"]["name"].endswith("-verify") and not p["metadata"].get("deletionTimestamp")
        ]

    def working(self, step: int) -> list[dict[str, Any]]:
        return [p for p in self.trial_pods(step) if _running(p, "agent")]

    def saved(self, step: int) -> int:
        return sum(1 for r in self.records() if r["step"] == step and r["split"] == "train")

    def operator_pods(self) -> list[dict[str, Any]]:
        items = self.node.get_json(
            "pods", "-n", self.release_ns, "-l", "app.kubernetes.io/component=operator"
        )
        return [p for p in items["items"] if not p["metadata"].get("deletionTimestamp")]

    def store_state(self) -> tuple[list[int], list[str]]:
        from legorl.api.store import RunStore  # noqa: PLC0415

        store = RunStore(str(self.store))
        return store.committed_steps(), store.published_versions()

    def acknowledged(self, pod: dict[str, Any]) -> int:
        """Turns the trial's proxy has journaled and answered (its own count, through the API server)."""
        path = f"/api/v1/namespaces/{self.ns}/pods/{pod['metadata']['name']}:{PROXY_PORT}/proxy/trajectory"
        got = self.node.kubectl("get", "--raw", f"{path}?tokens=false", check=False, timeout=15)
        return int(json.loads(got.stdout)["turns"]) if got.returncode == 0 else 0

    def container_pid(self, pod: dict[str, Any], container: str) -> int:
        status = next(s for s in pod["status"]["containerStatuses"] if s["name"] == container)
        container_id = status["containerID"].removeprefix("docker://")
        return int(self.node.docker("inspect", "-f", "{{.State.Pid}}", container_id).stdout)

    # -- the faults --------------------------------------------------------------------------------------

    def _inject(self, name: str, working: list[dict[str, Any]]) -> Fault:
        fault = self.faults[name]
        fault.at = time.time() - self.started
        fault.in_flight = sorted(p["metadata"]["labels"].get("legorl.dev/trial", "") for p in working)
        return fault

    def _delete_trial_pod(self) -> bool:
        for pod in self.working(1):
            acked = self.acknowledged(pod)
            if acked < 1:
                continue
            fault = self._inject("trial pod deleted", [pod])
            fault.observed |= {"trial": fault.in_flight[0], "acknowledged_before": acked}
            self.node.kubectl("delete", "pod", pod["metadata"]["name"], "-n", self.ns, "--wait=false")
            return True
        return False

    def _kill_operator(self) -> bool:
        working = self.working(1)
        if not working or self.saved(1) < 2:
            return False
        (pod,) = self.operator_pods()
        pid = self.container_pid(pod, pod["status"]["containerStatuses"][0]["name"])
        restarts = pod["status"]["containerStatuses"][0]["restartCount"]
        fault = self._inject("operator kill -9", working)
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        while time.monotonic() - start < 180 and not self.stop.is_set():
            (now,) = self.operator_pods()
            status = now["status"]["containerStatuses"][0]
            if status["restartCount"] > restarts and status.get("ready"):
                fault.observed["operator_ready_again_seconds"] = round(time.monotonic() - start, 1)
                break
            time.sleep(1)
        return True

    def _kill_trainer(self) -> bool:
        committed, published = self.store_state()
        pending = [s for s in committed if f"v{s}" not in published]
        if not pending:
            return False
        pods = [p for p in self.pods(f"{self.run_name}-trainer-") if _running(p, "trainer")]
        if not pods:
            return False
        (pod,) = pods
        fault = self._inject("trainer kill -9", self.working(pending[0] + 1))
        fault.observed |= {"training_step": pending[0], "pod": pod["metadata"]["name"]}
        os.kill(self.container_pid(pod, "trainer"), signal.SIGKILL)
        return True

    def _restart_kubelet(self) -> bool:
        _, published = self.store_state()
        working = self.working(2)
        if "v1" not in published or not working:
            return False
        fault = self._inject("kubelet restart", working)
        fault.observed["lease_renewed_after_seconds"] = round(self.node.restart_kubelet(), 1)
        return True

    def _restart_fleet_pod(self) -> bool:
        if self.faults["kubelet restart"].at is None or self.saved(2) < 2:
            return False
        working = self.working(2)
        engines = self.pods(f"{self.run_name}-fleet-engine-")
        if not working or len(engines) != 1:
            return False
        fault = self._inject("fleet pod restart", working)
        fault.observed["deleted_pod"] = engines[0]["metadata"]["name"]
        self.node.kubectl("delete", "pod", engines[0]["metadata"]["name"], "-n", self.ns, "--wait=false")
        return True

    def run(self) -> None:
        steps: list[tuple[str, Callable[[], bool], str | None]] = [
            ("trial pod deleted", self._delete_trial_pod, None),
            ("operator kill -9", self._kill_operator, "trial pod deleted"),
            ("trainer kill -9", self._kill_trainer, None),
            ("kubelet restart", self._restart_kubelet, "operator kill -9"),
            ("fleet pod restart", self._restart_fleet_pod, "kubelet restart"),
        ]
        try:
            while not self.stop.is_set() and any(self.faults[n].at is None for n, _, _ in steps):
                for name, inject, after in steps:
                    if self.faults[name].at is not None or (after and self.faults[after].at is None):
                        continue
                    inject()
                self.stop.wait(0.5)
        except BaseException as exc:  # noqa: BLE001 - re-raised by the test (check)
            self.error = exc

    def check(self) -> None:
        if self.error is not None:
            raise AssertionError("the fault driver failed") from self.error

    # -- afterwards ----------------------------------------------------------------------------------------

    def account(self, records: list[dict[str, Any]], leftovers: list[str], batched: list[str]) -> list[Fault]:
        """Fill in what each fault did, from the run's records, the trial objects LEFTOVERS and the trial ids
        of the committed batches BATCHED."""
        by_trial = {r["trial"]: r for r in records}
        ids = Counter(r["trial"] for r in records)
        duplicated = sum(n - 1 for n in ids.values() if n > 1) + sum(
            n - 1 for n in Counter(batched).values() if n > 1
        )
        for fault in self.faults.values():
            if fault.at is None:
                fault.happened = "its moment never came in this run"
                continue
            fault.duplicated, fault.orphaned = duplicated, len(leftovers)
            mine = [by_trial[t] for t in fault.in_flight if t in by_trial]
            reasons = Counter(r["termination_reason"] for r in mine)
            fault.lost = sum(
                1 for r in mine if r["num_turns"] == 0 and r["termination_reason"] != "sandbox_error"
            )
            fault.observed["in_flight_reasons"] = dict(reasons)
            if fault.name == "trial pod deleted":
                record = by_trial.get(fault.observed["trial"])
                kept = record["num_turns"] if record else 0
                fault.observed |= {"kept_turns": kept, "reason": record and record["termination_reason"]}
                fault.lost = max(0, fault.observed["acknowledged_before"] - kept)
        return list(self.faults.values())

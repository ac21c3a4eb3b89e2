"""The Kubernetes trial backend: one trial = a trial pod from the SandboxPool's template, then a verify pod.

`KubeTrialBackend` implements `legorl.controller.backend.TrialBackend` for the run controller, which runs
in a thread of the operator (`legorl.operator.runs`). How a trial goes:

1. **launch** applies a task ConfigMap (`<run>-<trial>-task`: `task.json` without the gold fix and the
   hidden tests' contents, `problem.md`) and the trial pod (`render.pool.trial_pod`, owned by the RLRun,
   labelled with run, trial, step and split, the request in an annotation so a restarted operator can
   adopt it). The pod gets one more container, `hold` (the pool's pause image): it keeps the pod, and so
   the proxy sidecar with its journal, alive after the agent exits, until the operator has read the
   results. The pod's `activeDeadlineSeconds` is only a backstop (setup + agent + verify + 5 minutes) for
   an operator that is gone; the operator enforces the agent's deadline itself, so a timed-out agent's
   trajectory and changes are still collected.
2. The operator's pod watch feeds `TrialPods`; `collect` reads each trial's pod from there (no polling of
   the API server). When the agent container has exited (or its deadline passed), the backend talks to
   the trial's proxy **directly at the pod's IP** (`http://<podIP>:4000`): `POST /finish` (the harness's
   exit), `GET /changes` (the agent's changes, read by the proxy from the workspace mounted read-only).
   This needs no RBAC at all (the API server's `pods/proxy` would let the operator reach any port of any
   pod in its namespaces, the fleet's unauthenticated weight-update routes included), but it needs the
   network: the operator runs in the cluster, and a NetworkPolicy must admit it to the trial pods' port
   4000 (the pool's own policy admits nothing).
3. The change set goes into a ConfigMap (`<run>-<trial>-changes`, at most about 1 MiB) and the full task
   into `<run>-<trial>-verify-task`; the verify pod (`render.pool.verify_pod`) runs the pristine image and
   leaves the reward and tamper findings in its `verify` container's termination message.
4. Then `GET /trajectory` from the trial's proxy, `records.reconcile` + `records.build_record`, and
   every object of the trial is deleted.

The objects come from `render.trial` (pure); how a pod is doing is read by `status.trial` (pure).
`prefetch` names the next tasks' images on the pool (`legorl.dev/lookahead-images`) for its pre-pull.

Failures become records, never exceptions (`BackendError` only when the API server stays unreachable):
a pod that cannot start (image pull, missing config, unschedulable past its deadline), is evicted or
deleted → `sandbox_error`; a setup or egress-lock init container exiting 3 → `defense_failed`; the agent
past `agentSeconds` → `agent_timeout`; a proxy that does not answer → `proxy_error`; a verify pod that
fails or leaves no result → `verifier_error`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal, TypeVar

import httpx

from legorl.api.annotations import AgentOutcomeNote, TrialRequestNote
from legorl.api.kinds import RLRun, SandboxPool
from legorl.api.labels import (
    AGENT_OUTCOME_ANNOTATION,
    COMPONENT_LABEL,
    LOOKAHEAD_ANNOTATION,
    REQUEST_ANNOTATION,
    RUN_LABEL,
    TRIAL_LABEL,
    WARM_LABEL,
)
from legorl.api.summary import TrajectorySummary
from legorl.api.termination import TerminationReason
from legorl.api.timestamps import parse_time
from legorl.api.trajectory import TrajectoryError, TrialRecord
from legorl.controller.backend import BackendError, TrialRequest
from legorl.controller.canary import CANARY_TRIAL_PREFIX
from legorl.controller.records import build_record, reconcile
from legorl.operator.kube import ApiError, KubeClient
from legorl.operator.render.common import RenderContext, label_value
from legorl.operator.render.pool import PROXY_PORT, TRIAL, VERIFY
from legorl.operator.render.trial import (
    CLAIMED_AT_ANNOTATION,
    FleetAccess,
    TrialNames,
    claim_patch,
    lookahead_value,
    trial_objects,
    verify_objects,
)
from legorl.operator.status.trial import AgentEnd, VerifyResult, agent_end, verify_result
from legorl.sandbox.task import Task, TaskSet
from legorl.trialproxy.client import ProxyCallError, ProxyClient, ProxyUnreachable

log = logging.getLogger("legorl.operator.trials")

T = TypeVar("T")
Split = Literal["train", "validation"]


@dataclass(frozen=True)
class TrialSettings:
    """How the Kubernetes backend runs trials (one per operator; tests shorten the timings)."""

    proxy_port: int = PROXY_PORT
    """Port of the trial pods' proxy (the pod template's); the operator dials `<podIP>:<port>`."""
    proxy_timeout_seconds: float = 120.0
    """Limit of one call to a trial's proxy (`GET /changes` walks the whole workspace)."""
    proxy_attempts: int = 3
    """Calls to a proxy that fail to connect or answer 5xx are tried this often."""
    api_timeout_seconds: float = 60.0
    """Limit of one API call made from the controller's thread."""
    api_retry_seconds: float = 300.0
    """How long transient API errors are retried before the backend gives up (the run fails)."""
    appear_seconds: float = 30.0
    """A pod the backend created but the watch has not shown after this long is looked up directly."""
    tick_seconds: float = 1.0
    """`collect` re-checks deadlines at least this often while it waits for pod changes."""
    max_config_map_bytes: int = 1_000_000
    """Largest change set that fits in a ConfigMap (the API server refuses objects over 1 MiB)."""
    pvc_root: str = "/var/run/legorl/pvc"
    """Where the operator pod mounts PersistentVolumeClaims named by `pvc://claim/path` store and
    task-set URIs (`<pvc_root>/<claim>/<path>`)."""
    poll_seconds: float = 1.0
    """How often the per-run daemon re-reads the run while it waits or runs."""
    canary_score_seconds: float = 1800.0
    """How long a canary waits for the run's trainer to score its trial (the trainer answers between
    steps, once it has loaded the policy)."""


# --- the watch-fed index of trial and verify pods ------------------------------------------------------


class TrialPods:
    """Trial and verify pods as the operator's pod watch last saw them (written on the event loop,
    read by the controllers' threads)."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._pods: dict[tuple[str, str], dict[str, Any]] = {}
        self._version = 0

    @staticmethod
    def wanted(body: Mapping[str, Any]) -> bool:
        labels = (body.get("metadata") or {}).get("labels") or {}
        return RUN_LABEL in labels and labels.get(COMPONENT_LABEL) in (TRIAL, VERIFY)

    def update(self, namespace: str, body: Mapping[str, Any], deleted: bool) -> None:
        """A watch event (or an object read from the API)."""
        if not self.wanted(body):
            return
        key = (namespace, str(body.get("metadata", {}).get("name", "")))
        with self._changed:
            if deleted:
                self._pods.pop(key, None)
            else:
                self._pods[key] = json.loads(json.dumps(body))  # a private copy, safe across threads
            self._version += 1
            self._changed.notify_all()

    def get(self, namespace: str, name: str) -> dict[str, Any] | None:
        with self._changed:
            return self._pods.get((namespace, name))

    def of_run(self, namespace: str, run: str) -> list[dict[str, Any]]:
        value = label_value(run)
        with self._changed:
            return [
                body
                for (ns, _), body in self._pods.items()
                if ns == namespace and body["metadata"]["labels"].get(RUN_LABEL) == value
            ]

    @property
    def version(self) -> int:
        with self._changed:
            return self._version

    def wait(self, since: int, timeout: float) -> None:
        """Return when the index changed after `since`, or after `timeout` seconds."""
        with self._changed:
            self._changed.wait_for(lambda: self._version != since, timeout=max(0.0, timeout))


# --- the API client, called from the controller's thread ------------------------------------------------


class LoopApi:
    """The operator's async `KubeClient`, called from another thread through the operator's event loop."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        client: Callable[[], KubeClient],
        settings: TrialSettings,
    ) -> None:
        self.loop = loop
        self.client = client
        self.settings = settings

    def _call(self, what: str, fn: Callable[[KubeClient], Awaitable[T]]) -> T:
        give_up = time.monotonic() + self.settings.api_retry_seconds
        delay = 0.2
        while True:

            async def invoke() -> T:
                return await fn(self.client())

            if self.loop.is_closed() or not self.loop.is_running():
                # The operator is gone or stopping: nothing would ever run the call.
                state = "closed" if self.loop.is_closed() else "not running"
                raise BackendError(f"{what}: the operator's event loop is {state}")
            call = invoke()
            try:
                future = asyncio.run_coroutine_threadsafe(call, self.loop)
            except RuntimeError as exc:  # closed in between: the operator is gone
                call.close()  # never scheduled: close it here, not un-awaited in the garbage collector
                raise BackendError(f"{what}: the operator's event loop is closed") from exc
            try:
                return future.result(self.settings.api_timeout_seconds)
            except ApiError as exc:
                if not exc.transient:
                    raise
                problem = str(exc)
            except concurrent.futures.TimeoutError:
                future.cancel()
                if not self.loop.is_running():
                    # The loop stopped with the call still queued: it will never run it.
                    call.close()
                    raise BackendError(f"{what}: the operator's event loop stopped") from None
                problem = f"no answer in {self.settings.api_timeout_seconds:.0f}s"
            except Exception as exc:  # not logged in yet (TransientError), connection trouble
                if isinstance(exc, concurrent.futures.CancelledError):
                    raise BackendError(f"{what}: cancelled (the operator is stopping)") from exc
                problem = f"{type(exc).__name__}: {exc}"
            if time.monotonic() + delay > give_up:
                raise BackendError(
                    f"{what}: the Kubernetes API failed for {self.settings.api_retry_seconds:.0f}s: {problem}"
                )
            log.warning("%s: %s; retrying in %.1fs", what, problem, delay)
            time.sleep(delay)
            delay = min(delay * 2, 10.0)

    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        return self._call(f"apply {obj['kind']} {obj['metadata']['name']}", lambda c: c.apply(obj))

    def delete(self, kind: str, namespace: str, name: str) -> None:
        self._call(f"delete {kind} {name}", lambda c: c.delete(kind, namespace, name))

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return self._call(f"get {kind} {name}", lambda c: c.get(kind, namespace, name))

    def merge_patch(self, kind: str, namespace: str, name: str, patch: dict[str, Any]) -> None:
        self._call(f"patch {kind} {name}", lambda c: c.merge_patch(kind, namespace, name, patch))


# --- the backend ------------------------------------------------------------------------------------------


@dataclass
class _Trial:
    request: TrialRequest
    names: TrialNames
    launched: datetime
    created: float
    """Monotonic time the backend created (or adopted) the current pod."""
    stage: Literal["agent", "verify"] = "agent"
    seen: bool = False
    agent: AgentEnd | None = None
    cancel: bool = False
    proxy_problem: str | None = None
    """Why the trajectory could not be read from the trial's proxy, once that failed."""
    warm: bool = False
    """Its pod was made ready ahead (`prepare`): launching it claims the pod."""
    claimed: datetime | None = None
    """When the warm pod's proxy took the claim (the agent's clock starts then)."""
    claim_seconds: float | None = None
    """From `launch` to the proxy's answer that the agent has its `go`."""
    recreate: bool = False
    """Its warm pod died before the claim: the trial starts cold once that pod is gone."""


@dataclass
class _Warm:
    """A trial pod made ready ahead, not claimed yet."""

    request: TrialRequest
    names: TrialNames


class KubeTrialBackend:
    """`TrialBackend` over trial and verify pods (see the module docstring). Not thread-safe: one
    controller thread calls it."""

    def __init__(
        self,
        *,
        run: RLRun,
        pool: SandboxPool,
        fleet: FleetAccess,
        ctx: RenderContext,
        api: LoopApi,
        pods: TrialPods,
        task_set: TaskSet,
        settings: TrialSettings | None = None,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        on_proxy_metrics: Callable[[str], None] | None = None,
    ) -> None:
        self.run = run
        self.on_proxy_metrics = on_proxy_metrics
        """Gets each finished trial's proxy `GET /metrics` text once (the operator's /metrics sums them:
        Prometheus cannot scrape a trial's proxy, whose port only the operator may reach)."""
        self.pool = pool
        self.fleet = fleet
        self.ctx = ctx
        self.api = api
        self.pods = pods
        self.tasks = {t.instance_id: t for t in task_set}
        self.settings = settings or TrialSettings()
        self.clock = clock
        self.namespace = run.metadata.namespace or "default"
        self._trials: dict[str, _Trial] = {}
        self._returned: dict[str, TrialNames] = {}
        """Trials `collect` returned whose objects wait for `release` (the record is not saved yet)."""
        self._ready: list[TrialRecord] = []
        self._warm: dict[str, _Warm] = {}
        """Trial pods made ready ahead (`prepare`), by trial, not launched yet."""
        self._detached = False
        self._http = httpx.Client(timeout=httpx.Timeout(self.settings.proxy_timeout_seconds, connect=5.0))

    # -- TrialBackend ---------------------------------------------------------------------------------

    def launch(self, request: TrialRequest) -> None:
        if request.trial in self._trials:
            return
        now = self.clock()
        trial = _Trial(request, TrialNames.of(self.run.metadata.name, request.trial), now, time.monotonic())
        if self._warm.pop(request.trial, None) is not None:
            trial.warm = True
            pod = self.pods.get(self.namespace, trial.names.pod)
            if pod is not None and _dead(pod):
                self._recreate(trial)
            else:
                trial.seen = pod is not None
                self._claim(trial, pod)
            self._trials[request.trial] = trial
            return
        if request.task.image is None:
            self._ready.append(
                self._record(trial, "sandbox_error", f"task {request.task.instance_id} names no image")
            )
            return
        try:
            for obj in trial_objects(self.run, self.pool, request, self.fleet, self.ctx):
                self.api.apply(obj)
        except ApiError as exc:  # refused (quota, admission, invalid): this trial fails, the run goes on
            self._cleanup(trial)
            self._ready.append(
                self._record(trial, "sandbox_error", f"the API server refused the trial: {exc}")
            )
            return
        self._trials[request.trial] = trial

    def collect(self, timeout: float) -> list[TrialRecord]:
        give_up = time.monotonic() + max(0.0, timeout)
        while True:
            since = self.pods.version
            records, self._ready = self._ready, []
            for trial in list(self._trials.values()):
                record = self._advance(trial)
                if record is not None:
                    self._trials.pop(trial.request.trial, None)
                    records.append(record)
            left = give_up - time.monotonic()
            if records or left <= 0:
                return records
            self.pods.wait(since, min(left, self.settings.tick_seconds))

    def running(self) -> list[str]:
        return sorted({*self._trials, *(r.trial for r in self._ready)})

    def adopt(self) -> list[TrialRequest]:
        parts: dict[str, dict[str, dict[str, Any]]] = {}
        for body in self.pods.of_run(self.namespace, self.run.metadata.name):
            labels = body["metadata"]["labels"]
            parts.setdefault(labels.get(TRIAL_LABEL, ""), {})[labels[COMPONENT_LABEL]] = body
        adopted = []
        for trial_id, found in sorted(parts.items()):
            if trial_id in self._trials:
                continue
            names = TrialNames.of(self.run.metadata.name, trial_id)
            if trial_id.startswith(CANARY_TRIAL_PREFIX):
                # A canary cut off by an operator restart: never a trial of the run; the canary reruns.
                log.info(
                    "removing the interrupted canary trial %s of run %s", trial_id, self.run.metadata.name
                )
                self._delete_all(names)
                continue
            pod, verifier = found.get(TRIAL), found.get(VERIFY)
            request = self._request_of(pod or verifier or {})
            if pod is None or request is None:
                # Without the trial pod the proxy's journal is gone; the controller runs it again.
                log.warning(
                    "trial %s of run %s cannot be adopted; removing what is left",
                    trial_id,
                    self.run.metadata.name,
                )
                self._delete_all(names)
                continue
            if labels_of(pod).get(WARM_LABEL) == "waiting" and verifier is None:
                self._warm[trial_id] = _Warm(request, names)  # made ready ahead, not launched yet
                continue
            launched = parse_time(pod["metadata"].get("creationTimestamp")) or self.clock()
            trial = _Trial(request, names, launched, time.monotonic(), seen=True)
            if labels_of(pod).get(WARM_LABEL) == "claimed":
                claimed = (pod["metadata"].get("annotations") or {}).get(CLAIMED_AT_ANNOTATION)
                trial.warm, trial.claimed = True, parse_time(claimed) or self.clock()
            if verifier is not None:
                trial.stage = "verify"
                trial.agent = self._agent_of(verifier)
            self._trials[trial_id] = trial
            adopted.append(request)
        if adopted:
            log.info("run %s: adopted %d running trial(s)", self.run.metadata.name, len(adopted))
        return adopted

    def prepare(self, requests: Sequence[TrialRequest]) -> None:
        """Make the next trials' pods ready ahead: every stage done but the agent's, which waits at the
        gate (`render.pool.GATE_SCRIPT`) until `launch` claims the pod. Pods made for trials no longer
        named, or that died waiting, are deleted (and made again while named)."""
        if self._detached:
            return
        named = {
            r.trial: r for r in requests if r.trial not in self._trials and r.trial not in self._returned
        }
        for trial_id, warm in list(self._warm.items()):
            pod = self.pods.get(self.namespace, warm.names.pod)
            if trial_id not in named or (pod is not None and _dead(pod)):
                why = "it died waiting" if trial_id in named else "its trial is no longer next"
                log.info("deleting the warm pod of trial %s: %s", trial_id, why)
                del self._warm[trial_id]
                self._delete_all(warm.names)
        for trial_id, request in named.items():
            if trial_id in self._warm or request.task.image is None:
                continue
            names = TrialNames.of(self.run.metadata.name, trial_id)
            if self.pods.get(self.namespace, names.pod) is not None:
                continue  # the old pod is still going away: made on a later call
            try:
                for obj in trial_objects(self.run, self.pool, request, self.fleet, self.ctx, warm=True):
                    self.api.apply(obj)
            except ApiError as exc:  # a hint: the trial starts cold when it is launched
                log.warning("could not make trial %s ready ahead: %s", trial_id, exc)
                self._delete_all(names)
                continue
            self._warm[trial_id] = _Warm(request, names)
            log.info("made trial %s ready ahead (a warm pod)", trial_id)

    def prefetch(self, tasks: Sequence[Task]) -> None:
        """Feeds the pool's pre-pull lookahead (`legorl.dev/lookahead-images`, read fresh: a shared pool
        may have been named images by another run). With `Lookahead` the last writer wins: runs
        sharing such a pool take turns at its cache."""
        images = [t.image for t in tasks if t.image]
        namespace = self.pool.metadata.namespace or self.namespace
        try:
            live = self.api.get("SandboxPool", namespace, self.pool.metadata.name)
            annotations = ((live or {}).get("metadata") or {}).get("annotations") or {}
            try:
                current = json.loads(annotations.get(LOOKAHEAD_ANNOTATION) or "[]")
            except json.JSONDecodeError:
                current = []
            names = [str(c) for c in current] if isinstance(current, list) else []
            value = lookahead_value(self.pool.spec.pre_pull.policy, names, images)
            if value is None:
                return
            encoded = json.dumps(value, separators=(",", ":"))
            self.api.merge_patch(
                "SandboxPool",
                namespace,
                self.pool.metadata.name,
                {"metadata": {"annotations": {LOOKAHEAD_ANNOTATION: encoded}}},
            )
        except ApiError as exc:  # a hint: trials still pull their images themselves
            log.warning("could not name the next images on pool %s: %s", self.pool.metadata.name, exc)

    def cancel(self, trial: str) -> None:
        if trial in self._trials:
            self._trials[trial].cancel = True

    def release(self, trial: str) -> None:
        held = self._trials.pop(trial, None)
        names = self._returned.pop(trial, None) or (held.names if held else None)
        if names is None:
            names = TrialNames.of(self.run.metadata.name, trial)
        if not self._detached:
            self._delete_all(names)

    def close(self) -> None:
        if not self._detached:
            for trial in list(self._trials.values()):
                self._cleanup(trial)
            for names in [*self._returned.values(), *(w.names for w in self._warm.values())]:
                self._delete_all(names)
            self._trials.clear()
            self._returned.clear()
            self._warm.clear()
        self._http.close()

    # -- beyond the protocol -----------------------------------------------------------------------------

    def detach(self) -> None:
        """From now on leave every pod as it is: cancelled trials are reported without deleting anything,
        and `close` deletes nothing (the operator is stopping; the next one adopts the pods)."""
        self._detached = True

    # -- one trial's progress ------------------------------------------------------------------------------

    def _advance(self, trial: _Trial) -> TrialRecord | None:
        if trial.cancel:
            return self._finish(trial, "cancelled", "cancelled by the run controller")
        if trial.stage == "agent":
            return self._advance_agent(trial)
        return self._advance_verify(trial)

    def _observed(self, trial: _Trial, name: str) -> dict[str, Any] | Literal[False] | None:
        """The pod from the watch; None while it may still appear; False when it is gone."""
        pod = self.pods.get(self.namespace, name)
        if pod is not None:
            trial.seen = True
            return pod
        if trial.seen:
            return False
        if time.monotonic() - trial.created < self.settings.appear_seconds:
            return None
        try:
            fetched = self.api.get("Pod", self.namespace, name)
        except ApiError as exc:
            log.warning("could not look up pod %s: %s", name, exc)
            return None
        if fetched is None:
            return False
        self.pods.update(self.namespace, fetched, False)
        trial.seen = True
        return fetched

    def _advance_agent(self, trial: _Trial) -> TrialRecord | None:
        if trial.recreate:
            if self.pods.get(self.namespace, trial.names.pod) is not None:
                return None  # the dead warm pod is still going away
            return self._start_cold(trial)
        pod = self._observed(trial, trial.names.pod)
        if pod is None:
            return None
        if pod is False:
            return self._finish(trial, "sandbox_error", "the trial pod is gone (evicted or deleted)")
        if trial.warm and trial.claimed is None and not _dead(pod):
            self._claim(trial, pod)
        deadlines = self.pool.spec.deadlines
        end = agent_end(
            pod,
            now=self.clock(),
            setup_seconds=deadlines.setup_seconds,
            agent_seconds=deadlines.agent_seconds,
            launched=trial.launched,
            # A warm pod's stages were done ahead: its trial's clock starts at the claim.
            claimed=(trial.claimed or trial.launched) if trial.warm else None,
        )
        if end is None:
            return None
        if trial.claim_seconds is not None:
            end = dataclasses.replace(end, stage_seconds={**end.stage_seconds, "claim": trial.claim_seconds})
        if not end.collect:
            trajectory = self._salvage(trial, pod, end) if end.salvage else None
            return self._finish(
                trial, end.reason, end.detail, trajectory=trajectory, stage_seconds=end.stage_seconds
            )
        trial.agent = end
        try:
            proxy = self._client(pod)
            proxy.finish(TerminationReason(end.reason), end.exit_code, end.detail)
            changes = proxy.changes()
        except ProxyCallError as exc:
            return self._finish(trial, end.reason, f"{end.detail}; {exc}", stage_seconds=end.stage_seconds)
        outcome = AgentOutcomeNote(end.reason, end.exit_code, end.detail, end.stage_seconds)
        objects = verify_objects(
            self.run, self.pool, trial.request, self.fleet, self.ctx, changes=changes, agent_outcome=outcome
        )
        size = len(objects[1]["data"]["changes.json"].encode())
        if size > self.settings.max_config_map_bytes:
            return self._finish(
                trial,
                "verifier_error",
                f"the agent's change set is {size} bytes, more than a ConfigMap holds "
                f"({self.settings.max_config_map_bytes}); it cannot be verified",
                trajectory=self._trajectory(trial),
                stage_seconds=end.stage_seconds,
            )
        try:
            for obj in objects:
                self.api.apply(obj)
        except ApiError as exc:
            return self._finish(
                trial,
                "verifier_error",
                f"the API server refused the verify pod: {exc}",
                trajectory=self._trajectory(trial),
                stage_seconds=end.stage_seconds,
            )
        trial.stage, trial.seen, trial.created = "verify", False, time.monotonic()
        return None

    def _advance_verify(self, trial: _Trial) -> TrialRecord | None:
        agent = trial.agent or AgentEnd("completed")
        pod = self._observed(trial, trial.names.verify)
        if pod is None:
            return None
        if pod is False:
            result = VerifyResult(error="the verify pod is gone (evicted or deleted)")
        else:
            created = parse_time(pod["metadata"].get("creationTimestamp")) or self.clock()
            found = verify_result(
                pod, now=self.clock(), verify_seconds=self.pool.spec.deadlines.verify_seconds, created=created
            )
            if found is None:
                return None
            result = found
        seconds = dict(agent.stage_seconds)
        if result.seconds is not None:
            seconds["verify"] = result.seconds
        trajectory = self._trajectory(trial)
        if result.error is not None:
            return self._finish(
                trial, "verifier_error", result.error, trajectory=trajectory, stage_seconds=seconds
            )
        return self._finish(
            trial,
            agent.reason,
            "; ".join(
                text for text in (agent.detail if agent.reason != "completed" else "", result.note) if text
            )
            or None,
            trajectory=trajectory,
            reward=result.reward,
            findings=result.findings,
            stage_seconds=seconds,
        )

    def _finish(
        self,
        trial: _Trial,
        sandbox_reason: str,
        detail: str | None,
        *,
        trajectory: TrajectorySummary | None = None,
        reward: float | None = None,
        findings: Sequence[Mapping[str, Any]] = (),
        stage_seconds: Mapping[str, float] | None = None,
    ) -> TrialRecord:
        # Its pods (the proxy's journal) stay until the controller has saved the record (`release`).
        self._returned[trial.request.trial] = trial.names
        return self._record(
            trial,
            sandbox_reason,
            detail,
            trajectory=trajectory,
            reward=reward,
            findings=findings,
            stage_seconds=stage_seconds,
        )

    def _record(
        self,
        trial: _Trial,
        sandbox_reason: str,
        detail: str | None,
        *,
        trajectory: TrajectorySummary | None = None,
        reward: float | None = None,
        findings: Sequence[Mapping[str, Any]] = (),
        stage_seconds: Mapping[str, float] | None = None,
    ) -> TrialRecord:
        reason = reconcile(sandbox_reason, trajectory)
        if trajectory is None and reason.value != sandbox_reason:
            detail = f"{detail or sandbox_reason}; no trajectory could be read from the trial's proxy"
            if trial.proxy_problem:
                detail = f"{detail} ({trial.proxy_problem})"
        end = trajectory.end if trajectory is not None else None
        if end is not None and end.source == "proxy" and end.detail:
            detail = f"{detail or ''}; proxy: {end.detail}".lstrip("; ")
        try:
            return build_record(
                trial.request,
                run=self.run.metadata.name,
                harness=self.run.spec.harness.kind,
                reason=reason,
                reward=reward,
                trajectory=trajectory,
                started_at=trial.launched,
                ended_at=self.clock(),
                findings=findings,
                stage_seconds=stage_seconds,
                error=detail,
            )
        except TrajectoryError as exc:  # a trajectory that breaks the contract (fetched without tokens)
            return build_record(
                trial.request,
                run=self.run.metadata.name,
                harness=self.run.spec.harness.kind,
                reason=reconcile(sandbox_reason, None),
                reward=None,
                trajectory=None,
                started_at=trial.launched,
                ended_at=self.clock(),
                findings=findings,
                stage_seconds=stage_seconds,
                error=f"{detail or ''}; the proxy's trajectory is unusable: {exc}".lstrip("; "),
            )

    # -- warm trial pods ----------------------------------------------------------------------------------

    def _claim(self, trial: _Trial, pod: Mapping[str, Any] | None) -> None:
        """Tell a warm pod's proxy to open the agent's gate (`POST /claim`), then mark the pod claimed by
        this launch. A proxy not up yet is asked again on the next pass (`_advance_agent`)."""
        if pod is None or not (pod.get("status") or {}).get("podIP"):
            return
        try:
            released = self._client(pod).claim()
        except ProxyUnreachable as exc:
            log.debug("trial %s: its warm pod's proxy is not up yet: %s", trial.request.trial, exc)
            return
        except ProxyCallError as exc:
            log.warning("trial %s: the claim was refused: %s", trial.request.trial, exc)
            return
        trial.claimed = self.clock()
        if released:
            trial.claim_seconds = time.monotonic() - trial.created
        started = parse_time((pod.get("status") or {}).get("startTime")) or trial.claimed
        patch = claim_patch(
            self.pool, trial.request, (trial.claimed - started).total_seconds(), trial.claimed
        )
        try:
            self.api.merge_patch("Pod", self.namespace, trial.names.pod, patch)
        except ApiError as exc:  # the gate is open: the trial runs; a restarted operator re-claims it
            log.warning("trial %s: could not mark its pod claimed: %s", trial.request.trial, exc)

    def _recreate(self, trial: _Trial) -> None:
        """The warm pod died before its claim: delete it; the trial starts cold once it is gone."""
        log.info("trial %s: its warm pod died before the claim; starting it cold", trial.request.trial)
        trial.warm, trial.recreate = False, True
        self._delete_all(trial.names)

    def _start_cold(self, trial: _Trial) -> TrialRecord | None:
        trial.recreate, trial.seen, trial.created = False, False, time.monotonic()
        try:
            for obj in trial_objects(self.run, self.pool, trial.request, self.fleet, self.ctx):
                self.api.apply(obj)
        except ApiError as exc:
            return self._finish(trial, "sandbox_error", f"the API server refused the trial: {exc}")
        return None

    # -- the proxy ------------------------------------------------------------------------------------------

    def _client(self, pod: Mapping[str, Any]) -> ProxyClient:
        """The trial's proxy, dialled directly at the pod's IP."""
        ip = (pod.get("status") or {}).get("podIP")
        if not ip:
            raise ProxyCallError("the trial pod has no IP: its proxy cannot be reached")
        host = f"[{ip}]" if ":" in ip else ip
        return ProxyClient(
            self._http, f"http://{host}:{self.settings.proxy_port}", attempts=self.settings.proxy_attempts
        )

    def _salvage(self, trial: _Trial, pod: Mapping[str, Any], end: AgentEnd) -> TrajectorySummary | None:
        """The turns a deleted pod's proxy acknowledged, read while it drains (its journal is in the pod's
        emptyDir): the trial is not graded, but what the agent was told stays on its record."""
        try:
            self._client(pod).finish(TerminationReason(end.reason), end.exit_code, end.detail)
        except ProxyCallError as exc:
            log.warning("trial %s: the deleted pod's proxy is gone: %s", trial.request.trial, exc)
            trial.proxy_problem = str(exc)
            return None
        return self._trajectory(trial)

    def _trajectory(self, trial: _Trial) -> TrajectorySummary | None:
        pod = self.pods.get(self.namespace, trial.names.pod)
        if pod is None:
            trial.proxy_problem = "the trial pod is gone"
            return None
        try:
            proxy = self._client(pod)
            trajectory = proxy.trajectory()
        except ProxyCallError as exc:
            log.warning("trial %s: %s", trial.request.trial, exc)
            trial.proxy_problem = str(exc)
            return None
        if self.on_proxy_metrics is not None:
            # Figures are nice to have: one try, and a trial never fails on them.
            text = proxy.metrics()
            try:
                if text is not None:
                    self.on_proxy_metrics(text)
            except ValueError as exc:
                log.debug("trial %s: unreadable proxy metrics: %s", trial.request.trial, exc)
        return trajectory

    # -- adoption and cleanup ------------------------------------------------------------------------------

    def _request_of(self, pod: Mapping[str, Any]) -> TrialRequest | None:
        raw = ((pod.get("metadata") or {}).get("annotations") or {}).get(REQUEST_ANNOTATION)
        try:
            note = TrialRequestNote.from_json(raw)
            return TrialRequest.from_note(note, self.tasks[note.task_id])
        except (ValueError, KeyError):
            return None

    @staticmethod
    def _agent_of(verifier: Mapping[str, Any]) -> AgentEnd:
        raw = ((verifier.get("metadata") or {}).get("annotations") or {}).get(AGENT_OUTCOME_ANNOTATION)
        try:
            note = AgentOutcomeNote.from_json(raw)
        except ValueError:
            return AgentEnd("completed", "the agent stage's outcome was lost; the verifier decides")
        return AgentEnd(
            reason=note.reason,
            detail=note.detail,
            exit_code=note.exit_code,
            collect=True,
            stage_seconds=dict(note.stage_seconds),
        )

    def _cleanup(self, trial: _Trial) -> None:
        self._delete_all(trial.names)

    def _delete_all(self, names: TrialNames) -> None:
        for kind, name in (
            ("Pod", names.verify),
            ("Pod", names.pod),
            ("ConfigMap", names.task),
            ("ConfigMap", names.verify_task),
            ("ConfigMap", names.changes),
        ):
            try:
                self.api.delete(kind, self.namespace, name)
            except ApiError as exc:  # the run's owner reference removes it with the run
                log.warning("could not delete %s %s: %s", kind, name, exc)


def _dead(pod: Mapping[str, Any]) -> bool:
    """A pod that ended or is being deleted."""
    status = pod.get("status") or {}
    return bool((pod.get("metadata") or {}).get("deletionTimestamp")) or status.get("phase") in (
        "Failed",
        "Succeeded",
    )


def labels_of(pod: Mapping[str, Any]) -> dict[str, str]:
    labels = (pod.get("metadata") or {}).get("labels") or {}
    return dict(labels)

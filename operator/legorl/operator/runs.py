"""The run controller of each RLRun, inside the operator (the per-run kopf daemon's service).

`RunDaemon.serve` waits until the run is valid and its fleet and pool are ready, then runs the RL loop
(`legorl.controller.loop.RunController`) over a `KubeTrialBackend` in a thread of its own; API calls
from that thread go through the operator's event loop. What the loop reports becomes a
`ControllerReport` that the reconciler reads into the run's status (step, policy version, trials by
reason, metrics, `Training` / `Succeeded` / `Failed`): status is still computed and written in one
place. The loop stops when:

- the run is suspended, deleted or ended some other way (deadline, trainer failure): running trials are
  cancelled and their pods deleted;
- the operator exits: the backend detaches, so the trial pods keep running and the next operator adopts
  them (the run store holds every finished trial, so none is run twice);
- the run's spec changes (a new generation): the loop hands over in the same way and starts again with
  the new spec.

A `legorl.dev/validate-requested` annotation not yet answered in `status.validation` runs the run's
canary (`legorl.operator.canary`) first: before the loop starts, or by handing a running loop over and
restarting it afterwards. A canary that fails before the run finished any trial suspends the run.

The run store must be reachable from the operator: `s3://` / `gs://` with the operator's own
credentials, `file://`, or `pvc://claim/path` with the claim mounted at `<pvcRoot>/<claim>`. Task sets
are read from the same places, or from a ConfigMap (`configmap://name/key`, JSONL).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import fsspec
import kopf
from pydantic import ValidationError

from legorl.api.conditions import RunConditionType as T
from legorl.api.conditions import find_condition
from legorl.api.kinds import RLRun, RolloutFleet, SandboxPool
from legorl.api.labels import VALIDATE_ANNOTATION, fleet_name, pool_name
from legorl.api.progress import Progress
from legorl.api.run import RunMetrics, ValidationStatus
from legorl.api.store import RunStore, StoreError
from legorl.api.trajectory import TrialRecord
from legorl.controller.loop import FIDELITY_REASON, RunController, RunOutcome
from legorl.controller.plan import PlanError
from legorl.operator.canary import Stopped, run_canary, summary, validation_status
from legorl.operator.kube import ApiError
from legorl.operator.reconcile import Reconciler, TransientError
from legorl.operator.render.run import fleet_url, store_uri
from legorl.operator.render.trial import FleetAccess
from legorl.operator.status.run import ControllerReport, is_terminal
from legorl.operator.store import ObjectKey
from legorl.operator.trials import KubeTrialBackend, LoopApi, TrialPods, TrialSettings
from legorl.sandbox.task import TaskError, TaskSet, load_task_set
from legorl.telemetry.traces import emit_trial_spans

log = logging.getLogger("legorl.operator.runs")

METRICS = tuple(RunMetrics.model_fields)
"""RunMetrics fields, which Progress carries under the same names."""


class StartProblem(Exception):
    """The loop cannot start yet (its task set or store is unreachable); retried, never terminal."""


def resolve_uri(uri: str, settings: TrialSettings) -> str:
    """A task-set or store URI as the operator opens it: `pvc://claim/path` → its mount in the operator
    pod, `file://` → a path, others as they are (fsspec)."""
    scheme, _, rest = uri.partition("://")
    if scheme == "pvc":
        claim, _, path = rest.partition("/")
        mount = Path(settings.pvc_root) / claim
        if not mount.is_dir():
            raise StartProblem(
                f"{uri}: the operator has no volume for PersistentVolumeClaim {claim!r}; mount it into the "
                f"operator pod at {mount}, or use an s3:// / gs:// store"
            )
        return str(mount / path)
    if scheme == "file":
        return rest
    return uri


def progress_report(
    progress: Progress, *, running: bool, outcome: RunOutcome | None = None, stopping: bool = False
) -> ControllerReport:
    """The controller's progress as plain values (copied in the controller's thread)."""
    done = f"step {progress.step}" + (f"/{progress.max_steps}" if progress.max_steps else "")
    message = (
        f"{done}, policy {progress.policy_version}: {progress.trials_running} trial(s) running, "
        f"{progress.trials_total} finished"
    )
    if stopping:
        message += "; stopping (cancelling running trials)"
    return ControllerReport(
        running=running,
        step=progress.step,
        policy_version=progress.policy_version,
        trials_total=progress.trials_total,
        trials_running=progress.trials_running,
        trials_dropped=progress.trials_dropped,
        zero_variance_groups=progress.zero_variance_groups,
        by_reason=dict(progress.by_reason),
        metrics={k: getattr(progress, k) for k in METRICS},
        message=message,
        has_progress=True,
        outcome=(outcome.state, outcome.reason, outcome.message) if outcome is not None else None,
        degraded=(progress.degraded_reason, progress.degraded_message) if progress.degraded_reason else None,
    )


def _parse_jsonl(text: str, where: str) -> TaskSet:
    rows = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append((f"{where}:{lineno}", json.loads(line)))
        except json.JSONDecodeError as exc:
            raise TaskError(f"{where}:{lineno}: not valid JSON: {exc.msg}") from None
    return TaskSet.from_rows(rows)


def _read_task_set(location: str, fmt: str) -> TaskSet:
    """A JSONL / Parquet manifest from a local path or an fsspec URL (downloaded first)."""
    if "://" not in location:
        return load_task_set(Path(location), fmt)
    suffix = Path(location.rstrip("/")).suffix or ".jsonl"
    with tempfile.TemporaryDirectory() as tmp:
        local = Path(tmp) / f"tasks{suffix}"
        with fsspec.open(location, "rb") as src:
            local.write_bytes(src.read())
        return load_task_set(local, fmt)


@dataclass
class _Running:
    controller: RunController
    backend: KubeTrialBackend
    thread: threading.Thread
    generation: int
    outcome: RunOutcome | None = None
    error: BaseException | None = None
    stop_mode: str | None = None


class RunDaemon:
    """One RLRun's loop inside the operator (see the module docstring)."""

    def __init__(
        self,
        key: ObjectKey,
        *,
        reconciler: Reconciler,
        pods: TrialPods,
        settings: TrialSettings,
        operator_metrics: Any = None,
        tracer_provider: Any = None,
    ) -> None:
        self.key = key
        self.operator_metrics = operator_metrics
        """`legorl.operator.metrics.OperatorMetrics` of the operator's /metrics, or None."""
        self.progress_metrics = getattr(operator_metrics, "runs", None)
        """Its run gauges (`legorl.telemetry.metrics.ProgressMetrics`), fed with the loop's progress."""
        self.tracer_provider = tracer_provider
        """Where finished trials' spans go (`legorl.telemetry.traces`), or None: no tracing."""
        self.reconciler = reconciler
        self.pods = pods
        self.settings = settings
        self.loop = asyncio.get_running_loop()
        self.namespace = key[1]
        self._current: _Running | None = None
        self._validation: ValidationStatus | None = None
        """The canary this daemon last reported (sent with every report, so that a status patch racing
        the cache never loses it)."""

    # -- reporting (on the event loop) ------------------------------------------------------------------

    def report(self, report: ControllerReport) -> None:
        if report.validation is None and self._validation is not None:
            report = dataclasses.replace(report, validation=self._validation)
        self.reconciler.controllers[self.key] = report
        self.reconciler.store.mark(self.key)

    def _set_validation(self, validation: ValidationStatus) -> None:
        if validation == self._validation:
            return
        self._validation = validation
        last = self.reconciler.controllers.get(self.key) or ControllerReport()
        self.report(dataclasses.replace(last, validation=validation))

    def _report_threadsafe(self, report: ControllerReport) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed under a stopping controller
            self.loop.call_soon_threadsafe(self.report, report)

    # -- the daemon -----------------------------------------------------------------------------------------

    async def serve(self, stopped: Any, stopping: asyncio.Event) -> None:
        """Run until kopf stops this daemon (`stopped`) or the operator stops (`stopping`)."""
        ended = False
        backoff = self.settings.poll_seconds
        try:
            while not (stopped or stopping.is_set()):
                run = self._run()
                if run is None or self._waits(run, ended=ended):
                    await self._sleep(stopped, stopping, self.settings.poll_seconds)
                    continue
                try:
                    running = await self._begin(run, stopped, stopping)
                    if running is None:
                        continue  # a canary ran instead
                except StartProblem as exc:
                    log.warning("RLRun %s/%s: %s", self.namespace, self.key[2], exc)
                    self.report(ControllerReport(problem=str(exc)))
                    await self._sleep(stopped, stopping, backoff)
                    backoff = min(backoff * 2, 300.0)
                    continue
                await self._supervise(running, stopped, stopping)
                outcome = running.outcome
                problem = None
                if running.error is not None:
                    problem = f"the run controller failed: {type(running.error).__name__}: {running.error}"
                    log.error("RLRun %s/%s: %s", self.namespace, self.key[2], problem, exc_info=running.error)
                elif outcome is not None and outcome.reason == "BackendFailed":
                    # The API server was unreachable for minutes: the pods were left as they are, and
                    # a new loop adopts them once it answers again; the experiment does not end.
                    problem = outcome.message
                if problem is not None or outcome is None:
                    self.report(
                        ControllerReport(problem=problem or "the run controller ended without an outcome")
                    )
                    await self._sleep(stopped, stopping, backoff)
                    backoff = min(backoff * 2, 300.0)
                    continue
                backoff = self.settings.poll_seconds
                self.report(progress_report(outcome.progress, running=False, outcome=outcome))
                if outcome.reason == FIDELITY_REASON:
                    # fidelity.action Pause: suspend the run (as a person would) so that nothing
                    # restarts it until someone looks; resuming re-arms the guard.
                    await self._suspend(run, outcome.message, FIDELITY_REASON, stopped, stopping)
                if outcome.state != "Stopped":
                    log.info(
                        "RLRun %s/%s ended: %s (%s)",
                        self.namespace,
                        self.key[2],
                        outcome.reason,
                        outcome.message,
                    )
                    ended = True  # the reconciler writes Succeeded/Failed; nothing restarts it
        finally:
            self.reconciler.controllers.pop(self.key, None)
            if self.progress_metrics is not None:
                self.progress_metrics.forget(self.key[2], namespace=self.namespace)
            current = self._current
            if current is not None and current.thread.is_alive():
                # Cancelled by kopf while the loop runs: never leave it behind; the next daemon adopts.
                current.backend.detach()
                current.controller.stop()

    async def _suspend(
        self, run: RLRun, why: str, reason: str, stopped: Any, stopping: asyncio.Event
    ) -> None:
        """Set `spec.suspend` and wait until the operator's cache holds that generation of the run (a
        loop restarted before would run on; a person may also have resumed it since, which the newer
        generation then shows). Retried with backoff: a pause that did not land must not be forgotten."""
        client = self.reconciler.client
        name = self.key[2]
        backoff = self.settings.poll_seconds
        generation: int | None = None
        while not (stopped or stopping.is_set()):
            current = self._run()
            if current is None:
                return
            if generation is None:
                if current.spec.suspend:
                    return  # suspended meanwhile, by a person
                try:
                    patched = await client.merge_patch(
                        "RLRun", self.namespace, name, {"spec": {"suspend": True}}
                    )
                except ApiError as exc:
                    log.error("RLRun %s/%s: could not suspend it: %s", self.namespace, name, exc)
                    await self._sleep(stopped, stopping, backoff)
                    backoff = min(backoff * 2, 30.0)
                    continue
                generation = int((patched.get("metadata") or {}).get("generation") or 0)
                log.warning("RLRun %s/%s suspended (%s): %s", self.namespace, name, reason, why)
                with contextlib.suppress(ApiError):
                    await client.event(
                        run.to_wire(),
                        type_="Warning",
                        reason=reason,
                        message=f"suspended: {why}"[:1000],
                        now=datetime.now(UTC),
                    )
            elif (current.metadata.generation or 0) >= generation:
                return
            await self._sleep(stopped, stopping, self.settings.poll_seconds)

    def _waits(self, run: RLRun, *, ended: bool) -> bool:
        """Whether the loop must not start now (a canary asked for meanwhile says why it waits)."""
        blocked = "the run has ended" if ended else self._blocked(run)
        if blocked is not None:
            self._validation_waits(run, blocked)
        return blocked is not None

    async def _begin(self, run: RLRun, stopped: Any, stopping: asyncio.Event) -> _Running | None:
        """Start the loop, or run the canary asked for first (None)."""
        prepared = await self._prepare(run)
        requested = self._validation_request(run)
        if requested is not None:
            await self._validate(run, requested, prepared, stopped, stopping)
            return None
        return self._start(run, *prepared)

    # -- the canary (legorl.dev/validate-requested) ------------------------------------------------------

    def _validation_request(self, run: RLRun) -> str | None:
        """The annotation's value when it asks for a canary not yet answered (None: nothing to do). A
        canary cut off by an operator restart (status says Pending or Running) is run again."""
        requested = (run.metadata.annotations or {}).get(VALIDATE_ANNOTATION)
        if not requested:
            return None
        done = self._validation or (run.status.validation if run.status else None)
        if done is not None and done.requested == requested[:63] and done.state not in ("Pending", "Running"):
            return None
        return requested

    def _validation_waits(self, run: RLRun, blocked: str) -> None:
        """Status for a canary asked for while the loop may not run: it waits, or it cannot run at all."""
        requested = self._validation_request(run)
        if requested is None or blocked == "the run is being deleted":
            return
        if blocked == "the run has ended":
            self._set_validation(
                validation_status(
                    requested,
                    "Failed",
                    "the run has ended: a canary checks a run before or while it trains, with its fleet, "
                    "pool and trainer; validate a new run",
                    started=None,
                )
            )
            return
        self._set_validation(validation_status(requested, "Pending", f"waiting: {blocked}", started=None))

    async def _validate(
        self,
        run: RLRun,
        requested: str,
        prepared: tuple[RunStore, TaskSet, SandboxPool, FleetAccess],
        stopped: Any,
        stopping: asyncio.Event,
    ) -> None:
        """Run the canary in a thread; stop it when the run is suspended, deleted or changed, or the
        operator stops. Its end goes to status.validation, the store and an Event."""
        store, task_set, pool, fleet = prepared
        name = self.key[2]
        started = datetime.now(UTC)
        self._set_validation(validation_status(requested, "Running", "starting", started=started))
        log.info("RLRun %s/%s: canary %s starting", self.namespace, name, requested)
        stop = threading.Event()

        def progress(message: str) -> None:
            update = validation_status(requested, "Running", message, started=started)
            with contextlib.suppress(RuntimeError):
                self.loop.call_soon_threadsafe(self._set_validation, update)

        backend = self._backend(run, pool, fleet, task_set)
        deadlines = pool.spec.deadlines

        def target() -> Any:
            try:
                return run_canary(
                    run,
                    requested=requested,
                    store=store,
                    backend=backend,
                    task_set=task_set,
                    stop=stop,
                    progress=progress,
                    # Image pull and scheduling, then the pool's own stage deadlines.
                    trial_budget_seconds=600.0
                    + deadlines.setup_seconds
                    + deadlines.agent_seconds
                    + deadlines.verify_seconds,
                    score_seconds=self.settings.canary_score_seconds,
                    poll_seconds=min(self.settings.poll_seconds, 1.0),
                )
            finally:
                backend.close()  # deletes the canary's pods (never the run's: it adopted none)

        task = asyncio.ensure_future(asyncio.to_thread(target))
        generation = run.metadata.generation or 0
        while not task.done():
            await self._sleep(stopped, stopping, self.settings.poll_seconds)
            current = self._run()
            if (
                stopped
                or stopping.is_set()
                or current is None
                or self._ended(current) is not None
                or (current.metadata.generation or 0) != generation
            ):
                stop.set()
        try:
            report = task.result()
        except Stopped:
            log.info(
                "RLRun %s/%s: canary %s stopped; it runs again when it can", self.namespace, name, requested
            )
            self._set_validation(
                validation_status(requested, "Pending", "stopped; it runs again", started=None)
            )
            return
        except Exception as exc:
            log.exception("RLRun %s/%s: canary %s failed", self.namespace, name, requested)
            message = f"the canary could not run: {type(exc).__name__}: {exc}"
            self._set_validation(
                validation_status(requested, "Failed", message, started=started, report=None)
            )
            return
        verdict = summary(report)
        self._set_validation(
            validation_status(requested, report.result, verdict, started=started, report=report)
        )
        log.info("RLRun %s/%s: canary %s %s: %s", self.namespace, name, requested, report.result, verdict)
        with contextlib.suppress(ApiError):
            await self.reconciler.client.event(
                run.to_wire(),
                type_="Warning" if report.result == "Failed" else "Normal",
                reason="ValidationFailed" if report.result == "Failed" else "Validated",
                message=f"canary {report.result}: {verdict}"[:1000],
                now=datetime.now(UTC),
            )
        fresh = self._run()
        progressed = (
            fresh is not None
            and fresh.status is not None
            and (fresh.status.step or fresh.status.trials.total)
        )
        if report.result == "Failed" and fresh is not None and not progressed:
            # Fail closed: a run that has not finished one trial yet does not start on a broken setup.
            await self._suspend(
                fresh,
                f"the canary failed before the first trial ({verdict})",
                "ValidationFailed",
                stopped,
                stopping,
            )

    def _run(self) -> RLRun | None:
        body = self.reconciler.store.objects.get(self.key)
        if body is None:
            return None
        try:
            return RLRun.model_validate(body)
        except ValidationError:
            return None  # the reconciler reports it

    def _ended(self, run: RLRun) -> str | None:
        """Why the run's loop must stop and clean up (None: it may go on)."""
        if run.metadata.model_extra and run.metadata.model_extra.get("deletionTimestamp"):
            return "the run is being deleted"
        if run.spec.suspend:
            return "the run is suspended"
        if is_terminal(run.status.conditions if run.status else []):
            return "the run has ended"
        return None

    def _blocked(self, run: RLRun) -> str | None:
        """Why the loop must not start now (None: it may)."""
        ended = self._ended(run)
        if ended is not None:
            return ended
        if time.monotonic() < self.reconciler.settle_until:
            return "the operator's watches are still listing"
        conditions = run.status.conditions if run.status else []
        for type_ in (T.VALIDATED, T.ROLLOUT_READY, T.SANDBOXES_READY):
            cond = find_condition(conditions, type_)
            if cond is None or cond.status != "True":
                return f"{type_} is not True"
        return None

    async def _sleep(self, stopped: Any, stopping: asyncio.Event, seconds: float) -> None:
        waits = [asyncio.ensure_future(stopped.wait()), asyncio.ensure_future(stopping.wait())]
        try:
            await asyncio.wait(waits, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waits:
                waiter.cancel()

    # -- starting -------------------------------------------------------------------------------------------

    def _referenced(self, kind: str, name: str) -> dict[str, Any]:
        body = self.reconciler.store.objects.get((kind, self.namespace, name))
        if body is None:
            raise StartProblem(f"{kind} {name} is not known to the operator yet")
        return body

    async def _prepare(self, run: RLRun) -> tuple[RunStore, TaskSet, SandboxPool, FleetAccess]:
        try:
            fleet = RolloutFleet.model_validate(self._referenced("RolloutFleet", fleet_name(run)))
            pool = SandboxPool.model_validate(self._referenced("SandboxPool", pool_name(run)))
        except ValidationError as exc:
            raise StartProblem(f"the run's fleet or pool does not parse: {exc.errors()[0]['msg']}") from exc
        spec = fleet.spec
        access = FleetAccess(
            url=fleet_url(run, spec.port),
            served_model_name=spec.served_model_name,
            capture_routed_experts=spec.settings.routed_experts_capture == "Enabled",
        )
        uri = resolve_uri(store_uri(run, self.reconciler.ctx), self.settings)
        try:
            store = await asyncio.to_thread(self._open_store, uri, run)
        except (StoreError, OSError, ValueError) as exc:
            raise StartProblem(f"the run store {uri} cannot be used: {exc}") from exc
        task_set = await self._task_set(run)
        return store, task_set, pool, access

    @staticmethod
    def _open_store(uri: str, run: RLRun) -> RunStore:
        store = RunStore(uri)
        # The trainer Job starts from the run as recorded in its store.
        body = {
            "apiVersion": run.api_version,
            "kind": run.kind,
            "metadata": {"name": run.metadata.name, "namespace": run.metadata.namespace},
            "spec": run.spec.to_wire(),
        }
        recorded = store.read_run_spec()
        if recorded is None or recorded.get("spec") != body["spec"]:
            store.write_run_spec(body)
        return store

    async def _task_set(self, run: RLRun) -> TaskSet:
        source = run.spec.tasks.source
        uri = source.uri
        try:
            if uri.startswith("configmap://"):
                name, _, data_key = uri.removeprefix("configmap://").partition("/")
                try:
                    cm = await self.reconciler.client.get("ConfigMap", self.namespace, name)
                except (ApiError, TransientError) as exc:
                    raise StartProblem(f"task set {uri}: {exc}") from exc
                text = ((cm or {}).get("data") or {}).get(data_key or "tasks.jsonl")
                if text is None:
                    raise StartProblem(f"task set {uri}: the ConfigMap or its key does not exist")
                return await asyncio.to_thread(_parse_jsonl, text, uri)
            if uri.startswith("builtin://"):
                raise StartProblem(
                    f"task set {uri} exists only in local runs (legorl run); use a task set with images"
                )
            location = resolve_uri(uri, self.settings)
            return await asyncio.to_thread(_read_task_set, location, source.format)
        except (TaskError, OSError, ValueError, ImportError) as exc:  # ImportError: no s3fs / gcsfs
            raise StartProblem(f"task set {uri} cannot be read: {exc}") from exc

    def _proxy_metrics_sink(self) -> Callable[[str], None] | None:
        """Finished trials' proxy metrics, summed into the operator's /metrics under this run."""
        proxies = getattr(self.operator_metrics, "proxies", None)
        if proxies is None:
            return None
        name, namespace = self.key[2], self.namespace
        return lambda text: proxies.add(text, namespace=namespace, run=name)

    def _backend(
        self, run: RLRun, pool: SandboxPool, fleet: FleetAccess, task_set: TaskSet
    ) -> KubeTrialBackend:
        return KubeTrialBackend(
            run=run,
            pool=pool,
            fleet=fleet,
            ctx=self.reconciler.ctx,
            api=LoopApi(self.loop, lambda: self.reconciler.client, self.settings),
            pods=self.pods,
            task_set=task_set,
            settings=self.settings,
            on_proxy_metrics=self._proxy_metrics_sink(),
        )

    def _start(
        self, run: RLRun, store: RunStore, task_set: TaskSet, pool: SandboxPool, fleet: FleetAccess
    ) -> _Running:
        backend = self._backend(run, pool, fleet, task_set)
        stop = threading.Event()

        def on_progress(progress: Progress) -> None:
            self._report_threadsafe(progress_report(progress, running=True, stopping=stop.is_set()))
            if self.progress_metrics is not None:
                self.progress_metrics.update(progress, namespace=self.namespace)

        def on_trial(record: TrialRecord) -> None:
            emit_trial_spans(self.tracer_provider, record, attributes={"k8s.namespace.name": self.namespace})

        try:
            controller = RunController(
                run,
                store=store,
                backend=backend,
                task_set=task_set,
                on_progress=on_progress,
                on_trial=on_trial if self.tracer_provider is not None else None,
                stop=stop,
                poll_seconds=min(self.settings.poll_seconds, 0.5),
            )
        except PlanError as exc:
            backend.close()
            raise StartProblem(str(exc)) from exc
        running = _Running(controller, backend, threading.Thread(), run.metadata.generation or 0)

        def target() -> None:
            try:
                running.outcome = controller.run()
                if running.outcome.reason == "BackendFailed":
                    backend.detach()  # no API: leave the pods for the next loop to adopt
            except BaseException as exc:  # noqa: BLE001 - reported by the daemon, which retries
                running.error = exc
                backend.detach()
            finally:
                backend.close()

        running.thread = threading.Thread(
            target=target, name=f"run-controller-{run.metadata.name}", daemon=True
        )
        self.report(ControllerReport(running=True, message="the run controller is starting"))
        running.thread.start()
        log.info("RLRun %s/%s: run controller started", self.namespace, run.metadata.name)
        return running

    async def _supervise(self, running: _Running, stopped: Any, stopping: asyncio.Event) -> None:
        """Wait for the loop to end; stop it (cleanly or by handing over) when it must."""
        self._current = running
        while running.thread.is_alive():
            if running.stop_mode is not None:
                await asyncio.sleep(min(self.settings.poll_seconds, 0.1))  # the loop is winding down
                continue
            await self._sleep(stopped, stopping, self.settings.poll_seconds)
            mode = self._stop_mode(running, stopped, stopping)
            if mode is None:
                continue
            running.stop_mode = mode
            log.info("RLRun %s/%s: stopping the run controller (%s)", self.namespace, self.key[2], mode)
            if mode == "hand over":
                running.backend.detach()
            running.controller.stop()

    def _stop_mode(self, running: _Running, stopped: Any, stopping: asyncio.Event) -> str | None:
        """None (keep going), `hand over` (leave the pods for the next controller) or `clean up`.

        A fleet or pool that stops being ready does not stop the loop (a weight sync, a replica
        restarting): trials ride it out or end with engine errors, which the loop counts."""
        if stopping.is_set():
            return "hand over"
        if stopped:
            reason = stopped.reason
            deleted = reason is not None and bool(reason & kopf.DaemonStoppingReason.RESOURCE_DELETED)
            return "clean up" if deleted else "hand over"
        run = self._run()
        if run is None or self._ended(run) is not None:
            return "clean up"
        if (run.metadata.generation or 0) != running.generation:
            return "hand over"
        if self._validation_request(run) is not None:
            return "hand over"  # the canary runs now; the loop restarts after it and adopts its pods
        return None


def trial_settings(memo: Any) -> TrialSettings:
    """The backend's settings from kopf's memo (tests put shorter timings there)."""
    value = memo.get("trial_settings") if hasattr(memo, "get") else None
    return value if isinstance(value, TrialSettings) else TrialSettings()


__all__ = ["RunDaemon", "StartProblem", "progress_report", "resolve_uri", "trial_settings"]

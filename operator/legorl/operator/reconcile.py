"""The reconcile service: render → apply what changed → compute status → patch it once.

Kopf glue (handlers.py) stays thin and calls into here; rendering and status are
pure functions; API I/O goes through `KubeClient`. A reconcile reads observed
state from the `Store` (the watch cache), never by listing the API server.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any, TypeVar

import httpx
from pydantic import ValidationError

from legorl.api import weight_versions
from legorl.api.common import Condition
from legorl.api.conditions import rlrun_phase, set_condition
from legorl.api.kinds import RLRun, RolloutFleet, SandboxPool
from legorl.api.labels import HASH_ANNOTATION, POLICY_VERSION_ANNOTATION, fleet_name, pool_name
from legorl.api.weight_versions import policy_version
from legorl.manifests.preflight import check_resource, check_run_against_fleet
from legorl.manifests.problems import Problem
from legorl.operator.kube import ApiError, KubeClient
from legorl.operator.observe import MAX_VERSION, Observed, PodView
from legorl.operator.patch import apply_merge_patch, merge_patch
from legorl.operator.render.common import RenderContext, owner_key
from legorl.operator.render.fleet import LWS_API, RenderError, model_location, render_fleet
from legorl.operator.render.pool import pod_template_hash, render_pool
from legorl.operator.render.run import render_run, store_uri
from legorl.operator.settings import OperatorSettings
from legorl.operator.status.fleet import compute_fleet_status, serving_leaders
from legorl.operator.status.pool import compute_pool_status
from legorl.operator.status.run import ControllerReport, compute_run_status, deadline, is_terminal
from legorl.operator.store import ObjectKey, Store

log = logging.getLogger("legorl.operator")

WARNING_WHEN = {
    ("Ready", "False"),
    ("Degraded", "True"),
    ("Failed", "True"),
    ("Validated", "False"),
    ("ImagesCached", "False"),
    ("DefensesVerified", "False"),
}
"""Condition (type, status) pairs whose transitions are posted as Warning events."""
QUIET_REASONS = {"ScaledToZero", "PullInProgress", "RolloutInProgress", "ModelLoading", "PrePullDisabled"}
"""Transitions into these are posted as Normal events: they are expected, not problems."""
CREATE_ONLY_TEMPLATE = {"Job": ("suspend", "parallelism")}
"""Kinds whose pod template the API server refuses to change: after creation only these spec
fields are patched."""
QUIET_AT_START = {"Degraded", "Failed", "Succeeded"}
"""Conditions whose first appearance as False is not posted as an Event."""
APPLY_GRACE_SECONDS = 10.0
RETRY_SECONDS = 2.0
"""Delay before an object whose reconcile failed transiently is tried again."""
"""After applying a child, wait this long for the watch to show it before re-applying it."""


ResourceT = TypeVar("ResourceT", RolloutFleet, SandboxPool, RLRun)


class TransientError(Exception):
    """A reconcile failed in a way that retrying will fix (kopf's TemporaryError upstream)."""


def _status_problem(exc: ValidationError) -> str:
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first["loc"])
    more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    return f"the stored object does not match the schema: {where}: {first['msg']}{more}"


@dataclass
class Reconciler:
    """One per operator process (in kopf's memo)."""

    settings: OperatorSettings
    ctx: RenderContext
    client_: KubeClient | None = None
    """Set once kopf has logged in (and again when it re-authenticates)."""
    store: Store = field(default_factory=Store)
    clock: Callable[[], datetime] = lambda: datetime.now(UTC)
    applied: dict[tuple[str, str, str], tuple[str, float]] = field(default_factory=dict)
    """(namespace, kind, name) → (hash, monotonic time) of the last apply by this process."""
    full_apply: dict[ObjectKey, float] = field(default_factory=dict)
    """When each object last had every child applied regardless of hashes (drift repair)."""
    locks: dict[ObjectKey, asyncio.Lock] = field(default_factory=dict)
    written: dict[ObjectKey, dict[str, Any]] = field(default_factory=dict)
    """The status this process last wrote to each object: what its Events are posted against (the
    watch cache can be older for a moment)."""
    task_sets: dict[tuple[str, str], tuple[float, list[str], bool]] = field(default_factory=dict)
    wakeups: dict[ObjectKey, asyncio.TimerHandle] = field(default_factory=dict)
    """Pending reconciles at a run's deadline."""
    version_checks: dict[ObjectKey, asyncio.TimerHandle] = field(default_factory=dict)
    """Each fleet's next look at what its engines serve (`settings.engine_version_seconds`)."""
    discovered: bool = False
    """Whether optional APIs (LeaderWorkerSet) have been looked up since login."""
    settle_until: float = 0.0
    """Monotonic time before which nothing is reconciled (the watches are still listing)."""
    controllers: dict[ObjectKey, ControllerReport] = field(default_factory=dict)
    """What each run's controller daemon last reported (`legorl.operator.runs`); read into its status."""
    _slots: asyncio.Semaphore | None = None
    _discovery: asyncio.Lock | None = None

    @property
    def client(self) -> KubeClient:
        if self.client_ is None:
            msg = "the operator has not logged in to the API server yet"
            raise TransientError(msg)
        return self.client_

    # --- entry points ---------------------------------------------------------------------
    async def reconcile(self, key: ObjectKey) -> None:
        """Reconcile one custom resource from the store (no-op if it is gone or going)."""
        wait = self.settle_until - time.monotonic()
        if wait > 0:
            asyncio.get_running_loop().call_later(wait, self.store.mark, key)
            return
        if not self.discovered:
            await self._discover()
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.settings.concurrency)
        lock = self.locks.setdefault(key, asyncio.Lock())
        # At most `concurrency` reconciles at once, whoever asks (kopf's handlers on a mass create
        # or a restart, the resync loop): an unbounded burst only queues inside the HTTP pool.
        async with lock, self._slots:
            body = self.store.objects.get(key)
            if body is None:
                self.written.pop(key, None)
                self.full_apply.pop(key, None)
                return
            if body.get("metadata", {}).get("deletionTimestamp"):
                return
            kind = key[0]
            try:
                if kind == "RolloutFleet":
                    await self._reconcile_fleet(body)
                elif kind == "SandboxPool":
                    await self._reconcile_pool(body)
                else:
                    await self._reconcile_run(body)
            except ApiError as exc:
                if exc.transient:
                    raise TransientError(str(exc)) from exc
                raise

    async def _discover(self) -> None:
        if self._discovery is None:
            self._discovery = asyncio.Lock()
        async with self._discovery:
            if self.discovered:
                return
            try:
                lws = await self.client.api_available(LWS_API)
            except ApiError as exc:
                raise TransientError(f"API discovery failed: {exc}") from exc
            self.ctx = replace(self.ctx, lws_available=lws)
            self.discovered = True
        log.info(
            "LeaderWorkerSet API %s", "found" if lws else "absent: multi-node fleets use StatefulSet groups"
        )

    async def reconcile_dirty(self) -> int:
        """Reconcile every object marked dirty; returns how many."""
        keys = self.store.take_dirty()
        if not keys:
            return 0

        async def one(key: ObjectKey) -> None:
            try:
                await self.reconcile(key)
            except TransientError as exc:
                log.warning("retrying %s/%s %s: %s", key[1], key[2], key[0], exc)
                asyncio.get_running_loop().call_later(RETRY_SECONDS, self.store.mark, key)
            except ApiError as exc:
                log.error("reconcile of %s %s/%s failed: %s", key[0], key[1], key[2], exc)

        await asyncio.gather(*(one(k) for k in keys))
        return len(keys)

    # --- children -------------------------------------------------------------------------
    async def _sync_children(
        self, key: ObjectKey, desired: list[dict[str, Any]], observed: Observed
    ) -> list[str]:
        """Apply changed children and delete ones no longer desired; returns apply errors."""
        now = time.monotonic()
        force = now - self.full_apply.get(key, -1e18) > self.settings.resync_seconds
        namespace = key[1]
        errors: list[str] = []
        wanted = set()
        for obj in desired:
            kind, name = obj["kind"], obj["metadata"]["name"]
            wanted.add((kind, name))
            digest = obj["metadata"]["annotations"][HASH_ANNOTATION]
            current = observed.child(kind, name)
            last = self.applied.get((namespace, kind, name))
            recently = last is not None and last[0] == digest and now - last[1] < APPLY_GRACE_SECONDS
            if not force and ((current is not None and current.hash == digest) or recently):
                continue
            try:
                if kind in CREATE_ONLY_TEMPLATE and current is not None:
                    await self._patch_mutable(namespace, obj)
                else:
                    await self.client.apply(obj)
            except ApiError as exc:
                if exc.transient:
                    raise
                errors.append(f"{kind} {name}: {exc.message}")
                continue
            self.applied[(namespace, kind, name)] = (digest, now)
        for kind, name in list(observed.children):
            if (kind, name) not in wanted:
                await self.client.delete(kind, namespace, name)
                self.applied.pop((namespace, kind, name), None)
        if force and not errors:
            self.full_apply[key] = now
        return errors

    async def _patch_mutable(self, namespace: str, obj: dict[str, Any]) -> None:
        """Update what may change on an existing Job (suspend, parallelism) and leave its pod
        template, immutable once created, as it was: a changed trainer image or store takes
        effect when the trainer Job is next created."""
        spec = obj["spec"]
        patch = {
            "metadata": {"annotations": obj["metadata"]["annotations"]},
            "spec": {key: spec[key] for key in CREATE_ONLY_TEMPLATE[obj["kind"]] if key in spec},
        }
        await self.client.merge_patch(obj["kind"], namespace, obj["metadata"]["name"], patch)

    # --- status ---------------------------------------------------------------------------
    async def _write_status(self, body: dict[str, Any], status: dict[str, Any]) -> None:
        """Patch `.status` to `status` (a minimal merge patch, nulls for what went away); no
        request at all when nothing changed."""
        old = body.get("status") or {}
        meta = body["metadata"]
        key: ObjectKey = (body["kind"], meta.get("namespace", "default"), meta["name"])
        patch = merge_patch(old, status)
        if not patch:
            self.written[key] = copy.deepcopy(status)
            return
        try:
            await self.client.patch_status(
                body["kind"], meta.get("namespace", "default"), meta["name"], patch
            )
        except ApiError as exc:
            if exc.status != 404:
                raise
            # Deleted between the cache read and this patch (e.g. garbage-collected with its owner):
            # there is no status left to write, and the watch brings the deletion next.
            log.debug(
                "%s %s/%s is gone; status not written", body["kind"], meta.get("namespace"), meta["name"]
            )
            return
        body["status"] = apply_merge_patch(old, patch)  # what the watch will show; no second patch meanwhile
        # Transitions from what this process last wrote, where it wrote before: a watch event older than
        # that write (e.g. of kopf's own patch, sent before it) can replace the cached body while the write
        # is in flight, and diffing against its older status posted every Event twice (seen under load).
        before = self.written.get(key, old)
        self.written[key] = copy.deepcopy(status)
        await self._post_transitions(body, before.get("conditions") or [], status.get("conditions") or [])

    async def _post_transitions(
        self, body: dict[str, Any], before: list[dict[str, Any]], after: list[dict[str, Any]]
    ) -> None:
        old = {c.get("type"): (c.get("status"), c.get("reason")) for c in before}
        for cond in after:
            if old.get(cond["type"]) == (cond["status"], cond["reason"]):
                continue
            if cond["type"] not in old and cond["status"] == "False" and cond["type"] in QUIET_AT_START:
                continue  # "nothing is wrong, nothing ended" at creation is not news
            warning = (cond["type"], cond["status"]) in WARNING_WHEN and cond["reason"] not in QUIET_REASONS
            message = f"{cond['type']}={cond['status']}" + (
                f": {cond['message']}" if cond.get("message") else ""
            )
            try:
                await self.client.event(
                    body,
                    type_="Warning" if warning else "Normal",
                    reason=cond["reason"],
                    message=message,
                    now=self.clock(),
                )
            except ApiError as exc:  # an event is best effort; the status already says it
                log.warning("could not post event for %s: %s", body["metadata"]["name"], exc)

    # --- shared preamble --------------------------------------------------------------------
    def _place(self, body: dict[str, Any]) -> tuple[ObjectKey, Observed]:
        """The object's key and what is observed of its children."""
        ns, name = body["metadata"].get("namespace", "default"), body["metadata"]["name"]
        return (body["kind"], ns, name), self.store.observed(ns, owner_key(body["kind"], name))

    async def _parse(self, body: dict[str, Any], model: type[ResourceT], condition: str) -> ResourceT | None:
        """The typed object, or None after reporting on `condition` why the stored one does not parse."""
        try:
            return model.model_validate(body)
        except ValidationError as exc:
            await self._write_invalid(body, condition, _status_problem(exc))
            return None

    # --- RolloutFleet ---------------------------------------------------------------------
    async def _reconcile_fleet(self, body: dict[str, Any]) -> None:
        key, observed = self._place(body)
        fleet = await self._parse(body, RolloutFleet, "Ready")
        if fleet is None:
            return
        error: str | None = None
        try:
            desired = render_fleet(fleet, self.ctx)
        except RenderError as exc:
            error = str(exc)  # keep what runs: a fixed spec picks up from there
        else:
            errors = await self._sync_children(key, desired, observed)
            if errors:
                error = "the API server refused children: " + "; ".join(errors)
        if self.settings.engine_version_seconds > 0 and serving_leaders(fleet, observed.pods):
            observed = await self._engine_versions(key[1], fleet, observed)
            # Weight syncs change no Kubernetes object: look again while replicas serve.
            self._check_versions_again(key)
        status = compute_fleet_status(fleet, observed, self.clock(), render_error=error)
        await self._write_status(body, status.to_wire())

    async def _engine_versions(self, namespace: str, fleet: RolloutFleet, observed: Observed) -> Observed:
        """Ask each serving replica which policy version it serves and record a changed answer on its pod
        (`legorl.dev/policy-version`) and in what this reconcile reports. The trainer loads weights over
        HTTP and has no Kubernetes access, so nothing else would tell the fleet's status (`kubectl get
        rolloutfleets` showed v0 through a whole run on a real node). A replica that does not answer keeps
        what its pod says."""
        leaders = serving_leaders(fleet, observed.pods)
        if not leaders:
            return observed
        async with httpx.AsyncClient(timeout=httpx.Timeout(2.0, connect=1.0)) as http:
            answers = await asyncio.gather(*(_served_version(http, p, fleet.spec.port) for p in leaders))
        changed: dict[str, str] = {}
        for pod, version in zip(leaders, answers, strict=True):
            if version is None or version == pod.policy_version:
                continue
            try:
                await self.client.merge_patch(
                    "Pod",
                    namespace,
                    pod.name,
                    {"metadata": {"annotations": {POLICY_VERSION_ANNOTATION: version}}},
                )
            except ApiError as exc:  # reported from the answer anyway; the next look writes it again
                log.warning("could not record policy version %s on pod %s: %s", version, pod.name, exc)
            changed[pod.name] = version
        if not changed:
            return observed
        pods = [replace(p, policy_version=changed.get(p.name, p.policy_version)) for p in observed.pods]
        return replace(observed, pods=pods)

    def _check_versions_again(self, key: ObjectKey) -> None:
        handle = self.version_checks.pop(key, None)
        if handle is not None:
            handle.cancel()
        delay = self.settings.engine_version_seconds
        self.version_checks[key] = asyncio.get_running_loop().call_later(delay, self.store.mark, key)

    # --- SandboxPool ----------------------------------------------------------------------
    async def _reconcile_pool(self, body: dict[str, Any]) -> None:
        key, observed = self._place(body)
        ns = key[1]
        pool = await self._parse(body, SandboxPool, "Ready")
        if pool is None:
            return
        images: list[str] = []
        if pool.spec.source.task_set is not None:
            images, _ = await self.task_set_images(ns, pool.spec.source.task_set.uri)
        desired = render_pool(pool, self.ctx, images)
        errors = await self._sync_children(key, desired, observed)
        status = compute_pool_status(
            pool,
            observed,
            self.clock(),
            task_set_images=images,
            pod_template_hash=pod_template_hash(pool, self.ctx),
        )
        if errors:
            status = status.model_copy(
                update={"conditions": self._refused(status.conditions, "Ready", errors, pool)}
            )
        await self._write_status(body, status.to_wire())

    async def task_set_images(self, namespace: str, uri: str) -> tuple[list[str], bool]:
        """(images named by a `configmap://name/key` task set, whether it was found).

        Task sets in object stores are read by the run controller, which names their
        images through the Lookahead annotation; the operator holds no store credentials.
        """
        if not uri.startswith("configmap://"):
            return [], True  # not the operator's to read (see render.pool.operator_reads_task_set)
        ref = uri.removeprefix("configmap://")
        cm_name, _, data_key = ref.partition("/")
        now = time.monotonic()
        cached = self.task_sets.get((namespace, ref))
        if cached is not None and now - cached[0] < self.settings.resync_seconds:
            return cached[1], cached[2]
        cm = await self.client.get("ConfigMap", namespace, cm_name)
        text = ((cm or {}).get("data") or {}).get(data_key or "tasks.jsonl")
        found = text is not None
        images: list[str] = []
        for line in (text or "").splitlines():
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                continue
            image = entry.get("image") if isinstance(entry, dict) else None
            if isinstance(image, str) and image:
                images.append(image)
        self.task_sets[(namespace, ref)] = (now, images, found)
        return images, found

    # --- RLRun ----------------------------------------------------------------------------
    def _referenced(self, kind: str, namespace: str, name: str) -> RolloutFleet | SandboxPool | None:
        body = self.store.objects.get((kind, namespace, name))
        if body is None:
            return None
        model = RolloutFleet if kind == "RolloutFleet" else SandboxPool
        try:
            return model.model_validate(body)
        except ValidationError:
            return None

    async def _run_problems(
        self, run: RLRun, fleet: RolloutFleet | None, pool: SandboxPool | None
    ) -> list[Problem]:
        problems = check_resource(run, self.ctx.default_store_uri)
        ns = run.metadata.namespace or "default"
        if run.spec.fleet_ref is not None:
            if fleet is None:
                problems.append(
                    Problem(
                        "error",
                        "spec.fleetRef.name",
                        f"RolloutFleet {run.spec.fleet_ref.name!r} does not exist in namespace {ns}; "
                        "create it or point fleetRef at an existing one",
                        "reference",
                    )
                )
            else:
                problems += list(check_run_against_fleet(run, fleet, self.ctx.default_store_uri))
        if run.spec.pool_ref is not None and pool is None:
            problems.append(
                Problem(
                    "error",
                    "spec.poolRef.name",
                    f"SandboxPool {run.spec.pool_ref.name!r} does not exist in namespace {ns}; "
                    "create it or point poolRef at an existing one",
                    "reference",
                )
            )
        if run.spec.fleet is not None:
            probe = RolloutFleet.model_validate(
                {
                    "metadata": {"name": fleet_name(run), "namespace": ns},
                    "spec": {**run.spec.fleet.to_wire(), "model": run.spec.policy.checkpoint.to_wire()},
                }
            )
            try:
                model_location(probe)
            except RenderError as exc:
                problems.append(Problem("error", "spec.policy.checkpoint.uri", exc.message, "preflight"))
        task_uri = run.spec.tasks.source.uri
        if task_uri.startswith("configmap://"):
            _, found = await self.task_set_images(ns, task_uri)
            if not found:
                problems.append(
                    Problem(
                        "error",
                        "spec.tasks.source.uri",
                        f"task set {task_uri} is not readable: the ConfigMap or its key does not exist",
                        "preflight",
                    )
                )
        return problems

    async def _reconcile_run(self, body: dict[str, Any]) -> None:
        key, observed = self._place(body)
        ns = key[1]
        run = await self._parse(body, RLRun, "Validated")
        if run is None:
            return
        self.store.set_dependencies(
            key, [("RolloutFleet", ns, fleet_name(run)), ("SandboxPool", ns, pool_name(run))]
        )
        fleet = self._referenced("RolloutFleet", ns, fleet_name(run))
        pool = self._referenced("SandboxPool", ns, pool_name(run))
        problems = await self._run_problems(
            run,
            fleet if isinstance(fleet, RolloutFleet) else None,
            pool if isinstance(pool, SandboxPool) else None,
        )
        errors = [p for p in problems if p.severity == "error"]
        terminal = run.status is not None and is_terminal(run.status.conditions)
        now = self.clock()
        # Compute the status first: a deadline that just passed must already scale things down.
        status = compute_run_status(
            run,
            observed,
            now,
            fleet=fleet if isinstance(fleet, RolloutFleet) else None,
            pool=pool if isinstance(pool, SandboxPool) else None,
            problems=problems,
            store_uri=store_uri(run, self.ctx),
            controller=self.controllers.get(key),
        )
        terminal = terminal or is_terminal(status.conditions)
        # A failed preflight starts nothing new and keeps what exists: a later fix of a typo
        # resumes the run instead of having torn it down.
        if not errors:
            rendered = run
            if terminal and not run.spec.suspend:
                # An ended run keeps its store but holds no GPUs: render it as suspended.
                rendered = run.model_copy(update={"spec": run.spec.model_copy(update={"suspend": True})})
            sync = None
            if isinstance(fleet, RolloutFleet):
                # The referenced fleet's sync method decides what the trainer renders for NCCL (an inline
                # fleet's own method wins inside render_run).
                port, sync = fleet.spec.port, fleet.spec.weight_sync.method
            else:
                port = run.spec.fleet.port if run.spec.fleet is not None else 8000
            refused = await self._sync_children(
                key, render_run(rendered, self.ctx, port, fleet_sync=sync), observed
            )
            if refused:
                conditions = self._refused(status.conditions, "Validated", refused, run)
                phase, reason = rlrun_phase(conditions, run.spec.suspend)
                status = status.model_copy(
                    update={"conditions": conditions, "phase": phase.value, "reason": reason}
                )
        await self._write_status(body, status.to_wire())
        self._wake_at_deadline(key, run.model_copy(update={"status": status}), terminal)

    def _refused(
        self, conditions: list[Condition], type_: str, errors: list[str], res: SandboxPool | RLRun
    ) -> list[Condition]:
        """`type_` set False/InvalidSpec with what the API server said about the children."""
        log.error("%s %s: the API server refused children: %s", res.kind, res.metadata.name, errors)
        return set_condition(
            conditions,
            type_=type_,
            status="False",
            reason="InvalidSpec",
            message="the API server refused objects rendered from this spec: " + "; ".join(errors),
            generation=res.metadata.generation or 0,
            now=self.clock(),
        )

    def _wake_at_deadline(self, key: ObjectKey, run: RLRun, terminal: bool) -> None:
        """Reconcile again the moment activeDeadlineSeconds runs out (no waiting for a resync)."""
        handle = self.wakeups.pop(key, None)
        if handle is not None:
            handle.cancel()
        end = deadline(run)
        if terminal or end is None:
            return
        delay = max(0.0, (end - self.clock()).total_seconds()) + 0.05
        self.wakeups[key] = asyncio.get_running_loop().call_later(delay, self.store.mark, key)

    async def _write_invalid(self, body: dict[str, Any], type_: str, message: str) -> None:
        now = self.clock()
        previous = [Condition.model_validate(c) for c in (body.get("status") or {}).get("conditions") or []]
        conditions = set_condition(
            previous,
            type_=type_,
            status="False",
            reason="InvalidSpec",
            message=message,
            generation=int(body["metadata"].get("generation") or 0),
            now=now,
        )
        status = dict(body.get("status") or {})
        status["conditions"] = [c.to_wire() for c in conditions]
        status["observedGeneration"] = int(body["metadata"].get("generation") or 0)
        if body["kind"] == "RLRun":
            status["phase"], status["reason"] = "Invalid", "InvalidSpec"
        await self._write_status(body, status)


async def _served_version(http: httpx.AsyncClient, pod: PodView, port: int) -> str | None:
    """The policy version one engine pod serves (vLLM's startup `default` is `v0`), or None when it does
    not say (not up, no dev-mode routes, or an answer without `weight_version`)."""
    host = f"[{pod.ip}]" if ":" in pod.ip else pod.ip
    try:
        response = await http.get(f"http://{host}:{port}/weight_info")
        body = response.json() if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError) as exc:
        log.debug("engine pod %s did not say what it serves: %s", pod.name, exc)
        return None
    version = weight_versions.from_weight_info(body)
    return policy_version(version) if version is not None and len(version) <= MAX_VERSION else None

"""Kopf glue: watch streams feed the store (async handlers: they run on the event loop, never in
kopf's thread pool, so the store needs no locks); create/update/resume reconcile at once; a
background loop reconciles whatever changed; a daemon per RLRun runs the run controller
(`legorl.operator.runs`), whose trial and verify pods the pod watch also feeds to `TrialPods`.

Handlers stay short: the work is in `reconcile.Reconciler`.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import kopf

from legorl.api._base import API_GROUP, API_VERSION
from legorl.operator.kube import RESOURCES, KubeClient, credentials_from_kopf
from legorl.operator.metrics import MeteredReconciler, OperatorMetrics, start_metrics_server
from legorl.operator.reconcile import Reconciler, TransientError
from legorl.operator.render.common import MANAGED_BY
from legorl.operator.runs import RunDaemon, trial_settings
from legorl.operator.store import CUSTOM_KINDS, ObjectKey
from legorl.operator.trials import TrialPods

log = logging.getLogger("legorl.operator")

MANAGED = {"app.kubernetes.io/managed-by": MANAGED_BY}
CHILD_KINDS = (
    "ServiceAccount",
    "Service",
    "Deployment",
    "StatefulSet",
    "DaemonSet",
    "Job",
    "PodDisruptionBudget",
    "NetworkPolicy",
    "LeaderWorkerSet",
)
LoginFn = Callable[..., Any]


def _raw(body: Mapping[str, Any]) -> dict[str, Any]:
    """A plain, private copy of a kopf body."""
    return copy.deepcopy({k: body[k] for k in body})


def _reconciler(memo: Any) -> Reconciler:
    reconciler = memo["reconciler"] if isinstance(memo, Mapping) else memo.reconciler
    assert isinstance(reconciler, Reconciler)
    return reconciler


def _group_version(kind: str) -> tuple[str, str, str]:
    res = RESOURCES[kind]
    group, _, version = res.group_version.rpartition("/")
    return group, version, res.plural


def build_registry(login: LoginFn | None = None) -> kopf.OperatorRegistry:
    """Every handler of the operator, in a registry of its own (no import-time globals)."""
    registry = kopf.OperatorRegistry()

    @kopf.on.login(registry=registry)
    async def authenticate(memo: Any, **kwargs: Any) -> kopf.ConnectionInfo | None:
        # Async, so it runs on the operator's loop (a sync handler would run in a worker thread,
        # where the old client cannot be closed).
        info: kopf.ConnectionInfo | None
        if login is not None:
            info = login(memo=memo, **kwargs)
        else:
            info = kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)
        if info is not None:
            reconciler = _reconciler(memo)
            old = reconciler.client_
            reconciler.client_ = KubeClient(credentials_from_kopf(info))
            if old is not None:
                await old.close()
        return info

    @kopf.on.startup(registry=registry)
    async def start(memo: Any, **_: Any) -> None:
        reconciler = _reconciler(memo)
        reconciler.settle_until = time.monotonic() + reconciler.settings.settle_seconds
        memo["stopping"] = asyncio.Event()
        if not isinstance(memo.get("trial_pods"), TrialPods):
            memo["trial_pods"] = TrialPods()
        memo["loop"] = asyncio.get_running_loop().create_task(_resync_loop(_reconciler(memo)))
        await _start_metrics(memo, reconciler)

    @kopf.on.cleanup(registry=registry)
    async def stop(memo: Any, **_: Any) -> None:
        memo["stopping"].set()
        task = memo.get("loop")
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        server = memo.get("metrics_server")
        if server is not None:
            await server.cleanup()
        reconciler = _reconciler(memo)
        if reconciler.client_ is not None:
            await reconciler.client_.close()

    for kind in CHILD_KINDS:
        group, version, plural = _group_version(kind)

        @kopf.on.event(group, version, plural, labels=MANAGED, registry=registry, id=f"watch-{plural}")
        async def child_event(event: kopf.RawEvent, namespace: str | None, memo: Any, **_: Any) -> None:
            _reconciler(memo).store.child_event(
                namespace or "", event["object"], event.get("type") == "DELETED"
            )

    @kopf.on.event("", "v1", "pods", labels=MANAGED, registry=registry, id="watch-pods")
    async def pod_event(event: kopf.RawEvent, namespace: str | None, memo: Any, **_: Any) -> None:
        deleted = event.get("type") == "DELETED"
        _reconciler(memo).store.pod_event(namespace or "", event["object"], deleted)
        trial_pods = memo.get("trial_pods")
        if isinstance(trial_pods, TrialPods):
            trial_pods.update(namespace or "", event["object"], deleted)

    for kind in CUSTOM_KINDS:
        _register_custom(registry, kind)

    @kopf.daemon(API_GROUP, API_VERSION, "rlruns", registry=registry)
    async def run_controller(
        stopped: kopf.DaemonStopped, namespace: str | None, name: str, memo: Any, **_: Any
    ) -> None:
        """The run controller of one RLRun: the RL loop, once its fleet and pool are ready."""
        key: ObjectKey = ("RLRun", namespace or "", name)
        metrics = memo.get("metrics")
        daemon = RunDaemon(
            key,
            reconciler=_reconciler(memo),
            pods=memo["trial_pods"],
            settings=trial_settings(memo),
            operator_metrics=metrics,
            tracer_provider=memo.get("tracer_provider"),
        )
        # The operator's stop as well as this daemon's: kopf may respawn a daemon for a late event
        # while shutting down, and that one would otherwise sit until kopf cancels it.
        await daemon.serve(stopped, memo["stopping"])

    return registry


def _register_custom(registry: kopf.OperatorRegistry, kind: str) -> None:
    plural = RESOURCES[kind].plural

    @kopf.on.event(API_GROUP, API_VERSION, plural, registry=registry, id=f"watch-{plural}")
    async def object_event(event: kopf.RawEvent, namespace: str | None, memo: Any, **_: Any) -> None:
        _reconciler(memo).store.object_event(
            kind, namespace or "", event["object"], event.get("type") == "DELETED"
        )

    @kopf.on.resume(API_GROUP, API_VERSION, plural, registry=registry, id=f"reconcile-{plural}-resume")
    @kopf.on.create(API_GROUP, API_VERSION, plural, registry=registry, id=f"reconcile-{plural}-create")
    @kopf.on.update(API_GROUP, API_VERSION, plural, registry=registry, id=f"reconcile-{plural}-update")
    async def reconcile(body: kopf.Body, namespace: str | None, name: str, memo: Any, **_: Any) -> None:
        reconciler = _reconciler(memo)
        key: ObjectKey = (kind, namespace or "", name)
        fresh = _raw(body)
        known = reconciler.store.objects.get(key)
        if known is not None and "status" in known:
            # The store may hold a status this operator wrote after kopf's copy was taken; diffing
            # against the older one would re-send changes and post their Events twice.
            fresh["status"] = known["status"]
        reconciler.store.objects[key] = fresh
        try:
            await reconciler.reconcile(key)
        except TransientError as exc:
            raise kopf.TemporaryError(str(exc), delay=5) from exc


async def _start_metrics(memo: Any, reconciler: Reconciler) -> None:
    """The reconciler's metrics in the memo (`memo["metrics"].runs` is what run daemons feed), and
    their endpoint when the settings give it a port."""
    metrics = reconciler.metrics if isinstance(reconciler, MeteredReconciler) else OperatorMetrics(reconciler)
    memo["metrics"] = metrics
    if reconciler.settings.metrics_port:
        memo["metrics_server"] = await start_metrics_server(
            metrics.registry, reconciler.settings.metrics_port
        )


async def _resync_loop(reconciler: Reconciler) -> None:
    """Reconcile what changed, in small batches; everything at least every resync period."""
    settings = reconciler.settings
    loop = asyncio.get_running_loop()
    last_full = loop.time()
    while True:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(reconciler.store.wakeup.wait(), timeout=settings.resync_seconds)
        await asyncio.sleep(settings.debounce_seconds)  # let a burst of watch events settle
        if reconciler.client_ is None:
            continue
        if loop.time() - last_full >= settings.resync_seconds:
            reconciler.store.mark_all()
            last_full = loop.time()
        try:
            await reconciler.reconcile_dirty()
        except Exception:  # the loop must outlive any one bad object
            log.exception("reconcile loop iteration failed")

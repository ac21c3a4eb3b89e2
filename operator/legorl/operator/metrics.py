"""The operator's Prometheus metrics, served at `/metrics` on their own port from the operator's loop.

What is measured:

- every reconcile, by kind: how many, how they ended, how long they took (`MeteredReconciler`, the
  `Reconciler` that `main.make_reconciler` builds);
- what the watch cache holds when scraped: custom resources by kind and state, managed pods by
  component and phase (trial and verify pods included), objects waiting to be reconciled;
- the run controllers this operator hosts: `runs` is a `ProgressMetrics` their `on_progress` feeds;
- the proxies of the trials they collected: `proxies` sums each finished trial's proxy metrics.

The state gauges are computed from the store at scrape time, on the event loop that owns it (the
server is an aiohttp app on that loop), so nothing is copied on every watch event and no lock is
needed. Labels are closed sets (kind, state, component, phase, result); no object or trial names.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from legorl.api.labels import COMPONENT_LABEL
from legorl.operator.reconcile import Reconciler, TransientError
from legorl.operator.store import CUSTOM_KINDS, ObjectKey
from legorl.telemetry.metrics import ProgressMetrics, ProxyTotals, new_registry

if TYPE_CHECKING:
    from aiohttp import web
    from prometheus_client import CollectorRegistry
    from prometheus_client.metrics_core import Metric

__all__ = [
    "OPERATOR_METRICS",
    "MeteredReconciler",
    "OperatorMetrics",
    "resource_state",
    "start_metrics_server",
]

log = logging.getLogger("legorl.operator")

MetricType = Literal["gauge", "counter", "histogram"]

OPERATOR_METRICS: dict[str, tuple[MetricType, str]] = {
    "legorl_operator_reconciles_total": (
        "counter",
        "Reconciles of custom resources, by kind and result (ok, transient: retried, error).",
    ),
    "legorl_operator_reconcile_errors_total": (
        "counter",
        "Reconciles that failed (transient or not), by kind.",
    ),
    "legorl_operator_reconcile_seconds": ("histogram", "Time one reconcile took, by kind."),
    "legorl_operator_resources": (
        "gauge",
        "Custom resources in the watch cache, by kind and state (an RLRun's phase; Ready, NotReady or "
        "Degraded for fleets and pools; Unknown before the operator wrote a status).",
    ),
    "legorl_operator_pods": (
        "gauge",
        "Pods the operator manages, by component (trial, verify, ...) and phase.",
    ),
    "legorl_operator_dirty_objects": ("gauge", "Custom resources waiting to be reconciled."),
}
"""Every metric the operator itself defines: name (as scraped) → (type, help). The run controllers'
are `legorl.telemetry.metrics.RUN_METRICS`."""

_RECONCILE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def _condition(status: dict[str, Any], type_: str) -> str | None:
    for cond in status.get("conditions") or []:
        if isinstance(cond, dict) and cond.get("type") == type_:
            return str(cond.get("status"))
    return None


def resource_state(kind: str, body: dict[str, Any]) -> str:
    """A custom resource's state for `legorl_operator_resources` (a closed set). Pure."""
    status = body.get("status")
    if not isinstance(status, dict) or not status.get("conditions"):
        return "Unknown"
    if kind == "RLRun":
        return str(status.get("phase") or "Unknown")
    if _condition(status, "Degraded") == "True":
        return "Degraded"
    return "Ready" if _condition(status, "Ready") == "True" else "NotReady"


class OperatorMetrics:
    """The registry of one operator process: reconcile counters, the cache collector, and `runs`."""

    def __init__(
        self, reconciler: Reconciler | None = None, registry: CollectorRegistry | None = None
    ) -> None:
        from prometheus_client import Counter as PromCounter  # noqa: PLC0415
        from prometheus_client import Histogram  # noqa: PLC0415

        self.registry = registry if registry is not None else new_registry()
        self.reconciler = reconciler
        """Whose store the state gauges read (set by `MeteredReconciler`, or later)."""
        self.reconciles = PromCounter(
            "legorl_operator_reconciles",
            OPERATOR_METRICS["legorl_operator_reconciles_total"][1],
            ["kind", "result"],
            registry=self.registry,
        )
        self.errors = PromCounter(
            "legorl_operator_reconcile_errors",
            OPERATOR_METRICS["legorl_operator_reconcile_errors_total"][1],
            ["kind"],
            registry=self.registry,
        )
        self.seconds = Histogram(
            "legorl_operator_reconcile_seconds",
            OPERATOR_METRICS["legorl_operator_reconcile_seconds"][1],
            ["kind"],
            buckets=_RECONCILE_BUCKETS,
            registry=self.registry,
        )
        for kind in CUSTOM_KINDS:  # every series from the start: rate() needs the zero
            self.errors.labels(kind=kind)
            self.seconds.labels(kind=kind)
            for result in ("ok", "transient", "error"):
                self.reconciles.labels(kind=kind, result=result)
        self.registry.register(_CacheCollector(self))
        self.runs = ProgressMetrics(self.registry)
        """The hosted run controllers' figures: pass `runs.update` as their `on_progress`."""
        self.proxies = ProxyTotals(self.registry)
        """Finished trials' proxy counters: `proxies.add(<the proxy's /metrics text>, namespace=, run=)`."""

    def observe_reconcile(self, kind: str, seconds: float, result: str) -> None:
        self.reconciles.labels(kind=kind, result=result).inc()
        if result != "ok":
            self.errors.labels(kind=kind).inc()
        self.seconds.labels(kind=kind).observe(seconds)


class _CacheCollector:
    """The state gauges, read from the reconciler's store when scraped."""

    def __init__(self, metrics: OperatorMetrics) -> None:
        self.metrics = metrics

    def describe(self) -> Iterator[Metric]:
        return self._families(None)

    def collect(self) -> Iterator[Metric]:
        return self._families(self.metrics.reconciler)

    def _families(self, reconciler: Reconciler | None) -> Iterator[Metric]:
        from prometheus_client.core import GaugeMetricFamily  # noqa: PLC0415

        resources = GaugeMetricFamily(
            "legorl_operator_resources",
            OPERATOR_METRICS["legorl_operator_resources"][1],
            labels=["kind", "state"],
        )
        pods = GaugeMetricFamily(
            "legorl_operator_pods", OPERATOR_METRICS["legorl_operator_pods"][1], labels=["component", "phase"]
        )
        dirty = GaugeMetricFamily(
            "legorl_operator_dirty_objects", OPERATOR_METRICS["legorl_operator_dirty_objects"][1]
        )
        if reconciler is not None:
            store = reconciler.store
            states: Counter[tuple[str, str]] = Counter(
                (kind, resource_state(kind, body)) for (kind, _, _), body in store.objects.items()
            )
            for kind in CUSTOM_KINDS:
                states.setdefault((kind, "Unknown"), 0)
            for (kind, state), count in sorted(states.items()):
                resources.add_metric([kind, state], count)
            phases: Counter[tuple[str, str]] = Counter(
                (pod.labels.get(COMPONENT_LABEL, "unknown"), pod.phase)
                for bucket in store.pods.values()
                for pod in bucket.values()
            )
            for (component, phase), count in sorted(phases.items()):
                pods.add_metric([component, phase], count)
            dirty.add_metric([], len(store.dirty))
        yield resources
        yield pods
        yield dirty


@dataclass
class MeteredReconciler(Reconciler):
    """The operator's `Reconciler`, timing and counting every reconcile it does (kopf's handlers and
    the resync loop alike come through `reconcile`)."""

    metrics: OperatorMetrics = field(default_factory=OperatorMetrics)

    def __post_init__(self) -> None:
        self.metrics.reconciler = self

    async def reconcile(self, key: ObjectKey) -> None:
        body = self.store.objects.get(key)
        if (
            self.settle_until > time.monotonic()
            or body is None
            or body.get("metadata", {}).get("deletionTimestamp")
        ):
            await super().reconcile(key)  # postponed or nothing to do: not a reconcile
            return
        started = time.perf_counter()
        result = "error"
        try:
            await super().reconcile(key)
            result = "ok"
        except TransientError:
            result = "transient"
            raise
        finally:
            self.metrics.observe_reconcile(key[0], time.perf_counter() - started, result)


async def start_metrics_server(
    registry: CollectorRegistry,
    port: int,
    host: str = "0.0.0.0",  # noqa: S104 - a pod's metrics port, for Prometheus to scrape
) -> web.AppRunner:
    """Serve `registry` at `http://host:port/metrics` from the running event loop; `cleanup()` the
    returned runner to stop it."""
    from aiohttp import web  # noqa: PLC0415 - kopf's own HTTP stack
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest  # noqa: PLC0415

    async def metrics(_request: web.Request) -> web.Response:
        response = web.Response(body=generate_latest(registry))
        response.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return response

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    log.info("metrics at http://%s:%d/metrics", host, port)
    return runner

"""The run controller's figures as Prometheus metrics, and a small `/metrics` server for any process.

`ProgressMetrics` keeps the latest `Progress` snapshot of each run it is given (`update`, from the run
controller's `on_progress`, in whatever thread that runs) and turns them into metric families when
scraped; `progress_samples` is the pure Progress → samples step. Counters come from the snapshot's
own running totals, so a restarted controller that resumes its totals from the run store keeps them
monotonic. Labels are the run and its namespace (a handful per operator), a termination reason or a
stage (closed sets) — never a trial id: trials are on spans (`legorl.telemetry.traces`).

prometheus-client is imported only by `collect` and `serve_metrics`: building and updating a
`ProgressMetrics` costs nothing where metrics are never served.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

from legorl.api.store import parse_policy_version

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry
    from prometheus_client.metrics_core import Metric

__all__ = [
    "RUN_METRICS",
    "MetricsServer",
    "ProgressLike",
    "ProgressMetrics",
    "ProxyTotals",
    "Sample",
    "new_registry",
    "progress_samples",
    "serve_metrics",
]

log = logging.getLogger(__name__)

MetricType = Literal["gauge", "counter", "histogram"]

RUN_METRICS: dict[str, tuple[MetricType, str]] = {
    "legorl_run_step": ("gauge", "Newest committed training step."),
    "legorl_run_max_steps": ("gauge", "The run's stop.maxSteps (absent when unset)."),
    "legorl_run_policy_version": ("gauge", "Policy version the fleet serves, as its step (v7 is 7)."),
    "legorl_run_trials_running": ("gauge", "Trials in flight."),
    "legorl_run_trials_total": ("counter", "Training trials finished, by termination reason."),
    "legorl_run_trials_dropped_total": ("counter", "Training trials kept out of the loss by the filter."),
    "legorl_run_eval_trials_total": ("counter", "Held-out (validation) trials finished."),
    "legorl_run_zero_variance_groups_total": ("counter", "Groups dropped: every trial got the same reward."),
    "legorl_run_stage_seconds_total": (
        "counter",
        "Wall time in each trial stage summed over trials, and waiting for the trainer.",
    ),
    "legorl_run_reward_mean": ("gauge", "Mean reward of the newest committed step's trained-on trials."),
    "legorl_run_held_out_solve_rate": ("gauge", "Held-out solve rate of the newest evaluated policy."),
    "legorl_run_baseline_solve_rate": ("gauge", "Held-out solve rate of the initial policy (v0)."),
    "legorl_run_fidelity_correlation": (
        "gauge",
        "Pearson correlation of rollout vs. training token probabilities (newest step).",
    ),
    "legorl_run_max_abs_logprob_delta": (
        "gauge",
        "Largest |rollout - training| log-probability (newest step).",
    ),
    "legorl_run_fidelity_below_steps": (
        "gauge",
        "Newest consecutive steps below fidelity.minCorrelation (the fidelity guard's count).",
    ),
    "legorl_run_degraded": ("gauge", "1 while the run is Degraded (e.g. the fidelity guard fired), else 0."),
    "legorl_run_tokens_per_second": ("gauge", "Trainer tokens per second (newest step)."),
    "legorl_run_trials_per_minute": ("gauge", "Trials finished per minute (recent rate)."),
    "legorl_run_eta_seconds": ("gauge", "Estimated seconds until stop.maxSteps."),
    "legorl_run_elapsed_seconds": ("gauge", "Seconds since the run controller started this run."),
}
"""Every metric `ProgressMetrics` exposes: name (as scraped) → (type, help)."""


class ProgressLike(Protocol):
    """The fields of `legorl.controller.loop.Progress` read here (typed structurally, so the controller
    may import this module without an import cycle)."""

    run: str
    step: int
    policy_version: str
    max_steps: int | None
    trials_total: int
    eval_trials: int
    trials_running: int
    trials_dropped: int
    zero_variance_groups: int
    by_reason: dict[str, int]
    reward_mean: float | None
    held_out_solve_rate: float | None
    baseline_solve_rate: float | None
    fidelity_correlation: float | None
    max_abs_logprob_delta: float | None
    tokens_per_second: float | None
    trials_per_minute: float | None
    eta_seconds: float | None
    elapsed_seconds: float
    phase_seconds: dict[str, float]
    fidelity_below_steps: int
    degraded_reason: str | None


@dataclass(frozen=True)
class Sample:
    """One value of one metric."""

    name: str
    value: float
    labels: Mapping[str, str] = field(default_factory=dict)


def _finite(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def progress_samples(progress: ProgressLike) -> list[Sample]:
    """The samples of one run's Progress snapshot (without the run's labels). Pure.

    Figures not known yet (None, NaN) are left out rather than exported as 0 or NaN.
    """
    out: list[Sample] = []

    def add(name: str, value: object, **labels: str) -> None:
        number = _finite(value)
        if number is not None:
            out.append(Sample(name, number, labels))

    add("legorl_run_step", progress.step)
    add("legorl_run_max_steps", progress.max_steps)
    # A version not of the form v<step> (an engine's own name) has no number to plot.
    with contextlib.suppress(ValueError):
        add("legorl_run_policy_version", parse_policy_version(progress.policy_version))
    add("legorl_run_trials_running", progress.trials_running)
    for reason, count in sorted(progress.by_reason.items()):
        add("legorl_run_trials_total", count, reason=str(reason))
    add("legorl_run_trials_dropped_total", progress.trials_dropped)
    add("legorl_run_eval_trials_total", progress.eval_trials)
    add("legorl_run_zero_variance_groups_total", progress.zero_variance_groups)
    for stage, seconds in sorted(progress.phase_seconds.items()):
        add("legorl_run_stage_seconds_total", seconds, stage=str(stage))
    add("legorl_run_reward_mean", progress.reward_mean)
    add("legorl_run_held_out_solve_rate", progress.held_out_solve_rate)
    add("legorl_run_baseline_solve_rate", progress.baseline_solve_rate)
    add("legorl_run_fidelity_correlation", progress.fidelity_correlation)
    add("legorl_run_max_abs_logprob_delta", progress.max_abs_logprob_delta)
    add("legorl_run_fidelity_below_steps", progress.fidelity_below_steps)
    add("legorl_run_degraded", 1 if progress.degraded_reason else 0)
    add("legorl_run_tokens_per_second", progress.tokens_per_second)
    add("legorl_run_trials_per_minute", progress.trials_per_minute)
    add("legorl_run_eta_seconds", progress.eta_seconds)
    add("legorl_run_elapsed_seconds", progress.elapsed_seconds)
    return out


def _families(catalogue: Mapping[str, tuple[MetricType, str]], samples: list[Sample]) -> Iterator[Metric]:
    """Metric families of `catalogue`, filled with `samples` (each family once, even when empty)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily  # noqa: PLC0415
    from prometheus_client.samples import Sample as PromSample  # noqa: PLC0415

    by_name: dict[str, list[Sample]] = {}
    for sample in samples:
        by_name.setdefault(sample.name, []).append(sample)
    for name, (kind, text) in catalogue.items():
        family: Metric
        if kind == "counter":
            family = CounterMetricFamily(name.removesuffix("_total"), text)
        else:
            family = GaugeMetricFamily(name, text)
        # Appended as they are: the samples of one family may differ in their label names
        # (`add_metric` wants one set of names per family).
        family.samples.extend(
            PromSample(name, dict(s.labels), s.value, None, None) for s in by_name.get(name, [])
        )
        yield family


class ProgressMetrics:
    """The latest Progress of each run, as a prometheus-client collector (`register` it, or give the
    registry to the constructor). `update` may be called from any thread."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self._lock = threading.Lock()
        self._runs: dict[tuple[str, str], list[Sample]] = {}
        if registry is not None:
            registry.register(self)

    def update(self, progress: ProgressLike, *, namespace: str = "") -> None:
        """Take `progress` as the run's current figures (copied now: the controller goes on mutating it)."""
        samples = progress_samples(progress)
        with self._lock:
            self._runs[(namespace, progress.run)] = samples

    def forget(self, run: str, *, namespace: str = "") -> None:
        """Stop exporting a run (deleted, or its controller ended for good)."""
        with self._lock:
            self._runs.pop((namespace, run), None)

    def samples(self) -> list[Sample]:
        """Every run's samples, with `namespace` and `run` labels."""
        with self._lock:
            runs = list(self._runs.items())
        return [
            Sample(s.name, s.value, {"namespace": ns, "run": run, **s.labels})
            for (ns, run), samples in sorted(runs)
            for s in samples
        ]

    def describe(self) -> Iterator[Metric]:
        return _families(RUN_METRICS, [])

    def collect(self) -> Iterator[Metric]:
        return _families(RUN_METRICS, self.samples())


class ProxyTotals:
    """The counters and histograms of finished trials' proxies, summed, as a collector.

    A trial's proxy is a sidecar that lives minutes, on a port only the operator may reach (it also
    serves the model API and `/finish`), so Prometheus does not scrape it. Whoever collects a trial
    reads the proxy's `GET /metrics` once, at the end, and `add`s it here: the sums come out under the
    proxy's own names (`legorl_proxy_*`), with the labels given to `add` (namespace, run) on top of
    the proxy's (api_format, outcome, kind, status, le). Gauges describe one trial and are left out.
    Adding the same trial twice counts it twice.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self._lock = threading.Lock()
        self._families: dict[str, tuple[str, str]] = {}
        """Family name → (type, help)."""
        self._values: dict[tuple[str, str, tuple[tuple[str, str], ...]], float] = {}
        """(family, sample name, labels) → summed value."""
        if registry is not None:
            registry.register(self)

    def add(self, text: str, **labels: str) -> None:
        """Fold one proxy's `/metrics` text in (raises ValueError for text that is not the format)."""
        from prometheus_client.parser import text_string_to_metric_families  # noqa: PLC0415

        families = list(text_string_to_metric_families(text))
        with self._lock:
            for family in families:
                if family.type not in ("counter", "histogram") or not family.name.startswith("legorl_proxy_"):
                    continue
                self._families.setdefault(family.name, (family.type, family.documentation))
                for sample in family.samples:
                    if sample.name.endswith("_created"):
                        continue
                    key = (family.name, sample.name, tuple(sorted({**sample.labels, **labels}.items())))
                    self._values[key] = self._values.get(key, 0.0) + float(sample.value)

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.metrics_core import Metric as PromMetric  # noqa: PLC0415
        from prometheus_client.samples import Sample as PromSample  # noqa: PLC0415

        with self._lock:
            families = dict(self._families)
            values = sorted(self._values.items())
        out = {name: PromMetric(name, text, kind) for name, (kind, text) in families.items()}
        for (family, sample, labels), value in values:
            out[family].samples.append(PromSample(sample, dict(labels), value, None, None))
        yield from out.values()


def new_registry() -> CollectorRegistry:
    """A registry of this process's own (the library's global one also carries whatever else was
    imported; ours export only what legorl defines)."""
    from prometheus_client import CollectorRegistry  # noqa: PLC0415

    return CollectorRegistry(auto_describe=True)


@dataclass
class MetricsServer:
    """A running `/metrics` endpoint (a daemon thread); `close` stops it."""

    server: Any
    thread: threading.Thread

    @property
    def port(self) -> int:
        return int(self.server.server_address[1])

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def serve_metrics(registry: CollectorRegistry, port: int, *, host: str = "127.0.0.1") -> MetricsServer:
    """Serve `registry` as Prometheus text at `http://host:port/metrics` (port 0: any free port) from a
    daemon thread. Pods pass host `0.0.0.0`; the default keeps a workstation's metrics local."""
    from prometheus_client import start_http_server  # noqa: PLC0415

    server, thread = start_http_server(port, addr=host, registry=registry)
    log.info("metrics at http://%s:%d/metrics", host, server.server_address[1])
    return MetricsServer(server, thread)

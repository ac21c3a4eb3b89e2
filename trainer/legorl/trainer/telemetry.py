"""The trainer's per-step figures as OpenTelemetry metrics and Prometheus gauges (the run store keeps the
same figures as JSON).

One gauge per figure, named `legorl.trainer.<figure>` in OpenTelemetry and `legorl_trainer_<figure>` in
Prometheus (the name an OpenTelemetry collector's Prometheus exporter gives the former by default, so
dashboards read either), with the run as an attribute / label. The meter provider and the Prometheus
registry are passed in (one per process, configured by the entrypoint: an OTLP exporter and
`--metrics-port` in a cluster, an in-memory reader in tests), so importing this module configures nothing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from opentelemetry.metrics import MeterProvider
from opentelemetry.metrics import _Gauge as Gauge  # public since 1.23 under this name only

from legorl.api.figures import StepFigures

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

STEP_FIGURES: dict[str, str] = StepFigures.gauges()
"""The figures exported as gauges, with their help texts (declared once, on `StepFigures`)."""
PROMETHEUS_PREFIX = "legorl_trainer_"
"""`legorl_trainer_<figure>` for each of `STEP_FIGURES`, plus `legorl_trainer_step` and
`legorl_trainer_steps_total`."""


class TrainerTelemetry:
    """Publishes each step's figures as gauges (OpenTelemetry, and Prometheus when given a registry)."""

    def __init__(
        self, provider: MeterProvider, *, run: str, registry: CollectorRegistry | None = None
    ) -> None:
        meter = provider.get_meter("legorl.trainer")
        self._attributes = {"legorl.run": run}
        self._gauges: dict[str, Gauge] = {
            name: meter.create_gauge(f"legorl.trainer.{name}", description=text)
            for name, text in STEP_FIGURES.items()
        }
        self._step = meter.create_gauge("legorl.trainer.step", description="Last completed training step.")
        self._run = run
        self._prometheus: dict[str, Any] = {}
        """Prometheus gauges by figure; a run's series appears with its first finite value (a figure
        never reported, such as `sync_seconds` without a fleet, is absent rather than 0)."""
        self._steps: Any = None
        if registry is not None:
            from prometheus_client import Counter as PromCounter  # noqa: PLC0415
            from prometheus_client import Gauge as PromGauge  # noqa: PLC0415

            self._prometheus = {
                name: PromGauge(f"{PROMETHEUS_PREFIX}{name}", text, ["run"], registry=registry)
                for name, text in {"step": "Last completed training step.", **STEP_FIGURES}.items()
            }
            self._steps = PromCounter(
                f"{PROMETHEUS_PREFIX}steps",
                "Training steps completed by this process.",
                ["run"],
                registry=registry,
            ).labels(run=run)

    def record(self, step: int, figures: StepFigures | Mapping[str, object]) -> None:
        """Set every known, finite figure of `step` (NaN and missing ones are left as they were)."""
        self._step.set(step, self._attributes)
        if self._prometheus:
            self._prometheus["step"].labels(run=self._run).set(step)
            self._steps.inc()
        for name, gauge in self._gauges.items():
            value = getattr(figures, name) if isinstance(figures, StepFigures) else figures.get(name)
            if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
                gauge.set(float(value), self._attributes)
                if self._prometheus:
                    self._prometheus[name].labels(run=self._run).set(float(value))

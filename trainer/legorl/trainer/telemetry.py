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

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

STEP_FIGURES: dict[str, str] = {
    "loss": "Policy loss of the step.",
    "reward_mean": "Mean reward of the trials trained on.",
    "fidelity_pearson": "Pearson correlation of rollout vs. training token probabilities.",
    "fidelity_mean_abs_logprob_delta": "Mean |rollout − training| log-probability.",
    "fidelity_max_abs_logprob_delta": "Largest |rollout − training| log-probability.",
    "fidelity_kl": "KL estimate (k3) from the behaviour to the training distribution.",
    "replayed_token_share": "Share of loss tokens whose expert routing was replayed from the rollout.",
    "is_ess": "Effective sample size of the importance weights, as a fraction of the tokens.",
    "is_capped_share": "Share of tokens whose importance weight hit the cap.",
    "clip_fraction": "Share of tokens whose ratio was clipped.",
    "grad_norm": "Gradient norm before clipping.",
    "entropy": "Mean token entropy of the training distribution.",
    "kl_ref": "KL to the reference policy (when klCoef > 0).",
    "tokens_per_second": "Tokens through forward and backward per second.",
    "step_seconds": "Wall time of the step.",
    "trials_kept": "Trials that entered the loss.",
    "trials_dropped": "Trials dropped by the filter (reason or staleness).",
    "zero_variance_groups": "Groups dropped because every trial got the same reward.",
    "learning_rate": "Learning rate used for the step.",
    "sync_seconds": "Wall time of loading the step's weights into the fleet (absent without a fleet).",
}
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

    def record(self, step: int, figures: Mapping[str, object]) -> None:
        """Set every known, finite figure of `step` (NaN and missing ones are left as they were)."""
        self._step.set(step, self._attributes)
        if self._prometheus:
            self._prometheus["step"].labels(run=self._run).set(step)
            self._steps.inc()
        for name, gauge in self._gauges.items():
            value = figures.get(name)
            if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
                gauge.set(float(value), self._attributes)
                if self._prometheus:
                    self._prometheus[name].labels(run=self._run).set(float(value))

"""The trainer's per-step figures as OpenTelemetry metrics (the run store keeps the same figures as JSON).

One gauge per figure, named `legorl.trainer.<figure>`, with the run as an attribute. The meter provider is
passed in (one per process, configured by the entrypoint: an OTLP exporter in a cluster, an in-memory
reader in tests), so importing this module configures nothing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from opentelemetry.metrics import MeterProvider
from opentelemetry.metrics import _Gauge as Gauge  # public since 1.23 under this name only

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
}


class TrainerTelemetry:
    """Publishes each step's figures as gauges."""

    def __init__(self, provider: MeterProvider, *, run: str) -> None:
        meter = provider.get_meter("legorl.trainer")
        self._attributes = {"legorl.run": run}
        self._gauges: dict[str, Gauge] = {
            name: meter.create_gauge(f"legorl.trainer.{name}", description=text)
            for name, text in STEP_FIGURES.items()
        }
        self._step = meter.create_gauge("legorl.trainer.step", description="Last completed training step.")

    def record(self, step: int, figures: Mapping[str, object]) -> None:
        """Set every known, finite figure of `step` (NaN and missing ones are left as they were)."""
        self._step.set(step, self._attributes)
        for name, gauge in self._gauges.items():
            value = figures.get(name)
            if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
                gauge.set(float(value), self._attributes)

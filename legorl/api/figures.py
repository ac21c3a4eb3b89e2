"""What the trainer and the run controller write about a run's progress, typed once for every reader.

`StepFigures` is a training step's figures (`metrics/trainer/step-NNNNNN.json`), `TrainerState` the
trainer's resume pointer (`trainer/state.json`), `EvalSummary` a held-out evaluation
(`evals/step-NNNNNN.json`), `ScoringAnswer` the trainer's answer to a canary's scoring request
(`validation/score/<id>.json`) and `ValidationReport` the last canary's report (`validation/latest.json`).
Writers encode with `to_json`, readers decode with `from_json` (through `legorl.api.store.RunStore`'s typed
functions), so no part indexes another's JSON by a string key.

Each decoder names the bad field of a malformed document (`FiguresError`) and keeps fields a newer writer
added (`extra="allow"`: they read back as attributes and are written again), as the readers always did. The
JSON keys are the field names (snake_case) and stay what earlier versions wrote: a store written before
these types still reads. JSON has no NaN, so a non-finite float is written as null and reads back as None.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationError

__all__ = [
    "BatchSummary",
    "EvalSummary",
    "FiguresError",
    "ScoringAnswer",
    "StepFigures",
    "TrainerState",
    "ValidationCheck",
    "ValidationReport",
    "ValidationResult",
]


class FiguresError(ValueError):
    """A run-progress document (figures, state, evaluation, scoring answer) is malformed."""


class _Document(BaseModel):
    """Base of the documents: snake_case keys, lax numbers (JSON has one number type), unknown keys kept."""

    model_config = ConfigDict(extra="allow", use_attribute_docstrings=True, validate_assignment=True)

    def to_json(self) -> dict[str, Any]:
        """The document as JSON values: the fields that were set (a None that was set is written as null),
        plus the fields a newer writer added; non-finite floats become null."""
        return {k: _finite(v) for k, v in self.model_dump(mode="python", exclude_unset=True).items()}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Self:
        """The inverse of `to_json`; a malformed document raises `FiguresError` naming the bad field."""
        if not isinstance(obj, Mapping):
            raise FiguresError(f"{cls.__name__} must be a JSON object, got {type(obj).__name__}")
        try:
            return cls.model_validate(dict(obj))
        except ValidationError as exc:
            raise FiguresError(f"{cls.__name__} is malformed: {_errors(exc)}") from exc


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _errors(exc: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(p) for p in e['loc']) or '(document)'}: {e['msg']}" for e in exc.errors()[:5]
    )


def _figure(*, gauge: bool = False, curve: tuple[str, str] | None = None) -> Any:
    """A step figure (absent unless the trainer set it). `gauge`: exported as the trainer's OpenTelemetry
    and Prometheus gauge, described by the field's docstring; `curve`: (label, group) of the UI's training
    curve, drawn in the order the fields are declared."""
    extra: dict[str, Any] = {"gauge": gauge}
    if curve is not None:
        extra["curve"] = list(curve)
    return Field(default=None, json_schema_extra=extra)


DROPPED_BY_REASON = "dropped_by_reason"
"""`StepFigures.dropped_by_reason` is written flat, as `dropped_by_reason.<reason>` keys."""


class StepFigures(_Document):
    """One training step's figures (`metrics/trainer/step-NNNNNN.json`), the same on every trainer rank.

    The trainer fills them in as the step goes (filter counts, then the loss's figures, then the weight sync
    and checkpoint); a skipped step has only the filter counts and `skipped`. The curves come first, in the
    UI's order."""

    step: int
    """The training step (policy version `v<step>` is its result)."""
    reward_mean: float | None = _figure(gauge=True, curve=("Reward (trained-on trials)", "reward"))
    """Mean reward of the trials trained on."""
    entropy: float | None = _figure(gauge=True, curve=("Entropy", "policy"))
    """Mean token entropy of the training distribution."""
    kl_ref: float | None = _figure(gauge=True, curve=("KL to reference", "policy"))
    """KL to the reference policy (when klCoef > 0)."""
    fidelity_kl: float | None = _figure(gauge=True, curve=("KL rollout→training", "fidelity"))
    """KL estimate (k3) from the behaviour to the training distribution."""
    clip_fraction: float | None = _figure(gauge=True, curve=("Clip fraction", "policy"))
    """Share of tokens whose ratio was clipped."""
    grad_norm: float | None = _figure(gauge=True, curve=("Grad norm", "optimizer"))
    """Gradient norm before clipping."""
    loss: float | None = _figure(gauge=True, curve=("Loss", "optimizer"))
    """Policy loss of the step."""
    fidelity_pearson: float | None = _figure(
        gauge=True, curve=("Rollout-vs-training correlation", "fidelity")
    )
    """Pearson correlation of rollout vs. training token probabilities."""
    fidelity_mean_abs_logprob_delta: float | None = _figure(
        gauge=True, curve=("Mean |Δ log-prob|", "fidelity")
    )
    """Mean |rollout − training| log-probability."""
    fidelity_max_abs_logprob_delta: float | None = _figure(gauge=True, curve=("Max |Δ log-prob|", "fidelity"))
    """Largest |rollout − training| log-probability."""
    is_ess: float | None = _figure(gauge=True, curve=("IS effective sample size", "fidelity"))
    """Effective sample size of the importance weights, as a fraction of the tokens."""
    is_capped_share: float | None = _figure(gauge=True, curve=("IS capped share", "fidelity"))
    """Share of tokens whose importance weight hit the cap."""
    max_staleness_seen: int | None = _figure(curve=("Staleness (max steps)", "throughput"))
    """Largest staleness (in steps) of a trial in the batch."""
    tokens_per_second: float | None = _figure(gauge=True, curve=("Tokens/s (trainer)", "throughput"))
    """Tokens through forward and backward per second."""
    step_seconds: float | None = _figure(gauge=True, curve=("Step time (s)", "throughput"))
    """Wall time of the step."""
    replayed_token_share: float | None = _figure(gauge=True, curve=("Routing replayed share", "fidelity"))
    """Share of loss tokens whose expert routing was replayed from the rollout."""

    trials_total: int | None = _figure()
    """Trials in the committed batch."""
    trials_kept: int | None = _figure(gauge=True)
    """Trials that entered the loss."""
    trials_dropped: int | None = _figure(gauge=True)
    """Trials dropped by the filter (reason or staleness)."""
    zero_variance_groups: int | None = _figure(gauge=True)
    """Groups dropped because every trial got the same reward."""
    dropped_by_reason: dict[str, int] | None = _figure()
    """Trials dropped for their termination reason, by reason (`dropped_by_reason.<reason>` keys on disk)."""
    dropped_stale: int | None = _figure()
    """Trials dropped as staler than maxStalenessSteps."""
    dropped_no_reward: int | None = _figure()
    """Trials dropped for having no reward."""
    dropped_unknown_version: int | None = _figure()
    """Trials dropped because their policy version could not be read."""
    dropped_unrouted_segments: int | None = _figure()
    """Segments left out of the loss for carrying no routed experts (routingReplay Enabled)."""
    learning_rate: float | None = _figure(gauge=True)
    """Learning rate used for the step."""
    reward_mean_all: float | None = _figure()
    """Mean reward of every trial of the batch with a reward, trained on or not."""
    advantage_abs_mean: float | None = _figure()
    """Mean |advantage| of the trials trained on."""
    fidelity_tokens: int | None = _figure()
    """Tokens the fidelity figures compare (those sampled by the version being trained)."""
    fidelity_probe_trials: int | None = _figure()
    """Trials of zero-variance groups the fidelity figures were measured on (one forward, no gradient)
    because the trained trials held no token sampled by the version being trained; absent when they did."""
    loss_tokens: int | None = _figure()
    """Tokens in the loss, over every rank."""
    mini_batches: int | None = _figure()
    """Optimizer steps the batch was split into."""
    micro_batches: int | None = _figure()
    """Forward/backward passes over every mini-batch."""
    skipped: str | None = _figure()
    """Why the optimizer step was skipped (nothing left to train on, a non-finite gradient); absent when it
    was not."""
    retrained_on_resume: int | None = _figure()
    """1 when a restarted trainer re-trained the step from its batch (its weights were published before)."""
    sync_seconds: float | None = _figure(gauge=True)
    """Wall time of loading the step's weights into the fleet (absent without a fleet)."""
    sync_transfer_seconds: float | None = _figure()
    """Of `sync_seconds`, the time spent sending the weights (NCCL weight sync)."""
    sync_bytes: int | None = _figure()
    """Bytes the NCCL weight sync sent."""
    sync_bytes_per_second: float | None = _figure()
    """`sync_bytes` over `sync_transfer_seconds`."""
    checkpoint: str | None = _figure()
    """URI of the checkpoint saved after the step, when one was."""

    def to_json(self) -> dict[str, Any]:
        """The step's JSON object: scalars only (`dropped_by_reason` as `dropped_by_reason.<reason>` keys)."""
        out = super().to_json()
        by_reason = out.pop(DROPPED_BY_REASON, None)
        for reason, count in (by_reason or {}).items():
            out[f"{DROPPED_BY_REASON}.{reason}"] = count
        for key, value in out.items():
            if value is not None and not isinstance(value, (int, float, str)):
                raise FiguresError(
                    f"figure {key!r} is a {type(value).__name__}; figures are numbers or strings"
                )
        return out

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Self:
        """The inverse of `to_json`; also takes `dropped_by_reason` as a mapping (the trainer's own form)."""
        body = {k: v for k, v in obj.items() if not str(k).startswith(f"{DROPPED_BY_REASON}.")}
        flat = {str(k)[len(DROPPED_BY_REASON) + 1 :]: v for k, v in obj.items() if k not in body}
        if flat:
            body[DROPPED_BY_REASON] = {**(body.get(DROPPED_BY_REASON) or {}), **flat}
        return super().from_json(body)

    @classmethod
    def gauges(cls) -> dict[str, str]:
        """The figures exported as gauges, with their help text (the field's docstring)."""
        return {
            name: field.description or name
            for name, field in cls.model_fields.items()
            if isinstance(field.json_schema_extra, dict) and field.json_schema_extra.get("gauge")
        }

    @classmethod
    def curves(cls) -> list[tuple[str, str, str]]:
        """The UI's training curves: (figure, label, group), in the order they are drawn."""
        out = []
        for name, field in cls.model_fields.items():
            extra = field.json_schema_extra
            curve = extra.get("curve") if isinstance(extra, dict) else None
            if isinstance(curve, list):
                out.append((name, str(curve[0]), str(curve[1])))
        return out


class TrainerState(_Document):
    """The trainer's resume pointer (`trainer/state.json`), written after a step's weights were published
    and synced: the run controller reads the version the fleet serves from it."""

    step: int = 0
    """The last completed training step."""
    policy_version: str = "v0"
    """The policy version that step published (`v<step>`)."""
    checkpoint: str | None = None
    """URI of the newest checkpoint (what a restarted trainer loads), None before the first."""
    updated: float | None = None
    """When it was written (seconds since the epoch)."""


class EvalSummary(_Document):
    """The held-out evaluation of one policy version (`evals/step-NNNNNN.json`), written by the run
    controller once every held-out trial of that version ended."""

    step: int
    """The policy version's step (`v<step>`; 0 is the initial checkpoint)."""
    policy_version: str | None = None
    """The version evaluated (`v<step>`)."""
    trials: int = 0
    """Held-out trials run."""
    scored: int = 0
    """Of them, those that ended with a reward (infrastructure failures are not scored)."""
    solved: int | None = None
    """Scored trials with reward 1."""
    solve_rate: float | None = None
    """`solved / scored`; None when nothing was scored."""
    interval95: tuple[float, float] | None = None
    """The solve rate's 95% Wilson interval (low, high)."""
    infra_failures: int = 0
    """Trials that ended for an infrastructure reason."""
    by_reason: dict[str, int] = Field(default_factory=dict)
    """Trials by termination reason."""
    per_task: dict[str, float] = Field(default_factory=dict)
    """Mean reward by task."""


class BatchSummary(_Document):
    """What the run controller says of a committed batch, in its `COMMIT.json`'s `meta` (`BatchRef.meta`):
    counts of the step's trials. Every field is optional: a batch committed by another writer (a test, a
    tool) may carry other keys or none."""

    trials: int | None = None
    """Trials in the batch."""
    infra_failures: int | None = None
    """Of them, those that ended for an infrastructure reason."""
    kept: int | None = None
    """Trials that enter the loss (not dropped by reason, with a reward)."""
    zero_variance_groups: int | None = None
    """Groups whose kept trials all got the same reward (no advantage to learn from)."""
    groups: int | None = None
    """Groups among the kept trials."""
    reward_mean: float | None = None
    """Mean reward of the kept trials."""
    policy_versions_seen: list[str] = Field(default_factory=list)
    """Every weight version that served a call of the batch's trials, oldest first."""
    by_reason: dict[str, int] = Field(default_factory=dict)
    """Trials by termination reason."""


class ScoringAnswer(_Document):
    """The trainer's answer to a canary's scoring request (`validation/score/<id>.json`): the fidelity of
    its weights on the canary's trial (`ScoredBatch.fidelity()`), or why it could not score it."""

    policy_version: str | None = None
    """The version the trainer held when it scored."""
    error: str | None = None
    """Why the trial could not be scored (then the figures are absent)."""
    seconds: float | None = None
    """How long scoring took."""
    tokens: float | None = None
    """Sampled tokens compared."""
    pearson: float | None = None
    """Pearson correlation of rollout vs. training token probabilities."""
    mean_abs_logprob_delta: float | None = None
    """Mean |rollout − training| log-probability."""
    max_abs_logprob_delta: float | None = None
    """Largest |rollout − training| log-probability."""
    kl: float | None = None
    """KL estimate (k3) from the behaviour to the training distribution."""
    replayed_share: float | None = None
    """Share of the tokens whose expert routing was replayed."""
    routing_agreement: float | None = None
    """Share of (position, MoE layer) pairs where replayed experts are those the trainer's router picks;
    None when no routing was compared."""
    routing_compared: float | None = None
    """(position, MoE layer) pairs compared."""


ValidationResult = Literal["Passed", "Warning", "Failed"]
"""A canary check's (and report's) outcome."""


class ValidationCheck(_Document):
    """One check of a canary (`preflight`, `trial`, `token-parity`, `routing-parity`, ...)."""

    check: str
    """The check's name."""
    result: ValidationResult
    """Passed, Warning or Failed."""
    message: str
    """What it found, in words a person can act on."""
    figures: dict[str, Any] = Field(default_factory=dict)
    """The numbers behind the result (NaN written as null)."""


class ValidationReport(_Document):
    """The last canary's report (`validation/latest.json`): `legorl run --canary` or the operator's."""

    run: str
    """The RLRun validated."""
    time: str
    """When the canary ended (ISO 8601)."""
    seconds: float
    """How long it took."""
    checks: list[ValidationCheck]
    """Its checks, in the order they ran."""
    trial: str | None = None
    """The canary's trial, when one ran."""
    result: ValidationResult
    """Failed when a check failed, else Warning when one warned, else Passed."""

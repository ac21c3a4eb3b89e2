"""A canary: a few minutes that say whether a long run would be worth starting (shared by `legorl run
--canary` and the operator's `legorl.dev/validate-requested`).

The checks, in order, each `Passed`, `Warning` or `Failed` with a message a person can act on:

- **preflight**: the manifest's own checks (`legorl validate`'s preflight: settings that cannot work
  together, dtype mismatches that ruin fidelity, ...); an invalid manifest never gets this far.
- **trial**: one trial end to end on the first training task, through the same engine, proxy, sandbox
  stages, harness and verifier the run uses. It fails on any infrastructure termination (DESIGN §5) or a
  missing reward; a `completed` trial with reward 0 passes (the policy may fail a task, the machinery may
  not).
- **token-parity**: the trainer scores the exact tokens the engine sampled in that trial (prompts as the
  engine saw them, completions, behaviour log-probs recorded by the proxy). It fails when the Pearson
  correlation of rollout vs. training token log-probabilities is below `fidelity.minCorrelation` — the
  signal the fidelity guard stops a run for, caught before the run.
- **routing-parity**: with routed experts captured by the engine and routing replay on, every scored
  token must have a recorded routing row (replayed), and the recorded experts must be the ones the trainer's
  router chooses on the same weights, per token and MoE layer (`routing_agreement`, measured by the trainer
  while it scores): below `ROUTING_AGREEMENT_FLOOR` the run `Failed` (routing recorded for other tokens,
  in another layer order, or by another model), up to `ROUTING_AGREEMENT_GOOD` a `Warning` (more near-ties
  than a matching dtype gives). Without captured routing (vLLM's CPU build, or
  `routedExpertsCapture: Disabled`) this is a `Warning` that says so, never a silent pass.

The report goes to the run store (`validation/latest.json`) and, on a cluster, to `status.validation`.
The canary's trial is never trained on.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from legorl.api.figures import ScoringAnswer, ValidationCheck, ValidationReport, ValidationResult
from legorl.api.kinds import RLRun
from legorl.api.store import RunStore, StoreLayout
from legorl.api.termination import INFRA_REASONS
from legorl.api.trajectory import TrialRecord
from legorl.manifests.preflight import check_resource

Result = ValidationResult
ROUTING_AGREEMENT_FLOOR = 0.9
"""Below this share of (token, MoE layer) pairs routed as the trainer's router would, routing parity fails."""
ROUTING_AGREEMENT_GOOD = 0.99
"""From this share on it passes; in between, near-ties (a bf16 engine against an fp32 trainer) are many."""
VALIDATION_OBJECT = StoreLayout.VALIDATION
"""Where the last canary's report lands in the run store."""
CANARY_TRIAL_PREFIX = "canary-"
"""A canary's trial ids start with this; a run's own trials never do (`s<step>-...`, `e<step>-...`)."""


@dataclass
class CanaryCheck:
    check: str
    result: Result
    message: str
    figures: dict[str, Any] = field(default_factory=dict)


@dataclass
class CanaryReport:
    run: str
    time: str
    seconds: float
    checks: list[CanaryCheck]
    trial: str | None = None

    @classmethod
    def ended(
        cls, run: RLRun, started: float, checks: list[CanaryCheck], record: TrialRecord | None
    ) -> CanaryReport:
        """The report of a canary of `run` that began at `started` (`time.monotonic()`) and ends now."""
        return cls(
            run=run.metadata.name,
            time=datetime.now(UTC).isoformat(timespec="seconds"),
            seconds=time.monotonic() - started,
            checks=checks,
            trial=record.trial if record is not None else None,
        )

    @property
    def result(self) -> Result:
        results = {c.result for c in self.checks}
        return "Failed" if "Failed" in results else "Warning" if "Warning" in results else "Passed"

    def report(self) -> ValidationReport:
        """As the run store keeps it (`validation/latest.json`)."""
        return ValidationReport(
            run=self.run,
            time=self.time,
            seconds=self.seconds,
            checks=[
                ValidationCheck(check=c.check, result=c.result, message=c.message, figures=finite(c.figures))
                for c in self.checks
            ],
            trial=self.trial,
            result=self.result,
        )

    def to_json(self) -> dict[str, Any]:
        """As JSON values (NaN figures become null)."""
        return self.report().to_json()

    def text(self) -> str:
        width = max(len(c.check) for c in self.checks)
        lines = [f"canary of run {self.run}: {self.result} ({self.seconds:.0f} s)"]
        lines += [f"  {c.check:<{width}}  {c.result:<7}  {c.message}" for c in self.checks]
        return "\n".join(lines)


def preflight_check(run: RLRun) -> CanaryCheck:
    problems = check_resource(run)
    errors = [p for p in problems if p.severity == "error"]
    if errors:
        return CanaryCheck("preflight", "Failed", "; ".join(f"{p.path}: {p.message}" for p in errors))
    if problems:
        return CanaryCheck("preflight", "Warning", "; ".join(f"{p.path}: {p.message}" for p in problems))
    return CanaryCheck("preflight", "Passed", "no problem found")


def trial_check(record: TrialRecord | None, waited: float) -> CanaryCheck:
    if record is None:
        return CanaryCheck("trial", "Failed", f"no result after {waited:.0f} s (see the run's work/logs)")
    figures = {
        "termination_reason": record.termination_reason.value,
        "reward": record.reward,
        "turns": record.num_turns,
        "stage_seconds": dict(record.stage_seconds),
    }
    if record.termination_reason in INFRA_REASONS:
        why = f": {record.error}" if record.error else ""
        return CanaryCheck(
            "trial",
            "Failed",
            f"{record.trial} ended {record.termination_reason.value}{why}",
            figures,
        )
    if record.reward is None:
        return CanaryCheck(
            "trial", "Failed", f"{record.trial} has no reward: the verifier did not score it", figures
        )
    if not record.segments:
        return CanaryCheck(
            "trial", "Failed", f"{record.trial} recorded no tokens: nothing to train on", figures
        )
    return CanaryCheck(
        "trial",
        "Passed",
        f"{record.trial} {record.termination_reason.value}, reward {record.reward:g}, "
        f"{record.num_turns} turn(s), {sum(record.stage_seconds.values()):.0f} s",
        figures,
    )


def parity_checks(
    record: TrialRecord, scoring: ScoringAnswer | Mapping[str, Any], run: RLRun
) -> list[CanaryCheck]:
    """Token and routing parity from the trainer's scoring of `record`: its answer (`ScoringAnswer`), or
    `ScoredBatch.fidelity()` in process (tokens, pearson, max/mean |Δ log-prob|, replayed_share), with the
    `policy_version` the trainer held when it scored, where known."""
    stats = scoring if isinstance(scoring, ScoringAnswer) else ScoringAnswer.from_json(scoring)
    floor = float(run.spec.fidelity.min_correlation)
    held = stats.policy_version
    sampled = sorted({*record.policy_versions, *(v for s in record.segments for v in s.policy_versions)})
    if held is not None and sampled and sampled != [str(held)]:
        why = (
            f"the trainer holds {held}, the trial was sampled by {', '.join(sampled)}: "
            "the two cannot be compared (a weight sync happened in between); validate again"
        )
        return [CanaryCheck("token-parity", "Warning", why), CanaryCheck("routing-parity", "Warning", why)]
    tokens = int(stats.tokens or 0)
    pearson = _float(stats.pearson)
    figures = {
        "tokens": tokens,
        "pearson": pearson,
        "max_abs_logprob_delta": _float(stats.max_abs_logprob_delta),
        "mean_abs_logprob_delta": _float(stats.mean_abs_logprob_delta),
    }
    if tokens < 2:
        token = CanaryCheck("token-parity", "Failed", f"only {tokens} sampled token(s) to compare", figures)
    elif not pearson >= floor:
        token = CanaryCheck(
            "token-parity",
            "Failed",
            f"Pearson {pearson:.4f} over {tokens} tokens is below fidelity.minCorrelation {floor}: the "
            "trainer does not score what the engine sampled (dtype, checkpoint or chat template mismatch?)",
            figures,
        )
    else:
        token = CanaryCheck(
            "token-parity",
            "Passed",
            f"Pearson {pearson:.5f} over {tokens} tokens, max |Δ log-prob| "
            f"{figures['max_abs_logprob_delta']:.2e}",
            figures,
        )
    routed = [s for s in record.segments if s.routed_experts is not None]
    share = _float(stats.replayed_share, 0.0)
    if not routed:
        routing = CanaryCheck(
            "routing-parity",
            "Warning",
            "the engine recorded no routed experts (vLLM's CPU build, or routedExpertsCapture Disabled): "
            "routing replay cannot be checked here",
        )
    elif share < 1.0:
        routing = CanaryCheck(
            "routing-parity",
            "Failed",
            f"only {share:.1%} of the scored tokens were routed as the engine routed them "
            "(trainer.routingReplay?)",
            {"replayed_share": share},
        )
    else:
        routing = _routing_agreement_check(stats, share)
    return [token, routing]


def _routing_agreement_check(stats: ScoringAnswer, share: float) -> CanaryCheck:
    """Every scored token was replayed: are the experts replayed the ones these weights route to?"""
    agreement = _float(stats.routing_agreement)
    compared = int(_float(stats.routing_compared, 0.0))
    figures = {"replayed_share": share, "routing_agreement": agreement, "routing_compared": compared}
    if compared == 0 or math.isnan(agreement):
        return CanaryCheck(
            "routing-parity",
            "Warning",
            "every scored token was replayed, but the trainer did not compare the engine's experts with its "
            "router's own choice (an older trainer image?): routing parity is unmeasured",
            figures,
        )
    said = (
        f"{agreement:.2%} of {compared} (token, MoE layer) pairs recorded by the engine are the experts the "
        "trainer's router chooses on the same weights"
    )
    if agreement < ROUTING_AGREEMENT_FLOOR:
        return CanaryCheck(
            "routing-parity",
            "Failed",
            f"only {said}: the engine's routing was recorded for other tokens, in another layer order or by "
            "another model (check the proxy's routing capture and that engine and trainer load the same "
            "checkpoint)",
            figures,
        )
    if agreement < ROUTING_AGREEMENT_GOOD:
        return CanaryCheck(
            "routing-parity",
            "Warning",
            f"{said}: more near-ties than matching dtypes give (engine and trainer dtypes differ?); replay "
            "keeps training on the engine's routing either way",
            figures,
        )
    return CanaryCheck(
        "routing-parity", "Passed", f"every scored token replayed the engine's routing; {said}", figures
    )


def _float(value: Any, default: float = float("nan")) -> float:
    """A figure from JSON (None stands for NaN there) as a float."""
    try:
        return default if value is None else float(value)
    except (TypeError, ValueError):
        return default


def write_report(store: RunStore, report: CanaryReport) -> None:
    store.write_validation(report.report())


def finite(figures: Mapping[str, Any]) -> dict[str, Any]:
    """`figures` with NaN and infinities as None (JSON has no such numbers)."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in figures.items()}

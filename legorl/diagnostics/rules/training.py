"""Rules about the trainer's figures: fidelity, importance weights, reward variance, skipped updates."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

from legorl.api.figures import BatchSummary, FiguresError, StepFigures
from legorl.diagnostics._util import median, ranked, runs, steps_phrase
from legorl.diagnostics.facts import RunFacts, StepFacts, finite
from legorl.diagnostics.finding import Finding, finding, rule

ESS_WARNING: Final = 0.5
"""`is_ess` (a fraction of the tokens, 1 = all importance weights equal) below this is a warning."""
ESS_CRITICAL: Final = 0.2

EQUAL_SHARE: Final = 0.75
"""Share of a step's groups whose trials all got the same reward that counts as "most"."""
EQUAL_MIN_STEPS: Final = 2
"""Consecutive committed steps that must show it."""
EQUAL_CRITICAL_STEPS: Final = 3
"""Consecutive steps with every group equal that make it critical (nothing left to learn from)."""

SKIPPED_CRITICAL_STEPS: Final = 3

ENTROPY_MIN_STEPS: Final = 4
ENTROPY_BASELINE_STEPS: Final = 3
ENTROPY_DROP: Final = 0.2
"""The latest entropy below this fraction of the first steps' median is a collapse."""


def _series(facts: RunFacts, figure: Callable[[StepFigures], float | None]) -> list[tuple[StepFacts, float]]:
    """The steps with a finite `figure`, with it."""
    return [(s, v) for s in facts.steps if (v := finite(figure(s.figures))) is not None]


@rule("fidelity-below-threshold", "Rollout/training fidelity below the threshold")
def fidelity_below_threshold(facts: RunFacts) -> Finding | None:
    """The trainer's `fidelity_pearson` (Pearson correlation of rollout vs. training token
    log-probabilities) below the RLRun's fidelity.minCorrelation (default 0.99). Critical when it
    stays below for fidelity.windowSteps consecutive steps (the fidelity guard's own trigger), a
    warning for shorter dips. Causes are ranked with `replayed_token_share`, the trainer's and the
    fleet's dtype, and whether the first steps were fine."""
    spec = facts.spec
    series = _series(facts, lambda f: f.fidelity_pearson)
    below = {s.step for s, v in series if v < spec.min_correlation}
    if not below:
        return None
    order = [s.step for s, _ in series]
    spans = runs(order, below)
    longest = max(len(r) for r in spans)
    bad = [(s, v) for s, v in series if s.step in below]
    worst_step, worst = min(bad, key=lambda item: item[1])
    first_bad = min(below)
    fine_before = [s.step for s, _ in series if s.step < first_bad]
    replayed = [v for s, _ in bad if (v := finite(s.figures.replayed_token_share)) is not None]
    replay_share = sum(replayed) / len(replayed) if replayed else None
    replay_off = spec.routing_replay == "Disabled" or spec.routed_experts_capture == "Disabled"
    dtype_differs = spec.fleet_dtype not in (None, "auto") and spec.fleet_dtype != spec.trainer_dtype
    if replay_share == 0.0 and replay_off:
        replay = (
            3.0,
            "routing replay is off (trainer.routingReplay Disabled or the fleet's routedExpertsCapture "
            "Disabled): for an MoE policy the trainer re-chooses the experts the engine chose",
        )
    elif replay_share is not None and replay_share < 0.99 and spec.routing_replay != "Disabled":
        replay = (
            2.5,
            f"routing replay covered only {replay_share:.0%} of the tokens: the engine returned no "
            "routed experts for the rest (capture off on some replicas)",
        )
    else:
        replay = (
            1.0,
            "routing replay mismatched: the engine's and the trainer's expert numbering or layer order "
            "differ, or replay is off for an MoE policy",
        )
    dtype = (
        (
            3.0,
            f"dtype mismatch: the fleet runs {spec.fleet_dtype}, the trainer {spec.trainer_dtype}",
        )
        if dtype_differs
        else (
            0.5,
            "dtype mismatch between engine and trainer (e.g. an `auto` engine dtype resolving to "
            f"float16 while the trainer uses {spec.trainer_dtype})",
        )
    )
    later = bool(fine_before)
    stale = (
        2.0 if later else 1.0,
        "stale weights: the fleet served an older version than the one the trainer scored against "
        "(a failed or partial weight sync)",
    )
    if spec.prefix_caching == "Disabled":
        prefix_score = 0.0
    else:
        prefix_score = 2.0 if later and spec.prefix_caching == "Enabled" else 1.0
    prefix = (
        prefix_score,
        "the prefix cache was not reset after a weight sync, so prompts reused KV computed under the "
        "old weights",
    )
    causes = ranked([replay, dtype, stale, prefix])
    if spec.prefix_caching == "Disabled":
        causes = [c for c in causes if not c.startswith("the prefix cache")]
    critical = longest >= spec.window_steps
    latest_step, latest = series[-1]
    summary = (
        f"fidelity_pearson was below {spec.min_correlation:g} in {len(below)} of {len(series)} steps "
        f"({steps_phrase(below)}; longest run {longest}, guard window {spec.window_steps}); lowest "
        f"{worst:.4f} at step {worst_step.step}, latest {latest:.4f} at step {latest_step.step}."
    )
    return finding(
        fidelity_below_threshold,
        "critical" if critical else "warning",
        summary,
        causes,
        "Check that the fleet serves the trainer's latest version (RolloutFleet status), that routing "
        "replay is on with routedExpertsCapture Enabled for an MoE policy, and that fleet and trainer "
        f"dtypes match; the guard's action is {spec.fidelity_action}.",
        evidence={
            "threshold": spec.min_correlation,
            "window_steps": spec.window_steps,
            "longest_run": longest,
            "per_step": [
                {
                    "step": s.step,
                    "pearson": v,
                    "replayed_token_share": finite(s.figures.replayed_token_share),
                    "max_abs_logprob_delta": finite(s.figures.fidelity_max_abs_logprob_delta),
                    "kl": finite(s.figures.fidelity_kl),
                }
                for s, v in bad
            ],
            "steps_fine_before": fine_before,
            "trainer_dtype": spec.trainer_dtype,
            "fleet_dtype": spec.fleet_dtype,
            "routing_replay": spec.routing_replay,
            "routed_experts_capture": spec.routed_experts_capture,
            "prefix_caching": spec.prefix_caching,
        },
        steps=sorted(below),
    )


@rule("is-ess-collapse", "Importance-sampling effective sample size collapsed")
def is_ess_collapse(facts: RunFacts) -> Finding | None:
    """The trainer's `is_ess` — effective sample size of the token importance weights as a fraction of
    the tokens, (Σw)²/(N·Σw²) — below 0.5 in a step (warning) or below 0.2 (critical): a few tokens
    carry the gradient because rollout and training probabilities disagree."""
    series = _series(facts, lambda f: f.is_ess)
    low = [(s, v) for s, v in series if v < ESS_WARNING]
    if not low:
        return None
    worst_step, worst = min(low, key=lambda item: item[1])
    spec = facts.spec
    fidelity_bad = any(
        (p := finite(s.figures.fidelity_pearson)) is not None and p < spec.min_correlation for s, _ in low
    )
    stale = max((finite(s.figures.max_staleness_seen) or 0.0 for s, _ in low), default=0.0)
    causes = ranked(
        [
            (
                3.0 if fidelity_bad else 1.0,
                "rollout and training probabilities disagree (see the fidelity finding: routing "
                "replay, dtype, stale weights)",
            ),
            (
                2.0 if stale > 0 else 0.5,
                "trajectories are off-policy: trials sampled from older versions (async staleness)",
            ),
            (
                2.0 if spec.top_p < 1.0 else 0.0,
                f"sampling.topP {spec.top_p:g} < 1: the engine samples from a truncated distribution the "
                "trainer does not reproduce",
            ),
            (
                0.8,
                "a few very unlikely sampled tokens (long generations at high temperature) dominate the "
                "weights",
            ),
        ]
    )
    causes = [c for c in causes if spec.top_p < 1.0 or not c.startswith("sampling.topP")]
    return finding(
        is_ess_collapse,
        "critical" if worst < ESS_CRITICAL else "warning",
        f"is_ess fell below {ESS_WARNING:g} in {len(low)} of {len(series)} steps "
        f"({steps_phrase(s.step for s, _ in low)}); lowest {worst:.3f} at step {worst_step.step}.",
        causes,
        "Read fidelity_pearson and max_staleness_seen for the same steps; if fidelity is fine, compare "
        "the proxy's sampling settings with the trainer's (temperature, topP) and look at is_capped_share.",
        evidence={
            "warning_below": ESS_WARNING,
            "critical_below": ESS_CRITICAL,
            "importance_mode": spec.importance_mode,
            "per_step": [
                {
                    "step": s.step,
                    "is_ess": v,
                    "is_capped_share": finite(s.figures.is_capped_share),
                    "fidelity_pearson": finite(s.figures.fidelity_pearson),
                    "max_staleness_seen": finite(s.figures.max_staleness_seen),
                }
                for s, v in low
            ],
        },
        steps=[s.step for s, _ in low],
    )


def _groups(step: StepFacts, drop: set[str]) -> dict[str, list[float]] | None:
    """Rewards of the trained-on trials by group (groups of ≥ 2), None when the step has no trials."""
    if not step.trials:
        return None
    groups: dict[str, list[float]] = {}
    for trial in step.trials:
        if trial.termination_reason in drop or trial.reward is None:
            continue
        groups.setdefault(trial.group_id, []).append(trial.reward)
    return {g: r for g, r in groups.items() if len(r) >= 2}


@rule("equal-reward-groups", "Most groups with equal rewards")
def equal_reward_groups(facts: RunFacts) -> Finding | None:
    """In ≥ 2 consecutive committed steps, ≥ 75% of the groups (trained-on trials, ≥ 2 per group) got
    the same reward in every trial: GRPO's advantage is 0 for them, so they teach nothing. Critical
    when every group was equal for ≥ 3 consecutive steps. Uses the commit's meta
    (`zero_variance_groups`, `groups`) when the step's trials are not in the facts."""
    drop = set(facts.spec.drop_reasons)
    rows: dict[int, dict[str, Any]] = {}
    for step in facts.committed:
        groups = _groups(step, drop)
        if groups is None:
            try:
                batch = BatchSummary.from_json(step.meta)
            except FiguresError:
                continue
            total, equal = batch.groups, batch.zero_variance_groups
            if total is None or equal is None or total <= 0:
                continue
            zeros = ones = None
        else:
            if not groups:
                continue
            flat = [r for r in groups.values() if max(r) == min(r)]
            total, equal = len(groups), len(flat)
            zeros = sum(1 for r in flat if r[0] <= 0.0)
            ones = sum(1 for r in flat if r[0] >= 1.0)
        rows[step.step] = {
            "step": step.step,
            "groups": total,
            "equal": equal,
            "all_zero": zeros,
            "all_one": ones,
            "share": equal / total,
        }
    hits = {s for s, r in rows.items() if r["share"] >= EQUAL_SHARE}
    spans = [r for r in runs(sorted(rows), hits) if len(r) >= EQUAL_MIN_STEPS]
    if not spans:
        return None
    span = spans[-1]
    chosen = [rows[s] for s in span]
    every = all(r["share"] >= 1.0 for r in chosen)
    equal_total = sum(r["equal"] for r in chosen)
    groups_total = sum(r["groups"] for r in chosen)
    zeros = sum(r["all_zero"] or 0 for r in chosen)
    ones = sum(r["all_one"] or 0 for r in chosen)
    spec = facts.spec
    causes = ranked(
        [
            (
                3.0 if zeros >= 0.7 * equal_total else 1.0,
                "the tasks are too hard for the policy as it is: every trial of most tasks fails (or the "
                "verifier never passes — see the verifier finding)",
            ),
            (
                3.0 if ones >= 0.7 * equal_total else 0.5,
                "the tasks are too easy: the policy already solves most of them every time",
            ),
            (
                2.0 if spec.group_size <= 4 else 0.8,
                f"algorithm.groupSize {spec.group_size} is small: with a pass/fail reward a few trials "
                "often agree",
            ),
            (
                2.0 if spec.temperature < 0.7 else 0.0,
                f"sampling temperature {spec.temperature:g} makes the trials of a task nearly identical",
            ),
        ]
    )
    causes = [c for c in causes if spec.temperature < 0.7 or not c.startswith("sampling temperature")]
    return finding(
        equal_reward_groups,
        "critical" if every and len(span) >= EQUAL_CRITICAL_STEPS else "warning",
        f"In {steps_phrase(span)} {equal_total} of {groups_total} groups had the same reward in every "
        f"trial ({zeros} all failed, {ones} all solved), so their advantages are 0 "
        f"(filter.zeroVarianceGroups {spec.zero_variance_groups}).",
        causes,
        "Look at the per-task solve rates (evaluations' per_task, the UI's task view): drop tasks the "
        "policy always or never solves, raise algorithm.groupSize, and run the verifier with a gold patch "
        "if every group scored 0.",
        evidence={"threshold_share": EQUAL_SHARE, "group_size": spec.group_size, "per_step": chosen},
        steps=span,
    )


@rule("updates-skipped", "Training steps skipped")
def updates_skipped(facts: RunFacts) -> Finding | None:
    """Steps whose trainer figures carry `skipped` (a non-finite gradient norm, or nothing left to
    train on after filtering). Critical when the latest trained step was skipped or ≥ 3 were."""
    series = [(s, s.figures.skipped) for s in facts.steps if s.figures.skipped is not None]
    if not series:
        return None
    trained = [s for s in facts.steps if s.metrics]
    latest_skipped = bool(trained) and trained[-1].step == series[-1][0].step
    reasons = [str(why) for _, why in series]
    nonfinite = sum("non-finite" in r for r in reasons)
    empty = sum("no trials left" in r for r in reasons)
    causes = ranked(
        [
            (
                float(nonfinite),
                "the loss or its gradient overflowed: learning rate too high, bfloat16 overflow, or extreme "
                "importance weights",
            ),
            (
                float(empty),
                "every trial was filtered out (infra failures, zero-variance groups, staleness — see the "
                "other findings)",
            ),
            (
                float(len(reasons) - nonfinite - empty),
                "the trials carried no sampled tokens (the proxy journaled no turns)",
            ),
        ]
    )
    return finding(
        updates_skipped,
        "critical" if latest_skipped or len(series) >= SKIPPED_CRITICAL_STEPS else "warning",
        f"The trainer skipped the update in {len(series)} steps ({steps_phrase(s.step for s, _ in series)}): "
        f"{reasons[-1]}.",
        causes,
        "Read the trainer's figures of those steps (trials_kept, dropped_by_reason.*, grad_norm) and its "
        "log; lower the learning rate if the gradient norm was non-finite.",
        evidence={"per_step": [{"step": s.step, "skipped": why} for s, why in series]},
        steps=[s.step for s, _ in series],
    )


@rule("entropy-collapse", "Policy entropy collapsed")
def entropy_collapse(facts: RunFacts) -> Finding | None:
    """The trainer's `entropy` in the latest step below 20% of the median of the first three steps
    (with ≥ 4 steps recorded): the policy has become nearly deterministic."""
    series = _series(facts, lambda f: f.entropy)
    if len(series) < ENTROPY_MIN_STEPS:
        return None
    baseline = median([v for _, v in series[:ENTROPY_BASELINE_STEPS]])
    latest_step, latest = series[-1]
    if baseline is None or baseline <= 0 or latest >= ENTROPY_DROP * baseline:
        return None
    spec = facts.spec
    return finding(
        entropy_collapse,
        "warning",
        f"Entropy fell from {baseline:.3f} (median of the first {ENTROPY_BASELINE_STEPS} steps) to "
        f"{latest:.3f} at step {latest_step.step} ({latest / baseline:.0%} of it).",
        [
            "the learning rate is high or each batch is used for several updates (miniBatches "
            f"{spec.mini_batches}), pushing the policy to one behaviour",
            "the policy converged on one way of earning reward (look for tamper findings)",
            "no entropy bonus or KL term holds it (algorithm.entropyCoef, klCoef)",
        ],
        "Compare the held-out solve rate over the same steps: a falling rate with falling entropy is a "
        "collapse — lower the learning rate or add klCoef/entropyCoef.",
        evidence={
            "baseline": baseline,
            "latest": latest,
            "per_step": [{"step": s.step, "entropy": v} for s, v in series],
        },
        steps=[latest_step.step],
    )

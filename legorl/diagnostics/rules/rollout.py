"""Rules about rollouts: tool calls, the engine during weight syncs, stale trajectories."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Final

from legorl.api.termination import TerminationReason
from legorl.diagnostics._util import common_errors, mentions, pct, ranked, steps_phrase
from legorl.diagnostics.facts import RunFacts, StepFacts, TrialFacts, finite
from legorl.diagnostics.finding import Finding, Severity, finding, rule

MIN_BATCH_TRIALS: Final = 4
"""A step needs this many trials that reached the agent before its tool calls say anything."""

SYNC_MARGIN_SECONDS: Final = 180.0
"""An engine error up to this long after a sync ended still counts as during it: the proxy retries a
503 for `retryBudgetSeconds` (120 s by default) before the trial ends as `engine_error`."""
SYNC_LEAD_SECONDS: Final = 5.0
"""An engine error this long before a version's publication counts too (clocks of two processes)."""
MIN_SYNC_ENGINE_ERRORS: Final = 3
SYNC_ERRORS_CRITICAL_SHARE: Final = 0.25

STALE_CRITICAL_SHARE: Final = 0.5
"""Share of a step's agent trials too stale to train on that makes the finding critical."""

_UNAVAILABLE_WORDS = ("503", "unavailable", "aborted the call", "abort", "refused")


@rule("zero-tool-calls", "No tool calls in a batch")
def zero_tool_calls(facts: RunFacts) -> Finding | None:
    """A training step in which no trial that reached the agent (≥ 4 non-infra trials) made a tool call.

    Trial records carry the turns the engine answered with parsed tool calls
    (`TrialRecord.tool_call_turns`, from the proxy's finish reasons); for trials recorded before that
    (`TrialFacts.tool_calls` None) the rule matches the shapes such a batch takes: every trial ended
    after at most one model call (a tool-calling harness answers each call with another model call),
    or every trial ran into the turn limit (a harness re-asking after each reply without a call).
    Critical when tool-call counts are recorded, a warning on the fallback shapes."""
    counted: list[StepFacts] = []
    single: list[StepFacts] = []
    at_limit: list[StepFacts] = []
    for step in facts.steps:
        ran = [t for t in step.trials if not t.infra]
        if len(ran) < MIN_BATCH_TRIALS:
            continue
        if all(t.tool_calls is not None for t in ran):
            if sum(t.tool_calls or 0 for t in ran) == 0:
                counted.append(step)
        elif all(t.num_turns <= 1 for t in ran) and 2 * sum(t.num_turns == 1 for t in ran) >= len(ran):
            single.append(step)
        elif all(t.termination_reason == TerminationReason.TURN_LIMIT for t in ran):
            at_limit.append(step)
    hits = counted or single or at_limit
    if not hits:
        return None
    spec = facts.spec
    ran = [t for s in hits for t in s.trials if not t.infra]
    where = steps_phrase(s.step for s in hits)
    if spec.fleet_dtype is not None and spec.tool_call_parser is None:
        parser = (
            "no toolCallParser is set on the fleet (fleet.settings.toolCallParser), so the engine "
            "returns tool calls as plain text"
        )
    else:
        named = f"`{spec.tool_call_parser}`" if spec.tool_call_parser else "of the shared fleet"
        parser = (
            f"the engine's tool-call parser ({named}) does not match the policy's chat template "
            "(e.g. `hermes` for a template that writes `qwen3_coder` XML), so calls stay in the text"
        )
    causes = [
        parser,
        "the chat template does not render the harness's tools (a template without tool support), so "
        "the policy never sees them",
        "the policy does not write tool calls in its template's format (a base or collapsed policy)",
    ]
    severity: Severity
    if counted:
        severity, signal = "critical", "tool_calls"
        summary = f"No tool call in any of the {len(ran)} trials that reached the agent in {where}."
    elif single:
        severity, signal = "warning", "num_turns"
        summary = (
            f"Tool calls are not recorded in the run store, but all {len(ran)} trials that reached the "
            f"agent in {where} ended after at most one model call — what a tool-calling harness does "
            "when no reply carries a tool call."
        )
        causes.append("the policy answers at once without using a tool and the harness stops")
    else:
        severity, signal = "warning", "turn_limit"
        limit = f"maxTurns {spec.max_turns}" if spec.max_turns else "the turn limit"
        summary = (
            f"Tool calls are not recorded in the run store, but all {len(ran)} trials that reached the "
            f"agent in {where} ran into {limit} — consistent with a harness re-asking after every reply "
            "that carries no tool call."
        )
        causes.append(f"harness.maxTurns ({spec.max_turns or 'default'}) is too low for these tasks")
    evidence: dict[str, Any] = {
        "signal": signal,
        "per_step": [_turns_row(s) for s in hits],
        "tool_call_parser": spec.tool_call_parser,
        "harness": spec.harness,
    }
    return finding(
        zero_tool_calls,
        severity,
        summary,
        causes,
        "Open an example trial's turns and read the raw completion: a call written out as text (e.g. "
        "`<tool_call>{…}`) means the parser does not match — set fleet.settings.toolCallParser to the "
        "parser of the policy's chat template; no call-like text at all points at the template or the "
        "policy.",
        evidence=evidence,
        steps=[s.step for s in hits],
        trials=[t.trial for t in ran],
    )


def _turns_row(step: StepFacts) -> dict[str, Any]:
    agent = [t for t in step.trials if not t.infra]
    mean = sum(t.num_turns for t in agent) / len(agent) if agent else 0.0
    return {
        "step": step.step,
        "trials": len(agent),
        "mean_turns": round(mean, 2),
        "by_reason": step.by_reason,
    }


@rule("engine-unavailable-during-sync", "Engine errors during weight syncs")
def engine_unavailable_during_sync(facts: RunFacts) -> Finding | None:
    """≥ 3 trials that ended as `engine_error` during a weight sync: between 5 s before a version's
    publication and `sync_seconds` + 180 s after it (the proxy retries a 503 for its retry budget,
    120 s by default), or that saw two policy versions (they were live across a swap). Critical when
    they are ≥ 25% of the trials of their steps. The proxy's retry counts are not in the store; the
    trials' errors say whether the engine answered 503."""
    windows = []
    for step in facts.steps:
        if step.published_at is None:
            continue
        sync = finite(step.figures.sync_seconds) or 0.0
        start = step.published_at - timedelta(seconds=SYNC_LEAD_SECONDS)
        end = step.published_at + timedelta(seconds=sync + SYNC_MARGIN_SECONDS)
        windows.append((step.step, start, end, sync))
    engine = [t for t in facts.trials() if t.termination_reason == TerminationReason.ENGINE_ERROR]
    hits: list[tuple[TrialFacts, int | None]] = []
    for trial in engine:
        version = next(
            (w[0] for w in windows if trial.ended_at is not None and w[1] <= trial.ended_at <= w[2]),
            None,
        )
        if version is not None or len(set(trial.policy_versions)) > 1:
            hits.append((trial, version))
    if len(hits) < MIN_SYNC_ENGINE_ERRORS:
        return None
    steps = sorted({t.step for t, _ in hits})
    in_steps = sum(len(s.trials) for s in facts.steps if s.step in steps)
    share = len(hits) / in_steps if in_steps else 1.0
    unavailable = mentions((t.error for t, _ in hits), *_UNAVAILABLE_WORDS)
    syncs = sorted({v for _, v in hits if v is not None})
    longest = max((w[3] for w in windows if w[0] in syncs), default=None)
    pause = facts.spec.weight_sync_pause_mode
    causes = ranked(
        [
            (
                3.0 if pause == "Abort" else 0.0,
                "weightSync.pauseMode is Abort: every update ends the calls in flight",
            ),
            (
                2.0 if longest is not None and longest > 60 else 1.0,
                "the engines answer 503 while they load new weights for longer than the proxy's retry "
                "budget (retryBudgetSeconds, 120 s by default): a slow sync (large model, slow store)",
            ),
            (
                1.0,
                "every replica pauses for the update at once, so no engine is left to serve the calls",
            ),
            (0.5, "engines restart or fail while loading the new weights (memory during the swap)"),
        ]
    )
    return finding(
        engine_unavailable_during_sync,
        "critical" if share >= SYNC_ERRORS_CRITICAL_SHARE else "warning",
        f"{len(hits)} trials ended as engine_error during weight syncs"
        + (f" of {', '.join(f'v{v}' for v in syncs)}" if syncs else "")
        + f" ({pct(len(hits), in_steps)} of the trials of {steps_phrase(steps)}); "
        f"{unavailable} of their errors mention 503, unavailability or an abort.",
        causes,
        "Compare the trainer's sync_seconds with the proxy's retryBudgetSeconds, read the engine logs "
        "around the publication times in the evidence, and watch legorl_proxy_engine_retries_total on "
        "the trial proxies; use weightSync.pauseMode Keep or Wait rather than Abort.",
        evidence={
            "engine_errors": len(engine),
            "during_sync": len(hits),
            "mention_unavailable": unavailable,
            "syncs": [
                {"version": f"v{w[0]}", "published_at": w[1].isoformat(), "sync_seconds": w[3]}
                for w in windows
                if w[0] in syncs
            ],
            "pause_mode": pause,
            "errors": common_errors(t for t, _ in hits),
        },
        steps=steps,
        trials=[t.trial for t, _ in hits],
    )


@rule("staleness-over-limit", "Trajectories staler than the limit")
def staleness_over_limit(facts: RunFacts) -> Finding | None:
    """Agent trials of step N that saw a policy version older than v(N−1) − limit (limit: 0 in Sync
    mode, schedule.maxStalenessSteps — default 1 — in Async), trials whose version the engine did not
    report (`unknown`), or a trainer `max_staleness_seen` above the limit. The trainer drops such
    trials. Critical when they are ≥ 50% of a step's agent trials."""
    limit = facts.spec.staleness_limit
    rows: list[dict[str, Any]] = []
    examples: list[str] = []
    critical = False
    for step in facts.steps:
        agent = [t for t in step.trials if not t.infra]
        stale = [
            t for t in agent if t.oldest_version is not None and step.step - 1 - t.oldest_version > limit
        ]
        unknown = [t for t in agent if t.policy_versions and t.oldest_version is None]
        seen = finite(step.figures.max_staleness_seen)
        worst = max((step.step - 1 - (t.oldest_version or 0) for t in stale), default=None)
        if seen is not None and seen > limit:
            worst = max(worst or 0, int(seen))
        if not stale and not unknown and worst is None:
            continue
        dropped = finite(step.figures.dropped_stale)
        rows.append(
            {
                "step": step.step,
                "stale": len(stale),
                "unknown_version": len(unknown),
                "agent_trials": len(agent),
                "max_staleness": worst,
                "dropped_stale": dropped,
            }
        )
        examples += [t.trial for t in stale + unknown]
        total = finite(step.figures.trials_total) or len(agent)
        lost = max(len(stale) + len(unknown), int(dropped or 0))
        critical = critical or (total > 0 and lost / total >= STALE_CRITICAL_SHARE)
    if not rows:
        return None
    n_stale = sum(int(r["stale"] or 0) for r in rows)
    n_unknown = sum(int(r["unknown_version"] or 0) for r in rows)
    worst_all = max((int(r["max_staleness"]) for r in rows if r["max_staleness"] is not None), default=None)
    steps = [int(r["step"] or 0) for r in rows]
    parts = []
    if n_stale or worst_all is not None:
        parts.append(
            f"{n_stale} trials saw a policy more than {limit} version(s) behind the one trained"
            + (f" (up to {worst_all} behind)" if worst_all is not None else "")
        )
    if n_unknown:
        parts.append(f"{n_unknown} trials carry a policy version the engine did not report")
    mode = facts.spec.schedule_mode
    causes = (
        [
            "a weight sync failed or a replica kept serving an older version, so trials of the next "
            "step ran on old weights",
            "the fleet reported the new version before every replica served it (a partial sync)",
        ]
        if mode == "Sync"
        else [
            "trials run longer than a training step and straddle several weight swaps (agent deadline "
            "long compared with the trainer's step time)",
            f"schedule.maxStalenessSteps ({limit}) is tight for how fast the trainer steps",
            "a weight sync failed or a replica lags behind the others",
        ]
    )
    if n_unknown:
        causes.insert(
            0 if n_unknown >= n_stale else len(causes),
            "the engine does not report its policy version (`unknown`): the weight-info route is "
            "missing or failing",
        )
    return finding(
        staleness_over_limit,
        "critical" if critical else "warning",
        f"In {steps_phrase(steps)} {' and '.join(parts)}; the trainer drops them ({mode} mode, "
        f"staleness limit {limit}).",
        causes,
        "Compare the fleet's served versions per replica (RolloutFleet status) with the trainer's "
        "step, read the trainer's log for failed syncs, and in Async mode weigh the agent deadline "
        "against the trainer's step time.",
        evidence={"limit": limit, "mode": mode, "per_step": rows},
        steps=steps,
        trials=examples,
    )

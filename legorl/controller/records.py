"""One trial record from what each part saw: the proxy's trajectory, the sandbox stages, the verifier.

Both backends end a trial the same way: they know how the sandbox stages went (a reason from the
sandbox's point of view, a reward from verify, tamper findings, stage timings) and they fetch the proxy's
`GET /trajectory` (a `legorl.api.summary.TrajectorySummary`: segments, the proxy's own end state, policy
versions). `reconcile` decides the one termination reason the run store keeps; `build_record` assembles
the `TrialRecord`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from legorl.api.summary import TrajectorySummary
from legorl.api.termination import TerminationReason
from legorl.api.trajectory import TamperFinding, TrialRecord

from .backend import TrialRequest

R = TerminationReason

_SANDBOX_FINAL = frozenset({R.SANDBOX_ERROR, R.DEFENSE_FAILED, R.CANCELLED, R.VERIFIER_ERROR})
"""The sandbox's verdicts that stand whatever the proxy saw (the trial never ran properly, or its work
could not be scored)."""

_PROXY_WINS = frozenset({R.TURN_LIMIT, R.CONTEXT_OVERFLOW, R.ENGINE_ERROR, R.PROXY_ERROR})
"""Failures the proxy saw first-hand: they explain a harness exit better than its exit code does."""


def reconcile(sandbox_reason: str, trajectory: TrajectorySummary | None) -> TerminationReason:
    """The trial's termination reason.

    `sandbox_reason` is the sandbox's view (`completed`/`agent_error` from the harness's exit code,
    `agent_timeout`, `sandbox_error`, `defense_failed`, `verifier_error`, `cancelled`); the proxy's end
    state (`trajectory.end`) names failures only it could see. Without a trajectory the proxy is
    gone: a trial that otherwise ran is a `proxy_error` (its turns cannot be trusted or trained on).
    """
    reason = R(sandbox_reason)
    if reason in _SANDBOX_FINAL:
        return reason
    if trajectory is None:
        return R.PROXY_ERROR
    if trajectory.end is not None and trajectory.end.reason in _PROXY_WINS:
        return trajectory.end.reason
    return reason


def findings_from(items: Sequence[Mapping[str, Any]]) -> list[TamperFinding]:
    """Tamper findings as the sandbox reports them (`TamperFinding.from_dict`: unknown kinds are kept as
    `outside_repo`, never dropped)."""
    return [TamperFinding.from_dict(item) for item in items]


def build_record(
    request: TrialRequest,
    *,
    run: str,
    harness: str,
    reason: TerminationReason,
    reward: float | None,
    trajectory: TrajectorySummary | None,
    started_at: datetime,
    ended_at: datetime,
    findings: Sequence[Mapping[str, Any]] = (),
    stage_seconds: Mapping[str, float] | None = None,
    error: str | None = None,
) -> TrialRecord:
    """The record the run store keeps. Infrastructure failures keep no reward (they are never trained
    on); agent outcomes without a verifier result get 0 only when verify said so."""
    segments = trajectory.segment_list if trajectory is not None else []
    if reason in (R.SANDBOX_ERROR, R.DEFENSE_FAILED, R.CANCELLED, R.VERIFIER_ERROR, R.PROXY_ERROR):
        reward = None
    if reason == R.ENGINE_ERROR:
        reward = None
    versions = list(trajectory.policy_versions) if trajectory is not None else []
    if not versions and segments:
        for seg in segments:
            versions.extend(v for v in seg.policy_versions if v not in versions)
    finishes = trajectory.finish_reasons if trajectory is not None else None
    tool_call_turns = finishes.get("tool_calls", 0) if finishes is not None else None
    return TrialRecord(
        run=run,
        trial=request.trial,
        task_id=request.task.instance_id,
        group_id=request.group_id,
        split=request.split,
        step=request.step,
        harness=harness,
        termination_reason=reason,
        reward=reward,
        started_at=started_at,
        ended_at=ended_at,
        segments=segments,
        tamper_findings=findings_from(findings),
        policy_versions=versions,
        num_turns=trajectory.turns if trajectory is not None else 0,
        merged_turn_share=trajectory.merged_turn_share if trajectory is not None else None,
        stage_seconds=dict(stage_seconds or {}),
        error=error[-4000:] if error else None,
        tool_call_turns=tool_call_turns,
    )

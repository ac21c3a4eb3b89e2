"""How a trial's pods are doing, read from the pods the kubelet reports (pure: pod and clock in).

`agent_end` says how the agent stage of a trial pod ended (or None while it runs), in the sandbox's
termination vocabulary; `verify_result` reads a verify pod's verdict from its termination message.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from legorl.api.timestamps import parse_time
from legorl.operator.observe import CRASH_REASONS, PULL_FAILURES
from legorl.operator.render.trial import COLLECT_GRACE_SECONDS

DEFENSE_EXIT = 3
"""`legorl-sandbox setup` and `egress-lock` exit 3 when a defense self-test failed."""
START_FAILURES = PULL_FAILURES | (CRASH_REASONS - {"CrashLoopBackOff"})
"""Waiting reasons that mean a container will not start without a person fixing something."""
RETRIED_PULLS = frozenset({"ErrImagePull", "ImagePullBackOff"})
"""Pull failures the kubelet retries (a registry hiccup, a rate limit): fatal only after a grace."""
PULL_GRACE_SECONDS = 120


def _start_failure(waiting: Mapping[str, Any] | None, waited: float) -> bool:
    """Whether a waiting container will not start (a retried pull only after `PULL_GRACE_SECONDS`)."""
    if waiting is None or waiting.get("reason") not in START_FAILURES:
        return False
    return waiting.get("reason") not in RETRIED_PULLS or waited >= PULL_GRACE_SECONDS


@dataclass(frozen=True)
class AgentEnd:
    """How the agent stage ended, from the pod (and the clock)."""

    reason: str
    """The sandbox's view: completed, agent_error, agent_timeout, sandbox_error, defense_failed,
    proxy_error."""
    detail: str = ""
    exit_code: int | None = None
    collect: bool = False
    """Whether the proxy holds results to collect (the agent ran and the pod still runs)."""
    salvage: bool = False
    """Not graded, but the proxy may still hold the turns it acknowledged: read them while it drains
    (a pod being deleted)."""
    stage_seconds: Mapping[str, float] = field(default_factory=dict)


def _statuses(pod: Mapping[str, Any], key: str) -> dict[str, dict[str, Any]]:
    return {s.get("name", ""): s for s in (pod.get("status") or {}).get(key) or []}


def _terminated(status: Mapping[str, Any] | None) -> dict[str, Any] | None:
    if not status:
        return None
    term = (status.get("state") or {}).get("terminated")
    return term if isinstance(term, dict) else None


def _waiting(status: Mapping[str, Any] | None) -> dict[str, Any] | None:
    if not status:
        return None
    wait = (status.get("state") or {}).get("waiting")
    return wait if isinstance(wait, dict) else None


def _explain(term_or_wait: Mapping[str, Any]) -> str:
    reason = str(term_or_wait.get("reason") or "")
    message = str(term_or_wait.get("message") or "").strip()
    return f"{reason}: {message[:1500]}" if reason and message else (reason or message[:1500])


def _seconds(start: datetime | None, end: datetime | None) -> float | None:
    if start is None or end is None:
        return None
    return max(0.0, (end - start).total_seconds())


DELETION_SLACK = timedelta(seconds=2)
"""Clock skew allowed between the API server (deletionTimestamp) and the kubelet (finishedAt)."""


def _deleted_before(meta: Mapping[str, Any], term: Mapping[str, Any] | None) -> bool:
    """The pod is being deleted and its agent had not ended before the deletion was asked for
    (`deletionTimestamp` is when the grace period ends: asked = it - deletionGracePeriodSeconds)."""
    deadline = parse_time(meta.get("deletionTimestamp"))
    if deadline is None:
        return False
    asked = deadline - timedelta(seconds=int(meta.get("deletionGracePeriodSeconds") or 0))
    finished = parse_time((term or {}).get("finishedAt"))
    return finished is None or finished >= asked - DELETION_SLACK


def _latest(when: datetime | None, claimed: datetime | None) -> datetime | None:
    """WHEN, or the claim if it came later (a warm pod's agent container started before its trial)."""
    if when is None or claimed is None:
        return when
    return max(when, claimed)


def agent_end(
    pod: Mapping[str, Any],
    *,
    now: datetime,
    setup_seconds: int,
    agent_seconds: int,
    launched: datetime,
    agent_container: str = "agent",
    claimed: datetime | None = None,
) -> AgentEnd | None:
    """How the agent stage of a trial pod ended, or None while it runs. Pure: the pod and the clock.
    CLAIMED: a warm pod's claim (its stages were done ahead, its agent waited at the gate until then):
    the trial's clock starts there, not at the pod's start."""
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    inits, mains = _statuses(pod, "initContainerStatuses"), _statuses(pod, "containerStatuses")
    agent = mains.get(agent_container)
    start = parse_time(status.get("startTime")) or launched
    start = max(start, claimed) if claimed is not None else start
    waited = (now - start).total_seconds()
    running = ((agent or {}).get("state") or {}).get("running") or {}
    agent_started = _latest(parse_time(running.get("startedAt")), claimed)
    seconds: dict[str, float] = {}

    term = _terminated(agent)
    if _deleted_before(meta, term):
        # Someone deleted the pod (or evicted it) while the agent ran: the kubelet stopped the agent
        # (exit 143/137), and what it leaves is no outcome of the agent's. Checked before the agent's
        # exit, which a busy controller may see first (it would then call a dying proxy, and grade).
        return AgentEnd(
            "sandbox_error", "the trial pod was deleted (evicted or deleted by someone)", salvage=True
        )
    if term is not None:
        started, finished = (
            _latest(parse_time(term.get("startedAt")), claimed),
            parse_time(term.get("finishedAt")),
        )
        for name, value in (("setup", _seconds(start, started)), ("agent", _seconds(started, finished))):
            if value is not None:
                seconds[name] = value
        code = int(term.get("exitCode", 0))
        detail = f"the agent exited {code}" + (f" ({_explain(term)})" if _explain(term) else "")
        reason = "completed" if code == 0 else "agent_error"
        return AgentEnd(reason, detail, code, collect=True, stage_seconds=seconds)
    for name, container in inits.items():
        init_term = _terminated(container)
        if init_term is not None and int(init_term.get("exitCode", 0)) != 0:
            code = int(init_term.get("exitCode", 0))
            why = f"init container {name} exited {code}" + (
                f" ({_explain(init_term)})" if _explain(init_term) else ""
            )
            reason = "defense_failed" if code == DEFENSE_EXIT else "sandbox_error"
            return AgentEnd(reason, why, code)
        waiting = _waiting(container)
        if _start_failure(waiting, waited):
            assert waiting is not None
            return AgentEnd("sandbox_error", f"init container {name} cannot start: {_explain(waiting)}")
        if waiting is not None and waiting.get("reason") == "CrashLoopBackOff":
            return AgentEnd("proxy_error", f"sidecar {name} keeps crashing: {_explain(waiting)}")
    for name, container in mains.items():
        waiting = _waiting(container)
        if _start_failure(waiting, waited):
            assert waiting is not None
            return AgentEnd("sandbox_error", f"container {name} cannot start: {_explain(waiting)}")
    phase = status.get("phase", "Pending")
    if phase in ("Failed", "Succeeded"):
        why = _explain(status) or f"the pod is {phase}"
        if status.get("reason") == "DeadlineExceeded":
            # The kubelet killed the pod (the backstop deadline): the proxy is gone with it.
            return AgentEnd("agent_timeout", f"the trial pod passed its deadline and was killed: {why}")
        return AgentEnd("sandbox_error", f"the trial pod ended before the agent did: {why}")
    if agent_started is not None or running:
        if now >= start + timedelta(seconds=setup_seconds + agent_seconds):
            if agent_started is not None:
                seconds["setup"] = max(0.0, (agent_started - start).total_seconds())
                seconds["agent"] = max(0.0, (now - agent_started).total_seconds())
            return AgentEnd(
                "agent_timeout",
                f"the agent ran past the pool's deadline (setupSeconds {setup_seconds} + agentSeconds "
                f"{agent_seconds})",
                collect=True,
                stage_seconds=seconds,
            )
        return None
    if now >= start + timedelta(seconds=setup_seconds):
        scheduled = {c.get("type"): c for c in status.get("conditions") or []}.get("PodScheduled") or {}
        if scheduled.get("status") == "False":
            return AgentEnd(
                "sandbox_error",
                f"the trial pod was not scheduled within setupSeconds ({setup_seconds}s): "
                f"{_explain(scheduled) or 'Unschedulable'}",
            )
        return AgentEnd(
            "sandbox_error", f"setup did not finish within setupSeconds ({setup_seconds}s) (phase {phase})"
        )
    return None


@dataclass(frozen=True)
class VerifyResult:
    """The verifier's verdict: a reward and findings, or an error."""

    reward: float | None = None
    findings: tuple[Mapping[str, Any], ...] = ()
    error: str | None = None
    seconds: float | None = None
    note: str | None = None
    """Something the record's error field should say although there is a reward."""


_REWARD = re.compile(r'"reward":\s*(-?[0-9.]+(?:[eE][-+]?[0-9]+)?)')


def parse_verify_message(message: str) -> VerifyResult:
    """The verify container's termination message (`legorl-sandbox verify`'s JSON, cut at 4000
    characters by the tool itself): reward and tamper findings."""
    text = message.strip()
    try:
        payload = json.loads(text)
    except json.JSONDecodeError:
        # A long grade is cut off mid-JSON; the reward comes first and is what matters.
        match = _REWARD.search(text)
        if match is None:
            return VerifyResult(
                error=f"the verifier left no readable result (termination message: {text[:200]!r})"
            )
        note = "the verifier's termination message was cut off: its tamper findings are not recorded"
        return VerifyResult(reward=float(match.group(1)), note=note)
    if not isinstance(payload, dict):
        return VerifyResult(error="the verifier's termination message is not a JSON object")
    reward = payload.get("reward")
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        return VerifyResult(error=f"the verifier gave no reward ({payload.get('error') or text[:200]})")
    findings = payload.get("tamperFindings") or []
    return VerifyResult(reward=float(reward), findings=tuple(f for f in findings if isinstance(f, dict)))


def verify_result(
    pod: Mapping[str, Any], *, now: datetime, verify_seconds: int, created: datetime
) -> VerifyResult | None:
    """The verdict of a verify pod, or None while it runs. Pure: the pod and the clock."""
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    inits, mains = _statuses(pod, "initContainerStatuses"), _statuses(pod, "containerStatuses")
    start = parse_time(status.get("startTime")) or created
    term = _terminated(mains.get("verify"))
    if term is not None:
        seconds = _seconds(start, parse_time(term.get("finishedAt")))
        code = int(term.get("exitCode", 0))
        if code != 0:
            return VerifyResult(error=f"the verifier exited {code}: {_explain(term)}", seconds=seconds)
        result = parse_verify_message(str(term.get("message") or ""))
        return VerifyResult(result.reward, result.findings, result.error, seconds, result.note)
    if meta.get("deletionTimestamp"):
        return VerifyResult(error="the verify pod was deleted (evicted or deleted by someone)")
    for name, container in (*inits.items(), *mains.items()):
        init_term = _terminated(container)
        if init_term is not None and int(init_term.get("exitCode", 0)) != 0:
            return VerifyResult(
                error=f"verify's {name} exited {init_term.get('exitCode')}: {_explain(init_term)}"
            )
        waiting = _waiting(container)
        if _start_failure(waiting, (now - start).total_seconds()):
            assert waiting is not None
            return VerifyResult(error=f"verify's {name} cannot start: {_explain(waiting)}")
    if status.get("phase") in ("Failed", "Succeeded"):
        return VerifyResult(
            error=f"the verify pod ended without a result: {_explain(status) or status['phase']}"
        )
    if now >= start + timedelta(seconds=verify_seconds + COLLECT_GRACE_SECONDS):
        return VerifyResult(error=f"verify did not finish within verifySeconds ({verify_seconds}s)")
    return None

"""Why a trial ended: the closed set of termination reasons (DESIGN §5); no dependencies."""

from __future__ import annotations

from typing import Final

from legorl.api._enum import DocumentedEnum


class TerminationReason(DocumentedEnum):
    """Why a trial ended — a closed set (DESIGN §5)."""

    COMPLETED = "completed", "The harness finished on its own; the reward comes from verification."
    AGENT_ERROR = (
        "agent_error",
        "The harness exited with an error of its own (bad tool call, crash).",
    )
    TURN_LIMIT = "turn_limit", "The harness used up its turn budget."
    CONTEXT_OVERFLOW = "context_overflow", "A prompt no longer fit the engine's context window."
    AGENT_TIMEOUT = "agent_timeout", "The agent stage ran past its deadline."
    SANDBOX_ERROR = (
        "sandbox_error",
        "The sandbox failed (pod evicted, OOM of the runtime, setup failed).",
    )
    ENGINE_ERROR = (
        "engine_error",
        "The rollout engine failed or stayed unavailable past the retry budget.",
    )
    PROXY_ERROR = "proxy_error", "The proxy failed (journal write, upstream protocol error)."
    VERIFIER_ERROR = (
        "verifier_error",
        "Verification could not produce a result (tests did not run).",
    )
    DEFENSE_FAILED = "defense_failed", "A defense could not be applied or its self-test failed."
    CANCELLED = "cancelled", "The run stopped or was suspended while the trial ran."


INFRA_REASONS: Final = frozenset(
    {
        TerminationReason.SANDBOX_ERROR,
        TerminationReason.ENGINE_ERROR,
        TerminationReason.PROXY_ERROR,
        TerminationReason.VERIFIER_ERROR,
        TerminationReason.DEFENSE_FAILED,
        TerminationReason.CANCELLED,
    }
)
"""Reasons that say nothing about the policy; dropped from the loss by default."""

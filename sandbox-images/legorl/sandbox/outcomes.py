"""How a trial ends: the termination reasons and tamper kinds every part shares (DESIGN §5).

One definition, imported by the sandbox stages (which run inside task images, standard library
only) and re-exported by the API (`legorl.api.termination`, `legorl.api.trajectory`), so nothing
spells a reason as a string and no test has to keep two lists equal. It lives in the sandbox
package because task images carry only that package; it imports nothing but the standard library.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Final, Literal, cast, get_args


class DocumentedEnum(StrEnum):
    """A string enum whose members carry a one-line meaning (used by docs and the UI)."""

    description: str

    def __new__(cls, value: str, description: str = "") -> DocumentedEnum:
        member = str.__new__(cls, value)
        member._value_ = value
        member.description = description
        return member


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


TamperKind = Literal[
    "test_file_modified",
    "test_hook_added",
    "symlink",
    "binary_patch",
    "outside_repo",
    "egress_attempt",
    "results_tampered",
]
"""What a tamper finding is about: the closed set the sandbox reports and the trial table stores."""

TAMPER_KINDS: Final[frozenset[str]] = frozenset(get_args(TamperKind))


@dataclass(frozen=True, kw_only=True)
class TamperFinding:
    """Something the agent did that could game the reward: what the sandbox strips and reports, the
    verifier's termination message carries, the run controller records and the trial table stores
    (`legorl.api.trajectory` re-exports it)."""

    kind: TamperKind
    detail: str
    path: str | None = None
    """The file it is about, relative to the repository (None: the whole change set)."""

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "path": self.path, "detail": self.detail}

    @classmethod
    def from_dict(cls, item: Mapping[str, Any]) -> TamperFinding:
        """A finding as JSON carries it. A kind outside the closed set (a newer sandbox's) is kept, not
        dropped: as `outside_repo`, with the kind it named at the head of its detail."""
        kind, detail = str(item.get("kind", "")), str(item.get("detail", ""))
        path = item.get("path")
        if kind not in TAMPER_KINDS:
            kind, detail = "outside_repo", f"{kind}: {detail}"
        return cls(kind=cast("TamperKind", kind), detail=detail, path=None if path is None else str(path))


TamperPolicy = Literal["StripAndReport", "FailTrial"]
"""What verification does with a diff that touches tests or test-runner hooks: strip those parts and
record the finding, or end the trial with reward 0 (the SandboxPool's `tamperPolicy`)."""

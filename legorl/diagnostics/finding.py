"""What a diagnostic rule reports (`Finding`) and how rules are declared and listed (`Rule`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field

from legorl.diagnostics.facts import RunFacts

__all__ = ["SEVERITY_RANK", "Finding", "Rule", "Severity", "rule"]

Severity = Literal["info", "warning", "critical"]
SEVERITY_RANK: Final[dict[str, int]] = {"critical": 2, "warning": 1, "info": 0}

MAX_EXAMPLE_TRIALS: Final = 10


class Finding(BaseModel):
    """A failure signature matched in a run: what was seen, what plausibly causes it, what to check.

    Findings state correlations, never proof: `causes` are the plausible explanations consistent
    with the evidence, most likely first."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rule: str
    """Stable id of the rule that matched (e.g. `zero-tool-calls`)."""
    severity: Severity
    """`critical`: the training signal is likely garbage or the run cannot progress; `warning`:
    worth a look soon; `info`: context."""
    title: str
    summary: str
    """One sentence with the numbers."""
    causes: list[str]
    """Plausible causes, most likely first."""
    evidence: dict[str, Any] = Field(default_factory=dict)
    """JSON-able figures the finding rests on (thresholds, values, step ranges)."""
    steps: list[int] = Field(default_factory=list)
    """Training steps where the signature shows."""
    trials: list[str] = Field(default_factory=list)
    """Example trial ids (up to ten)."""
    next_step: str
    """What a person should check or do first."""


@dataclass(frozen=True)
class Rule:
    """One diagnostic rule: a pure function of the run's facts that matches one failure signature."""

    id: str
    title: str
    check: Callable[[RunFacts], Finding | None]

    @property
    def description(self) -> str:
        """The rule's docstring: what it looks at, its thresholds."""
        return " ".join((self.check.__doc__ or "").split())

    def __call__(self, facts: RunFacts) -> Finding | None:
        return self.check(facts)


def rule(rule_id: str, title: str) -> Callable[[Callable[[RunFacts], Finding | None]], Rule]:
    """Declare a rule: `@rule("zero-tool-calls", "No tool calls in a batch")` over its check function."""

    def wrap(check: Callable[[RunFacts], Finding | None]) -> Rule:
        return Rule(id=rule_id, title=title, check=check)

    return wrap


def finding(
    rule: Rule,
    severity: Severity,
    summary: str,
    causes: list[str],
    next_step: str,
    *,
    evidence: dict[str, Any] | None = None,
    steps: list[int] | None = None,
    trials: list[str] | None = None,
) -> Finding:
    """A Finding of `rule` (its id and title), with the example trials capped."""
    return Finding(
        rule=rule.id,
        severity=severity,
        title=rule.title,
        summary=summary,
        causes=causes,
        evidence=evidence or {},
        steps=sorted(set(steps or [])),
        trials=list(dict.fromkeys(trials or []))[:MAX_EXAMPLE_TRIALS],
        next_step=next_step,
    )

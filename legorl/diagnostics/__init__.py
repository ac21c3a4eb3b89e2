"""Diagnostics: rules that match failure signatures of an RL run and name plausible causes.

`RunFacts.from_store(store, run=..., pods=..., events=...)` takes a plain snapshot of a run;
`diagnose(facts)` runs every rule in `RULES` over it and returns the `Finding`s, most severe first.
A finding states what was seen (the numbers, the steps, example trials), the causes consistent with
it — most likely first, never a claim of proof — and what a person should check next. Rules are pure
functions of the facts: no I/O, no clock of their own.
"""

from __future__ import annotations

from collections.abc import Sequence

from legorl.diagnostics.facts import (
    ContainerFacts,
    EvalFacts,
    EventFacts,
    PodFacts,
    RunFacts,
    SpecFacts,
    StepFacts,
    TrialFacts,
)
from legorl.diagnostics.finding import SEVERITY_RANK, Finding, Rule, Severity
from legorl.diagnostics.rules import RULES

__all__ = [
    "RULES",
    "ContainerFacts",
    "EvalFacts",
    "EventFacts",
    "Finding",
    "PodFacts",
    "Rule",
    "RunFacts",
    "Severity",
    "SpecFacts",
    "StepFacts",
    "TrialFacts",
    "diagnose",
]


def diagnose(facts: RunFacts, rules: Sequence[Rule] = RULES) -> list[Finding]:
    """Every rule's finding on `facts`, most severe first (rules in registry order within a severity)."""
    found = [f for f in (r(facts) for r in rules) if f is not None]
    order = {r.id: i for i, r in enumerate(rules)}
    return sorted(found, key=lambda f: (-SEVERITY_RANK[f.severity], order.get(f.rule, len(order))))

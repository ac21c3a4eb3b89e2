"""Defense self-tests: every defense is checked after it is applied, and a failed check fails closed."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Check:
    """One self-test of one defense (`egress.refused`, `history.single_commit`, ...)."""

    name: str
    passed: bool
    message: str = ""

    def to_dict(self) -> dict[str, object]:
        return {"name": self.name, "result": "Passed" if self.passed else "Failed", "message": self.message}


class DefenseFailed(RuntimeError):
    """A defense could not be applied or its self-test failed: the trial ends `defense_failed`."""

    def __init__(self, checks: Iterable[Check]) -> None:
        self.checks = list(checks)
        failed = [c for c in self.checks if not c.passed]
        detail = "; ".join(f"{c.name}: {c.message}" for c in failed) or "no check passed"
        super().__init__(f"defense self-test failed: {detail}")


def require(checks: Iterable[Check]) -> list[Check]:
    """Return the checks if every one passed, else raise DefenseFailed (fail closed)."""
    result = list(checks)
    if not result or not all(c.passed for c in result):
        raise DefenseFailed(result)
    return result

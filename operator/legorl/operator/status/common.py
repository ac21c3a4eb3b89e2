"""Helpers shared by the pure status computations."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime

from legorl.api.common import CONDITION_STATUS, Condition
from legorl.api.conditions import set_condition
from legorl.operator.observe import CRASH_REASONS, PULL_FAILURES, PodView

MAX_LISTED = 3


class ConditionSet:
    """Builds a status's conditions from the previous ones, keeping transition times."""

    def __init__(self, previous: list[Condition], generation: int, now: datetime) -> None:
        self.conditions = list(previous)
        self.generation = generation
        self.now = now

    def set(self, type_: str, status: CONDITION_STATUS, reason: str, message: str) -> None:
        self.conditions = set_condition(
            self.conditions,
            type_=type_,
            status=status,
            reason=reason,
            message=message,
            generation=self.generation,
            now=self.now,
        )


def listing(items: Iterable[str], limit: int = MAX_LISTED) -> str:
    """`a, b, c and 4 more`."""
    items = list(items)
    shown = ", ".join(items[:limit])
    return f"{shown} and {len(items) - limit} more" if len(items) > limit else shown


def pod_problem(pod: PodView) -> tuple[str, str] | None:
    """(kind, explanation) of what blocks a pod: `pull`, `crash` or `unschedulable`."""
    if pod.unschedulable:
        return "unschedulable", f"pod {pod.name} cannot be scheduled: {pod.unschedulable}"
    for container in (*pod.init_containers, *pod.containers):
        if container.reason in PULL_FAILURES:
            detail = f": {container.message}" if container.message else ""
            return "pull", f"pod {pod.name} cannot pull {container.image} ({container.reason}){detail}"
        if container.reason in CRASH_REASONS:
            detail = f"; {container.message}" if container.message else ""
            return "crash", (
                f"container {container.name} of pod {pod.name} is in {container.reason} "
                f"after {container.restarts} restarts{detail}"
            )
    return None

"""The JSON documents the operator keeps on trial and verify pods, each one type with one encoder
(`to_json`) and one decoder (`from_json`, ValueError for anything it cannot use).

- `TrialRequestNote` (`legorl.dev/trial-request`, on trial and verify pods): which trial a pod runs, so a
  restarted operator can adopt it.
- `AgentOutcomeNote` (`legorl.dev/agent-outcome`, on verify pods): how the agent stage ended, so a
  restarted operator that finds only the verify pod still records it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

__all__ = ["AgentOutcomeNote", "TrialRequestNote"]


def _object(raw: str | None, what: str) -> dict[str, Any]:
    try:
        data = json.loads(raw or "")
    except json.JSONDecodeError as exc:
        raise ValueError(f"{what} is not JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{what} is not a JSON object")
    return data


@dataclass(frozen=True)
class TrialRequestNote:
    """A trial request as a pod carries it: the task by its id (the operator holds the task set)."""

    trial: str
    task_id: str
    group_id: str
    split: Literal["train", "validation"]
    step: int
    policy_version: str

    def to_json(self) -> str:
        return json.dumps(
            {
                "trial": self.trial,
                "taskId": self.task_id,
                "groupId": self.group_id,
                "split": self.split,
                "step": self.step,
                "policyVersion": self.policy_version,
            },
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, raw: str | None) -> TrialRequestNote:
        data = _object(raw, "the trial-request annotation")
        split = data.get("split")
        if split not in ("train", "validation"):
            raise ValueError(f"the trial-request annotation's split {split!r} is not train or validation")
        try:
            return cls(
                trial=str(data["trial"]),
                task_id=str(data["taskId"]),
                group_id=str(data["groupId"]),
                split=split,
                step=int(data["step"]),
                policy_version=str(data["policyVersion"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"the trial-request annotation lacks or mistypes {exc}") from exc


@dataclass(frozen=True)
class AgentOutcomeNote:
    """How a trial's agent stage ended, as its verify pod carries it."""

    reason: str
    """The sandbox's view (`legorl.operator.status.trial.AgentEnd.reason`)."""
    exit_code: int | None = None
    detail: str = ""
    stage_seconds: Mapping[str, float] = field(default_factory=dict)

    MAX_DETAIL: ClassVar[int] = 2000
    """Characters of `detail` kept (annotations share a 256 KiB budget)."""

    def to_json(self) -> str:
        return json.dumps(
            {
                "reason": self.reason,
                "exitCode": self.exit_code,
                "detail": self.detail[: self.MAX_DETAIL],
                "stageSeconds": dict(self.stage_seconds),
            },
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, raw: str | None) -> AgentOutcomeNote:
        data = _object(raw, "the agent-outcome annotation")
        try:
            code = data.get("exitCode")
            return cls(
                reason=str(data["reason"]),
                exit_code=None if code is None else int(code),
                detail=str(data.get("detail") or ""),
                stage_seconds={str(k): float(v) for k, v in (data.get("stageSeconds") or {}).items()},
            )
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            raise ValueError(f"the agent-outcome annotation lacks or mistypes {exc}") from exc

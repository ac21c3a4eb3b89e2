"""The trajectory contract (DESIGN §6): turns, segments and trial records, and their Arrow schemas.

One module, shared by the proxy (writes turns), the run controller (writes trial
records), the trainer (reads segments) and the UI (reads everything). It
depends on pyarrow and nothing else of ours but the termination reasons. The
schema is versioned: every table carries `legorl.schema` and
`legorl.schema_version` in its metadata, and readers refuse a major version they
do not know instead of misreading it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from datetime import datetime
from enum import StrEnum
from typing import Any, Final, Literal, get_args

import pyarrow as pa

from legorl.api.termination import INFRA_REASONS, TerminationReason

__all__ = [
    "INFRA_REASONS",
    "SCHEMA_VERSION",
    "TRIAL_SCHEMA",
    "TURN_SCHEMA",
    "ApiFormat",
    "Segment",
    "TamperFinding",
    "TerminationReason",
    "TrajectoryError",
    "TrialRecord",
    "Turn",
]

SCHEMA_VERSION: Final = 1
"""Major version of the trajectory schema; bump it on any incompatible change."""


class ApiFormat(StrEnum):
    """The API a harness spoke to its proxy."""

    OPENAI_CHAT = "openai_chat"
    OPENAI_RESPONSES = "openai_responses"
    ANTHROPIC_MESSAGES = "anthropic_messages"


class SchemaVersionError(ValueError):
    """A table was written with a schema version this code cannot read."""


def _meta(name: str) -> dict[bytes, bytes]:
    return {b"legorl.schema": name.encode(), b"legorl.schema_version": str(SCHEMA_VERSION).encode()}


_ROUTING_FIELDS = [
    # Routed experts, flattened row-major from shape (rows, layers, top_k); `rows` covers every
    # token that went through the model: token i of the sequence is row i (the last sampled
    # token has no row). Null when the engine did not capture routing (dense models, capture off).
    pa.field("routed_experts", pa.list_(pa.uint16()), nullable=True),
    pa.field("routed_experts_shape", pa.list_(pa.int32(), 3), nullable=True),
]

# Log-probabilities are float32: vLLM computes them in float32, so this stores exactly what the
# engine produced (its JSON carries the same values widened to float64).
TURN_SCHEMA: Final = pa.schema(
    [
        pa.field("run", pa.string(), nullable=False),
        pa.field("trial", pa.string(), nullable=False),
        pa.field("session", pa.string(), nullable=False),
        pa.field("index", pa.int32(), nullable=False),
        pa.field("api_format", pa.string(), nullable=False),
        pa.field("prompt_token_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("completion_token_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("completion_logprobs", pa.list_(pa.float32()), nullable=False),
        *_ROUTING_FIELDS,
        pa.field("finish_reason", pa.string(), nullable=False),
        pa.field("policy_versions", pa.list_(pa.string()), nullable=False),
        pa.field("started_at", pa.timestamp("us", tz="UTC"), nullable=False),
        pa.field("ended_at", pa.timestamp("us", tz="UTC"), nullable=False),
        pa.field("ttft_seconds", pa.float64(), nullable=True),
        pa.field("prompt_tokens", pa.int32(), nullable=False),
        pa.field("completion_tokens", pa.int32(), nullable=False),
        pa.field("request_body", pa.large_string(), nullable=True),
        pa.field("response_body", pa.large_string(), nullable=True),
    ],
    metadata=_meta("turn"),
)
"""One model call as the proxy journaled it."""

SEGMENT_TYPE: Final = pa.struct(
    [
        pa.field("index", pa.int32(), nullable=False),
        pa.field("token_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("loss_mask", pa.list_(pa.int8()), nullable=False),
        pa.field("behavior_logprobs", pa.list_(pa.float32()), nullable=False),
        *_ROUTING_FIELDS,
        pa.field("turn_indices", pa.list_(pa.int32()), nullable=False),
        pa.field("policy_versions", pa.list_(pa.string()), nullable=False),
    ]
)

TAMPER_TYPE: Final = pa.struct(
    [
        pa.field("kind", pa.string(), nullable=False),
        pa.field("path", pa.string(), nullable=True),
        pa.field("detail", pa.string(), nullable=False),
    ]
)

STAGE_TYPE: Final = pa.struct(
    [
        pa.field("stage", pa.string(), nullable=False),
        pa.field("seconds", pa.float64(), nullable=False),
    ]
)

TRIAL_SCHEMA: Final = pa.schema(
    [
        pa.field("run", pa.string(), nullable=False),
        pa.field("trial", pa.string(), nullable=False),
        pa.field("task_id", pa.string(), nullable=False),
        pa.field("group_id", pa.string(), nullable=False),
        pa.field("split", pa.string(), nullable=False),
        pa.field("step", pa.int32(), nullable=False),
        pa.field("harness", pa.string(), nullable=False),
        pa.field("termination_reason", pa.string(), nullable=False),
        pa.field("reward", pa.float64(), nullable=True),
        pa.field("tamper_findings", pa.list_(TAMPER_TYPE), nullable=False),
        pa.field("segments", pa.list_(SEGMENT_TYPE), nullable=False),
        pa.field("policy_versions", pa.list_(pa.string()), nullable=False),
        pa.field("num_turns", pa.int32(), nullable=False),
        pa.field("merged_turn_share", pa.float64(), nullable=True),
        pa.field("stage_seconds", pa.list_(STAGE_TYPE), nullable=False),
        pa.field("started_at", pa.timestamp("us", tz="UTC"), nullable=False),
        pa.field("ended_at", pa.timestamp("us", tz="UTC"), nullable=False),
        pa.field("error", pa.string(), nullable=True),
        # Added in 0.1 without a version bump: optional, absent from older tables (read as null).
        pa.field("tool_call_turns", pa.int32(), nullable=True),
    ],
    metadata=_meta("trial"),
)
"""One trial: outcome, reward, tamper findings and the segments the trainer consumes."""


class TrajectoryError(ValueError):
    """A turn, segment or trial record breaks the contract (lengths, masks, shapes)."""


def _check_routing(
    where: str, routed: list[int] | None, shape: tuple[int, int, int] | None, rows: int
) -> None:
    if routed is None and shape is None:
        return
    if routed is None or shape is None:
        raise TrajectoryError(f"{where}: routed_experts and routed_experts_shape go together")
    if shape[0] != rows:
        raise TrajectoryError(
            f"{where}: routed_experts has {shape[0]} rows, expected {rows} (one per token but the last)"
        )
    if len(routed) != math.prod(shape):
        raise TrajectoryError(
            f"{where}: routed_experts has {len(routed)} entries, shape {shape} needs {math.prod(shape)}"
        )


@dataclass(frozen=True)
class Turn:
    """One model call, journaled by the proxy before it answered the harness."""

    run: str
    trial: str
    session: str
    index: int
    api_format: ApiFormat
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    completion_logprobs: list[float]
    finish_reason: str
    policy_versions: list[str]
    started_at: datetime
    ended_at: datetime
    routed_experts: list[int] | None = None
    routed_experts_shape: tuple[int, int, int] | None = None
    ttft_seconds: float | None = None
    request_body: str | None = None
    response_body: str | None = None

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def completion_tokens(self) -> int:
        return len(self.completion_token_ids)

    def check(self) -> None:
        """Raise TrajectoryError if the turn breaks the contract."""
        if len(self.completion_logprobs) != len(self.completion_token_ids):
            raise TrajectoryError(
                f"turn {self.index}: {len(self.completion_logprobs)} logprobs for "
                f"{len(self.completion_token_ids)} completion tokens"
            )
        if not self.policy_versions:
            raise TrajectoryError(f"turn {self.index}: no policy version recorded")
        rows = max(len(self.prompt_token_ids) + len(self.completion_token_ids) - 1, 0)
        _check_routing(f"turn {self.index}", self.routed_experts, self.routed_experts_shape, rows)

    def to_row(self) -> dict[str, Any]:
        row = {f.name: getattr(self, f.name) for f in fields(self)}
        row["api_format"] = self.api_format.value
        row["prompt_tokens"] = self.prompt_tokens
        row["completion_tokens"] = self.completion_tokens
        row["routed_experts_shape"] = list(self.routed_experts_shape) if self.routed_experts_shape else None
        return row

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> Turn:
        data = {f.name: row[f.name] for f in fields(cls)}
        data["api_format"] = ApiFormat(row["api_format"])
        shape = row["routed_experts_shape"]
        data["routed_experts_shape"] = tuple(shape) if shape is not None else None
        return cls(**data)


@dataclass(frozen=True)
class Segment:
    """What the trainer consumes: consecutive turns merged while each prompt extends the last.

    `loss_mask[i]` is 1 where token i was sampled by the policy; `behavior_logprobs[i]` is its
    log-probability at generation time (0.0 where the mask is 0).
    """

    index: int
    token_ids: list[int]
    loss_mask: list[int]
    behavior_logprobs: list[float]
    turn_indices: list[int]
    policy_versions: list[str]
    routed_experts: list[int] | None = None
    routed_experts_shape: tuple[int, int, int] | None = None

    def check(self) -> None:
        """Raise TrajectoryError if the segment breaks the contract."""
        n = len(self.token_ids)
        if len(self.loss_mask) != n or len(self.behavior_logprobs) != n:
            raise TrajectoryError(
                f"segment {self.index}: token_ids ({n}), loss_mask ({len(self.loss_mask)}) and "
                f"behavior_logprobs ({len(self.behavior_logprobs)}) must align"
            )
        if any(m not in (0, 1) for m in self.loss_mask):
            raise TrajectoryError(f"segment {self.index}: loss_mask holds values other than 0/1")
        if not self.turn_indices:
            raise TrajectoryError(f"segment {self.index}: built from no turns")
        _check_routing(f"segment {self.index}", self.routed_experts, self.routed_experts_shape, max(n - 1, 0))

    def to_row(self) -> dict[str, Any]:
        row = {f.name: getattr(self, f.name) for f in fields(self)}
        row["routed_experts_shape"] = list(self.routed_experts_shape) if self.routed_experts_shape else None
        return row

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> Segment:
        data = {f.name: row[f.name] for f in fields(cls)}
        shape = row["routed_experts_shape"]
        data["routed_experts_shape"] = tuple(shape) if shape is not None else None
        return cls(**data)


TamperKind = Literal[
    "test_file_modified",
    "test_hook_added",
    "symlink",
    "binary_patch",
    "outside_repo",
    "egress_attempt",
    "results_tampered",
]
TAMPER_KINDS: frozenset[str] = frozenset(get_args(TamperKind))


@dataclass(frozen=True)
class TamperFinding:
    """Something the agent did that could game the reward (recorded, shown, and filtered)."""

    kind: TamperKind
    detail: str
    path: str | None = None


@dataclass(frozen=True)
class TrialRecord:
    """One trial's outcome; rows of the run store's trial table."""

    run: str
    trial: str
    task_id: str
    group_id: str
    split: Literal["train", "validation"]
    step: int
    harness: str
    termination_reason: TerminationReason
    reward: float | None
    started_at: datetime
    ended_at: datetime
    segments: list[Segment] = field(default_factory=list)
    tamper_findings: list[TamperFinding] = field(default_factory=list)
    policy_versions: list[str] = field(default_factory=list)
    num_turns: int = 0
    merged_turn_share: float | None = None
    stage_seconds: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    tool_call_turns: int | None = None
    """Turns the engine answered with parsed tool calls (finish reason `tool_calls`); 0 means the policy
    never called a tool the engine recognised; None: not known (no proxy trajectory, an older record)."""

    def check(self) -> None:
        """Raise TrajectoryError if the record breaks the contract."""
        if self.termination_reason == TerminationReason.COMPLETED and self.reward is None:
            raise TrajectoryError(f"trial {self.trial}: completed without a reward")
        for seg in self.segments:
            seg.check()

    def to_row(self) -> dict[str, Any]:
        return {
            "run": self.run,
            "trial": self.trial,
            "task_id": self.task_id,
            "group_id": self.group_id,
            "split": self.split,
            "step": self.step,
            "harness": self.harness,
            "termination_reason": self.termination_reason.value,
            "reward": self.reward,
            "tamper_findings": [
                {"kind": t.kind, "path": t.path, "detail": t.detail} for t in self.tamper_findings
            ],
            "segments": [s.to_row() for s in self.segments],
            "policy_versions": self.policy_versions,
            "num_turns": self.num_turns,
            "merged_turn_share": self.merged_turn_share,
            "stage_seconds": [{"stage": k, "seconds": v} for k, v in self.stage_seconds.items()],
            "started_at": self.started_at,
            "ended_at": self.ended_at,
            "error": self.error,
            "tool_call_turns": self.tool_call_turns,
        }

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> TrialRecord:
        return cls(
            run=row["run"],
            trial=row["trial"],
            task_id=row["task_id"],
            group_id=row["group_id"],
            split=row["split"],
            step=row["step"],
            harness=row["harness"],
            termination_reason=TerminationReason(row["termination_reason"]),
            reward=row["reward"],
            started_at=row["started_at"],
            ended_at=row["ended_at"],
            segments=[Segment.from_row(s) for s in row["segments"]],
            tamper_findings=[TamperFinding(**t) for t in row["tamper_findings"]],
            policy_versions=list(row["policy_versions"]),
            num_turns=row["num_turns"],
            merged_turn_share=row["merged_turn_share"],
            stage_seconds={s["stage"]: s["seconds"] for s in row["stage_seconds"]},
            error=row["error"],
            tool_call_turns=row.get("tool_call_turns"),
        )


def check_schema(table: pa.Table | pa.Schema, expected: pa.Schema) -> None:
    """Raise SchemaVersionError unless `table` was written with `expected`'s name and version."""
    schema = table if isinstance(table, pa.Schema) else table.schema
    meta = schema.metadata or {}
    name = meta.get(b"legorl.schema", b"").decode()
    want = (expected.metadata or {})[b"legorl.schema"].decode()
    if name != want:
        raise SchemaVersionError(f"expected a {want!r} table, got {name or 'an unlabelled'!r} one")
    version = meta.get(b"legorl.schema_version", b"").decode()
    if version != str(SCHEMA_VERSION):
        raise SchemaVersionError(
            f"{want} table has schema version {version or '?'}; this legorl reads version "
            f"{SCHEMA_VERSION} — upgrade legorl or convert the run store"
        )


def turns_to_table(turns: list[Turn]) -> pa.Table:
    """Turns as an Arrow table (checked against the contract first)."""
    for turn in turns:
        turn.check()
    return pa.Table.from_pylist([t.to_row() for t in turns], schema=TURN_SCHEMA)


def turns_from_table(table: pa.Table) -> list[Turn]:
    check_schema(table, TURN_SCHEMA)
    return [Turn.from_row(row) for row in table.to_pylist()]


def trials_to_table(trials: list[TrialRecord]) -> pa.Table:
    """Trial records as an Arrow table (checked against the contract first)."""
    for trial in trials:
        trial.check()
    return pa.Table.from_pylist([t.to_row() for t in trials], schema=TRIAL_SCHEMA)


def trials_from_table(table: pa.Table) -> list[TrialRecord]:
    check_schema(table, TRIAL_SCHEMA)
    return [TrialRecord.from_row(row) for row in table.to_pylist()]

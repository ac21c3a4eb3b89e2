"""The trajectory contract (DESIGN §6): turns, segments and trial records, and their Arrow schemas.

One module, shared by the proxy (writes turns), the run controller (writes trial
records), the trainer (reads segments) and the UI (reads everything). It
depends on pyarrow and numpy and nothing else of ours but the termination reasons
and tamper kinds (`legorl.sandbox.outcomes`). The schema is versioned: every table
carries `legorl.schema` and `legorl.schema_version` in its metadata, and readers
refuse a version they do not know instead of misreading it.

Routed experts (which experts each MoE layer sent each token to) are by far the
largest part of a trajectory: (tokens − 1) × layers × top_k ids, a hundred million
for a production batch. They stay numpy arrays from the proxy's decode to the
trainer, never Python lists:

- In memory, `routed_experts` is a C-ordered numpy array shaped (rows, layers, top_k),
  row i the routing of token i (the last sampled token never went through the model),
  of dtype **uint8 or uint16**. The dtype follows the engine: vLLM sends uint8 when the
  model has ≤ 256 experts and uint16 otherwise, and that width is kept, so every turn of
  one model has the same dtype whichever ids it happened to use. An engine that sends
  another integer type gets the narrowest of the two that holds its largest id
  (`routing_array`). A segment that merges turns of different widths takes the wider
  (numpy's promotion): lossless, one dtype per segment. Readers accept both widths; the
  dtype says nothing about the model's expert count beyond "≤ 256" for uint8. Arrays read
  back from a table are read-only views of the table's memory.
- In Arrow/Parquet (schema version 2), a routing is three columns: `routed_experts`
  (large_binary: the array's raw little-endian bytes, row-major), `routed_experts_dtype`
  (`uint8`/`uint16`) and `routed_experts_shape`. Writing and reading them is one buffer
  copy, not a hundred million Python ints. Version 1 stored a `list<uint16>`; such tables
  (and version-1 stores) still read, converted on read.
- In JSON (the proxy's journal, `GET /trajectory`, `GET /turns`), a routing is
  `{"$array": "u1"|"u2", "shape": [rows, layers, top_k], "b64": <little-endian bytes>}`;
  the older flat list (and the journal's older flat `u2` array) still decodes.
"""

from __future__ import annotations

import base64
import binascii
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from datetime import datetime
from enum import StrEnum
from typing import Any, Final, Literal, TypeAlias

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from legorl.api.termination import INFRA_REASONS, TerminationReason
from legorl.sandbox.outcomes import TAMPER_KINDS, TamperFinding, TamperKind

__all__ = [
    "INFRA_REASONS",
    "OPTIONAL_COLUMNS",
    "READABLE_SCHEMA_VERSIONS",
    "ROUTING_DTYPES",
    "SCHEMA_VERSION",
    "SUMMARY_COLUMNS",
    "TAMPER_KINDS",
    "TRIAL_SCHEMA",
    "TRIAL_SCHEMA_V1",
    "TURN_SCHEMA",
    "TURN_SCHEMA_V1",
    "ApiFormat",
    "ExpertIds",
    "Segment",
    "TamperFinding",
    "TamperKind",
    "TerminationReason",
    "TrajectoryError",
    "TrialRecord",
    "TrialSummary",
    "Turn",
    "decode_routing",
    "routing_array",
    "routing_to_json",
]

SCHEMA_VERSION: Final = 2
"""Major version of the trajectory schema; bump it on any incompatible change.

2: routed experts as raw bytes (large_binary) + dtype + shape instead of `list<uint16>`."""

READABLE_SCHEMA_VERSIONS: Final = (1, 2)
"""Versions this code reads (older ones converted on read); anything else is refused."""

ROUTING_DTYPES: Final = ("uint8", "uint16")
"""The dtypes a routing array may have (see the module docstring for which one)."""

ExpertIds: TypeAlias = npt.NDArray[np.unsignedinteger[Any]]
"""Routed expert ids: (rows, layers, top_k), uint8 or uint16."""


class ApiFormat(StrEnum):
    """The API a harness spoke to its proxy."""

    OPENAI_CHAT = "openai_chat"
    OPENAI_RESPONSES = "openai_responses"
    ANTHROPIC_MESSAGES = "anthropic_messages"


class SchemaVersionError(ValueError):
    """A table was written with a schema version this code cannot read."""


class TrajectoryError(ValueError):
    """A turn, segment or trial record breaks the contract (lengths, masks, shapes)."""


def _meta(name: str, version: int = SCHEMA_VERSION) -> dict[bytes, bytes]:
    return {b"legorl.schema": name.encode(), b"legorl.schema_version": str(version).encode()}


_ROUTING_FIELDS = [
    # Routed experts: the raw little-endian bytes of a C-ordered (rows, layers, top_k) array of
    # `routed_experts_dtype`; `rows` covers every token that went through the model: token i of
    # the sequence is row i (the last sampled token has no row). Null when the engine did not
    # capture routing (dense models, capture off).
    pa.field("routed_experts", pa.large_binary(), nullable=True),
    pa.field("routed_experts_dtype", pa.string(), nullable=True),
    pa.field("routed_experts_shape", pa.list_(pa.int32(), 3), nullable=True),
]

_ROUTING_FIELDS_V1 = [
    # Version 1: flattened row-major into a list (one Python int per id on every read and write).
    pa.field("routed_experts", pa.list_(pa.uint16()), nullable=True),
    pa.field("routed_experts_shape", pa.list_(pa.int32(), 3), nullable=True),
]


def _turn_schema(routing: list[pa.Field], version: int) -> pa.Schema:
    # Log-probabilities are float32: vLLM computes them in float32, so this stores exactly what the
    # engine produced (its JSON carries the same values widened to float64).
    return pa.schema(
        [
            pa.field("run", pa.string(), nullable=False),
            pa.field("trial", pa.string(), nullable=False),
            pa.field("session", pa.string(), nullable=False),
            pa.field("index", pa.int32(), nullable=False),
            pa.field("api_format", pa.string(), nullable=False),
            pa.field("prompt_token_ids", pa.list_(pa.int32()), nullable=False),
            pa.field("completion_token_ids", pa.list_(pa.int32()), nullable=False),
            pa.field("completion_logprobs", pa.list_(pa.float32()), nullable=False),
            *routing,
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
        metadata=_meta("turn", version),
    )


def _segment_type(routing: list[pa.Field]) -> pa.StructType:
    return pa.struct(
        [
            pa.field("index", pa.int32(), nullable=False),
            pa.field("token_ids", pa.list_(pa.int32()), nullable=False),
            pa.field("loss_mask", pa.list_(pa.int8()), nullable=False),
            pa.field("behavior_logprobs", pa.list_(pa.float32()), nullable=False),
            *routing,
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


def _trial_schema(segment: pa.StructType, version: int) -> pa.Schema:
    return pa.schema(
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
            pa.field("segments", pa.list_(segment), nullable=False),
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
        metadata=_meta("trial", version),
    )


TURN_SCHEMA: Final = _turn_schema(_ROUTING_FIELDS, SCHEMA_VERSION)
"""One model call as the proxy journaled it."""

SEGMENT_TYPE: Final = _segment_type(_ROUTING_FIELDS)

TRIAL_SCHEMA: Final = _trial_schema(SEGMENT_TYPE, SCHEMA_VERSION)
"""One trial: outcome, reward, tamper findings and the segments the trainer consumes."""

TURN_SCHEMA_V1: Final = _turn_schema(_ROUTING_FIELDS_V1, 1)
"""The turn table of schema version 1 (routing as `list<uint16>`), kept to document what still reads."""

TRIAL_SCHEMA_V1: Final = _trial_schema(_segment_type(_ROUTING_FIELDS_V1), 1)
"""The trial table of schema version 1 (routing as `list<uint16>`), kept to document what still reads."""


# --- routing arrays ------------------------------------------------------------------------------


def routing_array(values: Any, shape: Sequence[int] | None = None) -> ExpertIds:
    """Expert ids as the contract holds them: a (rows, layers, top_k) array of uint8 or uint16.

    `values` is any integer array (or sequence), reshaped to `shape` when given. uint8 and uint16
    keep their width (an engine's choice, made from its model's expert count); any other integer
    type becomes the narrowest of the two that holds its largest id. TrajectoryError for anything
    that is not integer ids in [0, 65535] of three dimensions."""
    arr = np.asarray(values)
    if shape is not None:
        dims = tuple(int(d) for d in shape)
        if arr.size != math.prod(dims):
            raise TrajectoryError(
                f"routed_experts has {arr.size} entries, shape {dims} needs {math.prod(dims)}"
            )
        arr = arr.reshape(dims)
    if arr.ndim != 3:
        raise TrajectoryError(
            f"routed_experts must have 3 dimensions (rows, layers, top_k), got shape {arr.shape}"
        )
    if arr.size == 0 and arr.dtype.kind not in "iu":
        arr = arr.astype(np.uint8)  # an empty Python sequence is float64 to numpy
    if arr.dtype.kind not in "iu":
        raise TrajectoryError(f"routed_experts must hold integer expert ids, got {arr.dtype}")
    if arr.dtype.kind == "u" and arr.dtype.itemsize <= 2:
        # Native byte order (a big-endian `>u2` from the wire is swapped once, here).
        return np.ascontiguousarray(arr.astype(arr.dtype.newbyteorder("="), copy=False))
    low, high = (int(arr.min()), int(arr.max())) if arr.size else (0, 0)
    if low < 0 or high > 65535:
        raise TrajectoryError("routed_experts holds expert ids outside [0, 65535]")
    return np.ascontiguousarray(arr, dtype=np.uint8 if high < 256 else np.uint16)


_JSON_KINDS: Final[dict[str, np.dtype[Any]]] = {"u1": np.dtype("<u1"), "u2": np.dtype("<u2")}


def routing_to_json(routed: ExpertIds) -> dict[str, Any]:
    """A routing array as JSON: `{"$array": "u1"|"u2", "shape": [...], "b64": little-endian bytes}`."""
    kind = "u1" if routed.dtype.itemsize == 1 else "u2"
    data = np.ascontiguousarray(routed, dtype=_JSON_KINDS[kind])
    return {
        "$array": kind,
        "shape": [int(d) for d in routed.shape],
        "b64": base64.b64encode(data.data).decode(),
    }


def decode_routing(
    value: Any, shape: Sequence[int] | None = None, dtype: str | None = None
) -> ExpertIds | None:
    """A routing in any form the contract ever wrote it, as a routing array (None for None).

    Accepts a numpy array; the JSON form of `routing_to_json` (and the journal's older flat
    `{"$array": "u2", "b64": ...}`, reshaped to `shape`); raw bytes of `dtype` (a schema-2 row as
    `to_pylist` gives it); a flat list of ints (a schema-1 row, an older proxy's JSON) with
    `shape`. TrajectoryError if it does not decode."""
    if value is None:
        return None
    if isinstance(value, np.ndarray):
        return routing_array(value, None if value.ndim == 3 else shape)
    if isinstance(value, Mapping):
        kind = value.get("$array")
        if kind not in _JSON_KINDS:
            raise TrajectoryError(f"routed_experts is an object but not an encoded array ($array={kind!r})")
        try:
            data = base64.b64decode(value.get("b64", ""), validate=True)
        except (binascii.Error, TypeError) as exc:
            raise TrajectoryError(f"routed_experts is not valid base64: {exc}") from exc
        wide = _JSON_KINDS[kind]
        if len(data) % wide.itemsize:
            raise TrajectoryError(f"routed_experts holds {len(data)} bytes, not a whole number of {kind}")
        return routing_array(np.frombuffer(data, wide), value.get("shape") or shape)
    if isinstance(value, bytes | bytearray | memoryview):
        if dtype not in ROUTING_DTYPES:
            raise TrajectoryError(f"routed_experts as bytes needs a dtype of {ROUTING_DTYPES}, got {dtype!r}")
        if shape is None:
            raise TrajectoryError("routed_experts as bytes needs its shape")
        wide = np.dtype(dtype).newbyteorder("<")
        if len(value) % wide.itemsize:
            raise TrajectoryError(f"routed_experts holds {len(value)} bytes, not a whole number of {dtype}")
        return routing_array(np.frombuffer(value, wide), shape)
    if isinstance(value, list | tuple):
        if shape is None:
            raise TrajectoryError("routed_experts as a flat list needs its shape")
        return routing_array(np.asarray(value, dtype=np.int64) if value else np.zeros(0, np.uint8), shape)
    raise TrajectoryError(f"routed_experts cannot be a {type(value).__name__}")


def _check_routing(where: str, routed: Any, shape: tuple[int, int, int] | None, rows: int) -> None:
    # Shape and dtype only: O(1) whatever the size (ids are checked against the model by the trainer).
    if routed is None and shape is None:
        return
    if routed is None or shape is None:
        raise TrajectoryError(f"{where}: routed_experts and routed_experts_shape go together")
    if not isinstance(routed, np.ndarray):
        raise TrajectoryError(
            f"{where}: routed_experts is a {type(routed).__name__}; the contract keeps routing as a numpy "
            f"array (rows, layers, top_k) of {' or '.join(ROUTING_DTYPES)} (see routing_array)"
        )
    if routed.dtype.name not in ROUTING_DTYPES or not routed.dtype.isnative:
        raise TrajectoryError(
            f"{where}: routed_experts has dtype {routed.dtype.str}; expected native "
            f"{' or '.join(ROUTING_DTYPES)}"
        )
    if routed.shape != tuple(shape):
        raise TrajectoryError(
            f"{where}: routed_experts has shape {routed.shape}, routed_experts_shape says {tuple(shape)}"
        )
    if shape[0] != rows:
        raise TrajectoryError(
            f"{where}: routed_experts has {shape[0]} rows, expected {rows} (one per token but the last)"
        )


def _shape_of(routed: Any, shape: Any) -> tuple[int, int, int] | None:
    """The shape field's value. It mirrors the array (None without one, a 3-D array's own shape), so
    `replace(seg, routed_experts=...)` needs no second argument and the two never disagree; only what is
    not a routing array keeps the given shape, for `check` to report."""
    if routed is None:
        return None
    if isinstance(routed, np.ndarray) and routed.ndim == 3:
        return (int(routed.shape[0]), int(routed.shape[1]), int(routed.shape[2]))
    if shape is None or isinstance(shape, tuple):
        return shape
    a, b, c = (int(d) for d in shape)
    return (a, b, c)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return a is not None and b is not None and bool(np.array_equal(a, b))
    return bool(a == b)


def _fields_equal(a: Any, b: Any) -> bool:
    return all(_same(getattr(a, f.name), getattr(b, f.name)) for f in fields(a))


# --- turns and segments ----------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Turn:
    """One model call, journaled by the proxy before it answered the harness.

    Equality compares routing by value (not dtype): the same ids are the same routing."""

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
    routed_experts: ExpertIds | None = None
    """(prompt + completion tokens − 1, layers, top_k), uint8 or uint16 (see the module docstring)."""
    routed_experts_shape: tuple[int, int, int] | None = None
    """`routed_experts.shape`, or None without routing: a mirror of the array, kept for its readers."""
    ttft_seconds: float | None = None
    request_body: str | None = None
    response_body: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "routed_experts_shape", _shape_of(self.routed_experts, self.routed_experts_shape)
        )

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return _fields_equal(self, other)

    __hash__ = None  # type: ignore[assignment]  # mutable lists and arrays inside: unhashable, as before

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

    def to_json(self) -> dict[str, Any]:
        """The turn as JSON (the proxy's journal and `GET /turns`): timestamps as ISO strings, routing
        as `routing_to_json`."""
        out = {name: getattr(self, name) for name in _TURN_FIELDS}
        out["api_format"] = self.api_format.value
        out["prompt_tokens"] = self.prompt_tokens
        out["completion_tokens"] = self.completion_tokens
        out["started_at"] = self.started_at.isoformat()
        out["ended_at"] = self.ended_at.isoformat()
        out["routed_experts"] = None if self.routed_experts is None else routing_to_json(self.routed_experts)
        out["routed_experts_shape"] = list(self.routed_experts_shape) if self.routed_experts_shape else None
        return out

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Turn:
        """The inverse of `to_json`; also reads what older proxies wrote (flat routing lists)."""
        shape = obj.get("routed_experts_shape")
        data = {f.name: obj[f.name] for f in fields(cls) if f.name in obj}
        data["api_format"] = ApiFormat(obj["api_format"])
        for key in ("started_at", "ended_at"):
            if isinstance(data[key], str):
                data[key] = datetime.fromisoformat(data[key])
        data["routed_experts"] = decode_routing(obj.get("routed_experts"), shape)
        data["routed_experts_shape"] = tuple(shape) if shape is not None else None
        return cls(**data)


_TURN_FIELDS = tuple(f.name for f in fields(Turn))
"""`Turn`'s field names, once: `dataclasses.fields` costs more than the rest of `to_json`."""


@dataclass(frozen=True, eq=False)
class Segment:
    """What the trainer consumes: consecutive turns merged while each prompt extends the last.

    `loss_mask[i]` is 1 where token i was sampled by the policy; `behavior_logprobs[i]` is its
    log-probability at generation time (0.0 where the mask is 0). Equality compares routing by
    value (not dtype).
    """

    index: int
    token_ids: list[int]
    loss_mask: list[int]
    behavior_logprobs: list[float]
    turn_indices: list[int]
    policy_versions: list[str]
    routed_experts: ExpertIds | None = None
    """(len(token_ids) − 1, layers, top_k), uint8 or uint16 (see the module docstring)."""
    routed_experts_shape: tuple[int, int, int] | None = None
    """`routed_experts.shape`, or None without routing: a mirror of the array, kept for its readers."""

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "routed_experts_shape", _shape_of(self.routed_experts, self.routed_experts_shape)
        )

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return _fields_equal(self, other)

    __hash__ = None  # type: ignore[assignment]  # mutable lists and arrays inside: unhashable, as before

    def check(self) -> None:
        """Raise TrajectoryError if the segment breaks the contract."""
        n = len(self.token_ids)
        if len(self.loss_mask) != n or len(self.behavior_logprobs) != n:
            raise TrajectoryError(
                f"segment {self.index}: token_ids ({n}), loss_mask ({len(self.loss_mask)}) and "
                f"behavior_logprobs ({len(self.behavior_logprobs)}) must align"
            )
        if set(self.loss_mask) - {0, 1}:
            raise TrajectoryError(f"segment {self.index}: loss_mask holds values other than 0/1")
        if not self.turn_indices:
            raise TrajectoryError(f"segment {self.index}: built from no turns")
        _check_routing(f"segment {self.index}", self.routed_experts, self.routed_experts_shape, max(n - 1, 0))

    def to_json(self) -> dict[str, Any]:
        """The segment as JSON (the proxy's `GET /trajectory`), routing as `routing_to_json`."""
        return {
            "index": self.index,
            "token_ids": list(self.token_ids),
            "loss_mask": list(self.loss_mask),
            "behavior_logprobs": list(self.behavior_logprobs),
            "turn_indices": list(self.turn_indices),
            "policy_versions": list(self.policy_versions),
            "routed_experts": None if self.routed_experts is None else routing_to_json(self.routed_experts),
            "routed_experts_shape": list(self.routed_experts_shape) if self.routed_experts_shape else None,
        }

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Segment:
        """The inverse of `to_json`; also reads what older proxies sent (flat routing lists)."""
        shape = obj.get("routed_experts_shape")
        return cls(
            index=int(obj["index"]),
            token_ids=list(obj["token_ids"]),
            loss_mask=list(obj["loss_mask"]),
            behavior_logprobs=list(obj["behavior_logprobs"]),
            turn_indices=list(obj["turn_indices"]),
            policy_versions=list(obj["policy_versions"]),
            routed_experts=decode_routing(obj.get("routed_experts"), shape),
            routed_experts_shape=tuple(shape) if shape is not None else None,
        )


SUMMARY_COLUMNS: Final = (
    "run",
    "trial",
    "task_id",
    "group_id",
    "split",
    "step",
    "harness",
    "termination_reason",
    "reward",
    "tamper_findings",
    "policy_versions",
    "num_turns",
    "merged_turn_share",
    "stage_seconds",
    "started_at",
    "ended_at",
    "error",
)
"""The trial table's columns but the segments (token arrays, routing): what listings read."""
OPTIONAL_COLUMNS: Final = ("tool_call_turns",)
"""Trial columns added after the schema's first version: absent from older tables (read when there)."""


@dataclass(frozen=True)
class TrialSummary:
    """A trial-table row without its segments: the one decoder of the table's small columns, for the
    trainer's batches (`trials_from_table`), diagnostics and the UI."""

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
    tamper_findings: list[TamperFinding]
    policy_versions: list[str]
    num_turns: int
    merged_turn_share: float | None
    stage_seconds: dict[str, float]
    error: str | None
    tool_call_turns: int | None

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> TrialSummary:
        """A row as pyarrow's `to_pylist` gives it (`SUMMARY_COLUMNS`, and `OPTIONAL_COLUMNS` when read)."""
        return cls(
            run=row["run"],
            trial=row["trial"],
            task_id=row["task_id"],
            group_id=row["group_id"],
            split=row["split"],
            step=int(row["step"]),
            harness=row["harness"],
            termination_reason=TerminationReason(row["termination_reason"]),
            reward=row["reward"],
            started_at=row["started_at"],
            ended_at=row["ended_at"],
            tamper_findings=[TamperFinding.from_dict(t) for t in row["tamper_findings"]],
            policy_versions=list(row["policy_versions"]),
            num_turns=int(row["num_turns"]),
            merged_turn_share=row["merged_turn_share"],
            stage_seconds={s["stage"]: s["seconds"] for s in row["stage_seconds"]},
            error=row["error"],
            tool_call_turns=row.get("tool_call_turns"),
        )


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

    def eval_outcome(self) -> bool | None:
        """The trial as a held-out evaluation counts it: solved (reward 1) or not; None when it is not
        scored (it ended for an infrastructure reason, or without a reward)."""
        if self.termination_reason in INFRA_REASONS or self.reward is None:
            return None
        return self.reward >= 1.0

    def check(self, *, segments: bool = True) -> None:
        """Raise TrajectoryError if the record breaks the contract. `segments=False` leaves its segments
        alone: they are checked once, where they enter a process (the proxy's assembly,
        `TrajectorySummary.from_json`, `trials_from_table`), not again at every hand-over."""
        if self.termination_reason == TerminationReason.COMPLETED and self.reward is None:
            raise TrajectoryError(f"trial {self.trial}: completed without a reward")
        if segments:
            for seg in self.segments:
                seg.check()


# --- schema versions -------------------------------------------------------------------------------


def check_schema(table: pa.Table | pa.Schema, expected: pa.Schema) -> int:
    """The schema version `table` was written with; SchemaVersionError unless it is a table of
    `expected`'s name in a version this code reads (`READABLE_SCHEMA_VERSIONS`)."""
    schema = table if isinstance(table, pa.Schema) else table.schema
    meta = schema.metadata or {}
    name = meta.get(b"legorl.schema", b"").decode()
    want = (expected.metadata or {})[b"legorl.schema"].decode()
    if name != want:
        raise SchemaVersionError(f"expected a {want!r} table, got {name or 'an unlabelled'!r} one")
    version = meta.get(b"legorl.schema_version", b"").decode()
    readable = {str(v): v for v in READABLE_SCHEMA_VERSIONS}
    if version not in readable:
        raise SchemaVersionError(
            f"{want} table has schema version {version or '?'}; this legorl reads version "
            f"{SCHEMA_VERSION} (and older: {', '.join(map(str, READABLE_SCHEMA_VERSIONS[:-1]))}) — "
            "upgrade legorl or convert the run store"
        )
    return readable[version]


# --- columnar encoding -----------------------------------------------------------------------------
# Tables are built from and read into numpy buffers column by column: no `from_pylist`/`to_pylist`
# over the token and routing columns, whose per-element Python objects cost tens of seconds per batch.

_ArrowArray: TypeAlias = Any  # pyarrow ships no type hints


def _offsets(lengths: Iterable[int], dtype: type[np.signedinteger[Any]]) -> npt.NDArray[Any]:
    sizes = np.fromiter(lengths, dtype=np.int64)
    out = np.zeros(sizes.size + 1, dtype=dtype)
    np.cumsum(sizes, out=out[1:])
    return out


def _list_column(values: Sequence[Sequence[Any]], np_type: Any, pa_type: pa.DataType) -> _ArrowArray:
    """A `list<pa_type>` array of `values`, built from one flat numpy buffer."""
    offsets = _offsets((len(v) for v in values), np.int32)
    parts = [np.asarray(v, dtype=np_type) for v in values if len(v)]
    flat = np.concatenate(parts) if parts else np.zeros(0, dtype=np_type)
    return pa.ListArray.from_arrays(
        pa.array(offsets, pa.int32()), pa.array(flat, pa_type), type=pa.list_(pa_type)
    )


def _lists(array: _ArrowArray) -> list[list[Any]]:
    """A list array's rows as Python lists, through numpy (one slice and `tolist` per row)."""
    offsets = array.offsets.to_numpy()
    values = array.values.to_numpy(zero_copy_only=False)
    return [values[offsets[i] : offsets[i + 1]].tolist() for i in range(len(array))]


def _routing_columns(routing: Sequence[ExpertIds | None]) -> tuple[_ArrowArray, _ArrowArray, _ArrowArray]:
    """(bytes, dtype, shape) columns of routing arrays (None: no routing)."""
    valid = np.array([r is not None for r in routing], dtype=bool)
    little = [
        None if r is None else np.ascontiguousarray(r, dtype=r.dtype.newbyteorder("<")) for r in routing
    ]
    offsets = _offsets((0 if r is None else r.nbytes for r in little), np.int64)
    parts = [r.reshape(-1).view(np.uint8) for r in little if r is not None and r.size]
    data = np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint8)
    nulls = int(valid.size - valid.sum())
    bitmap = pa.py_buffer(np.packbits(valid, bitorder="little")) if nulls else None
    blobs = pa.LargeBinaryArray.from_buffers(
        pa.large_binary(), len(routing), [bitmap, pa.py_buffer(offsets), pa.py_buffer(data)], null_count=nulls
    )
    dtypes = pa.array([None if r is None else r.dtype.name for r in routing], pa.string())
    shapes = pa.array([None if r is None else list(r.shape) for r in routing], pa.list_(pa.int32(), 3))
    return blobs, dtypes, shapes


def _routing_v2(blobs: _ArrowArray, dtypes: _ArrowArray, shapes: _ArrowArray) -> list[ExpertIds | None]:
    """Routing arrays of schema-2 columns: zero-copy, read-only views of the table's buffers."""
    n = len(blobs)
    if n == 0:
        return []
    _, offsets_buf, data = blobs.buffers()
    offsets = np.frombuffer(offsets_buf, dtype=np.int64)[blobs.offset : blobs.offset + n + 1]
    valid = (
        np.ones(n, dtype=bool) if blobs.null_count == 0 else blobs.is_valid().to_numpy(zero_copy_only=False)
    )
    names = dtypes.to_pylist()
    dims = shapes.to_pylist()
    out: list[ExpertIds | None] = []
    for i in range(n):
        if not valid[i]:
            out.append(None)
            continue
        name, shape = names[i], dims[i]
        if name not in ROUTING_DTYPES or shape is None:
            raise TrajectoryError(f"routing {i} has dtype {name!r} and shape {shape}: the table is damaged")
        wide = np.dtype(name).newbyteorder("<")
        start, end = int(offsets[i]), int(offsets[i + 1])
        if end - start != math.prod(shape) * wide.itemsize:
            raise TrajectoryError(
                f"routing {i} holds {end - start} bytes, shape {tuple(shape)} of {name} needs "
                f"{math.prod(shape) * wide.itemsize}: the table is damaged"
            )
        if start == end:
            flat: npt.NDArray[Any] = np.zeros(0, dtype=wide)
        else:
            flat = np.frombuffer(data, dtype=wide, count=(end - start) // wide.itemsize, offset=start)
        arr = flat.reshape(shape)
        if not arr.dtype.isnative:
            arr = arr.astype(arr.dtype.newbyteorder("="))
        # A view of the table's buffer: writing through it would change the table under its other readers.
        arr.flags.writeable = False
        out.append(arr)
    return out


def _routing_v1(flat: _ArrowArray, shapes: _ArrowArray) -> list[ExpertIds | None]:
    """Routing arrays of schema-1 columns (`list<uint16>`), converted on read."""
    offsets = flat.offsets.to_numpy()
    values = flat.values.to_numpy(zero_copy_only=False)
    valid = flat.is_valid().to_numpy(zero_copy_only=False)
    dims = shapes.to_pylist()
    return [
        routing_array(values[offsets[i] : offsets[i + 1]].astype(np.int64), dims[i]) if valid[i] else None
        for i in range(len(flat))
    ]


def _routing_from(columns: Mapping[str, _ArrowArray], version: int) -> list[ExpertIds | None]:
    if version == 1:
        return _routing_v1(columns["routed_experts"], columns["routed_experts_shape"])
    return _routing_v2(
        columns["routed_experts"], columns["routed_experts_dtype"], columns["routed_experts_shape"]
    )


def _whole(column: Any) -> _ArrowArray:
    """One array of a table column (a ChunkedArray)."""
    return column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)


# --- turn tables -------------------------------------------------------------------------------------

_ROUTING_COLUMNS: Final = ("routed_experts", "routed_experts_dtype", "routed_experts_shape")


def turns_to_table(turns: list[Turn]) -> pa.Table:
    """Turns as an Arrow table (checked against the contract first)."""
    for turn in turns:
        turn.check()
    blobs, dtypes, shapes = _routing_columns([t.routed_experts for t in turns])
    arrays: dict[str, Any] = {
        "prompt_token_ids": _list_column([t.prompt_token_ids for t in turns], np.int32, pa.int32()),
        "completion_token_ids": _list_column([t.completion_token_ids for t in turns], np.int32, pa.int32()),
        "completion_logprobs": _list_column([t.completion_logprobs for t in turns], np.float32, pa.float32()),
        "routed_experts": blobs,
        "routed_experts_dtype": dtypes,
        "routed_experts_shape": shapes,
        "api_format": pa.array([t.api_format.value for t in turns], pa.string()),
        "prompt_tokens": pa.array([t.prompt_tokens for t in turns], pa.int32()),
        "completion_tokens": pa.array([t.completion_tokens for t in turns], pa.int32()),
    }
    columns = [
        arrays[f.name] if f.name in arrays else pa.array([getattr(t, f.name) for t in turns], f.type)
        for f in TURN_SCHEMA
    ]
    return pa.Table.from_arrays(columns, schema=TURN_SCHEMA)


def turns_from_table(table: pa.Table) -> list[Turn]:
    version = check_schema(table, TURN_SCHEMA)
    heavy = {"prompt_token_ids", "completion_token_ids", "completion_logprobs", *_ROUTING_COLUMNS}
    rows = table.drop_columns([c for c in table.column_names if c in heavy]).to_pylist()
    whole = {name: _whole(table.column(name)) for name in table.column_names if name in heavy}
    prompts, completions, logprobs = (
        _lists(whole[c]) for c in ("prompt_token_ids", "completion_token_ids", "completion_logprobs")
    )
    routing = _routing_from(whole, version)
    names = {f.name for f in fields(Turn)}
    return [
        Turn(
            **{k: v for k, v in row.items() if k in names and k not in heavy and k != "api_format"},
            api_format=ApiFormat(row["api_format"]),
            prompt_token_ids=prompts[i],
            completion_token_ids=completions[i],
            completion_logprobs=logprobs[i],
            routed_experts=routing[i],
        )
        for i, row in enumerate(rows)
    ]


# --- trial tables ------------------------------------------------------------------------------------


def _segments_array(trials: Sequence[TrialRecord]) -> _ArrowArray:
    segs = [s for t in trials for s in t.segments]
    blobs, dtypes, shapes = _routing_columns([s.routed_experts for s in segs])
    children = {
        "index": pa.array([s.index for s in segs], pa.int32()),
        "token_ids": _list_column([s.token_ids for s in segs], np.int32, pa.int32()),
        "loss_mask": _list_column([s.loss_mask for s in segs], np.int8, pa.int8()),
        "behavior_logprobs": _list_column([s.behavior_logprobs for s in segs], np.float32, pa.float32()),
        "routed_experts": blobs,
        "routed_experts_dtype": dtypes,
        "routed_experts_shape": shapes,
        "turn_indices": _list_column([s.turn_indices for s in segs], np.int32, pa.int32()),
        "policy_versions": pa.array([s.policy_versions for s in segs], pa.list_(pa.string())),
    }
    struct = pa.StructArray.from_arrays([children[f.name] for f in SEGMENT_TYPE], fields=list(SEGMENT_TYPE))
    offsets = _offsets((len(t.segments) for t in trials), np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), struct, type=pa.list_(SEGMENT_TYPE))


def _segments_of(column: Any, version: int) -> list[list[Segment]]:
    """Each row's segments, decoded column by column (see `_routing_v2`: routing is zero-copy)."""
    out: list[list[Segment]] = []
    for chunk in column.chunks:
        starts = chunk.offsets.to_numpy()
        struct = chunk.values
        child = {f.name: struct.field(f.name) for f in struct.type}
        index = child["index"].to_numpy(zero_copy_only=False).tolist()
        tokens = _lists(child["token_ids"])
        masks = _lists(child["loss_mask"])
        logprobs = _lists(child["behavior_logprobs"])
        turns = _lists(child["turn_indices"])
        versions = child["policy_versions"].to_pylist()
        routing = _routing_from(child, version)
        for row in range(len(chunk)):
            out.append(
                [
                    Segment(
                        index=index[i],
                        token_ids=tokens[i],
                        loss_mask=masks[i],
                        behavior_logprobs=logprobs[i],
                        turn_indices=turns[i],
                        policy_versions=versions[i],
                        routed_experts=routing[i],
                    )
                    for i in range(int(starts[row]), int(starts[row + 1]))
                ]
            )
    return out


def trials_to_table(trials: list[TrialRecord]) -> pa.Table:
    """Trial records as an Arrow table. Each record is checked first, but not its segments, which were
    checked where they came in (see `TrialRecord.check`); `trials_from_table` checks them on read. A
    segment that breaks the contract so badly that Arrow refuses it is named by the contract's check."""
    for trial in trials:
        trial.check(segments=False)
    try:
        return _trials_table(trials)
    except (pa.ArrowException, ValueError, TypeError):
        for trial in trials:
            trial.check()
        raise


def _trials_table(trials: list[TrialRecord]) -> pa.Table:
    arrays: dict[str, Any] = {
        "termination_reason": pa.array([t.termination_reason.value for t in trials], pa.string()),
        "tamper_findings": pa.array(
            [[f.to_dict() for f in t.tamper_findings] for t in trials],
            pa.list_(TAMPER_TYPE),
        ),
        "segments": _segments_array(trials),
        "stage_seconds": pa.array(
            [[{"stage": k, "seconds": v} for k, v in t.stage_seconds.items()] for t in trials],
            pa.list_(STAGE_TYPE),
        ),
    }
    columns = [
        arrays[f.name] if f.name in arrays else pa.array([getattr(t, f.name) for t in trials], f.type)
        for f in TRIAL_SCHEMA
    ]
    return pa.Table.from_arrays(columns, schema=TRIAL_SCHEMA)


def _shallow(summary: TrialSummary) -> dict[str, Any]:
    return {f.name: getattr(summary, f.name) for f in fields(summary)}


def trials_from_table(table: pa.Table) -> list[TrialRecord]:
    """Trial records of a trial table of any readable schema version (version 1 converted on read),
    checked against the contract, segments included: a table is data from outside this process."""
    version = check_schema(table, TRIAL_SCHEMA)
    rows = table.drop_columns(["segments"]).to_pylist()
    segments = _segments_of(table.column("segments"), version)
    records = [
        TrialRecord(**_shallow(TrialSummary.from_row(row)), segments=segs)
        for row, segs in zip(rows, segments, strict=True)
    ]
    for record in records:
        record.check()
    return records

"""The trajectory contract: round trips through Arrow and Parquet, schema versions, and contract checks."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from legorl.api.summary import TrajectorySummary
from legorl.api.trajectory import (
    INFRA_REASONS,
    SCHEMA_VERSION,
    TRIAL_SCHEMA,
    TRIAL_SCHEMA_V1,
    TURN_SCHEMA,
    ApiFormat,
    SchemaVersionError,
    Segment,
    TamperFinding,
    TerminationReason,
    TrajectoryError,
    TrialRecord,
    Turn,
    check_schema,
    decode_routing,
    routing_array,
    routing_to_json,
    trials_from_table,
    trials_to_table,
    turns_from_table,
    turns_to_table,
)
from tests.support.trajectory_v1 import v1_trial_table, v1_turn_table

T0 = datetime(2025, 3, 1, 12, 0, 0, 123456, tzinfo=UTC)
LAYERS, TOP_K = 2, 2


def routing(tokens: int, *, high: int = 64) -> npt.NDArray[Any]:
    """Routed experts for a sequence of TOKENS: one row per token but the last (uint8 below 256)."""
    shape = (tokens - 1, LAYERS, TOP_K)
    return routing_array(np.arange(math.prod(shape)) * 97 % high, shape)


def make_turn(**changes: Any) -> Turn:
    # Logprobs are exact in float32, the width the schema stores them in.
    experts = routing(5)
    turn = Turn(
        run="run-a",
        trial="trial-1",
        session="sess-1",
        index=0,
        api_format=ApiFormat.OPENAI_CHAT,
        prompt_token_ids=[1, 2, 3],
        completion_token_ids=[4, 5],
        completion_logprobs=[-0.5, -1.25],
        finish_reason="stop",
        policy_versions=["step-3"],
        started_at=T0,
        ended_at=T0 + timedelta(seconds=1.5),
        routed_experts=experts,
        ttft_seconds=0.25,
        request_body='{"messages": []}',
        response_body='{"choices": []}',
    )
    return dataclasses.replace(turn, **changes)


def make_segment(index: int = 0, **changes: Any) -> Segment:
    experts = routing(6)
    segment = Segment(
        index=index,
        token_ids=[10, 11, 12, 13, 14, 15],
        loss_mask=[0, 0, 1, 1, 0, 1],
        behavior_logprobs=[0.0, 0.0, -0.5, -0.75, 0.0, -2.0],
        turn_indices=[0, 1],
        policy_versions=["step-3", "step-4"],
        routed_experts=experts,
    )
    return dataclasses.replace(segment, **changes)


def make_trial(**changes: Any) -> TrialRecord:
    trial = TrialRecord(
        run="run-a",
        trial="trial-1",
        task_id="task-7",
        group_id="group-2",
        split="train",
        step=4,
        harness="claude-code",
        termination_reason=TerminationReason.COMPLETED,
        reward=1.0,
        started_at=T0,
        ended_at=T0 + timedelta(minutes=3, microseconds=7),
        segments=[
            make_segment(0),
            make_segment(1, routed_experts=None, routed_experts_shape=None, turn_indices=[2]),
        ],
        tamper_findings=[
            TamperFinding(kind="test_file_modified", detail="edited the test", path="tests/test_x.py"),
            TamperFinding(kind="egress_attempt", detail="tried example.com"),
        ],
        policy_versions=["step-3", "step-4"],
        num_turns=3,
        merged_turn_share=0.5,
        stage_seconds={"sandbox": 12.5, "agent": 140.0, "verify": 9.25},
        error=None,
        tool_call_turns=2,
    )
    return dataclasses.replace(trial, **changes)


def parquet_round_trip(table: pa.Table, path: Path) -> pa.Table:
    fs = fsspec.filesystem("file")
    with fs.open(str(path), "wb") as out:
        pq.write_table(table, out)
    with fs.open(str(path), "rb") as src:
        return pq.read_table(src)


# --- round trips ----------------------------------------------------------------------------------


def test_turn_round_trips_through_arrow() -> None:
    turns = [
        make_turn(),
        make_turn(index=1, routed_experts=None, routed_experts_shape=None, ttft_seconds=None),
    ]
    table = turns_to_table(turns)
    assert table.schema.equals(TURN_SCHEMA, check_metadata=True)
    assert table.column("prompt_tokens").to_pylist() == [3, 3]
    assert table.column("completion_tokens").to_pylist() == [2, 2]
    assert turns_from_table(table) == turns


def test_trial_round_trips_through_arrow() -> None:
    trials = [
        make_trial(),
        make_trial(trial="trial-2", reward=None, termination_reason=TerminationReason.SANDBOX_ERROR),
    ]
    table = trials_to_table(trials)
    assert table.schema.equals(TRIAL_SCHEMA, check_metadata=True)
    back = trials_from_table(table)
    assert back == trials
    assert back[0].segments[0].routed_experts_shape == (5, LAYERS, TOP_K)
    routed = back[0].segments[0].routed_experts
    assert isinstance(routed, np.ndarray) and routed.dtype == np.uint8 and routed.shape == (5, LAYERS, TOP_K)
    assert back[0].segments[1].routed_experts is None
    assert isinstance(back[1].termination_reason, TerminationReason)
    assert back[0].started_at.tzinfo is not None


def test_round_trip_through_parquet(tmp_path: Path) -> None:
    turns = [make_turn()]
    trials = [make_trial()]
    turn_table = parquet_round_trip(turns_to_table(turns), tmp_path / "turns.parquet")
    trial_table = parquet_round_trip(trials_to_table(trials), tmp_path / "trials.parquet")

    for table, schema in ((turn_table, TURN_SCHEMA), (trial_table, TRIAL_SCHEMA)):
        metadata = table.schema.metadata or {}
        assert metadata[b"legorl.schema"] == schema.metadata[b"legorl.schema"]
        assert metadata[b"legorl.schema_version"] == str(SCHEMA_VERSION).encode()
        assert table.schema.equals(schema), f"{schema.metadata[b'legorl.schema']!r} schema changed in Parquet"
    assert turns_from_table(turn_table) == turns
    assert trials_from_table(trial_table) == trials


def test_a_table_written_before_tool_call_turns_still_reads(tmp_path: Path) -> None:
    """`tool_call_turns` was added without a version bump: older trial tables lack the column."""
    table = trials_to_table([make_trial()])
    older = table.drop_columns(["tool_call_turns"])
    (back,) = trials_from_table(parquet_round_trip(older, tmp_path / "older.parquet"))
    assert back.tool_call_turns is None and back == make_trial(tool_call_turns=None)


# --- routing stays numpy ----------------------------------------------------------------------------


def wide_segment(index: int) -> Segment:
    """A segment whose routing needs uint16 (ids up to 511, a 512-expert model)."""
    return make_segment(index, routed_experts=routing(6, high=512), turn_indices=[index])


def test_routing_round_trips_as_read_only_numpy_of_its_own_dtype(tmp_path: Path) -> None:
    """Each segment keeps its width through Parquet (uint8 next to uint16 in one table), and reads back as a
    read-only view of the table's memory: no list of ints was built on the way."""
    trials = [make_trial(segments=[make_segment(0), wide_segment(1), make_segment(2, routed_experts=None)])]
    table = parquet_round_trip(trials_to_table(trials), tmp_path / "trials.parquet")
    (back,) = trials_from_table(table)
    assert back == trials[0]
    narrow, wide, bare = (s.routed_experts for s in back.segments)
    assert narrow is not None and wide is not None and bare is None
    assert narrow.dtype == np.uint8 and wide.dtype == np.uint16
    assert int(wide.max()) >= 256
    assert narrow.shape == wide.shape == (5, LAYERS, TOP_K)
    np.testing.assert_array_equal(wide, trials[0].segments[1].routed_experts)
    assert not narrow.flags.writeable and not wide.flags.writeable  # zero-copy views, not rebuilt arrays
    # The stored bytes are the array's little-endian bytes, row-major.
    stored = table.column("segments").combine_chunks().flatten().field("routed_experts")
    assert stored[1].as_py() == np.ascontiguousarray(wide, "<u2").tobytes()
    assert table.column("segments").combine_chunks().flatten().field("routed_experts_dtype").to_pylist() == [
        "uint8",
        "uint16",
        None,
    ]


def test_sliced_and_chunked_tables_read_row_by_row() -> None:
    """Offsets are honoured: a slice of a table, and a table of several chunks, give their own rows."""
    first = make_trial(trial="t-1", segments=[make_segment(0)])
    second = make_trial(trial="t-2", segments=[wide_segment(0), make_segment(1, routed_experts=None)])
    third = make_trial(trial="t-3", segments=[], reward=0.0)
    table = trials_to_table([first, second, third])
    assert trials_from_table(table.slice(1, 1)) == [second]
    assert trials_from_table(table.slice(2)) == [third]
    chunked = pa.concat_tables([table.slice(1), table.slice(0, 1)])
    assert chunked.column("segments").num_chunks == 2
    assert trials_from_table(chunked) == [second, third, first]


def test_an_empty_table_reads_as_no_trials() -> None:
    assert trials_from_table(trials_to_table([])) == []
    assert turns_from_table(turns_to_table([])) == []


@pytest.mark.parametrize(
    ("values", "dtype"),
    [
        pytest.param(np.full((2, 2, 2), 7, np.uint8), np.uint8, id="uint8-kept"),
        # vLLM sends uint16 for models with more than 256 experts: kept even when a turn's ids are all small,
        # so every turn of one model has one dtype.
        pytest.param(np.full((2, 2, 2), 7, np.uint16), np.uint16, id="uint16-kept-even-if-small"),
        pytest.param(np.full((2, 2, 2), 7, ">u2"), np.uint16, id="big-endian-uint16-to-native"),
        pytest.param(np.full((2, 2, 2), 255, np.int32), np.uint8, id="int32-narrowed-to-uint8"),
        pytest.param(np.full((2, 2, 2), 256, np.int64), np.uint16, id="int64-narrowed-to-uint16"),
        pytest.param(np.zeros((0, 2, 2), np.int32), np.uint8, id="empty"),
    ],
)
def test_routing_array_dtype_rule(values: npt.NDArray[Any], dtype: Any) -> None:
    out = routing_array(values)
    assert out.dtype == np.dtype(dtype) and out.dtype.isnative
    np.testing.assert_array_equal(out, values)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        pytest.param(np.full((2, 2, 2), -1, np.int32), "outside [0, 65535]", id="negative"),
        pytest.param(np.full((2, 2, 2), 65536, np.int32), "outside [0, 65535]", id="too-large"),
        pytest.param(np.zeros((2, 2), np.uint8), "3 dimensions", id="2-D"),
        pytest.param(np.zeros((2, 2, 2), np.float64), "integer expert ids", id="floats"),
        pytest.param(np.zeros((2, 2, 2), np.bool_), "integer expert ids", id="booleans"),
    ],
)
def test_routing_array_refuses_what_is_not_expert_ids(values: npt.NDArray[Any], message: str) -> None:
    with pytest.raises(TrajectoryError, match=re.escape(message)):
        routing_array(values)


def test_segments_merging_turns_of_both_widths_take_the_wider() -> None:
    """The dtype rule across turns: one dtype per segment, the wider (lossless)."""
    narrow, wide = (
        routing_array(np.full((2, 1, 2), 3, np.int32)),
        routing_array(np.full((3, 1, 2), 300, np.int32)),
    )
    assert narrow.dtype == np.uint8 and wide.dtype == np.uint16
    merged = np.concatenate([narrow, wide])
    assert merged.dtype == np.uint16 and merged.tolist()[0] == [[3, 3]]


def test_segment_json_carries_routing_as_base64_and_reads_older_lists() -> None:
    segment = wide_segment(3)
    wire = json.loads(json.dumps(segment.to_json()))
    assert wire["routed_experts"]["$array"] == "u2"
    assert wire["routed_experts"]["shape"] == [5, LAYERS, TOP_K]
    back = Segment.from_json(wire)
    assert back == segment
    assert back.routed_experts is not None and back.routed_experts.dtype == np.uint16
    # What a proxy before schema 2 sent: a flat list of ints and the shape.
    assert segment.routed_experts is not None
    older = {**wire, "routed_experts": segment.routed_experts.reshape(-1).tolist()}
    assert Segment.from_json(older) == segment
    bare = Segment.from_json({**wire, "routed_experts": None, "routed_experts_shape": None})
    assert bare.routed_experts is None and bare.routed_experts_shape is None


def test_decode_routing_reads_every_stored_form() -> None:
    array = routing(4, high=300)
    shape = list(array.shape)
    raw = np.ascontiguousarray(array, "<u2").tobytes()
    for form in (
        array,
        routing_to_json(array),
        {"$array": "u2", "b64": routing_to_json(array)["b64"]},  # the journal's older flat form
        raw,
        array.reshape(-1).tolist(),
    ):
        decoded = decode_routing(form, shape, "uint16")
        assert decoded is not None and decoded.dtype == np.uint16
        np.testing.assert_array_equal(decoded, array)
    assert decode_routing(None) is None
    for bad, message in [
        ({"$array": "f8", "b64": ""}, "not an encoded array"),
        ({"$array": "u2", "b64": "not base64!"}, "not valid base64"),
        ({"$array": "u2", "b64": "AAAA", "shape": [1, 1, 1]}, "not a whole number of u2"),
        ({"$array": "u1", "b64": "AAAA", "shape": [2, 1, 1]}, "3 entries, shape (2, 1, 1) needs 2"),
        (raw, "needs a dtype"),
        ("text", "cannot be a str"),
    ]:
        with pytest.raises(TrajectoryError, match=re.escape(message)):
            decode_routing(bad, shape, "uint16" if message != "needs a dtype" else None)


# --- version 1 (routing as list<uint16>) -------------------------------------------------------------


def test_a_version_1_trial_table_still_reads(tmp_path: Path) -> None:
    trials = [
        make_trial(segments=[make_segment(0), wide_segment(1), make_segment(2, routed_experts=None)]),
        make_trial(trial="trial-2", segments=[]),
    ]
    old = v1_trial_table(trials)
    segment_type = old.schema.field("segments").type.value_type
    assert segment_type.field("routed_experts").type == pa.list_(pa.uint16())
    assert old.schema.metadata[b"legorl.schema_version"] == b"1"
    with fsspec.filesystem("file").open(str(tmp_path / "v1.parquet"), "wb") as out:
        pq.write_table(old, out, compression="zstd")  # the version-1 writer's settings
    table = pq.read_table(tmp_path / "v1.parquet")
    assert check_schema(table, TRIAL_SCHEMA) == 1
    back = trials_from_table(table)
    assert back == trials
    narrow, wide, bare = (s.routed_experts for s in back[0].segments)
    assert narrow is not None and narrow.dtype == np.uint8  # converted on read, to the narrowest width
    assert wide is not None and wide.dtype == np.uint16
    assert bare is None
    # Converted records write as version 2.
    assert check_schema(trials_to_table(back), TRIAL_SCHEMA) == 2


def test_a_version_1_turn_table_still_reads() -> None:
    turns = [make_turn(), make_turn(index=1, routed_experts=None)]
    old = v1_turn_table(turns)
    assert old.schema.field("routed_experts").type == pa.list_(pa.uint16())
    back = turns_from_table(old)
    assert back == turns
    assert back[0].routed_experts is not None and back[0].routed_experts.dtype == np.uint8


# --- schema versions ------------------------------------------------------------------------------


@pytest.mark.parametrize("version", [b"3", b"0", b"?"])
def test_other_schema_version_is_refused(version: bytes) -> None:
    table = trials_to_table([make_trial()])
    future = table.replace_schema_metadata({**table.schema.metadata, b"legorl.schema_version": version})
    with pytest.raises(
        SchemaVersionError, match=rf"version {re.escape(version.decode())};.*reads version {SCHEMA_VERSION}"
    ):
        trials_from_table(future)
    with pytest.raises(SchemaVersionError, match=f"version {re.escape(version.decode())}"):
        check_schema(future.schema, TRIAL_SCHEMA)


def test_the_schema_version_was_bumped_for_columnar_routing() -> None:
    assert SCHEMA_VERSION == 2
    assert check_schema(trials_to_table([make_trial()]), TRIAL_SCHEMA) == 2
    assert TRIAL_SCHEMA.metadata[b"legorl.schema_version"] == b"2"
    assert TRIAL_SCHEMA_V1.metadata[b"legorl.schema_version"] == b"1"
    segment = TRIAL_SCHEMA.field("segments").type.value_type
    assert segment.field("routed_experts").type == pa.large_binary()
    assert segment.field("routed_experts_dtype").type == pa.string()


def test_unlabelled_table_is_refused() -> None:
    bare = turns_to_table([make_turn()]).replace_schema_metadata(None)
    with pytest.raises(SchemaVersionError, match="unlabelled"):
        turns_from_table(bare)


def test_turn_table_is_not_a_trial_table() -> None:
    turns = turns_to_table([make_turn()])
    with pytest.raises(SchemaVersionError, match=r"expected a 'trial' table, got 'turn'"):
        check_schema(turns, TRIAL_SCHEMA)
    with pytest.raises(SchemaVersionError, match="'turn'"):
        trials_from_table(turns)
    check_schema(turns, TURN_SCHEMA)


# --- contract violations --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("turn", "message"),
    [
        pytest.param(
            make_turn(completion_logprobs=[-0.5]), "turn 0: 1 logprobs for 2 completion tokens", id="logprobs"
        ),
        pytest.param(
            make_turn(policy_versions=[]), "turn 0: no policy version recorded", id="no-policy-version"
        ),
        pytest.param(make_turn(routed_experts=routing(7)), "6 rows, expected 4", id="routing-rows"),
        pytest.param(
            make_turn(routed_experts=np.zeros((4, LAYERS * TOP_K), np.uint8), routed_experts_shape=(4, 2, 2)),
            "routed_experts has shape (4, 4), routed_experts_shape says (4, 2, 2)",
            id="routing-2d",
        ),
        pytest.param(
            make_turn(routed_experts=[0] * 16, routed_experts_shape=None),
            "go together",
            id="routing-without-shape",
        ),
        pytest.param(
            make_turn(routed_experts=[0] * 16, routed_experts_shape=(4, LAYERS, TOP_K)),
            "routed_experts is a list; the contract keeps routing as a numpy array",
            id="routing-as-a-list",
        ),
        pytest.param(
            make_turn(routed_experts=np.zeros((4, LAYERS, TOP_K), np.int32)),
            "routed_experts has dtype <i4; expected native uint8 or uint16",
            id="routing-int32",
        ),
        pytest.param(
            make_turn(routed_experts=np.zeros((4, LAYERS, TOP_K), ">u2")),
            "routed_experts has dtype >u2",
            id="routing-big-endian",
        ),
    ],
)
def test_turn_contract_violations(turn: Turn, message: str) -> None:
    with pytest.raises(TrajectoryError, match=re.escape(message)):
        turns_to_table([turn])


@pytest.mark.parametrize(
    ("segment", "message", "table_message"),
    [
        pytest.param(
            make_segment(loss_mask=[0, 1, 1]),
            "segment 0: token_ids (6), loss_mask (3)",
            None,
            id="mask-misaligned",
        ),
        pytest.param(
            make_segment(behavior_logprobs=[0.0]), "behavior_logprobs (1) must align", None, id="logprobs"
        ),
        pytest.param(
            make_segment(loss_mask=[0, 0, 1, 2, 0, 1]),
            "segment 0: loss_mask holds values other than 0/1",
            None,
            id="mask-value-2",
        ),
        pytest.param(make_segment(routed_experts=routing(7)), "6 rows, expected 5", None, id="routing-rows"),
        pytest.param(
            make_segment(
                routed_experts=np.zeros((5, LAYERS * TOP_K), np.uint8), routed_experts_shape=(5, 2, 2)
            ),
            "routed_experts has shape (5, 4), routed_experts_shape says (5, 2, 2)",
            None,
            id="routing-2d",
        ),
        pytest.param(
            make_segment(routed_experts=np.zeros((5, LAYERS, TOP_K), np.float32)),
            "routed_experts has dtype <f4",
            # Written as bytes with its dtype's name; the read refuses that name before the contract.
            "routing 0 has dtype 'float32' and shape [5, 2, 2]",
            id="routing-float",
        ),
        pytest.param(make_segment(turn_indices=[]), "segment 0: built from no turns", None, id="no-turns"),
    ],
)
def test_segment_contract_violations(segment: Segment, message: str, table_message: str | None) -> None:
    # Segments are checked where they enter a process: a table read back (or, when Arrow cannot even
    # hold the segment, the write), and the proxy's trajectory.
    with pytest.raises(TrajectoryError, match=re.escape(table_message or message)):
        trials_from_table(trials_to_table([make_trial(segments=[segment])]))


@pytest.mark.parametrize(
    ("segment", "message"),
    [
        pytest.param(
            make_segment(behavior_logprobs=[0.0]), "behavior_logprobs (1) must align", id="logprobs"
        ),
        pytest.param(make_segment(loss_mask=[0, 0, 1, 2, 0, 1]), "loss_mask holds values other", id="mask"),
        pytest.param(make_segment(routed_experts=routing(7)), "6 rows, expected 5", id="routing-rows"),
        pytest.param(make_segment(turn_indices=[]), "segment 0: built from no turns", id="no-turns"),
    ],
)
def test_a_trajectory_whose_segment_breaks_the_contract_is_refused(segment: Segment, message: str) -> None:
    # Where the proxy's segments enter the run controller.
    body = TrajectorySummary(run="run-a", trial="trial-1", state="ended", segments=[segment]).to_json()
    with pytest.raises(TrajectoryError, match=re.escape(message)):
        TrajectorySummary.from_json(body)


def test_completed_trial_needs_a_reward() -> None:
    with pytest.raises(TrajectoryError, match="trial trial-1: completed without a reward"):
        trials_to_table([make_trial(reward=None)])
    make_trial(reward=None, termination_reason=TerminationReason.AGENT_TIMEOUT).check()


# --- termination reasons --------------------------------------------------------------------------


def test_infra_reasons() -> None:
    assert {reason.value for reason in INFRA_REASONS} == {
        "sandbox_error",
        "engine_error",
        "proxy_error",
        "verifier_error",
        "defense_failed",
        "cancelled",
    }
    assert all(isinstance(reason, TerminationReason) for reason in INFRA_REASONS)


def test_termination_reasons_are_closed_and_documented() -> None:
    policy_reasons = {"completed", "agent_error", "turn_limit", "context_overflow", "agent_timeout"}
    assert len(TerminationReason) == 11
    assert {reason.value for reason in TerminationReason} == policy_reasons | {r.value for r in INFRA_REASONS}
    assert not policy_reasons & {r.value for r in INFRA_REASONS}
    for reason in TerminationReason:
        assert isinstance(reason.description, str), reason
        assert reason.description.strip(), f"{reason} has no description"

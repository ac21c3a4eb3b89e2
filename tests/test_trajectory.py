"""The trajectory contract: round trips through Arrow and Parquet, schema versions, and contract checks."""

from __future__ import annotations

import dataclasses
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from legorl.api.trajectory import (
    INFRA_REASONS,
    SCHEMA_VERSION,
    TRIAL_SCHEMA,
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
    trials_from_table,
    trials_to_table,
    turns_from_table,
    turns_to_table,
)

T0 = datetime(2025, 3, 1, 12, 0, 0, 123456, tzinfo=UTC)
LAYERS, TOP_K = 2, 2


def routing(tokens: int) -> tuple[list[int], tuple[int, int, int]]:
    """Routed experts for a sequence of TOKENS: one row per token but the last."""
    shape = (tokens - 1, LAYERS, TOP_K)
    return [i % 64 for i in range(shape[0] * shape[1] * shape[2])], shape


def make_turn(**changes: Any) -> Turn:
    # Logprobs are exact in float32, the width the schema stores them in.
    experts, shape = routing(5)
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
        routed_experts_shape=shape,
        ttft_seconds=0.25,
        request_body='{"messages": []}',
        response_body='{"choices": []}',
    )
    return dataclasses.replace(turn, **changes)


def make_segment(index: int = 0, **changes: Any) -> Segment:
    experts, shape = routing(6)
    segment = Segment(
        index=index,
        token_ids=[10, 11, 12, 13, 14, 15],
        loss_mask=[0, 0, 1, 1, 0, 1],
        behavior_logprobs=[0.0, 0.0, -0.5, -0.75, 0.0, -2.0],
        turn_indices=[0, 1],
        policy_versions=["step-3", "step-4"],
        routed_experts=experts,
        routed_experts_shape=shape,
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


# --- schema versions ------------------------------------------------------------------------------


def test_other_schema_version_is_refused() -> None:
    table = trials_to_table([make_trial()])
    future = table.replace_schema_metadata({**table.schema.metadata, b"legorl.schema_version": b"2"})
    with pytest.raises(SchemaVersionError, match=rf"version 2.*reads version {SCHEMA_VERSION}"):
        trials_from_table(future)
    with pytest.raises(SchemaVersionError, match="version 2"):
        check_schema(future.schema, TRIAL_SCHEMA)


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
        pytest.param(
            make_turn(routed_experts=[0] * 6 * LAYERS * TOP_K, routed_experts_shape=(6, LAYERS, TOP_K)),
            "6 rows, expected 4",
            id="routing-rows",
        ),
        pytest.param(
            make_turn(routed_experts=[0] * 7, routed_experts_shape=(4, LAYERS, TOP_K)),
            "7 entries, shape (4, 2, 2) needs 16",
            id="routing-shape",
        ),
        pytest.param(make_turn(routed_experts_shape=None), "go together", id="routing-without-shape"),
    ],
)
def test_turn_contract_violations(turn: Turn, message: str) -> None:
    with pytest.raises(TrajectoryError, match=re.escape(message)):
        turns_to_table([turn])


@pytest.mark.parametrize(
    ("segment", "message"),
    [
        pytest.param(
            make_segment(loss_mask=[0, 1, 1]), "segment 0: token_ids (6), loss_mask (3)", id="mask-misaligned"
        ),
        pytest.param(
            make_segment(behavior_logprobs=[0.0]), "behavior_logprobs (1) must align", id="logprobs"
        ),
        pytest.param(
            make_segment(loss_mask=[0, 0, 1, 2, 0, 1]),
            "segment 0: loss_mask holds values other than 0/1",
            id="mask-value-2",
        ),
        pytest.param(
            make_segment(routed_experts=[0] * 6 * LAYERS * TOP_K, routed_experts_shape=(6, LAYERS, TOP_K)),
            "6 rows, expected 5",
            id="routing-rows",
        ),
        pytest.param(
            make_segment(routed_experts=[0] * 19, routed_experts_shape=(5, LAYERS, TOP_K)),
            "19 entries, shape (5, 2, 2) needs 20",
            id="routing-shape",
        ),
        pytest.param(make_segment(turn_indices=[]), "segment 0: built from no turns", id="no-turns"),
    ],
)
def test_segment_contract_violations(segment: Segment, message: str) -> None:
    with pytest.raises(TrajectoryError, match=re.escape(message)):
        trials_to_table([make_trial(segments=[segment])])


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

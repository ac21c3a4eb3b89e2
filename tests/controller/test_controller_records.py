"""A proxy's `GET /trajectory` to the run store: routed experts travel as base64 arrays and land as numpy."""

from __future__ import annotations

import base64
import io
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from legorl.api.store import RunStore
from legorl.api.summary import TrajectorySummary
from legorl.api.termination import TerminationReason
from legorl.api.trajectory import ApiFormat, TrajectoryError, Turn
from legorl.controller.backend import TrialRequest
from legorl.controller.records import build_record
from legorl.proxy import _json
from legorl.proxy.metrics import Metrics
from legorl.proxy.settings import ProxySettings
from legorl.proxy.trial import Trial, decode_routed_experts
from legorl.sandbox.task import Task

T0 = datetime(2026, 12, 1, tzinfo=UTC)
LAYERS, TOP_K = 4, 2


def vllm_routing(tokens: int, seed: int) -> str:
    """What vLLM sends for a call over `tokens` tokens: base64 `.npy`, uint8 (a model of ≤ 256 experts)."""
    ids = np.random.default_rng(seed).integers(0, 128, size=(tokens - 1, LAYERS, TOP_K)).astype(np.uint8)
    with io.BytesIO() as buffer:
        np.save(buffer, ids, allow_pickle=False)
        return base64.b64encode(buffer.getvalue()).decode()


def turn(prompt: list[int], completion: list[int], seed: int) -> Turn:
    return Turn(
        run="run",
        trial="trial-1",
        session="trial-1",
        index=-1,
        api_format=ApiFormat.OPENAI_CHAT,
        prompt_token_ids=prompt,
        completion_token_ids=completion,
        completion_logprobs=[-0.25] * len(completion),
        finish_reason="stop",
        policy_versions=["v0"],
        started_at=T0,
        ended_at=T0,
        routed_experts=decode_routed_experts(vllm_routing(len(prompt) + len(completion), seed)),
    )


def request() -> TrialRequest:
    task = Task(
        instance_id="task-1",
        repo="r",
        base_commit="0" * 40,
        problem_statement="fix it",
        test_patch="",
        fail_to_pass=("tests/test_x.py::test_a",),
        pass_to_pass=(),
    )
    return TrialRequest(trial="trial-1", task=task, group_id="g", split="train", step=1, policy_version="v0")


async def proxy_trajectory(tmp_path: Path) -> tuple[dict[str, Any], list[Turn]]:
    """Two turns through a real proxy `Trial` (journaled), then its trajectory as the JSON a client parses."""
    settings = ProxySettings(
        upstream="http://engine:8000", journal=tmp_path / "journal", run="run", trial="trial-1"
    )
    trial = Trial(settings, Metrics())
    try:
        first = await trial.record(turn([1, 2, 3, 4, 5], [6, 7], seed=1))
        second = await trial.record(turn([1, 2, 3, 4, 5, 6, 7, 8, 9], [10, 11], seed=2))
        wire: dict[str, Any] = _json.loads(_json.dumps(trial.trajectory()))
    finally:
        trial.close()
    return wire, [first, second]


def build(trajectory: dict[str, Any]) -> Any:
    return build_record(
        request(),
        run="run",
        harness="MiniSweAgent",
        reason=TerminationReason.COMPLETED,
        reward=1.0,
        trajectory=TrajectorySummary.from_json(trajectory),
        started_at=T0,
        ended_at=T0 + timedelta(minutes=1),
    )


@pytest.mark.asyncio
async def test_routing_from_the_proxy_reaches_the_store_as_arrays(tmp_path: Path) -> None:
    wire, (first, second) = await proxy_trajectory(tmp_path)
    (seg_json,) = wire["segments"]
    assert seg_json["routed_experts"]["$array"] == "u1"  # base64 bytes on the wire, not a list of ints
    record = build(wire)
    (seg,) = record.segments
    assert seg.token_ids == list(range(1, 12))
    assert seg.routed_experts is not None and seg.routed_experts.dtype == np.uint8
    assert first.routed_experts is not None and second.routed_experts is not None
    # Rows 0..5 from the first call, the rest from the second (which fed tokens 7.. through the model).
    np.testing.assert_array_equal(seg.routed_experts[:6], first.routed_experts)
    np.testing.assert_array_equal(seg.routed_experts[6:], second.routed_experts[6:])
    store = RunStore(tmp_path / "store")
    store.save_trial(record)
    store.commit_batch(1, [record], policy_version="v0")
    assert store.saved_trials("train", 1) == [record]
    (back,) = store.read_batch(1).trials
    assert back == record
    assert back.segments[0].routed_experts is not None and back.segments[0].routed_experts.dtype == np.uint8


@pytest.mark.asyncio
async def test_an_older_proxys_lists_still_build_the_same_record(tmp_path: Path) -> None:
    wire, _ = await proxy_trajectory(tmp_path)
    record = build(wire)
    routed = record.segments[0].routed_experts
    assert routed is not None
    older = {**wire, "segments": [{**wire["segments"][0], "routed_experts": routed.reshape(-1).tolist()}]}
    assert build(older) == record


@pytest.mark.asyncio
async def test_a_damaged_routing_is_a_trajectory_error(tmp_path: Path) -> None:
    """The backends catch TrajectoryError as "the proxy's trajectory is unusable"."""
    wire, _ = await proxy_trajectory(tmp_path)
    seg = wire["segments"][0]
    short = {**seg["routed_experts"], "b64": base64.b64encode(b"\x01\x02").decode()}
    with pytest.raises(TrajectoryError, match=r"segment 0 is malformed: .*routed_experts has 2 entries"):
        TrajectorySummary.from_json({**wire, "segments": [{**seg, "routed_experts": short}]})


@pytest.mark.asyncio
async def test_the_summary_decodes_what_the_proxy_sends_and_encodes_it_back_unchanged(tmp_path: Path) -> None:
    wire, _ = await proxy_trajectory(tmp_path)
    assert list(wire) == [
        "run",
        "trial",
        "state",
        "end",
        "turns",
        "policyVersions",
        "mergedTurnShare",
        "errors",
        "journalDroppedBytes",
        "finishReasons",
        "segments",
    ]
    summary = TrajectorySummary.from_json(wire)
    assert (summary.run, summary.trial, summary.state, summary.end, summary.turns) == (
        "run",
        "trial-1",
        "running",
        None,
        2,
    )
    assert _json.loads(_json.dumps(summary.to_json())) == wire


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"turns": "2"}, "turns: Input should be a valid integer"),
        (
            {"end": {"reason": "bored", "source": "proxy", "endedAt": "2026-12-01T00:00:00+00:00"}},
            "end.reason",
        ),
        ({"end": {"reason": "completed", "source": "proxy"}}, r"end\.endedAt: Field required"),
        ({"state": "paused"}, "state: Input should be 'running' or 'ended'"),
        ({"segments": "many"}, "neither a list nor a count"),
        ({"segments": [{"index": 0}]}, "segment 0 is malformed: lacks 'token_ids'"),
    ],
)
@pytest.mark.asyncio
async def test_a_malformed_summary_says_what_is_wrong(
    tmp_path: Path, change: dict[str, Any], message: str
) -> None:
    wire, _ = await proxy_trajectory(tmp_path)
    with pytest.raises(TrajectoryError, match=message):
        TrajectorySummary.from_json({**wire, **change})
    with pytest.raises(TrajectoryError, match="not a JSON object"):
        TrajectorySummary.from_json([wire])

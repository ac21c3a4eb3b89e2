"""Segment assembly (DESIGN §6): turns merged by exact token-prefix extension, routing stitched per token."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from legorl.api.trajectory import ApiFormat, Segment, Turn, routing_array
from legorl.proxy.segments import Assembler, assemble_segments

T0 = datetime(2025, 3, 1, 12, 0, 0, tzinfo=UTC)
LAYERS, TOP_K = 3, 2
# Routed expert ids that say where they came from: which turn produced the row and for which
# token position, so a stitched segment shows the source of every row.
TURN_STRIDE = 8192


def expert(turn: int, position: int, layer: int, k: int) -> int:
    return turn * TURN_STRIDE + position * LAYERS * TOP_K + layer * TOP_K + k


def routing_for(turn: int, tokens: int) -> npt.NDArray[Any]:
    """Routing as vLLM returns it for a call over `tokens` tokens: one row per token but the last."""
    rows = tokens - 1
    flat = [expert(turn, p, layer, k) for p in range(rows) for layer in range(LAYERS) for k in range(TOP_K)]
    return routing_array(np.array(flat, dtype=np.int64), (rows, LAYERS, TOP_K))


def make_turn(
    index: int,
    prompt: Sequence[int],
    completion: Sequence[int],
    *,
    logprobs: Sequence[float] | None = None,
    versions: Sequence[str] = ("v0",),
    routed: bool = False,
    routing_source: int | None = None,
) -> Turn:
    if logprobs is None:
        # Distinct, recognisable values: -(index + 1) - position / 1000.
        logprobs = [-(index + 1) - i / 1000 for i in range(len(completion))]
    experts = None
    if routed:
        experts = routing_for(
            index if routing_source is None else routing_source, len(prompt) + len(completion)
        )
    turn = Turn(
        run="run-a",
        trial="trial-0",
        session="trial-0",
        index=index,
        api_format=ApiFormat.ANTHROPIC_MESSAGES,
        prompt_token_ids=list(prompt),
        completion_token_ids=list(completion),
        completion_logprobs=list(logprobs),
        finish_reason="stop",
        policy_versions=list(versions),
        started_at=T0,
        ended_at=T0,
        routed_experts=experts,
    )
    turn.check()
    return turn


def rows_of(segment: Segment) -> list[list[int]]:
    """The segment's routing as one flat row (layers × top_k) per token."""
    assert isinstance(segment.routed_experts, np.ndarray)
    assert segment.routed_experts_shape == segment.routed_experts.shape
    rows, layers, top_k = segment.routed_experts.shape
    rows_list: list[list[int]] = segment.routed_experts.reshape(rows, layers * top_k).tolist()
    return rows_list


def row(turn: int, position: int) -> list[int]:
    return [expert(turn, position, layer, k) for layer in range(LAYERS) for k in range(TOP_K)]


SYSTEM = [100, 101, 102, 103]
USER1 = [200, 201, 202]
ANSWER1 = [300, 301, 302, 303, 304]
TOOL1 = [400, 401]
ANSWER2 = [310, 311, 312]
USER2 = [210, 211, 212, 213]
ANSWER3 = [320, 321]


def clean_conversation(*, routed: bool = False) -> list[Turn]:
    """Three turns, each prompt the previous prompt + completion + new context tokens."""
    p0 = SYSTEM + USER1
    p1 = p0 + ANSWER1 + TOOL1
    p2 = p1 + ANSWER2 + USER2
    return [
        make_turn(0, p0, ANSWER1, versions=["v1"], routed=routed),
        make_turn(1, p1, ANSWER2, versions=["v1", "v2"], routed=routed),
        make_turn(2, p2, ANSWER3, versions=["v2"], routed=routed),
    ]


def test_a_clean_conversation_is_one_segment_with_loss_on_sampled_tokens_only() -> None:
    turns = clean_conversation()
    assembly = assemble_segments(turns)

    assert len(assembly.segments) == 1
    seg = assembly.segments[0]
    expected_tokens = SYSTEM + USER1 + ANSWER1 + TOOL1 + ANSWER2 + USER2 + ANSWER3
    assert seg.token_ids == expected_tokens
    sampled = set(ANSWER1 + ANSWER2 + ANSWER3)
    assert seg.loss_mask == [1 if t in sampled else 0 for t in expected_tokens]
    expected_logprobs: list[float] = []
    for part, turn in [
        (SYSTEM + USER1, None),
        (ANSWER1, turns[0]),
        (TOOL1, None),
        (ANSWER2, turns[1]),
        (USER2, None),
        (ANSWER3, turns[2]),
    ]:
        expected_logprobs += [0.0] * len(part) if turn is None else turn.completion_logprobs
    assert seg.behavior_logprobs == expected_logprobs
    assert seg.turn_indices == [0, 1, 2]
    assert seg.policy_versions == ["v1", "v2"]
    assert seg.routed_experts is None
    assert seg.routed_experts_shape is None
    assert assembly.turns == 3
    assert assembly.merged_turns == 2
    assert assembly.merged_turn_share == 1.0
    seg.check()


def test_the_assembler_reports_each_merge_as_it_happens() -> None:
    assembler = Assembler()
    turns = clean_conversation()
    assert assembler.add(turns[0]) is False
    assert assembler.merged_turn_share is None
    assert assembler.add(turns[1]) is True
    assert assembler.add(turns[2]) is True
    assert assembler.merged_turn_share == 1.0
    assert assembler.assembly() == assemble_segments(turns)


def test_turns_are_assembled_in_index_order_whatever_order_they_come_in() -> None:
    turns = clean_conversation()
    assert assemble_segments([turns[2], turns[0], turns[1]]) == assemble_segments(turns)


def test_a_single_turn_has_no_merge_share() -> None:
    assembly = assemble_segments([make_turn(0, SYSTEM, ANSWER1)])
    assert assembly.merged_turn_share is None
    assert [s.turn_indices for s in assembly.segments] == [[0]]


def test_a_compacted_history_starts_a_new_segment() -> None:
    turns = clean_conversation()[:2]
    # The harness summarised the conversation: the next prompt keeps the system prompt but not
    # what followed it, so it does not extend the segment.
    summary = [500, 501, 502]
    compacted = make_turn(2, SYSTEM + summary, [330, 331])
    assembly = assemble_segments([*turns, compacted])

    assert [s.turn_indices for s in assembly.segments] == [[0, 1], [2]]
    second = assembly.segments[1]
    assert second.token_ids == SYSTEM + summary + [330, 331]
    assert second.loss_mask == [0] * len(SYSTEM + summary) + [1, 1]
    assert assembly.merged_turns == 1
    assert assembly.merged_turn_share == 0.5


def test_an_injected_reminder_in_the_middle_starts_a_new_segment() -> None:
    turns = clean_conversation()[:1]
    reminder = [600, 601]
    # A reminder spliced into the first user message: every earlier token is still there, but
    # no longer as a prefix.
    prompt = SYSTEM + USER1[:1] + reminder + USER1[1:] + ANSWER1 + TOOL1
    assembly = assemble_segments([*turns, make_turn(1, prompt, ANSWER2)])
    assert [s.turn_indices for s in assembly.segments] == [[0], [1]]
    assert assembly.segments[1].token_ids == prompt + ANSWER2
    assert assembly.merged_turn_share == 0.0


def test_a_retokenised_earlier_answer_starts_a_new_segment() -> None:
    turns = clean_conversation()[:1]
    # The same text split into different tokens when the harness sent it back.
    retokenised = [300, 9301, 9302, 304]
    prompt = SYSTEM + USER1 + retokenised + TOOL1
    assembly = assemble_segments([*turns, make_turn(1, prompt, ANSWER2)])
    assert [s.turn_indices for s in assembly.segments] == [[0], [1]]
    assert assembly.merged_turns == 0


def test_a_prompt_equal_to_the_segment_is_not_an_extension() -> None:
    # Nothing new to attach: the call continues right where the last completion stopped.
    first = make_turn(0, SYSTEM + USER1, ANSWER1)
    again = make_turn(1, SYSTEM + USER1 + ANSWER1, ANSWER2)
    assembly = assemble_segments([first, again])
    assert [s.turn_indices for s in assembly.segments] == [[0], [1]]


def test_an_interleaved_side_session_does_not_break_the_main_segment() -> None:
    main = clean_conversation()
    # A title generation between turns: its own system prompt and the first user message.
    title = make_turn(1, [700, 701, *USER1], [710, 711], versions=["v1"])
    turns = [
        main[0],
        title,
        make_turn(2, main[1].prompt_token_ids, ANSWER2, versions=["v2"]),
        make_turn(3, main[2].prompt_token_ids, ANSWER3, versions=["v2"]),
    ]
    assembly = assemble_segments(turns)

    assert [s.turn_indices for s in assembly.segments] == [[0, 2, 3], [1]]
    assert assembly.segments[0].token_ids == main[2].prompt_token_ids + ANSWER3
    assert assembly.segments[1].token_ids == [700, 701, *USER1, 710, 711]
    assert assembly.merged_turns == 2
    assert assembly.merged_turn_share == pytest.approx(2 / 3)


def test_a_turn_extends_the_longest_segment_it_matches() -> None:
    first = make_turn(0, SYSTEM + USER1, ANSWER1)
    # Not an extension of the first (no new prompt token), so a second segment that is the
    # first one plus more.
    second = make_turn(1, SYSTEM + USER1 + ANSWER1, ANSWER2)
    # Extends both; it belongs with the longer one, where nothing of its prompt is lost.
    third = make_turn(2, SYSTEM + USER1 + ANSWER1 + ANSWER2 + USER2, ANSWER3)
    assembly = assemble_segments([first, second, third])
    assert [s.turn_indices for s in assembly.segments] == [[0], [1, 2]]
    assert assembly.segments[1].loss_mask == (
        [0] * len(SYSTEM + USER1 + ANSWER1) + [1] * len(ANSWER2) + [0] * len(USER2) + [1] * len(ANSWER3)
    )


def test_routing_rows_come_from_the_turn_that_first_fed_each_token() -> None:
    turns = clean_conversation(routed=True)
    assembly = assemble_segments(turns)
    (seg,) = assembly.segments
    seg.check()

    n = len(seg.token_ids)
    assert seg.routed_experts_shape == (n - 1, LAYERS, TOP_K)
    lengths = [len(t.prompt_token_ids) + len(t.completion_token_ids) for t in turns]
    # Row i belongs to the earliest turn whose call fed token i through the model: a call over
    # L tokens has rows for positions [0, L - 1) (its last sampled token was never fed back).
    expected = []
    for position in range(n - 1):
        source = next(i for i, length in enumerate(lengths) if position < length - 1)
        expected.append(row(source, position))
    assert rows_of(seg) == expected
    # Spelled out for the second turn: it supplies the rows from the last token of the first
    # turn's sequence on.
    prior = lengths[0]
    assert rows_of(seg)[prior - 2] == row(0, prior - 2)
    assert rows_of(seg)[prior - 1] == row(1, prior - 1)


def test_a_turn_without_routing_drops_the_segments_routing() -> None:
    turns = clean_conversation(routed=True)
    unrouted = make_turn(1, turns[1].prompt_token_ids, ANSWER2)
    assembly = assemble_segments([turns[0], unrouted, turns[2]])
    (seg,) = assembly.segments
    assert seg.turn_indices == [0, 1, 2]
    assert seg.routed_experts is None
    assert seg.routed_experts_shape is None
    seg.check()


def test_a_routed_turn_after_an_unrouted_start_gives_no_routing() -> None:
    turns = clean_conversation(routed=True)
    unrouted = make_turn(0, turns[0].prompt_token_ids, ANSWER1)
    (seg,) = assemble_segments([unrouted, turns[1], turns[2]]).segments
    assert seg.routed_experts is None
    assert seg.routed_experts_shape is None


def test_routing_of_a_different_layout_drops_the_segments_routing() -> None:
    turns = clean_conversation(routed=True)
    prompt = turns[1].prompt_token_ids
    tokens = len(prompt) + len(ANSWER2)
    other = dataclasses.replace(
        turns[1],
        routed_experts=np.zeros((tokens - 1, LAYERS, TOP_K + 1), np.uint16),
    )
    other.check()
    (seg,) = assemble_segments([turns[0], other]).segments
    assert seg.routed_experts is None
    assert seg.routed_experts_shape is None


def test_separate_segments_keep_their_own_routing() -> None:
    first = make_turn(0, SYSTEM + USER1, ANSWER1, routed=True)
    compacted = make_turn(1, [*SYSTEM, 500, 501], [330], routed=True)
    a, b = assemble_segments([first, compacted]).segments
    assert rows_of(a) == [row(0, p) for p in range(len(SYSTEM + USER1 + ANSWER1) - 1)]
    assert rows_of(b) == [row(1, p) for p in range(len(SYSTEM) + 2)]


def test_a_segment_of_turns_of_both_widths_is_of_the_wider() -> None:
    """An engine that sends int32 gets each turn narrowed on its own ids: a turn that only used experts below
    256 is uint8, the next uint16. The segment holds one dtype, the wider, and every id exactly."""
    turns = clean_conversation(routed=True)
    small = turns[0].routed_experts
    assert small is not None
    narrow = dataclasses.replace(turns[0], routed_experts=routing_array(small.astype(np.int64) % 200))
    assert narrow.routed_experts is not None and narrow.routed_experts.dtype == np.uint8
    assert turns[1].routed_experts is not None and turns[1].routed_experts.dtype == np.uint16
    (seg,) = assemble_segments([narrow, turns[1]]).segments
    seg.check()
    assert seg.routed_experts is not None and seg.routed_experts.dtype == np.uint16
    prior = len(narrow.prompt_token_ids) + len(narrow.completion_token_ids)
    np.testing.assert_array_equal(seg.routed_experts[: prior - 1], narrow.routed_experts)
    np.testing.assert_array_equal(seg.routed_experts[prior - 1 :], turns[1].routed_experts[prior - 1 :])
    # A conversation of one width keeps it.
    (alone,) = assemble_segments([narrow]).segments
    assert alone.routed_experts is not None and alone.routed_experts.dtype == np.uint8


tokens = st.integers(min_value=0, max_value=151_000)


@st.composite
def extending_conversations(draw: st.DrawFn) -> list[Turn]:
    """Turns where each prompt is the previous prompt + completion + at least one new token."""
    count = draw(st.integers(min_value=1, max_value=6))
    routed = draw(st.booleans())
    prompt = draw(st.lists(tokens, min_size=1, max_size=12))
    turns = []
    for index in range(count):
        completion = draw(st.lists(tokens, min_size=0, max_size=8))
        logprobs = draw(
            st.lists(
                st.floats(min_value=-30.0, max_value=0.0, width=32),
                min_size=len(completion),
                max_size=len(completion),
            )
        )
        version = draw(st.sampled_from(["v0", "v1", "v2"]))
        turns.append(
            make_turn(index, prompt, completion, logprobs=logprobs, versions=[version], routed=routed)
        )
        prompt = [*prompt, *completion, *draw(st.lists(tokens, min_size=1, max_size=8))]
    return turns


@settings(max_examples=200, deadline=None, database=None)
@given(extending_conversations())
def test_conversations_built_by_extension_always_give_one_segment(turns: list[Turn]) -> None:
    assembly = assemble_segments(turns)

    assert len(assembly.segments) == 1
    seg = assembly.segments[0]
    last = turns[-1]
    assert seg.token_ids == last.prompt_token_ids + last.completion_token_ids
    assert sum(seg.loss_mask) == sum(len(t.completion_token_ids) for t in turns)
    # The sampled positions are exactly where each completion sits in the final sequence.
    sampled: list[int] = []
    for t in turns:
        start = len(t.prompt_token_ids)
        sampled += range(start, start + len(t.completion_token_ids))
    assert [i for i, m in enumerate(seg.loss_mask) if m] == sampled
    assert [lp for lp, m in zip(seg.behavior_logprobs, seg.loss_mask, strict=True) if m] == [
        lp for t in turns for lp in t.completion_logprobs
    ]
    assert all(lp == 0.0 for lp, m in zip(seg.behavior_logprobs, seg.loss_mask, strict=True) if not m)
    assert seg.turn_indices == [t.index for t in turns]
    assert set(seg.policy_versions) == {v for t in turns for v in t.policy_versions}
    assert len(seg.policy_versions) == len(set(seg.policy_versions))
    assert assembly.merged_turns == len(turns) - 1
    if len(turns) > 1:
        assert assembly.merged_turn_share == 1.0
    if turns[0].routed_experts is not None:
        # Every row carries the position it was recorded for: the stitching never shifts a row.
        positions = [r[0] % TURN_STRIDE // (LAYERS * TOP_K) for r in rows_of(seg)]
        assert positions == list(range(len(seg.token_ids) - 1))
    seg.check()

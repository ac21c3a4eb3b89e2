"""The trainer's data pipeline: from trial records to filtered, advantaged, packed micro-batches."""

from __future__ import annotations

import random
import re
from datetime import UTC, datetime

import numpy as np
import pytest
import torch

from legorl.api.run import TrajectoryFilter
from legorl.api.termination import INFRA_REASONS, TerminationReason
from legorl.api.trajectory import (
    Segment,
    TrajectoryError,
    TrialRecord,
    routing_array,
    trials_from_table,
    trials_to_table,
)
from legorl.trainer.data import (
    DataError,
    TrainSequence,
    filter_trials,
    group_stats,
    oldest_policy_version,
    pack_micro_batches,
    sequences_from_trials,
    trial_advantages,
)

T0 = datetime(2025, 5, 1, tzinfo=UTC)
LAYERS, TOP_K = 3, 2
R = TerminationReason


def segment(
    tokens: list[int],
    mask: list[int],
    *,
    index: int = 0,
    versions: tuple[str, ...] = ("v3",),
    routed: bool = True,
    logprobs: list[float] | None = None,
) -> Segment:
    n = len(tokens)
    if logprobs is None:
        logprobs = [-(i + 1) / 8 if m else 0.0 for i, m in enumerate(mask)]
    experts = None
    if routed:
        experts = routing_array(np.arange((n - 1) * LAYERS * TOP_K) * 7 % 64 + 3, (n - 1, LAYERS, TOP_K))
    return Segment(
        index=index,
        token_ids=tokens,
        loss_mask=mask,
        behavior_logprobs=logprobs,
        turn_indices=[index],
        policy_versions=list(versions),
        routed_experts=experts,
    )


def trial(
    name: str,
    group: str,
    reward: float | None,
    *,
    reason: TerminationReason = R.COMPLETED,
    versions: tuple[str, ...] = ("v3",),
    segments: list[Segment] | None = None,
) -> TrialRecord:
    if segments is None:
        segments = [segment([1, 2, 3, 4, 5], [0, 0, 1, 1, 0], versions=versions)]
    return TrialRecord(
        run="run",
        trial=name,
        task_id=f"task-{group}",
        group_id=group,
        split="train",
        step=4,
        harness="MiniSweAgent",
        termination_reason=reason,
        reward=reward,
        started_at=T0,
        ended_at=T0,
        segments=segments,
        policy_versions=list(versions),
        num_turns=len(segments),
    )


def drop_default() -> set[TerminationReason]:
    return set(TrajectoryFilter().drop_reasons)


# --- filtering ---------------------------------------------------------------------------------


def test_default_filter_drops_infra_and_keeps_agent_outcomes() -> None:
    assert drop_default() == set(INFRA_REASONS)
    trials = [
        trial("ok-1", "g1", 1.0),
        trial("timeout", "g1", 0.0, reason=R.AGENT_TIMEOUT),
        trial("turns", "g1", 0.0, reason=R.TURN_LIMIT),
        trial("sandbox", "g1", None, reason=R.SANDBOX_ERROR),
        trial("engine", "g2", None, reason=R.ENGINE_ERROR),
        trial("engine-2", "g2", None, reason=R.ENGINE_ERROR),
        trial("ok-2", "g2", 0.0),
        trial("err", "g2", 1.0, reason=R.AGENT_ERROR),
    ]
    result = filter_trials(trials, drop_reasons=drop_default(), current_version=3, max_staleness=None)
    assert [t.trial for t in result.kept] == ["ok-1", "timeout", "turns", "ok-2", "err"]
    assert result.dropped_by_reason == {R.SANDBOX_ERROR: 1, R.ENGINE_ERROR: 2}
    assert result.dropped_stale == 0
    assert result.zero_variance_groups == 0
    assert result.dropped == 3


def test_custom_drop_reasons() -> None:
    trials = [trial("a", "g", 1.0), trial("b", "g", 0.0, reason=R.TURN_LIMIT), trial("c", "g", 0.0)]
    result = filter_trials(trials, drop_reasons={R.TURN_LIMIT}, current_version=3, max_staleness=None)
    assert [t.trial for t in result.kept] == ["a", "c"]
    assert result.dropped_by_reason == {R.TURN_LIMIT: 1}


def test_staleness_uses_the_oldest_version_seen() -> None:
    mixed = [
        segment([1, 2, 3], [0, 1, 1], index=0, versions=("v5",)),
        segment([1, 2, 3], [0, 1, 1], index=1, versions=("v4", "v6")),
    ]
    trials = [
        trial("fresh", "g", 1.0, versions=("v6",)),
        trial("one-behind", "g", 0.0, versions=("v5",)),
        trial("mixed", "g", 0.5, versions=("v5", "v6"), segments=mixed),  # a segment saw v4
        trial("old", "g", 1.0, versions=("v3",)),
    ]
    assert oldest_policy_version(trials[2]) == 4
    result = filter_trials(trials, drop_reasons=set(), current_version=6, max_staleness=1)
    assert [t.trial for t in result.kept] == ["fresh", "one-behind"]
    assert result.dropped_stale == 2
    assert result.max_staleness_seen == 3
    loose = filter_trials(trials, drop_reasons=set(), current_version=6, max_staleness=None)
    assert len(loose.kept) == 4
    assert loose.dropped_stale == 0


def test_staleness_errors_are_clear() -> None:
    with pytest.raises(DataError, match="newer than the trainer's current v2"):
        filter_trials(
            [trial("a", "g", 1.0, versions=("v3",))], drop_reasons=set(), current_version=2, max_staleness=1
        )
    # An unreadable version (the proxy records `unknown` when /weight_info fails) cannot prove the trial is
    # fresh: dropped and counted under a staleness limit, kept without one. Never a crash: a committed batch
    # cannot be rewritten, so raising would stop the trainer on it for good.
    unknown = [trial("a", "g", 1.0, versions=("unknown",)), trial("b", "g", 0.0, versions=("v3",))]
    strict = filter_trials(
        unknown, drop_reasons=set(), current_version=3, max_staleness=1, drop_zero_variance_groups=False
    )
    assert [t.trial for t in strict.kept] == ["b"] and strict.dropped_unknown_version == 1
    loose = filter_trials(unknown, drop_reasons=set(), current_version=3, max_staleness=None)
    assert loose.dropped_unknown_version == 0
    assert [t.trial for t in loose.kept] == ["a", "b"]


def test_kept_trial_without_reward_is_dropped_counted_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    trials = [trial("a", "g", 1.0), trial("t", "g", None, reason=R.AGENT_TIMEOUT)]
    counted = filter_trials(trials, drop_reasons=drop_default(), current_version=3, max_staleness=None)
    assert counted.dropped_no_reward == 1 and [t.trial for t in counted.kept] == []  # group of one left
    assert re.search(r"agent_timeout.*filter.dropReasons", caplog.text)
    result = filter_trials(
        trials,
        drop_reasons=drop_default() | {R.AGENT_TIMEOUT},
        current_version=3,
        max_staleness=None,
        drop_zero_variance_groups=False,
    )
    assert [t.trial for t in result.kept] == ["a"]


def test_trials_without_segments_are_dropped_and_counted() -> None:
    trials = [trial("a", "g", 1.0), trial("b", "g", 0.0), trial("empty", "g", 0.0, segments=[], versions=())]
    result = filter_trials(trials, drop_reasons=set(), current_version=3, max_staleness=0)
    assert [t.trial for t in result.kept] == ["a", "b"]
    assert result.dropped_empty == 1


def test_zero_variance_groups_dropped_or_kept_and_counted() -> None:
    trials = [
        trial("a1", "a", 1.0),
        trial("a2", "a", 1.0),
        trial("b1", "b", 0.0),
        trial("b2", "b", 1.0),
        trial("c1", "c", 0.0),
        trial("c2", "c", 1.0, reason=R.ENGINE_ERROR),  # after the drop, c is a group of one
        trial("d1", "d", 0.0),
        trial("d2", "d", 0.0),
        trial("d3", "d", 0.0),
    ]
    dropped = filter_trials(trials, drop_reasons=drop_default(), current_version=3, max_staleness=None)
    assert [t.trial for t in dropped.kept] == ["b1", "b2"]
    assert dropped.zero_variance_groups == 3
    assert dropped.dropped_zero_variance == 6
    assert dropped.dropped == 7
    keep = filter_trials(
        trials,
        drop_reasons=drop_default(),
        current_version=3,
        max_staleness=None,
        drop_zero_variance_groups=False,
    )
    assert len(keep.kept) == 8
    assert keep.zero_variance_groups == 3
    assert keep.dropped_zero_variance == 0
    stats = group_stats(keep.kept)
    assert list(stats) == ["a", "b", "c", "d"]
    assert stats["b"].mean == 0.5
    assert stats["b"].std == pytest.approx(np.std([0.0, 1.0], ddof=1))
    assert [s.zero_variance for s in stats.values()] == [True, False, True, True]
    assert stats["c"].size == 1


def test_trial_advantages_follow_the_groups() -> None:
    trials = [trial("a1", "a", 1.0), trial("a2", "a", 0.0), trial("b1", "b", 0.25), trial("b2", "b", 0.75)]
    adv = trial_advantages(trials, "GroupMean")
    assert adv == pytest.approx({"a1": 0.5, "a2": -0.5, "b1": -0.25, "b2": 0.25})
    std = trial_advantages(trials, "GroupMeanStd")
    assert std["a1"] == pytest.approx(0.5 / np.std([1.0, 0.0], ddof=1), rel=1e-5)
    with pytest.raises(DataError, match="repeat"):
        trial_advantages([trials[0], trials[0]], "GroupMean")


# --- sequences ---------------------------------------------------------------------------------


def test_sequences_carry_segments_routing_and_advantage() -> None:
    two = [
        segment([10, 11, 12, 13], [0, 0, 1, 1], index=0, versions=("v2",)),
        segment([10, 11, 12, 13, 14, 15], [0, 0, 0, 0, 1, 1], index=1, versions=("v2", "v3"), routed=False),
        segment([10, 11], [0, 0], index=2),  # nothing sampled: skipped
    ]
    trials = [trial("t1", "g", 1.0, segments=two), trial("t2", "g", 0.0)]
    seqs = sequences_from_trials(trials, {"t1": 0.7, "t2": -0.7})
    assert [(s.trial_id, s.segment_index) for s in seqs] == [("t1", 0), ("t1", 1), ("t2", 0)]
    first = seqs[0]
    assert first.token_ids.dtype == torch.long
    assert first.token_ids.tolist() == [10, 11, 12, 13]
    assert first.loss_mask.tolist() == [False, False, True, True]
    assert first.behavior_logprobs.tolist() == pytest.approx([0.0, 0.0, -3 / 8, -4 / 8])
    assert first.advantage == 0.7
    assert first.group_id == "g"
    assert first.policy_versions == ("v2",)
    assert first.num_loss_tokens == 2
    assert first.routed_experts is not None
    assert first.routed_experts.shape == (3, LAYERS, TOP_K)
    # The segment's own array, as it is: no copy, no widening (ids below 256 are uint8).
    assert first.routed_experts.dtype == np.uint8
    assert first.routed_experts is two[0].routed_experts
    assert seqs[1].routed_experts is None
    assert seqs[1].policy_versions == ("v2", "v3")
    assert seqs[2].advantage == -0.7


def test_sequences_reject_contract_violations() -> None:
    with pytest.raises(DataError, match="no advantage"):
        sequences_from_trials([trial("t1", "g", 1.0)], {})
    bad_first = trial("t1", "g", 1.0, segments=[segment([1, 2, 3], [1, 0, 1])])
    with pytest.raises(DataError, match="token 0 is marked as sampled"):
        sequences_from_trials([bad_first], {"t1": 1.0})
    misaligned = Segment(
        index=0,
        token_ids=[1, 2, 3],
        loss_mask=[0, 1],
        behavior_logprobs=[0.0, -1.0, -1.0],
        turn_indices=[0],
        policy_versions=["v3"],
    )
    # A misaligned segment never reaches the trainer: reading the batch (a table) checks every segment.
    table = trials_to_table([trial("t1", "g", 1.0, segments=[misaligned])])
    with pytest.raises(TrajectoryError, match="must align"):
        trials_from_table(table)


# --- packing -----------------------------------------------------------------------------------


def make_seq(n: int, *, seed: int, advantage: float = 1.0, routed: bool = True) -> TrainSequence:
    rng = random.Random(seed)
    tokens = [rng.randrange(1, 1000) for _ in range(n)]
    mask = [0] + [int(rng.random() < 0.6) for _ in range(n - 1)]
    mask[-1] = 1
    logprobs = [-rng.random() * 3 if m else 0.0 for m in mask]
    seg = segment(tokens, mask, logprobs=logprobs, routed=routed)
    [seq] = sequences_from_trials([trial(f"t{seed}", "g", 1.0, segments=[seg])], {f"t{seed}": advantage})
    return seq


def test_shift_and_alignment_by_hand() -> None:
    seg = segment([5, 6, 7, 8, 9], [0, 0, 1, 0, 1], logprobs=[0.0, 0.0, -0.3, 0.0, -0.9])
    short = segment([20, 21, 22], [0, 1, 1], logprobs=[0.0, -0.1, -0.2], routed=False)
    seqs = sequences_from_trials(
        [trial("a", "g", 1.0, segments=[seg]), trial("b", "g", 0.0, segments=[short])], {"a": 2.0, "b": -1.0}
    )
    [mb] = pack_micro_batches(seqs, max_tokens=8)
    assert mb.shape == (2, 4)
    assert mb.input_ids.tolist() == [[5, 6, 7, 8], [20, 21, 0, 0]]
    assert mb.targets.tolist() == [[6, 7, 8, 9], [21, 22, 0, 0]]
    assert mb.lengths.tolist() == [4, 2]
    # Token i's mask and behaviour log-prob sit at position i-1: token 2 (-0.3) at 1, token 4 (-0.9) at 3.
    assert mb.loss_mask.tolist() == [[0.0, 1.0, 0.0, 1.0], [1.0, 1.0, 0.0, 0.0]]
    torch.testing.assert_close(
        mb.behavior_logprobs, torch.tensor([[0.0, -0.3, 0.0, -0.9], [-0.1, -0.2, 0.0, 0.0]])
    )
    assert mb.advantages.tolist() == [[2.0, 2.0, 2.0, 2.0], [-1.0, -1.0, 0.0, 0.0]]
    assert mb.loss_mask.dtype == torch.float32
    assert mb.input_ids.dtype == torch.long
    assert mb.seq_index.tolist() == [0, 1]
    assert mb.num_loss_tokens == 4
    assert mb.num_tokens == 8
    # Routing passes through unchanged: one row per input position of the real tokens.
    assert mb.routing[0] is seqs[0].routed_experts
    assert mb.routing[0] is not None and mb.routing[0].shape == (4, LAYERS, TOP_K)
    assert mb.routing[1] is None


def test_packing_respects_the_budget_and_keeps_every_loss_token_once() -> None:
    rng = random.Random(0)
    lengths = [rng.randrange(2, 300) for _ in range(60)]
    seqs = [make_seq(n, seed=i, advantage=float(i)) for i, n in enumerate(lengths)]
    budget = 1024
    batches = pack_micro_batches(seqs, budget)
    seen: list[int] = []
    for mb in batches:
        b, s = mb.shape
        assert b * s <= budget
        assert s == int(mb.lengths.max())
        seen.extend(mb.seq_index.tolist())
        for row, i in enumerate(mb.seq_index.tolist()):
            seq = seqs[i]
            n = seq.length - 1
            assert mb.lengths[row] == n
            assert torch.equal(mb.input_ids[row, :n], seq.token_ids[:-1])
            assert torch.equal(mb.targets[row, :n], seq.token_ids[1:])
            assert torch.equal(mb.loss_mask[row, :n].bool(), seq.loss_mask[1:])
            assert mb.loss_mask[row, n:].abs().sum() == 0
            assert mb.advantages[row, n:].abs().sum() == 0
            assert (mb.advantages[row, :n] == seq.advantage).all()
            assert torch.equal(mb.behavior_logprobs[row, :n], seq.behavior_logprobs[1:])
            assert mb.routing[row] is seq.routed_experts
        assert mb.num_loss_tokens == int(mb.loss_mask.sum())
    assert sorted(seen) == list(range(len(seqs)))
    assert sum(mb.num_loss_tokens for mb in batches) == sum(s.num_loss_tokens for s in seqs)
    real = sum(n - 1 for n in lengths)
    padded = sum(mb.num_tokens for mb in batches)
    # Longest-first keeps padding small (measured: under 10% here).
    assert padded < 1.1 * real
    # Deterministic: the same input gives the same batches.
    again = pack_micro_batches(seqs, budget)
    assert [mb.seq_index.tolist() for mb in again] == [mb.seq_index.tolist() for mb in batches]
    assert all(torch.equal(a.input_ids, b.input_ids) for a, b in zip(again, batches, strict=True))


def test_sequence_longer_than_the_budget_gets_its_own_micro_batch() -> None:
    seqs = [make_seq(10, seed=1), make_seq(50, seed=2), make_seq(12, seed=3), make_seq(9, seed=4)]
    batches = pack_micro_batches(seqs, max_tokens=20)
    assert [mb.seq_index.tolist() for mb in batches] == [[1], [2], [0, 3]]
    assert batches[0].shape == (1, 49)
    assert all(mb.num_tokens <= 20 for mb in batches[1:])
    with pytest.raises(ValueError, match="max_tokens"):
        pack_micro_batches(seqs, 0)


def test_packing_rejects_sequences_too_short_to_train() -> None:
    seq = make_seq(3, seed=0)
    one = TrainSequence(
        token_ids=seq.token_ids[:1],
        loss_mask=seq.loss_mask[:1],
        behavior_logprobs=seq.behavior_logprobs[:1],
        advantage=1.0,
        routed_experts=None,
        trial_id="x",
        group_id="g",
        segment_index=0,
        policy_versions=(),
    )
    with pytest.raises(DataError, match="needs 2"):
        pack_micro_batches([seq, one], 100)


def test_end_to_end_from_trials_to_micro_batches() -> None:
    trials = [
        trial("a1", "a", 1.0),
        trial("a2", "a", 0.0, reason=R.AGENT_ERROR),
        trial("a3", "a", None, reason=R.PROXY_ERROR),
        trial("b1", "b", 1.0),
        trial("b2", "b", 1.0),
    ]
    kept = filter_trials(trials, drop_reasons=drop_default(), current_version=3, max_staleness=None).kept
    adv = trial_advantages(kept, "GroupMeanStd")
    seqs = sequences_from_trials(kept, adv)
    [mb] = pack_micro_batches(seqs, 64)
    assert [seqs[i].trial_id for i in mb.seq_index.tolist()] == ["a1", "a2"]
    assert mb.advantages[:, 0].tolist() == pytest.approx([adv["a1"], adv["a2"]])
    assert adv["a1"] > 0 > adv["a2"]


def test_plan_rounds_give_every_data_parallel_rank_the_same_shapes() -> None:
    """Every sequence exactly once; in each round every rank's micro-batch has the same rows and width (a
    multiple of the tensor-parallel size), within the token budget; loads dealt round-robin."""
    from legorl.trainer.data import plan_rounds  # noqa: PLC0415

    lengths = [57, 3, 12, 12, 40, 9, 33, 2, 70, 18, 5, 26]
    rounds = plan_rounds(lengths, max_tokens=64, data_parallel=3, multiple_of=2)
    seen = sorted(i for r in rounds for m in r.members for i in m)
    assert seen == list(range(len(lengths)))
    for r in rounds:
        assert r.width % 2 == 0 and r.width >= max(lengths[i] - 1 for m in r.members for i in m)
        assert r.rows == max(len(m) for m in r.members) and len(r.members) == 3
        assert r.rows * r.width <= 64 or r.rows == 1  # an overlong sequence rides alone
    # Longest first: the first round holds the three longest sequences, one per rank.
    assert [m for m in rounds[0].members] == [(8,), (0,), (4,)]
    # One rank, no tensor split: exactly the classic packing.
    single = plan_rounds(lengths, max_tokens=64)
    assert all(len(r.members) == 1 for r in single)
    assert [r.members[0] for r in single][:2] == [(8,), (0,)]


def test_collate_pads_a_rank_short_of_sequences_with_empty_rows() -> None:
    from legorl.trainer.data import collate  # noqa: PLC0415

    seqs = [make_seq(5, seed=1), make_seq(4, seed=2, routed=False)]
    micro = collate(seqs, [1], rows=3, width=6)
    assert micro.shape == (3, 6)
    assert micro.seq_index.tolist() == [1, -1, -1]
    assert micro.lengths.tolist() == [3, 0, 0]
    assert micro.input_ids[0, :3].tolist() == seqs[1].token_ids[:-1].tolist()
    assert micro.targets[0, :3].tolist() == seqs[1].token_ids[1:].tolist()
    assert float(micro.loss_mask[1:].sum()) == 0.0 and float(micro.loss_mask[0].sum()) > 0
    assert micro.routing == [None, None, None]

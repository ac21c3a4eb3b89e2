"""From committed trial records to packed micro-batches: filter, advantages, sequences, packing.

The order a training step follows:

    kept = filter_trials(batch.trials, ...).kept           # reasons, staleness, empty, zero variance
    adv = trial_advantages(kept, mode)                     # GRPO group baseline per trial
    seqs = sequences_from_trials(kept, adv)                # one TrainSequence per segment
    micro = pack_micro_batches(seqs, max_tokens)           # right-padded [B, S] tensors (one rank)
    rounds = plan_rounds(lengths, max_tokens=..., data_parallel=DP, multiple_of=TP)   # every rank's

Packing for several data-parallel ranks at once: each data-parallel rank trains on its own share of the
batch, but the ranks must stay in step: with expert parallelism every MoE layer gathers tokens from all of
them (the same number of forwards, of the same shape, on every rank), with sequence parallelism the
sequence must split evenly over the tensor ranks. So the plan is made from every sequence's length alone —
the same on every rank, no communication — as *rounds*: in round k each data-parallel rank runs one
micro-batch of B_k rows × S_k positions, S_k a multiple of the tensor-parallel size. Longest sequences
first, dealt round-robin over the ranks (so their loads stay even), each round as wide as its longest row
and with at most `max_tokens` positions per rank (one overlong sequence gets a round of its own rather than
failing the run). Ranks short of sequences in a round get empty rows (length 0, nothing trained), so shapes
match without changing any result.

The shift: a sequence of n tokens t_0..t_{n-1} is fed as `input_ids` = t_0..t_{n-2} and scored
against `targets` = t_1..t_{n-1}. Position p of a micro-batch row predicts token p+1 of the
segment, so the loss mask, behaviour log-prob and advantage of token i sit at position i−1.
Token 0 is never predicted (it has no context); the routing rows of the engine (one per token
but the last) line up with `input_ids` one-to-one.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from legorl.api.store import parse_policy_version
from legorl.api.termination import TerminationReason
from legorl.api.trajectory import TrialRecord
from legorl.trainer.loss import AdvantageMode, group_advantages

__all__ = [
    "DataError",
    "FilterResult",
    "GroupStats",
    "MicroBatch",
    "Round",
    "TrainSequence",
    "collate",
    "filter_trials",
    "group_stats",
    "oldest_policy_version",
    "pack_micro_batches",
    "plan_rounds",
    "sequences_from_trials",
    "trial_advantages",
]


log = logging.getLogger(__name__)


class DataError(ValueError):
    """A batch cannot be turned into training data as it is (contract broken, settings inconsistent)."""


# --- filtering ---------------------------------------------------------------------------------


def oldest_policy_version(trial: TrialRecord) -> int | None:
    """The oldest policy version (as a step) the trial saw, over the trial and its segments."""
    names = set(trial.policy_versions)
    for seg in trial.segments:
        names.update(seg.policy_versions)
    if not names:
        return None
    try:
        return min(parse_policy_version(name) for name in names)
    except ValueError as exc:
        raise DataError(f"trial {trial.trial}: {exc}") from exc


@dataclass(frozen=True)
class GroupStats:
    """The rewards of one group's trials."""

    size: int
    mean: float
    std: float
    """Sample standard deviation (0 for a group of one)."""
    zero_variance: bool
    """All rewards equal (a group of one included): no GRPO signal."""


def group_stats(trials: Sequence[TrialRecord]) -> dict[str, GroupStats]:
    """Reward statistics per group id, in first-seen order; every trial must have a reward."""
    rewards: dict[str, list[float]] = {}
    for trial in trials:
        if trial.reward is None:
            raise DataError(f"trial {trial.trial} has no reward; group statistics need one per trial")
        rewards.setdefault(trial.group_id, []).append(trial.reward)
    stats = {}
    for group, values in rewards.items():
        mean = sum(values) / len(values)
        var = sum((v - mean) ** 2 for v in values) / (len(values) - 1) if len(values) > 1 else 0.0
        stats[group] = GroupStats(
            size=len(values), mean=mean, std=math.sqrt(var), zero_variance=len(set(values)) == 1
        )
    return stats


@dataclass
class FilterResult:
    """The trials that enter the loss and what was dropped, by cause."""

    kept: list[TrialRecord]
    """The trials that enter the loss, in their original order."""
    dropped_by_reason: dict[TerminationReason, int] = field(default_factory=dict)
    """Trials dropped for their termination reason (e.g. infra failures)."""
    dropped_stale: int = 0
    """Trials that saw a policy version older than allowed."""
    dropped_empty: int = 0
    """Trials without a segment (no model call, nothing to train on)."""
    zero_variance_groups: int = 0
    """Groups whose kept trials all had the same reward (counted whether dropped or kept)."""
    dropped_zero_variance: int = 0
    """Trials dropped because their group had zero variance."""
    zero_variance: list[TrialRecord] = field(default_factory=list)
    """The trials dropped because their group had zero variance, in their original order: fresh enough,
    scored, with segments (the trainer may still measure fidelity on them)."""
    max_staleness_seen: int = 0
    """Largest staleness among the trials that passed the reason filter."""
    dropped_no_reward: int = 0
    """Trained-on trials without a finite reward: a run-controller bug, counted and logged."""
    dropped_unknown_version: int = 0
    """Trials whose policy version could not be read (e.g. the proxy's `unknown`) under a staleness
    limit: nothing proves they are fresh enough."""

    @property
    def dropped(self) -> int:
        return (
            sum(self.dropped_by_reason.values())
            + self.dropped_stale
            + self.dropped_empty
            + self.dropped_zero_variance
            + self.dropped_no_reward
            + self.dropped_unknown_version
        )


def filter_trials(
    trials: Sequence[TrialRecord],
    *,
    drop_reasons: set[TerminationReason] | frozenset[TerminationReason],
    current_version: int,
    max_staleness: int | None,
    drop_zero_variance_groups: bool = True,
) -> FilterResult:
    """Select the trials a training step learns from (DESIGN §5), in their original order.

    In order: trials whose termination reason is in `drop_reasons` are dropped (default
    RLRun: the infra reasons; agent outcomes stay and are trained with their reward). A
    remaining trial without a finite reward is a run-controller bug (it scores every agent
    outcome; losing e.g. all timeouts would bias the batch towards successes): it is dropped,
    counted in `dropped_no_reward` and logged as an error rather than raised, because a
    committed batch cannot be rewritten and raising would stop the trainer on it for good.
    Then trials more than `max_staleness` versions behind are dropped (staleness =
    `current_version` − the oldest version the trial saw; None disables this); a trial whose
    version cannot be parsed (the proxy's `unknown`) is dropped under a limit, as
    `dropped_unknown_version`. A version newer than the trainer's is an error: the trainer's
    state is behind the fleet's. Trials without segments are dropped. Last, groups whose kept
    trials all got the same reward (including a group left with one trial) are counted and,
    with `drop_zero_variance_groups` (RLRun `filter.zeroVarianceGroups: Drop`), dropped: their
    advantages are all 0.
    """
    result = FilterResult(kept=[])
    by_reason: Counter[TerminationReason] = Counter()
    candidates: list[TrialRecord] = []
    for trial in trials:
        if trial.termination_reason in drop_reasons:
            by_reason[trial.termination_reason] += 1
            continue
        if trial.reward is None or not math.isfinite(trial.reward):
            log.error(
                "trial %s ended as %s with reward %r, and that reason is trained on: dropped; score "
                "such trials in the run controller or add %r to filter.dropReasons",
                trial.trial,
                trial.termination_reason.value,
                trial.reward,
                trial.termination_reason.value,
            )
            result.dropped_no_reward += 1
            continue
        try:
            oldest = oldest_policy_version(trial)
        except DataError:
            if max_staleness is not None:
                result.dropped_unknown_version += 1
                continue
            oldest = None
        if oldest is not None:
            staleness = current_version - oldest
            if staleness < 0:
                raise DataError(
                    f"trial {trial.trial} saw policy version v{oldest}, newer than the trainer's "
                    f"current v{current_version}: the trainer resumed from an older state than "
                    "the fleet serves"
                )
            result.max_staleness_seen = max(result.max_staleness_seen, staleness)
            if max_staleness is not None and staleness > max_staleness:
                result.dropped_stale += 1
                continue
        if not trial.segments:
            result.dropped_empty += 1
            continue
        candidates.append(trial)
    result.dropped_by_reason = dict(by_reason)

    stats = group_stats(candidates)
    flat = {group for group, s in stats.items() if s.zero_variance}
    result.zero_variance_groups = len(flat)
    if drop_zero_variance_groups:
        result.kept = [t for t in candidates if t.group_id not in flat]
        result.zero_variance = [t for t in candidates if t.group_id in flat]
        result.dropped_zero_variance = len(result.zero_variance)
    else:
        result.kept = candidates
    return result


def trial_advantages(
    trials: Sequence[TrialRecord], mode: AdvantageMode, eps: float = 1e-6
) -> dict[str, float]:
    """Each trial's group-relative advantage (see `loss.group_advantages`), by trial id."""
    if not trials:
        return {}
    ids = [t.trial for t in trials]
    if len(set(ids)) != len(ids):
        raise DataError("trial ids repeat within the batch; advantages are keyed by trial id")
    rewards = []
    for t in trials:
        if t.reward is None:
            raise DataError(f"trial {t.trial} has no reward; filter it out before computing advantages")
        rewards.append(t.reward)
    adv = group_advantages(
        torch.tensor(rewards, dtype=torch.float64), [t.group_id for t in trials], mode, eps=eps
    )
    return dict(zip(ids, adv.tolist(), strict=True))


# --- sequences ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainSequence:
    """One segment of one trial, ready for the trainer (all aligned to `token_ids`)."""

    token_ids: torch.Tensor
    """Long [n]."""
    loss_mask: torch.Tensor
    """Bool [n]: token i was sampled by the policy (never token 0)."""
    behavior_logprobs: torch.Tensor
    """Float32 [n]: the engine's log-prob of token i (0 where not sampled)."""
    advantage: float
    """The trial's advantage, shared by all of its tokens."""
    routed_experts: np.ndarray | None
    """Uint8 or uint16 (n−1, layers, top_k) in the engine's layout: row i routed token i; None without
    capture. The trajectory's own array (see legorl.api.trajectory): read-only when it came from the store."""
    trial_id: str
    group_id: str
    segment_index: int
    policy_versions: tuple[str, ...]

    @property
    def length(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())


def sequences_from_trials(
    trials: Sequence[TrialRecord], advantages: Mapping[str, float]
) -> list[TrainSequence]:
    """One TrainSequence per segment that has a trained token, in trial then segment order.

    Segments were checked against the contract where they entered this process (the store's read,
    `trials_from_table`); a segment whose first token is marked as sampled is refused here (token 0
    has no context to be predicted from). Segments without a
    sampled token are skipped: they would cost compute and add nothing to the loss.
    """
    seqs: list[TrainSequence] = []
    for trial in trials:
        if trial.trial not in advantages:
            raise DataError(f"trial {trial.trial} has no advantage; compute advantages on the kept trials")
        advantage = float(advantages[trial.trial])
        if not math.isfinite(advantage):
            raise DataError(f"trial {trial.trial} has advantage {advantage}")
        for seg in trial.segments:
            where = f"trial {trial.trial} segment {seg.index}"
            if not any(seg.loss_mask):
                continue
            if seg.loss_mask[0]:
                raise DataError(f"{where}: token 0 is marked as sampled, but nothing precedes it")
            seqs.append(
                TrainSequence(
                    token_ids=torch.tensor(seg.token_ids, dtype=torch.long),
                    loss_mask=torch.tensor(seg.loss_mask, dtype=torch.bool),
                    behavior_logprobs=torch.tensor(seg.behavior_logprobs, dtype=torch.float32),
                    advantage=advantage,
                    # The record's array as it is (uint8 or uint16, read-only when read from the
                    # store): engine_to_megatron only reads it, so no copy, no widening.
                    routed_experts=seg.routed_experts,
                    trial_id=trial.trial,
                    group_id=trial.group_id,
                    segment_index=seg.index,
                    policy_versions=tuple(seg.policy_versions),
                )
            )
    return seqs


# --- packing -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class MicroBatch:
    """Right-padded rows [B, S]; position p of a row predicts the row's token p+1.

    S is the longest row's input length; padding positions have input and target 0 and
    mask, behaviour log-prob and advantage 0.
    """

    input_ids: torch.Tensor
    """Long [B, S]: tokens[:-1] of each sequence."""
    targets: torch.Tensor
    """Long [B, S]: tokens[1:] of each sequence."""
    lengths: torch.Tensor
    """Long [B]: n−1 per row (real positions; the rest is padding)."""
    loss_mask: torch.Tensor
    """Float32 [B, S]: 1 where the target token is trained on."""
    behavior_logprobs: torch.Tensor
    """Float32 [B, S]: the engine's log-prob of each target token."""
    advantages: torch.Tensor
    """Float32 [B, S]: the row's advantage at every real position, 0 on padding."""
    seq_index: torch.Tensor
    """Long [B]: index of each row in the sequences packed (-1 on an empty row)."""
    routing: list[np.ndarray | None]
    """Per row, its sequence's routed experts (n−1, layers, top_k) unchanged (row i ↔ input position i)."""
    num_loss_tokens: int

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.input_ids.shape[0]), int(self.input_ids.shape[1])

    @property
    def num_tokens(self) -> int:
        """B·S: positions the forward pass computes, padding included."""
        batch, seq = self.shape
        return batch * seq


def pack_micro_batches(seqs: Sequence[TrainSequence], max_tokens: int) -> list[MicroBatch]:
    """Pack sequences into micro-batches of B·S ≤ `max_tokens` positions, with S the longest row: the
    one-rank plan (`plan_rounds` with one data-parallel rank), collated.

    Longest first (ties keep their input order), each micro-batch takes sequences while the
    padded size stays within budget — deterministic, and little padding since rows of a batch
    have similar lengths. A sequence longer than `max_tokens` on its own gets a micro-batch
    of its own (B = 1) rather than failing a run over one long trajectory; the model's context
    length already bounds it, and `MicroBatch.num_tokens` shows the overshoot.
    """
    for i, seq in enumerate(seqs):
        if seq.length < 2:
            raise DataError(f"sequence {i} ({seq.trial_id}) has {seq.length} token(s); it needs 2 to train")
    rounds = plan_rounds([q.length for q in seqs], max_tokens=max_tokens)
    return [collate(seqs, r.members[0], rows=r.rows, width=r.width) for r in rounds]


@dataclass(frozen=True)
class Round:
    """One micro-batch per data-parallel rank, all of shape [rows, width]."""

    width: int
    """S: input positions of every row (tokens[:-1], padded up to a multiple of the tensor-parallel size)."""
    rows: int
    """B: rows of every rank's micro-batch."""
    members: tuple[tuple[int, ...], ...]
    """members[d]: indices (into the planned sequences) of data-parallel rank d's rows; the rest pads."""


def plan_rounds(
    lengths: Sequence[int], *, max_tokens: int, data_parallel: int = 1, multiple_of: int = 1
) -> list[Round]:
    """Rounds covering every sequence once (`lengths[i]`: tokens of sequence i, each ≥ 2)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    if data_parallel < 1 or multiple_of < 1:
        raise ValueError(f"data_parallel ({data_parallel}) and multiple_of ({multiple_of}) must be ≥ 1")
    for i, n in enumerate(lengths):
        if n < 2:
            raise DataError(f"sequence {i} has {n} token(s); it needs 2 to train")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rounds: list[Round] = []
    start = 0
    while start < len(order):
        width = _round_up(lengths[order[start]] - 1, multiple_of)
        per_rank = max(1, max_tokens // width)
        take = order[start : start + per_rank * data_parallel]
        members = tuple(tuple(take[d::data_parallel]) for d in range(data_parallel))
        rounds.append(Round(width=width, rows=max(len(m) for m in members), members=members))
        start += len(take)
    return rounds


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def collate(seqs: Sequence[TrainSequence], members: Sequence[int], *, rows: int, width: int) -> MicroBatch:
    """A right-padded micro-batch [rows, width] of `seqs[i]` for i in `members` (then empty rows).

    Position p of a row predicts the row's token p+1; padding (beyond a row's length, and whole empty rows)
    has input and target 0 and mask, behaviour log-prob and advantage 0. `seq_index` is -1 on empty rows.
    """
    if len(members) > rows:
        raise ValueError(f"{len(members)} sequences do not fit {rows} rows")
    input_ids = torch.zeros(rows, width, dtype=torch.long)
    targets = torch.zeros(rows, width, dtype=torch.long)
    loss_mask = torch.zeros(rows, width, dtype=torch.float32)
    behavior = torch.zeros(rows, width, dtype=torch.float32)
    advantages = torch.zeros(rows, width, dtype=torch.float32)
    lengths = torch.zeros(rows, dtype=torch.long)
    seq_index = torch.full((rows,), -1, dtype=torch.long)
    routing: list[np.ndarray | None] = [None] * rows
    for row, i in enumerate(members):
        seq = seqs[i]
        n = seq.length - 1
        if n > width:
            raise ValueError(f"sequence {i} needs {n} positions, the micro-batch has {width}")
        lengths[row] = n
        input_ids[row, :n] = seq.token_ids[:-1]
        targets[row, :n] = seq.token_ids[1:]
        loss_mask[row, :n] = seq.loss_mask[1:].to(torch.float32)
        behavior[row, :n] = seq.behavior_logprobs[1:]
        advantages[row, :n] = seq.advantage
        seq_index[row] = i
        routing[row] = seq.routed_experts
    return MicroBatch(
        input_ids=input_ids,
        targets=targets,
        lengths=lengths,
        loss_mask=loss_mask,
        behavior_logprobs=behavior,
        advantages=advantages,
        seq_index=seq_index,
        routing=routing,
        num_loss_tokens=int(loss_mask.sum()),
    )

"""Packing a mini-batch for every data-parallel rank at once: micro-batches of one shape per round.

Each data-parallel rank trains on its own share of the batch, but the ranks must stay in step: with expert
parallelism every MoE layer gathers tokens from all of them (the same number of forwards, of the same shape,
on every rank), with sequence parallelism the sequence must split evenly over the tensor ranks. So the plan is
made from every sequence's length alone — the same on every rank, no communication — as *rounds*: in round k
each data-parallel rank runs one micro-batch of B_k rows × S_k positions, S_k a multiple of the tensor-
parallel size. Longest sequences first, dealt round-robin over the ranks (so their loads stay even), each
round as wide as its longest row and with at most `max_tokens` positions per rank (one overlong sequence gets
a round of its own rather than failing the run). Ranks short of sequences in a round get empty rows (length
0, nothing trained), so shapes match without changing any result.

With one data-parallel rank and one tensor rank this is the packing the trainer always did.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from legorl.trainer.data import DataError, MicroBatch, TrainSequence

__all__ = ["Round", "collate", "plan_rounds"]


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

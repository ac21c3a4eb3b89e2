"""Segment assembly (DESIGN §6): turns merged by exact token-prefix extension, never re-tokenized.

A turn extends a segment when its prompt starts with exactly the segment's tokens (the earlier
prompts and completions, as the engine saw and sampled them). The extension's new prompt tokens
(tool results, the next user message, the chat template's glue) get loss mask 0; the sampled
completion gets loss mask 1 and its behaviour log-probs. Anything else (a compacted or rewritten
history, an injected reminder, a retokenised earlier answer, a parallel side call such as a
title generation) starts a new segment: correct either way, merged when possible.

Pure functions over `Turn`s; the proxy calls them for `GET /trajectory`, and the run controller
can call them again on a journal it reads back.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from legorl.api.trajectory import ExpertIds, Segment, Turn

__all__ = ["Assembler", "Assembly", "assemble_segments"]


@dataclass
class _Open:
    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    turn_indices: list[int]
    versions: list[str]
    # Routing rows, one per token that went through the model (all but the last token), as the
    # turns' arrays (views, concatenated when a segment is read); None once any merged turn lacks
    # routing or brings another (layers, top_k).
    routing: list[ExpertIds] | None
    routing_row: tuple[int, int] | None


@dataclass(frozen=True)
class Assembly:
    """Segments of one trial and how well its turns merged."""

    segments: list[Segment]
    merged_turns: int
    """Turns that extended an earlier segment exactly."""
    turns: int

    @property
    def merged_turn_share(self) -> float | None:
        """Share of turns after the first that extended an earlier one; 1.0 = one clean segment
        per session. None with fewer than two turns."""
        if self.turns < 2:
            return None
        return self.merged_turns / (self.turns - 1)


def _routing_rows(turn: Turn) -> tuple[ExpertIds, tuple[int, int]] | None:
    if turn.routed_experts is None:
        return None
    _, layers, top_k = turn.routed_experts.shape
    return turn.routed_experts, (int(layers), int(top_k))


def _start(turn: Turn) -> _Open:
    routing = _routing_rows(turn)
    return _Open(
        token_ids=[*turn.prompt_token_ids, *turn.completion_token_ids],
        loss_mask=[0] * len(turn.prompt_token_ids) + [1] * len(turn.completion_token_ids),
        logprobs=[0.0] * len(turn.prompt_token_ids) + list(turn.completion_logprobs),
        turn_indices=[turn.index],
        versions=list(turn.policy_versions),
        routing=[routing[0]] if routing else None,
        routing_row=routing[1] if routing else None,
    )


def _extend(seg: _Open, turn: Turn) -> None:
    prior = len(seg.token_ids)
    new_prompt = turn.prompt_token_ids[prior:]
    seg.token_ids.extend(new_prompt)
    seg.token_ids.extend(turn.completion_token_ids)
    seg.loss_mask.extend([0] * len(new_prompt) + [1] * len(turn.completion_token_ids))
    seg.logprobs.extend([0.0] * len(new_prompt) + list(turn.completion_logprobs))
    seg.turn_indices.append(turn.index)
    seg.versions.extend(v for v in turn.policy_versions if v not in seg.versions)
    routing = _routing_rows(turn)
    if seg.routing is None or routing is None or routing[1] != seg.routing_row:
        seg.routing = None
        seg.routing_row = None
        return
    # The segment so far has rows for tokens [0, prior - 1); this turn's rows cover every token
    # of its own sequence, so the rows from `prior - 1` on are the ones the segment lacks: the
    # previous completion's last token (never fed through the model by the turn that sampled
    # it), the new prompt tokens, and this completion but its last token. Earlier rows keep the
    # routing of the call that sampled those tokens.
    seg.routing.append(routing[0][max(prior - 1, 0) :])


def _extends(seg: _Open, turn: Turn) -> bool:
    n = len(seg.token_ids)
    prompt = turn.prompt_token_ids
    # A strict extension: the prompt must be longer, else there is nothing new to attach. The
    # segment's last tokens (its latest answer) are compared first: sessions that share a long
    # system prompt differ there, so most candidates are ruled out without a full comparison.
    if (
        len(prompt) <= n
        or prompt[n - 1] != seg.token_ids[-1]
        or prompt[max(0, n - 16) : n] != seg.token_ids[-16:]
    ):
        return False
    return prompt[:n] == seg.token_ids


class Assembler:
    """Incremental assembly: `add` turns in journal order, read `assembly()` at any time."""

    def __init__(self) -> None:
        self._open: list[_Open] = []
        self._merged = 0
        self._turns = 0

    def add(self, turn: Turn) -> bool:
        """Attach one turn; True when it extended an earlier segment.

        A turn extends the longest open segment it extends exactly, so interleaved sessions (a
        sub-agent, a title call) each keep their own segment instead of breaking one another's.
        """
        self._turns += 1
        best: _Open | None = None
        for seg in self._open:
            if _extends(seg, turn) and (best is None or len(seg.token_ids) > len(best.token_ids)):
                best = seg
        if best is None:
            self._open.append(_start(turn))
            return False
        _extend(best, turn)
        self._merged += 1
        return True

    @property
    def merged_turn_share(self) -> float | None:
        return None if self._turns < 2 else self._merged / (self._turns - 1)

    def assembly(self) -> Assembly:
        segments = []
        for i, seg in enumerate(self._open):
            segment = Segment(
                index=i,
                token_ids=list(seg.token_ids),
                loss_mask=list(seg.loss_mask),
                behavior_logprobs=list(seg.logprobs),
                turn_indices=list(seg.turn_indices),
                policy_versions=list(seg.versions),
                routed_experts=_stitched(seg.routing),
            )
            segment.check()
            segments.append(segment)
        return Assembly(segments=segments, merged_turns=self._merged, turns=self._turns)


def _stitched(parts: list[ExpertIds] | None) -> ExpertIds | None:
    """One segment's routing: its turns' rows end to end. Turns of different widths (an engine that
    sent wider ints, narrowed per turn) give the wider dtype: lossless, one dtype per segment."""
    if parts is None:
        return None
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def assemble_segments(turns: list[Turn]) -> Assembly:
    """Merge turns (ordered by index) into segments by exact token-prefix extension."""
    assembler = Assembler()
    for turn in sorted(turns, key=lambda t: t.index):
        assembler.add(turn)
    return assembler.assembly()

"""Trajectory tables and run-store objects exactly as legorl wrote them at trajectory schema version 1.

Version 1 stored routed experts as `list<uint16>` and built its tables with `pa.Table.from_pylist` over
rows of Python lists (`Segment.to_row`, `TrialRecord.to_row`, `Turn.to_row` before the bump), and
`RunStore` wrote them with `pq.write_table(table, sink, compression="zstd")`. These helpers rebuild those
bytes from today's records (routing flattened back to int lists), so tests can prove that version-1 stores
still read. Plain helpers.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from legorl.api.store import RunStore
from legorl.api.trajectory import TRIAL_SCHEMA_V1, TURN_SCHEMA_V1, Segment, TrialRecord, Turn

__all__ = ["v1_parquet", "v1_trial_table", "v1_turn_table", "write_v1_batch", "write_v1_saved_trial"]


def v1_segment_row(segment: Segment) -> dict[str, Any]:
    """A segment as schema version 1's writer (`Segment.to_row` before the bump) made it: flat int lists."""
    routed = segment.routed_experts
    return {
        "index": segment.index,
        "token_ids": segment.token_ids,
        "loss_mask": segment.loss_mask,
        "behavior_logprobs": segment.behavior_logprobs,
        "routed_experts": None if routed is None else routed.reshape(-1).tolist(),
        "routed_experts_shape": None if routed is None else list(routed.shape),
        "turn_indices": segment.turn_indices,
        "policy_versions": segment.policy_versions,
    }


def v1_trial_row(trial: TrialRecord) -> dict[str, Any]:
    """A trial as schema version 1's writer (`TrialRecord.to_row` before the bump) made it."""
    return {
        "run": trial.run,
        "trial": trial.trial,
        "task_id": trial.task_id,
        "group_id": trial.group_id,
        "split": trial.split,
        "step": trial.step,
        "harness": trial.harness,
        "termination_reason": trial.termination_reason.value,
        "reward": trial.reward,
        "tamper_findings": [
            {"kind": t.kind, "path": t.path, "detail": t.detail} for t in trial.tamper_findings
        ],
        "segments": [v1_segment_row(s) for s in trial.segments],
        "policy_versions": trial.policy_versions,
        "num_turns": trial.num_turns,
        "merged_turn_share": trial.merged_turn_share,
        "stage_seconds": [{"stage": k, "seconds": v} for k, v in trial.stage_seconds.items()],
        "started_at": trial.started_at,
        "ended_at": trial.ended_at,
        "error": trial.error,
        "tool_call_turns": trial.tool_call_turns,
    }


def v1_trial_table(trials: list[TrialRecord]) -> pa.Table:
    """A trial table exactly as legorl wrote it at schema version 1 (`pa.Table.from_pylist` of its rows)."""
    return pa.Table.from_pylist([v1_trial_row(t) for t in trials], schema=TRIAL_SCHEMA_V1)


def v1_turn_table(turns: list[Turn]) -> pa.Table:
    """A turn table as schema version 1 wrote it."""
    rows = []
    for turn in turns:
        routed = turn.routed_experts
        row = {f.name: getattr(turn, f.name) for f in dataclasses.fields(turn)}
        row.update(
            api_format=turn.api_format.value,
            prompt_tokens=turn.prompt_tokens,
            completion_tokens=turn.completion_tokens,
            routed_experts=None if routed is None else routed.reshape(-1).tolist(),
            routed_experts_shape=None if routed is None else list(routed.shape),
        )
        rows.append(row)
    return pa.Table.from_pylist(rows, schema=TURN_SCHEMA_V1)


def v1_parquet(trials: list[TrialRecord]) -> bytes:
    """`trials` as the Parquet bytes version 1's `RunStore` wrote (zstd, Parquet's other defaults)."""
    sink = io.BytesIO()
    pq.write_table(v1_trial_table(trials), sink, compression="zstd")
    return sink.getvalue()


def write_v1_batch(store: RunStore, step: int, trials: list[TrialRecord], *, policy_version: str) -> None:
    """Commit `trials` as step `step` the way version 1's `RunStore.commit_batch` did."""
    data = v1_parquet(trials)
    folder = f"batches/step-{step:06d}"
    store.write_object(f"{folder}/trials.parquet", data)
    marker = {
        "format": 1,
        "step": step,
        "policy_version": policy_version,
        "num_trials": len(trials),
        "sha256": hashlib.sha256(data).hexdigest(),
        "size": len(data),
        "schema_version": 1,
        "created_at": "2026-12-01T09:39:13.531038+00:00",
        "meta": {},
    }
    store.write_object(f"{folder}/COMMIT.json", json.dumps(marker, sort_keys=True, indent=1).encode() + b"\n")


def write_v1_saved_trial(store: RunStore, record: TrialRecord) -> None:
    """Save one finished trial the way version 1's `RunStore.save_trial` did."""
    store.write_object(
        f"trials/{record.split}/step-{record.step:06d}/{record.trial}.parquet", v1_parquet([record])
    )

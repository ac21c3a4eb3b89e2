"""Routed experts from the run store to the trainer's replay input: numpy all the way, both widths, any
schema version; and the routing I/O benchmark's quick mode (benchmarks/routing_io.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from legorl.api.store import RunStore
from legorl.api.trajectory import Segment, TerminationReason, TrialRecord, routing_array
from legorl.trainer.data import pack_micro_batches, sequences_from_trials
from legorl.trainer.models.model import MoeArchitecture
from legorl.trainer.replay import engine_to_megatron
from tests.support.trajectory_v1 import write_v1_batch

REPO = Path(__file__).resolve().parents[2]
T0 = datetime(2025, 6, 1, tzinfo=UTC)
LAYERS, TOP_K = 3, 2


def architecture(experts: int) -> MoeArchitecture:
    return MoeArchitecture(
        vocab_size=100,
        hidden_size=16,
        num_layers=LAYERS,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        ffn_hidden_size=32,
        moe_ffn_hidden_size=8,
        num_experts=experts,
        top_k=TOP_K,
        norm_topk_prob=True,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        moe_layers=tuple(range(LAYERS)),
    )


def routed_trial(name: str, tokens: int, experts: int, seed: int) -> TrialRecord:
    """A completed trial of one segment whose routing picks TOP_K distinct experts of `experts` per layer."""
    rng = np.random.default_rng(seed)
    ids = np.argsort(rng.random((tokens - 1, LAYERS, experts)), axis=-1)[..., :TOP_K]
    segment = Segment(
        index=0,
        token_ids=list(range(1, tokens + 1)),
        loss_mask=[0] * (tokens // 2) + [1] * (tokens - tokens // 2),
        behavior_logprobs=[0.0] * (tokens // 2) + [-0.5] * (tokens - tokens // 2),
        turn_indices=[0],
        policy_versions=["v0"],
        routed_experts=routing_array(ids.astype(np.uint8 if experts <= 256 else np.uint16)),
    )
    return TrialRecord(
        run="run",
        trial=name,
        task_id="task",
        group_id="g",
        split="train",
        step=1,
        harness="MiniSweAgent",
        termination_reason=TerminationReason.COMPLETED,
        reward=1.0,
        started_at=T0,
        ended_at=T0 + timedelta(seconds=1),
        segments=[segment],
        policy_versions=["v0"],
        num_turns=1,
    )


@pytest.mark.parametrize(("experts", "dtype"), [(128, np.uint8), (512, np.uint16)])
@pytest.mark.parametrize("version", [2, 1])
def test_stored_routing_reaches_engine_to_megatron_unchanged(
    tmp_path: Path, experts: int, dtype: type[np.unsignedinteger[Any]], version: int
) -> None:
    """commit_batch (or a version-1 store) → read_batch → sequences_from_trials → engine_to_megatron: the
    replayed indices are exactly the engine's, and the trainer got the store's arrays (read-only views)."""
    trials = [routed_trial("t1", 9, experts, seed=1), routed_trial("t2", 6, experts, seed=2)]
    store = RunStore(tmp_path / "run")
    if version == 2:
        store.commit_batch(1, trials, policy_version="v0")
    else:
        write_v1_batch(store, 1, trials, policy_version="v0")
    read = store.read_batch(1).trials
    seqs = sequences_from_trials(read, {"t1": 1.0, "t2": -1.0})
    for seq, trial in zip(seqs, read, strict=True):
        assert seq.routed_experts is trial.segments[0].routed_experts
        assert seq.routed_experts is not None and seq.routed_experts.dtype == dtype
        if version == 2:
            assert not seq.routed_experts.flags.writeable
    (micro,) = pack_micro_batches(seqs, max_tokens=64)
    seq_len = micro.input_ids.shape[1]
    per_layer, covered = engine_to_megatron(micro.routing, seq_len, architecture(experts))
    batch = len(micro.routing)
    for row, routing in enumerate(micro.routing):
        assert routing is not None
        expected = next(t.segments[0].routed_experts for t in trials if t.trial == seqs[row].trial_id)
        assert expected is not None
        rows = routing.shape[0]
        assert covered[row, :rows].all() and not covered[row, rows:].any()
        for layer in range(LAYERS):
            got = per_layer[layer].view(seq_len, batch, TOP_K)[:rows, row]
            assert torch.equal(got, torch.from_numpy(expected[:, layer, :].astype(np.int64)))


def test_routing_benchmark_quick_mode_runs_and_reports(tmp_path: Path) -> None:
    """`benchmarks/routing_io.py --quick` builds a small batch, times every variant and writes its JSON."""
    out = tmp_path / "routing_io.json"
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "routing_io.py"),
            "--quick",
            "--rounds",
            "1",
            "--out",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["batch"]["quick"] is True
    names = {v["name"] for v in result["variants"]}
    assert names == {
        "before, 128 experts (lists, schema 1)",
        "after, 128 experts (uint8)",
        "before, 512 experts (lists, schema 1)",
        "after, 512 experts (uint16)",
    }
    for variant in result["variants"]:
        for stage in ("commit", "read_to_tensor"):
            figures = variant["seconds"][stage]
            assert 0 < figures["min"] <= figures["median"] <= figures["max"]
        assert variant["bytes_on_disk"] > 0
    assert set(result["speedup"]) == {"uint8_vs_before", "uint16_vs_before"}
    study = result["parquet_dictionary_encoding"]
    assert {(row["table"], row["use_dictionary"]) for row in study} == {
        (f"schema {v}, {e} experts", d) for v in (1, 2) for e in (128, 512) for d in (True, False)
    }
    assert all(row["bytes"] > 0 and row["write_seconds"]["min"] > 0 for row in study)
    assert len(result["machine"]["cpu_affinity"]) == 1
    assert "git_commit" in result

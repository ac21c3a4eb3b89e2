"""The run store: atomic, verified batches; published weights; trainer metrics and state."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from legorl.api.store import (
    RunStore,
    StoreError,
    parse_policy_version,
    policy_version,
)
from legorl.api.trajectory import (
    SCHEMA_VERSION,
    Segment,
    TerminationReason,
    TrialRecord,
    routing_array,
)
from legorl.api.weights import PUBLISHED_MARKER, PublishedWeights
from tests.support.trajectory_v1 import write_v1_batch, write_v1_saved_trial

T0 = datetime(2025, 6, 1, 8, 30, tzinfo=UTC)


def make_trial(name: str, *, reward: float | None = 1.0, step: int = 1) -> TrialRecord:
    seg = Segment(
        index=0,
        token_ids=[1, 2, 3, 4],
        loss_mask=[0, 0, 1, 1],
        behavior_logprobs=[0.0, 0.0, -0.5, -1.25],
        turn_indices=[0],
        policy_versions=["v0"],
        routed_experts=routing_array(np.arange(3 * 2 * 2), (3, 2, 2)),
    )
    return TrialRecord(
        run="run-a",
        trial=name,
        task_id="task-1",
        group_id="g-1",
        split="train",
        step=step,
        harness="MiniSweAgent",
        termination_reason=TerminationReason.COMPLETED
        if reward is not None
        else TerminationReason.ENGINE_ERROR,
        reward=reward,
        started_at=T0,
        ended_at=T0 + timedelta(seconds=30),
        segments=[seg],
        policy_versions=["v0"],
        num_turns=1,
        stage_seconds={"agent": 12.5},
    )


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> datetime:
        self.now += timedelta(seconds=1)
        return self.now


@pytest.fixture(params=["local", "file-url", "memory"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[RunStore]:
    if request.param == "local":
        yield RunStore(tmp_path / "run", clock=Clock())
    elif request.param == "file-url":
        yield RunStore(f"file://{tmp_path}/run/", clock=Clock())
    else:
        root = f"memory://legorl-test-{uuid.uuid4().hex}/run"
        yield RunStore(root, clock=Clock())
        memory = fsspec.filesystem("memory")
        if memory.exists(root.removeprefix("memory://")):
            memory.rm(root.removeprefix("memory://"), recursive=True)


def put_raw(store: RunStore, relative: str, data: bytes) -> None:
    """Write bytes behind the store's back (a crash, a bit flip, another writer)."""
    path = store.fs_path(relative)
    store.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    store.fs.pipe_file(path, data)


# --- versions ----------------------------------------------------------------------------------


def test_policy_versions() -> None:
    assert policy_version(0) == "v0"
    assert policy_version(12) == "v12"
    assert parse_policy_version("v0") == 0
    assert parse_policy_version("v123") == 123
    for bad in ["", "v", "V1", "v-1", "v01", "1", "step-3", "v1.0", " v1", "v1/../x"]:
        with pytest.raises(ValueError, match="v<step>"):
            parse_policy_version(bad)
    for step in [-1, True, 1.0]:
        with pytest.raises(ValueError, match="step ≥ 0"):
            policy_version(step)  # type: ignore[arg-type]


# --- batches -----------------------------------------------------------------------------------


def test_commit_and_read_batch(store: RunStore) -> None:
    assert store.committed_steps() == []
    trials = [make_trial("t1"), make_trial("t2", reward=None)]
    ref = store.commit_batch(1, trials, policy_version="v0", meta={"assembled_seconds": 1.5})
    assert ref.step == 1
    assert ref.policy_version == "v0"
    assert ref.num_trials == 2
    assert ref.created_at == (T0 + timedelta(seconds=1)).isoformat()
    assert ref.meta == {"assembled_seconds": 1.5}
    assert ref.path.endswith("batches/step-000001/trials.parquet")
    assert store.committed_steps() == [1]
    batch = store.read_batch(1)
    assert batch.ref == ref
    assert batch.trials == trials
    marker = json.loads(store.fs.cat_file(store.fs_path("batches/step-000001/COMMIT.json")))
    assert marker["sha256"] == ref.sha256
    assert marker["schema_version"] == SCHEMA_VERSION == 2
    store.commit_batch(12, [make_trial("t3", step=12)], policy_version="v11")
    store.commit_batch(3, [make_trial("t4", step=3)], policy_version="v2")
    assert store.committed_steps() == [1, 3, 12]
    _, table = store.read_batch_table(12)
    assert table.column("trial").to_pylist() == ["t3"]


def test_a_batch_without_its_commit_marker_is_invisible(store: RunStore) -> None:
    store.commit_batch(1, [make_trial("t1")], policy_version="v0")
    # A crash after the data object and before the marker of step 2:
    sink = pa.BufferOutputStream()
    pq.write_table(pa.table({"x": [1]}), sink)
    put_raw(store, "batches/step-000002/trials.parquet", sink.getvalue().to_pybytes())
    assert store.committed_steps() == [1]
    with pytest.raises(StoreError, match=r"step 2 has no committed batch.*committed steps: \[1\]"):
        store.read_batch(2)
    # The retried commit replaces the leftover and commits.
    store.commit_batch(2, [make_trial("t2", step=2)], policy_version="v1")
    assert store.committed_steps() == [1, 2]
    assert [t.trial for t in store.read_batch(2).trials] == ["t2"]


def test_corrupted_parquet_fails_the_checksum(store: RunStore) -> None:
    ref = store.commit_batch(1, [make_trial("t1")], policy_version="v0")
    data = bytearray(store.fs.cat_file(store.fs_path("batches/step-000001/trials.parquet")))
    data[len(data) // 2] ^= 0x01
    put_raw(store, "batches/step-000001/trials.parquet", bytes(data))
    with pytest.raises(StoreError, match=f"fails its checksum.*COMMIT.json says {ref.sha256}"):
        store.read_batch(1)
    put_raw(store, "batches/step-000001/trials.parquet", bytes(data[:100]))
    with pytest.raises(StoreError, match="100 bytes, expected"):
        store.read_batch(1)
    store.fs.rm(store.fs_path("batches/step-000001/trials.parquet"))
    with pytest.raises(StoreError, match=r"is committed but .* is missing"):
        store.read_batch(1)


def test_recommit_is_idempotent_only_for_identical_content(store: RunStore) -> None:
    trials = [make_trial("t1"), make_trial("t2")]
    first = store.commit_batch(4, trials, policy_version="v3", meta={"k": 1})
    again = store.commit_batch(4, [make_trial("t1"), make_trial("t2")], policy_version="v3", meta={"k": 1})
    assert again == first  # same commit, not rewritten (created_at unchanged)
    with pytest.raises(StoreError, match=r"step 4 is already committed .* with different content"):
        store.commit_batch(4, [make_trial("t1")], policy_version="v3", meta={"k": 1})
    with pytest.raises(StoreError, match="different content"):
        store.commit_batch(
            4, [make_trial("t1"), make_trial("t2", reward=0.0)], policy_version="v3", meta={"k": 1}
        )
    with pytest.raises(StoreError, match="different content"):
        store.commit_batch(4, trials, policy_version="v2", meta={"k": 1})
    with pytest.raises(StoreError, match="different content"):
        store.commit_batch(4, trials, policy_version="v3", meta={"k": 2})
    assert store.read_batch(4).trials == trials


def test_recommit_compares_rows_not_bytes(store: RunStore) -> None:
    """Another writer (another pyarrow, another compression) may encode the same rows differently."""
    trials = [make_trial("t1"), make_trial("t2")]
    ref = store.commit_batch(4, trials, policy_version="v3")
    table = pq.read_table(
        pa.BufferReader(store.fs.cat_file(store.fs_path("batches/step-000004/trials.parquet")))
    )
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="none")
    data = sink.getvalue().to_pybytes()
    put_raw(store, "batches/step-000004/trials.parquet", data)
    marker = json.loads(store.fs.cat_file(store.fs_path("batches/step-000004/COMMIT.json")))
    marker.update(sha256=hashlib.sha256(data).hexdigest(), size=len(data))
    put_raw(store, "batches/step-000004/COMMIT.json", json.dumps(marker).encode())
    again = store.commit_batch(4, trials, policy_version="v3")
    assert again.sha256 != ref.sha256
    assert again.created_at == ref.created_at


def test_schema_and_format_versions_are_checked(store: RunStore) -> None:
    store.commit_batch(1, [make_trial("t1")], policy_version="v0")
    path = "batches/step-000001/COMMIT.json"
    marker = json.loads(store.fs.cat_file(store.fs_path(path)))
    put_raw(store, path, json.dumps({**marker, "schema_version": 3}).encode())
    with pytest.raises(StoreError, match="trajectory schema version 3; this legorl reads version 2"):
        store.read_batch(1)
    put_raw(store, path, json.dumps({**marker, "format": 9}).encode())
    with pytest.raises(StoreError, match="store format 9"):
        store.read_batch(1)
    # A parquet file labelled with another schema version, with a matching checksum.
    table = pq.read_table(
        pa.BufferReader(store.fs.cat_file(store.fs_path("batches/step-000001/trials.parquet")))
    )
    meta = dict(table.schema.metadata)
    meta[b"legorl.schema_version"] = b"3"
    sink = pa.BufferOutputStream()
    pq.write_table(table.replace_schema_metadata(meta), sink)
    data = sink.getvalue().to_pybytes()
    put_raw(store, "batches/step-000001/trials.parquet", data)
    put_raw(
        store,
        path,
        json.dumps({**marker, "sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}).encode(),
    )
    with pytest.raises(StoreError, match="schema version 3; this legorl reads version 2"):
        store.read_batch(1)
    put_raw(store, path, b"{not json")
    with pytest.raises(StoreError, match="not valid JSON"):
        store.read_batch(1)


def test_batches_are_zstd_parquet_without_dictionary_encoding(store: RunStore) -> None:
    """Dictionary pages buy nothing on routing bytes and cost time (benchmarks/routing_io.py): off."""
    store.commit_batch(1, [make_trial("t1"), make_trial("t2")], policy_version="v0")
    store.save_trial(make_trial("t3"))
    for relative in ("batches/step-000001/trials.parquet", "trials/train/step-000001/t3.parquet"):
        meta = pq.ParquetFile(pa.BufferReader(store.fs.cat_file(store.fs_path(relative)))).metadata
        columns = [
            meta.row_group(g).column(c) for g in range(meta.num_row_groups) for c in range(meta.num_columns)
        ]
        assert {c.compression for c in columns} == {"ZSTD"}
        dictionary = [c.path_in_schema for c in columns if any("DICTIONARY" in e for e in c.encodings)]
        assert dictionary == [], f"{relative}: dictionary-encoded columns {dictionary}"
        paths = {c.path_in_schema for c in columns}
        assert "segments.list.element.routed_experts" in paths


def wide_trial(name: str, *, step: int = 1) -> TrialRecord:
    """A trial whose routing needs uint16 (a model with more than 256 experts)."""
    trial = make_trial(name, step=step)
    seg = dataclasses.replace(
        trial.segments[0], routed_experts=routing_array(np.arange(12) * 50 + 3, (3, 2, 2))
    )
    return dataclasses.replace(trial, segments=[seg])


def test_a_version_1_store_still_reads(store: RunStore) -> None:
    """Batches and saved trials written before the schema bump (routing as list<uint16>) read as arrays."""
    trials = [make_trial("t1"), wide_trial("t2")]
    write_v1_batch(store, 1, trials, policy_version="v0")
    marker = json.loads(store.fs.cat_file(store.fs_path("batches/step-000001/COMMIT.json")))
    assert marker["schema_version"] == 1
    batch = store.read_batch(1)
    assert batch.trials == trials
    narrow, wide = (t.segments[0].routed_experts for t in batch.trials)
    assert narrow is not None and narrow.dtype == np.uint8
    assert wide is not None and wide.dtype == np.uint16
    # A controller upgraded between its commit and recording it commits the same step again: the same
    # records are the same commit, whatever version wrote it; other records are refused.
    assert store.commit_batch(1, trials, policy_version="v0") == batch.ref
    with pytest.raises(StoreError, match="different content"):
        store.commit_batch(1, [make_trial("t1")], policy_version="v0")
    # Saved trials of both versions side by side in one step's folder.
    write_v1_saved_trial(store, make_trial("s1"))
    store.save_trial(wide_trial("s2"))
    assert store.saved_trials("train", 1) == [make_trial("s1"), wide_trial("s2")]


def test_commit_rejects_bad_input(store: RunStore) -> None:
    with pytest.raises(ValueError, match="v<step>"):
        store.commit_batch(1, [make_trial("t1")], policy_version="step-0")
    with pytest.raises(ValueError, match="step is an integer"):
        store.commit_batch(-1, [make_trial("t1")], policy_version="v0")
    broken = make_trial("t1")
    object.__setattr__(broken, "reward", None)  # completed without a reward breaks the contract
    with pytest.raises(StoreError, match="completed without a reward"):
        store.commit_batch(1, [broken], policy_version="v0")
    with pytest.raises(ValueError, match=r"JSON compliant|Out of range float"):
        store.commit_batch(1, [make_trial("t1")], policy_version="v0", meta={"x": float("nan")})
    assert store.committed_steps() == []


# --- weights -----------------------------------------------------------------------------------


def test_publish_weights(store: RunStore) -> None:
    assert store.latest_weights() is None
    assert store.published_versions() == []
    digest = "ab" * 32
    assert store.weights_path("v2").endswith("/weights/v2/")
    with pytest.raises(StoreError, match="holds no files"):
        store.record_weights("v2", 2, digest)
    for version in ["v2", "v10", "v1"]:
        store.write_object(f"weights/{version}/model.safetensors", b"weights")
    # Written but not recorded: not published.
    assert store.published_versions() == []
    assert store.read_published("v2") is None
    published = store.record_weights("v2", 2, digest)
    assert published.files == ("model.safetensors",)
    assert published.path == store.weights_path("v2")
    store.record_weights("v10", 10, "cd" * 32)
    store.record_weights("v1", 1, "ef" * 32)
    assert store.published_versions() == ["v1", "v2", "v10"]
    assert store.latest_weights() == store.weights_path("v10")
    assert store.read_published("v2") == published
    assert store.record_weights("v2", 2, digest) == published  # idempotent
    with pytest.raises(StoreError, match="already published with sha256"):
        store.record_weights("v2", 2, "00" * 32)
    with pytest.raises(StoreError, match="does not belong to step 3"):
        store.record_weights("v2", 3, digest)
    with pytest.raises(ValueError, match="64 lowercase hex"):
        store.record_weights("v1", 1, "xyz")
    with pytest.raises(ValueError, match="v<step>"):
        store.weights_path("../v1")


def test_the_weights_marker_round_trips_and_names_what_is_wrong(store: RunStore) -> None:
    store.write_object("weights/v3/model.safetensors", b"weights")
    published = store.record_weights("v3", 3, "ab" * 32, files=["model.safetensors"], num_tensors=2)
    assert (published.num_tensors, published.bytes) == (2, len(b"weights"))
    marker = json.loads(store.fs.cat_file(store.fs_path(f"weights/v3/{PUBLISHED_MARKER}")))
    assert PublishedWeights.from_json(marker) == published
    assert PublishedWeights.from_json(published.to_json(), path="elsewhere") == published
    store.write_object("weights/v4/config.json", b"{}")
    with pytest.raises(StoreError, match="lacks the weight file"):
        store.record_weights("v4", 4, "ab" * 32, files=["model.safetensors"])
    for broken, problem in [
        ({**marker, "format": 2}, "format 2 is not 1"),
        ({**marker, "files": []}, "files must be a non-empty list"),
        ({**marker, "num_tensors": -1}, "num_tensors must be an integer"),
    ]:
        store.write_object(f"weights/v3/{PUBLISHED_MARKER}", json.dumps(broken).encode())
        with pytest.raises(StoreError, match=problem):
            store.read_published("v3")


def test_local_path_only_for_local_stores(store: RunStore, tmp_path: Path) -> None:
    local = store.local_path("weights/v1/")
    if store.fs.protocol == "memory":
        assert local is None
        assert store.weights_path("v1").startswith("memory://")
    else:
        assert local == tmp_path / "run" / "weights" / "v1"
        assert store.weights_path("v1") == f"{tmp_path}/run/weights/v1/"
    # A URL the store handed out is accepted where a relative path is.
    assert store.local_path(store.weights_path("v1")) == local
    assert store.fs_path(store.url("batches/step-000001")) == store.fs_path("batches/step-000001")
    with pytest.raises(ValueError, match="stay inside the store"):
        store.local_path("../elsewhere")
    with pytest.raises(ValueError, match="stay inside the store"):
        store.fs_path("/etc/passwd")


# --- metrics and trainer state -----------------------------------------------------------------


def test_metrics_round_trip(store: RunStore) -> None:
    assert store.read_metrics() == []
    store.write_metrics(2, {"loss": 0.5, "tokens": 100, "policy_version": "v2", "pearson": float("nan")})
    store.write_metrics(1, {"loss": 0.75, "grad_norm": None})
    store.write_metrics(10, {"loss": 0.25})
    store.write_metrics(2, {"loss": 0.4, "tokens": 100, "policy_version": "v2", "pearson": 0.999})  # a retry
    assert store.read_metrics() == [
        {"step": 1, "loss": 0.75, "grad_norm": None},
        {"step": 2, "loss": 0.4, "tokens": 100, "policy_version": "v2", "pearson": 0.999},
        {"step": 10, "loss": 0.25},
    ]
    store.write_metrics(3, {"inf": float("inf")})
    assert store.read_metrics()[2] == {"step": 3, "inf": None}
    with pytest.raises(TypeError, match="metrics are numbers, strings or None"):
        store.write_metrics(4, {"bad": [1, 2]})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="carry step=5"):
        store.write_metrics(4, {"step": 5})


def test_trainer_state_round_trip(store: RunStore) -> None:
    assert store.read_trainer_state() is None
    state = {"step": 3, "policy_version": "v3", "checkpoint": "checkpoints/step-000003"}
    store.write_trainer_state(state)
    assert store.read_trainer_state() == state
    store.write_trainer_state({**state, "step": 4})
    assert store.read_trainer_state() == {**state, "step": 4}
    if store.local_path("trainer") is not None:
        # The atomic replace leaves no temporary files behind.
        assert sorted(p.name for p in Path(str(store.local_path("trainer"))).iterdir()) == ["state.json"]


def test_run_spec_round_trip(store: RunStore) -> None:
    assert store.read_run_spec() is None
    body = {"apiVersion": "legorl.dev/v1alpha1", "kind": "RLRun", "metadata": {"name": "r"}}
    store.write_run_spec(body)
    assert store.read_run_spec() == body


def test_unknown_protocol_is_a_clear_error() -> None:
    with pytest.raises(StoreError, match="pvc:// is resolved to its mount path"):
        RunStore("pvc://claim/runs/a")


def test_reader_sees_commits_made_by_another_store_object(tmp_path: Path) -> None:
    writer = RunStore(tmp_path / "run")
    reader = RunStore(f"file://{tmp_path}/run")
    assert reader.committed_steps() == []
    writer.commit_batch(1, [make_trial("t1")], policy_version="v0")
    assert reader.committed_steps() == [1]
    assert reader.read_batch(1).trials == writer.read_batch(1).trials

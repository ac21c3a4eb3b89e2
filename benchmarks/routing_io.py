"""Routing I/O: commit a production-size batch of trials, read it back as the trainer's replay input.

    python benchmarks/routing_io.py            # 64 trials, 311k tokens, 48 MoE layers, top-8; ~3 min
    python benchmarks/routing_io.py --quick    # a small batch, seconds (the test suite runs this)

Routed experts are (tokens − 1) × layers × top_k ids per segment: 119 million for this batch. Four variants,
the same batch with ids of 128 experts and of 512, measured in the same run, interleaved (their order
rotates each round), `--rounds` times (min/median/max):

- **before, N experts (lists, schema 1)**: the trajectory code as it was before routing stayed numpy
  (trajectory schema version 1), reimplemented here from it: the proxy's decode
  `.astype(uint16).reshape(-1).tolist()`, segments and records holding Python lists, `pa.Table.from_pylist`
  over `to_row()` dicts (routing `list<uint16>`), `pq.write_table(..., compression="zstd")` with Parquet's
  other defaults (dictionary encoding on), then on read `table.to_pylist()` → records →
  `np.asarray(routed, dtype=uint16).reshape(shape)` per segment. The file writes go through the same
  `RunStore.write_object` as today (tmp file, fsync, rename).
- **after, 128 experts (uint8)** and **after, 512 experts (uint16)**: the shipped code:
  `RunStore.commit_batch` (columnar table, routing as raw bytes + dtype + shape, zstd, no dictionary) and
  `RunStore.read_batch` → `trainer.data.sequences_from_trials` → every sequence's `routed_experts` (numpy,
  what `replay.engine_to_megatron` takes).

Also (`parquet_dictionary_encoding` in the results): the Parquet write of each table layout with and without
dictionary encoding, which is why the store turns it off.

Stages timed: **proxy_decode** (vLLM's base64 `.npy` of every segment's routing, in vLLM's dtype: uint8 for
≤ 256 experts, → what a turn holds), **commit** (trial records → a committed batch in a local temporary
store: table, Parquet, SHA-256, fsync'd writes, marker) and **read_to_tensor** (the committed batch →
checksum → records → `TrainSequence`s, token tensors built, routing arrays in hand). Every variant checks
that the routing it read back equals what was committed.

One core: the process pins itself to one CPU (`os.sched_setaffinity`), sets OMP_NUM_THREADS=1 before numpy
and torch load, `torch.set_num_threads(1)`, and Arrow's CPU and I/O pools to one thread each. Expert ids are
drawn uniformly without repetition per token and layer (real routing is skewed, so compresses better).
Python caches the ints below 257, so the "before" lists of 128 experts cost less than those of 512.
Results go to `benchmarks/results/routing_io.json` (`--out`)."""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"  # before numpy/torch load their thread pools

import argparse
import base64
import functools
import gc
import hashlib
import io
import itertools
import json
import math
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Final

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import numpy.typing as npt  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import torch  # noqa: E402

from legorl.api.store import RunStore  # noqa: E402
from legorl.api.trajectory import (  # noqa: E402
    TRIAL_SCHEMA_V1,
    Segment,
    TerminationReason,
    TrialRecord,
    trials_to_table,
)
from legorl.proxy.trial import decode_routed_experts  # noqa: E402
from legorl.trainer.data import sequences_from_trials  # noqa: E402

FULL = {"trials": 64, "tokens": 311_000, "layers": 48, "top_k": 8}
QUICK = {"trials": 4, "tokens": 6_000, "layers": 48, "top_k": 8}
T0 = datetime(2026, 12, 1, tzinfo=UTC)


# --- the batch ----------------------------------------------------------------------------------------


@dataclass
class Layout:
    """Token ids, masks and log-probs of every segment (shared by the variants), trial by trial."""

    tokens: list[list[list[int]]]
    masks: list[list[list[int]]]
    logprobs: list[list[list[float]]]


def make_layout(trials: int, total_tokens: int, rng: np.random.Generator) -> Layout:
    """Trials of uneven length summing to `total_tokens`, each 1–3 segments of prompt (mask 0) and
    sampled (mask 1) spans; log-probs exact in float32."""
    weights = rng.lognormal(0.0, 0.5, trials)
    lengths = np.maximum(np.floor(weights / weights.sum() * total_tokens).astype(int), 16)
    lengths[-1] += total_tokens - int(lengths.sum())
    layout = Layout([], [], [])
    for length in lengths.tolist():
        parts = int(rng.integers(1, 4))
        cuts: list[int] = []
        if parts > 1:
            cuts = np.sort(rng.choice(np.arange(8, length - 8), size=parts - 1, replace=False)).tolist()
        bounds = [0, *cuts, length]
        t_tokens, t_masks, t_logprobs = [], [], []
        for a, b in itertools.pairwise(bounds):
            n = b - a
            mask = (np.arange(n) // 97 % 2).astype(np.int8)  # alternating context / sampled spans
            mask[0], mask[-1] = 0, 1  # every segment trains: token 0 is context, the last one sampled
            t_tokens.append(rng.integers(0, 151_000, n).tolist())
            t_masks.append(mask.tolist())
            lp = np.where(mask == 1, -rng.exponential(1.0, n), 0.0).astype(np.float32)
            t_logprobs.append(lp.astype(np.float64).tolist())
        layout.tokens.append(t_tokens)
        layout.masks.append(t_masks)
        layout.logprobs.append(t_logprobs)
    return layout


def distinct_ids(rows: int, experts: int, top_k: int, rng: np.random.Generator) -> npt.NDArray[Any]:
    """`rows` × `top_k` expert ids, distinct within each row, uniform over subsets (Floyd's algorithm)."""
    out = np.empty((rows, top_k), dtype=np.int64)
    for i, j in enumerate(range(experts - top_k, experts)):
        t = rng.integers(0, j + 1, size=rows)
        seen = (out[:, :i] == t[:, None]).any(axis=1) if i else np.zeros(rows, dtype=bool)
        out[:, i] = np.where(seen, j, t)
    return out


def make_routing(
    layout: Layout, layers: int, top_k: int, experts: int, rng: np.random.Generator
) -> list[list[npt.NDArray[Any]]]:
    """Per trial, per segment: the (n − 1, layers, top_k) array vLLM would send (uint8 for ≤ 256 experts)."""
    dtype = np.uint8 if experts <= 256 else np.uint16
    return [
        [
            distinct_ids((len(ids) - 1) * layers, experts, top_k, rng)
            .astype(dtype)
            .reshape(len(ids) - 1, layers, top_k)
            for ids in trial
        ]
        for trial in layout.tokens
    ]


def npy_base64(array: npt.NDArray[Any]) -> str:
    """What vLLM sends (vllm.utils.serial_utils.numpy2base64)."""
    with io.BytesIO() as buffer:
        np.save(buffer, array, allow_pickle=False)
        return base64.b64encode(buffer.getbuffer()).decode("ascii")


# --- before: the trajectory code of schema version 1, reimplemented ----------------------------------------


def old_decode(encoded: str) -> tuple[list[int], tuple[int, int, int]]:
    """`decode_routed_experts` as it was: the array as a flat list of Python ints."""
    array = np.load(io.BytesIO(base64.b64decode(encoded, validate=True)), allow_pickle=False)
    if array.ndim != 3 or array.dtype.kind not in "iu":
        raise ValueError(
            f"routed_experts must be an integer array of 3 dimensions, got {array.dtype}{array.shape}"
        )
    if array.size and (array.min() < 0 or array.max() > 65535):
        raise ValueError("routed_experts holds expert ids outside [0, 65535]")
    rows, layers, top_k = (int(d) for d in array.shape)
    return array.astype(np.uint16).reshape(-1).tolist(), (rows, layers, top_k)


@dataclass(frozen=True)
class OldSegment:
    """`Segment` as it was: routing a flat list of ints plus its shape."""

    index: int
    token_ids: list[int]
    loss_mask: list[int]
    behavior_logprobs: list[float]
    turn_indices: list[int]
    policy_versions: list[str]
    routed_experts: list[int] | None = None
    routed_experts_shape: tuple[int, int, int] | None = None

    def check(self) -> None:
        n = len(self.token_ids)
        if len(self.loss_mask) != n or len(self.behavior_logprobs) != n:
            raise ValueError("misaligned")
        if any(m not in (0, 1) for m in self.loss_mask):
            raise ValueError("loss_mask holds values other than 0/1")
        if not self.turn_indices:
            raise ValueError("built from no turns")
        if (self.routed_experts is None) != (self.routed_experts_shape is None):
            raise ValueError("routed_experts and routed_experts_shape go together")
        if self.routed_experts is not None and self.routed_experts_shape is not None:
            if self.routed_experts_shape[0] != max(n - 1, 0):
                raise ValueError("rows")
            if len(self.routed_experts) != math.prod(self.routed_experts_shape):
                raise ValueError("entries")

    def to_row(self) -> dict[str, Any]:
        row = {f.name: getattr(self, f.name) for f in fields(self)}
        row["routed_experts_shape"] = list(self.routed_experts_shape) if self.routed_experts_shape else None
        return row

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> OldSegment:
        data = {f.name: row[f.name] for f in fields(cls)}
        shape = row["routed_experts_shape"]
        data["routed_experts_shape"] = tuple(shape) if shape is not None else None
        return cls(**data)


@dataclass(frozen=True)
class OldTrial:
    """The parts of `TrialRecord` as it was that carry segments (the rest: the same small columns)."""

    record: TrialRecord
    segments: list[OldSegment] = field(default_factory=list)

    def to_row(self) -> dict[str, Any]:
        r = self.record
        return {
            "run": r.run,
            "trial": r.trial,
            "task_id": r.task_id,
            "group_id": r.group_id,
            "split": r.split,
            "step": r.step,
            "harness": r.harness,
            "termination_reason": r.termination_reason.value,
            "reward": r.reward,
            "tamper_findings": [],
            "segments": [s.to_row() for s in self.segments],
            "policy_versions": r.policy_versions,
            "num_turns": r.num_turns,
            "merged_turn_share": r.merged_turn_share,
            "stage_seconds": [{"stage": k, "seconds": v} for k, v in r.stage_seconds.items()],
            "started_at": r.started_at,
            "ended_at": r.ended_at,
            "error": r.error,
            "tool_call_turns": r.tool_call_turns,
        }


def old_commit(store: RunStore, step: int, trials: list[OldTrial]) -> int:
    """`RunStore.commit_batch` as it was; returns the bytes written."""
    for trial in trials:
        for seg in trial.segments:
            seg.check()
    table = pa.Table.from_pylist([t.to_row() for t in trials], schema=TRIAL_SCHEMA_V1)
    sink = io.BytesIO()
    pq.write_table(table, sink, compression="zstd")
    data = sink.getvalue()
    digest = hashlib.sha256(data).hexdigest()
    folder = f"batches/step-{step:06d}"
    store.write_object(f"{folder}/trials.parquet", data)
    marker = {"format": 1, "step": step, "num_trials": table.num_rows, "sha256": digest, "schema_version": 1}
    store.write_object(f"{folder}/COMMIT.json", json.dumps(marker).encode())
    return len(data)


def old_read_to_tensor(store: RunStore, step: int) -> list[npt.NDArray[Any]]:
    """`RunStore.read_batch` + `sequences_from_trials` as they were: rows as Python objects, routing
    rebuilt from lists."""
    folder = f"batches/step-{step:06d}"
    marker = json.loads(store.fs.cat_file(store.fs_path(f"{folder}/COMMIT.json")))
    data = store.fs.cat_file(store.fs_path(f"{folder}/trials.parquet"))
    if hashlib.sha256(data).hexdigest() != marker["sha256"]:
        raise RuntimeError("checksum")
    table = pq.read_table(pa.BufferReader(data))
    rows = table.to_pylist()
    routing = []
    for row in rows:
        for seg in (OldSegment.from_row(s) for s in row["segments"]):
            seg.check()
            if not any(seg.loss_mask) or seg.loss_mask[0]:
                raise RuntimeError("the batch has an untrainable segment")
            assert seg.routed_experts is not None and seg.routed_experts_shape is not None
            routing.append(np.asarray(seg.routed_experts, dtype=np.uint16).reshape(seg.routed_experts_shape))
            torch.tensor(seg.token_ids, dtype=torch.long)
            torch.tensor(seg.loss_mask, dtype=torch.bool)
            torch.tensor(seg.behavior_logprobs, dtype=torch.float32)
    return routing


# --- after: the shipped code -------------------------------------------------------------------------------


def records(layout: Layout, routing: list[list[Any]], segment: Callable[..., Any]) -> list[Any]:
    out = []
    for t, (tokens, masks, logprobs, routed) in enumerate(
        zip(layout.tokens, layout.masks, layout.logprobs, routing, strict=True)
    ):
        segments = [
            segment(index=i, token_ids=ids, loss_mask=m, behavior_logprobs=lp, routed=r)
            for i, (ids, m, lp, r) in enumerate(zip(tokens, masks, logprobs, routed, strict=True))
        ]
        out.append((t, segments))
    return out


def trial_record(t: int, segments: list[Segment]) -> TrialRecord:
    return TrialRecord(
        run="bench",
        trial=f"trial-{t:03d}",
        task_id=f"task-{t // 8}",
        group_id=f"group-{t // 8}",
        split="train",
        step=1,
        harness="ClaudeCode",
        termination_reason=TerminationReason.COMPLETED,
        reward=float(t % 2),
        started_at=T0,
        ended_at=T0 + timedelta(minutes=5),
        segments=segments,
        policy_versions=["v0"],
        num_turns=len(segments) * 10,
        merged_turn_share=0.9,
        stage_seconds={"agent": 300.0, "verify": 20.0},
        tool_call_turns=8,
    )


def new_records(layout: Layout, routing: list[list[npt.NDArray[Any]]]) -> list[TrialRecord]:
    def segment(
        index: int, token_ids: list[int], loss_mask: list[int], behavior_logprobs: list[float], routed: Any
    ) -> Segment:
        return Segment(index, token_ids, loss_mask, behavior_logprobs, [index], ["v0"], routed_experts=routed)

    return [trial_record(t, segs) for t, segs in records(layout, routing, segment)]


def old_records(
    layout: Layout, routing: list[list[tuple[list[int], tuple[int, int, int]]]]
) -> list[OldTrial]:
    def segment(
        index: int, token_ids: list[int], loss_mask: list[int], behavior_logprobs: list[float], routed: Any
    ) -> OldSegment:
        return OldSegment(
            index, token_ids, loss_mask, behavior_logprobs, [index], ["v0"], routed[0], routed[1]
        )

    return [OldTrial(trial_record(t, []), segs) for t, segs in records(layout, routing, segment)]


def new_read_to_tensor(store: RunStore, step: int) -> list[npt.NDArray[Any]]:
    trials = store.read_batch(step).trials
    seqs = sequences_from_trials(trials, {t.trial: 1.0 for t in trials})
    routing = [s.routed_experts for s in seqs]
    if any(r is None for r in routing):
        raise RuntimeError("a sequence lost its routing")
    return [r for r in routing if r is not None]


# --- the run -----------------------------------------------------------------------------------------------


def _stats(samples: list[float]) -> dict[str, Any]:
    return {
        "min": round(min(samples), 4),
        "median": round(statistics.median(samples), 4),
        "max": round(max(samples), 4),
        "samples": [round(s, 4) for s in samples],
    }


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    gc.collect()
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def _git() -> dict[str, Any]:
    def run(*args: str) -> str:
        done = subprocess.run(  # noqa: S603 - fixed argv, no shell
            ["git", *args],  # noqa: S607 - git from PATH, as a developer runs it
            cwd=REPO,
            capture_output=True,
            text=True,
            check=False,
        )
        return done.stdout.strip()

    return {"git_commit": run("rev-parse", "HEAD") or None, "git_dirty": bool(run("status", "--porcelain"))}


def _machine(cpu: int) -> dict[str, Any]:
    model = ""
    try:
        model = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    except (OSError, StopIteration):
        model = platform.processor()
    return {
        "cpu_model": model,
        "cpus_online": os.cpu_count(),
        "cpu_affinity": [cpu],
        "threads": {
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
            "torch": torch.get_num_threads(),
            "arrow_cpu": pa.cpu_count(),
            "arrow_io": pa.io_thread_count(),
        },
        "python": platform.python_version(),
        "numpy": np.__version__,
        "pyarrow": pa.__version__,
        "torch": torch.__version__,
        "platform": platform.platform(),
    }


VARIANTS: Final = (
    "before, 128 experts (lists, schema 1)",
    "after, 128 experts (uint8)",
    "before, 512 experts (lists, schema 1)",
    "after, 512 experts (uint16)",
)
EXPERTS: Final = {v: int(v.split()[1]) for v in VARIANTS}
COMPARED: Final = {
    "uint8_vs_before": (VARIANTS[0], VARIANTS[1]),
    "uint16_vs_before": (VARIANTS[2], VARIANTS[3]),
}
"""Speed-ups reported: before / after, medians, same expert count."""


@dataclass
class Batch:
    layout: Layout
    routing: dict[int, list[list[npt.NDArray[Any]]]]
    """By expert count: per trial, per segment, the engine's array."""
    encoded: dict[int, list[list[str]]]
    """The same as vLLM sends it (base64 `.npy`)."""


def run_variant(variant: str, batch: Batch, store: RunStore) -> tuple[dict[str, float], int]:
    """One measurement of each stage of `variant`; checks that the routing read back is what was committed."""
    e = EXPERTS[variant]
    seconds: dict[str, float] = {}
    arrays: list[npt.NDArray[Any]]
    if variant.startswith("before"):
        seconds["proxy_decode"], decoded = _timed(
            lambda: [[old_decode(x) for x in t] for t in batch.encoded[e]]
        )
        old = old_records(batch.layout, decoded)
        del decoded
        seconds["commit"], size = _timed(lambda: old_commit(store, 1, old))
        del old
        seconds["read_to_tensor"], arrays = _timed(lambda: old_read_to_tensor(store, 1))
    else:
        seconds["proxy_decode"], decoded = _timed(
            lambda: [[decode_routed_experts(x) for x in t] for t in batch.encoded[e]]
        )
        new = new_records(batch.layout, decoded)
        del decoded
        seconds["commit"], ref = _timed(lambda: store.commit_batch(1, new, policy_version="v0"))
        del new
        size = ref.size
        seconds["read_to_tensor"], arrays = _timed(lambda: new_read_to_tensor(store, 1))
    want = [r for trial in batch.routing[e] for r in trial]
    if len(arrays) != len(want) or not all(np.array_equal(a, b) for a, b in zip(arrays, want, strict=True)):
        raise RuntimeError(f"{variant}: the routing read back differs from what was committed")
    return seconds, size


def dictionary_study(batch: Batch, rounds: int) -> list[dict[str, Any]]:
    """What Parquet's dictionary encoding costs and saves on each table layout (the write alone, min of
    `rounds`): why `RunStore` turns it off."""
    tables: dict[str, pa.Table] = {}
    for e in (128, 512):
        tables[f"schema 2, {e} experts"] = trials_to_table(new_records(batch.layout, batch.routing[e]))
        decoded = [[old_decode(x) for x in t] for t in batch.encoded[e]]
        old = old_records(batch.layout, decoded)
        del decoded
        tables[f"schema 1, {e} experts"] = pa.Table.from_pylist(
            [t.to_row() for t in old], schema=TRIAL_SCHEMA_V1
        )
        del old

    def write(table: pa.Table, dictionary: bool) -> int:
        sink = io.BytesIO()
        pq.write_table(table, sink, compression="zstd", use_dictionary=dictionary)
        return len(sink.getvalue())

    out = []
    for name, table in tables.items():
        for dictionary in (True, False):
            runs = [_timed(functools.partial(write, table, dictionary)) for _ in range(rounds)]
            samples, size = [seconds for seconds, _ in runs], int(runs[-1][1])
            out.append(
                {"table": name, "use_dictionary": dictionary, "write_seconds": _stats(samples), "bytes": size}
            )
            figures = f"{min(samples):.3f} s, {size / 1e6:.1f} MB"
            print(f"parquet write, {name}, use_dictionary={dictionary}: {figures}", file=sys.stderr)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"a small batch ({QUICK}) for a smoke test")
    parser.add_argument(
        "--rounds", type=int, default=3, help="interleaved repeats of every variant (default 3)"
    )
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "routing_io.json")
    parser.add_argument(
        "--cpu", type=int, default=None, help="the core to pin to (default: the first allowed)"
    )
    parser.add_argument(
        "--tmp", type=Path, default=None, help="where the temporary stores go (default: $TMPDIR)"
    )
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be ≥ 1")

    cpu = args.cpu if args.cpu is not None else min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpu})
    torch.set_num_threads(1)
    pa.set_cpu_count(1)
    pa.set_io_thread_count(1)

    shape = QUICK if args.quick else FULL
    rng = np.random.default_rng(20261201)
    started = time.perf_counter()
    layout = make_layout(shape["trials"], shape["tokens"], rng)
    routing = {e: make_routing(layout, shape["layers"], shape["top_k"], e, rng) for e in (128, 512)}
    batch = Batch(layout, routing, {e: [[npy_base64(r) for r in t] for t in routing[e]] for e in routing})
    segments = sum(len(t) for t in layout.tokens)
    ids = sum(r.size for trial in routing[128] for r in trial)
    print(
        f"batch: {shape['trials']} trials, {segments} segments, {shape['tokens']:,} tokens, {ids:,} ids "
        f"per variant (built in {time.perf_counter() - started:.1f} s); pinned to CPU {cpu}",
        file=sys.stderr,
    )

    times: dict[str, dict[str, list[float]]] = {v: {} for v in VARIANTS}
    sizes: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="routing-io-", dir=args.tmp) as tmp:
        for round_ in range(args.rounds):
            turn = round_ % len(VARIANTS)
            for variant in VARIANTS[turn:] + VARIANTS[:turn]:
                root = Path(tmp) / f"round-{round_}-{VARIANTS.index(variant)}"
                seconds, sizes[variant] = run_variant(variant, batch, RunStore(root))
                shutil.rmtree(root)
                for stage, value in seconds.items():
                    times[variant].setdefault(stage, []).append(value)
                figures = "  ".join(f"{stage} {value:7.3f} s" for stage, value in seconds.items())
                where = f"round {round_ + 1}/{args.rounds} {variant:38s}"
                print(f"{where} {figures}  {sizes[variant] / 1e6:7.1f} MB", file=sys.stderr)

    result: dict[str, Any] = {
        "benchmark": "routing_io",
        "command": "python benchmarks/routing_io.py"
        + (" --quick" if args.quick else "")
        + f" --rounds {args.rounds}",
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
        **_git(),
        "machine": _machine(cpu),
        "batch": {
            "quick": args.quick,
            **shape,
            "segments": segments,
            "routed_ids": ids,
            "ids": "uniform, distinct per (token, layer); vLLM's dtype on the wire (uint8 for ≤ 256 experts)",
        },
        "rounds": args.rounds,
        "variants": [
            {
                "name": v,
                "experts": EXPERTS[v],
                "routing": "list<uint16> (Python ints)" if v.startswith("before") else "numpy, raw bytes",
                "seconds": {stage: _stats(samples) for stage, samples in times[v].items()},
                "bytes_on_disk": sizes[v],
            }
            for v in VARIANTS
        ],
    }
    result["speedup"] = {
        name: {
            stage: round(statistics.median(times[old][stage]) / statistics.median(times[new][stage]), 1)
            for stage in times[old]
        }
        for name, (old, new) in COMPARED.items()
    }
    result["parquet_dictionary_encoding"] = dictionary_study(batch, args.rounds)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    for v in result["variants"]:
        medians = "  ".join(f"{stage} {f['median']:.3f} s" for stage, f in v["seconds"].items())
        print(f"{v['name']:38s} median {medians}  {v['bytes_on_disk'] / 1e6:.1f} MB on disk")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

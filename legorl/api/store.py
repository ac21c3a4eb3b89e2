"""The run store: committed trial batches, published weights, trainer metrics and state under one fsspec URI.

Shared by the run controller (writes batches), the trainer (reads batches, publishes
weights, writes metrics and its resume pointer) and the UI (reads everything). Layout
under the store's root:

    batches/step-000007/trials.parquet    trial records of step 7 (TRIAL_SCHEMA)
    batches/step-000007/COMMIT.json       written last: the batch exists once this does
    weights/v7/...                        the policy's weights after step 7 (safetensors)
    weights/v7/PUBLISHED.json             written last: the version exists once this does
                                          (legorl.api.weights.PublishedWeights)
    metrics/trainer/step-000007.json      the trainer's figures of step 7
    metrics/tokens/step-000007.parquet    its training log-prob of every trained token (trial, segment)
    trainer/state.json                    what a restarted trainer resumes from
    trials/train/step-000007/<trial>.parquet   each finished trial, saved as it ends (the
                                          controller's journal: a restart re-runs none of them)
    trials/validation/step-000005/<trial>.parquet   held-out trials evaluating policy v5
    evals/step-000005.json                held-out solve rate of policy v5, with its interval
    controller/state.json                 the run controller's progress (for status and the UI)
    run.json                              the RLRun the store belongs to
    validation/latest.json                the last canary's report (`legorl run --canary`, the operator)
    validation/score/<id>.parquet         a canary's trial, for the running trainer to score
    validation/score/<id>.json            the trainer's answer: its fidelity figures on that trial

Object stores have no rename, so every commit is "data objects first, then one small JSON
marker": a single PUT is atomic, and readers only look at what a marker names. On a local
directory every JSON object is written to a temporary file, fsync'd and renamed into
place, so a crash never leaves a half-written marker. The store assumes one writer per
kind of object (one run controller, one trainer); readers may be many.

Policy versions are named `v<step>`: `v0` is the initial checkpoint, `vN` the weights after
training step N (`policy_version`, `parse_policy_version`).
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import posixpath
import re
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.implementations.local import LocalFileSystem

from legorl.api.figures import (
    EvalSummary,
    ScoringAnswer,
    StepFigures,
    TrainerState,
    ValidationReport,
)
from legorl.api.trajectory import (
    READABLE_SCHEMA_VERSIONS,
    SCHEMA_VERSION,
    TRIAL_SCHEMA,
    SchemaVersionError,
    TrajectoryError,
    TrialRecord,
    check_schema,
    trials_from_table,
    trials_to_table,
)
from legorl.api.weights import PUBLISHED_MARKER, PublishedWeights

__all__ = [
    "STORE_FORMAT",
    "Batch",
    "BatchRef",
    "PublishedWeights",
    "RunStore",
    "StoreError",
    "parse_policy_version",
    "policy_version",
]

STORE_FORMAT: Final = 1
"""Version of the layout and of the marker files; readers refuse markers of another version."""

MetricValue = float | int | str | None

_VERSION_RE: Final = re.compile(r"v(0|[1-9][0-9]*)")
_STEP_DIR_RE: Final = re.compile(r"step-([0-9]{6,})")
_TRIAL_RE: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class StoreError(RuntimeError):
    """The run store holds something other than what was asked for (missing, corrupt, conflicting)."""


def policy_version(step: int) -> str:
    """The policy version after training step `step`: `v0` is the initial checkpoint."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"a policy version needs a step ≥ 0, got {step!r}")
    return f"v{step}"


INITIAL_VERSION_ALIASES: Final = frozenset({"default"})
"""What an engine reports before its first weight update: vLLM names its startup weights `default`.
They are the run's initial policy, v0."""


def parse_policy_version(version: str) -> int:
    """The step of a policy version string (`"v7"` → 7, vLLM's startup `"default"` → 0); ValueError
    for anything else."""
    if version in INITIAL_VERSION_ALIASES:
        return 0
    match = _VERSION_RE.fullmatch(version) if isinstance(version, str) else None
    if match is None:
        raise ValueError(
            f"policy version {version!r} is not of the form v<step> (v0, v1, ...); versions are "
            "made by legorl.api.store.policy_version(step)"
        )
    return int(match.group(1))


def _step_dir(step: int) -> str:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"a step is an integer ≥ 0, got {step!r}")
    return f"step-{step:06d}"


class StoreLayout:
    """Every path in a run store, relative to its root (the module's docstring draws the tree): the one
    place a path is spelled. The run store's methods, the UI's reader and the diagnostics build theirs
    from it."""

    RUN: Final = "run.json"
    CONTROLLER_STATE: Final = "controller/state.json"
    TRAINER_STATE: Final = "trainer/state.json"
    VALIDATION: Final = "validation/latest.json"
    BATCHES: Final = "batches"
    WEIGHTS: Final = "weights"
    STEP_FIGURES: Final = "metrics/trainer"
    TOKEN_LOGPROBS: Final = "metrics/tokens"  # noqa: S105 - a folder, not a secret
    TRIALS: Final = "trials"
    EVALS: Final = "evals"
    SCORING: Final = "validation/score"
    BATCH_MARKER: Final = "COMMIT.json"
    BATCH_TRIALS: Final = "trials.parquet"
    STEP_GLOB: Final = "step-*"

    @staticmethod
    def batch(step: int) -> str:
        """The folder of step `step`'s committed batch."""
        return f"{StoreLayout.BATCHES}/{_step_dir(step)}"

    @staticmethod
    def batch_marker(step: int) -> str:
        return f"{StoreLayout.batch(step)}/{StoreLayout.BATCH_MARKER}"

    @staticmethod
    def batch_trials(step: int) -> str:
        return f"{StoreLayout.batch(step)}/{StoreLayout.BATCH_TRIALS}"

    @staticmethod
    def weights(version: str) -> str:
        """The folder of policy version `version`'s weights."""
        return f"{StoreLayout.WEIGHTS}/{version}"

    @staticmethod
    def weights_marker(version: str) -> str:
        return f"{StoreLayout.weights(version)}/{PUBLISHED_MARKER}"

    @staticmethod
    def step_figures(step: int) -> str:
        return f"{StoreLayout.STEP_FIGURES}/{_step_dir(step)}.json"

    @staticmethod
    def token_logprobs(step: int) -> str:
        return f"{StoreLayout.TOKEN_LOGPROBS}/{_step_dir(step)}.parquet"

    @staticmethod
    def trials(split: str, step: int | None = None) -> str:
        """The folder of a split's saved trials, or of one step's."""
        folder = f"{StoreLayout.TRIALS}/{split}"
        return folder if step is None else f"{folder}/{_step_dir(step)}"

    @staticmethod
    def saved_trial(split: str, step: int, trial: str) -> str:
        return f"{StoreLayout.trials(split, step)}/{trial}.parquet"

    @staticmethod
    def eval_summary(step: int) -> str:
        return f"{StoreLayout.EVALS}/{_step_dir(step)}.json"

    @staticmethod
    def scoring_request(request: str) -> str:
        return f"{StoreLayout.SCORING}/{request}.parquet"

    @staticmethod
    def scoring_answer(request: str) -> str:
        return f"{StoreLayout.SCORING}/{request}.json"


def _now() -> datetime:
    return datetime.now(UTC)


def _json_bytes(obj: Any) -> bytes:
    # allow_nan=False: NaN/Infinity are not JSON and would break every non-Python reader.
    return json.dumps(obj, sort_keys=True, indent=1, allow_nan=False).encode() + b"\n"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _parquet_bytes(table: pa.Table) -> bytes:
    """A trial table as Parquet: zstd, no dictionary encoding.

    Routing is a few large binary values per table, where Parquet's default dictionary pages buy
    nothing: on a production batch (benchmarks/routing_io.py, 119M routed ids) the write took 0.43 s
    with them and 0.37 s without, for the same size (106.5 vs 105.9 MB). zstd does the compressing.
    """
    sink = io.BytesIO()
    pq.write_table(table, sink, compression="zstd", use_dictionary=False)
    return sink.getvalue()


@dataclass(frozen=True)
class BatchRef:
    """A committed batch, as its COMMIT.json describes it."""

    step: int
    policy_version: str
    """The policy version the trainer trains from when it consumes this batch."""
    num_trials: int
    sha256: str
    """SHA-256 of `trials.parquet`."""
    size: int
    """Bytes of `trials.parquet`."""
    created_at: str
    """RFC 3339 time of the commit."""
    meta: dict[str, Any]
    """Free-form JSON the run controller attached (timings, counts)."""
    path: str
    """URL of `trials.parquet`."""


@dataclass(frozen=True)
class Batch:
    """A committed batch read back: its commit marker and its trial records."""

    ref: BatchRef
    trials: list[TrialRecord]


class RunStore:
    """One run's store at an fsspec URI: a local directory, `file://`, `memory://`, `s3://`, `gs://`..."""

    def __init__(
        self,
        uri: str | os.PathLike[str],
        *,
        storage_options: Mapping[str, Any] | None = None,
        clock: Callable[[], datetime] = _now,
    ) -> None:
        text = os.fspath(uri)
        if not text:
            raise ValueError("a run store needs a URI (a local directory, file://, s3://, memory://...)")
        try:
            fs, root = fsspec.core.url_to_fs(text, **dict(storage_options or {}))
        except (ValueError, ImportError) as exc:
            raise StoreError(
                f"cannot open run store {text!r}: {exc}. Use a local directory or an fsspec URL "
                "whose filesystem is installed (s3:// needs s3fs, gs:// needs gcsfs; pvc:// is "
                "resolved to its mount path by the operator)"
            ) from exc
        self.uri = text
        self.fs: fsspec.AbstractFileSystem = fs
        self._root = root.rstrip("/")
        self._local = isinstance(fs, LocalFileSystem)
        self._clock = clock

    def __repr__(self) -> str:
        return f"RunStore({self.uri!r})"

    # --- paths -------------------------------------------------------------------------------
    def _relative(self, path: str) -> str:
        # A path or URL this store handed out (e.g. `weights_path`) is accepted as well.
        for prefix in (self._root, self.fs.unstrip_protocol(self._root)):
            if prefix and (path == prefix or path.startswith(prefix.rstrip("/") + "/")):
                return path[len(prefix) :].lstrip("/")
        return path

    def fs_path(self, relative: str) -> str:
        """The filesystem path (for `self.fs`) of a path relative to the store's root.

        Paths and URLs inside the store (as `url` and `weights_path` return them) are accepted
        too; anything leading outside the store raises ValueError."""
        relative = self._relative(relative)
        parts = [p for p in relative.split("/") if p]
        if relative.startswith("/") or any(p in (".", "..") for p in parts):
            raise ValueError(f"store paths are relative and stay inside the store, got {relative!r}")
        joined = "/".join(parts)
        if not joined:
            return self._root or "/"
        return f"{self._root}/{joined}"

    def url(self, relative: str) -> str:
        """A URL of a path in the store that fsspec (and, for local stores, anything else) can open.

        A local store gives a plain absolute path; others give `protocol://...`. A trailing
        `/` on `relative` is kept (folders)."""
        path = self.fs_path(relative)
        if not self._local:
            path = self.fs.unstrip_protocol(path)
        return path + "/" if relative.endswith("/") and not path.endswith("/") else path

    def local_path(self, relative: str) -> Path | None:
        """The real local path of `relative` (or of a URL of this store) for a local store, else None."""
        path = self.fs_path(relative)
        return Path(path) if self._local else None

    # --- low-level I/O -----------------------------------------------------------------------
    def write_object(self, relative: str, data: bytes) -> None:
        """Write one object so that readers see all of it or nothing (e.g. a weight file)."""
        path = self.fs_path(relative)
        if not self._local:
            self.fs.pipe_file(path, data)  # one PUT: atomic on object stores and in memory://
            return
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex}.tmp")
        try:
            with tmp.open("wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            tmp.replace(target)
        finally:
            tmp.unlink(missing_ok=True)
        # The rename is durable only once the directory entry is.
        fd = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _get(self, relative: str) -> bytes | None:
        try:
            data: bytes = self.fs.cat_file(self.fs_path(relative))
        except FileNotFoundError:
            return None
        return data

    def _get_json(self, relative: str) -> dict[str, Any] | None:
        data = self._get(relative)
        if data is None:
            return None
        try:
            obj = json.loads(data)
        except ValueError as exc:
            raise StoreError(f"{self.url(relative)} is not valid JSON ({exc}); the store is damaged") from exc
        if not isinstance(obj, dict):
            raise StoreError(f"{self.url(relative)} holds a JSON {type(obj).__name__}, expected an object")
        return obj

    def _glob(self, pattern: str) -> list[str]:
        # Object-store filesystems cache listings; a reader polling for new commits must not
        # be served yesterday's listing.
        self.fs.invalidate_cache()
        found: list[str] = self.fs.glob(self.fs_path(pattern))
        return found

    @staticmethod
    def _check_format(obj: dict[str, Any], where: str) -> None:
        fmt = obj.get("format")
        if fmt != STORE_FORMAT:
            raise StoreError(
                f"{where} was written in store format {fmt!r}; this legorl reads format "
                f"{STORE_FORMAT} — upgrade legorl or use a new run store"
            )

    # --- batches -----------------------------------------------------------------------------
    def commit_batch(
        self,
        step: int,
        trials: list[TrialRecord],
        *,
        policy_version: str,
        meta: Mapping[str, Any] | None = None,
    ) -> BatchRef:
        """Write step `step`'s trial records, then its commit marker; the batch is visible once committed.

        Committing a step again with the same trials, policy version and meta returns the
        existing commit; anything different raises StoreError (a committed batch may already
        have been trained on, so it is never replaced)."""
        _step_dir(step)  # a step that is not an integer ≥ 0 is refused before anything is read
        parse_policy_version(policy_version)
        meta_json = json.loads(_json_bytes(dict(meta or {})))
        try:
            table = trials_to_table(trials)
        except TrajectoryError as exc:
            raise StoreError(f"step {step}: a trial record breaks the trajectory contract: {exc}") from exc
        # The parquet bytes are buffered in memory so their digest is known before the marker
        # is written; they are smaller than the Arrow table the records already occupy.
        data = _parquet_bytes(table)
        digest = _sha256(data)

        existing = self._get_json(StoreLayout.batch_marker(step))
        if existing is not None:
            ref = self._ref(step, existing)
            same = ref.policy_version == policy_version and ref.meta == meta_json
            if same and ref.sha256 != digest:
                # Another pyarrow may encode the same rows differently, and a batch committed before
                # an upgrade has an older schema version: compare the rows, then the records.
                stored = self._read_table(ref)
                same = stored.equals(table) or trials_from_table(stored) == trials_from_table(table)
            if not same:
                raise StoreError(
                    f"step {step} is already committed at {ref.path} with different content "
                    f"(policy version {ref.policy_version}, {ref.num_trials} trials); a committed "
                    "batch is never replaced — commit the new trials under a later step"
                )
            return ref

        # A leftover trials.parquet from a crash before the marker was never visible: replace it.
        self.write_object(StoreLayout.batch_trials(step), data)
        marker = {
            "format": STORE_FORMAT,
            "step": step,
            "policy_version": policy_version,
            "num_trials": table.num_rows,
            "sha256": digest,
            "size": len(data),
            "schema_version": SCHEMA_VERSION,
            "created_at": self._clock().astimezone(UTC).isoformat(),
            "meta": meta_json,
        }
        self.write_object(StoreLayout.batch_marker(step), _json_bytes(marker))
        return self._ref(step, marker)

    def committed_steps(self) -> list[int]:
        """Steps with a commit marker, ascending."""
        steps = []
        for path in self._glob(f"{StoreLayout.BATCHES}/{StoreLayout.STEP_GLOB}/{StoreLayout.BATCH_MARKER}"):
            match = _STEP_DIR_RE.fullmatch(posixpath.basename(posixpath.dirname(path)))
            if match:
                steps.append(int(match.group(1)))
        return sorted(steps)

    def batch_ref(self, step: int) -> BatchRef:
        """The commit marker of step `step`; StoreError if the step is not committed."""
        relative = StoreLayout.batch_marker(step)
        marker = self._get_json(relative)
        if marker is None:
            raise StoreError(
                f"step {step} has no committed batch ({self.url(relative)} does not exist); "
                f"committed steps: {self.committed_steps() or 'none'}"
            )
        return self._ref(step, marker)

    def read_batch_table(self, step: int) -> tuple[BatchRef, pa.Table]:
        """Step `step`'s trials as an Arrow table, checksum and schema version verified (for the UI)."""
        ref = self.batch_ref(step)
        return ref, self._read_table(ref)

    def read_batch(self, step: int) -> Batch:
        """Step `step`'s committed trial records, checksum and schema version verified."""
        ref, table = self.read_batch_table(step)
        return Batch(ref=ref, trials=trials_from_table(table))

    def _ref(self, step: int, marker: dict[str, Any]) -> BatchRef:
        where = self.url(StoreLayout.batch_marker(step))
        self._check_format(marker, where)
        if marker.get("schema_version") not in READABLE_SCHEMA_VERSIONS:
            raise StoreError(
                f"{where}: the batch was written with trajectory schema version "
                f"{marker.get('schema_version')!r}; this legorl reads version {SCHEMA_VERSION} (and "
                f"older: {', '.join(map(str, READABLE_SCHEMA_VERSIONS[:-1]))}) — upgrade legorl or "
                "convert the run store"
            )
        try:
            ref = BatchRef(
                step=int(marker["step"]),
                policy_version=str(marker["policy_version"]),
                num_trials=int(marker["num_trials"]),
                sha256=str(marker["sha256"]),
                size=int(marker["size"]),
                created_at=str(marker["created_at"]),
                meta=dict(marker["meta"]),
                path=self.url(StoreLayout.batch_trials(step)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise StoreError(f"{where} lacks or mangles a field ({exc!r}); the store is damaged") from exc
        if ref.step != step:
            raise StoreError(f"{where} says step {ref.step}; the store is damaged")
        return ref

    def _read_table(self, ref: BatchRef) -> pa.Table:
        relative = StoreLayout.batch_trials(ref.step)
        data = self._get(relative)
        if data is None:
            raise StoreError(f"step {ref.step} is committed but {ref.path} is missing; the store is damaged")
        digest = _sha256(data)
        if digest != ref.sha256:
            raise StoreError(
                f"{ref.path} fails its checksum: sha256 {digest}, COMMIT.json says {ref.sha256} "
                f"({len(data)} bytes, expected {ref.size}); the file was changed or truncated after "
                "the commit — restore it from a backup or drop the run store"
            )
        table = pq.read_table(pa.BufferReader(data))
        try:
            check_schema(table, TRIAL_SCHEMA)
        except SchemaVersionError as exc:
            raise StoreError(f"{ref.path}: {exc}") from exc
        if table.num_rows != ref.num_trials:
            raise StoreError(f"{ref.path} holds {table.num_rows} trials, COMMIT.json says {ref.num_trials}")
        return table

    # --- published weights ---------------------------------------------------------------------
    def weights_path(self, version: str) -> str:
        """URL of the folder the weights of `version` go into, ending in `/`."""
        parse_policy_version(version)
        return self.url(f"{StoreLayout.weights(version)}/")

    def record_weights(
        self,
        version: str,
        step: int,
        sha256: str,
        *,
        files: Sequence[str] | None = None,
        num_tensors: int | None = None,
    ) -> PublishedWeights:
        """Publish `version`: write its PUBLISHED.json after its weight files are in place.

        `files`: the weight files the digest covers (default: every file in the folder); `num_tensors`:
        their tensor count, when the publisher counted them. Recording the same version with the same
        digest again is a no-op; another digest raises StoreError (the fleet may already serve the first)."""
        if parse_policy_version(version) != step:
            raise StoreError(
                f"version {version!r} does not belong to step {step}: the weights after step "
                f"{step} are {policy_version(step)!r}"
            )
        if not re.fullmatch(r"[0-9a-f]{64}", sha256):
            raise ValueError(f"sha256 must be 64 lowercase hex digits, got {sha256!r}")
        existing = self.read_published(version)
        if existing is not None:
            if existing.sha256 != sha256:
                raise StoreError(
                    f"{version} is already published with sha256 {existing.sha256}, not {sha256}; "
                    "published weights are never replaced — publish under the next version"
                )
            return existing
        folder = self.fs_path(StoreLayout.weights(version))
        self.fs.invalidate_cache(folder)
        try:
            listed = self.fs.ls(folder, detail=True)
        except FileNotFoundError:
            listed = []
        sizes = {
            name: int(entry.get("size") or 0)
            for entry in listed
            if (name := posixpath.basename(str(entry["name"]).rstrip("/"))) != PUBLISHED_MARKER
            and not name.startswith(".")
        }
        if not sizes:
            raise StoreError(
                f"{self.weights_path(version)} holds no files: write the weights there before "
                "recording them as published"
            )
        names = sorted(sizes) if files is None else list(files)
        missing = [name for name in names if name not in sizes]
        if missing or not names:
            raise StoreError(f"{self.weights_path(version)} lacks the weight file(s) {missing or names}")
        published = PublishedWeights(
            version=version,
            sha256=sha256,
            files=tuple(names),
            published_at=self._clock().astimezone(UTC).isoformat(),
            num_tensors=num_tensors,
            bytes=sum(sizes[name] for name in names),
            path=self.weights_path(version),
        )
        self.write_object(StoreLayout.weights_marker(version), _json_bytes(published.to_json()))
        return published

    def read_published(self, version: str) -> PublishedWeights | None:
        """The publication record of `version`, or None if it is not published (yet)."""
        parse_policy_version(version)
        where = self.url(StoreLayout.weights_marker(version))
        marker = self._get_json(StoreLayout.weights_marker(version))
        if marker is None:
            return None
        try:
            published = PublishedWeights.from_json(marker, path=self.weights_path(version))
        except ValueError as exc:
            raise StoreError(f"{where}: {exc}; the store is damaged") from exc
        if published.version != version:
            raise StoreError(f"{where} names version {published.version!r}; the store is damaged")
        return published

    def published_versions(self) -> list[str]:
        """Published policy versions, oldest first."""
        steps = []
        for path in self._glob(StoreLayout.weights_marker("*")):
            name = posixpath.basename(posixpath.dirname(path))
            if _VERSION_RE.fullmatch(name):
                steps.append(parse_policy_version(name))
        return [policy_version(s) for s in sorted(steps)]

    def latest_weights(self) -> str | None:
        """The folder of the newest published version, or None when nothing is published."""
        versions = self.published_versions()
        return self.weights_path(versions[-1]) if versions else None

    # --- the run's manifest ----------------------------------------------------------------------
    def write_run_spec(self, body: Mapping[str, Any]) -> None:
        """Record the RLRun this store belongs to (`run.json`), so processes can start from the store."""
        self.write_object(StoreLayout.RUN, _json_bytes(dict(body)))

    def read_run_spec(self) -> dict[str, Any] | None:
        """The recorded RLRun (as JSON), or None before one was written."""
        return self._get_json(StoreLayout.RUN)

    # --- finished trials (the run controller's journal) ----------------------------------------
    def save_trial(self, record: TrialRecord) -> None:
        """Save one finished trial at once, so a restarted controller neither loses nor repeats it."""
        if not _TRIAL_RE.fullmatch(record.trial):
            raise StoreError(f"trial id {record.trial!r} cannot name an object in the store")
        try:
            table = trials_to_table([record])
        except TrajectoryError as exc:
            raise StoreError(f"trial {record.trial} breaks the trajectory contract: {exc}") from exc
        self.write_object(
            StoreLayout.saved_trial(record.split, record.step, record.trial), _parquet_bytes(table)
        )

    def saved_trials(self, split: str, step: int) -> list[TrialRecord]:
        """Trials saved for `split` and `step`, by trial id."""
        if split not in ("train", "validation"):
            raise ValueError(f"split must be train or validation, got {split!r}")
        paths = self._glob(f"{StoreLayout.trials(split, step)}/*.parquet")
        if not paths:
            return []
        records = []
        for path, data in sorted(self.fs.cat(paths, on_error="omit").items()):
            try:
                records.extend(trials_from_table(pq.read_table(io.BytesIO(data))))
            except (pa.ArrowInvalid, SchemaVersionError) as exc:
                raise StoreError(f"{path} is unreadable ({exc}); delete it to re-run that trial") from exc
        return sorted(records, key=lambda r: r.trial)

    def saved_steps(self, split: str) -> list[int]:
        """Steps with at least one saved trial of `split`, ascending."""
        steps = set()
        for path in self._glob(f"{StoreLayout.trials(split)}/{StoreLayout.STEP_GLOB}/*.parquet"):
            match = _STEP_DIR_RE.fullmatch(posixpath.basename(posixpath.dirname(path)))
            if match:
                steps.add(int(match.group(1)))
        return sorted(steps)

    # --- the canary ----------------------------------------------------------------------------
    def write_validation(self, report: ValidationReport | Mapping[str, Any]) -> None:
        """Replace the last canary's report (`legorl.controller.canary.CanaryReport.report`)."""
        body = report.to_json() if isinstance(report, ValidationReport) else dict(report)
        self.write_object(StoreLayout.VALIDATION, _json_bytes(body))

    def read_validation(self) -> dict[str, Any] | None:
        """The last canary's report, or None before any canary ran."""
        return self._get_json(StoreLayout.VALIDATION)

    def validation_report(self) -> ValidationReport | None:
        """The last canary's report, typed; None before any canary ran."""
        report = self.read_validation()
        return ValidationReport.from_json(report) if report is not None else None

    # --- scoring requests: a canary asks the running trainer to score its trial ---------------------
    def request_scoring(self, request: str, records: Sequence[TrialRecord]) -> None:
        """Ask the trainer to score `records` with the weights it holds (answered by `answer_scoring`)."""
        if not _TRIAL_RE.fullmatch(request):
            raise StoreError(f"scoring request id {request!r} cannot name an object in the store")
        try:
            table = trials_to_table(list(records))
        except TrajectoryError as exc:
            raise StoreError(f"scoring request {request} breaks the trajectory contract: {exc}") from exc
        self.write_object(StoreLayout.scoring_request(request), _parquet_bytes(table))

    def scoring_requests(self) -> list[str]:
        """Ids of scoring requests without an answer yet, sorted."""
        asked = {
            posixpath.basename(p).removesuffix(".parquet")
            for p in self._glob(StoreLayout.scoring_request("*"))
        }
        answered = {
            posixpath.basename(p).removesuffix(".json") for p in self._glob(StoreLayout.scoring_answer("*"))
        }
        return sorted(asked - answered)

    def read_scoring_request(self, request: str) -> list[TrialRecord]:
        data = self._get(StoreLayout.scoring_request(request))
        if data is None:
            raise StoreError(f"no scoring request {request!r} in {self.uri}")
        try:
            return trials_from_table(pq.read_table(io.BytesIO(data)))
        except (pa.ArrowInvalid, SchemaVersionError) as exc:
            raise StoreError(f"scoring request {request} is unreadable: {exc}") from exc

    def answer_scoring(self, request: str, answer: ScoringAnswer | Mapping[str, Any]) -> None:
        """The trainer's answer to `request` (its figures, or an `error`); written once."""
        body = answer.to_json() if isinstance(answer, ScoringAnswer) else dict(answer)
        self.write_object(StoreLayout.scoring_answer(request), _json_bytes(body))

    def read_scoring_answer(self, request: str) -> dict[str, Any] | None:
        return self._get_json(StoreLayout.scoring_answer(request))

    def scoring_answer(self, request: str) -> ScoringAnswer | None:
        """The trainer's answer to `request`, typed; None before it answered."""
        answer = self.read_scoring_answer(request)
        return ScoringAnswer.from_json(answer) if answer is not None else None

    # --- evaluations and the controller's progress ------------------------------------------------
    def write_eval(self, step: int, summary: Mapping[str, Any]) -> None:
        """The held-out evaluation of policy version `step` (written once all its trials ended)."""
        self.write_object(StoreLayout.eval_summary(step), _json_bytes({"step": step, **summary}))

    def read_evals(self) -> list[dict[str, Any]]:
        """Every evaluation, by step."""
        paths = self._glob(f"{StoreLayout.EVALS}/{StoreLayout.STEP_GLOB}.json")
        out = [json.loads(data) for data in self.fs.cat(paths, on_error="omit").values()] if paths else []
        return sorted(out, key=lambda r: int(r["step"]))

    def write_eval_summary(self, summary: EvalSummary) -> None:
        """The held-out evaluation of policy version `summary.step` (written once all its trials ended)."""
        self.write_eval(summary.step, summary.to_json())

    def eval_summaries(self) -> list[EvalSummary]:
        """Every evaluation, typed, by step."""
        return [EvalSummary.from_json(r) for r in self.read_evals()]

    def write_controller_state(self, state: Mapping[str, Any]) -> None:
        """Replace the run controller's progress snapshot (what status and the UI show)."""
        self.write_object(StoreLayout.CONTROLLER_STATE, _json_bytes(dict(state)))

    def read_controller_state(self) -> dict[str, Any] | None:
        return self._get_json(StoreLayout.CONTROLLER_STATE)

    # --- trainer metrics and state -------------------------------------------------------------
    def write_metrics(self, step: int, metrics: Mapping[str, MetricValue]) -> None:
        """Write the trainer's figures of `step` as one JSON object (replacing a previous write).

        NaN and infinities are written as null: JSON has no such numbers."""
        record: dict[str, MetricValue] = {"step": step}
        for key, given in metrics.items():
            value = given
            if not isinstance(key, str):
                raise TypeError(f"metric names are strings, got {key!r}")
            if value is not None and not isinstance(value, (int, float, str)):
                raise TypeError(
                    f"metric {key!r} is a {type(value).__name__}; metrics are numbers, strings or None"
                )
            if isinstance(value, float) and not math.isfinite(value):
                value = None
            if key == "step" and value != step:
                raise ValueError(f"metrics of step {step} carry step={value!r}")
            record[key] = value
        self.write_object(StoreLayout.step_figures(step), _json_bytes(record))

    def read_metrics(self) -> list[dict[str, Any]]:
        """Every step's trainer metrics, by step."""
        paths = self._glob(f"{StoreLayout.STEP_FIGURES}/{StoreLayout.STEP_GLOB}.json")
        if not paths:
            return []
        records = []
        for path, data in self.fs.cat(paths, on_error="omit").items():
            try:
                obj = json.loads(data)
            except ValueError as exc:
                raise StoreError(f"{path} is not valid JSON ({exc}); the store is damaged") from exc
            records.append(obj)
        return sorted(records, key=lambda r: int(r["step"]))

    def write_step_figures(self, figures: StepFigures) -> None:
        """Write a step's figures (`StepFigures.to_json`), replacing a previous write."""
        self.write_metrics(figures.step, figures.to_json())

    def step_figures(self) -> list[StepFigures]:
        """Every step's figures, typed, by step."""
        return [StepFigures.from_json(r) for r in self.read_metrics()]

    def write_token_logprobs(self, step: int, rows: Mapping[tuple[str, int], Sequence[float | None]]) -> None:
        """The trainer's log-prob of every token it trained on in `step`, by (trial, segment index), aligned
        to the segment's tokens (None where a token was not trained on); replaces an earlier write."""
        keys = sorted(rows)
        table = pa.table(
            {
                "trial": pa.array([k[0] for k in keys], pa.string()),
                "segment": pa.array([k[1] for k in keys], pa.int32()),
                "logprobs": pa.array([list(rows[k]) for k in keys], pa.list_(pa.float32())),
            }
        )
        sink = io.BytesIO()
        pq.write_table(table, sink, compression="zstd")
        self.write_object(StoreLayout.token_logprobs(step), sink.getvalue())

    def read_token_logprobs(self, step: int, trial: str) -> dict[int, list[float | None]] | None:
        """`trial`'s training log-probs of `step` by segment index; None when the trainer wrote none for
        that step (an older trainer, a skipped step), {} when the trial was not trained on (filtered)."""
        data = self._get(StoreLayout.token_logprobs(step))
        if data is None:
            return None
        try:
            table = pq.read_table(io.BytesIO(data), filters=[("trial", "=", trial)])
        except (pa.ArrowInvalid, OSError) as exc:
            raise StoreError(f"training log-probs of step {step} are unreadable: {exc}") from exc
        return {
            int(seg): list(values)
            for seg, values in zip(
                table.column("segment").to_pylist(), table.column("logprobs").to_pylist(), strict=True
            )
        }

    def write_trainer_state(self, state: TrainerState | Mapping[str, Any]) -> None:
        """Replace the trainer's resume pointer (last completed step, policy version, checkpoint)."""
        body = state.to_json() if isinstance(state, TrainerState) else dict(state)
        self.write_object(StoreLayout.TRAINER_STATE, _json_bytes(body))

    def read_trainer_state(self) -> dict[str, Any] | None:
        """The trainer's resume pointer, or None before the trainer wrote one."""
        return self._get_json(StoreLayout.TRAINER_STATE)

    def trainer_state(self) -> TrainerState | None:
        """The trainer's resume pointer, typed; None before the trainer wrote one."""
        state = self.read_trainer_state()
        return TrainerState.from_json(state) if state is not None else None

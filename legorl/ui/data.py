"""The UI's view of one run store: its answers (`legorl.ui.schemas`), cached by the files' modification times.

Everything here is synchronous (pyarrow, fsspec); the server calls it from worker threads. A store of
10,000 trials answers from memory: each step's trial summaries are read once (only the small columns,
never the token arrays) and kept until that step's files change. Only `trajectory()` reads tokens.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import posixpath
import re
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Final, Literal, TypeVar

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from legorl.api.figures import (
    BatchSummary,
    EvalSummary,
    FiguresError,
    StepFigures,
    TrainerState,
    ValidationReport,
)
from legorl.api.lenient import read_field, reported
from legorl.api.progress import Progress
from legorl.api.run import PolicySpec, RLRunSpec, StopConditions, TrajectoryFilter
from legorl.api.store import RunStore, StoreError, StoreLayout, parse_policy_version
from legorl.api.termination import INFRA_REASONS, TerminationReason
from legorl.api.trajectory import (
    SUMMARY_COLUMNS,
    SchemaVersionError,
    Segment,
    TrajectoryError,
    TrialRecord,
    TrialSummary,
    trials_from_table,
)
from legorl.api.weights import PUBLISHED_MARKER

from .schemas import (
    BatchView,
    CheckView,
    Curves,
    EvalOutcome,
    HeldOutPoint,
    Outcomes,
    OutcomeStep,
    Part,
    Routing,
    RunSummary,
    SegmentView,
    Series,
    SplitGrid,
    StageStat,
    StoreCondition,
    StoreOverview,
    TamperView,
    TaskCell,
    TaskGrid,
    TaskRow,
    ToolCall,
    TrainingLogprobs,
    Trajectory,
    TrialPage,
    TrialRow,
    TurnView,
    ValidationView,
)
from .tokens import TokenText, load_token_text

__all__ = [
    "CURVES",
    "REASONS",
    "NotFound",
    "StoreData",
    "StoredTrial",
    "TrialQuery",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

REASONS: Final = [r.value for r in TerminationReason]
"""Termination reasons in their documented order (the UI's colour order)."""
INFRA: Final = sorted(r.value for r in INFRA_REASONS)


CURVES: Final = StepFigures.curves()
"""Training curves the UI draws first, in this order, as (figure, label, group): declared on `StepFigures`'s
fields. Any other numeric figure in metrics/trainer/step-N.json follows."""

_STEP_RE: Final = re.compile(r"step-([0-9]{6,})")
_TRIAL_ID_RE: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_TOOL_CALL_RE: Final = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
_MAX_TOKENS: Final = 200_000
"""A trajectory larger than this is cut (a browser cannot lay out millions of spans)."""


class NotFound(LookupError):
    """An unknown run, step or trial (HTTP 404)."""


@dataclass(frozen=True)
class TrialQuery:
    """Filters, order and page of a trial list (validated by the server)."""

    split: str | None = None
    step: int | None = None
    task: str | None = None
    reason: tuple[str, ...] = ()
    group: str | None = None
    tampered: bool | None = None
    min_reward: float | None = None
    max_reward: float | None = None
    text: str | None = None
    sort: str = "step"
    order: str = "asc"
    offset: int = 0
    limit: int = 50


SORT_KEYS: Final = ("step", "trial", "task_id", "reward", "termination_reason", "num_turns", "duration")
"""The trial list's orders (`TrialQuery.sort`)."""


_Document = TypeVar("_Document", EvalSummary, StepFigures, TrainerState, ValidationReport)


def _decoded(kind: type[_Document], records: Iterable[Mapping[str, Any]]) -> list[_Document]:
    """`records` decoded as `kind`; a malformed one is logged and left out (the UI shows what it can)."""
    out = []
    for record in records:
        try:
            out.append(kind.from_json(record))
        except FiguresError as exc:
            log.warning("%s", exc)
    return out


def _batch_summary(meta: Mapping[str, Any]) -> BatchSummary:
    """A batch's `COMMIT.json` meta, typed; a malformed one is logged and read as saying nothing."""
    try:
        return BatchSummary.from_json(meta)
    except FiguresError as exc:
        log.warning("%s", exc)
        return BatchSummary()


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _iso(value: Any) -> str | None:
    if isinstance(value, datetime):
        return value.isoformat()
    return None if value is None else str(value)


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1))
    return ordered[rank]


def _trial_row(t: TrialSummary | TrialRecord, committed: bool | None = None) -> TrialRow:
    """A trial as the UI's lists show it (from `TrialSummary`, the one decoder of a trial-table row)."""
    row = TrialRow(
        trial=t.trial,
        task_id=t.task_id,
        group_id=t.group_id,
        split=t.split,
        step=t.step,
        harness=t.harness,
        termination_reason=t.termination_reason.value,
        reward=_num(t.reward),
        tamper_findings=[TamperView(kind=f.kind, detail=f.detail, path=f.path) for f in t.tamper_findings],
        policy_versions=t.policy_versions,
        num_turns=t.num_turns,
        merged_turn_share=_num(t.merged_turn_share),
        stage_seconds=t.stage_seconds,
        started_at=_iso(t.started_at),
        ended_at=_iso(t.ended_at),
        duration=(t.ended_at - t.started_at).total_seconds(),
        error=t.error,
    )
    if committed is not None:
        row.committed = committed
    return row


@dataclass(frozen=True)
class StoredTrial:
    """A trial as the UI keeps it in memory: its summary, and whether it was read from a committed batch."""

    summary: TrialSummary
    committed: bool

    @property
    def reward(self) -> float | None:
        """The reward, None when there is none (or it is not a finite number)."""
        return _num(self.summary.reward)

    @property
    def duration(self) -> float:
        return (self.summary.ended_at - self.summary.started_at).total_seconds()

    @functools.cached_property
    def row(self) -> TrialRow:
        """The trial as the lists show it (built once; the lists page through the same rows)."""
        return _trial_row(self.summary, self.committed)


_SORT: Final[dict[str, Callable[[StoredTrial], Any]]] = {
    "step": lambda t: t.summary.step,
    "trial": lambda t: t.summary.trial,
    "task_id": lambda t: t.summary.task_id,
    "reward": lambda t: t.reward,
    "termination_reason": lambda t: t.summary.termination_reason.value,
    "num_turns": lambda t: t.summary.num_turns,
    "duration": lambda t: t.duration,
}
"""What each of `SORT_KEYS` orders the trial list by."""


class StoreData:
    """One run store as the UI reads it (thread-safe; caches keyed by modification times)."""

    def __init__(
        self,
        uri: str,
        *,
        refresh_seconds: float = 2.0,
        tokenizer: Path | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = RunStore(uri)
        self.uri = uri
        root = self.store.local_path("")
        self.root: Path | None = root
        self.refresh_seconds = refresh_seconds
        self._tokenizer_path = tokenizer
        self._token_text: tuple[str, TokenText | None] | None = None
        self._clock = clock
        self._lock = threading.RLock()
        self._cache: dict[Any, tuple[Any, Any]] = {}
        self._remote_sig: dict[str, tuple[float, Any]] = {}

    def __repr__(self) -> str:
        return f"StoreData({self.uri!r})"

    # --- change detection ------------------------------------------------------------------------
    def _sig(self, relative: str) -> Any:
        """What changes when `relative` (a file, or a folder's entries) changes: its mtime and size.

        Local folders change mtime when an entry is added, removed or renamed into place (every store
        write is a rename), so one stat per folder is enough. Remote stores are asked at most every
        `refresh_seconds` per path."""
        if self.root is not None:
            try:
                st = (self.root / relative).stat()
            except FileNotFoundError:
                return None
            return (st.st_mtime_ns, st.st_size)
        now = self._clock()
        cached = self._remote_sig.get(relative)
        if cached is not None and now - cached[0] < self.refresh_seconds:
            return cached[1]
        try:
            info = self.store.fs.info(self.store.fs_path(relative))
            sig: Any = (info.get("mtime") or info.get("LastModified") or info.get("ETag"), info.get("size"))
            if info.get("type") == "directory":
                self.store.fs.invalidate_cache(self.store.fs_path(relative))
                sig = tuple(sorted(self.store.fs.ls(self.store.fs_path(relative), detail=False)))
        except FileNotFoundError:
            sig = None
        self._remote_sig[relative] = (now, sig)
        return sig

    def _cached(self, key: Any, sig: Any, compute: Callable[[], T]) -> T:
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None and hit[0] == sig:
                return hit[1]  # type: ignore[no-any-return]
        value = compute()
        with self._lock:
            self._cache[key] = (sig, value)
        return value

    def _list(self, relative: str) -> list[str]:
        """Entry names of a folder (cached by the folder's signature)."""

        def compute() -> list[str]:
            if self.root is not None:
                try:
                    return sorted(e.name for e in os.scandir(self.root / relative))
                except FileNotFoundError:
                    return []
            try:
                return sorted(
                    posixpath.basename(p.rstrip("/"))
                    for p in self.store.fs.ls(self.store.fs_path(relative), detail=False)
                )
            except FileNotFoundError:
                return []

        return self._cached(("ls", relative), self._sig(relative), compute)

    def _json(self, relative: str) -> dict[str, Any] | None:
        def compute() -> dict[str, Any] | None:
            try:
                data = self.store.fs.cat_file(self.store.fs_path(relative))
            except FileNotFoundError:
                return None
            try:
                obj = json.loads(data)
            except ValueError:
                log.warning("%s is not valid JSON; ignored", self.store.url(relative))
                return None
            return obj if isinstance(obj, dict) else None

        return self._cached(("json", relative), self._sig(relative), compute)

    @staticmethod
    def _steps_of(names: Iterable[str], suffix: str = "") -> list[int]:
        steps = []
        for name in names:
            if suffix and not name.endswith(suffix):
                continue
            match = _STEP_RE.fullmatch(name.removesuffix(suffix))
            if match:
                steps.append(int(match.group(1)))
        return sorted(steps)

    # --- run-level records ---------------------------------------------------------------------
    def run_spec(self) -> dict[str, Any] | None:
        return self._json(StoreLayout.RUN)

    def spec_field(self, name: str) -> Any:
        """Field `name` of the run's spec (`RLRunSpec`) as run.json gives it, read leniently; None when it
        does not say (`legorl.api.lenient.read_field`)."""
        return read_field(RLRunSpec, (self.run_spec() or {}).get("spec"), name)

    def validation(self) -> ValidationView | None:
        """The last canary's report (`legorl run --canary`, or the operator's), as the overview shows it."""
        raw = self._json(StoreLayout.VALIDATION)
        reports = _decoded(ValidationReport, [raw]) if raw else []
        if not reports:
            return None
        report = reports[0]
        return ValidationView(
            source="store",
            state=report.result,
            time=report.time,
            seconds=report.seconds,
            trial=report.trial,
            checks=[CheckView(check=c.check, result=c.result, message=c.message) for c in report.checks],
        )

    def name(self) -> str:
        spec = self.run_spec() or {}
        name = (spec.get("metadata") or {}).get("name")
        if isinstance(name, str) and name:
            return name
        state = Progress.from_json(self.controller_state())
        if state.run:
            return state.run
        return posixpath.basename(self.uri.rstrip("/")) or "run"

    def controller_state(self) -> dict[str, Any] | None:
        return self._json(StoreLayout.CONTROLLER_STATE)

    def trainer_state(self) -> dict[str, Any] | None:
        return self._json(StoreLayout.TRAINER_STATE)

    def trainer_policy_version(self) -> str | None:
        """The version the trainer last published (`TrainerState`), None before it said one."""
        states = _decoded(TrainerState, [self.trainer_state() or {}])
        return states[0].policy_version if states and reported(states[0], "policy_version") else None

    def committed_steps(self) -> list[int]:
        steps = []
        for step in self._steps_of(self._list(StoreLayout.BATCHES)):
            if StoreLayout.BATCH_MARKER in self._list(StoreLayout.batch(step)):
                steps.append(step)
        return steps

    def commit(self, step: int) -> dict[str, Any] | None:
        return self._json(StoreLayout.batch_marker(step))

    def evals(self) -> list[dict[str, Any]]:
        out = []
        for step in self._steps_of(self._list(StoreLayout.EVALS), ".json"):
            record = self._json(StoreLayout.eval_summary(step))
            if record is not None:
                out.append(record)
        return out

    def eval_summaries(self) -> list[EvalSummary]:
        """`evals`, typed; a malformed one is left out (and logged)."""
        return _decoded(EvalSummary, self.evals())

    def step_figures(self) -> list[StepFigures]:
        """`metrics`, typed; a malformed one is left out (and logged)."""
        return _decoded(StepFigures, self.metrics())

    def metrics(self) -> list[dict[str, Any]]:
        out = []
        for step in self._steps_of(self._list(StoreLayout.STEP_FIGURES), ".json"):
            record = self._json(StoreLayout.step_figures(step))
            if record is not None:
                out.append(record)
        return out

    def published_versions(self) -> list[str]:
        versions = []
        for name in self._list(StoreLayout.WEIGHTS):
            try:
                step = parse_policy_version(name)
            except ValueError:
                continue
            if PUBLISHED_MARKER in self._list(StoreLayout.weights(name)):
                versions.append((step, name))
        return [name for _, name in sorted(versions)]

    def updated_at(self) -> float | None:
        """Unix time of the newest progress write (controller state), for "is it still running"."""
        if self.root is None:
            return None
        try:
            return (self.root / StoreLayout.CONTROLLER_STATE).stat().st_mtime
        except FileNotFoundError:
            return None

    # --- trials ------------------------------------------------------------------------------------
    def _read_rows(self, paths: list[str], columns: list[str]) -> list[TrialSummary]:
        if not paths:
            return []
        try:
            # One multi-file read (threaded) beats thousands of single-file ones.
            table = ds.dataset(paths, format="parquet", filesystem=self.store.fs).to_table(columns=columns)
        except (OSError, pa.ArrowInvalid) as exc:
            log.info("reading %d trial files one by one (%s)", len(paths), exc)
            tables = []
            for path in paths:
                try:
                    with self.store.fs.open(path, "rb") as f:
                        tables.append(pq.read_table(f, columns=columns))
                except (OSError, pa.ArrowInvalid) as err:
                    log.warning("skipping unreadable trial file %s: %s", path, err)
            if not tables:
                return []
            table = pa.concat_tables(tables, promote_options="permissive")
        return [TrialSummary.from_row(r) for r in table.to_pylist()]

    def _step_rows(self, split: str, step: int, committed: bool) -> list[StoredTrial]:
        """Summaries of one step's trials: the committed batch if there is one, else the saved trials."""
        if committed and split == "train":
            marker = StoreLayout.batch_marker(step)

            def from_batch() -> list[StoredTrial]:
                path = self.store.fs_path(StoreLayout.batch_trials(step))
                return [StoredTrial(t, True) for t in self._read_rows([path], list(SUMMARY_COLUMNS))]

            return self._cached(("batch-rows", step), self._sig(marker), from_batch)
        folder = StoreLayout.trials(split, step)

        def from_saved() -> list[StoredTrial]:
            names = [n for n in self._list(folder) if n.endswith(".parquet") and not n.startswith(".")]
            paths = [self.store.fs_path(f"{folder}/{n}") for n in names]
            return [StoredTrial(t, False) for t in self._read_rows(paths, list(SUMMARY_COLUMNS))]

        return self._cached(("saved-rows", split, step), self._sig(folder), from_saved)

    def trials(self) -> list[StoredTrial]:
        """Every trial's summary (train and validation), by split, step and trial id."""
        return self._rows_and_index()[0]

    def trial_index(self) -> dict[str, StoredTrial]:
        """Trial summaries by trial id."""
        return self._rows_and_index()[1]

    def _trial_keys(self) -> tuple[list[tuple[str, int, bool]], Any]:
        """Which (split, step, committed) groups of trials exist, and a signature of all of them."""
        committed = self.committed_steps()
        keys: list[tuple[str, int, bool]] = [("train", s, True) for s in committed]
        done = set(committed)
        for split in ("train", "validation"):
            for step in self._steps_of(self._list(StoreLayout.trials(split))):
                if split == "train" and step in done:
                    continue
                keys.append((split, step, False))
        return keys, tuple((k, self._sig_of_rows(*k)) for k in keys)

    def signature(self) -> Any:
        """Changes whenever anything the UI derives from the store changes (for memoised views)."""
        return (
            self._trial_keys()[1],
            *(
                self._sig(p)
                for p in (
                    StoreLayout.STEP_FIGURES,
                    StoreLayout.EVALS,
                    StoreLayout.CONTROLLER_STATE,
                    StoreLayout.RUN,
                    StoreLayout.TRAINER_STATE,
                )
            ),
        )

    def memo(self, key: Any, sig: Any, compute: Callable[[], T]) -> T:
        """`compute()`, kept until `sig` changes (e.g. diagnostics, keyed by `signature()`)."""
        return self._cached(("memo", key), sig, compute)

    def _rows_and_index(self) -> tuple[list[StoredTrial], dict[str, StoredTrial]]:
        keys, sig = self._trial_keys()

        def compute() -> tuple[list[StoredTrial], dict[str, StoredTrial]]:
            rows: list[StoredTrial] = []
            for split, step, is_committed in keys:
                rows.extend(self._step_rows(split, step, is_committed))
            rows.sort(key=lambda r: (r.summary.split != "train", r.summary.step, r.summary.trial))
            return rows, {r.summary.trial: r for r in rows}

        return self._cached(("all-rows",), sig, compute)

    def _sig_of_rows(self, split: str, step: int, committed: bool) -> Any:
        if committed:
            return self._sig(StoreLayout.batch_marker(step))
        return self._sig(StoreLayout.trials(split, step))

    def query_trials(self, q: TrialQuery) -> TrialPage:
        text = q.text.lower() if q.text else None
        out = []
        for r in self._ordered(q.sort, q.order):
            t = r.summary
            if q.split is not None and t.split != q.split:
                continue
            if q.step is not None and t.step != q.step:
                continue
            if q.task is not None and t.task_id != q.task:
                continue
            if q.group is not None and t.group_id != q.group:
                continue
            if q.reason and t.termination_reason.value not in q.reason:
                continue
            if q.tampered is not None and bool(t.tamper_findings) != q.tampered:
                continue
            reward = r.reward
            if q.min_reward is not None and (reward is None or reward < q.min_reward):
                continue
            if q.max_reward is not None and (reward is None or reward > q.max_reward):
                continue
            if text is not None and text not in t.trial.lower() and text not in t.task_id.lower():
                continue
            out.append(r)
        page = out[q.offset : q.offset + q.limit]
        return TrialPage(total=len(out), offset=q.offset, limit=q.limit, items=[r.row for r in page])

    def _ordered(self, sort: str, order: str) -> list[StoredTrial]:
        """Every trial ordered by `sort` (kept until the trials change); filters keep this order."""
        if (sort, order) == ("step", "asc"):
            return self.trials()
        key = _SORT[sort]

        def compute() -> list[StoredTrial]:
            rows = self.trials()
            # Rows without a value (no reward) go last in either order.
            present = [r for r in rows if key(r) is not None]
            missing = [r for r in rows if key(r) is None]
            present.sort(key=lambda r: (key(r), r.summary.step, r.summary.trial), reverse=order == "desc")
            return present + missing

        return self.memo(("ordered", sort, order), self._trial_keys()[1], compute)

    # --- derived views -----------------------------------------------------------------------------
    def progress(self) -> dict[str, Any]:
        """The controller's snapshot (or what the store alone says when there is none)."""
        state = dict(self.controller_state() or {})
        committed = self.committed_steps()
        state.setdefault("step", committed[-1] if committed else 0)
        trainer = _decoded(TrainerState, [self.trainer_state() or {}])
        state.setdefault("policy_version", trainer[0].policy_version if trainer else "v0")
        return state

    def summary(self) -> RunSummary:
        """One row of the runs list."""
        p = Progress.from_json(self.progress())
        evals = self.eval_summaries()
        last_eval = evals[-1] if evals else None
        metrics = self.step_figures()
        last = metrics[-1] if metrics else None
        stop: StopConditions | None = self.spec_field("stop")
        updated = self.updated_at()
        return RunSummary(
            name=self.name(),
            store=self.uri,
            step=p.step,
            max_steps=p.max_steps or (stop.max_steps if stop else None),
            policy_version=p.policy_version,
            reward_mean=_num(p.reward_mean),
            held_out=_num(last_eval.solve_rate if last_eval else p.held_out_solve_rate),
            held_out_interval=(
                list(last_eval.interval95)
                if last_eval and last_eval.interval95
                else (list(p.held_out_interval) if p.held_out_interval else None)
            ),
            baseline=_num(p.baseline_solve_rate),
            fidelity=_num(last.fidelity_pearson) if last else _num(p.fidelity_correlation),
            trials_per_minute=_num(p.trials_per_minute),
            trials_total=p.trials_total,
            trials_running=p.trials_running,
            message=p.message,
            degraded_reason=p.degraded_reason,
            updated_seconds_ago=(time.time() - updated) if updated else None,
            conditions=self.local_conditions(),
        )

    def local_conditions(self) -> list[StoreCondition]:
        """Conditions as the store shows them (no cluster: nothing else writes any)."""
        updated = self.updated_at()
        when = datetime.fromtimestamp(updated).astimezone().isoformat() if updated else None
        raw = self.controller_state()
        if raw is None:
            return [
                StoreCondition(
                    type="Training",
                    status="Unknown",
                    reason="NoProgressYet",
                    message="the run controller has not written controller/state.json yet",
                    last_transition_time=when,
                    source="store",
                )
            ]
        fresh = updated is not None and time.time() - updated < 120
        p = Progress.from_json(raw)
        step, max_steps, running = p.step, p.max_steps, p.trials_running
        finished = max_steps is not None and step >= max_steps and running == 0
        out: list[StoreCondition] = []
        if finished:
            out.append(
                StoreCondition(
                    type="Succeeded",
                    status="True",
                    reason="Finished",
                    message=p.message or f"trained {step} step(s)",
                    last_transition_time=when,
                    source="store",
                )
            )
        else:
            out.append(
                StoreCondition(
                    type="Training",
                    status="True" if fresh else "Unknown",
                    reason="Running" if fresh else "NoRecentProgress",
                    message=p.message
                    or (
                        f"step {step} of {max_steps}, {running} trial(s) running"
                        if fresh
                        else "no progress written in the last 2 minutes: stopped, or the writer is gone"
                    ),
                    last_transition_time=when,
                    source="store",
                )
            )
        if p.degraded_reason:
            out.append(
                StoreCondition(
                    type="Degraded",
                    status="True",
                    reason=p.degraded_reason,
                    message=p.degraded_message,
                    last_transition_time=when,
                    source="store",
                )
            )
        return out

    def batches(self) -> list[BatchView]:
        out = []
        for step in self.committed_steps():
            marker = self.commit(step) or {}
            out.append(
                BatchView(
                    step=step,
                    policy_version=marker.get("policy_version"),
                    num_trials=marker.get("num_trials"),
                    created_at=marker.get("created_at"),
                    size=marker.get("size"),
                    meta=marker.get("meta") or {},
                )
            )
        return out

    def overview(self) -> StoreOverview:
        return StoreOverview(
            name=self.name(),
            store=self.uri,
            spec=self.run_spec(),
            progress=self.progress(),
            trainer=self.trainer_state(),
            batches=self.batches(),
            evals=self.evals(),
            published_versions=self.published_versions(),
            conditions=self.local_conditions(),
            validation=self.validation(),
        )

    def curves(self) -> Curves:
        metrics = self.metrics()
        series: dict[str, list[tuple[int, float]]] = {}
        for m in metrics:
            step = m.get("step")
            if not isinstance(step, int):
                continue
            for key, value in m.items():
                v = _num(value)
                if key != "step" and v is not None:
                    series.setdefault(key, []).append((step, v))
        batch_reward = []
        for b in self.batches():
            v = _num(_batch_summary(b.meta).reward_mean)
            if v is not None:
                batch_reward.append((b.step, v))
        if batch_reward:
            series["reward_mean"] = batch_reward
        held_out = []
        for e in self.eval_summaries():
            low, high = e.interval95 or (None, None)
            held_out.append(
                HeldOutPoint(
                    step=e.step,
                    rate=_num(e.solve_rate),
                    low=_num(low),
                    high=_num(high),
                    scored=e.scored,
                    policy_version=e.policy_version,
                )
            )
        known = [c[0] for c in CURVES]
        order = [k for k in known if k in series] + sorted(k for k in series if k not in known)
        labels = {k: label for k, label, _ in CURVES}
        groups = {k: group for k, _, group in CURVES}
        return Curves(
            series=[
                Series(key=k, label=labels.get(k, k), group=groups.get(k, "other"), points=series[k])
                for k in order
            ],
            held_out=held_out,
        )

    def outcomes(self) -> Outcomes:
        """Per training step: trials by termination reason, dropped share, zero-variance groups."""
        return self.memo("outcomes", (self._trial_keys()[1], self._sig(StoreLayout.RUN)), self._outcomes)

    def _outcomes(self) -> Outcomes:
        spec_filter: TrajectoryFilter | None = self.spec_field("filter")
        said = spec_filter.drop_reasons if spec_filter and reported(spec_filter, "drop_reasons") else None
        drop = {r.value for r in said} if said else set(INFRA)
        reasons_by_step: dict[int, Counter[str]] = {}
        for r in self.trials():
            t = r.summary
            if t.split == "train":
                reasons_by_step.setdefault(t.step, Counter())[t.termination_reason.value] += 1
        committed = set(self.committed_steps())
        steps = []
        for step in sorted(reasons_by_step):
            counts = reasons_by_step[step]
            meta = (self.commit(step) or {}).get("meta") if step in committed else None
            marker = _batch_summary(meta) if meta else None
            trials = sum(counts.values())
            dropped = sum(n for reason, n in counts.items() if reason in drop)
            if marker is not None:
                kept = marker.kept
                dropped_share = 1 - kept / marker.trials if kept is not None and marker.trials else None
            else:
                dropped_share = dropped / trials if trials else None
            steps.append(
                OutcomeStep(
                    step=step,
                    committed=step in committed,
                    trials=trials,
                    by_reason=dict(counts),
                    dropped=dropped,
                    dropped_share=dropped_share,
                    zero_variance_groups=marker.zero_variance_groups if marker else None,
                    groups=marker.groups if marker else None,
                    infra_failures=sum(n for reason, n in counts.items() if reason in INFRA),
                )
            )
        evals = [
            EvalOutcome(step=e.step, by_reason=e.by_reason, trials=e.trials) for e in self.eval_summaries()
        ]
        return Outcomes(reasons=REASONS, infra=INFRA, drop_reasons=sorted(drop), steps=steps, evals=evals)

    def task_grid(self) -> TaskGrid:
        """Per-task solve rate (mean reward) across steps, training and held-out."""
        return self.memo("task_grid", (self._trial_keys()[1]), self._task_grid)

    def _task_grid(self) -> TaskGrid:
        cells: dict[tuple[str, str, int], list[float | None]] = {}
        for r in self.trials():
            t = r.summary
            cells.setdefault((t.split, t.task_id, t.step), []).append(r.reward)
        out: dict[str, dict[str, dict[str, TaskCell]]] = {"train": {}, "validation": {}}
        steps: dict[str, set[int]] = {"train": set(), "validation": set()}
        for (split, task, step), rewards in cells.items():
            scored = [x for x in rewards if x is not None]
            out[split].setdefault(task, {})[str(step)] = TaskCell(
                n=len(rewards),
                scored=len(scored),
                mean=sum(scored) / len(scored) if scored else None,
                solved=sum(1 for x in scored if x >= 1.0),
            )
            steps[split].add(step)
        grids = {
            split: SplitGrid(
                steps=sorted(steps[split]),
                tasks=[
                    TaskRow(
                        task=task,
                        cells=row,
                        mean=_mean([c.mean for c in row.values() if c.mean is not None]),
                    )
                    for task, row in sorted(out[split].items())
                ],
            )
            for split in ("train", "validation")
        }
        return TaskGrid(train=grids["train"], validation=grids["validation"])

    def stage_stats(self) -> dict[str, StageStat]:
        """Sandbox stage timings over all trials: p50 / p95 / max per stage, and per termination reason."""
        return self.memo("stage_stats", (self._trial_keys()[1]), self._stage_stats)

    def _stage_stats(self) -> dict[str, StageStat]:
        stages: dict[str, list[float]] = {}
        for r in self.trials():
            for stage, seconds in r.summary.stage_seconds.items():
                if isinstance(seconds, (int, float)):
                    stages.setdefault(stage, []).append(float(seconds))
        return {
            stage: StageStat(
                n=len(v),
                p50=_percentile(v, 0.5),
                p95=_percentile(v, 0.95),
                max=max(v),
                mean=statistics.fmean(v),
            )
            for stage, v in sorted(stages.items())
        }

    # --- one trial, with its tokens -------------------------------------------------------------------
    def token_text(self) -> TokenText | None:
        candidates: list[Path] = []
        if self._tokenizer_path is not None:
            candidates.append(self._tokenizer_path)
        if self.root is not None:
            for version in reversed(self.published_versions()):
                candidates.append(self.root / StoreLayout.weights(version) / "tokenizer.json")
            policy: PolicySpec | None = self.spec_field("policy")
            uri = policy.checkpoint.uri if policy else None
            if uri is not None and (uri.startswith("/") or uri.startswith("file://")):
                candidates.append(Path(uri.removeprefix("file://")) / "tokenizer.json")
        found = next((p for p in candidates if p.is_file()), None)
        key = str(found) if found else ""
        with self._lock:
            if self._token_text is not None and self._token_text[0] == key:
                return self._token_text[1]
        loaded = load_token_text(found) if found else None
        with self._lock:
            self._token_text = (key, loaded)
        return loaded

    def trial_record(self, trial: str) -> TrialRecord:
        """The full stored record of one trial (with its segments)."""
        if not _TRIAL_ID_RE.fullmatch(trial):
            raise NotFound(f"no trial {trial!r} in run {self.name()!r}")
        found = self.trial_index().get(trial)
        if found is None:
            raise NotFound(f"no trial {trial!r} in run {self.name()!r}")
        split, step = found.summary.split, found.summary.step
        saved = StoreLayout.saved_trial(split, step, trial)
        table: pa.Table | None = None
        try:
            with self.store.fs.open(self.store.fs_path(saved), "rb") as f:
                table = pq.read_table(f)
        except FileNotFoundError:
            table = None
        if table is None and found.committed:
            path = self.store.fs_path(StoreLayout.batch_trials(step))
            with self.store.fs.open(path, "rb") as f:
                table = pq.read_table(f, filters=[("trial", "=", trial)])
        if table is None or table.num_rows == 0:
            raise NotFound(f"trial {trial!r} is listed but its record is gone from {self.uri}")
        try:
            return trials_from_table(table.slice(0, 1))[0]
        except (SchemaVersionError, TrajectoryError) as exc:
            raise StoreError(f"{saved}: {exc}") from exc

    def trajectory(self, trial: str) -> Trajectory:
        """One trial turn by turn, with every token's text, loss mask, behaviour log-prob and routing."""
        record = self.trial_record(trial)
        tok = self.token_text()
        trained, train_note = self._training_logprobs(record)
        segments = []
        total = 0
        truncated = False
        for seg in record.segments:
            ids = list(seg.token_ids)
            if total + len(ids) > _MAX_TOKENS:
                ids = ids[: max(0, _MAX_TOKENS - total)]
                truncated = True
            total += len(ids)
            n = len(ids)
            mask = list(seg.loss_mask)[:n]
            logprobs = [float(x) for x in list(seg.behavior_logprobs)[:n]]
            text = tok.pieces(ids) if tok is not None else None
            experts = _routing(seg, n)
            train = trained.get(seg.index) if trained else None
            train = train[:n] if train is not None and len(train) >= n else None
            segments.append(
                SegmentView(
                    index=seg.index,
                    policy_versions=list(seg.policy_versions),
                    turns=_turns(
                        ids=ids,
                        mask=mask,
                        logprobs=logprobs,
                        text=text,
                        experts=experts,
                        turn_indices=list(seg.turn_indices),
                        train=train,
                    ),
                    tokens=n,
                    sampled=sum(mask),
                    routing=None if experts is None else Routing(layers=experts[1], top_k=experts[2]),
                    training_logprobs=(
                        None
                        if train is None
                        else TrainingLogprobs(
                            step=record.step,
                            policy_version=f"v{record.step - 1}",
                            tokens=sum(v is not None for v in train),
                        )
                    ),
                )
            )
            if truncated:
                break
        return Trajectory(
            trial=_trial_row(record),
            tokenizer=tok.source if tok is not None else None,
            segments=segments,
            truncated=truncated,
            training_logprobs_note=train_note,
        )

    def _training_logprobs(self, record: TrialRecord) -> tuple[dict[int, list[float | None]], str]:
        """The trainer's per-token log-probs of a training trial (by segment), and a note on why there are
        none when there are none."""
        if record.split != "train":
            return {}, "held-out trials are never trained on: there are no training log-probs to compare"
        step = record.step
        try:
            stored = self.store.read_token_logprobs(step, record.trial)
        except StoreError as exc:
            return {}, f"the training log-probs of step {step} are unreadable: {exc}"
        if stored is None:
            return {}, (
                f"the trainer recorded no per-token log-probs for step {step} (not trained yet, skipped, or "
                "a trainer before they were recorded); the curves' fidelity figures summarise the step"
            )
        if not stored:
            return {}, f"this trial was not trained on in step {step} (the filter dropped it or its group)"
        return stored, (
            f"training log-probs: the weights step {step} started from (v{step - 1}), scored by the trainer"
        )


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _routing(seg: Segment, n: int) -> tuple[list[list[list[int]]], int, int] | None:
    """Per token (the first `n`), the experts each layer routed it to (row i is token i; the last token has
    none)."""
    routed = seg.routed_experts
    if routed is None:
        return None
    _, layers, top_k = routed.shape
    # Lists for the JSON answer: only the rows shown, never the training path.
    return routed[: max(min(routed.shape[0], n), 0)].tolist(), int(layers), int(top_k)


def _turns(
    *,
    ids: list[int],
    mask: list[int],
    logprobs: list[float],
    text: list[str] | None,
    experts: tuple[list[list[list[int]]], int, int] | None,
    turn_indices: list[int],
    train: list[float | None] | None = None,
) -> list[TurnView]:
    """Split a segment into turns: each is the context the model was shown (mask 0) and its sampled
    completion (mask 1)."""
    runs: list[tuple[int, int, int]] = []  # (mask, start, end)
    start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or mask[i] != mask[start]:
            runs.append((mask[start], start, i))
            start = i
    turns: list[TurnView] = []
    pending: tuple[int, int] | None = None
    turn_no = 0

    def part(kind: Literal["context", "completion"], a: int, b: int) -> Part:
        # Built from a typed Segment: validating every token of a long trajectory again would cost more
        # than the rest of the answer.
        return Part.model_construct(
            kind=kind,
            start=a,
            ids=ids[a:b],
            text=text[a:b] if text is not None else None,
            mask=mask[a:b],
            logprobs=logprobs[a:b],
            experts=experts[0][a:b] if experts is not None else None,
            train=train[a:b] if train is not None else None,
        )

    for m, a, b in runs:
        if m == 0:
            pending = (a, b)
            continue
        parts = []
        if pending is not None:
            parts.append(part("context", *pending))
            pending = None
        parts.append(part("completion", a, b))
        completion = "".join(text[a:b]) if text is not None else ""
        turns.append(
            TurnView(
                turn=turn_indices[turn_no] if turn_no < len(turn_indices) else None,
                parts=parts,
                tool_calls=_tool_calls(completion),
                tokens=b - a,
                mean_logprob=statistics.fmean(logprobs[a:b]) if b > a else None,
            )
        )
        turn_no += 1
    if pending is not None:
        turns.append(
            TurnView(turn=None, parts=[part("context", *pending)], tool_calls=[], tokens=0, mean_logprob=None)
        )
    return turns


def _tool_calls(text: str) -> list[ToolCall]:
    """Tool calls in a completion, in the hermes format the tiny policies and Qwen models use."""
    calls = []
    for body in _TOOL_CALL_RE.findall(text):
        try:
            obj = json.loads(body)
        except ValueError:
            calls.append(ToolCall(name=None, arguments=body, valid=False))
            continue
        if isinstance(obj, dict):
            args = obj.get("arguments")
            calls.append(
                ToolCall(
                    name=str(obj.get("name")) if obj.get("name") is not None else None,
                    arguments=args if isinstance(args, str) else json.dumps(args, indent=1),
                    valid=True,
                )
            )
    return calls

"""RunFacts: a plain, JSON-able snapshot of one run that the diagnostic rules read (store, spec, cluster).

`RunFacts.from_store` reads the run store once: every committed batch's small columns (never the token
arrays), the trainer's per-step figures, the evaluations, the weight publications and the trials saved
for steps not committed yet; the RLRun spec's thresholds; and, on a cluster, the trial and fleet pods
and their events. Tests build `RunFacts` directly.

What the store does not record is left `None` rather than guessed (see docs/diagnostics.md, "Signals
the store lacks"): the proxy's engine retries, and tool-call counts of trials recorded before
`TrialRecord.tool_call_turns` existed.
"""

from __future__ import annotations

import json
import math
import posixpath
from collections import Counter
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from functools import cached_property
from typing import Any, Final, Literal

import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, Field

from legorl.api.figures import EvalSummary, StepFigures
from legorl.api.lenient import partial
from legorl.api.run import (
    Algorithm,
    FidelityGuard,
    RLRunSpec,
    Schedule,
    StopConditions,
    TrainerSpec,
    TrajectoryFilter,
)
from legorl.api.store import RunStore, StoreError, StoreLayout, parse_policy_version
from legorl.api.termination import INFRA_REASONS
from legorl.api.timestamps import parse_time
from legorl.api.trajectory import (
    OPTIONAL_COLUMNS,
    SUMMARY_COLUMNS,
    TRIAL_SCHEMA,
    SchemaVersionError,
    TrialSummary,
    check_schema,
)
from legorl.api.weights import PublishedWeights

__all__ = [
    "AGENT_STAGES",
    "ContainerFacts",
    "EvalFacts",
    "EventFacts",
    "PodFacts",
    "RunFacts",
    "SpecFacts",
    "StepFacts",
    "TrialFacts",
]

AGENT_STAGES: Final = frozenset({"agent", "verify"})
"""Trial stages after the sandbox started; every other recorded stage (`setup`, `proxy_start`,
`agent_start` on the local backend; `setup` on pods, from pod start to agent start, which holds
scheduling and image pulls) counts towards the sandbox's start time."""

ERROR_CHARS: Final = 1000
"""Trial errors are kept up to this many characters (the store keeps 4000)."""


class _Facts(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TrialFacts(_Facts):
    """One finished trial, without its tokens."""

    trial: str
    step: int
    split: Literal["train", "validation"] = "train"
    task_id: str = ""
    group_id: str = ""
    termination_reason: str = "completed"
    """A `TerminationReason` value (DESIGN §5)."""
    reward: float | None = None
    num_turns: int = 0
    """Model calls the proxy journaled."""
    tool_calls: int | None = None
    """Turns the engine answered with parsed tool calls (`TrialRecord.tool_call_turns`). None: not
    recorded (a store written before the column existed, or a trial without a proxy trajectory)."""
    policy_versions: list[str] = Field(default_factory=list)
    """Every policy version the trial's turns saw."""
    stage_seconds: dict[str, float] = Field(default_factory=dict)
    started_at: datetime | None = None
    ended_at: datetime | None = None
    tamper_kinds: list[str] = Field(default_factory=list)
    """Kinds of the trial's tamper findings (`TAMPER_KINDS`), one per finding."""
    error: str | None = None
    """Why the trial failed, as the backend recorded it (first `ERROR_CHARS` characters)."""

    @property
    def infra(self) -> bool:
        """Ended for an infrastructure reason (says nothing about the policy)."""
        return self.termination_reason in INFRA_REASONS

    @property
    def start_seconds(self) -> float | None:
        """Seconds the sandbox took to start (stages before the agent), None when none was recorded."""
        parts = [v for k, v in self.stage_seconds.items() if k not in AGENT_STAGES]
        return sum(parts) if parts else None

    @property
    def oldest_version(self) -> int | None:
        """The oldest policy version the trial saw, None when it saw none or only unparsable ones."""
        steps = []
        for version in self.policy_versions:
            try:
                steps.append(parse_policy_version(version))
            except ValueError:
                continue
        return min(steps) if steps else None


class StepFacts(_Facts):
    """One training step: its trials, the controller's commit, the trainer's figures."""

    step: int
    committed: bool = True
    """False for a step whose trials are still coming in (read from the saved trials)."""
    policy_version: str | None = None
    """The version the step's trials were launched with (the commit's)."""
    committed_at: datetime | None = None
    meta: dict[str, Any] = Field(default_factory=dict)
    """The controller's commit meta (reward_mean, zero_variance_groups, by_reason, ...)."""
    metrics: dict[str, float | int | str | None] = Field(default_factory=dict)
    """The trainer's figures of the step (empty before the trainer trained it)."""
    published_at: datetime | None = None
    """When policy version `v<step>` (the step's result) was published; its weight sync follows."""
    trials: list[TrialFacts] = Field(default_factory=list)

    @cached_property
    def figures(self) -> StepFigures:
        """The trainer's figures, typed (every figure None before the trainer trained the step)."""
        return StepFigures.from_json({**self.metrics, "step": self.step})

    def metric(self, name: str) -> float | None:
        """A numeric figure by name (for figures a newer trainer added; the rules read `figures`), None
        when absent, not a number or not finite."""
        value = self.metrics.get(name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return None
        return float(value)

    @property
    def by_reason(self) -> dict[str, int]:
        return dict(Counter(t.termination_reason for t in self.trials))


class EvalFacts(_Facts):
    """One held-out evaluation (`evals/step-N.json`)."""

    step: int
    solve_rate: float | None = None
    trials: int = 0
    scored: int = 0
    infra_failures: int = 0
    by_reason: dict[str, int] = Field(default_factory=dict)


class SpecFacts(_Facts):
    """The RLRun settings the rules compare against (API defaults where the spec leaves them out)."""

    min_correlation: float = float(FidelityGuard().min_correlation)
    window_steps: int = FidelityGuard().window_steps
    fidelity_action: str = FidelityGuard().action
    schedule_mode: Literal["Sync", "Async"] = Schedule().mode
    max_staleness_steps: int | None = None
    group_size: int = Algorithm().group_size
    tasks_per_step: int = Algorithm().tasks_per_step
    mini_batches: int = Algorithm().mini_batches
    importance_mode: str = Algorithm().importance_correction.mode
    temperature: float = float(Algorithm().sampling.temperature)
    top_p: float = float(Algorithm().sampling.top_p)
    drop_reasons: list[str] = Field(default_factory=lambda: [str(r) for r in TrajectoryFilter().drop_reasons])
    zero_variance_groups: str = TrajectoryFilter().zero_variance_groups
    max_infra_failure_percent: int = StopConditions(max_steps=1).max_infra_failure_percent
    harness: str | None = None
    max_turns: int | None = None
    trainer_dtype: str = TrainerSpec().dtype
    routing_replay: str = TrainerSpec().routing_replay
    fleet_dtype: str | None = None
    """None when the run uses a shared fleet (fleetRef): its settings are not in the run."""
    routed_experts_capture: str | None = None
    prefix_caching: str | None = None
    tool_call_parser: str | None = None
    weight_sync_pause_mode: str | None = None
    pre_pull_policy: str | None = None
    runtime_class_name: str | None = None

    @property
    def staleness_limit(self) -> int:
        """Policy versions a trained trial may lag: 0 in Sync mode, maxStalenessSteps (default 1) in Async."""
        return 0 if self.schedule_mode == "Sync" else (self.max_staleness_steps or 1)

    @classmethod
    def from_run(cls, run: Mapping[str, Any] | None) -> SpecFacts:
        """Read an RLRun (Kubernetes JSON) through `RLRunSpec`, leniently (`legorl.api.lenient.partial`): a
        valid spec is validated once; in an invalid or partial one each value that does not validate, and
        each one left out, keeps the API default, and the others are read."""
        spec = partial(RLRunSpec, _dict((run or {}).get("spec")))
        algo, filt, trainer = spec.algorithm, spec.filter, spec.trainer
        harness = _given(spec, "harness")
        # Only an inline fleet or pool has its settings in the run; a shared one's (fleetRef, poolRef) leave
        # their facts None.
        inline: dict[str, Any] = {}
        if spec.fleet is not None:
            engine = spec.fleet.settings
            inline.update(
                fleet_dtype=engine.dtype,
                routed_experts_capture=engine.routed_experts_capture,
                prefix_caching=engine.prefix_caching,
                tool_call_parser=engine.tool_call_parser,
                weight_sync_pause_mode=spec.fleet.weight_sync.pause_mode,
            )
        if spec.pool is not None:
            inline.update(
                pre_pull_policy=spec.pool.pre_pull.policy, runtime_class_name=spec.pool.runtime_class_name
            )
        return cls(
            min_correlation=float(spec.fidelity.min_correlation),
            window_steps=spec.fidelity.window_steps,
            fidelity_action=spec.fidelity.action,
            schedule_mode=spec.schedule.mode,
            max_staleness_steps=spec.schedule.max_staleness_steps,
            group_size=algo.group_size,
            tasks_per_step=algo.tasks_per_step,
            mini_batches=algo.mini_batches,
            importance_mode=algo.importance_correction.mode,
            temperature=float(algo.sampling.temperature),
            top_p=float(algo.sampling.top_p),
            drop_reasons=[str(r) for r in filt.drop_reasons],
            zero_variance_groups=filt.zero_variance_groups,
            max_infra_failure_percent=spec.stop.max_infra_failure_percent,
            harness=_given(harness, "kind"),
            # None, not the API's 100, when the spec leaves it out: the rules then name no number.
            max_turns=_given(harness, "max_turns"),
            trainer_dtype=trainer.dtype,
            routing_replay=trainer.routing_replay,
            **inline,
        )


class ContainerFacts(_Facts):
    """One (init) container of a pod, as the kubelet reports it."""

    name: str
    image: str = ""
    init: bool = False
    waiting_reason: str | None = None
    waiting_message: str | None = None
    terminated_reason: str | None = None
    exit_code: int | None = None
    restarts: int = 0


class PodFacts(_Facts):
    """A trial, verify, pre-pull or engine pod."""

    name: str
    namespace: str = ""
    phase: str = ""
    node: str | None = None
    created_at: datetime | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    containers: list[ContainerFacts] = Field(default_factory=list)

    @classmethod
    def from_object(cls, pod: Mapping[str, Any]) -> PodFacts:
        """From a Pod as the API server returns it (JSON)."""
        meta, spec, status = _dict(pod.get("metadata")), _dict(pod.get("spec")), _dict(pod.get("status"))
        images = {
            str(c.get("name")): str(c.get("image") or "")
            for key in ("initContainers", "containers")
            for c in _list(spec.get(key))
        }
        containers = []
        for key, init in (("initContainerStatuses", True), ("containerStatuses", False)):
            for item in _list(status.get(key)):
                state = _dict(item.get("state"))
                waiting, terminated = _dict(state.get("waiting")), _dict(state.get("terminated"))
                name = str(item.get("name") or "")
                containers.append(
                    ContainerFacts(
                        name=name,
                        image=str(item.get("image") or images.get(name, "")),
                        init=init,
                        waiting_reason=_str(waiting.get("reason")),
                        waiting_message=_str(waiting.get("message")),
                        terminated_reason=_str(terminated.get("reason")),
                        exit_code=_int(terminated.get("exitCode"), None),
                        restarts=_int(item.get("restartCount"), 0) or 0,
                    )
                )
        labels = {str(k): str(v) for k, v in _dict(meta.get("labels")).items()}
        return cls(
            name=str(meta.get("name") or ""),
            namespace=str(meta.get("namespace") or ""),
            phase=str(status.get("phase") or ""),
            node=_str(spec.get("nodeName")),
            created_at=parse_time(meta.get("creationTimestamp")),
            labels=labels,
            containers=containers,
        )


class EventFacts(_Facts):
    """A Kubernetes event (core/v1 or events.k8s.io/v1)."""

    reason: str = ""
    message: str = ""
    type: str = "Normal"
    kind: str = ""
    """Kind of the object the event is about."""
    name: str = ""
    """Name of the object the event is about."""
    count: int = 1
    last_seen: datetime | None = None

    @classmethod
    def from_object(cls, event: Mapping[str, Any]) -> EventFacts:
        about = _dict(event.get("involvedObject") or event.get("regarding"))
        series = _dict(event.get("series"))
        count = _int(event.get("count"), None) or _int(series.get("count"), None)
        count = count or _int(event.get("deprecatedCount"), None) or 1
        seen = (
            parse_time(series.get("lastObservedTime"))
            or parse_time(event.get("lastTimestamp"))
            or parse_time(event.get("eventTime"))
            or parse_time(event.get("firstTimestamp"))
            or parse_time(_dict(event.get("metadata")).get("creationTimestamp"))
        )
        return cls(
            reason=str(event.get("reason") or ""),
            message=str(event.get("message") or event.get("note") or ""),
            type=str(event.get("type") or "Normal"),
            kind=str(about.get("kind") or ""),
            name=str(about.get("name") or ""),
            count=count,
            last_seen=seen,
        )


class RunFacts(_Facts):
    """Everything the diagnostic rules look at, as plain data."""

    run: str = ""
    now: datetime = Field(default_factory=lambda: datetime.now(UTC))
    spec: SpecFacts = Field(default_factory=SpecFacts)
    steps: list[StepFacts] = Field(default_factory=list)
    """Training steps, ascending: committed ones, then any still collecting trials."""
    evals: list[EvalFacts] = Field(default_factory=list)
    pods: list[PodFacts] = Field(default_factory=list)
    events: list[EventFacts] = Field(default_factory=list)

    @property
    def committed(self) -> list[StepFacts]:
        return [s for s in self.steps if s.committed]

    def trials(self) -> list[TrialFacts]:
        """Every training trial, by step."""
        return [t for s in self.steps for t in s.trials]

    @classmethod
    def from_store(
        cls,
        store: RunStore,
        *,
        run: Mapping[str, Any] | None = None,
        pods: Sequence[Mapping[str, Any]] = (),
        events: Sequence[Mapping[str, Any]] = (),
        now: datetime | None = None,
    ) -> RunFacts:
        """Read a run's facts from its store (and the cluster objects the caller fetched).

        `run`: the RLRun as JSON; None reads the one the store recorded (`run.json`). Each committed
        batch is read once, only its small columns (a batch's checksum covers the whole file and is
        the trainer's to verify; diagnostics never reads the token arrays).
        """
        body = run if run is not None else store.read_run_spec()
        metrics = {m.step: m.to_json() for m in store.step_figures()}
        published = _published_times(store)
        steps = []
        committed = store.committed_steps()
        for step in committed:
            ref = store.batch_ref(step)
            rows = _read_trials(store, StoreLayout.batch_trials(step))
            steps.append(
                StepFacts(
                    step=step,
                    policy_version=ref.policy_version,
                    committed_at=parse_time(ref.created_at),
                    meta=ref.meta,
                    metrics=_scalars(metrics.get(step, {})),
                    published_at=published.get(step),
                    trials=rows,
                )
            )
        done = set(committed)
        for step in store.saved_steps("train"):
            if step in done:
                continue
            paths = store.fs.glob(store.fs_path(f"{StoreLayout.trials('train', step)}/*.parquet"))
            rows = [row for path in sorted(paths) for row in _read_trials(store, path)]
            steps.append(
                StepFacts(step=step, committed=False, metrics=_scalars(metrics.get(step, {})), trials=rows)
            )
        steps.sort(key=lambda s: s.step)
        name = str(_dict(_dict(body).get("metadata")).get("name") or "")
        return cls(
            run=name,
            now=now or datetime.now(UTC),
            spec=SpecFacts.from_run(body),
            steps=steps,
            evals=[_eval(e) for e in store.eval_summaries()],
            pods=[PodFacts.from_object(p) for p in pods],
            events=[EventFacts.from_object(e) for e in events],
        )


def _read_trials(store: RunStore, path: str) -> list[TrialFacts]:
    """The small columns of one trial table (a batch, or one saved trial)."""
    try:
        with store.fs.open(store.fs_path(path), "rb") as f:
            parquet = pq.ParquetFile(f)
            check_schema(parquet.schema_arrow, TRIAL_SCHEMA)
            present = set(parquet.schema_arrow.names)
            # Optional columns (absent from older tables) are read when there.
            table = parquet.read(columns=[*SUMMARY_COLUMNS, *(c for c in OPTIONAL_COLUMNS if c in present)])
    except (OSError, SchemaVersionError, ValueError) as exc:
        raise StoreError(f"{store.url(path)} cannot be read for diagnostics: {exc}") from exc
    return [_trial(row) for row in table.to_pylist()]


def _trial(row: Mapping[str, Any]) -> TrialFacts:
    t = TrialSummary.from_row(row)
    return TrialFacts(
        trial=t.trial,
        step=t.step,
        split=t.split,
        task_id=t.task_id,
        group_id=t.group_id,
        termination_reason=t.termination_reason.value,
        reward=t.reward,
        num_turns=t.num_turns,
        policy_versions=t.policy_versions,
        stage_seconds=t.stage_seconds,
        started_at=t.started_at,
        ended_at=t.ended_at,
        tamper_kinds=[f.kind for f in t.tamper_findings],
        error=t.error[:ERROR_CHARS] if t.error else None,
        tool_calls=t.tool_call_turns,
    )


def _published_times(store: RunStore) -> dict[int, datetime]:
    """Publication time of each policy version, by step (one listing, one read per marker)."""
    store.fs.invalidate_cache()
    paths = store.fs.glob(store.fs_path(StoreLayout.weights_marker("*")))
    out: dict[int, datetime] = {}
    if not paths:
        return out
    for path, data in store.fs.cat(paths, on_error="omit").items():
        name = posixpath.basename(posixpath.dirname(str(path)))
        try:
            step = parse_policy_version(name)
            marker = PublishedWeights.from_json(json.loads(data))
        except ValueError:
            continue
        when = parse_time(marker.published_at)
        if when is not None:
            out[step] = when
    return out


def _eval(summary: EvalSummary) -> EvalFacts:
    return EvalFacts(
        step=summary.step,
        solve_rate=summary.solve_rate,
        trials=summary.trials,
        scored=summary.scored,
        infra_failures=summary.infra_failures,
        by_reason=dict(summary.by_reason),
    )


def finite(value: float | None) -> float | None:
    """`value` when it is a finite number, else None (a figure NaN or absent says nothing)."""
    return float(value) if value is not None and math.isfinite(value) else None


def _scalars(metrics: Mapping[str, Any]) -> dict[str, float | int | str | None]:
    return {
        str(k): v
        for k, v in metrics.items()
        if k != "step" and (v is None or isinstance(v, (int, float, str))) and not isinstance(v, bool)
    }


def _given(model: BaseModel | None, name: str) -> Any:
    """MODEL's field NAME when the document gave it (a valid value), else None (not the API default)."""
    return getattr(model, name) if model is not None and name in model.model_fields_set else None


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _list(value: Any) -> list[dict[str, Any]]:
    return [v for v in value if isinstance(v, dict)] if isinstance(value, list) else []


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _int(value: Any, default: int | None) -> int | None:
    if isinstance(value, bool):
        return default
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            return default
    return default

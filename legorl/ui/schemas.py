"""The UI's JSON answers, one model per endpoint: the shape of every `/api/*` response, declared once.

Starlette has no response models, so the server's `_api` wraps each handler: a handler returns one of these,
and its answer is `to_json` of it. A field without a default is in every answer; a field with one is in an
answer only when the handler set it (the JSON keeps the keys it always had, present or absent). Parts of the
custom resources are their `legorl.api` types (camelCase, as the API server holds them); documents shown as
they are (a spec, a status, a controller snapshot) are plain JSON objects.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from legorl.api.common import Condition
from legorl.api.pool import NodeImageStatus, SelfTest
from legorl.api.run import PreflightResult
from legorl.api.run import ValidationCheck as RunValidationCheck

__all__ = [
    "ActionDone",
    "CheckView",
    "Compare",
    "ComparedRun",
    "Curves",
    "Diagnostics",
    "EngineFigures",
    "EventView",
    "Fleet",
    "Health",
    "Info",
    "Outcomes",
    "Overview",
    "PodRow",
    "PoolView",
    "Replica",
    "RuleDoc",
    "Rules",
    "RunRow",
    "RunSummary",
    "Runs",
    "Sandboxes",
    "Schema",
    "StageStat",
    "StoreCondition",
    "StoreOverview",
    "TaskGrid",
    "Trajectory",
    "TrialPage",
    "TrialRow",
    "ValidationView",
    "given",
    "to_json",
    "to_json_bytes",
]


class Schema(BaseModel):
    """Base of the UI's answers: every key declared (an undeclared one is an error)."""

    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="null")


def to_json(answer: BaseModel) -> Any:
    """`answer` as JSON values: the fields set, camelCase where a resource's part is (NaN stays NaN)."""
    return answer.model_dump(mode="python", by_alias=True, exclude_unset=True)


def to_json_bytes(answer: BaseModel) -> bytes:
    """`to_json(answer)` as the UI sends it: compact ASCII JSON that every browser parses (NaN and the
    infinities as null; a value JSON has no type for as its `str`)."""
    return answer.model_dump_json(by_alias=True, exclude_unset=True, ensure_ascii=True, fallback=str).encode()


def given(model: BaseModel) -> dict[str, Any]:
    """The fields of `model` that were set, by name (to carry them into a larger answer)."""
    return {name: getattr(model, name) for name in model.model_fields_set}


# --- conditions -------------------------------------------------------------------------------------------
class StoreCondition(Schema):
    """A condition the UI derives from a run store alone (no cluster writes any for a local run)."""

    model_config = ConfigDict(extra="forbid", validate_by_name=True, validate_by_alias=True)

    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str
    message: str | None
    last_transition_time: str | None = Field(alias="lastTransitionTime")
    """When the controller last wrote its progress."""
    source: Literal["store"]


Conditions = list[Condition | StoreCondition]
"""A run's conditions: its RLRun's (cluster runs), or those its store shows."""


# --- /healthz, /api/info, /api/rules ---------------------------------------------------------------------
class Health(Schema):
    ok: bool


class Info(Schema):
    version: str
    cluster: bool
    """Whether this UI reads a cluster."""
    namespaces: list[str]
    actions_enabled: bool
    actions: list[str]
    reasons: list[str]
    """Termination reasons, in their documented order."""
    static: bool
    """True in an exported page."""


class RuleDoc(Schema):
    id: str
    title: str
    doc: str


class Rules(Schema):
    available: bool
    rules: list[RuleDoc]
    note: str | None = None
    """Why the diagnostics are not available."""
    findings: list[dict[str, Any]] | None = None


# --- runs ---------------------------------------------------------------------------------------------------
class RunSummary(Schema):
    """What a run store says of its run (one row of the runs list, before the cluster's word)."""

    name: str
    store: str
    step: int
    max_steps: int | None
    policy_version: str
    reward_mean: float | None
    held_out: float | None
    held_out_interval: list[float] | None
    baseline: float | None
    fidelity: float | None
    trials_per_minute: float | None
    trials_total: int
    trials_running: int
    message: str
    degraded_reason: str | None
    updated_seconds_ago: float | None
    conditions: Conditions


class RunRow(Schema):
    """One run in the runs list: its store's summary when readable, its RLRun's status over it."""

    id: str
    name: str
    namespace: str | None
    source: Literal["cluster", "store"]
    store_note: str | None
    conditions: Conditions
    phase: str
    store: str | None = None
    step: int | None = None
    max_steps: int | None = None
    policy_version: str | None = None
    reward_mean: float | None = None
    held_out: float | None = None
    held_out_interval: list[float] | None = None
    baseline: float | None = None
    fidelity: float | None = None
    trials_per_minute: float | None = None
    trials_total: int | None = None
    trials_running: int | None = None
    message: str | None = None
    degraded_reason: str | None = None
    updated_seconds_ago: float | None = None
    reason: str | None = None
    """The reason of the condition that decided the RLRun's phase (cluster runs)."""
    suspended: bool | None = None


class Runs(Schema):
    runs: list[RunRow]
    cluster_note: str | None
    """Why the cluster could not be read."""


# --- a run's overview ---------------------------------------------------------------------------------------
class CheckView(Schema):
    """One check of a canary, as the run store's report has it."""

    check: str
    result: str
    message: str | None = None


class ValidationView(Schema):
    """The last canary: the RLRun's status (`source` cluster) or the run store's report (`source` store)."""

    source: Literal["cluster", "store"]
    state: str | None
    time: str | None
    trial: str | None
    checks: list[RunValidationCheck | CheckView]
    seconds: float | None = None
    requested: str | None = None
    message: str | None = None


class BatchView(Schema):
    """A committed batch, as its COMMIT.json describes it."""

    step: int
    policy_version: Any
    num_trials: Any
    created_at: Any
    size: Any
    meta: dict[str, Any]


class EventView(Schema):
    """A Kubernetes event about the run, its fleet or its pool."""

    kind: str
    object: str
    type: str | None
    reason: str | None
    message: str | None
    count: int | None
    time: str | None


class StoreOverview(Schema):
    """What a run store says of its run, for the overview."""

    name: str
    store: str
    spec: dict[str, Any] | None
    """run.json: the RLRun the run started from."""
    progress: dict[str, Any]
    """The controller's snapshot (controller/state.json), with the store's step and version beside it."""
    trainer: dict[str, Any] | None
    batches: list[BatchView]
    evals: list[dict[str, Any]]
    published_versions: list[str]
    conditions: Conditions
    validation: ValidationView | None


class Overview(Schema):
    """A run's overview: its row, its store's word, and its RLRun's (cluster runs)."""

    run: RunRow
    spec: dict[str, Any] | None
    """The RLRun as the API server holds it (cluster runs), else the store's run.json."""
    conditions: Conditions
    preflight: list[PreflightResult]
    events: list[EventView]
    name: str | None = None
    store: str | None = None
    progress: dict[str, Any] | None = None
    trainer: dict[str, Any] | None = None
    batches: list[BatchView] | None = None
    evals: list[dict[str, Any]] | None = None
    published_versions: list[str] | None = None
    validation: ValidationView | None = None
    status: dict[str, Any] | None = None
    """The RLRun's status as the API server holds it."""


# --- curves, outcomes, tasks --------------------------------------------------------------------------------
class Series(Schema):
    key: str
    label: str
    group: str
    points: list[tuple[int, float]]
    """(step, value)."""


class HeldOutPoint(Schema):
    step: int
    rate: float | None
    low: float | None
    high: float | None
    scored: int
    policy_version: str | None


class Curves(Schema):
    series: list[Series]
    held_out: list[HeldOutPoint]


class OutcomeStep(Schema):
    step: int
    committed: bool
    trials: int
    by_reason: dict[str, int]
    dropped: int
    dropped_share: float | None
    zero_variance_groups: int | None
    groups: int | None
    infra_failures: int


class EvalOutcome(Schema):
    step: int
    by_reason: dict[str, int]
    trials: int


class Outcomes(Schema):
    reasons: list[str]
    infra: list[str]
    drop_reasons: list[str]
    steps: list[OutcomeStep]
    evals: list[EvalOutcome]


class TaskCell(Schema):
    n: int
    scored: int
    mean: float | None
    solved: int


class TaskRow(Schema):
    task: str
    cells: dict[str, TaskCell]
    """By step."""
    mean: float | None


class SplitGrid(Schema):
    steps: list[int]
    tasks: list[TaskRow]


class TaskGrid(Schema):
    train: SplitGrid
    validation: SplitGrid


# --- trials ----------------------------------------------------------------------------------------------
class TamperView(Schema):
    kind: str
    detail: str
    path: str | None


class TrialRow(Schema):
    """A trial as the lists show it (`legorl.api.trajectory.TrialSummary`, plus where it was read from)."""

    trial: str
    task_id: str
    group_id: str
    split: Literal["train", "validation"]
    step: int
    harness: str
    termination_reason: str
    reward: float | None
    tamper_findings: list[TamperView]
    policy_versions: list[str]
    num_turns: int
    merged_turn_share: float | None
    stage_seconds: dict[str, float]
    started_at: str | None
    ended_at: str | None
    duration: float
    error: str | None
    committed: bool | None = None
    """Read from a committed batch (lists only)."""


class TrialPage(Schema):
    total: int
    offset: int
    limit: int
    items: list[TrialRow]


class Part(Schema):
    """A stretch of a turn's tokens: the context the model was shown, or its sampled completion."""

    kind: Literal["context", "completion"]
    start: int
    ids: list[int]
    text: list[str] | None
    mask: list[int]
    logprobs: list[float]
    experts: list[list[list[int]]] | None
    """Per token, the experts each layer routed it to."""
    train: list[float | None] | None
    """Per token, the trainer's log-probability (trained tokens only)."""


class ToolCall(Schema):
    name: str | None
    arguments: str
    valid: bool


class TurnView(Schema):
    turn: int | None
    parts: list[Part]
    tool_calls: list[ToolCall]
    tokens: int
    mean_logprob: float | None


class Routing(Schema):
    layers: int
    top_k: int


class TrainingLogprobs(Schema):
    step: int
    policy_version: str
    tokens: int


class SegmentView(Schema):
    index: int
    policy_versions: list[str]
    turns: list[TurnView]
    tokens: int
    sampled: int
    routing: Routing | None
    training_logprobs: TrainingLogprobs | None


class Trajectory(Schema):
    trial: TrialRow
    tokenizer: str | None
    segments: list[SegmentView]
    truncated: bool
    training_logprobs_note: str


# --- fleet and sandboxes ------------------------------------------------------------------------------
class EngineFigures(Schema):
    """Queue and KV-cache usage from an engine's Prometheus metrics, or why there are none."""

    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None
    policy_version: str | None = None
    metrics_note: str | None = None


class Replica(EngineFigures):
    """One engine of the fleet: its endpoint, its pod, its figures."""

    name: str | None
    url: str | None
    ready: bool | None
    policy_version: str | None
    phase: str | None = None
    node: str | None = None
    restarts: int | None = None


class Fleet(Schema):
    available: bool
    replicas: list[Replica]
    trainer_policy_version: str | None = None
    published_versions: list[str] | None = None
    note: str | None = None
    source: Literal["cluster", "local"] | None = None
    name: str | None = None
    spec_replicas: int | None = None
    ready_replicas: int | None = None
    served_policy_version: str | None = None
    conditions: list[Condition] | None = None


class StageStat(Schema):
    n: int
    p50: float | None
    p95: float | None
    max: float
    mean: float


class PoolView(Schema):
    name: str
    conditions: list[Condition]
    images_desired: int
    images_cached: int
    nodes: list[NodeImageStatus]
    replicas: int
    ready_replicas: int
    leased_replicas: int
    self_test: SelfTest


class PodRow(Schema):
    name: str | None
    trial: str | None
    stage: str
    phase: str | None
    node: str | None
    started: str | None
    reason: str | None


class Sandboxes(Schema):
    available: bool
    stage_stats: dict[str, StageStat] | None = None
    source: Literal["cluster"] | None = None
    pool: PoolView | None = None
    pool_note: str | None = None
    stages: dict[str, int] | None = None
    pods: list[PodRow] | None = None
    note: str | None = None


# --- diagnostics, compare, actions -----------------------------------------------------------------------
class Diagnostics(Schema):
    available: bool
    findings: list[dict[str, Any]]
    """`legorl.diagnostics.Finding`s as JSON, worst first."""
    note: str | None = None
    store_note: str | None = None


class ComparedRun(Schema):
    run: RunRow
    curves: Curves | None


class Compare(Schema):
    runs: list[ComparedRun]


class ActionDone(Schema):
    ok: bool
    action: str
    run: str
    patch: dict[str, Any]
    """The merge patch sent to the RLRun."""

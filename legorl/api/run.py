"""RLRun: one experiment — policy, harness, tasks, algorithm, trainer, stop conditions."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Annotated, Final, Literal

from pydantic import Field, Strict

from legorl.api._base import (
    MAX_LIST,
    MAX_SHORT,
    ApiModel,
    CelRule,
    DecimalString,
    NamedList,
    Seconds,
    Text,
    UniqueList,
    exactly_one,
    rules,
)
from legorl.api.common import (
    Conditions,
    ContainerImage,
    EnvVar,
    LocalObjectReference,
    ModelSource,
    Placement,
    PodIdentity,
    ResourceRequirements,
    StorageLocation,
    TaskSetSource,
)
from legorl.api.fleet import FleetTemplate
from legorl.api.layout import ParallelLayout
from legorl.api.pool import SandboxPoolSpec
from legorl.api.termination import INFRA_REASONS, TerminationReason

HarnessKind = Literal["ClaudeCode", "Codex", "OpenCode", "OpenHands", "MiniSweAgent", "Custom"]

# The loss settings: spelled here once; the trainer's settings and loss functions import them.
AlgorithmName = Literal["GRPO", "GSPO", "PPO"]
AdvantageMode = Literal["GroupMeanStd", "GroupMean"]
ImportanceMode = Literal["Truncated", "Masked", "Disabled"]
LossAggregation = Literal["TokenMean", "SequenceMeanTokenMean", "SequenceMeanTokenSum"]
DEFAULT_CLIP: Final[Mapping[AlgorithmName, tuple[float, float]]] = MappingProxyType(
    {
        "GRPO": (0.2, 0.28),
        "PPO": (0.2, 0.28),
        # GSPO's ratio is a per-token geometric mean, so it moves far less than a token ratio;
        # the GSPO paper clips it at 3e-4 / 4e-4.
        "GSPO": (3e-4, 4e-4),
    }
)
"""(clipLow, clipHigh) per algorithm when the RLRun leaves them unset (`Algorithm.clip_low`'s doc says
the same)."""
ApiFormatName = Literal["AnthropicMessages", "OpenAIResponses", "OpenAIChatCompletions"]

NATIVE_API_FORMAT: dict[str, ApiFormatName] = {
    "ClaudeCode": "AnthropicMessages",
    "Codex": "OpenAIResponses",
    "OpenCode": "OpenAIChatCompletions",
    "OpenHands": "OpenAIChatCompletions",
    "MiniSweAgent": "OpenAIChatCompletions",
}
"""The API each known harness speaks when `apiFormat` is not set."""


class PolicySpec(ApiModel):
    """The policy being trained."""

    checkpoint: ModelSource
    """Initial weights (policy version 0), Hugging Face layout."""
    reference: ModelSource | None = None
    """Reference model for the KL term; defaults to `checkpoint`. Only loaded when klCoef > 0."""


class Harness(ApiModel):
    """The unmodified agent harness that runs inside each sandbox, talking to its proxy."""

    model_config = rules(
        CelRule(
            rule="self.kind != 'Custom' || (has(self.command) && size(self.command) > 0)",
            message="kind Custom needs command (how to start the harness)",
            field_path=".command",
            reason="FieldValueRequired",
        ),
        CelRule(
            rule="self.kind != 'Custom' || has(self.apiFormat)",
            message="kind Custom needs apiFormat (which API the harness speaks to the proxy)",
            field_path=".apiFormat",
            reason="FieldValueRequired",
        ),
        CelRule(
            rule="self.kind != 'ClaudeCode' || !has(self.apiFormat) || self.apiFormat == 'AnthropicMessages'",
            message="Claude Code only speaks AnthropicMessages",
            field_path=".apiFormat",
        ),
        CelRule(
            rule="self.kind != 'Codex' || !has(self.apiFormat) || self.apiFormat == 'OpenAIResponses'",
            message="Codex only speaks OpenAIResponses",
            field_path=".apiFormat",
        ),
    )

    kind: HarnessKind
    """Which harness: `ClaudeCode`, `Codex`, `OpenCode`, `OpenHands`, `MiniSweAgent`, or `Custom`."""
    version: Annotated[str, Field(max_length=MAX_SHORT, pattern=r"^[A-Za-z0-9._+-]+$")] | None = None
    """Harness release (npm / PyPI version); defaults to the one the operator was tested with."""
    image: ContainerImage | None = None
    """Image carrying the harness runtime, copied into the sandbox; defaults per kind."""
    command: Annotated[list[Annotated[str, Field(max_length=1024)]], Field(max_length=MAX_LIST)] | None = None
    """Command that starts the harness (required for Custom). `{prompt}` is replaced with the task."""
    api_format: ApiFormatName | None = None
    """API the harness speaks to its proxy; defaults to the harness's native one."""
    model_name: Annotated[str, Field(max_length=128, pattern=r"^[A-Za-z0-9._:/-]+$")] | None = None
    """Model name the harness is configured with (some harnesses change behaviour by name, e.g.
    Claude Code's thinking mode); the proxy serves the policy under any name."""
    max_turns: Annotated[int, Field(ge=1, le=10_000)] = 100
    """Model calls per trial before it ends as `turn_limit`."""
    env: NamedList[EnvVar] = Field(default_factory=list)
    """Extra environment for the harness (credentials for the real vendor are never needed)."""
    config_map_ref: LocalObjectReference | None = None
    """ConfigMap with harness config files, mounted read-only at /etc/legorl/harness."""


class Split(ApiModel):
    """Which tasks are held out for validation: a percentage, an explicit list, or the task set's own
    split labels; exactly one of them."""

    model_config = rules(
        *exactly_one(
            "heldOutPercent",
            "heldOutTaskIds",
            "taskSetSplit",
            hint="a share of the tasks, a list of task ids, or the task set's own split labels",
        ),
    )

    held_out_percent: Annotated[int, Field(ge=0, le=90)] | None = None
    """Share of tasks held out, chosen with `tasks.seed`."""
    held_out_task_ids: (
        Annotated[list[Annotated[str, Field(max_length=256)]], Field(max_length=10_000)] | None
    ) = None
    """Task ids held out."""
    task_set_split: Literal["validation", "test"] | None = None
    """Use the task set's own labels (each task's `legorl_split`: train, validation or test): train on
    `train` tasks only, hold out the tasks labelled with this value; tasks of the other held-out split
    never run. Choose settings with `validation`, report once with `test`."""


class TaskSelection(ApiModel):
    """The task set and how it is sampled."""

    source: TaskSetSource
    """The task-set manifest."""
    split: Split = Field(default_factory=lambda: Split(held_out_percent=10))
    """Held-out validation split."""
    seed: Annotated[int, Field(ge=0, le=2**31 - 1)] = 0
    """Seed for shuffling and the split; same seed, same order."""
    epochs: Annotated[int, Field(ge=1, le=10_000)] = 1
    """Passes over the training split."""
    max_tasks: Annotated[int, Field(ge=1, le=10_000_000)] | None = None
    """Train on at most N tasks of the training pool, sampled with `tasks.seed` (the held-out tasks
    are not capped)."""


class Sampling(ApiModel):
    """Sampling parameters for rollouts (the proxy enforces them over what the harness asks)."""

    model_config = rules(
        CelRule(
            rule="double(self.temperature) > 0.0 && double(self.temperature) <= 2.0",
            message="temperature must be in (0, 2]; RL needs stochastic samples",
            field_path=".temperature",
        ),
        CelRule(
            rule="double(self.topP) > 0.0 && double(self.topP) <= 1.0",
            message="topP must be in (0, 1]",
            field_path=".topP",
        ),
    )

    temperature: DecimalString = "1.0"
    """Sampling temperature. Importance correction assumes the proxy's temperature, not the harness's."""
    top_p: DecimalString = "1.0"
    """Nucleus sampling threshold."""
    max_tokens_per_turn: Annotated[int, Field(ge=1, le=1_048_576)] = 4096
    """Cap on completion tokens per model call."""


class ImportanceCorrection(ApiModel):
    """Token-level importance weights against the behaviour log-probs recorded at generation."""

    model_config = rules(
        CelRule(
            rule="double(self.cap) >= 1.0",
            message="cap must be at least 1.0",
            field_path=".cap",
        ),
    )

    mode: ImportanceMode = "Truncated"
    """`Truncated` clips weights at `cap` (TIS); `Masked` drops tokens above `cap` (MIS)."""
    cap: DecimalString = "2.0"
    """Upper bound of the importance weight."""


class Algorithm(ApiModel):
    """The policy-gradient algorithm and its knobs."""

    model_config = rules(
        CelRule(
            rule="self.groupSize >= 2",
            message=(
                "every algorithm here takes its baseline from the trial's group (GRPO, GSPO, and PPO's "
                "group mean): groupSize must be at least 2, or every advantage is 0 and nothing trains"
            ),
            field_path=".groupSize",
        ),
        CelRule(
            rule="double(self.learningRate) > 0.0 && double(self.learningRate) < 1.0",
            message='learningRate must be in (0, 1), e.g. "1e-6"',
            field_path=".learningRate",
        ),
        CelRule(
            rule="!has(self.clipLow) || (double(self.clipLow) > 0.0 && double(self.clipLow) < 1.0)",
            message="clipLow must be in (0, 1)",
            field_path=".clipLow",
        ),
        CelRule(
            rule="!has(self.clipHigh) || double(self.clipHigh) > 0.0",
            message="clipHigh must be positive",
            field_path=".clipHigh",
        ),
        CelRule(
            rule="double(self.klCoef) >= 0.0 && double(self.entropyCoef) >= 0.0",
            message="klCoef and entropyCoef must not be negative",
            field_path=".klCoef",
        ),
    )

    name: AlgorithmName = "GRPO"
    """`GRPO` (token-level ratio, group baseline), `GSPO` (sequence-level ratio), `PPO` (token-level
    clipped ratio with a group-mean baseline)."""
    group_size: Annotated[int, Field(ge=1, le=512)] = 8
    """Trials per task per step; their rewards form the baseline."""
    tasks_per_step: Annotated[int, Field(ge=1, le=65_536)] = 16
    """Tasks per training step; a step's batch is tasksPerStep × groupSize trials."""
    mini_batches: Annotated[int, Field(ge=1, le=1024)] = 1
    """Optimizer steps per batch (more than 1 makes later mini-batches off-policy)."""
    learning_rate: DecimalString = "1e-6"
    """Optimizer learning rate."""
    clip_low: DecimalString | None = None
    """Lower clip ε of the ratio; defaults to 0.2 (GRPO, PPO) or 3e-4 (GSPO)."""
    clip_high: DecimalString | None = None
    """Upper clip ε of the ratio; defaults to 0.28 (GRPO, PPO) or 4e-4 (GSPO)."""
    kl_coef: DecimalString = "0"
    """Weight of the KL penalty to the reference model (0 = no reference model is loaded)."""
    entropy_coef: DecimalString = "0"
    """Weight of the entropy bonus."""
    advantage: AdvantageMode = "GroupMeanStd"
    """Advantage estimate: reward minus group mean, divided by the group's std or not (Dr. GRPO)."""
    loss_aggregation: LossAggregation = "TokenMean"
    """How token losses combine into the batch loss."""
    importance_correction: ImportanceCorrection = Field(default_factory=ImportanceCorrection)
    """Correction for the gap between rollout and training probabilities."""
    sampling: Sampling = Field(default_factory=Sampling)
    """Rollout sampling."""


class Schedule(ApiModel):
    """How rollouts and training interleave."""

    model_config = rules(
        CelRule(
            rule="!has(self.maxStalenessSteps) || self.mode == 'Async'",
            message="maxStalenessSteps only applies to mode Async (Sync never trains on stale data)",
            field_path=".maxStalenessSteps",
            reason="FieldValueForbidden",
        ),
    )

    mode: Literal["Sync", "Async"] = "Sync"
    """`Sync`: trials of step N all use policy N. `Async`: trials keep running while the trainer
    updates, bounded by maxStalenessSteps."""
    max_staleness_steps: Annotated[int, Field(ge=1, le=64)] | None = None
    """Async only: drop trajectories more than this many policy versions old (default 1)."""
    max_concurrent_trials: Annotated[int, Field(ge=1, le=100_000)] = 32
    """Trials running at once."""
    warm_trials: Annotated[int, Field(ge=0, le=100_000)] = 0
    """Trials made ready ahead on a cluster: the pods of the next trials in line (the next step's too,
    while this one runs and trains) are created with every stage done but the agent's, which waits at
    a gate; launching such a trial claims its pod (the operator tells the pod's proxy to open the
    gate: milliseconds) instead of starting one (seconds: images, init stages, the proxy). Each holds
    its pod, and its resource requests, while it waits. 0: every trial pod starts when its trial is
    launched. The embedded default has no pods to warm and ignores it."""


def _default_drop() -> list[TerminationReason]:
    return sorted(INFRA_REASONS)


class TrajectoryFilter(ApiModel):
    """Which finished trials are trained on; dropped ones stay in the store for the UI."""

    drop_reasons: UniqueList[Annotated[TerminationReason, Strict(False)]] = Field(
        default_factory=_default_drop
    )
    """Termination reasons excluded from the loss. Default: the infra reasons (sandbox, engine,
    proxy, verifier, defense, cancelled)."""
    zero_variance_groups: Literal["Drop", "Keep"] = "Drop"
    """Groups whose trials all got the same reward carry no GRPO signal; `Drop` skips them."""


_RANKS_PER_NODE = (
    "(has(self.processesPerNode) ? self.processesPerNode : (self.gpusPerNode == 0 ? 1 : self.gpusPerNode))"
)
"""Trainer ranks per pod, in CEL (the default of `TrainerParallelism.layout`)."""
_WORLD = f"(self.nodes * {_RANKS_PER_NODE})"


class TrainerParallelism(ApiModel):
    """Megatron parallel layout of the trainer: `nodes` pods of ranks, split into tensor, pipeline, expert and
    data parallelism (data parallelism is what is left: ranks / (tensor × pipeline × context))."""

    model_config = rules(
        CelRule(
            rule=(
                "!has(self.processesPerNode) || self.gpusPerNode == 0 "
                "|| self.processesPerNode == self.gpusPerNode"
            ),
            message=(
                "a GPU trainer runs one rank per GPU: leave processesPerNode unset or equal to gpusPerNode"
            ),
            field_path=".processesPerNode",
        ),
        CelRule(
            rule=f"{_WORLD} % (self.tensor * self.pipeline * self.context) == 0",
            message=(
                "tensor × pipeline × context must divide the trainer ranks (nodes × ranks per node: "
                "gpusPerNode, or processesPerNode for a CPU trainer)"
            ),
            field_path=".tensor",
        ),
        CelRule(
            rule=f"self.tensor <= {_RANKS_PER_NODE}",
            message="tensor parallelism must stay within one node: tensor ≤ ranks per node",
            field_path=".tensor",
        ),
        CelRule(
            rule=f"{_WORLD} % (self.tensor * self.expert * self.pipeline) == 0",
            message=(
                "tensor × expert × pipeline must divide the trainer ranks: experts are split over ranks "
                "taken from data parallelism, each expert over the tensor-parallel ranks"
            ),
            field_path=".expert",
        ),
    )

    nodes: Annotated[int, Field(ge=1, le=4096)] = 1
    """Trainer pods (one per node)."""
    gpus_per_node: Annotated[int, Field(ge=0, le=16)] = 8
    """GPUs per trainer pod; 0 trains on CPU (tests and the embedded default)."""
    processes_per_node: Annotated[int, Field(ge=1, le=64)] | None = None
    """Trainer ranks per pod. Default: one per GPU, or 1 for a CPU trainer; a CPU trainer may run several
    (gloo) ranks to test a layout without GPUs. A GPU trainer always runs one rank per GPU."""
    tensor: Annotated[int, Field(ge=1, le=64)] = 1
    """Tensor parallel size (with sequence parallelism when above 1)."""
    pipeline: Annotated[int, Field(ge=1, le=256)] = 1
    """Pipeline parallel size (decoder layers split evenly over the stages)."""
    expert: Annotated[int, Field(ge=1, le=1024)] = 1
    """Expert parallel size (MoE): the experts of each layer split over this many ranks."""
    context: Annotated[int, Field(ge=1, le=64)] = 1
    """Context parallel size (long sequences); this trainer build needs 1 (see docs/trainer.md)."""

    def layout(self) -> ParallelLayout:
        """The ranks and parallel sizes this spec asks for."""
        ranks = self.processes_per_node or max(1, self.gpus_per_node)
        return ParallelLayout(
            nodes=self.nodes,
            ranks_per_node=ranks,
            tensor=self.tensor,
            pipeline=self.pipeline,
            expert=self.expert,
            context=self.context,
            gpus_per_node=self.gpus_per_node,
        )


class TrainerSpec(ApiModel):
    """The Megatron trainer."""

    image: ContainerImage | None = None
    """Trainer image; defaults to the operator's."""
    parallelism: TrainerParallelism = Field(default_factory=TrainerParallelism)
    """Parallel layout."""
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """Training dtype; it should match the fleet's for fidelity."""
    routing_replay: Literal["Auto", "Enabled", "Disabled"] = "Auto"
    """Replay the experts the engine routed each token to (R3). `Auto`: on for MoE checkpoints."""
    recompute: Literal["None", "Selective", "Full"] = "Selective"
    """Activation recomputation (memory vs. compute); replay holds under recomputation."""
    max_tokens_per_micro_batch: Annotated[int, Field(ge=128, le=4_194_304)] = 16_384
    """Tokens packed into one micro-batch."""
    grad_clip: DecimalString = "1.0"
    """Gradient norm clip (0 = off)."""
    weight_decay: DecimalString = "0"
    """AdamW weight decay."""
    warmup_steps: Annotated[int, Field(ge=0, le=1_000_000)] = 0
    """Linear learning-rate warm-up."""
    resources: ResourceRequirements = Field(default_factory=ResourceRequirements)
    """Resources of each trainer pod; GPUs are added from parallelism.gpusPerNode."""
    placement: Placement = Field(default_factory=Placement)
    """Node selection for trainer pods."""
    identity: PodIdentity = Field(default_factory=PodIdentity)
    """ServiceAccount and pull secrets for trainer pods."""
    restarts: Annotated[int, Field(ge=0, le=100)] = 3
    """How many times the trainer is started again after a pod of it failed (killed, OOM, a node lost),
    before the run fails with TrainerFailed; each pod of the layout may fail that often (the Job's
    backoffLimit is restarts × nodes). A new pod resumes from the last checkpoint and the run store:
    the steps it had published are trained again from their stored batches and not published again."""


class Checkpoints(ApiModel):
    """Trainer checkpoints (the weights published to the fleet are separate and always kept)."""

    interval_steps: Annotated[int, Field(ge=1, le=1_000_000)] = 50
    """Save every N steps (and at the end)."""
    keep: Annotated[int, Field(ge=1, le=1000)] = 3
    """Most recent checkpoints kept."""
    location: StorageLocation | None = None
    """Where checkpoints go; defaults to `<store>/checkpoints`."""


class StopConditions(ApiModel):
    """When the run ends; the first condition met wins."""

    model_config = rules(
        CelRule(
            rule="has(self.maxSteps) || has(self.maxDurationSeconds) || has(self.targetReward)",
            message="set at least one of maxSteps, maxDurationSeconds or targetReward",
            reason="FieldValueRequired",
        ),
        CelRule(
            rule=(
                "!has(self.targetReward) || "
                "(double(self.targetReward) > 0.0 && double(self.targetReward) <= 1.0)"
            ),
            message="targetReward is a held-out solve rate in (0, 1]",
            field_path=".targetReward",
        ),
    )

    max_steps: Annotated[int, Field(ge=1, le=10_000_000)] | None = None
    """Training steps (policy versions) to run."""
    max_duration_seconds: Seconds | None = None
    """Wall-clock limit."""
    target_reward: DecimalString | None = None
    """Stop once the held-out solve rate reaches this value."""
    max_infra_failure_percent: Annotated[int, Field(ge=1, le=100)] = 50
    """Fail the run when more than this share of a step's trials end with infra reasons."""


class Evaluation(ApiModel):
    """Periodic validation on the held-out split."""

    interval_steps: Annotated[int, Field(ge=1, le=1_000_000)] = 10
    """Validate every N steps (and at the end)."""
    trials_per_task: Annotated[int, Field(ge=1, le=64)] = 1
    """Trials per held-out task."""
    at_start: Literal["Enabled", "Disabled"] = "Enabled"
    """Score the initial policy before training (the baseline)."""


class FidelityGuard(ApiModel):
    """Pause (or alert) when rollout and training probabilities disagree."""

    model_config = rules(
        CelRule(
            rule="double(self.minCorrelation) >= 0.0 && double(self.minCorrelation) <= 1.0",
            message="minCorrelation is a Pearson correlation in [0, 1]",
            field_path=".minCorrelation",
        ),
    )

    min_correlation: DecimalString = "0.99"
    """Lowest acceptable Pearson correlation of rollout vs. training token probabilities."""
    window_steps: Annotated[int, Field(ge=1, le=1000)] = 3
    """Consecutive steps below the threshold before acting."""
    action: Literal["Pause", "Alert"] = "Pause"
    """`Pause` suspends the run and sets Degraded; `Alert` only sets Degraded."""


class RLRunSpec(ApiModel):
    """Desired state of an RLRun."""

    model_config = rules(
        *exactly_one("fleetRef", "fleet", hint="a shared RolloutFleet, or one owned by this run"),
        *exactly_one("poolRef", "pool", hint="a shared SandboxPool, or one owned by this run"),
        CelRule(
            rule=(
                "!has(self.fleet) || self.trainer.routingReplay != 'Enabled' || "
                "self.fleet.settings.routedExpertsCapture == 'Enabled'"
            ),
            message=(
                "routingReplay Enabled needs the fleet to capture routed experts: set "
                "fleet.settings.routedExpertsCapture to Enabled or routingReplay to Auto/Disabled"
            ),
            field_path=".trainer.routingReplay",
        ),
    )

    mode: Literal["Train", "Evaluate"] = "Train"
    """`Train` runs the RL loop. `Evaluate` only scores the policy the fleet serves on every task
    of the task set, or only those of `tasks.split.taskSetSplit` when it is set (the other split
    settings are ignored), again each time the fleet's policy advances by
    `evaluation.intervalSteps` versions — share a fleet with a training run to track it. In
    Evaluate mode a step is one full evaluation."""
    suspend: bool = False
    """Scale everything the run owns to zero (trainer Job suspended, owned fleet and warm sandboxes
    at 0 replicas); the run store is kept, and unsetting resumes. A shared fleet or pool is left
    running."""
    active_deadline_seconds: Seconds | None = None
    """Wall-clock limit from the run's start; when it passes the run ends as `Failed` with reason
    `DeadlineExceeded` (unlike `stop.maxDurationSeconds`, which ends it as `Succeeded`)."""
    policy: PolicySpec
    """The policy."""
    fleet_ref: LocalObjectReference | None = None
    """A shared RolloutFleet; this run takes its weight-update lease when training."""
    fleet: FleetTemplate | None = None
    """A RolloutFleet created for and owned by this run, serving `policy.checkpoint`."""
    pool_ref: LocalObjectReference | None = None
    """A shared SandboxPool."""
    pool: SandboxPoolSpec | None = None
    """A SandboxPool created for and owned by this run."""
    harness: Harness
    """The agent harness."""
    tasks: TaskSelection
    """Tasks and their sampling."""
    algorithm: Algorithm = Field(default_factory=Algorithm)
    """Algorithm and hyper-parameters."""
    schedule: Schedule = Field(default_factory=Schedule)
    """Sync / async and concurrency."""
    filter: TrajectoryFilter = Field(default_factory=TrajectoryFilter)
    """Which trials enter the loss."""
    trainer: TrainerSpec = Field(default_factory=TrainerSpec)
    """The trainer."""
    checkpoints: Checkpoints = Field(default_factory=Checkpoints)
    """Trainer checkpoints."""
    store: StorageLocation | None = None
    """Run store for trajectories, metrics and weights; defaults to the operator's store on a
    cluster and to `./.legorl/runs/<name>` for `legorl run`."""
    stop: StopConditions = Field(default_factory=lambda: StopConditions(max_steps=100))
    """When the run ends."""
    evaluation: Evaluation = Field(default_factory=Evaluation)
    """Held-out validation."""
    fidelity: FidelityGuard = Field(default_factory=FidelityGuard)
    """Rollout/training agreement guard."""


class TrialCount(ApiModel):
    """Trials that ended with one termination reason."""

    reason: Annotated[TerminationReason, Strict(False)]
    """Termination reason."""
    count: Annotated[int, Field(ge=0)]
    """Number of trials."""


class TrialSummary(ApiModel):
    """Trial counts."""

    total: Annotated[int, Field(ge=0)] = 0
    """Trials finished."""
    running: Annotated[int, Field(ge=0)] = 0
    """Trials running now."""
    dropped: Annotated[int, Field(ge=0)] = 0
    """Finished trials excluded from the loss by the filter."""
    zero_variance_groups: Annotated[int, Field(ge=0)] = 0
    """Groups skipped because every trial got the same reward."""
    by_reason: Annotated[list[TrialCount], Field(max_length=16)] = Field(default_factory=list)
    """Finished trials per termination reason."""


class RunMetrics(ApiModel):
    """Latest figures of the run (the full history is in the run store)."""

    reward_mean: float | None = None
    """Mean reward of the last training batch."""
    held_out_solve_rate: float | None = None
    """Solve rate on the held-out split at the last validation."""
    baseline_solve_rate: float | None = None
    """Solve rate of the initial policy on the held-out split."""
    fidelity_correlation: float | None = None
    """Pearson correlation of rollout vs. training token probabilities, last step."""
    max_abs_logprob_delta: float | None = None
    """Largest |rollout − training| log-probability, last step."""
    tokens_per_second: float | None = None
    """Trainer throughput, last step."""
    trials_per_minute: float | None = None
    """Rollout throughput over the last step."""


class PreflightResult(ApiModel):
    """One preflight check."""

    check: Annotated[str, Field(max_length=MAX_SHORT)]
    """Check name."""
    result: Literal["Passed", "Warning", "Failed"]
    """Outcome."""
    message: Text = ""
    """What was found and what to do."""


class ValidationCheck(ApiModel):
    """One check of a canary."""

    check: Annotated[str, Field(max_length=MAX_SHORT)]
    """`preflight`, `trial`, `token-parity` or `routing-parity`."""
    result: Literal["Passed", "Warning", "Failed"]
    """Outcome."""
    message: Text = ""
    """What was found and what to do."""


class ValidationStatus(ApiModel):
    """The last canary of the run: preflight, one trial end to end, token and routing parity of the
    trainer's scoring of that trial against what the engine sampled."""

    requested: Annotated[str, Field(max_length=MAX_SHORT)]
    """The value of the `legorl.dev/validate-requested` annotation this canary answers."""
    state: Literal["Pending", "Running", "Passed", "Warning", "Failed"]
    """`Pending` (waiting to start), `Running`, or the worst result of its checks."""
    message: Text = ""
    """What it waits for, what it does now, or the failed checks in one line."""
    start_time: Annotated[str, Field(max_length=MAX_SHORT)] | None = None
    """When the canary started (RFC 3339)."""
    completion_time: Annotated[str, Field(max_length=MAX_SHORT)] | None = None
    """When it ended (RFC 3339)."""
    trial: Annotated[str, Field(max_length=MAX_SHORT)] | None = None
    """The canary's trial (its trajectory is in the run store under `validation/`)."""
    checks: Annotated[list[ValidationCheck], Field(max_length=16)] = Field(default_factory=list)
    """Each check with its result."""


class CheckpointRef(ApiModel):
    """A saved checkpoint."""

    step: Annotated[int, Field(ge=0)]
    """Step it was saved at."""
    uri: Annotated[str, Field(max_length=2048)]
    """Where it is."""


class RLRunStatus(ApiModel):
    """Observed state of an RLRun."""

    observed_generation: Annotated[int, Field(ge=0)] = 0
    """The `.metadata.generation` last reconciled."""
    conditions: Conditions = Field(default_factory=list)
    """`Validated`, `RolloutReady`, `SandboxesReady`, `Training`, `Succeeded`, `Failed`, `Degraded`."""
    phase: Literal["Pending", "Invalid", "Suspended", "Running", "Degraded", "Succeeded", "Failed"] = (
        "Pending"
    )
    """One-word summary derived from the conditions."""
    reason: Annotated[str, Field(max_length=MAX_SHORT * 2)] = ""
    """Reason of the condition that decided the phase."""
    step: Annotated[int, Field(ge=0)] = 0
    """Training steps completed."""
    policy_version: Annotated[str, Field(max_length=MAX_SHORT)] | None = None
    """Policy version the fleet serves for this run."""
    start_time: Annotated[str, Field(max_length=MAX_SHORT)] | None = None
    """When the loop started (RFC 3339)."""
    completion_time: Annotated[str, Field(max_length=MAX_SHORT)] | None = None
    """When the run succeeded or failed (RFC 3339)."""
    trials: TrialSummary = Field(default_factory=TrialSummary)
    """Trial counts."""
    metrics: RunMetrics = Field(default_factory=RunMetrics)
    """Latest figures."""
    preflight: Annotated[list[PreflightResult], Field(max_length=64)] = Field(default_factory=list)
    """Preflight checks of the current generation."""
    store_uri: Annotated[str, Field(max_length=2048)] | None = None
    """Resolved run store."""
    fleet_name: Annotated[str, Field(max_length=253)] | None = None
    """The RolloutFleet in use (referenced or owned)."""
    pool_name: Annotated[str, Field(max_length=253)] | None = None
    """The SandboxPool in use (referenced or owned)."""
    last_checkpoint: CheckpointRef | None = None
    """Most recent checkpoint."""
    validation: ValidationStatus | None = None
    """The last canary (asked for with the `legorl.dev/validate-requested` annotation)."""

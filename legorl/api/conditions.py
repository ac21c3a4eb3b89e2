"""Condition types and their documented reasons for each kind, and pure helpers to set them.

Status is conditions, not a phase: every kind's `status.conditions[]` carries
one entry per type below, and any `phase` shown to people is derived from them
(`rlrun_phase`). Reasons are closed sets so that the UI, alerts and tests can
rely on them; each member's docstring says what it means.
"""

from __future__ import annotations

from datetime import UTC, datetime
from enum import StrEnum

from legorl.api._enum import DocumentedEnum
from legorl.api.common import CONDITION_STATUS, Condition


class FleetConditionType(StrEnum):
    """Condition types of a RolloutFleet."""

    READY = "Ready"
    """All desired replicas serve the policy and answer /health."""
    PROGRESSING = "Progressing"
    """A rollout, scale or weight sync is under way."""
    DEGRADED = "Degraded"
    """Something is wrong that needs a person (crash loops, pull failures, version skew)."""


class FleetReason(DocumentedEnum):
    """Reasons of RolloutFleet conditions."""

    ALL_REPLICAS_READY = "AllReplicasReady", "Every desired replica is up and answers /health."
    REPLICAS_NOT_READY = (
        "ReplicasNotReady",
        "Some desired replicas are not ready yet; the message names them and why.",
    )
    SCALED_TO_ZERO = "ScaledToZero", "replicas is 0: nothing serves the policy (not an error)."
    MODEL_LOADING = "ModelLoading", "Replicas are running but still loading weights."
    ROLLOUT_IN_PROGRESS = (
        "RolloutInProgress",
        "Pods are being created or replaced after a spec change.",
    )
    ROLLOUT_COMPLETE = "RolloutComplete", "The current spec is fully rolled out."
    WEIGHT_SYNC_IN_PROGRESS = (
        "WeightSyncInProgress",
        "A new policy version is being loaded into the replicas.",
    )
    PROGRESS_DEADLINE_EXCEEDED = (
        "ProgressDeadlineExceeded",
        "A rollout did not finish within startupSeconds.",
    )
    AS_EXPECTED = "AsExpected", "Nothing is wrong."
    CRASH_LOOP = (
        "CrashLoop",
        "A container restarts repeatedly; the message carries its last termination reason.",
    )
    IMAGE_PULL_FAILED = "ImagePullFailed", "An image cannot be pulled (name, tag or pull secret)."
    UNSCHEDULABLE = "Unschedulable", "Pods cannot be scheduled (resources, node selector, taints)."
    POLICY_VERSION_SKEW = (
        "PolicyVersionSkew",
        "Ready replicas serve different policy versions for longer than a sync takes.",
    )
    INVALID_SPEC = (
        "InvalidSpec",
        "The spec fails validation; the message names the field and the fix.",
    )


class PoolConditionType(StrEnum):
    """Condition types of a SandboxPool."""

    READY = "Ready"
    """Trials can start: images cached (per policy), defenses self-tested, warm capacity up."""
    IMAGES_CACHED = "ImagesCached"
    """Every desired task image is present on every matching node."""
    DEFENSES_VERIFIED = "DefensesVerified"
    """The staged defenses passed their self-test in a probe sandbox."""
    DEGRADED = "Degraded"
    """Something is wrong that needs a person."""


class PoolReason(DocumentedEnum):
    """Reasons of SandboxPool conditions."""

    POOL_READY = "PoolReady", "The pool can start trials."
    WARM_CAPACITY_NOT_READY = (
        "WarmCapacityNotReady",
        "Fewer warm sandboxes are ready than replicas asks for.",
    )
    ALL_IMAGES_CACHED = "AllImagesCached", "Every desired image is on every matching node."
    PULL_IN_PROGRESS = "PullInProgress", "Images are still being pulled onto nodes."
    TASK_SET_IMAGES_UNKNOWN = (
        "TaskSetImagesUnknown",
        "The task set is in an object store or volume the operator does not read; its images are "
        "cached once the run controller names them (the pool's legorl.dev/lookahead-images annotation).",
    )
    PULL_FAILED = (
        "PullFailed",
        "At least one image failed to pull on at least one node; status.nodes says where.",
    )
    NO_MATCHING_NODES = (
        "NoMatchingNodes",
        "No node matches the pool's node selector and tolerations.",
    )
    PRE_PULL_DISABLED = (
        "PrePullDisabled",
        "prePull.policy is Never: images are pulled when trials start.",
    )
    SELF_TEST_PASSED = (
        "SelfTestPassed",
        "The probe sandbox confirmed every defense (egress refused, history gone, tests absent).",
    )
    SELF_TEST_PENDING = "SelfTestPending", "The defense self-test has not finished yet."
    SELF_TEST_FAILED = (
        "SelfTestFailed",
        "A defense could not be confirmed; trials fail closed as defense_failed until fixed.",
    )
    DEFENSES_RELAXED_BY_SPEC = (
        "DefensesRelaxedBySpec",
        "The spec turns a defense off; rewards from this pool are not hack-proof.",
    )
    AS_EXPECTED = "AsExpected", "Nothing is wrong."
    INVALID_SPEC = (
        "InvalidSpec",
        "The spec fails validation; the message names the field and the fix.",
    )


class RunConditionType(StrEnum):
    """Condition types of an RLRun (DESIGN §2)."""

    VALIDATED = "Validated"
    """The spec passed schema, CEL and preflight checks and its references resolve."""
    ROLLOUT_READY = "RolloutReady"
    """The RolloutFleet serves this run's policy."""
    SANDBOXES_READY = "SandboxesReady"
    """The SandboxPool can start trials."""
    TRAINING = "Training"
    """The loop is running: trials, batches, updates."""
    SUCCEEDED = "Succeeded"
    """A stop condition was met; the final checkpoint is committed."""
    FAILED = "Failed"
    """The run stopped without meeting a stop condition."""
    DEGRADED = "Degraded"
    """The run continues but something needs a person (fidelity, infra failure rate, staleness)."""


class RunReason(DocumentedEnum):
    """Reasons of RLRun conditions."""

    VALID = "Valid", "Schema, CEL and preflight checks passed."
    INVALID_SPEC = (
        "InvalidSpec",
        "The spec fails validation; the message names the field and the fix.",
    )
    PREFLIGHT_FAILED = (
        "PreflightFailed",
        "A check beyond the schema failed (e.g. requests above limits); see the message.",
    )
    REFERENCE_NOT_FOUND = (
        "ReferenceNotFound",
        "A referenced RolloutFleet or SandboxPool does not exist (a missing Secret shows on the "
        "pods that reference it, as CreateContainerConfigError).",
    )
    FLEET_READY = "FleetReady", "The fleet serves this run's policy."
    FLEET_NOT_READY = "FleetNotReady", "The fleet is not ready; its own conditions say why."
    FLEET_LEASED_BY_OTHER_RUN = (
        "FleetLeasedByOtherRun",
        "Another training run owns the fleet's weights; this run waits.",
    )
    POOL_READY = "PoolReady", "The pool can start trials."
    POOL_NOT_READY = "PoolNotReady", "The pool is not ready; its own conditions say why."
    NOT_STARTED = "NotStarted", "The run has not started its loop yet."
    CONTROLLER_PENDING = (
        "ControllerPending",
        "The run controller cannot start its loop yet (task set or run store unreachable); the "
        "message says why.",
    )
    WAITING_FOR_DEPENDENCIES = (
        "WaitingForDependencies",
        "The loop starts once the fleet serves the policy and the pool can start trials.",
    )
    DEADLINE_EXCEEDED = "DeadlineExceeded", "activeDeadlineSeconds passed before a stop condition was met."
    STEPPING = "Stepping", "Trials and updates are running."
    WAITING_FOR_ROLLOUTS = (
        "WaitingForRollouts",
        "The trainer waits for a full batch of trajectories.",
    )
    SYNCING_WEIGHTS = "SyncingWeights", "New weights are being loaded into the fleet."
    SUSPENDED = "Suspended", "spec.suspend is true: no new trials start, running ones finish."
    STOPPED = "Stopped", "The loop has stopped (see Succeeded / Failed)."
    MAX_STEPS_REACHED = "MaxStepsReached", "stop.maxSteps was reached."
    TARGET_REWARD_REACHED = (
        "TargetRewardReached",
        "A training step's mean reward reached stop.targetReward.",
    )
    MAX_DURATION_REACHED = "MaxDurationReached", "stop.maxDurationSeconds elapsed."
    EVALUATION_COMPLETE = "EvaluationComplete", "An Evaluate run scored every task."
    TASKS_EXHAUSTED = "TasksExhausted", "Every training task was used for tasks.epochs epochs."
    BACKEND_FAILED = (
        "BackendFailed",
        "Trials could not be run at all (the message says why); the operator retries.",
    )
    TRAINER_FAILED = (
        "TrainerFailed",
        "The trainer exited with an error; the message has its last lines.",
    )
    STORE_UNAVAILABLE = "StoreUnavailable", "The run store cannot be read or written."
    TOO_MANY_INFRA_FAILURES = (
        "TooManyInfraFailures",
        "Infra failures exceeded the limit; the trials' reasons say where.",
    )
    AS_EXPECTED = "AsExpected", "Nothing is wrong."
    FIDELITY_BELOW_THRESHOLD = (
        "FidelityBelowThreshold",
        "Rollout vs. training probability correlation stayed below fidelity.minCorrelation.",
    )
    HIGH_INFRA_FAILURE_RATE = (
        "HighInfraFailureRate",
        "A large share of recent trials ended with infra reasons.",
    )
    STALENESS_EXCEEDED = "StalenessExceeded", "Trajectories arrive older than the staleness limit."


class RunPhase(DocumentedEnum):
    """A one-word summary of an RLRun, derived from its conditions (never stored on its own)."""

    PENDING = "Pending", "Waiting for the fleet or the pool."
    INVALID = "Invalid", "The spec is invalid (Validated=False)."
    SUSPENDED = "Suspended", "spec.suspend is true: no new trials start, running ones finish."
    RUNNING = "Running", "The loop is running."
    DEGRADED = "Degraded", "Running, but Degraded=True."
    SUCCEEDED = "Succeeded", "Succeeded=True."
    FAILED = "Failed", "Failed=True."


def rfc3339(now: datetime) -> str:
    """Format a timestamp the way metav1.Time does (UTC, second precision, `Z`)."""
    return now.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def set_condition(
    conditions: list[Condition],
    *,
    type_: str,
    status: CONDITION_STATUS,
    reason: str,
    message: str,
    generation: int,
    now: datetime,
) -> list[Condition]:
    """Return `conditions` with `type_` set; the transition time moves only when status changes."""
    new = Condition(
        type=type_,
        status=status,
        reason=reason,
        message=message,
        last_transition_time=rfc3339(now),
        observed_generation=generation,
    )
    out: list[Condition] = []
    replaced = False
    for cond in conditions:
        if cond.type != type_:
            out.append(cond)
            continue
        replaced = True
        if cond.status == status:
            new = new.model_copy(update={"last_transition_time": cond.last_transition_time})
        out.append(new)
    if not replaced:
        out.append(new)
    return out


def find_condition(conditions: list[Condition], type_: str) -> Condition | None:
    """The condition of `type_`, if present."""
    return next((c for c in conditions if c.type == type_), None)


def rlrun_phase(conditions: list[Condition], suspended: bool) -> tuple[RunPhase, str]:
    """Derive (phase, reason) for an RLRun from its conditions; the reason explains the phase."""

    def is_true(type_: RunConditionType) -> Condition | None:
        cond = find_condition(conditions, type_)
        return cond if cond is not None and cond.status == "True" else None

    validated = find_condition(conditions, RunConditionType.VALIDATED)
    if (done := is_true(RunConditionType.SUCCEEDED)) is not None:
        return RunPhase.SUCCEEDED, done.reason
    if (failed := is_true(RunConditionType.FAILED)) is not None:
        return RunPhase.FAILED, failed.reason
    if validated is not None and validated.status == "False":
        return RunPhase.INVALID, validated.reason
    if suspended:
        return RunPhase.SUSPENDED, RunReason.SUSPENDED.value
    if (degraded := is_true(RunConditionType.DEGRADED)) is not None:
        return RunPhase.DEGRADED, degraded.reason
    if (training := is_true(RunConditionType.TRAINING)) is not None:
        return RunPhase.RUNNING, training.reason
    for waiting in (RunConditionType.ROLLOUT_READY, RunConditionType.SANDBOXES_READY):
        cond = find_condition(conditions, waiting)
        if cond is not None and cond.status != "True":
            return RunPhase.PENDING, cond.reason
    training = find_condition(conditions, RunConditionType.TRAINING)
    if training is not None:
        return RunPhase.PENDING, training.reason
    return RunPhase.PENDING, RunReason.NOT_STARTED.value

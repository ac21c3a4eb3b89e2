"""RLRun status: preflight, dependencies, the trainer workload, the run controller's progress, deadline
and the derived phase."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from legorl.api._base import MAX_TEXT
from legorl.api.common import Condition
from legorl.api.conditions import RunConditionType as T
from legorl.api.conditions import RunReason as R
from legorl.api.conditions import find_condition, rfc3339, rlrun_phase
from legorl.api.kinds import RLRun, RolloutFleet, SandboxPool
from legorl.api.labels import fleet_name, pool_name, trainer_name
from legorl.api.run import (
    PreflightResult,
    RLRunStatus,
    RunMetrics,
    TrialCount,
    TrialSummary,
    ValidationStatus,
)
from legorl.api.termination import INFRA_REASONS, TerminationReason
from legorl.api.timestamps import parse_time
from legorl.manifests.problems import Problem
from legorl.operator.observe import ChildView, Observed
from legorl.operator.status.common import ConditionSet, listing

TERMINAL = (T.SUCCEEDED, T.FAILED)

OUTCOME_REASONS: Mapping[str, str] = {
    "MaxSteps": R.MAX_STEPS_REACHED,
    "TargetReward": R.TARGET_REWARD_REACHED,
    "MaxDuration": R.MAX_DURATION_REACHED,
    "Evaluated": R.EVALUATION_COMPLETE,
    "InfraFailures": R.TOO_MANY_INFRA_FAILURES,
    "TrainerFailed": R.TRAINER_FAILED,
    "StoreUnavailable": R.STORE_UNAVAILABLE,
    "TasksExhausted": R.TASKS_EXHAUSTED,
    "BackendFailed": R.BACKEND_FAILED,
}
"""The run controller's outcome reasons → condition reasons."""


@dataclass(frozen=True)
class ControllerReport:
    """What the run's controller (the per-RLRun daemon) last reported: plain values, copied out of the
    controller's thread, so that status stays a pure function."""

    running: bool = False
    """The loop is running (trials, batches, waiting for the trainer)."""
    step: int = 0
    policy_version: str | None = None
    trials_total: int = 0
    trials_running: int = 0
    trials_dropped: int = 0
    zero_variance_groups: int = 0
    by_reason: Mapping[str, int] = field(default_factory=dict)
    metrics: Mapping[str, float | None] = field(default_factory=dict)
    """RunMetrics fields by their Python names (reward_mean, fidelity_correlation, ...)."""
    message: str = ""
    has_progress: bool = False
    """Whether the counts above come from a controller (else status keeps what it had)."""
    outcome: tuple[str, str, str] | None = None
    """(Succeeded | Failed | Stopped, reason, message) once the loop ended."""
    problem: str | None = None
    """Why the loop cannot start (task set or store unreadable); retried."""
    degraded: tuple[str, str] | None = None
    """(reason, message) while the loop's fidelity guard has fired."""
    validation: ValidationStatus | None = None
    """The last canary this daemon ran or is running (None: status keeps what it had)."""


def is_terminal(conditions: Sequence[Condition]) -> bool:
    """Whether the run has ended (Succeeded or Failed is True)."""
    return any(
        (c := find_condition(list(conditions), t)) is not None and c.status == "True" for t in TERMINAL
    )


def deadline(run: RLRun) -> datetime | None:
    """When spec.activeDeadlineSeconds runs out (counted from status.startTime), if set."""
    start = run.status.start_time if run.status else None
    limit = run.spec.active_deadline_seconds
    started = parse_time(start)
    return started + timedelta(seconds=limit) if started and limit else None


def deadline_passed(run: RLRun, now: datetime) -> bool:
    """Whether spec.activeDeadlineSeconds has run out since the run started."""
    end = deadline(run)
    return end is not None and now >= end


def _dependency(
    conds: ConditionSet,
    *,
    type_: str,
    kind: str,
    name: str,
    obj: RolloutFleet | SandboxPool | None,
    ready_reason: str,
    not_ready_reason: str,
) -> bool:
    if obj is None:
        conds.set(type_, "False", R.REFERENCE_NOT_FOUND, f"{kind} {name!r} does not exist in this namespace")
        return False
    ready = find_condition(obj.status.conditions, "Ready") if obj.status else None
    if ready is not None and ready.status == "True":
        conds.set(type_, "True", ready_reason, f"{kind} {name}: {ready.message}")
        return True
    why = f"{ready.reason}: {ready.message}" if ready is not None else "no status yet"
    conds.set(type_, "False", not_ready_reason, f"{kind} {name} is not ready ({why})")
    return False


def _preflight_results(problems: Sequence[Problem]) -> list[PreflightResult]:
    results = [
        PreflightResult(
            check=p.check[:63],
            result="Failed" if p.severity == "error" else "Warning",
            message=(f"{p.path}: {p.message}" if p.path else p.message)[:MAX_TEXT],
        )
        for p in problems
    ]
    if not results:
        results.append(PreflightResult(check="preflight", result="Passed", message="every check passed"))
    return results[:64]


def compute_run_status(
    run: RLRun,
    observed: Observed,
    now: datetime,
    *,
    fleet: RolloutFleet | None,
    pool: SandboxPool | None,
    problems: Sequence[Problem],
    store_uri: str,
    controller: ControllerReport | None = None,
) -> RLRunStatus:
    """The whole status of a run. `problems` are preflight findings (errors block the run);
    `controller` is what the run's controller daemon last reported (None: it has not started)."""
    previous = run.status or RLRunStatus()
    generation = run.metadata.generation or 0
    conds = ConditionSet(previous.conditions, generation, now)
    errors = [p for p in problems if p.severity == "error"]
    terminal_before = is_terminal(previous.conditions)

    if errors:
        reason = R.REFERENCE_NOT_FOUND if all(p.check == "reference" for p in errors) else R.PREFLIGHT_FAILED
        if any(p.check in {"schema", "cel"} for p in errors):
            reason = R.INVALID_SPEC
        text = listing([f"{p.path}: {p.message}" if p.path else p.message for p in errors], 3).rstrip(".")
        conds.set(T.VALIDATED, "False", reason, f"{text}. Nothing was started; fix the spec and re-apply.")
    else:
        warnings = [p for p in problems if p.severity == "warning"]
        note = f" ({len(warnings)} warning(s) in status.preflight)" if warnings else ""
        conds.set(T.VALIDATED, "True", R.VALID, f"schema, CEL and preflight checks passed{note}")

    rollout_ok = _dependency(
        conds,
        type_=T.ROLLOUT_READY,
        kind="RolloutFleet",
        name=fleet_name(run),
        obj=fleet,
        ready_reason=R.FLEET_READY,
        not_ready_reason=R.FLEET_NOT_READY,
    )
    if (
        rollout_ok
        and fleet is not None
        and run.spec.mode == "Train"
        and fleet.status is not None
        and fleet.status.weights_owner not in (None, run.metadata.name)
    ):
        conds.set(
            T.ROLLOUT_READY,
            "False",
            R.FLEET_LEASED_BY_OTHER_RUN,
            f"RLRun {fleet.status.weights_owner} holds the weight lease of fleet {fleet.metadata.name}; "
            "this run waits until it ends",
        )
        rollout_ok = False
    pool_ok = _dependency(
        conds,
        type_=T.SANDBOXES_READY,
        kind="SandboxPool",
        name=pool_name(run),
        obj=pool,
        ready_reason=R.POOL_READY,
        not_ready_reason=R.POOL_NOT_READY,
    )

    start_time = previous.start_time
    if start_time is None and not errors:
        start_time = rfc3339(now)
    timed_run = run.model_copy(update={"status": previous.model_copy(update={"start_time": start_time})})

    job = observed.child("Job", trainer_name(run.metadata.name))
    if not terminal_before:
        _set_ended(conds, timed_run, job, now, errors=bool(errors), controller=controller)

    terminal = is_terminal(conds.conditions)
    _set_training(
        conds,
        run,
        job,
        terminal=terminal,
        errors=bool(errors),
        deps=(rollout_ok, pool_ok),
        controller=controller,
    )
    if controller is not None and controller.has_progress:
        _set_degraded(conds, run, controller)
    elif find_condition(conds.conditions, T.DEGRADED) is None:
        conds.set(T.DEGRADED, "False", R.AS_EXPECTED, "")

    phase, phase_reason = rlrun_phase(conds.conditions, run.spec.suspend)
    completion = previous.completion_time or (rfc3339(now) if terminal else None)
    served = fleet.status.served_policy_version if fleet is not None and fleet.status else None
    progress: dict[str, object] = {}
    if controller is not None and controller.has_progress:
        progress = {
            "step": controller.step,
            "trials": _trial_summary(controller),
            "metrics": RunMetrics(**{k: _round(v) for k, v in controller.metrics.items()}),
        }
        served = controller.policy_version or served
    return previous.model_copy(
        update={
            **progress,
            "observed_generation": generation,
            "conditions": conds.conditions,
            "phase": phase.value,
            "reason": phase_reason,
            "policy_version": served or previous.policy_version,
            "start_time": start_time,
            "completion_time": completion,
            "preflight": _preflight_results(problems),
            "store_uri": store_uri,
            "fleet_name": fleet_name(run),
            "pool_name": pool_name(run),
            "validation": (controller.validation if controller is not None else None) or previous.validation,
        }
    )


def _set_ended(
    conds: ConditionSet,
    run: RLRun,
    job: ChildView | None,
    now: datetime,
    *,
    errors: bool,
    controller: ControllerReport | None,
) -> None:
    """Failed and Succeeded: the trainer Job, the run controller's outcome, the deadline. `run`
    carries the start time."""
    # Failed pods the Job replaces (spec.trainer.restarts) are not the run's failure: the Job's is.
    trainer_failed = job is not None and job.conditions.get("Failed", ("",))[0] == "True"
    outcome = controller.outcome if controller is not None else None
    start_time = run.status.start_time if run.status else None
    if trainer_failed and job is not None:
        message = job.conditions.get("Failed", ("", "", ""))[2] or "a trainer pod failed"
        conds.set(T.FAILED, "True", R.TRAINER_FAILED, f"trainer Job {job.name}: {message}")
    elif outcome is not None and outcome[0] == "Failed":
        conds.set(T.FAILED, "True", OUTCOME_REASONS.get(outcome[1], outcome[1]), outcome[2])
    elif not errors and deadline_passed(run, now):
        conds.set(
            T.FAILED,
            "True",
            R.DEADLINE_EXCEEDED,
            f"activeDeadlineSeconds ({run.spec.active_deadline_seconds}s) passed since {start_time}; "
            "the run was scaled to zero and its store kept",
        )
    else:
        conds.set(T.FAILED, "False", R.AS_EXPECTED, "")
    failed = find_condition(conds.conditions, T.FAILED)
    if outcome is not None and outcome[0] == "Succeeded" and (failed is None or failed.status != "True"):
        conds.set(T.SUCCEEDED, "True", OUTCOME_REASONS.get(outcome[1], outcome[1]), outcome[2])
    else:
        conds.set(T.SUCCEEDED, "False", R.NOT_STARTED, "no stop condition has been met")


def _round(value: float | None) -> float | None:
    """Four significant digits: status is not rewritten for noise in the last digits."""
    return None if value is None else float(f"{value:.4g}")


def _trial_summary(controller: ControllerReport) -> TrialSummary:
    counts = [
        TrialCount(reason=TerminationReason(reason), count=count)
        for reason, count in sorted(controller.by_reason.items())
        if reason in TerminationReason._value2member_map_
    ]
    return TrialSummary(
        total=controller.trials_total,
        running=controller.trials_running,
        dropped=controller.trials_dropped,
        zero_variance_groups=controller.zero_variance_groups,
        by_reason=counts[:16],
    )


def _set_degraded(conds: ConditionSet, run: RLRun, controller: ControllerReport) -> None:
    """Degraded from the controller's figures: the fidelity guard fired (the correlation stayed below
    fidelity.minCorrelation for fidelity.windowSteps steps), or many infra failures."""
    infra = sum(n for r, n in controller.by_reason.items() if r in {x.value for x in INFRA_REASONS})
    limit = run.spec.stop.max_infra_failure_percent / 2
    if controller.degraded is not None and controller.degraded[0] == R.FIDELITY_BELOW_THRESHOLD.value:
        action = run.spec.fidelity.action
        then = "; the run was suspended (fidelity.action Pause)" if action == "Pause" else ""
        conds.set(T.DEGRADED, "True", R.FIDELITY_BELOW_THRESHOLD, controller.degraded[1] + then)
    elif controller.trials_total >= 10 and 100 * infra / controller.trials_total > limit:
        share = 100 * infra / controller.trials_total
        conds.set(
            T.DEGRADED,
            "True",
            R.HIGH_INFRA_FAILURE_RATE,
            f"{infra} of {controller.trials_total} trials ({share:.0f}%) ended for infrastructure reasons "
            f"(the run stops above stop.maxInfraFailurePercent={run.spec.stop.max_infra_failure_percent}); "
            "status.trials.byReason says which",
        )
    else:
        conds.set(T.DEGRADED, "False", R.AS_EXPECTED, "")


def _set_training(
    conds: ConditionSet,
    run: RLRun,
    job: ChildView | None,
    *,
    terminal: bool,
    errors: bool,
    deps: tuple[bool, bool],
    controller: ControllerReport | None,
) -> None:
    rollout_ok, pool_ok = deps
    if terminal:
        conds.set(T.TRAINING, "False", R.STOPPED, "the run has ended; see Succeeded / Failed")
    elif errors:
        conds.set(T.TRAINING, "False", R.NOT_STARTED, "the spec did not pass validation")
    elif run.spec.suspend:
        conds.set(
            T.TRAINING, "False", R.SUSPENDED, "spec.suspend is true: everything the run owns is at zero"
        )
    elif controller is not None and controller.running:
        conds.set(T.TRAINING, "True", R.STEPPING, controller.message or "trials and updates are running")
    elif not (rollout_ok and pool_ok):
        waiting = [n for n, ok in (("the fleet", rollout_ok), ("the pool", pool_ok)) if not ok]
        conds.set(
            T.TRAINING,
            "False",
            R.WAITING_FOR_DEPENDENCIES,
            f"waiting for {' and '.join(waiting)} to be ready",
        )
    else:
        trainer = ""
        if job is not None:
            trainer = f"trainer Job {job.name} has {job.counters.get('active', 0)} active pod(s); "
        why = "it starts within seconds"
        if controller is not None and controller.problem:
            why = f"it cannot start: {controller.problem}"
        elif (
            controller is not None
            and controller.validation is not None
            and controller.validation.state
            in (
                "Pending",
                "Running",
            )
        ):
            why = f"a canary runs first, see status.validation: {controller.validation.message}"
        elif controller is not None and controller.outcome is not None:
            why = f"the last one stopped: {controller.outcome[2]}"
        conds.set(
            T.TRAINING,
            "False",
            R.CONTROLLER_PENDING,
            f"{trainer}the fleet and the pool are ready; no run controller is driving trials and steps "
            f"yet ({why})",
        )

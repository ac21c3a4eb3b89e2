"""The canary of an RLRun on a cluster (`legorl.dev/validate-requested`; `legorl.controller.canary`).

The per-run daemon runs it in a thread of its own, before (or instead of) the run's loop: the loop is
never running at the same time, so the canary's trial pod is the only one launched meanwhile (trials of a
handed-over loop keep running and are adopted when it restarts). Its steps:

1. **preflight** of the run as it is now;
2. **trial**: one trial on the first training task, as a pod from the pool's template through the run's
   proxy, harness and verifier (`KubeTrialBackend`), with the id `canary-<hash of the request>`;
3. **token-parity** and **routing-parity**: the trial's segments go to the run store as a scoring request
   (`RunStore.request_scoring`); the run's trainer Job answers between steps with the figures of the
   weights it holds (`TrainingService.serve_scoring`), tagged with their version. In `Evaluate` mode there
   is no trainer: both checks are a `Warning` that says so.

The report goes to the run store (`validation/latest.json`) and, through the daemon, to
`status.validation`. The canary's trial is never trained on.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Literal

from legorl.api._base import MAX_TEXT
from legorl.api.conditions import rfc3339
from legorl.api.kinds import RLRun
from legorl.api.labels import trainer_name
from legorl.api.run import ValidationCheck, ValidationStatus
from legorl.api.store import RunStore, StoreError
from legorl.api.trajectory import TrialRecord
from legorl.controller.canary import (
    CANARY_TRIAL_PREFIX,
    CanaryCheck,
    CanaryReport,
    parity_checks,
    preflight_check,
    trial_check,
    write_report,
)
from legorl.controller.plan import PlanError, TaskPlan
from legorl.operator.trials import KubeTrialBackend
from legorl.sandbox.task import TaskSet

log = logging.getLogger("legorl.operator.canary")

Progress = Callable[[str], None]
"""Told what the canary does now (one line for `status.validation.message`)."""


def canary_trial_id(requested: str) -> str:
    """`canary-<10 hex digits>`: stable for one request (a restarted operator finds what is left of it)."""
    return CANARY_TRIAL_PREFIX + hashlib.sha256(requested.encode()).hexdigest()[:10]


class Stopped(Exception):
    """The canary was told to stop (the run was suspended or deleted, or the operator is stopping)."""


def run_canary(
    run: RLRun,
    *,
    requested: str,
    store: RunStore,
    backend: KubeTrialBackend,
    task_set: TaskSet,
    stop: threading.Event,
    progress: Progress,
    trial_budget_seconds: float,
    score_seconds: float,
    poll_seconds: float = 1.0,
) -> CanaryReport:
    """The canary's checks (see the module docstring). Raises `Stopped` when `stop` is set."""
    started = time.monotonic()
    checks = [preflight_check(run)]
    record = _trial(
        run,
        requested=requested,
        backend=backend,
        task_set=task_set,
        stop=stop,
        progress=progress,
        budget=trial_budget_seconds,
    )
    checks.append(trial_check(record, time.monotonic() - started))
    if record is None or not record.segments:
        checks.append(CanaryCheck("token-parity", "Failed", "no trial tokens to score"))
    elif run.spec.mode != "Train":
        why = "mode Evaluate runs no trainer to score the trial: parity is checked by training runs"
        checks += [CanaryCheck("token-parity", "Warning", why), CanaryCheck("routing-parity", "Warning", why)]
    else:
        checks += _parity(
            run,
            record=record,
            store=store,
            stop=stop,
            progress=progress,
            score_seconds=score_seconds,
            poll_seconds=poll_seconds,
        )
    report = CanaryReport.ended(run, started, checks, record)
    try:
        write_report(store, report)
    except (StoreError, OSError) as exc:  # status still shows it
        log.warning("run %s: could not write the canary's report to the store: %s", run.metadata.name, exc)
    return report


def _trial(
    run: RLRun,
    *,
    requested: str,
    backend: KubeTrialBackend,
    task_set: TaskSet,
    stop: threading.Event,
    progress: Progress,
    budget: float,
) -> TrialRecord | None:
    try:
        plan = TaskPlan.from_spec(run.spec, task_set)
        first = plan.step_requests(1, (run.status.policy_version if run.status else None) or "v0")[0]
    except (PlanError, IndexError) as exc:
        raise ValueError(f"no task to run the canary's trial on: {exc}") from exc
    request = dataclasses.replace(
        first, trial=canary_trial_id(requested), group_id=CANARY_TRIAL_PREFIX + "group", step=0
    )
    progress(f"trial {request.trial} on task {request.task.instance_id} is running")
    backend.launch(request)
    deadline = time.monotonic() + budget
    while time.monotonic() < deadline:
        if stop.is_set():
            raise Stopped
        for record in backend.collect(1.0):
            return record
    backend.cancel(request.trial)
    return None


def _parity(
    run: RLRun,
    *,
    record: TrialRecord,
    store: RunStore,
    stop: threading.Event,
    progress: Progress,
    score_seconds: float,
    poll_seconds: float,
) -> list[CanaryCheck]:
    request = record.trial
    try:
        store.request_scoring(request, [record])
    except (StoreError, OSError) as exc:
        return [CanaryCheck("token-parity", "Failed", f"could not hand the trial to the trainer: {exc}")]
    progress(
        f"trial {record.trial} ended {record.termination_reason.value}; waiting for the trainer Job to score "
        "its tokens (it answers between steps, once the policy is loaded)"
    )
    deadline = time.monotonic() + score_seconds
    while True:
        if stop.is_set():
            raise Stopped
        try:
            answer = store.scoring_answer(request)
        except (StoreError, OSError, ValueError) as exc:
            log.warning("run %s: reading the trainer's answer: %s", run.metadata.name, exc)
            answer = None
        if answer is not None:
            break
        if time.monotonic() > deadline:
            why = (
                f"the trainer Job did not score the trial within {score_seconds:.0f} s (is it running? "
                f"kubectl logs job/{trainer_name(run.metadata.name)})"
            )
            return [CanaryCheck("token-parity", "Failed", why), CanaryCheck("routing-parity", "Failed", why)]
        stop.wait(poll_seconds)
    if answer.error:
        why = f"the trainer could not score the trial: {answer.error}"
        return [CanaryCheck("token-parity", "Failed", why), CanaryCheck("routing-parity", "Failed", why)]
    return parity_checks(record, answer, run)


def validation_status(
    requested: str,
    state: Literal["Pending", "Running", "Passed", "Warning", "Failed"],
    message: str,
    *,
    started: datetime | None,
    report: CanaryReport | None = None,
    now: datetime | None = None,
) -> ValidationStatus:
    """`status.validation` for a canary waiting, running, or ended with `report`."""
    checks: list[ValidationCheck] = []
    if report is not None:
        checks = [
            ValidationCheck(check=c.check[:63], result=c.result, message=c.message[:MAX_TEXT])
            for c in report.checks
        ]
    return ValidationStatus(
        requested=requested[:63],
        state=state,
        message=message[:MAX_TEXT],
        start_time=rfc3339(started) if started is not None else None,
        completion_time=rfc3339(now or datetime.now(UTC)) if report is not None else None,
        trial=report.trial if report is not None else None,
        checks=checks[:16],
    )


def summary(report: CanaryReport) -> str:
    """One line: the result and what failed or warned."""
    bad = [c for c in report.checks if c.result != "Passed"]
    if not bad:
        return f"every check passed in {report.seconds:.0f} s"
    return "; ".join(f"{c.check} {c.result}: {c.message}" for c in bad)


__all__ = ["Stopped", "canary_trial_id", "run_canary", "summary", "validation_status"]

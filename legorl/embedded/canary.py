"""`legorl run FILE --canary`: the canary of `legorl.controller.canary` on this machine.

vLLM's CPU build serves the policy, one trial runs in a local sandbox through the run's harness and
proxy, and the trainer (megatron-core on CPU, the same code as the run's) scores that trial's tokens.
The result goes to the run store (`validation/latest.json`) and to the terminal; the exit code is 1 when
any check failed. The run's own trials, batches and weights are left alone: the canary's trial is not
trained on, so `legorl run FILE` afterwards starts from scratch.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

from legorl.api.trajectory import TrialRecord
from legorl.controller.canary import (
    VALIDATION_OBJECT,
    CanaryCheck,
    CanaryReport,
    parity_checks,
    preflight_check,
    trial_check,
    write_report,
)
from legorl.controller.plan import TaskPlan
from legorl.embedded.local import LocalTrialBackend

if TYPE_CHECKING:
    from legorl.embedded.runner import EmbeddedRun

__all__ = ["VALIDATION_OBJECT", "CanaryCheck", "CanaryReport", "run_canary"]


def run_canary(embedded: EmbeddedRun) -> CanaryReport:
    """The checks for `embedded` (an `EmbeddedRun`): engine, one trial, the trainer's scoring."""
    started = time.monotonic()
    run = embedded.run_obj
    checks = [preflight_check(run)]
    store, task_set, model, sandbox = embedded.prepare()
    from legorl.trainer.settings import TrainerSettings  # noqa: PLC0415 - torch only when running
    from legorl.trainer.train import PolicyTrainer  # noqa: PLC0415

    plan = TaskPlan.from_spec(run.spec, task_set)
    first = plan.step_requests(1, "v0")[0]
    request = dataclasses.replace(first, trial="canary-t0-r0", group_id="canary-t0", step=0)
    engine = embedded.start_engine(model)
    record: TrialRecord | None = None
    backend: LocalTrialBackend | None = None
    try:
        backend = LocalTrialBackend(
            run,
            sandbox=sandbox,
            task_set=task_set,
            engine_url=engine.url,
            workers=1,
            folder=embedded.paths.work,
        )
        embedded.say(f"canary trial {request.trial} on {request.task.instance_id} ...")
        deadlines = run.spec.pool.deadlines if run.spec.pool else None
        budget = 120.0 + (
            (deadlines.agent_seconds + deadlines.verify_seconds) if deadlines is not None else 1800.0
        )
        backend.launch(request)
        waited = time.monotonic()
        while record is None and time.monotonic() - waited < budget:
            for got in backend.collect(1.0):
                record = got
        checks.append(trial_check(record, time.monotonic() - waited))
        if record is not None and record.segments:
            settings = TrainerSettings.from_run(
                run, store_uri=str(embedded.paths.store), checkpoint_dir=model, device="cpu"
            )
            scored = PolicyTrainer(settings).score_trials([record])
            checks += parity_checks(record, scored.fidelity(), run)
        else:
            checks.append(CanaryCheck("token-parity", "Failed", "no trial tokens to score"))
    finally:
        if backend is not None:
            backend.close()
        engine.close()
    report = CanaryReport.ended(run, started, checks, record)
    write_report(store, report)
    return report

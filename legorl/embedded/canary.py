"""`legorl run FILE --canary`: a few minutes that say whether a long run of FILE would be worth starting.

The checks, in order, each `Passed`, `Warning` or `Failed` with a message a person can act on:

- **preflight**: the manifest's own checks (`legorl validate`'s preflight: settings that cannot work
  together, dtype mismatches that ruin fidelity, ...); an invalid manifest never gets this far.
- **trial**: one trial end to end on the first training task, through the same engine flags, proxy,
  sandbox stages, harness and verifier the run uses. It fails on any infrastructure termination
  (DESIGN §5) or a missing reward; a `completed` trial with reward 0 passes (the policy may fail a task,
  the machinery may not).
- **token-parity**: the trainer scores the exact tokens the engine sampled in that trial (prompts as the
  engine saw them, completions, behaviour log-probs recorded by the proxy). It fails when the Pearson
  correlation of rollout vs. training token log-probabilities is below `fidelity.minCorrelation` — the
  signal the fidelity guard stops a run for, caught before the run.
- **routing-parity**: with routed experts captured by the engine and routing replay on, every scored
  token must be routed as the engine routed it. Without captured routing (vLLM's CPU build, or
  `routedExpertsCapture: Disabled`) this is a `Warning` that says so, never a silent pass.

The result goes to the run store (`validation/latest.json`, with the time and the trial's figures) and
to the terminal; the exit code is 1 when any check failed. The run's own trials, batches and weights are
left alone: the canary's trial is not trained on, so `legorl run FILE` afterwards starts from scratch.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Literal

from legorl.api.kinds import RLRun
from legorl.api.store import RunStore
from legorl.api.termination import INFRA_REASONS
from legorl.api.trajectory import TrialRecord
from legorl.controller.plan import TaskPlan
from legorl.embedded.local import LocalTrialBackend
from legorl.manifests.preflight import check_resource

if TYPE_CHECKING:
    from legorl.embedded.runner import EmbeddedRun

Result = Literal["Passed", "Warning", "Failed"]
VALIDATION_OBJECT = "validation/latest.json"


@dataclass
class Check:
    check: str
    result: Result
    message: str
    figures: dict[str, Any] = field(default_factory=dict)


@dataclass
class CanaryReport:
    run: str
    time: str
    seconds: float
    checks: list[Check]
    trial: str | None = None

    @property
    def result(self) -> Result:
        results = {c.result for c in self.checks}
        return "Failed" if "Failed" in results else "Warning" if "Warning" in results else "Passed"

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "result": self.result}

    def text(self) -> str:
        width = max(len(c.check) for c in self.checks)
        lines = [f"canary of run {self.run}: {self.result} ({self.seconds:.0f} s)"]
        lines += [f"  {c.check:<{width}}  {c.result:<7}  {c.message}" for c in self.checks]
        return "\n".join(lines)


def preflight_check(run: RLRun) -> Check:
    problems = check_resource(run)
    errors = [p for p in problems if p.severity == "error"]
    if errors:
        return Check("preflight", "Failed", "; ".join(f"{p.path}: {p.message}" for p in errors))
    if problems:
        return Check("preflight", "Warning", "; ".join(f"{p.path}: {p.message}" for p in problems))
    return Check("preflight", "Passed", "no problem found")


def trial_check(record: TrialRecord | None, waited: float) -> Check:
    if record is None:
        return Check("trial", "Failed", f"no result after {waited:.0f} s (see the run's work/logs)")
    figures = {
        "termination_reason": record.termination_reason.value,
        "reward": record.reward,
        "turns": record.num_turns,
        "stage_seconds": dict(record.stage_seconds),
    }
    if record.termination_reason in INFRA_REASONS:
        why = f": {record.error}" if record.error else ""
        return Check(
            "trial",
            "Failed",
            f"{record.trial} ended {record.termination_reason.value}{why}",
            figures,
        )
    if record.reward is None:
        return Check(
            "trial", "Failed", f"{record.trial} has no reward: the verifier did not score it", figures
        )
    if not record.segments:
        return Check("trial", "Failed", f"{record.trial} recorded no tokens: nothing to train on", figures)
    return Check(
        "trial",
        "Passed",
        f"{record.trial} {record.termination_reason.value}, reward {record.reward:g}, "
        f"{record.num_turns} turn(s), {sum(record.stage_seconds.values()):.0f} s",
        figures,
    )


def parity_checks(record: TrialRecord, scored: Any, run: RLRun) -> list[Check]:
    """Token and routing parity from the trainer's scoring of `record` (a `ScoredBatch`)."""
    floor = float(run.spec.fidelity.min_correlation)
    stats = scored.fidelity()
    tokens = int(stats["tokens"])
    pearson = float(stats.get("pearson", float("nan")))
    figures = {
        "tokens": tokens,
        "pearson": pearson,
        "max_abs_logprob_delta": float(stats.get("max_abs_logprob_delta", float("nan"))),
        "mean_abs_logprob_delta": float(stats.get("mean_abs_logprob_delta", float("nan"))),
    }
    if tokens < 2:
        token = Check("token-parity", "Failed", f"only {tokens} sampled token(s) to compare", figures)
    elif not pearson >= floor:
        token = Check(
            "token-parity",
            "Failed",
            f"Pearson {pearson:.4f} over {tokens} tokens is below fidelity.minCorrelation {floor}: the "
            "trainer does not score what the engine sampled (dtype, checkpoint or chat template mismatch?)",
            figures,
        )
    else:
        token = Check(
            "token-parity",
            "Passed",
            f"Pearson {pearson:.5f} over {tokens} tokens, max |Δ log-prob| "
            f"{figures['max_abs_logprob_delta']:.2e}",
            figures,
        )
    routed = [s for s in record.segments if s.routed_experts is not None]
    share = float(stats.get("replayed_share", 0.0))
    if not routed:
        routing = Check(
            "routing-parity",
            "Warning",
            "the engine recorded no routed experts (vLLM's CPU build, or routedExpertsCapture Disabled): "
            "routing replay cannot be checked here",
        )
    elif share < 1.0:
        routing = Check(
            "routing-parity",
            "Failed",
            f"only {share:.1%} of the scored tokens were routed as the engine routed them "
            "(trainer.routingReplay?)",
            {"replayed_share": share},
        )
    else:
        routing = Check(
            "routing-parity",
            "Passed",
            "every scored token replayed the engine's routing",
            {"replayed_share": share},
        )
    return [token, routing]


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
            checks += parity_checks(record, scored, run)
        else:
            checks.append(Check("token-parity", "Failed", "no trial tokens to score"))
    finally:
        if backend is not None:
            backend.close()
        engine.close()
    report = CanaryReport(
        run=run.metadata.name,
        time=datetime.now(UTC).isoformat(timespec="seconds"),
        seconds=time.monotonic() - started,
        checks=checks,
        trial=record.trial if record is not None else None,
    )
    write_report(store, report)
    return report


def write_report(store: RunStore, report: CanaryReport) -> None:
    store.write_object(VALIDATION_OBJECT, json.dumps(report.to_json(), indent=1, sort_keys=True).encode())

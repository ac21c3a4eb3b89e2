"""The RL loop (DESIGN §3): launch trials, collect records, commit batches, wait for the policy, repeat.

One `RunController` drives one RLRun over a `TrialBackend` and a `RunStore`:

- **Training steps.** Step `s` runs `groupSize` trials for each of its `tasksPerStep` tasks (`TaskPlan`),
  at most `schedule.maxConcurrentTrials` at a time. Each finished trial is saved to the store at once
  (`RunStore.save_trial`); when all of a step's trials are in, the step is committed as a batch
  (`RunStore.commit_batch`) for the trainer, which trains it into policy version `v<s>`.
- **Sync mode** launches step `s` only once the fleet serves `v<s-1>` (no trial is stale). **Async mode**
  keeps trials running while the trainer works: step `s` may start while the fleet serves `v<s-1-k>` for
  `k ≤ schedule.maxStalenessSteps` (default 1). A trial straddling a weight swap carries every version it
  saw (the proxy records them per turn); the trainer drops trials staler than the limit.
- **Validation.** The held-out tasks are evaluated (`evaluation.trialsPerTask` trials each) at the start
  and every `evaluation.intervalSteps` policy versions, and on the final one; the solve rate and its 95%
  Wilson interval go to `evals/step-N.json`. In sync mode a step's batch is committed only after the
  evaluation of the policy that produced it ended, so no evaluation trial straddles a swap.
- **Stop conditions**: `stop.maxSteps`, `stop.maxDurationSeconds`, `stop.targetReward` (mean training
  reward of a step), tasks exhausted (`tasks.epochs`), the share of infrastructure failures in a step above
  `stop.maxInfraFailurePercent` (the run fails: its rewards would be meaningless), or `stop()`.
- **Fidelity guard** (`fidelity`): when the trainer's rollout-vs-training correlation stays below
  `minCorrelation` for `windowSteps` consecutive steps, the run is Degraded (`FidelityBelowThreshold`);
  with `action: Pause` it also stops (cancelling running trials) with that reason. A resume re-arms the
  guard: it counts only steps trained after the pause.
- **Resume.** Everything needed is in the store: committed steps, saved trials (re-used, never re-run),
  finished evaluations, the trainer's state (the served version). Trials still running in the backend
  (Kubernetes pods) are adopted. A restarted controller continues where the last one stopped.

Progress is reported as `Progress` snapshots (`on_progress`, and `controller/state.json` in the store) for
`legorl run`'s display, the RLRun status and the UI.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from legorl.api.figures import BatchSummary, EvalSummary, StepFigures
from legorl.api.kinds import RLRun
from legorl.api.progress import Progress
from legorl.api.store import RunStore, parse_policy_version, policy_version
from legorl.api.termination import INFRA_REASONS, TerminationReason
from legorl.api.trajectory import TrialRecord
from legorl.sandbox.task import TaskSet

from .backend import BackendError, TrialBackend, TrialRequest
from .plan import TaskPlan, wilson_interval

log = logging.getLogger(__name__)


FIDELITY_REASON = "FidelityBelowThreshold"
"""The RLRun's Degraded reason (and the run's end reason when the guard pauses it)."""


class TrainerHandle(Protocol):
    """What the controller needs of the trainer: its served policy step, and whether it failed."""

    def served_step(self) -> int:
        """The newest step whose weights the fleet serves (0: the initial checkpoint)."""

    def error(self) -> str | None:
        """Why the trainer can no longer make progress, or None while it can."""


class StoreTrainer:
    """The trainer as the store shows it: `trainer/state.json` is written after a step's weights were
    published and synced (the Kubernetes trainer Job, or an in-process `TrainingService`)."""

    def __init__(self, store: RunStore, error: Callable[[], str | None] | None = None) -> None:
        self.store = store
        self._error = error

    def served_step(self) -> int:
        state = self.store.trainer_state()
        if state is None:
            return 0
        return parse_policy_version(state.policy_version)

    def error(self) -> str | None:
        return self._error() if self._error is not None else None


@dataclass
class RunOutcome:
    """How `RunController.run` ended."""

    state: Literal["Succeeded", "Failed", "Stopped"]
    reason: str
    """CamelCase, for the RLRun's condition: MaxSteps, TasksExhausted, TargetReward, MaxDuration,
    InfraFailures, TrainerFailed, BackendFailed, Stopped, FidelityBelowThreshold (paused by the guard)."""
    message: str
    progress: Progress


@dataclass
class _Step:
    """A training step in flight: its planned requests and the records collected so far."""

    step: int
    requests: dict[str, TrialRequest]
    records: dict[str, TrialRecord] = field(default_factory=dict)

    @property
    def done(self) -> bool:
        return len(self.records) == len(self.requests)


class RunController:
    """Runs one RLRun's loop; `run()` blocks until it ends (see the module docstring)."""

    def __init__(
        self,
        run: RLRun,
        *,
        store: RunStore,
        backend: TrialBackend,
        task_set: TaskSet,
        trainer: TrainerHandle | None = None,
        on_progress: Callable[[Progress], None] | None = None,
        on_trial: Callable[[TrialRecord], None] | None = None,
        stop: threading.Event | None = None,
        clock: Callable[[], float] = time.monotonic,
        poll_seconds: float = 0.5,
    ) -> None:
        self.run_obj = run
        self.spec = run.spec
        self.name = run.metadata.name
        self.store = store
        self.backend = backend
        self.plan = TaskPlan.from_spec(self.spec, task_set)
        self.trainer: TrainerHandle = trainer or StoreTrainer(store)
        self.on_progress = on_progress
        self.on_trial = on_trial
        self.stop_event = stop or threading.Event()
        self.clock = clock
        self.poll_seconds = poll_seconds
        schedule = self.spec.schedule
        self.max_concurrent = schedule.max_concurrent_trials
        self.lookahead = 0 if schedule.mode == "Sync" else (schedule.max_staleness_steps or 1)
        self.warm_trials = schedule.warm_trials
        limit = self.spec.stop.max_steps
        self.last_step = self.plan.available_steps
        self._end_reason = (
            "TasksExhausted",
            f"used every training task ({len(self.plan.train)} over {self.spec.tasks.epochs} epoch(s))",
        )
        if limit is not None and limit < self.plan.available_steps:
            self.last_step = limit
            self._end_reason = ("MaxSteps", f"trained {limit} steps (stop.maxSteps)")
        if self.spec.mode == "Evaluate":
            self.last_step = 0
            self._end_reason = ("Evaluated", "evaluated the policy on the held-out tasks")
        self.drop_reasons = {TerminationReason(r) for r in self.spec.filter.drop_reasons}
        self.progress = Progress(run=self.name, max_steps=self.last_step)
        self._started = clock()
        self._steps: dict[int, _Step] = {}
        self._evals: dict[int, _Step] = {}
        self._queue: list[TrialRequest] = []
        self._in_flight: dict[str, TrialRequest] = {}
        self._finished_times: list[float] = []
        self._phase: dict[str, float] = {}
        self._wait_started: float | None = None
        self._counted: set[str] = set()
        self._published_at = -math.inf
        self._guard_paused = False
        self._guard_newest = 0
        self._upcoming: tuple[int, list[TrialRequest]] | None = None
        """The first step not planned yet and its trials not saved (what warm trials are made for)."""
        self._prepared: list[str] = []
        """The trials last named to `backend.prepare`."""

    # -- public -----------------------------------------------------------------------------------

    def stop(self) -> None:
        """Ask the loop to end: running trials are cancelled (their records kept as `cancelled`)."""
        self.stop_event.set()

    def run(self) -> RunOutcome:
        try:
            return self._run()
        except BackendError as exc:
            log.error("the trial backend failed: %s", exc)
            return self._end("Failed", "BackendFailed", f"the trial backend failed: {exc}")
        finally:
            self._publish()

    # -- the loop ---------------------------------------------------------------------------------

    def _run(self) -> RunOutcome:
        self._resume()
        while True:
            served = self.trainer.served_step()
            self.progress.policy_version = policy_version(served)
            if self.stop_event.is_set():
                self._cancel_all()
                return self._end("Stopped", "Stopped", "stopped on request; run again to resume")
            problem = self.trainer.error()
            if problem is not None:
                self._cancel_all()
                return self._end("Failed", "TrainerFailed", f"the trainer failed: {problem}")
            if self.progress.degraded_reason == FIDELITY_REASON and self.spec.fidelity.action == "Pause":
                self._cancel_all()
                self._guard_paused = True
                self.progress.fidelity_guard_after = max(
                    self.progress.fidelity_guard_after, self._guard_newest
                )
                return self._end(
                    "Stopped",
                    FIDELITY_REASON,
                    f"paused by the fidelity guard: {self.progress.degraded_message}. Find the cause "
                    "(see the trainer's fidelity figures), then resume; the guard re-arms and pauses again "
                    f"only after {self.spec.fidelity.window_steps} new step(s) below the threshold",
                )
            limit = self.spec.stop.max_duration_seconds
            if limit is not None and self.clock() - self._started >= limit:
                self._cancel_all()
                return self._end(
                    "Succeeded", "MaxDuration", f"ran for the {limit} s of stop.maxDurationSeconds"
                )
            committed = max(self.store.committed_steps(), default=0)
            if committed >= self.last_step and served >= self.last_step and not self._pending_evals():
                if self._eval_due(served, final=True):
                    self._plan_eval(served)
                else:
                    self._cancel_all()  # steps planned past a target reward reached meanwhile
                    return self._finished(served)
            outcome = self._advance(served, committed)
            if outcome is not None:
                self._cancel_all()
                return outcome
            self._launch()
            self._prepare(served, committed)
            if self._collect(served) or self.clock() - self._published_at >= 5.0:
                self._publish()

    def _advance(self, served: int, committed: int) -> RunOutcome | None:
        """Plan evaluations and steps that may start now; commit steps whose trials are all in."""
        if self._eval_due(served) and served not in self._evals:
            self._plan_eval(served)
        # Training steps allowed by the schedule: sync waits for v<s-1>, async looks ahead.
        nxt = committed + 1
        while nxt <= self.last_step and nxt - 1 - served <= self.lookahead:
            if nxt not in self._steps:
                self._plan_step(nxt, served)
            nxt += 1
        # Commit finished steps in order.
        step = committed + 1
        while step in self._steps and self._steps[step].done:
            if self.spec.schedule.mode == "Sync" and self._pending_evals(before=step):
                break  # the policy that produced this batch is still being evaluated
            outcome = self._commit(self._steps.pop(step))
            if outcome is not None:
                return outcome
            step += 1
        if self._wait_started is None and self._waiting_for_trainer(served):
            self._wait_started = self.clock()
        elif self._wait_started is not None and not self._waiting_for_trainer(served):
            self._add_phase("wait_trainer", self.clock() - self._wait_started)
            self._wait_started = None
        return None

    def _waiting_for_trainer(self, served: int) -> bool:
        return (
            not self._in_flight and not self._queue and served < max(self.store.committed_steps(), default=0)
        )

    def _plan_step(self, step: int, served: int) -> None:
        requests = {r.trial: r for r in self.plan.step_requests(step, policy_version(served))}
        state = _Step(step, requests)
        for record in self.store.saved_trials("train", step):
            if record.trial in requests:
                state.records[record.trial] = record
                self._count(record)
        self._steps[step] = state
        if self._upcoming is not None and self._upcoming[0] <= step:
            self._upcoming = None  # planned now: its trials are queued, and saved as they end
        missing = [r for t, r in requests.items() if t not in state.records and t not in self._in_flight]
        self._queue.extend(missing)
        self.backend.prefetch([r.task for r in self._queue[: self.max_concurrent * 2]])
        if missing:
            log.info("step %d: %d trials to run (%d saved before)", step, len(missing), len(state.records))

    def _eval_due(self, served: int, *, final: bool = False) -> bool:
        evaluation = self.spec.evaluation
        if not self.plan.held_out or served in self._done_evals():
            return False
        if served in self._evals:
            return False
        if final:
            return True
        if served == 0:
            return bool(evaluation.at_start == "Enabled" or self.spec.mode == "Evaluate")
        return bool(served % evaluation.interval_steps == 0)

    def _done_evals(self) -> set[int]:
        return {e.step for e in self.store.eval_summaries()}

    def _plan_eval(self, version_step: int) -> None:
        requests = {r.trial: r for r in self.plan.eval_requests(version_step, policy_version(version_step))}
        state = _Step(version_step, requests)
        for record in self.store.saved_trials("validation", version_step):
            if record.trial in requests:
                state.records[record.trial] = record
        self._evals[version_step] = state
        # Evaluations go first: they gate sync-mode commits.
        missing = [r for t, r in requests.items() if t not in state.records and t not in self._in_flight]
        self._queue[:0] = missing
        log.info("evaluating policy v%d on %d held-out trials", version_step, len(requests))

    def _pending_evals(self, before: int | None = None) -> bool:
        return any(before is None or step < before for step in self._evals)

    def _launch(self) -> None:
        while self._queue and len(self._in_flight) < self.max_concurrent:
            request = self._queue.pop(0)
            self.backend.launch(request)
            self._in_flight[request.trial] = request
        self.progress.trials_running = len(self._in_flight)

    def _prepare(self, served: int, committed: int) -> None:
        """Name the next `warmTrials` trials to the backend to make ready: those queued, then the trials of
        the first step not planned yet (in Sync mode, planned only once the trainer serves the policy
        before it: its pods get ready while this step's trials run and the trainer trains)."""
        if self.warm_trials <= 0:
            return
        wanted = self._queue[: self.warm_trials]
        upcoming = max([committed, *self._steps]) + 1
        while len(wanted) < self.warm_trials and upcoming <= self.last_step:
            if self._upcoming is None or self._upcoming[0] != upcoming:
                saved = {r.trial for r in self.store.saved_trials("train", upcoming)}
                requests = self.plan.step_requests(upcoming, policy_version(served))
                self._upcoming = (upcoming, [r for r in requests if r.trial not in saved])
            if self._upcoming[1]:
                wanted = wanted + self._upcoming[1][: self.warm_trials - len(wanted)]
                break
            upcoming += 1  # all saved (a step committed since `committed` was read): the one after
        names = [r.trial for r in wanted]
        if names != self._prepared:
            self.backend.prepare(wanted)
            self._prepared = names

    def _collect(self, served: int) -> int:
        timeout = self.poll_seconds if self._in_flight else 0.0
        records = self.backend.collect(timeout)
        if not records and not self._in_flight:
            self.stop_event.wait(self.poll_seconds)
        for record in records:
            request = self._in_flight.pop(record.trial, None)
            if request is None:
                log.warning(
                    "the backend returned trial %s, which this controller did not launch", record.trial
                )
                self.backend.release(record.trial)
                continue
            self._save(record)
            self.backend.release(record.trial)  # only now: a crash before the save loses nothing
            self._finished_times.append(self.clock())
            for stage, seconds in record.stage_seconds.items():
                self._add_phase(stage, seconds)
            if record.split == "train":
                step = self._steps.get(record.step)
                if step is not None:
                    step.records[record.trial] = record
                self._count(record)
            else:
                self.progress.eval_trials += 1
                ev = self._evals.get(record.step)
                if ev is not None:
                    ev.records[record.trial] = record
                    if ev.done:
                        self._finish_eval(self._evals.pop(record.step))
        self.progress.trials_running = len(self._in_flight)
        return len(records)

    def _add_phase(self, name: str, seconds: float) -> None:
        self._phase[name] = self._phase.get(name, 0.0) + seconds

    def _count(self, record: TrialRecord) -> None:
        if record.trial in self._counted:
            return
        self._counted.add(record.trial)
        reason = record.termination_reason.value
        self.progress.by_reason[reason] = self.progress.by_reason.get(reason, 0) + 1
        self.progress.trials_total += 1
        if record.termination_reason in self.drop_reasons:
            self.progress.trials_dropped += 1

    def _finish_eval(self, ev: _Step) -> None:
        records = list(ev.records.values())
        scored = [r for r in records if r.eval_outcome() is not None]
        solved = sum(1 for r in scored if r.eval_outcome())
        low, high = wilson_interval(solved, len(scored))
        per_task: dict[str, list[float]] = {}
        for r in scored:
            per_task.setdefault(r.task_id, []).append(float(r.reward or 0.0))
        summary = EvalSummary(
            step=ev.step,
            policy_version=policy_version(ev.step),
            trials=len(records),
            scored=len(scored),
            solved=solved,
            solve_rate=solved / len(scored) if scored else None,
            interval95=(low, high),
            infra_failures=len(records) - len(scored),
            by_reason=dict(Counter(r.termination_reason.value for r in records)),
            per_task={k: sum(v) / len(v) for k, v in sorted(per_task.items())},
        )
        self.store.write_eval_summary(summary)
        log.info(
            "held-out solve rate of v%d: %s (95%% interval %.2f-%.2f, %d scored trials)",
            ev.step,
            f"{summary.solve_rate:.3f}" if summary.solve_rate is not None else "n/a",
            low,
            high,
            len(scored),
        )
        self._refresh_evals()

    def _commit(self, step: _Step) -> RunOutcome | None:
        records = [step.records[t] for t in sorted(step.records)]
        infra = sum(1 for r in records if r.termination_reason in INFRA_REASONS)
        kept = [r for r in records if r.termination_reason not in self.drop_reasons and r.reward is not None]
        groups: dict[str, list[float]] = {}
        for r in kept:
            groups.setdefault(r.group_id, []).append(float(r.reward or 0.0))
        zero_var = sum(1 for rewards in groups.values() if max(rewards) == min(rewards))
        reward_mean = sum(sum(g) for g in groups.values()) / len(kept) if kept else None
        versions = sorted({v for r in records for v in r.policy_versions}, key=_version_key)
        by_reason = dict(sorted(Counter(r.termination_reason.value for r in records).items()))
        summary = BatchSummary(
            trials=len(records),
            infra_failures=infra,
            kept=len(kept),
            zero_variance_groups=zero_var,
            groups=len(groups),
            reward_mean=reward_mean,
            policy_versions_seen=versions,
            by_reason=by_reason,
        )
        launched_at = min((r.policy_version for r in step.requests.values()), key=parse_policy_version)
        self.store.commit_batch(step.step, records, policy_version=launched_at, meta=summary.to_json())
        self.progress.step = step.step
        self.progress.zero_variance_groups += zero_var
        self.progress.reward_mean = reward_mean
        log.info(
            "step %d committed: %d trials, reward %s, %d infra failures, %d/%d zero-variance groups",
            step.step,
            len(records),
            f"{reward_mean:.3f}" if reward_mean is not None else "n/a",
            infra,
            zero_var,
            len(groups),
        )
        share = 100.0 * infra / len(records) if records else 0.0
        if share > self.spec.stop.max_infra_failure_percent:
            reasons = ", ".join(
                f"{k} {v}" for k, v in by_reason.items() if TerminationReason(k) in INFRA_REASONS
            )
            return self._end(
                "Failed",
                "InfraFailures",
                f"step {step.step}: {infra} of {len(records)} trials failed for infrastructure reasons "
                f"({reasons}), above stop.maxInfraFailurePercent="
                f"{self.spec.stop.max_infra_failure_percent}; see the trials' errors in the run store",
            )
        target = self.spec.stop.target_reward
        if target is not None and reward_mean is not None and reward_mean >= float(target):
            # The batch is committed: the trainer still learns from it, then the run ends.
            self.last_step = step.step
            self._end_reason = (
                "TargetReward",
                f"step {step.step}'s mean reward {reward_mean:.3f} reached stop.targetReward={target}",
            )
            self._queue = [r for r in self._queue if r.split != "train" or r.step <= step.step]
        return None

    # -- resume, cancel, end ----------------------------------------------------------------------

    def _resume(self) -> None:
        saved = Progress.from_json(self.store.read_controller_state(), run=self.name)
        self.progress.fidelity_guard_after = saved.fidelity_guard_after
        committed = self.store.committed_steps()
        for step in committed:
            for record in self.store.read_batch(step).trials:
                self._count(record)
            summary = BatchSummary.from_json(self.store.batch_ref(step).meta)
            self.progress.zero_variance_groups += summary.zero_variance_groups or 0
            self.progress.reward_mean = summary.reward_mean
        if committed:
            self.progress.step = committed[-1]
            log.info("resuming after step %d (%d trials recorded)", committed[-1], self.progress.trials_total)
        stored: dict[tuple[str, int], set[str]] = {}
        for request in self.backend.adopt():
            key = (request.split, request.step)
            if key not in stored:
                stored[key] = {r.trial for r in self.store.saved_trials(request.split, request.step)}
            if request.trial in stored[key]:
                # Saved by the controller before this one, which stopped before releasing it: its record
                # stands (what is left of its pods, maybe half deleted, would grade it again, wrongly).
                log.info("trial %s was saved before the restart; releasing what is left of it", request.trial)
                self.backend.release(request.trial)
                continue
            self._in_flight[request.trial] = request
        self._refresh_evals()
        self._refresh_trainer_metrics()

    def _refresh_evals(self) -> None:
        evals = self.store.eval_summaries()
        if not evals:
            return
        first, last = evals[0], evals[-1]
        if first.step == 0:
            self.progress.baseline_solve_rate = first.solve_rate
        self.progress.held_out_solve_rate = last.solve_rate
        self.progress.held_out_interval = last.interval95

    def _refresh_trainer_metrics(self) -> None:
        metrics = self.store.step_figures()
        if not metrics:
            return
        last = metrics[-1]
        self.progress.fidelity_correlation = _number(last.fidelity_pearson)
        self.progress.max_abs_logprob_delta = _number(last.fidelity_max_abs_logprob_delta)
        self.progress.tokens_per_second = _number(last.tokens_per_second)
        if not self._guard_paused:
            self._fidelity_guard(metrics)

    def _fidelity_guard(self, metrics: list[StepFigures]) -> None:
        """Count the newest consecutive steps below fidelity.minCorrelation (after the last pause); at
        `windowSteps` of them the run is Degraded (and `_run` pauses it when the action is Pause)."""
        guard = self.spec.fidelity
        floor = float(guard.min_correlation)
        below: list[tuple[int, float]] = []
        for figures in reversed(metrics):
            step = figures.step
            if step <= self.progress.fidelity_guard_after:
                break
            value = _number(figures.fidelity_pearson)
            if value is None:
                continue  # a step with nothing trained says nothing about fidelity
            if value >= floor:
                break
            below.append((step, value))
        self.progress.fidelity_below_steps = len(below)
        self._guard_newest = below[0][0] if below else 0
        if len(below) >= guard.window_steps:
            shown = ", ".join(f"step {s}: {v:.4f}" for s, v in reversed(below[: guard.window_steps]))
            self.progress.degraded_reason = FIDELITY_REASON
            self.progress.degraded_message = (
                f"rollout vs. training probability correlation below fidelity.minCorrelation {floor} for "
                f"{len(below)} consecutive step(s) ({shown}): the trainer is not scoring what the engine "
                "sampled"
            )
        elif self.progress.degraded_reason == FIDELITY_REASON:
            self.progress.degraded_reason, self.progress.degraded_message = None, ""

    def _cancel_all(self) -> None:
        for trial in list(self._in_flight):
            self.backend.cancel(trial)
        deadline = self.clock() + 60
        while self._in_flight and self.clock() < deadline:
            for record in self.backend.collect(1.0):
                if (
                    self._in_flight.pop(record.trial, None) is not None
                    and record.termination_reason != TerminationReason.CANCELLED
                ):
                    # It ended on its own before the cancel landed: keep it.
                    self._save(record)
                self.backend.release(record.trial)
        self._queue.clear()

    def _save(self, record: TrialRecord) -> None:
        """Save a finished trial at once (nothing is lost on a crash), then tell `on_trial` (traces)."""
        self.store.save_trial(record)
        if self.on_trial is not None:
            try:
                self.on_trial(record)
            except Exception:  # telemetry must never stop a run
                log.exception("on_trial failed for %s", record.trial)

    def _finished(self, served: int) -> RunOutcome:
        reason, message = self._end_reason
        return self._end("Succeeded", reason, message)

    def _end(self, state: Literal["Succeeded", "Failed", "Stopped"], reason: str, message: str) -> RunOutcome:
        self.progress.message = message
        self._publish()
        return RunOutcome(state=state, reason=reason, message=message, progress=self.progress)

    def _publish(self) -> None:
        now = self.clock()
        self._published_at = now
        self.progress.elapsed_seconds = now - self._started
        recent = [t for t in self._finished_times if now - t <= 600]
        window = min(600.0, now - self._started)
        self.progress.trials_per_minute = 60.0 * len(recent) / window if window > 5 and recent else None
        self.progress.phase_seconds = dict(self._phase)
        self._refresh_trainer_metrics()
        done = self.progress.step
        if done > 0 and self.last_step > done:
            per_step = self.progress.elapsed_seconds / max(done, 1)
            self.progress.eta_seconds = per_step * (self.last_step - done)
        elif self.last_step <= done:
            self.progress.eta_seconds = 0.0
        try:
            self.store.write_controller_state(self.progress.to_json())
        except OSError as exc:  # the display must not kill the run
            log.warning("could not write the controller's progress: %s", exc)
        if self.on_progress is not None:
            self.on_progress(self.progress)


def _version_key(version: str) -> tuple[int, str]:
    """Sort key for recorded versions, tolerant of names the proxy or an engine may report (`unknown`)."""
    try:
        return (parse_policy_version(version), version)
    except ValueError:
        return (-1, version)


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None

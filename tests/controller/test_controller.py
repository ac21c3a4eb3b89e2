"""The run controller's loop against a scripted backend and a stand-in trainer.

The backend here is a fake on purpose: it returns records whose rewards the test chooses, so the loop's
bookkeeping (plans, batches, evaluations, resume, stop conditions, staleness) can be checked exactly. The
real backends run in tests/e2e/test_embedded_run.py (local processes, vLLM, mini-swe-agent, Megatron) and
tests/operator/test_operator_controller.py (kopf against the API mock).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from legorl.api.kinds import RLRun
from legorl.api.store import RunStore, policy_version
from legorl.api.summary import TrajectorySummary
from legorl.api.termination import TerminationReason
from legorl.api.trajectory import Segment, TrialRecord
from legorl.controller.backend import TrialRequest
from legorl.controller.loop import RunController
from legorl.controller.plan import PlanError, TaskPlan, wilson_interval
from legorl.controller.records import reconcile
from legorl.sandbox.task import SPLIT_KEY, Task, TaskSet

NOW = datetime(2026, 12, 1, tzinfo=UTC)


def _task(i: int) -> Task:
    return Task(
        instance_id=f"task-{i:02d}",
        repo="r",
        base_commit="0" * 40,
        problem_statement="fix it",
        test_patch="",
        fail_to_pass=("tests/test_x.py::test_a",),
        pass_to_pass=(),
    )


def task_set(n: int = 10) -> TaskSet:
    return TaskSet(tasks=tuple(_task(i) for i in range(n)), root=Path("/nonexistent"))


def labelled_task_set(**counts: int) -> TaskSet:
    """`counts` tasks per split label (`train=6, validation=3, test=2`), ids `<label>-<i>`; the label
    `none` makes tasks without one."""
    tasks = []
    for label, count in counts.items():
        extra = {} if label == "none" else {SPLIT_KEY: label}
        tasks += [
            dataclasses.replace(_task(i), instance_id=f"{label}-{i}", extra=extra) for i in range(count)
        ]
    return TaskSet(tasks=tuple(tasks), root=Path("/nonexistent"))


def _ids(tasks: Sequence[Task]) -> set[str]:
    return {t.instance_id for t in tasks}


def make_run(**spec: Any) -> RLRun:
    body: dict[str, Any] = {
        "policy": {"checkpoint": {"uri": "builtin://tiny-moe"}},
        "harness": {"kind": "MiniSweAgent"},
        "tasks": {"source": {"uri": "builtin://tiny-python"}, "split": {"heldOutPercent": 20}, "seed": 3},
        "algorithm": {"groupSize": 2, "tasksPerStep": 2},
        "schedule": {"mode": "Sync", "maxConcurrentTrials": 3},
        "stop": {"maxSteps": 3},
        "evaluation": {"intervalSteps": 2, "trialsPerTask": 2},
    }
    for key, value in spec.items():
        if isinstance(value, dict) and isinstance(body.get(key), dict):
            body[key] = {**body[key], **value}
        else:
            body[key] = value
    return RLRun.model_validate(
        {"apiVersion": "legorl.dev/v1alpha1", "kind": "RLRun", "metadata": {"name": "t"}, "spec": body}
    )


Reward = Callable[[TrialRequest], tuple[TerminationReason, float | None]]


class ScriptedBackend:
    """Finishes launched trials after `delay` polls with the reward `reward(request)` chooses; the served
    version at the end of the trial is recorded as the proxy would."""

    def __init__(self, store: RunStore, reward: Reward, served: Callable[[], int]) -> None:
        self.store = store
        self.reward = reward
        self.served = served
        self.launched: list[TrialRequest] = []
        self.live: dict[str, TrialRequest] = {}
        self.cancelled: list[str] = []
        self.released: list[str] = []
        """Trials `release`d, in order (each after its record was saved)."""
        self.on_launch: Callable[[TrialRequest], None] | None = None
        self.prepared: list[list[str]] = []
        """The trials named to each `prepare` call, in order."""

    def launch(self, request: TrialRequest) -> None:
        self.launched.append(request)
        self.live[request.trial] = request
        if self.on_launch is not None:
            self.on_launch(request)

    def collect(self, timeout: float) -> list[TrialRecord]:
        out = []
        for trial, request in list(self.live.items())[:2]:
            del self.live[trial]
            cancelled = trial in self.cancelled
            reason, reward = (TerminationReason.CANCELLED, None) if cancelled else self.reward(request)
            versions = sorted({request.policy_version, policy_version(self.served())})
            seg = Segment(
                index=0,
                token_ids=[1, 2, 3],
                loss_mask=[0, 1, 1],
                behavior_logprobs=[0.0, -0.5, -0.5],
                turn_indices=[0],
                policy_versions=versions,
            )
            out.append(
                TrialRecord(
                    run="t",
                    trial=trial,
                    task_id=request.task.instance_id,
                    group_id=request.group_id,
                    split=request.split,
                    step=request.step,
                    harness="MiniSweAgent",
                    termination_reason=reason,
                    reward=reward,
                    started_at=NOW,
                    ended_at=NOW,
                    segments=[seg],
                    policy_versions=versions,
                    stage_seconds={"agent": 1.0, "verify": 0.5},
                )
            )
        return out

    def running(self) -> list[str]:
        return list(self.live)

    def adopt(self) -> list[TrialRequest]:
        return []

    def release(self, trial: str) -> None:
        self.live.pop(trial, None)
        self.released.append(trial)

    def prefetch(self, tasks: Sequence[Task]) -> None:
        pass

    def prepare(self, requests: Sequence[TrialRequest]) -> None:
        self.prepared.append([r.trial for r in requests])

    def cancel(self, trial: str) -> None:
        self.cancelled.append(trial)

    def close(self) -> None:
        pass


class FakeTrainer:
    """Stands in for the trainer: serves step N once batch N is committed (after `lag` polls), writing the
    trainer state the real TrainingService writes."""

    def __init__(self, store: RunStore, lag: int = 0) -> None:
        self.store = store
        self.lag = lag
        self.step = 0
        self._polls = 0
        self.fidelity: Callable[[int], float] | None = None
        """When set, the rollout-vs-training correlation the trainer records for each step it trains."""

    def served_step(self) -> int:
        committed = self.store.committed_steps()
        if committed and committed[-1] > self.step and self.step + 1 in committed:
            self._polls += 1
            if self._polls > self.lag:
                self._polls = 0
                self.step += 1
                state = {"step": self.step, "policy_version": policy_version(self.step)}
                if self.fidelity is not None:
                    self.store.write_metrics(
                        self.step, {"step": self.step, "fidelity_pearson": self.fidelity(self.step)}
                    )
                self.store.write_trainer_state(state)
        return self.step

    def error(self) -> str | None:
        return None


def alternating(request: TrialRequest) -> tuple[TerminationReason, float | None]:
    replica = int(request.trial.rsplit("-r", 1)[1])
    return TerminationReason.COMPLETED, float(replica % 2)


def controller(
    tmp_path: Path,
    run: RLRun,
    reward: Reward = alternating,
    lag: int = 0,
    n: int = 10,
    *,
    tasks: TaskSet | None = None,
) -> tuple[RunController, ScriptedBackend, FakeTrainer, RunStore]:
    store = RunStore(str(tmp_path / "store"))
    trainer = FakeTrainer(store, lag=lag)
    backend = ScriptedBackend(store, reward, lambda: trainer.step)
    ctl = RunController(
        run,
        store=store,
        backend=backend,
        task_set=tasks if tasks is not None else task_set(n),
        trainer=trainer,
        poll_seconds=0.0,
    )
    return ctl, backend, trainer, store


def test_plan_is_reproducible_and_splits_the_tasks() -> None:
    run = make_run(tasks={"epochs": 2})
    a = TaskPlan.from_spec(run.spec, task_set())
    b = TaskPlan.from_spec(run.spec, task_set())
    assert a == b
    assert len(a.held_out) == 2
    assert not {t.instance_id for t in a.held_out} & {t.instance_id for t in a.train}
    assert len(a.train) == 16  # 8 tasks x 2 epochs, each epoch once
    assert sorted(t.instance_id for t in a.train[:8]) == sorted(t.instance_id for t in a.train[8:])
    assert a.available_steps == 8
    requests = a.step_requests(1, "v0")
    assert [r.trial for r in requests] == ["s1-t0-r0", "s1-t0-r1", "s1-t1-r0", "s1-t1-r1"]
    assert requests[0].group_id == requests[1].group_id != requests[2].group_id
    other = TaskPlan.from_spec(make_run(tasks={"seed": 4, "epochs": 2}).spec, task_set())
    assert other.train != a.train


def test_plan_refuses_what_cannot_run() -> None:
    with pytest.raises(PlanError, match="not in the task set"):
        TaskPlan.from_spec(make_run(tasks={"split": {"heldOutTaskIds": ["nope"]}}).spec, task_set())
    ids = [f"task-{i:02d}" for i in range(3)]
    with pytest.raises(PlanError, match="every task is held out"):
        TaskPlan.from_spec(make_run(tasks={"split": {"heldOutTaskIds": ids}}).spec, task_set(3))


def test_plan_with_the_task_sets_own_split_trains_on_train_and_holds_out_one_label() -> None:
    tasks = labelled_task_set(train=6, validation=3, test=2)
    train_ids = {f"train-{i}" for i in range(6)}
    for held, other in (("validation", "test"), ("test", "validation")):
        run = make_run(tasks={"split": {"taskSetSplit": held}, "epochs": 2})
        plan = TaskPlan.from_spec(run.spec, tasks)
        assert plan == TaskPlan.from_spec(run.spec, tasks)
        assert _ids(plan.held_out) == {t.instance_id for t in tasks if t.split == held}
        assert _ids(plan.train) == train_ids
        assert len(plan.train) == 12  # each epoch once
        # The other held-out split never runs, neither in training nor in evaluation.
        launched = _ids([r.task for r in plan.step_requests(1, "v0") + plan.eval_requests(0, "v0")])
        for step in range(2, plan.available_steps + 1):
            launched |= _ids([r.task for r in plan.step_requests(step, "v0")])
        assert not any(i.startswith(other) for i in launched)
    # maxTasks caps the training pool only; the held-out split stays whole.
    capped = TaskPlan.from_spec(
        make_run(tasks={"split": {"taskSetSplit": "test"}, "maxTasks": 4}).spec, tasks
    )
    assert len(capped.train) == 4 and _ids(capped.train) <= train_ids
    assert _ids(capped.held_out) == {"test-0", "test-1"}


@pytest.mark.parametrize(
    ("tasks", "split", "message"),
    [
        (
            task_set(),
            "test",
            "tasks.split.taskSetSplit is 'test' but no task of the task set is labelled legorl_split=test; "
            "this split needs a task set with split labels such as builtin://tiny-read",
        ),
        (
            labelled_task_set(train=3, validation=2),
            "test",
            "no task of the task set is labelled legorl_split=test",
        ),
        (labelled_task_set(train=3, test=2, none=1), "test", "but task none-0 has no label (1 of 6 tasks"),
        (labelled_task_set(train=3, dev=1, test=2), "test", "but task dev-0 is labelled 'dev'"),
        (
            labelled_task_set(validation=2, test=2),
            "test",
            "no task of the task set is labelled legorl_split=train",
        ),
    ],
    ids=["unlabelled-set", "split-missing", "one-unlabelled", "unknown-label", "nothing-to-train"],
)
def test_plan_refuses_a_task_set_split_the_task_set_cannot_give(
    tasks: TaskSet, split: str, message: str
) -> None:
    with pytest.raises(PlanError) as caught:
        TaskPlan.from_spec(make_run(tasks={"split": {"taskSetSplit": split}}).spec, tasks)
    assert message in str(caught.value)


def test_evaluate_mode_plans_every_task_or_only_the_task_set_split() -> None:
    tasks = labelled_task_set(train=4, validation=3, test=2)
    every = TaskPlan.from_spec(make_run(mode="Evaluate").spec, tasks)
    assert _ids(every.held_out) == _ids(tuple(tasks)) and every.train == ()
    test = TaskPlan.from_spec(
        make_run(mode="Evaluate", tasks={"split": {"taskSetSplit": "test"}}).spec, tasks
    )
    assert _ids(test.held_out) == {"test-0", "test-1"}
    # An evaluation needs no training tasks.
    only_test = labelled_task_set(test=2)
    evaluate = make_run(mode="Evaluate", tasks={"split": {"taskSetSplit": "test"}})
    assert _ids(TaskPlan.from_spec(evaluate.spec, only_test).held_out) == {"test-0", "test-1"}


def test_wilson_interval() -> None:
    low, high = wilson_interval(0, 10)
    assert low == 0.0 and 0.25 < high < 0.35
    low, high = wilson_interval(5, 10)
    assert low < 0.5 < high
    assert wilson_interval(0, 0) == (0.0, 1.0)


def _ended(reason: str) -> TrajectorySummary:
    end = {"reason": reason, "source": "proxy", "endedAt": "2026-12-01T00:00:00+00:00"}
    return TrajectorySummary.from_json({"run": "r", "trial": "t", "state": "ended", "end": end})


def test_reconcile_prefers_what_the_proxy_saw() -> None:
    ended = _ended("turn_limit")
    assert reconcile("agent_error", ended) == TerminationReason.TURN_LIMIT
    assert reconcile("completed", _ended("completed")) == TerminationReason.COMPLETED
    assert reconcile("defense_failed", ended) == TerminationReason.DEFENSE_FAILED
    assert reconcile("completed", None) == TerminationReason.PROXY_ERROR


def test_sync_run_commits_every_step_and_evaluates(tmp_path: Path) -> None:
    ctl, backend, _, store = controller(tmp_path, make_run())
    outcome = ctl.run()
    assert (outcome.state, outcome.reason) == ("Succeeded", "MaxSteps"), outcome.message
    assert store.committed_steps() == [1, 2, 3]
    for step in (1, 2, 3):
        batch = store.read_batch(step)
        assert len(batch.trials) == 4
        # Sync mode: every trial of step s ran on v(s-1), and nothing straddled a swap.
        assert {v for t in batch.trials for v in t.policy_versions} == {policy_version(step - 1)}
        assert batch.ref.meta["zero_variance_groups"] == 0
        assert batch.ref.meta["reward_mean"] == 0.5
    evals = store.read_evals()
    assert [e["step"] for e in evals] == [0, 2, 3]  # at start, every 2 versions, and the final one
    assert all(e["trials"] == 4 and e["solve_rate"] == 0.5 for e in evals)
    assert len(backend.launched) == 3 * 4 + 3 * 4
    assert len({r.trial for r in backend.launched}) == len(backend.launched)
    assert ctl.progress.trials_total == 12
    assert ctl.progress.baseline_solve_rate == 0.5
    state = store.read_controller_state()
    assert state is not None and state["step"] == 3


def test_evaluate_run_with_a_task_set_split_scores_only_its_tasks(tmp_path: Path) -> None:
    run = make_run(mode="Evaluate", tasks={"split": {"taskSetSplit": "test"}})
    tasks = labelled_task_set(train=4, validation=3, test=2)
    ctl, backend, _, store = controller(tmp_path, run, tasks=tasks)
    outcome = ctl.run()
    assert (outcome.state, outcome.reason) == ("Succeeded", "Evaluated"), outcome.message
    assert _ids([r.task for r in backend.launched]) == {"test-0", "test-1"}
    assert len(backend.launched) == 2 * 2  # trialsPerTask each
    assert {r.split for r in backend.launched} == {"validation"}
    assert store.committed_steps() == []
    assert [(e["step"], e["trials"]) for e in store.read_evals()] == [(0, 4)]


def test_a_restart_reruns_no_finished_trial(tmp_path: Path) -> None:
    run = make_run()
    ctl, backend, _, store = controller(tmp_path, run)

    def stop_midway(request: TrialRequest) -> None:
        if request.trial == "s2-t0-r1":
            ctl.stop()

    backend.on_launch = stop_midway
    outcome = ctl.run()
    assert outcome.state == "Stopped"
    assert store.committed_steps() == [1]
    first = {r.trial for r in backend.launched} - set(backend.cancelled)
    assert backend.cancelled  # trials running at the stop were cancelled ...
    saved = {r.trial for r in store.saved_trials("train", 2)}
    assert not saved & set(backend.cancelled)  # ... and not saved: they run again

    ctl2, backend2, _, _ = controller(tmp_path, run)
    ctl2.trainer.step = 1  # type: ignore[attr-defined]
    outcome = ctl2.run()
    assert outcome.reason == "MaxSteps", outcome.message
    again = {r.trial for r in backend2.launched}
    assert not again & (first & {f"s1-t{i}-r{k}" for i in range(2) for k in range(2)})
    assert not again & saved
    assert store.committed_steps() == [1, 2, 3]
    assert ctl2.progress.trials_total == 12


def test_each_trial_is_released_only_once_its_record_is_saved(tmp_path: Path) -> None:
    """A backend keeps a returned trial's objects (a cluster's pods hold the proxy's journal) until the
    controller has saved the record: an operator killed between the two loses nothing."""
    run = make_run()
    ctl, backend, _, store = controller(tmp_path, run)
    requests: dict[str, TrialRequest] = {}
    saved_at_release: list[bool] = []
    backend.on_launch = lambda request: requests.update({request.trial: request})
    release = backend.release

    def checked(trial: str) -> None:
        request = requests[trial]
        saved_at_release.append(trial in {r.trial for r in store.saved_trials(request.split, request.step)})
        release(trial)

    backend.release = checked  # type: ignore[method-assign]
    assert ctl.run().reason == "MaxSteps"
    assert sorted(backend.released) == sorted(requests) and all(saved_at_release), saved_at_release


def test_warm_trials_name_the_next_trials_and_the_next_steps_before_they_launch(tmp_path: Path) -> None:
    """`schedule.warmTrials`: the backend is told which trials come next, in launch order, at most that
    many, none already saved; the next step's trials are named while the trainer has yet to serve the
    policy they wait for (in Sync mode its trials are launched only then)."""
    run = make_run(schedule={"warmTrials": 4})
    ctl, backend, trainer, store = controller(tmp_path, run)
    named_at: dict[str, int] = {}  # trial -> the served step when it was first named
    prepare = backend.prepare

    def recorded(requests: Sequence[TrialRequest]) -> None:
        prepare(requests)
        for r in requests:
            assert r.trial not in {t.trial for t in store.saved_trials(r.split, r.step)}, "a saved trial"
            named_at.setdefault(r.trial, trainer.step)

    backend.prepare = recorded  # type: ignore[method-assign]
    launched_named: list[tuple[str, bool]] = []
    backend.on_launch = lambda request: launched_named.append((request.trial, request.trial in named_at))
    assert ctl.run().reason == "MaxSteps"
    assert backend.prepared and all(len(names) <= 4 for names in backend.prepared)
    assert backend.prepared[-1] == []  # at the end, nothing is kept ready
    # Every trial of steps 2 and 3 was named before it launched, while the policy it waits for was not
    # served yet.
    later = [(t, named) for t, named in launched_named if t.startswith(("s2-", "s3-"))]
    assert len(later) == 8 and all(named for _, named in later), launched_named
    assert all(named_at[t] == int(t[1]) - 2 for t, _ in later), named_at
    # Each call names trials in the order they launch.
    order = {t: i for i, (t, _) in enumerate(launched_named)}
    for names in backend.prepared:
        launched = [order[t] for t in names if t in order]
        assert launched == sorted(launched), (names, order)


def test_no_warm_trials_no_prepare(tmp_path: Path) -> None:
    ctl, backend, _, _ = controller(tmp_path, make_run())
    assert ctl.run().reason == "MaxSteps"
    assert backend.prepared == []


def test_an_adopted_trial_saved_before_the_restart_keeps_its_record(tmp_path: Path) -> None:
    """An operator killed after saving a trial but before deleting its pods: the next one finds the pods
    and adopts the trial. Its record stands; the trial is released, not collected and saved again (what
    is left of its pods, maybe half deleted, would grade it again as an infra failure)."""
    run = make_run()
    ctl, backend, _, store = controller(tmp_path, run)
    first: list[TrialRequest] = []

    def stop_midway(request: TrialRequest) -> None:
        first.append(request)
        if request.trial == "s2-t0-r1":
            ctl.stop()

    backend.on_launch = stop_midway
    ctl.run()
    kept = store.saved_trials("train", 1)
    assert kept, "the first controller saved no trial"
    before = {r.trial: (r.termination_reason, r.reward) for r in kept}

    def sandbox_error(request: TrialRequest) -> tuple[TerminationReason, float | None]:
        return TerminationReason.SANDBOX_ERROR, None

    ctl2, backend2, _, _ = controller(tmp_path, run, reward=sandbox_error)
    saved_request = next(r for r in first if r.trial in before)

    def adopt() -> list[TrialRequest]:  # its pods are still there: collect would return it
        backend2.live[saved_request.trial] = saved_request
        return [saved_request]

    backend2.adopt = adopt  # type: ignore[method-assign]
    ctl2.trainer.step = 1  # type: ignore[attr-defined]
    ctl2.run()
    assert backend2.released[:1] == [saved_request.trial]
    after = {r.trial: (r.termination_reason, r.reward) for r in store.saved_trials("train", 1)}
    assert after[saved_request.trial] == before[saved_request.trial]


def test_async_runs_ahead_within_the_staleness_limit(tmp_path: Path) -> None:
    run = make_run(schedule={"mode": "Async", "maxStalenessSteps": 1}, evaluation={"atStart": "Disabled"})
    ctl, backend, trainer, store = controller(tmp_path, run, lag=3)
    seen: list[tuple[int, int]] = []
    backend.on_launch = lambda r: seen.append((r.step, trainer.step)) if r.split == "train" else None
    outcome = ctl.run()
    assert outcome.reason == "MaxSteps", outcome.message
    assert store.committed_steps() == [1, 2, 3]
    # Trials of step s start while the fleet serves v(s-2) at the oldest.
    assert all(step - 1 - served <= 1 for step, served in seen)
    assert any(step - 1 - served == 1 for step, served in seen), seen


def test_infra_failures_fail_the_run(tmp_path: Path) -> None:
    def broken(request: TrialRequest) -> tuple[TerminationReason, float | None]:
        return TerminationReason.SANDBOX_ERROR, None

    ctl, _, _, store = controller(tmp_path, make_run(evaluation={"atStart": "Disabled"}), reward=broken)
    outcome = ctl.run()
    assert (outcome.state, outcome.reason) == ("Failed", "InfraFailures")
    assert "4 of 4 trials" in outcome.message and "sandbox_error 4" in outcome.message
    assert store.committed_steps() == [1]  # kept for the UI; the trainer drops them


def test_target_reward_ends_the_run(tmp_path: Path) -> None:
    def solved(request: TrialRequest) -> tuple[TerminationReason, float | None]:
        return TerminationReason.COMPLETED, 1.0

    run = make_run(stop={"maxSteps": 3, "targetReward": "0.9"}, evaluation={"atStart": "Disabled"})
    ctl, _, _, store = controller(tmp_path, run, reward=solved)
    outcome = ctl.run()
    assert outcome.reason == "TargetReward", outcome.message
    assert store.committed_steps() == [1]
    assert ctl.progress.zero_variance_groups == 2


def test_trainer_failure_stops_the_run(tmp_path: Path) -> None:
    ctl, _, trainer, _ = controller(tmp_path, make_run())
    trainer.error = lambda: "out of memory"  # type: ignore[method-assign]
    outcome = ctl.run()
    assert (outcome.state, outcome.reason) == ("Failed", "TrainerFailed")
    assert "out of memory" in outcome.message


def test_stop_from_another_thread(tmp_path: Path) -> None:
    ctl, _, _, _ = controller(tmp_path, make_run(stop={"maxSteps": 100}, tasks={"epochs": 50}))
    timer = threading.Timer(0.5, ctl.stop)
    timer.start()
    outcome = ctl.run()
    timer.join()
    assert outcome.state == "Stopped"


def test_fidelity_guard_pauses_after_k_low_steps_and_a_resume_rearms_it(tmp_path: Path) -> None:
    guard = {"minCorrelation": "0.99", "windowSteps": 2, "action": "Pause"}
    run = make_run(stop={"maxSteps": 6}, tasks={"epochs": 5}, fidelity=guard)
    ctl, backend, trainer, store = controller(tmp_path, run)
    trainer.fidelity = lambda step: 0.999 if step == 1 else 0.5  # steps 2 and 3 below: window reached
    outcome = ctl.run()
    assert (outcome.state, outcome.reason) == ("Stopped", "FidelityBelowThreshold"), outcome.message
    assert "step 2: 0.5000, step 3: 0.5000" in outcome.message and "re-arms" in outcome.message
    assert ctl.progress.degraded_reason == "FidelityBelowThreshold"
    assert ctl.progress.fidelity_below_steps == 2
    assert max(store.committed_steps()) < 6
    assert not backend.running()  # running trials were cancelled
    saved = store.read_controller_state()
    assert saved is not None and saved["fidelity_guard_after"] == 3
    assert saved["degraded_reason"] == "FidelityBelowThreshold"

    # Resumed with healthy fidelity: the old low steps do not pause it again; it runs to the end.
    ctl2, _, trainer2, _ = controller(tmp_path, run)
    trainer2.step = 3
    trainer2.fidelity = lambda step: 0.999
    outcome = ctl2.run()
    assert outcome.reason == "MaxSteps", outcome.message
    assert ctl2.progress.degraded_reason is None and ctl2.progress.fidelity_below_steps == 0


def test_fidelity_guard_alert_degrades_without_stopping_and_one_low_step_is_not_enough(
    tmp_path: Path,
) -> None:
    run = make_run(fidelity={"windowSteps": 2, "action": "Alert"})
    ctl, _, trainer, _ = controller(tmp_path, run)
    trainer.fidelity = lambda step: 0.5
    outcome = ctl.run()
    assert outcome.reason == "MaxSteps", outcome.message
    assert ctl.progress.degraded_reason == "FidelityBelowThreshold"
    assert "3 consecutive step(s)" in ctl.progress.degraded_message

    # Near miss: low steps separated by a healthy one never make a window of 2.
    ctl, _, trainer, _ = controller(tmp_path / "b", make_run(fidelity={"windowSteps": 2, "action": "Pause"}))
    trainer.fidelity = lambda step: 0.5 if step % 2 else 0.995
    outcome = ctl.run()
    assert outcome.reason == "MaxSteps", outcome.message
    assert ctl.progress.degraded_reason is None


def test_every_saved_trial_reaches_on_trial_and_its_failures_do_not_stop_the_run(tmp_path: Path) -> None:
    store = RunStore(str(tmp_path / "store"))
    trainer = FakeTrainer(store)
    backend = ScriptedBackend(store, alternating, lambda: trainer.step)
    seen: list[str] = []

    def on_trial(record: TrialRecord) -> None:
        seen.append(record.trial)
        raise RuntimeError("the trace exporter is down")

    ctl = RunController(
        make_run(),
        store=store,
        backend=backend,
        task_set=task_set(),
        trainer=trainer,
        on_trial=on_trial,
        poll_seconds=0.0,
    )
    outcome = ctl.run()
    assert outcome.reason == "MaxSteps", outcome.message
    saved = {
        r.trial
        for split in ("train", "validation")
        for s in store.saved_steps(split)
        for r in store.saved_trials(split, s)
    }
    assert sorted(seen) == sorted(saved) and len(seen) == 24

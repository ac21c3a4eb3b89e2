"""Which tasks run when: the held-out split, epochs, shuffling with the run's seed, trial ids.

Everything here is a pure function of the RLRun's `spec.tasks`, `spec.algorithm` and the task set, so a
restarted controller makes the same plan and recognises its finished trials by id.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from legorl.api.run import RLRunSpec, TaskSelection
from legorl.sandbox.task import SPLIT_KEY, SPLIT_LABELS, Task, TaskSet

from .backend import TrialRequest


class PlanError(ValueError):
    """The task selection leaves nothing to train or evaluate on (a message a person can act on)."""


@dataclass(frozen=True)
class TaskPlan:
    """Training tasks in the order they are used, the held-out tasks, and the batch shape."""

    train: tuple[Task, ...]
    """Every epoch's tasks, concatenated (each epoch shuffled with its own seed)."""
    held_out: tuple[Task, ...]
    tasks_per_step: int
    group_size: int
    eval_trials_per_task: int

    @classmethod
    def from_spec(cls, spec: RLRunSpec, task_set: TaskSet) -> TaskPlan:
        tasks = sorted(task_set, key=lambda t: t.instance_id)
        if not tasks:
            raise PlanError("the task set is empty")
        selection = spec.tasks
        labelled = selection.split.task_set_split
        if labelled is not None:
            held_out, pool = _labelled_split(tasks, labelled)
        elif spec.mode == "Evaluate":
            held_out, pool = tuple(tasks), []  # an evaluation scores every task; nothing trains
        else:
            held_ids = _held_out_ids(selection, tasks)
            held_out = tuple(t for t in tasks if t.instance_id in held_ids)
            pool = [t for t in tasks if t.instance_id not in held_ids]
        if selection.max_tasks is not None:
            rng = random.Random(f"max-tasks/{selection.seed}")  # noqa: S311 - reproducible, not a secret
            pool = sorted(rng.sample(pool, min(selection.max_tasks, len(pool))), key=lambda t: t.instance_id)
        if not pool and spec.mode == "Train":
            if labelled is not None:
                raise PlanError(
                    f"no task of the task set is labelled {SPLIT_KEY}=train, and tasks.split.taskSetSplit "
                    "trains on those only"
                )
            raise PlanError("every task is held out: lower tasks.split.heldOutPercent or list fewer ids")
        train: list[Task] = []
        for epoch in range(selection.epochs):
            shuffled = list(pool)
            rng = random.Random(f"epoch/{selection.seed}/{epoch}")  # noqa: S311 - reproducible, not a secret
            rng.shuffle(shuffled)
            train.extend(shuffled)
        return cls(
            train=tuple(train),
            held_out=held_out,
            tasks_per_step=spec.algorithm.tasks_per_step,
            group_size=spec.algorithm.group_size,
            eval_trials_per_task=spec.evaluation.trials_per_task,
        )

    @property
    def available_steps(self) -> int:
        """Training steps the task order fills (the last may hold fewer tasks)."""
        return math.ceil(len(self.train) / self.tasks_per_step)

    def step_tasks(self, step: int) -> tuple[Task, ...]:
        """Tasks of training step `step` (1-based)."""
        if step < 1:
            raise ValueError(f"steps start at 1, got {step}")
        start = (step - 1) * self.tasks_per_step
        return self.train[start : start + self.tasks_per_step]

    def step_requests(self, step: int, policy_version: str) -> list[TrialRequest]:
        """`group_size` trials per task of `step`; ids `s<step>-t<index>-r<replica>`."""
        out = []
        for i, task in enumerate(self.step_tasks(step)):
            group = f"s{step}-t{i}-{task.instance_id}"
            for r in range(self.group_size):
                out.append(
                    TrialRequest(
                        trial=f"s{step}-t{i}-r{r}",
                        task=task,
                        group_id=group,
                        split="train",
                        step=step,
                        policy_version=policy_version,
                    )
                )
        return out

    def eval_requests(self, version_step: int, policy_version: str) -> list[TrialRequest]:
        """Held-out trials evaluating policy version `version_step`; ids `e<step>-t<index>-r<replica>`."""
        out = []
        for i, task in enumerate(self.held_out):
            for r in range(self.eval_trials_per_task):
                out.append(
                    TrialRequest(
                        trial=f"e{version_step}-t{i}-r{r}",
                        task=task,
                        group_id=f"e{version_step}-t{i}-{task.instance_id}",
                        split="validation",
                        step=version_step,
                        policy_version=policy_version,
                    )
                )
        return out


def _held_out_ids(selection: TaskSelection, tasks: list[Task]) -> set[str]:
    """Ids held out by `heldOutTaskIds`, or by `heldOutPercent` of the tasks chosen with the seed."""
    if selection.split.held_out_task_ids is not None:
        ids = {t.instance_id for t in tasks}
        unknown = sorted(set(selection.split.held_out_task_ids) - ids)
        if unknown:
            raise PlanError(f"tasks.split.heldOutTaskIds names tasks not in the task set: {unknown[:5]}")
        return set(selection.split.held_out_task_ids)
    share = (selection.split.held_out_percent or 0) / 100
    order = [t.instance_id for t in tasks]
    rng = random.Random(f"held-out/{selection.seed}")  # noqa: S311 - reproducible, not a secret
    rng.shuffle(order)
    count = round(len(order) * share)
    if share > 0 and count == 0 and len(order) > 1:
        count = 1
    return set(order[:count])


def _labelled_split(tasks: list[Task], held: str) -> tuple[tuple[Task, ...], list[Task]]:
    """`tasks.split.taskSetSplit`: the tasks labelled `held` and, to train on, those labelled `train`.
    Tasks of the other held-out label are in neither."""
    held_out = tuple(t for t in tasks if t.split == held)
    if not held_out:
        raise PlanError(
            f"tasks.split.taskSetSplit is {held!r} but no task of the task set is labelled "
            f"{SPLIT_KEY}={held}; this split needs a task set with split labels such as builtin://tiny-read"
        )
    unlabelled = [t for t in tasks if t.split not in SPLIT_LABELS]
    if unlabelled:
        first = unlabelled[0]
        got = "has no label" if first.split is None else f"is labelled {first.split!r}"
        raise PlanError(
            f"tasks.split.taskSetSplit needs every task labelled {SPLIT_KEY} (train, validation or test), "
            f"but task {first.instance_id} {got} ({len(unlabelled)} of {len(tasks)} tasks are not labelled)"
        )
    return held_out, [t for t in tasks if t.split == "train"]


def wilson_interval(successes: int, trials: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a proportion (sane at 0 and n, unlike the normal approximation)."""
    if trials == 0:
        return (0.0, 1.0)
    p = successes / trials
    denom = 1 + z * z / trials
    centre = (p + z * z / (2 * trials)) / denom
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))

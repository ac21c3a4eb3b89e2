"""builtin://tiny-read: tasks whose fix is read off the test output, in train / validation / test splits.

Generated for real (git bundles in a temporary cache); a sample of tasks of every split is checked end to
end in a real checkout: the test command prints the task's diagnosis, the fix written from it earns
reward 1 from the hidden tests, the buggy base and the wrong fix earn 0.
"""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from legorl.sandbox import reading
from legorl.sandbox.task import SPLIT_KEY, TaskSet, load_task_set
from legorl.sandbox.workspace import checkout_source
from legorl.trainer.warmstart.demos import SUBMIT_COMMAND, grade_commands

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def manifest(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return reading.generate(tmp_path_factory.mktemp("tiny-read") / "set")


@pytest.fixture(scope="module")
def task_set(manifest: Path) -> TaskSet:
    return load_task_set(manifest)


def test_command_line_prints_the_manifest(manifest: Path, tmp_path: Path) -> None:
    run = [sys.executable, "-m", "legorl.sandbox.reading"]
    proc = subprocess.run([*run, str(manifest.parent)], capture_output=True, text=True, check=False)
    assert (proc.returncode, proc.stdout) == (0, f"{manifest}\n"), proc.stderr
    (tmp_path / "notes.txt").write_text("mine")
    proc = subprocess.run([*run, str(tmp_path)], capture_output=True, text=True, check=False)
    assert proc.returncode == 1
    assert "refusing to replace" in proc.stderr


def test_the_splits_have_their_sizes_and_labels(task_set: TaskSet) -> None:
    counts = Counter(t.split for t in task_set)
    assert counts == Counter(dict(reading.SPLITS))
    assert all(t.extra[SPLIT_KEY] == t.split for t in task_set)


def test_no_held_out_fix_is_a_training_fix_in_either_order(task_set: TaskSet) -> None:
    pairs: dict[str, set[frozenset[str]]] = {}
    for task in reading.reading_tasks():
        pairs.setdefault(task.split, set()).add(frozenset((task.found, task.expected)))
    assert pairs["train"].isdisjoint(pairs["validation"])
    assert pairs["train"].isdisjoint(pairs["test"])
    assert pairs["validation"].isdisjoint(pairs["test"])
    # ...while every name is a fix's name in training: the tokens are known, only the reading is new.
    trained_names = {n for pair in pairs["train"] for n in pair}
    held_names = {n for split in ("validation", "test") for pair in pairs[split] for n in pair}
    assert held_names <= trained_names


def _edit(patch: str) -> tuple[str, ...]:
    """A patch's removed and added lines without their file names, hunk headers or context: the edit."""
    changed = [line for line in patch.splitlines() if line.startswith(("+", "-"))]
    return tuple(line for line in changed if not line.startswith(("+++", "---")))


def test_no_module_text_patch_or_fix_is_shared_across_splits(task_set: TaskSet) -> None:
    sources = [t.source(buggy=True) for t in reading.reading_tasks()]
    assert len(set(sources)) == len(sources)
    edits: dict[str, set[tuple[str, ...]]] = {}
    commands: dict[str, set[str]] = {}
    for task in task_set:
        edit = _edit(task.patch)
        assert len(edit) == 2, task.patch  # one line out, one line in
        edits.setdefault(str(task.split), set()).add(edit)
        commands.setdefault(str(task.split), set()).add(task.extra["legorl_fix_command"])
    for a, b in (("train", "validation"), ("train", "test"), ("validation", "test")):
        assert edits[a].isdisjoint(edits[b]), (a, b, edits[a] & edits[b])
        assert commands[a].isdisjoint(commands[b]), (a, b)


def test_generation_is_deterministic(tmp_path: Path, task_set: TaskSet) -> None:
    again = load_task_set(reading.generate(tmp_path / "again"))
    assert [t.to_dict() for t in again] == [t.to_dict() for t in task_set]


@pytest.mark.slow  # runs each task's test suite before and after its fix
@pytest.mark.parametrize("split", ["train", "validation", "test"])
def test_the_diagnosis_is_what_the_tests_print_and_its_fix_solves_the_task(
    task_set: TaskSet, split: str, tmp_path: Path
) -> None:
    for task in [t for t in task_set if t.split == split][:3]:
        repo = tmp_path / task.instance_id
        checkout_source(task_set.source_path(task), task.base_commit, repo)
        printed = subprocess.run(
            reading.TEST_COMMAND.replace("python", sys.executable, 1),
            shell=True,
            cwd=repo,
            capture_output=True,
            text=True,
            check=False,
        ).stdout
        assert printed.strip() == f"E   AssertionError: {task.extra['legorl_diagnosis']}"
        fix = task.extra["legorl_fix_command"]
        assert grade_commands(task_set, task, [f"{fix} && {SUBMIT_COMMAND}"]) == 1.0
        assert grade_commands(task_set, task, [SUBMIT_COMMAND]) == 0.0
        line = reading.by_id()[task.instance_id]
        wrong = f"sed -i '{line.line}s/{line.found}/{line.function.params[0]}/' {line.path}"
        assert grade_commands(task_set, task, [wrong]) == 0.0


def test_names_never_hide_inside_other_words() -> None:
    words = (*reading.NAMES, *reading.FUNCTIONS, *reading.PACKAGES, *reading.MODULES)
    for name in reading.NAMES:
        assert not any(name in w for w in words if w != name), name

"""The stages written once, used by both backends: setup's workspace and verify's pristine tree.

Backends differ in where a stage runs (an init container or verify pod on Kubernetes, a bubblewrap
sandbox locally) and how a command is isolated; what a stage does to files lives here.
"""

from __future__ import annotations

import os
import shlex
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from legorl.sandbox import changes as ch
from legorl.sandbox import workspace
from legorl.sandbox.checks import Check
from legorl.sandbox.grade import Grade, GradeError, grade, parse_junit, parse_pytest_log_all
from legorl.sandbox.outcomes import TamperFinding
from legorl.sandbox.paths import installed_plugin_modules
from legorl.sandbox.task import Task


@dataclass
class SetupResult:
    """The staged workspace's self-tests and its baseline (what capture compares against)."""

    checks: list[Check]
    baseline: dict[str, ch.Entry]


def setup(pristine: Path, into: Path, task: Task, *, git_history: str = "BaseCommitOnly") -> SetupResult:
    """Stage 1: build the agent's workspace from the pristine tree and self-test it."""
    checks = workspace.stage(pristine, into, hidden_tests=task.hidden_test_files, git_history=git_history)
    return SetupResult(checks, ch.baseline(into))


def top_level_names(tree: Path) -> frozenset[str]:
    return frozenset(p.name for p in tree.iterdir() if p.name != ".git")


@dataclass
class VerifyTree:
    """A fresh tree for verification: pristine + the agent's sanitized changes + the hidden tests."""

    path: Path
    applied: ch.ChangeSet
    findings: list[TamperFinding] = field(default_factory=list)


def prepare_verify(pristine: Path, into: Path, task: Task, changes: ch.ChangeSet) -> VerifyTree:
    """Stage 3, files: copy the pristine tree, apply the sanitized changes, restore hidden tests."""
    workspace.copy_tree(pristine, into)
    clean = ch.sanitize(
        changes,
        hidden_tests=task.test_patch_paths,
        existing_tops=top_level_names(pristine),
        runner_modules=installed_plugin_modules(),
        pristine=pristine,
    )
    ch.apply(clean, into)
    # git must not find a repository above the tree (a run folder inside a checkout): it would then
    # take the patch's paths from that repository's top and skip every file outside `into`.
    env = workspace.git_env() | {"GIT_CEILING_DIRECTORIES": str(into.resolve().parent)}
    patch = subprocess.run(
        ["git", "apply", "--whitespace=nowarn", "-"],
        input=task.test_patch,
        cwd=into,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if patch.returncode != 0:
        raise GradeError(f"the task's test patch does not apply to the pristine tree: {patch.stderr.strip()}")
    missing = [rel for rel in task.hidden_test_files if not (into / rel).is_file()]
    if missing:
        raise GradeError(f"the task's test patch left hidden tests missing: {missing}")
    return VerifyTree(into, clean, clean.findings)


def make_read_only(tree: Path) -> None:
    """Drop every write bit in the verify tree: the tests run as another uid, which can then
    neither change nor replace a file (the hidden tests included) before pytest imports it."""
    for dirpath, dirnames, filenames in os.walk(tree):
        for name in filenames:
            path = Path(dirpath) / name
            if not path.is_symlink():
                path.chmod(path.stat().st_mode & 0o555)
        for name in dirnames:
            path = Path(dirpath) / name
            if not path.is_symlink():
                path.chmod(path.stat().st_mode & 0o555)
    tree.chmod(tree.stat().st_mode & 0o555)


def test_argv(task: Task, junit: str) -> list[str]:
    """The task's test command with `{junit}` and `{tests}` filled in (no shell involved)."""
    argv: list[str] = []
    for word in shlex.split(task.test_command):
        if word == "{tests}":
            argv.extend(task.test_files)
        else:
            argv.append(word.replace("{junit}", junit))
    return argv


PASSED = ("PASSED", "XPASS")


def grade_run(task: Task, junit: Path, log: str) -> tuple[Grade, list[TamperFinding]]:
    """Reward from the verifier's JUnit XML, cross-checked against pytest's `-rA` summary.

    Both come from the process that also runs the code under test, so either can be forged from
    inside it (see docs/sandbox.md); forging both consistently is harder, and the summary reached
    the verifier through a pipe as it was printed. A listed test the XML calls passed while the
    summary calls it failed (or, with `-rA` in the command, does not name it) makes the reward 0
    with a `results_tampered` finding. Without JUnit XML the summary alone is used; with neither,
    this raises GradeError (the caller decides whether that is the agent's doing)."""
    summary = parse_pytest_log_all(log)
    try:
        results = parse_junit(junit)
    except GradeError:
        if not summary:
            raise
        return grade({k: v[-1] for k, v in summary.items()}, task.fail_to_pass, task.pass_to_pass), []
    findings: list[TamperFinding] = []
    # With -rA, pytest's summary names every test; a pass in the XML needs the summary's word.
    corroborate = "-rA" in task.test_command.split()
    for test_id in (*task.fail_to_pass, *task.pass_to_pass):
        if results.get(test_id) not in PASSED:
            continue
        seen = summary.get(test_id, [])
        failed = [s for s in seen if s in ("FAILED", "ERROR")]
        if failed or (corroborate and not seen):
            said = ", ".join(seen) or "nothing"
            findings.append(
                TamperFinding(
                    kind="results_tampered",
                    path=test_id,
                    detail=f"JUnit XML says it passed; pytest's summary says {said}",
                )
            )
    result = grade(results, task.fail_to_pass, task.pass_to_pass)
    if findings:
        return Grade(0.0, result.fail_to_pass, result.pass_to_pass), findings
    return result, findings

"""One trial on the local backend: setup → agent → capture → verify, with stage timings and outcome.

The termination reason uses the closed set of DESIGN §5 (`legorl.api.termination`); a proxy-side
reason (turn limit, context overflow, engine error) is reconciled by the run controller.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from legorl.sandbox import changes as ch
from legorl.sandbox import stages, workspace
from legorl.sandbox.checks import Check
from legorl.sandbox.grade import Grade, GradeError
from legorl.sandbox.inner import EXIT_DEFENSE_FAILED
from legorl.sandbox.local import (
    HOME,
    INNER_LIB,
    OUT_DIR,
    PROXY_SOCKET,
    TASK_DIR,
    LocalBackend,
    SandboxError,
    parse_report,
)
from legorl.sandbox.task import Task, TaskSet

# Changed source that reaches into the test runner cannot be a fix; it is dropped and reported.
RUNNER_REFERENCE = re.compile(
    r"\b(_pytest|pluggy|pytest_runtest\w*|pytest_configure|junitxml|LEGORL_\w+)\b|legorl-out|"
    r"sys\.modules\s*\[[^\]]*\]\s*=|setattr\(\s*sys\.modules"
)


@dataclass
class TrialOutcome:
    """What one local trial produced (the sandbox's part of a trial record)."""

    trial: str
    task_id: str
    termination_reason: str
    reward: float | None
    checks: list[Check] = field(default_factory=list)
    findings: list[ch.Finding] = field(default_factory=list)
    stage_seconds: dict[str, float] = field(default_factory=dict)
    diff: str = ""
    grade: Grade | None = None
    agent_exit_code: int | None = None
    agent_output: str = ""
    verify_output: str = ""
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "trial": self.trial,
            "taskId": self.task_id,
            "terminationReason": self.termination_reason,
            "reward": self.reward,
            "checks": [c.to_dict() for c in self.checks],
            "tamperFindings": [f.to_dict() for f in self.findings],
            "stageSeconds": self.stage_seconds,
            "diff": self.diff,
            "grade": self.grade.to_dict() if self.grade else None,
            "agentExitCode": self.agent_exit_code,
            "error": self.error,
        }


def pristine_tree(backend: LocalBackend, task_set: TaskSet, task: Task) -> Path:
    """The task's files at its base commit, made once per task and shared read-only."""
    path = backend.root / "pristine" / f"{task.instance_id}-{task.base_commit[:12]}"
    if path.is_dir():
        return path
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{time.monotonic_ns()}")
    workspace.checkout_source(task_set.source_path(task), task.base_commit, tmp)
    try:
        tmp.rename(path)
    except OSError:  # another trial made it first
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def runner_findings(changes: ch.ChangeSet) -> ch.ChangeSet:
    """Drop changed source files that reference test-runner internals (reported, never applied)."""
    kept = ch.ChangeSet(
        files={},
        executable=set(changes.executable),
        deleted=set(changes.deleted),
        findings=list(changes.findings),
    )
    for rel, text in changes.files.items():
        match = RUNNER_REFERENCE.search(text) if rel.endswith(".py") else None
        if match:
            kept.findings.append(
                ch.Finding(
                    "test_hook_added", rel, f"source refers to the test runner ({match.group(0)!r}); ignored"
                )
            )
        else:
            kept.files[rel] = text
    return kept


def agent_env(task: Task, extra: Mapping[str, str] | None = None, port: int = 4000) -> dict[str, str]:
    """The harness's environment: what a trial pod gives its agent container, nothing of the host."""
    venv_bin = str(Path(sys.executable).parent)
    env = {
        "PATH": f"{venv_bin}:/usr/local/bin:/usr/bin:/bin",
        "HOME": HOME,
        "TMPDIR": "/tmp",  # noqa: S108 - a private tmpfs inside the sandbox
        "LANG": "C.UTF-8",
        "PYTHONPATH": INNER_LIB,
        "PYTHONDONTWRITEBYTECODE": "1",
        "OPENAI_BASE_URL": f"http://127.0.0.1:{port}/v1",
        "ANTHROPIC_BASE_URL": f"http://127.0.0.1:{port}",
        "OPENAI_API_KEY": "legorl-proxy",
        "ANTHROPIC_API_KEY": "legorl-proxy",
        "LEGORL_WORKSPACE": task.workspace_dir,
        "LEGORL_TASK_FILE": f"{TASK_DIR}/problem.md",
    }
    env.update(extra or {})
    return env


def run_local_trial(
    backend: LocalBackend,
    task_set: TaskSet,
    task: Task,
    trial_id: str,
    agent_argv: Sequence[str],
    *,
    proxy_socket: Path | None = None,
    env: Mapping[str, str] | None = None,
    agent_seconds: float = 3600,
    verify_seconds: float = 1800,
    probes: Sequence[str] = (),
    keep: bool = False,
) -> TrialOutcome:
    """Run the four stages of one trial; every failure is classified, nothing is left running."""
    out = TrialOutcome(
        trial=trial_id, task_id=task.instance_id, termination_reason="sandbox_error", reward=None
    )
    trial_dir = backend.root / "trials" / trial_id
    if trial_dir.exists():
        raise SandboxError(f"trial folder {trial_dir} already exists (trial ids must be unique)")
    trial_dir.mkdir(parents=True)
    mounts: list[Path] = []
    defenses = backend.defenses
    try:
        # Stage 1: setup.
        started = time.monotonic()
        pristine = pristine_tree(backend, task_set, task)
        ws = trial_dir / "workspace"
        if backend.make_workspace(ws, backend.limits.workspace_bytes):
            mounts.append(ws)
        staged = stages.setup(pristine, ws, task, git_history=defenses.git_history)
        out.checks.extend(staged.checks)
        task_dir = trial_dir / "task"
        task_dir.mkdir()
        (task_dir / "problem.md").write_text(task.problem_statement, encoding="utf-8")
        out.stage_seconds["setup"] = time.monotonic() - started
        if not all(c.passed for c in staged.checks):
            out.termination_reason = "defense_failed"
            out.error = "; ".join(f"{c.name}: {c.message}" for c in staged.checks if not c.passed)
            return out

        # Stage 2: agent.
        with backend.identity() as uid:
            if backend.is_root:
                workspace.make_agent_owned(ws, uid, uid)
            binds: list[tuple[str, str, bool]] = [
                (str(ws), task.workspace_dir, True),
                (str(task_dir), TASK_DIR, False),
            ]
            inner_args: list[str] = []
            if proxy_socket is not None:
                binds.append((str(proxy_socket), PROXY_SOCKET, True))
                inner_args += ["--proxy-socket", PROXY_SOCKET]
            if defenses.egress == "Unrestricted":
                inner_args.append("--no-egress-check")
            for item in probes:
                inner_args += ["--probe", item]
            run = backend.run(
                [*inner_args, "--", *agent_argv],
                uid=uid,
                binds=binds,
                cwd=task.workspace_dir,
                env=agent_env(task, env),
                timeout=agent_seconds,
                network=defenses.egress == "Unrestricted",
                report=True,
                name=f"agent-{trial_id}",
            )
        out.stage_seconds["agent_start"] = run.report_seconds
        out.stage_seconds["agent"] = run.seconds
        out.agent_exit_code = run.returncode
        out.agent_output = run.output[-20000:]
        report_checks = parse_report(run.report) if defenses.egress == "ProxyOnly" else []
        out.checks.extend(report_checks)
        if (
            report_checks and not all(c.passed for c in report_checks)
        ) or run.returncode == EXIT_DEFENSE_FAILED:
            out.termination_reason = "defense_failed"
            out.error = (
                "; ".join(f"{c.name}: {c.message}" for c in report_checks if not c.passed)
                or run.output[-500:]
            )
            return out
        if run.timed_out:
            out.termination_reason = "agent_timeout"
        elif run.returncode == 0:
            out.termination_reason = "completed"
        else:
            out.termination_reason = "agent_error"

        # The agent is gone (every process of its uid was killed); read what it left.
        captured = runner_findings(ch.capture(ws, staged.baseline))

        # Stage 3: verify, in a fresh sandbox from the pristine tree.
        started = time.monotonic()
        verify_dir = trial_dir / "verify"
        if backend.make_workspace(verify_dir, backend.limits.workspace_bytes):
            mounts.append(verify_dir)
        repo = verify_dir / "repo"
        results = verify_dir / "out"
        results.mkdir()
        try:
            tree = stages.prepare_verify(pristine, repo, task, captured)
        except (GradeError, ValueError) as exc:
            out.termination_reason, out.error = "verifier_error", str(exc)
            return out
        out.findings = tree.findings
        out.diff = ch.unified_diff(tree.applied, pristine)
        if defenses.tamper_policy == "FailTrial" and out.findings:
            out.reward = 0.0
            out.stage_seconds["verify"] = time.monotonic() - started
            return out
        with backend.identity() as vuid:
            if backend.is_root:
                workspace.make_agent_owned(verify_dir, vuid, vuid)
            vrun = backend.run(
                stages.test_argv(task, f"{OUT_DIR}/junit.xml"),
                uid=vuid,
                binds=[(str(repo), task.workspace_dir, True), (str(results), OUT_DIR, True)],
                cwd=task.workspace_dir,
                env={k: v for k, v in agent_env(task).items() if not k.startswith(("OPENAI", "ANTHROPIC"))}
                | {"PYTHONNOUSERSITE": "1"},
                timeout=verify_seconds,
                name=f"verify-{trial_id}",
            )
        out.verify_output = vrun.output[-20000:]
        out.stage_seconds["verify"] = time.monotonic() - started
        if vrun.timed_out:
            out.reward, out.error = 0.0, f"tests ran past the {verify_seconds:.0f} s verify deadline"
            return out
        try:
            out.grade = stages.grade_run(task, results / "junit.xml", vrun.output)
        except GradeError as exc:
            out.termination_reason, out.error = "verifier_error", str(exc)
            return out
        out.reward = out.grade.reward
        return out
    except SandboxError as exc:
        out.termination_reason, out.error = "sandbox_error", str(exc)
        return out
    except workspace.SetupError as exc:
        out.termination_reason, out.error = "sandbox_error", f"setup: {exc}"
        return out
    finally:
        for mount in mounts:
            backend.unmount(mount)
        if not keep:
            with contextlib.suppress(OSError):
                shutil.rmtree(trial_dir)
        (backend.root / "outcomes").mkdir(exist_ok=True)
        (backend.root / "outcomes" / f"{trial_id}.json").write_text(json.dumps(out.to_dict(), indent=1))

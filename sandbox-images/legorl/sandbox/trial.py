"""One trial on the local backend: setup → agent → capture → verify, with stage timings and outcome.

The termination reason uses the closed set of DESIGN §5 (`legorl.sandbox.outcomes`); a proxy-side
reason (turn limit, context overflow, engine error) is reconciled by the run controller.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from legorl.sandbox import changes as ch
from legorl.sandbox import stages, workspace
from legorl.sandbox.checks import Check
from legorl.sandbox.grade import Grade, GradeError
from legorl.sandbox.local import (
    HOME,
    INNER_LIB,
    OUT_DIR,
    PROXY_SOCKET,
    TASK_DIR,
    LocalBackend,
    Run,
    SandboxError,
    parse_report,
)
from legorl.sandbox.outcomes import TamperFinding, TerminationReason
from legorl.sandbox.task import Task, TaskSet

TRIAL_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


@dataclass
class TrialOutcome:
    """What one local trial produced (the sandbox's part of a trial record)."""

    trial: str
    task_id: str
    termination_reason: TerminationReason
    reward: float | None
    checks: list[Check] = field(default_factory=list)
    findings: list[TamperFinding] = field(default_factory=list)
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


def agent_env(
    backend: LocalBackend, task: Task, extra: Mapping[str, str] | None = None, port: int = 4000
) -> dict[str, str]:
    """The harness's environment: what a trial pod gives its agent container, nothing of the host.

    The task's Python comes first on PATH (what a task image provides); legorl's own environment
    after it, for harnesses installed there (mini-swe-agent)."""
    venv_bin = str(Path(sys.executable).parent)
    env = {
        "PATH": f"{backend.task_env}/bin:{venv_bin}:/usr/local/bin:/usr/bin:/bin",
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


@dataclass
class _Trial:
    """One trial's folders and the mounts to undo."""

    backend: LocalBackend
    task_set: TaskSet
    task: Task
    out: TrialOutcome
    dir: Path
    mounts: list[Path] = field(default_factory=list)

    def folder(self, name: str) -> Path:
        """A stage folder; a size-limited tmpfs when the backend can mount one."""
        path = self.dir / name
        if self.backend.make_workspace(path, self.backend.limits.workspace_bytes):
            self.mounts.append(path)
        return path

    def fail(self, reason: TerminationReason, error: str) -> TrialOutcome:
        self.out.termination_reason, self.out.error = reason, error
        return self.out

    def setup(self) -> stages.SetupResult | None:
        """Stage 1; None when a self-test failed (the trial is then `defense_failed`)."""
        started = time.monotonic()
        pristine = pristine_tree(self.backend, self.task_set, self.task)
        staged = stages.setup(
            pristine, self.folder("workspace"), self.task, git_history=self.backend.defenses.git_history
        )
        self.out.checks.extend(staged.checks)
        task_dir = self.dir / "task"
        task_dir.mkdir()
        (task_dir / "problem.md").write_text(self.task.problem_statement, encoding="utf-8")
        self.out.stage_seconds["setup"] = time.monotonic() - started
        failed = [c for c in staged.checks if not c.passed]
        if failed:
            self.fail(TerminationReason.DEFENSE_FAILED, "; ".join(f"{c.name}: {c.message}" for c in failed))
            return None
        return staged

    def agent(
        self,
        argv: Sequence[str],
        *,
        proxy_socket: Path | None,
        env: Mapping[str, str] | None,
        seconds: float,
        probes: Sequence[str],
        extra_binds: Sequence[tuple[str, str]] = (),
        stop: threading.Event | None = None,
    ) -> bool:
        """Stage 2; False when the sandbox's own self-test failed. `extra_binds` (host, inside) are
        mounted read-only (a harness runtime, its configuration)."""
        backend, task, out = self.backend, self.task, self.out
        ws = self.dir / "workspace"
        egress_locked = backend.defenses.egress == "ProxyOnly"
        with backend.identity() as uid:
            if backend.is_root:
                workspace.make_agent_owned(ws, uid, uid)
            binds = [(str(ws), task.workspace_dir, True), (str(self.dir / "task"), TASK_DIR, False)]
            binds += [(host, inside, False) for host, inside in extra_binds]
            inner: list[str] = []
            if proxy_socket is not None:
                binds.append((str(proxy_socket), PROXY_SOCKET, True))
                inner += ["--proxy-socket", PROXY_SOCKET]
            if not egress_locked:
                inner.append("--no-egress-check")
            for item in probes:
                inner += ["--probe", item]
            run = backend.run(
                [*inner, "--", *argv],
                uid=uid,
                binds=binds,
                cwd=task.workspace_dir,
                env=agent_env(backend, task, env),
                timeout=seconds,
                network=not egress_locked,
                report=True,
                name=f"agent-{out.trial}",
                stop=stop,
            )
        out.stage_seconds["agent_start"] = run.report_seconds
        out.stage_seconds["agent"] = run.seconds
        out.agent_exit_code = run.returncode
        out.agent_output = run.output[-20000:]
        if run.cancelled:
            self.fail(TerminationReason.CANCELLED, "the trial was cancelled while its agent ran")
            return False
        checks = parse_report(run.report) if egress_locked else []
        out.checks.extend(checks)
        failed = [c for c in checks if not c.passed]
        if failed:  # an empty or missing report is itself a failed check
            self.fail(
                TerminationReason.DEFENSE_FAILED,
                "; ".join(f"{c.name}: {c.message}" for c in failed) or run.output[-500:],
            )
            return False
        if run.timed_out:
            out.termination_reason = TerminationReason.AGENT_TIMEOUT
        else:
            out.termination_reason = (
                TerminationReason.COMPLETED if run.returncode == 0 else TerminationReason.AGENT_ERROR
            )
        return True

    def verify(self, staged: stages.SetupResult, seconds: float) -> TrialOutcome:
        """Stage 3 in a fresh sandbox from the pristine tree (the agent's processes are all dead).

        The tree is bound read-only: the code under test cannot rewrite the hidden tests (or
        anything else) before pytest imports them. Only the results folder is writable."""
        backend, task, out = self.backend, self.task, self.out
        try:
            captured = ch.capture(self.dir / "workspace", staged.baseline)
        except OSError as exc:  # the agent's tree defeated the walk: its work cannot be read
            out.findings = [
                TamperFinding(
                    kind="outside_repo", path=None, detail=f"the workspace could not be read: {exc}"
                )
            ]
            out.reward = 0.0
            return out
        started = time.monotonic()
        pristine = pristine_tree(backend, self.task_set, task)
        verify_dir = self.folder("verify")
        try:
            tree = stages.prepare_verify(pristine, verify_dir / "repo", task, captured)
        except (GradeError, ValueError) as exc:
            return self.fail(TerminationReason.VERIFIER_ERROR, str(exc))
        out.findings = tree.findings
        out.diff = ch.unified_diff(tree.applied, pristine)
        if backend.defenses.tamper_policy == "FailTrial" and out.findings:
            out.reward = 0.0
            out.stage_seconds["verify"] = time.monotonic() - started
            return out
        run = self._run_tests(verify_dir, seconds)
        out.verify_output = run.output[-20000:]
        out.stage_seconds["verify"] = time.monotonic() - started
        if run.timed_out:
            out.reward, out.error = 0.0, f"tests ran past the {seconds:.0f} s verify deadline"
            return out
        try:
            out.grade, tampered = stages.grade_run(task, verify_dir / "out" / "junit.xml", run.output)
        except GradeError as exc:
            tail = run.output[-1500:].strip() or "(no output)"
            if self._verifier_works(seconds):
                # The same tests give results without the agent's changes: their absence is the
                # agent's doing (a crash at import, os._exit), a 0, not an infrastructure failure.
                out.findings.append(
                    TamperFinding(kind="results_tampered", path=None, detail=f"no test results: {exc}")
                )
                out.reward, out.error = 0.0, f"the tests produced no results with the agent's changes: {tail}"
                return out
            return self.fail(
                TerminationReason.VERIFIER_ERROR, f"{exc}; the test command exited {run.returncode}: {tail}"
            )
        out.findings.extend(tampered)
        out.reward = out.grade.reward
        return out

    def _run_tests(self, verify_dir: Path, seconds: float) -> Run:
        """The task's test command on `verify_dir/repo` (read-only), results to `verify_dir/out`."""
        backend, task = self.backend, self.task
        results = verify_dir / "out"
        results.mkdir(exist_ok=True)
        with backend.identity() as uid:
            if backend.is_root:
                workspace.make_agent_owned(results, uid, uid)
            env = {
                k: v for k, v in agent_env(backend, task).items() if not k.startswith(("OPENAI", "ANTHROPIC"))
            }
            return backend.run(
                stages.test_argv(task, f"{OUT_DIR}/junit.xml"),
                uid=uid,
                binds=[(str(verify_dir / "repo"), task.workspace_dir, False), (str(results), OUT_DIR, True)],
                cwd=task.workspace_dir,
                env=env | {"PYTHONNOUSERSITE": "1"},
                timeout=seconds,
                name=f"verify-{self.out.trial}",
            )

    def _verifier_works(self, seconds: float) -> bool:
        """Whether the task's tests give results on the pristine tree with the hidden tests and no
        agent changes (asked once per task and backend, only when a trial got no results)."""
        record = self.backend.root / "verifier-health" / f"{self.task.instance_id}.json"
        if record.exists():
            return bool(json.loads(record.read_text())["works"])
        check_dir = self.folder("verify-health")
        pristine = pristine_tree(self.backend, self.task_set, self.task)
        try:
            stages.prepare_verify(pristine, check_dir / "repo", self.task, ch.ChangeSet())
            run = self._run_tests(check_dir, seconds)
            stages.grade_run(self.task, check_dir / "out" / "junit.xml", run.output)
            works = True
        except (GradeError, ValueError):
            works = False
        record.parent.mkdir(exist_ok=True)
        record.write_text(json.dumps({"works": works}))
        return works

    def close(self, keep: bool) -> None:
        for mount in self.mounts:
            self.backend.unmount(mount)
        if not keep:
            shutil.rmtree(self.dir, ignore_errors=True)
        outcomes = self.backend.root / "outcomes"
        outcomes.mkdir(exist_ok=True)
        (outcomes / f"{self.out.trial}.json").write_text(json.dumps(self.out.to_dict(), indent=1))


def discard_trial_folder(backend: LocalBackend, trial_id: str) -> bool:
    """Remove what a killed earlier attempt of `trial_id` left (its tmpfs mounts and folder) so the trial
    can run again; True when there was something. Only for trials no process runs any more."""
    if not TRIAL_ID.match(trial_id):
        raise ValueError(f"trial id {trial_id!r} names no trial folder")
    trial_dir = backend.root / "trials" / trial_id
    if not trial_dir.exists():
        return False
    prefix = str(trial_dir.resolve()) + "/"
    with open("/proc/self/mounts", encoding="utf-8") as mounts:  # noqa: PTH123 - a procfs file
        points = [line.split()[1] for line in mounts if len(line.split()) > 1]
    for point in sorted((p for p in points if p.startswith(prefix)), key=len, reverse=True):
        backend.unmount(Path(point))
    shutil.rmtree(trial_dir, ignore_errors=True)
    return True


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
    extra_binds: Sequence[tuple[str, str]] = (),
    after_agent: Callable[[TrialOutcome], None] | None = None,
    stop: threading.Event | None = None,
) -> TrialOutcome:
    """Run the stages of one trial; every failure is classified, nothing is left running.

    `probes` (HOST:PORT) are extra addresses the sandbox's egress self-test must find unreachable
    (the engine's address, say). `extra_binds` (host path, sandbox path) are mounted read-only in the
    agent's sandbox. `after_agent` is called once the agent stage ended and before verify (the run
    controller tells the proxy how the harness exited). Setting `stop` kills the agent's sandbox: the
    trial ends `cancelled`, unverified. The outcome is also written to
    `<root>/outcomes/<trial>.json`."""
    if not TRIAL_ID.match(trial_id):
        raise ValueError(
            f"trial id {trial_id!r}: use 1-128 letters, digits, '.', '_' or '-' (it names folders)"
        )
    out = TrialOutcome(
        trial=trial_id,
        task_id=task.instance_id,
        termination_reason=TerminationReason.SANDBOX_ERROR,
        reward=None,
    )
    trial_dir = backend.root / "trials" / trial_id
    if trial_dir.exists():
        raise SandboxError(f"trial folder {trial_dir} already exists (trial ids must be unique)")
    trial_dir.mkdir(parents=True)
    trial = _Trial(backend, task_set, task, out, trial_dir)
    try:
        staged = trial.setup()
        if staged is None:
            return out
        if not trial.agent(
            agent_argv,
            proxy_socket=proxy_socket,
            env=env,
            seconds=agent_seconds,
            probes=probes,
            extra_binds=extra_binds,
            stop=stop,
        ):
            return out
        if after_agent is not None:
            after_agent(out)
        return trial.verify(staged, verify_seconds)
    except SandboxError as exc:
        return trial.fail(TerminationReason.SANDBOX_ERROR, str(exc))
    except workspace.SetupError as exc:
        return trial.fail(TerminationReason.SANDBOX_ERROR, f"setup: {exc}")
    finally:
        trial.close(keep)

"""The local backend for real: bubblewrap namespaces, per-trial uids, limits, cleanup, the proxy relay.

Needs root and bwrap (CI has both; scripts/get-sandbox-tools.sh installs bwrap). The trials use a
tiny hand-made task so each module runs in seconds; the bundled task set has its own tests.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from legorl.proxy.testing import FakeEngine
from legorl.sandbox import seccomp, workspace
from legorl.sandbox.local import Defenses, Limits, LocalBackend, processes_of
from legorl.sandbox.task import Task, TaskSet
from legorl.sandbox.trial import TrialOutcome, run_local_trial
from tests.support.asgi_server import serve

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        shutil.which("bwrap") is None, reason="bubblewrap missing (scripts/get-sandbox-tools.sh)"
    ),
    pytest.mark.skipif(os.geteuid() != 0, reason="per-trial uids, cgroups and tmpfs limits need root"),
]

GIT_ENV = workspace.git_env()
FIX = "sed -i 's/a - b/a + b/' calc/__init__.py"


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=repo, env=GIT_ENV, check=True, capture_output=True, text=True
    ).stdout.strip()


@pytest.fixture(scope="module")
def task_set(tmp_path_factory: pytest.TempPathFactory) -> TaskSet:
    root = tmp_path_factory.mktemp("task")
    repo = root / "repo"
    (repo / "calc").mkdir(parents=True)
    (repo / "tests").mkdir()
    _git(repo, "init", "-q", "-b", "main")
    (repo / "calc" / "__init__.py").write_text("def add(a, b):\n    return a - b\n")
    (repo / "tests" / "test_calc.py").write_text(
        "from calc import add\n\n\ndef test_zero():\n    assert add(0, 0) == 0\n"
    )
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "base")
    base = _git(repo, "rev-parse", "HEAD")
    (repo / "tests" / "test_hidden.py").write_text(
        "from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"
    )
    _git(repo, "add", "-A")
    test_patch = _git(repo, "diff", "--cached") + "\n"
    _git(repo, "commit", "-qm", "hidden tests")
    row = {
        "instance_id": "calc-1",
        "repo": "legorl-tests/calc",
        "base_commit": base,
        "problem_statement": "add(2, 3) returns -1; it should return 5.",
        "test_patch": test_patch,
        "FAIL_TO_PASS": ["tests/test_hidden.py::test_add"],
        "PASS_TO_PASS": ["tests/test_calc.py::test_zero"],
        "source": str(repo),
    }
    return TaskSet((Task.from_dict(row),), root)


@pytest.fixture
def backend(tmp_path: Path) -> Iterator[LocalBackend]:
    limits = Limits(memory_bytes=512 << 20, pids=64, workspace_bytes=32 << 20, tmp_bytes=16 << 20)
    backend = LocalBackend(tmp_path / "root", limits=limits)
    yield backend
    # Nothing may outlive a test: no process of a trial uid, no mount under the root.
    assert not [p for uid in range(backend.uid_base, backend.uid_base + 8) for p in processes_of(uid)]
    assert str(tmp_path / "root") not in Path("/proc/mounts").read_text()


_counter = iter(range(10_000))


def trial(backend: LocalBackend, task_set: TaskSet, script: str, **kwargs: object) -> TrialOutcome:
    return run_local_trial(
        backend,
        task_set,
        task_set.tasks[0],
        f"t{next(_counter)}",
        ["/bin/sh", "-c", script],
        **{"agent_seconds": 30.0, "verify_seconds": 120.0, **kwargs},  # type: ignore[arg-type]
    )


def test_a_fix_earns_reward_and_a_non_fix_does_not(backend: LocalBackend, task_set: TaskSet) -> None:
    fixed = trial(backend, task_set, FIX)
    assert (fixed.termination_reason, fixed.reward) == ("completed", 1.0), fixed.error
    assert "+    return a + b" in fixed.diff
    assert {c.name for c in fixed.checks} >= {
        "history.single_commit",
        "tests.hidden_absent",
        "egress.loopback_only",
    }
    assert set(fixed.stage_seconds) == {"setup", "agent_start", "agent", "verify"}
    idle = trial(backend, task_set, "true")
    assert (idle.termination_reason, idle.reward) == ("completed", 0.0)
    assert idle.grade is not None and idle.grade.fail_to_pass == {"tests/test_hidden.py::test_add": "FAILED"}
    crashed = trial(backend, task_set, f"{FIX}; exit 3")
    assert (crashed.termination_reason, crashed.agent_exit_code, crashed.reward) == ("agent_error", 3, 1.0)
    saved = json.loads((backend.root / "outcomes" / f"{crashed.trial}.json").read_text())
    assert saved["terminationReason"] == "agent_error"


def test_the_seccomp_program_is_well_formed() -> None:
    for machine in seccomp.ARCHES:
        program = seccomp.program(machine)
        assert len(program) % 8 == 0 and len(program) // 8 < 256  # sock_filter entries, short jumps
    with pytest.raises(seccomp.UnsupportedArchitecture, match="no seccomp table for sparc"):
        seccomp.program("sparc")


def test_trial_ids_cannot_name_folders_outside_the_root(backend: LocalBackend, task_set: TaskSet) -> None:
    for bad in ("../escape", "a/b", "", ".hidden", "x" * 200):
        with pytest.raises(ValueError, match="trial id"):
            run_local_trial(backend, task_set, task_set.tasks[0], bad, ["true"])
    assert not (backend.root.parent / "escape").exists()


def test_the_agent_is_an_unprivileged_uid_of_its_own(backend: LocalBackend, task_set: TaskSet) -> None:
    script = (
        "id -u; grep -E '^(CapEff|CapBnd|NoNewPrivs)' /proc/self/status; "
        "touch /usr/x 2>&1; touch /etc/x 2>&1; ls /proc | grep -c '^[0-9]'; hostname; "
        "touch ok && echo workspace-writable; "
        "python -c 'import sys, pytest; print(\"task-python\", sys.prefix); import hypothesis' 2>&1 "
        "| tail -2; "
        "unshare -Ur true 2>&1; unshare -n true 2>&1; python -c 'import legorl.sandbox.trial' 2>&1 | tail -1"
    )
    out = trial(backend, task_set, script)
    lines = out.agent_output
    uid = int(lines.split()[0])
    assert uid > backend.uid_base
    assert "CapEff:\t0000000000000000" in lines
    assert "CapBnd:\t0000000000000000" in lines
    assert "NoNewPrivs:\t1" in lines
    assert "'/usr/x': Read-only file system" in lines
    assert "'/etc/x': Read-only file system" in lines
    assert "sandbox" in lines
    assert "workspace-writable" in lines
    # The task's Python stands in for the task image's: pytest, and nothing else of the host.
    assert f"task-python {backend.task_env}" in lines
    assert "No module named 'hypothesis'" in lines
    # seccomp: no new namespaces, not even a user namespace (where most container escapes start).
    assert lines.count("unshare failed: Operation not permitted") == 2
    # Of legorl, only the modules the sandbox's first process runs.
    assert "No module named 'legorl.sandbox.trial'" in lines


def test_limits_hold(backend: LocalBackend, task_set: TaskSet) -> None:
    """Memory, processes, file size and /tmp are bounded; the trial itself still completes."""
    script = (
        f"{FIX}; "
        "python -c 'x = bytearray(900 << 20)' 2>/dev/null; echo memory-exit=$?; "
        'python -c "import os, time\nn=0\ntry:\n  for _ in range(500):\n'
        "    if os.fork() == 0:\n      time.sleep(2); os._exit(0)\n"
        "    n += 1\nexcept OSError as e: print('fork-refused', e.errno, n)\n"
        'while True:\n  try: os.wait()\n  except ChildProcessError: break"; '
        "dd if=/dev/zero of=big bs=1M count=64 2>&1 | grep -v records; "
        "dd if=/dev/zero of=/tmp/big bs=1M count=64 2>&1 | grep -v records; rm -f big /tmp/big"
    )
    out = trial(backend, task_set, script)
    assert out.termination_reason == "completed"
    assert "memory-exit=137" in out.agent_output or "memory-exit=1" in out.agent_output
    assert "fork-refused 11" in out.agent_output  # EAGAIN: the pids / nproc limit
    assert out.agent_output.count("No space left on device") + out.agent_output.count("File too large") >= 2
    assert out.reward == 1.0


def test_a_hanging_harness_is_killed_with_everything_it_started(
    backend: LocalBackend, task_set: TaskSet
) -> None:
    script = (
        f"{FIX}; "
        "(trap '' TERM HUP; setsid sh -c 'trap \"\" TERM HUP; sleep 1000' &) ; "
        "trap '' TERM; sleep 1000"
    )
    started = time.monotonic()
    out = trial(backend, task_set, script, agent_seconds=2.0)
    assert out.termination_reason == "agent_timeout"
    assert time.monotonic() - started < 30
    assert out.reward == 1.0  # what the agent did before the deadline is still verified


def test_a_cancelled_trial_is_killed_at_once_and_not_verified(
    backend: LocalBackend, task_set: TaskSet
) -> None:
    stop = threading.Event()
    timer = threading.Timer(1.0, stop.set)
    timer.start()
    started = time.monotonic()
    out = trial(backend, task_set, f"{FIX}; sleep 1000", agent_seconds=600.0, stop=stop)
    timer.join()
    assert out.termination_reason == "cancelled"
    assert out.reward is None and out.grade is None
    assert time.monotonic() - started < 20


def test_trials_run_side_by_side_as_different_uids(backend: LocalBackend, task_set: TaskSet) -> None:
    with ThreadPoolExecutor(3) as pool:
        outs = list(pool.map(lambda _: trial(backend, task_set, f"id -u; {FIX}; sleep 1"), range(3)))
    uids = {int(o.agent_output.split()[0]) for o in outs}
    assert len(uids) == 3
    assert all(o.reward == 1.0 for o in outs)


def test_egress_self_test_fails_closed(
    backend: LocalBackend, task_set: TaskSet, monkeypatch: pytest.MonkeyPatch
) -> None:
    """If the network namespace were not applied, the sandbox notices before the agent starts."""
    original = LocalBackend._bwrap

    def leaky(self: LocalBackend, *args: object, **kwargs: object) -> list[str]:
        argv = original(self, *args, **kwargs)  # type: ignore[arg-type]
        return [a for a in argv if a != "--unshare-net"]

    monkeypatch.setattr(LocalBackend, "_bwrap", leaky)
    out = trial(backend, task_set, f"{FIX}; touch agent-ran")
    assert out.termination_reason == "defense_failed"
    assert out.reward is None
    assert "egress.loopback_only" in (out.error or "")
    assert out.agent_exit_code == 97


def test_defenses_off_runs_the_same_trial_unsandboxed(tmp_path: Path, task_set: TaskSet) -> None:
    """The baseline the lifecycle benchmark compares against (and proof the checks can tell)."""
    backend = LocalBackend(tmp_path / "root", defenses=Defenses.off())
    out = trial(backend, task_set, f"{FIX}; git log --all --oneline | wc -l")
    assert (out.termination_reason, out.reward) == ("completed", 1.0)
    assert out.agent_output.split()[-1] == "2"  # the full history was there
    assert [c.name for c in out.checks] == ["history.preserved", "tests.hidden_absent"]


def test_the_proxy_is_the_one_way_out(backend: LocalBackend, task_set: TaskSet, tmp_path: Path) -> None:
    """A real proxy on the host's Unix socket: the sandboxed agent reaches it (and through it the
    engine) at 127.0.0.1:4000, the turn is journaled outside, the engine itself is unreachable."""
    engine = FakeEngine(reply="hello from the engine")
    sock = tmp_path / "proxy" / "proxy.sock"
    sock.parent.mkdir()
    journal = tmp_path / "journal"
    with serve(engine) as engine_url:
        log = (tmp_path / "proxy.log").open("w")
        proxy = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "legorl.cli",
                "proxy",
                f"--unix-socket={sock}",
                f"--upstream={engine_url}",
                "--trial=t-relay",
                "--run=r",
                f"--journal={journal}",
                "--served-model-name=policy",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        try:
            deadline = time.monotonic() + 30
            while not sock.exists():
                assert proxy.poll() is None, (tmp_path / "proxy.log").read_text()
                assert time.monotonic() < deadline
                time.sleep(0.05)
            port = engine_url.rsplit(":", 1)[1]
            script = (
                "python - <<'EOF'\n"
                "import json, urllib.request, socket\n"
                "msgs = [{'role': 'user', 'content': 'hi'}]\n"
                "body = json.dumps({'model': 'policy', 'messages': msgs}).encode()\n"
                "req = urllib.request.Request('http://127.0.0.1:4000/v1/chat/completions', body,\n"
                "    {'content-type': 'application/json'})\n"
                "answer = json.load(urllib.request.urlopen(req))\n"
                "print('ANSWER', answer['choices'][0]['message']['content'])\n"
                f"try:\n    socket.create_connection(('127.0.0.1', {port}), 2)\n    print('ENGINE-REACHED')\n"
                "except OSError as e:\n    print('ENGINE-REFUSED', e.errno)\n"
                "EOF\n"
            )
            out = trial(backend, task_set, script, proxy_socket=sock, probes=[f"127.0.0.1:{port}"])
        finally:
            proxy.send_signal(signal.SIGTERM)
            proxy.wait(timeout=30)
    assert out.termination_reason == "completed", (out.error, out.agent_output)
    assert "ANSWER hello from the engine" in out.agent_output
    assert "ENGINE-REFUSED 111" in out.agent_output
    assert "ENGINE-REACHED" not in out.agent_output
    checks = {c.name: c for c in out.checks}
    assert checks["egress.proxy_reachable"].passed
    assert checks[f"egress.refused 127.0.0.1:{port}"].passed
    assert engine.calls == 1
    assert any(journal.iterdir())


def test_a_python_without_pytest_is_a_clear_error_and_a_stale_task_env_is_remade(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`legorl run` on a machine whose legorl has no pytest: the verifier could not run any task's
    tests, so the sandbox backend refuses to start and says what to install (a fresh-clone quick start
    once ended every trial as verifier_error instead)."""
    from legorl.sandbox import taskenv  # noqa: PLC0415
    from legorl.sandbox.local import LocalBackend, SandboxError  # noqa: PLC0415

    real = importlib.util.find_spec
    # A task env made by such an interpreter: stamped, but without pytest among its links.
    stale = tmp_path / "sandbox" / "task-env"
    (stale / "links").mkdir(parents=True)
    (stale / taskenv.STAMP).write_text("")
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "pytest" else real(name, *a)
    )
    with pytest.raises(SandboxError, match=r"pytest is not installed.*legorl\[local\]"):
        LocalBackend(tmp_path / "sandbox")
    monkeypatch.setattr(importlib.util, "find_spec", real)
    made = taskenv.ensure_task_env(stale)
    assert (made / "links" / "pytest").exists(), "the stale environment was made again"
    python = made / "bin" / "python"
    assert subprocess.run([str(python), "-c", "import pytest"], check=False).returncode == 0

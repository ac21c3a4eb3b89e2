"""The local trial backend: each trial is a proxy process and the four sandbox stages on this machine.

For every trial `LocalTrialBackend`

1. starts `legorl proxy` on a Unix socket (the trial's only way out), pointed at the local vLLM, with the
   run's sampling settings and turn budget;
2. runs the trial's stages with `legorl.sandbox.trial.run_local_trial` (bubblewrap sandboxes, one uid per
   trial): setup, the unmodified harness (`legorl-harness KIND`, the script trial pods run) reaching the
   proxy at 127.0.0.1:4000, then verify in a fresh sandbox from the pristine tree;
3. tells the proxy how the harness exited (`POST /finish`), fetches `GET /trajectory`, and builds the
   `TrialRecord` (`legorl.controller.records`), the proxy's journal kept under the backend's folder.

Trials run on a thread pool (the controller bounds how many at once). Cancelling a trial stops its proxy:
the harness's next model call fails and it exits; the record says `cancelled`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path

import httpx

import legorl.sandbox
from legorl.api.kinds import RLRun
from legorl.api.summary import TrajectorySummary
from legorl.api.termination import TerminationReason
from legorl.api.trajectory import TrialRecord
from legorl.controller.backend import BackendError, TrialRequest
from legorl.controller.harness import CONFIG_DIR
from legorl.controller.records import build_record, reconcile
from legorl.embedded.engine import die_with_parent
from legorl.sandbox.local import LocalBackend
from legorl.sandbox.task import Task, TaskSet
from legorl.sandbox.trial import TrialOutcome, discard_trial_folder, run_local_trial
from legorl.trialproxy.client import ProxyCallError, ProxyClient
from legorl.trialproxy.command import ProxyTrial, proxy_command

log = logging.getLogger(__name__)

R = TerminationReason
_NO_TRAJECTORY = frozenset({R.SANDBOX_ERROR, R.DEFENSE_FAILED, R.CANCELLED})
"""The sandbox's verdicts after which the proxy is not asked for a trajectory (the trial never ran
properly, or it was stopped)."""

RUNTIME_INSIDE = "/opt/legorl-harness"
LOCAL_HARNESSES = ("MiniSweAgent",)
"""Harness kinds whose runtime this machine provides (mini-swe-agent from PyPI, in legorl's environment)."""


def harness_script() -> Path:
    """`legorl-harness`: inside the installed package (wheel), or in the source tree."""
    package = Path(legorl.sandbox.__file__).resolve().parent
    for candidate in (package / "legorl-harness", package.parents[1] / "harness" / "legorl-harness"):
        if candidate.is_file():
            return candidate
    raise BackendError(
        "legorl-harness is missing from this installation (sandbox-images/harness/legorl-harness)"
    )


def make_harness_runtime(folder: Path) -> Path:
    """The layout `legorl-harness` expects (bin/, python/bin/python3, config/), for this machine: the
    Python is legorl's own environment (mini-swe-agent is installed there), the configuration is the
    compact mini-swe-agent settings shipped with legorl."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "bin").mkdir(exist_ok=True)
    script = folder / "bin" / "legorl-harness"
    shutil.copyfile(harness_script(), script)
    script.chmod(0o755)
    python = folder / "python" / "bin" / "python3"
    python.parent.mkdir(parents=True, exist_ok=True)
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    config = folder / "config"
    config.mkdir(exist_ok=True)
    for item in CONFIG_DIR.glob("*.yaml"):
        shutil.copyfile(item, config / item.name)
    for path in (folder, *folder.rglob("*")):
        mode = path.stat().st_mode
        path.chmod(mode | stat.S_IRGRP | stat.S_IROTH | (stat.S_IXGRP | stat.S_IXOTH if path.is_dir() else 0))
    return folder


class LocalTrialBackend:
    """`TrialBackend` on this machine (see the module docstring)."""

    def __init__(
        self,
        run: RLRun,
        *,
        sandbox: LocalBackend,
        task_set: TaskSet,
        engine_url: str,
        workers: int,
        folder: Path,
        proxy_start_seconds: float = 60.0,
        proxy_timeout_seconds: float = 30.0,
    ) -> None:
        spec = run.spec
        if spec.harness.kind not in LOCAL_HARNESSES:
            raise BackendError(
                f"harness {spec.harness.kind} has no local runtime here; `legorl run` runs "
                f"{', '.join(LOCAL_HARNESSES)} (use the Kubernetes backend for the others)"
            )
        self.run = run
        self.name = run.metadata.name
        self.sandbox = sandbox
        self.task_set = task_set
        self.engine_url = engine_url.rstrip("/")
        self.folder = folder
        self.proxy_start_seconds = proxy_start_seconds
        self.proxy_timeout_seconds = proxy_timeout_seconds
        """Limit of one call to a trial's proxy (`ProxyClient` tries a call that fails up to 3 times)."""
        self.runtime = make_harness_runtime(folder / "harness-runtime")
        # Unix socket paths are limited to 107 bytes: keep them short.
        self.sockets = Path(tempfile.mkdtemp(prefix="legorl-sock-"))
        self.sockets.chmod(0o755)
        (folder / "journals").mkdir(parents=True, exist_ok=True)
        (folder / "logs").mkdir(parents=True, exist_ok=True)
        self.pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="trial")
        self.done: queue.Queue[TrialRecord] = queue.Queue()
        self.live: dict[str, TrialRequest] = {}
        self.cancelled: set[str] = set()
        self.stops: dict[str, threading.Event] = {}
        self.lock = threading.Lock()
        self.closed = False

    # -- TrialBackend -------------------------------------------------------------------------------

    def launch(self, request: TrialRequest) -> None:
        if self.closed:
            raise BackendError("the local backend is closed")
        with self.lock:
            self.live[request.trial] = request
            self.stops[request.trial] = threading.Event()
        self.pool.submit(self._run_trial, request)

    def collect(self, timeout: float) -> list[TrialRecord]:
        out: list[TrialRecord] = []
        try:
            out.append(self.done.get(timeout=timeout) if timeout > 0 else self.done.get_nowait())
        except queue.Empty:
            return out
        while True:
            try:
                out.append(self.done.get_nowait())
            except queue.Empty:
                break
        with self.lock:
            for record in out:
                self.live.pop(record.trial, None)
        return out

    def running(self) -> list[str]:
        with self.lock:
            return list(self.live)

    def adopt(self) -> list[TrialRequest]:
        return []  # local trials die with the process that ran them

    def release(self, trial: str) -> None:
        pass  # a local trial's sandbox is gone when it is returned (its record carries the journal's turns)

    def prefetch(self, tasks: Sequence[Task]) -> None:
        pass  # the task repositories are local bundles: nothing to pull

    def prepare(self, requests: Sequence[TrialRequest]) -> None:
        pass  # a local sandbox starts in well under a second: nothing is worth keeping warm

    def cancel(self, trial: str) -> None:
        with self.lock:
            self.cancelled.add(trial)
            stop = self.stops.get(trial)
        if stop is not None:
            stop.set()  # kills the agent's sandbox; the trial ends `cancelled`

    def close(self) -> None:
        self.closed = True
        for trial in self.running():
            self.cancel(trial)
        self.pool.shutdown(wait=True, cancel_futures=True)
        shutil.rmtree(self.sockets, ignore_errors=True)

    # -- one trial ------------------------------------------------------------------------------------

    def _run_trial(self, request: TrialRequest) -> None:
        started = datetime.now(UTC)
        try:
            record = self._trial(request, started)
        except Exception as exc:
            log.exception("trial %s failed in the local backend", request.trial)
            record = build_record(
                request,
                run=self.name,
                harness=self.run.spec.harness.kind,
                reason=TerminationReason.SANDBOX_ERROR,
                reward=None,
                trajectory=None,
                started_at=started,
                ended_at=datetime.now(UTC),
                error=f"local backend: {type(exc).__name__}: {exc}",
            )
        if request.trial in self.cancelled and record.termination_reason != TerminationReason.COMPLETED:
            record = _as_cancelled(record)
        with self.lock:
            self.stops.pop(request.trial, None)
        self.done.put(record)

    def _trial(self, request: TrialRequest, started: datetime) -> TrialRecord:
        spec = self.run.spec
        sock = self.sockets / f"{request.trial}.sock"
        journal = self.folder / "journals" / request.trial
        if journal.exists():  # a trial cancelled or killed before: its turns were never saved
            shutil.rmtree(journal)
        if discard_trial_folder(self.sandbox, request.trial):
            log.info("trial %s: removed what an interrupted earlier attempt left", request.trial)
        timings: dict[str, float] = {}
        t0 = time.monotonic()
        proxy = self._start_proxy(request, sock, journal)
        timings["proxy_start"] = time.monotonic() - t0
        trajectory: TrajectorySummary | None = None
        problem: str | None = None  # why the proxy gave no usable answer (`/finish` failed, no trajectory)
        try:
            with httpx.Client(
                transport=httpx.HTTPTransport(uds=str(sock)),
                timeout=httpx.Timeout(self.proxy_timeout_seconds, connect=5.0),
            ) as http:
                client = ProxyClient(http, "http://proxy")

                def finish(outcome: TrialOutcome) -> None:
                    nonlocal problem
                    reason, code = R(outcome.termination_reason), outcome.agent_exit_code
                    detail = f"harness exit code {code}" if reason is R.AGENT_ERROR else None
                    try:
                        client.finish(reason, code, detail)
                    except ProxyCallError as exc:
                        # As in the Kubernetes backend: a proxy that cannot end the trial leaves no
                        # trajectory to trust (`proxy_error`); verify still runs, the record says why.
                        log.warning("trial %s: %s", request.trial, exc)
                        problem = str(exc)

                engine_port = self.engine_url.rsplit(":", 1)[1]
                deadlines = spec.pool.deadlines if spec.pool is not None else None
                outcome = run_local_trial(
                    self.sandbox,
                    self.task_set,
                    request.task,
                    request.trial,
                    [f"{RUNTIME_INSIDE}/bin/legorl-harness", spec.harness.kind],
                    proxy_socket=sock,
                    env=self._harness_env(),
                    agent_seconds=float(deadlines.agent_seconds if deadlines else 3600),
                    verify_seconds=float(deadlines.verify_seconds if deadlines else 1800),
                    probes=[f"127.0.0.1:{engine_port}"],
                    extra_binds=[(str(self.runtime), RUNTIME_INSIDE)],
                    after_agent=finish,
                    stop=self.stops.get(request.trial),
                )
                if problem is None and R(outcome.termination_reason) not in _NO_TRAJECTORY:
                    try:
                        trajectory = client.trajectory()
                    except ProxyCallError as exc:
                        log.warning("trial %s: %s", request.trial, exc)
                        problem = str(exc)
        finally:
            _stop(proxy)
            sock.unlink(missing_ok=True)
        timings.update(outcome.stage_seconds)
        reason = reconcile(outcome.termination_reason, trajectory)
        error = outcome.error
        if trajectory is None and reason == R.PROXY_ERROR:
            error = (
                f"the trial's proxy gave no trajectory ({problem or 'it was not asked'}); "
                f"its log: {self._log_tail(request.trial)}"
            )
        elif reason in (R.AGENT_ERROR, R.SANDBOX_ERROR) and not error:
            error = outcome.agent_output[-2000:]
        return build_record(
            request,
            run=self.name,
            harness=spec.harness.kind,
            reason=reason,
            reward=outcome.reward,
            trajectory=trajectory,
            started_at=started,
            ended_at=datetime.now(UTC),
            findings=[f.to_dict() for f in outcome.findings],
            stage_seconds=timings,
            error=error,
        )

    def _harness_env(self) -> dict[str, str]:
        harness = self.run.spec.harness
        env = {e.name: e.value for e in harness.env if e.value is not None}
        env |= {
            "LEGORL_MODEL_NAME": "policy",
            "LEGORL_MAX_TURNS": str(harness.max_turns),
            "LEGORL_HARNESS_CONFIG_DIR": f"{RUNTIME_INSIDE}/config",
        }
        if harness.api_format:
            env["LEGORL_API_FORMAT"] = harness.api_format
        return env

    def _start_proxy(self, request: TrialRequest, sock: Path, journal: Path) -> subprocess.Popen[bytes]:
        fleet = self.run.spec.fleet
        command = proxy_command(
            self.run,
            ProxyTrial(
                trial=request.trial,
                upstream=self.engine_url,
                journal=str(journal),
                unix_socket=str(sock),
                capture_routed_experts=(
                    fleet is not None and fleet.settings.routed_experts_capture == "Enabled"
                ),
            ),
        )
        argv = [sys.executable, "-m", "legorl.cli", *command.args]
        log_file = (self.folder / "logs" / f"{request.trial}-proxy.log").open("wb")
        try:
            proxy = subprocess.Popen(  # noqa: S603 - our own interpreter and module
                argv,
                env={**os.environ, **command.env},
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=die_with_parent,  # noqa: PLW1509 - one prctl call
            )
        finally:
            log_file.close()
        deadline = time.monotonic() + self.proxy_start_seconds
        while not sock.exists():
            if proxy.poll() is not None or time.monotonic() > deadline or request.trial in self.cancelled:
                _stop(proxy)
                raise RuntimeError(f"the trial's proxy did not start: {self._log_tail(request.trial)}")
            time.sleep(0.05)
        return proxy

    def _log_tail(self, trial: str) -> str:
        path = self.folder / "logs" / f"{trial}-proxy.log"
        try:
            return path.read_text(errors="replace")[-1500:]
        except OSError:
            return "(no log)"


def _stop(proxy: subprocess.Popen[bytes]) -> None:
    if proxy.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proxy.pid, signal.SIGTERM)
        try:
            proxy.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proxy.pid, signal.SIGKILL)
            proxy.wait(timeout=10)


def _as_cancelled(record: TrialRecord) -> TrialRecord:
    from dataclasses import replace  # noqa: PLC0415

    return replace(record, termination_reason=TerminationReason.CANCELLED, reward=None)

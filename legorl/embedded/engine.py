"""vLLM's OpenAI server in a subprocess: the rollout engine of `legorl run` (and of the tests).

`VllmServer(model_dir)` runs ``python -m vllm.entrypoints.openai.api_server`` (this process never imports
vLLM), waits for ``/health``, and stops the whole process group on exit. With `engine_args` it serves with
exactly those flags (what the operator would give the fleet's pods, `engine_args_for_run`); without, with
the tests' defaults (fp32, eager, the hermes tool parser).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

__all__ = ["SERVED_MODEL_NAME", "VllmServer", "die_with_parent", "free_port"]


def die_with_parent() -> None:
    """`preexec_fn` for children that must not outlive a crashed parent (Linux `PR_SET_PDEATHSIG`): a
    killed `legorl run` leaves no engine or proxy behind. The signal fires when the thread that started
    the child exits, so start such children from long-lived threads."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


SERVED_MODEL_NAME = "policy"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the usual bind-to-0 race applies)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


class VllmServer:
    """`python -m vllm.entrypoints.openai.api_server` on `model_dir`, as a context manager.

    Serves the model as ``policy`` (`SERVED_MODEL_NAME`) with fp32, eager mode, the hermes tool parser and the
    dev-mode control routes (``/pause``, ``/update_weights``, ``/weight_info``, ...). The log goes to
    `log_path`; on exit the whole process group gets SIGTERM, then SIGKILL after `grace` seconds.
    """

    def __init__(
        self,
        model_dir: Path,
        *,
        max_model_len: int = 8192,
        extra_args: Sequence[str] = (),
        extra_env: Mapping[str, str] | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        startup_timeout: float = 240.0,
        grace: float = 15.0,
        log_path: Path | None = None,
        python: str = sys.executable,
        engine_args: Sequence[str] | None = None,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.max_model_len = max_model_len
        self.extra_args = list(extra_args)
        self.extra_env = dict(extra_env or {})
        self.host = host
        self.port = port if port is not None else free_port(host)
        self.startup_timeout = startup_timeout
        self.grace = grace
        self.python = python
        self.engine_args = list(engine_args) if engine_args is not None else None
        self._tmp = tempfile.TemporaryDirectory(prefix="vllm-server-")
        self.log_path = Path(log_path) if log_path is not None else Path(self._tmp.name) / "server.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.startup_seconds: float | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        served = [
            self.python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model_dir),
            "--served-model-name",
            SERVED_MODEL_NAME,
            "--host",
            self.host,
            "--port",
            str(self.port),
        ]
        if self.engine_args is not None:
            return [*served, *self.engine_args, *self.extra_args]
        return [
            *served,
            "--dtype",
            "float32",
            "--enforce-eager",
            "--max-model-len",
            str(self.max_model_len),
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "hermes",
            *self.extra_args,
        ]

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            {
                "VLLM_CPU_KVCACHE_SPACE": "1",
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "VLLM_SERVER_DEV_MODE": "1",
                "VLLM_CACHE_ROOT": str(Path(self._tmp.name) / "cache"),
                # vLLM's switch is VLLM_NO_USAGE_STATS (it warns about VLLM_USE_USAGE_STATS as unknown).
                "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1",
                "PYTHONUNBUFFERED": "1",
            }
        )
        env.update(self.extra_env)
        return env

    def log_tail(self, lines: int = 60) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no server log)"
        return "\n".join(text.splitlines()[-lines:])

    def start(self) -> VllmServer:
        if self.process is not None:
            raise RuntimeError("server already started")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(  # noqa: S603 - our own interpreter and flags
                self.command(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.environment(),
                cwd=self._tmp.name,
                start_new_session=True,
                preexec_fn=die_with_parent,  # noqa: PLW1509 - async-signal-safe: one prctl call
            )
        try:
            self._wait_healthy(started + self.startup_timeout)
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - started
        return self

    def set_weight_version(self, version: str) -> None:
        """Name the weights the engine serves (vLLM starts as `default`); the proxy records this name on
        every turn (`/update_weight_version`, a dev-mode route)."""
        request = urllib.request.Request(  # noqa: S310 - http to our own server
            f"{self.url}/update_weight_version",
            data=json.dumps({"new_version": version}).encode(),
            headers={"content-type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=30) as response:  # noqa: S310 - http
            if response.status != 200:
                raise RuntimeError(f"{self.url}/update_weight_version answered {response.status}")

    def healthy(self) -> bool:
        """Whether `GET /health` answers 200 now."""
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:  # noqa: S310 - http
                return bool(response.status == 200)
        except (OSError, urllib.error.URLError):
            return False

    def _wait_healthy(self, deadline: float) -> None:
        assert self.process is not None
        while True:
            code = self.process.poll()
            if code is not None:
                raise RuntimeError(
                    f"vLLM server exited with code {code} before becoming healthy; "
                    f"log tail:\n{self.log_tail()}"
                )
            if self.healthy():
                return
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"vLLM server not healthy after {self.startup_timeout:.0f}s; log tail:\n{self.log_tail()}"
                )
            time.sleep(0.5)

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is None:
            return
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=self.grace)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=self.grace)
        else:
            # The API server is gone; make sure no engine worker of its group outlives it.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)

    def close(self) -> None:
        self.stop()
        self._tmp.cleanup()

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

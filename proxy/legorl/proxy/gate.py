"""The gate a warm trial pod's agent waits at, and `POST /claim`, which opens it.

A trial pod made ready ahead (`spec.schedule.warmTrials`) runs every stage but the agent's before its
trial is launched; its agent container starts, then waits in `read` on a FIFO in a volume it mounts
read-only (`legorl.operator.render.pool.GATE_SCRIPT`). The proxy makes the FIFO (0644: only its own uid
can write it, so nothing in the agent's container can open the gate) before it listens, and writes one
line, `go`, when the operator claims the pod. Opening a FIFO for writing finds the agent's reader at
once (the write needs no poll, no clock, no HTTP client in the task image); when the agent is not
there yet (its container still starting), a thread waits for it and the claim answers `pending`.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
import time
from pathlib import Path
from typing import Literal

log = logging.getLogger("legorl.proxy")

GateState = Literal["waiting", "pending", "released"]
GO = b"go\n"


class ClaimGate:
    """One pod's gate (thread-safe: claims come from the event loop, the waiting writer is a thread)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._state: GateState = "waiting"
        self.claimed_at: float | None = None
        """When the first claim arrived (seconds since the epoch)."""
        self.released_at: float | None = None
        """When the agent got its `go` (seconds since the epoch)."""

    def make(self) -> None:
        """Create the FIFO, 0644, unless it is there (a restarted proxy keeps the agent's reader)."""
        try:
            os.mkfifo(self.path, 0o644)
        except FileExistsError:
            if not stat.S_ISFIFO(self.path.stat().st_mode):
                raise RuntimeError(f"{self.path} exists and is not a FIFO") from None
        self.path.chmod(0o644)  # whatever the umask

    @property
    def state(self) -> GateState:
        with self._lock:
            return self._state

    def claim(self) -> GateState:
        """Open the gate: `released` when the agent got its `go`, `pending` when it is not waiting yet (a
        thread gives it the line as soon as it opens the FIFO). Idempotent."""
        with self._lock:
            if self._state != "waiting":
                return self._state
            self.claimed_at = time.time()
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK)
            except OSError as exc:
                if exc.errno != errno.ENXIO:  # ENXIO: no reader yet
                    raise
                self._state = "pending"
                threading.Thread(target=self._release_when_read, name="claim-gate", daemon=True).start()
                return self._state
            self._write(fd)
            return self._state

    def _release_when_read(self) -> None:
        fd = os.open(self.path, os.O_WRONLY)  # blocks until the agent's `read` opens the FIFO
        with self._lock:
            self._write(fd)
        log.info("the agent came to the gate %.3f s after the claim", time.time() - (self.claimed_at or 0))

    def _write(self, fd: int) -> None:
        try:
            os.write(fd, GO)
        finally:
            os.close(fd)
        self._state = "released"
        self.released_at = time.time()

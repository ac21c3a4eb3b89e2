"""SIGTERM that waits for the trial's journal to be read: uvicorn's server with a drain."""

from __future__ import annotations

import logging
import threading
import time
from types import FrameType
from typing import Protocol

import uvicorn

__all__ = ["DrainingServer"]

log = logging.getLogger(__name__)


class Collected(Protocol):
    collected: bool
    """The trajectory was read since the trial ended."""


class DrainingServer(uvicorn.Server):
    """uvicorn's server, but SIGTERM stops it only once the trial's trajectory was read, or after
    `drain_seconds`. The kubelet stops every container of a deleted trial pod at once, and the proxy holds
    the only copy of the turns it acknowledged; the controller reads them within the pod's grace period.
    A second signal stops it at once (uvicorn's own handling)."""

    def __init__(self, config: uvicorn.Config, app: Collected, drain_seconds: float) -> None:
        super().__init__(config)
        self.proxy_app, self.drain_seconds = app, drain_seconds
        self._draining = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._draining or self.drain_seconds <= 0 or self.proxy_app.collected:
            super().handle_exit(sig, frame)
            return
        self._draining = True
        log.warning(
            "signal %d: serving the trial's journal until it is read, at most %.0f s", sig, self.drain_seconds
        )
        threading.Thread(target=self._drain, args=(sig,), name="drain", daemon=True).start()

    def _drain(self, sig: int) -> None:
        deadline = time.monotonic() + self.drain_seconds
        while time.monotonic() < deadline and not self.proxy_app.collected and not self.should_exit:
            time.sleep(0.1)
        if not self.should_exit:
            log.warning(
                "stopping: %s", "the trajectory was read" if self.proxy_app.collected else "drain time over"
            )
            self.should_exit = True

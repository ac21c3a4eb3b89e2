"""`ProxyClient`: what a trial backend asks a trial's proxy: `/claim`, `/finish`, `/changes`, `/trajectory`,
`/metrics`.

Calls that cannot connect or get a 5xx are tried again with backoff; a 4xx, an answer that is not a JSON
object, or a trajectory that breaks the contract (`legorl.api.summary`) is a `ProxyCallError` at once, with
what went wrong in its message. The backends turn a `ProxyCallError` into the trial's record (no trajectory:
`proxy_error`), never into a crash.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import httpx

from legorl.api.summary import TrajectorySummary
from legorl.api.termination import TerminationReason
from legorl.api.trajectory import TrajectoryError

__all__ = ["ProxyCallError", "ProxyClient", "ProxyUnreachable"]

log = logging.getLogger(__name__)


class ProxyCallError(Exception):
    """A trial's proxy did not answer usefully: unreachable, refused the call, or answered nonsense."""


class ProxyUnreachable(ProxyCallError):
    """A call that got no HTTP answer at all (the proxy is not listening yet, or is gone)."""


class ProxyClient:
    """One trial's proxy at `base_url` (`http://<podIP>:4000`, or `http://proxy` over a Unix socket
    transport), through `http`, which the caller owns (one pool may serve many trials' proxies)."""

    def __init__(
        self,
        http: httpx.Client,
        base_url: str,
        *,
        attempts: int = 3,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.http = http
        self.base_url = base_url.rstrip("/")
        self.attempts = max(1, attempts)
        self.sleep = sleep

    def claim(self, timeout: float = 5.0) -> bool:
        """`POST /claim`, tried once (the caller asks again on its next pass): open a warm pod's gate so its
        agent starts. True when the agent was released at once (200); False when the proxy took the claim
        and releases the agent as soon as it reaches the gate (202). `ProxyUnreachable` when the proxy is not
        up; `ProxyCallError` when it refuses (404: the pod has no gate)."""
        try:
            response = self.http.post(
                f"{self.base_url}/claim", timeout=httpx.Timeout(timeout, connect=min(timeout, 1.0))
            )
        except httpx.HTTPError as exc:
            raise ProxyUnreachable(
                f"the proxy did not answer POST /claim ({type(exc).__name__}: {exc})"
            ) from exc
        if response.status_code not in (200, 202):
            raise ProxyCallError(
                f"the proxy refused POST /claim: HTTP {response.status_code}: {response.text[:200]}"
            )
        return response.status_code == 200

    def finish(
        self, reason: TerminationReason, exit_code: int | None, detail: str | None
    ) -> TrajectorySummary:
        """`POST /finish`: how the harness exited. The answer is the trial's summary without tokens, the
        proxy's own end state in it (a failure it saw first wins over the harness's exit)."""
        body = {"reason": reason.value, "exitCode": exit_code, "detail": detail}
        return self._summary("/finish", self._call("POST", "/finish", body))

    def changes(self) -> dict[str, Any]:
        """`GET /changes`: the agent's changes to the workspace (read by the proxy, mounted read-only)."""
        return self._call("GET", "/changes")

    def trajectory(self, *, tokens: bool = True) -> TrajectorySummary:
        """`GET /trajectory`: end state, segments and how well the turns merged."""
        path = "/trajectory" if tokens else "/trajectory?tokens=false"
        return self._summary(path, self._call("GET", path))

    def metrics(self, timeout: float = 5.0) -> str | None:
        """`GET /metrics` (Prometheus text), tried once: figures are nice to have, a trial never waits on
        them. None when the proxy does not give them."""
        try:
            response = self.http.get(f"{self.base_url}/metrics", timeout=timeout)
        except httpx.HTTPError as exc:
            log.debug("no proxy metrics from %s: %s", self.base_url, exc)
            return None
        return response.text if response.status_code == 200 else None

    @staticmethod
    def _summary(path: str, data: dict[str, Any]) -> TrajectorySummary:
        try:
            return TrajectorySummary.from_json(data)
        except TrajectoryError as exc:
            raise ProxyCallError(f"the proxy's {path} breaks the trajectory contract: {exc}") from exc

    def _call(self, method: str, path: str, body: Any = None) -> dict[str, Any]:
        url = f"{self.base_url}{path}"
        problem = "no attempt made"
        for attempt in range(self.attempts):
            if attempt:
                self.sleep(min(2.0**attempt * 0.25, 5.0))
            try:
                response = self.http.request(method, url, json=body)
            except httpx.HTTPError as exc:
                problem = f"{type(exc).__name__}: {exc}"
                continue
            if response.status_code >= 500:
                problem = f"HTTP {response.status_code}: {response.text[:300]}"
                continue
            if response.status_code >= 400:
                raise ProxyCallError(
                    f"the proxy refused {method} {path}: HTTP {response.status_code}: {response.text[:300]}"
                )
            try:
                data = response.json()
            except ValueError as exc:
                raise ProxyCallError(f"the proxy's {path} is not JSON: {exc}") from exc
            if not isinstance(data, dict):
                raise ProxyCallError(f"the proxy's {path} is not a JSON object")
            return data
        raise ProxyCallError(f"the proxy did not answer {method} {path} ({problem})")

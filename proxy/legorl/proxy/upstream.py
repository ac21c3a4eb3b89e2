"""The engine side: one shared client (`http1`), retries through weight swaps, errors classified.

A weight swap pauses the engine; a restarting engine refuses connections. Both are retried with
exponential backoff and full jitter until the settings' budget runs out, then the call fails as
`engine_error`. Retries happen only before the engine has answered: a stream that already
delivered tokens to the harness is never replayed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

from legorl.api import weight_versions
from legorl.proxy import _json as fastjson
from legorl.proxy import http1
from legorl.proxy.errors import ProxyError
from legorl.proxy.metrics import Metrics
from legorl.proxy.settings import ProxySettings

__all__ = ["Served", "Upstream", "classify_engine_error"]

log = logging.getLogger(__name__)

_RETRY_STATUS = {503}
_JSON_HEADERS = {"content-type": "application/json"}
# vLLM's wording for prompts that do not fit: "This model's maximum context length is N tokens.
# However, you requested M tokens...", "... longer than the maximum model length ...".
_OVERFLOW = re.compile(
    r"maximum context length|maximum model length|max_model_len|context length|too long", re.I
)


def _error_message(body: bytes) -> str:
    try:
        data = json.loads(body)
    except ValueError:
        return body[:500].decode(errors="replace") or "(empty body)"
    if isinstance(data, dict):
        error = data.get("error", data)
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return str(error["message"])
        if isinstance(data.get("message"), str):
            return str(data["message"])
    return json.dumps(data)[:500]


def classify_engine_error(status: int, body: bytes) -> ProxyError:
    """What an engine's non-2xx answer means for the harness and the trial."""
    message = _error_message(body)
    if status == 400 and _OVERFLOW.search(message):
        return ProxyError("context_overflow", message)
    if status in (400, 422):
        # The engine refused what the harness asked (e.g. a tool choice naming no tool): the
        # harness's mistake, reported back to it; the trial goes on.
        return ProxyError("invalid_request", f"the engine rejected the request: {message}")
    return ProxyError("engine_error", f"the engine answered {status}: {message}")


class Served:
    """What the engine said about one call besides the answer: the weight versions that served it
    (`legorl.api.weight_versions`), or None when it did not say."""

    __slots__ = ("versions",)

    def __init__(self) -> None:
        self.versions: list[str] | None = None


class Upstream:
    """The rollout engine, reached over HTTP or a Unix socket."""

    def __init__(self, settings: ProxySettings, metrics: Metrics) -> None:
        self.settings = settings
        self.metrics = metrics
        # Harnesses think (run tools) between calls; keep their connections for the next one.
        self.client = http1.Client(
            settings.upstream,
            connect_timeout=settings.connect_timeout_seconds,
            read_timeout=settings.read_timeout_seconds,
            max_connections=settings.max_connections,
            keepalive_expiry=300.0,
        )
        self._version_supported = settings.policy_version_source == "engine"
        self.engine_names_versions = False
        """The engine's answers name the versions that served them (legorl's middleware in vLLM): no
        `/weight_info` reads around the calls. Learned from the first answer that does."""

    @property
    def reads_versions(self) -> bool:
        """Whether a call needs `GET /weight_info` before it (the engine names no versions)."""
        return self._version_supported and not self.engine_names_versions

    async def call_versions(self, before: str | None, served: Served) -> list[str]:
        """The weight versions that may have served a call: those the engine named with the answer, else
        `before` (read before the call) and a read now. Never an empty list."""
        if not self._version_supported:
            return [self.settings.policy_version]
        if served.versions is not None:
            if not self.engine_names_versions:
                log.info("the engine names the weight versions that served each call; no /weight_info reads")
                self.engine_names_versions = True
            return served.versions
        if self.engine_names_versions:
            log.warning(
                "the engine stopped naming the weight versions that served its answers (restarted without "
                "legorl's middleware?); reading /weight_info around each call again"
            )
            self.engine_names_versions = False
        # Without a read before the call (the engine was expected to name them), the start is unknown.
        start = before or "unknown"
        # Read without waiting: the answer is in hand, and an engine gone quiet right after it must not
        # cost the turn. "unknown" marks a turn whose weights cannot be vouched for.
        after = await self.policy_version(wait=False) or "unknown"
        return [start] + ([after] if after != start else [])

    async def close(self) -> None:
        await self.client.aclose()

    async def _backoff(self, attempt: int, deadline: float, why: str) -> None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise ProxyError(
                "engine_error",
                f"the engine stayed unavailable for {self.settings.retry_budget_seconds:g}s ({why})",
                status=503,
            )
        cap = min(self.settings.retry_max_seconds, self.settings.retry_initial_seconds * 2**attempt)
        self.metrics.inc("legorl_proxy_engine_retries_total")
        await asyncio.sleep(min(remaining, random.uniform(0, cap)))  # noqa: S311 - jitter, not crypto

    def _upstream_error(self, status: str) -> None:
        self.metrics.inc("legorl_proxy_upstream_errors_total", status=status)

    @asynccontextmanager
    async def _send(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None,
        *,
        headers: Mapping[str, str] | None = None,
    ) -> AsyncIterator[http1.Response]:
        """A response with a 2xx status (retried through 503s and refused connections), its body unread.
        `headers`: extra request headers (the trace's `traceparent`)."""
        deadline = time.monotonic() + self.settings.retry_budget_seconds
        attempt = 0
        sent_headers = {**(_JSON_HEADERS if body is not None else {}), **(headers or {})}
        content = fastjson.dumps(body) if body is not None else None
        while True:
            try:
                response = await self.client.request(method, path, content, sent_headers)
            except http1.Unreached as exc:
                self._upstream_error("unreachable")
                await self._backoff(attempt, deadline, str(exc))
                attempt += 1
                continue
            except http1.ReadTimeout as exc:
                self._upstream_error("timeout")
                raise ProxyError("engine_error", "the engine timed out (no answer)", status=504) from exc
            except http1.HttpError as exc:
                self._upstream_error("transport")
                raise ProxyError("engine_error", f"the engine call failed: {exc}") from exc
            try:
                status = response.status
                if status >= 300:
                    self._upstream_error(str(status))
                    error_body = await self._body(response, "an error answer")
                    if status in _RETRY_STATUS:
                        await self._backoff(attempt, deadline, f"HTTP {status}")
                        attempt += 1
                        continue
                    raise classify_engine_error(status, error_body)
                yield response
                return
            finally:
                response.close()

    async def _body(self, response: http1.Response, what: str) -> bytes:
        """A response's whole body; a timeout or a cut-off answer is the engine's error."""
        try:
            return await response.read()
        except http1.ReadTimeout as exc:
            self._upstream_error("timeout")
            raise ProxyError("engine_error", f"the engine timed out mid-answer ({what})", status=504) from exc
        except http1.HttpError as exc:
            self._upstream_error("transport")
            raise ProxyError("engine_error", f"the engine dropped {what}: {exc}") from exc

    async def complete(
        self, body: dict[str, Any], headers: Mapping[str, str] | None = None, served: Served | None = None
    ) -> dict[str, Any]:
        """A non-streaming call; the parsed JSON body. `served` gets the versions the engine named."""
        async with self._send("POST", "/v1/chat/completions", body, headers=headers) as response:
            if served is not None and (named := response.headers.get(weight_versions.HEADER)) is not None:
                served.versions = weight_versions.policy_versions(weight_versions.decode(named))
            content = await self._body(response, "the answer")
        try:
            data = fastjson.loads(content)
        except fastjson.JSONDecodeError as exc:
            raise ProxyError("engine_error", "the engine sent a body that is not JSON") from exc
        if not isinstance(data, dict):
            raise ProxyError("engine_error", "the engine sent a body that is not a JSON object")
        return data

    async def stream(
        self, body: dict[str, Any], headers: Mapping[str, str] | None = None, served: Served | None = None
    ) -> AsyncGenerator[list[bytes], None]:
        """A streaming call; yields the SSE `data:` payloads that arrived together, as a batch.

        Whatever one socket read brought is handled (and relayed to the harness) at once: the
        batching adds no wait, and it spares a write per event when the engine is ahead. `served`
        gets the versions of the stream's closing comment, if the engine sent one.
        """
        async with self._send("POST", "/v1/chat/completions", body, headers=headers) as response:
            pending = b""
            try:
                async for raw in response.chunks():
                    pending += raw
                    if b"\r" in pending:  # normalised on the buffer: a CRLF may straddle two reads
                        pending = pending.replace(b"\r\n", b"\n")
                    *events, pending = pending.split(b"\n\n")
                    batch = []
                    for event in events:
                        for line in event.split(b"\n"):
                            if line.startswith(b"data:"):
                                batch.append(line[5:].strip())
                            elif served is not None and line.startswith(weight_versions.SSE_PREFIX):
                                served.versions = weight_versions.policy_versions(
                                    weight_versions.decode(line[len(weight_versions.SSE_PREFIX) :])
                                )
                    if batch:
                        yield batch
                tail = pending.strip()
                if tail.startswith(b"data:"):
                    yield [tail[5:].strip()]
                elif served is not None and tail.startswith(weight_versions.SSE_PREFIX):
                    served.versions = weight_versions.policy_versions(
                        weight_versions.decode(tail[len(weight_versions.SSE_PREFIX) :])
                    )
            except http1.ReadTimeout as exc:
                self._upstream_error("timeout")
                raise ProxyError("engine_error", "the engine went silent mid-stream", status=504) from exc
            except http1.HttpError as exc:
                self._upstream_error("transport")
                raise ProxyError("engine_error", f"the engine dropped the stream: {exc}") from exc

    async def tokenize(self, body: dict[str, Any]) -> dict[str, Any]:
        async with self._send("POST", "/tokenize", body) as response:
            content = await self._body(response, "its /tokenize answer")
        try:
            data = fastjson.loads(content)
        except fastjson.JSONDecodeError as exc:
            raise ProxyError("engine_error", "the engine's /tokenize answer is not JSON") from exc
        if not isinstance(data, dict):
            raise ProxyError("engine_error", "the engine's /tokenize answer is not a JSON object")
        return data

    async def kv_cache_usage(self) -> float | None:
        """The engine's KV cache usage in [0, 1] (the fullest engine core), or None if unknown."""
        try:
            status, content = await self.client.get("/metrics")
        except http1.HttpError:
            return None
        if status != 200:
            return None
        values = []
        for line in content.decode(errors="replace").splitlines():
            if line.startswith("vllm:kv_cache_usage_perc"):
                try:
                    values.append(float(line.rsplit(" ", 1)[1]))
                except (IndexError, ValueError):
                    continue
        return max(values) if values else None

    async def policy_version(self, *, wait: bool = True) -> str | None:
        """The weights the engine serves now (`GET /weight_info`), or the configured version when
        the engine cannot tell. `wait`: ride out a restart or a swap like a model call does;
        without it, an engine that does not answer gives None (version unknown)."""
        if not self._version_supported:
            return self.settings.policy_version
        deadline = time.monotonic() + self.settings.retry_budget_seconds
        attempt = 0
        while True:
            try:
                status, content = await self.client.get("/weight_info")
            except http1.Unreached as exc:
                if not wait:
                    return None
                await self._backoff(attempt, deadline, str(exc))
                attempt += 1
                continue
            except http1.HttpError as exc:
                if not wait:
                    return None
                raise ProxyError(
                    "engine_error", f"could not read the engine's policy version: {exc}"
                ) from exc
            if status in _RETRY_STATUS and wait:
                await self._backoff(attempt, deadline, f"HTTP {status}")
                attempt += 1
                continue
            break
        if status in (404, 405):
            log.warning(
                "the engine has no /weight_info (VLLM_SERVER_DEV_MODE off?); recording policy version %r",
                self.settings.policy_version,
            )
            self._version_supported = False
            return self.settings.policy_version
        try:
            data = json.loads(content) if status == 200 else None
        except ValueError:
            data = None
        version = data.get("weight_version", data.get("version")) if isinstance(data, dict) else None
        if version is None:
            if not wait:
                return None
            raise ProxyError("engine_error", f"the engine's /weight_info answered {status} without a version")
        return weight_versions.policy_version(str(version))

"""vLLM API-server middleware: every model call's answer names the weight versions that served it.

vLLM loads it with `--middleware legorl.trainer.engine.versions.WeightVersions` (the operator renders the
flag next to the Filesystem weight-transfer extension, which already puts legorl in the engine image).
The wire format is `legorl.api.weight_versions`.

What makes it exact. Weight versions change only through this server's own RL routes, and legorl's
trainer swaps weights as pause (keep) → start → update → finish with the version → reset the prefix cache
→ resume. The middleware keeps the version current now (read from the engine, not guessed) and the list of
model calls in flight. When a route that can change the version (`/update_weights`, `/finish_weight_update`,
`/update_weight_version`, `/resume`) has succeeded, it reads the engine's version again *before* the
route's answer goes out, and adds it to every call in flight. So:

- a call records the version current when it arrived, plus every version made current before it ended;
- the trainer sends `/resume` only after `/finish_weight_update` has answered, by which time every call
  in flight carries the new version: no token sampled after the resume can go unrecorded;
- a call that arrives while the engine is paused records the old version too (a superset: the proxy never
  misses a version, and at most names one that served no token, as the before/after reads did).

One API server process per engine (vLLM's default): with `--api-server-count` above 1 each process would
see only the RL routes it served itself and could name a stale version, so the operator leaves the
middleware out there, and the proxy, getting no versions with the answers, reads `GET /weight_info` (which
asks the engine core) before and after each call instead.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from legorl.api import weight_versions as wire

__all__ = ["WeightVersions"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]
VersionReader = Callable[[Scope], Awaitable[str]]

MODEL_CALLS = frozenset({"/v1/chat/completions", "/v1/completions"})
"""Routes whose answers carry the versions."""
VERSION_CHANGES = frozenset({"/update_weights", "/finish_weight_update", "/update_weight_version", "/resume"})
"""Routes after whose success the engine's version is read again."""


async def _engine_version(scope: Scope) -> str:
    """vLLM's own answer to `GET /weight_info`: the engine client on the app's state."""
    return str(await scope["app"].state.engine_client.get_weight_version())


class WeightVersions:
    """Wraps vLLM's app (`app.add_middleware(WeightVersions)`); `read_version` stands in for the engine
    client in tests that put it in front of another engine."""

    def __init__(self, app: App, read_version: VersionReader | None = None) -> None:
        self.app = app
        self._read = read_version or _engine_version
        self.current: str | None = None
        self._in_flight: dict[int, list[str]] = {}
        self._next_id = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST":
            await self.app(scope, receive, send)
        elif scope["path"] in MODEL_CALLS:
            await self._model_call(scope, receive, send)
        elif scope["path"] in VERSION_CHANGES:
            await self._version_change(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    async def _refresh(self, scope: Scope) -> str:
        version = await self._read(scope)
        self.current = version
        for seen in self._in_flight.values():
            if version not in seen:
                seen.append(version)
        return version

    async def _version_change(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def answered(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] < 300:
                await self._refresh(scope)
            await send(message)

        await self.app(scope, receive, answered)

    async def _model_call(self, scope: Scope, receive: Receive, send: Send) -> None:
        current = self.current if self.current is not None else await self._refresh(scope)
        seen = [current]
        call = self._next_id
        self._next_id += 1
        self._in_flight[call] = seen
        streaming = False

        async def answered(message: Message) -> None:
            nonlocal streaming
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                content_type = next((v for k, v in headers if k.lower() == b"content-type"), b"")
                streaming = content_type.startswith(b"text/event-stream")
                if not streaming:  # an unstreamed answer starts once its last token is in
                    headers.append((wire.HEADER.encode(), wire.encode(seen).encode("ascii")))
                    message = {**message, "headers": headers}
            elif message["type"] == "http.response.body" and streaming and not message.get("more_body"):
                message = {**message, "body": message.get("body", b"") + wire.sse_comment(seen)}
            await send(message)

        try:
            await self.app(scope, receive, answered)
        finally:
            del self._in_flight[call]

"""The proxy's ASGI application: three client APIs in, one engine API out, every turn journaled.

Routes (a `/v1` prefix is optional, as is a trailing slash; query strings are ignored):

- `POST /v1/chat/completions`, `POST /v1/responses`, `POST /v1/messages`: model calls, streaming
  or not, answered in the client's own schema and error format.
- `POST /v1/messages/count_tokens`: the engine's own tokenizer and chat template count the prompt.
- `GET /v1/models`: the one model this proxy serves, in OpenAI's or Anthropic's list format.
- `GET /health` (alive), `GET /ready` (journal open), `GET /metrics` (Prometheus text).
- `GET /trajectory` (end state, segments, merge share; `?tokens=false` for a summary),
  `GET /turns` (journaled turns), `POST /finish` (the harness's exit; returns the end state).
- `HEAD /` answers 200 (Claude Code probes it before its first call).

Starlette routes them and runs the lifespan. The model calls are plain ASGI endpoints inside its
router, so the relay reads the body, watches for the client going away and writes the engine's
stream itself, one write per engine read.

The order inside a model call is the point of the whole component: the engine's answer is
checked, turned into a `Turn` and fsync'd to the journal, and only then does the harness get the
answer (for a stream: its terminal events). A harness never acts on a turn the journal lacks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from opentelemetry.trace import SpanKind, Status, StatusCode, TracerProvider
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route, Router
from starlette.types import Message, Receive, Scope, Send

from legorl.api.termination import TerminationReason
from legorl.api.trajectory import ApiFormat
from legorl.proxy import _json as fastjson
from legorl.proxy.errors import ProxyError, error_body
from legorl.proxy.formats import anthropic, chat, responses
from legorl.proxy.formats.common import (
    ClientFormat,
    Completion,
    Prepared,
    StreamAccumulator,
    StreamEncoder,
    TextDelta,
    ToolCallStart,
    completion_from_response,
    events_from_completion,
)
from legorl.proxy.gate import ClaimGate
from legorl.proxy.journal import turn_to_record
from legorl.proxy.metrics import Metrics
from legorl.proxy.settings import ProxySettings
from legorl.proxy.trial import Trial
from legorl.proxy.upstream import Served, Upstream
from legorl.sandbox import changes
from legorl.telemetry.traces import trace_headers, trial_context

__all__ = ["ProxyApp"]

log = logging.getLogger(__name__)

_FORMATS: dict[str, ClientFormat] = {
    "/chat/completions": chat,
    "/responses": responses,
    "/messages": anthropic,
}
_COUNT_TOKENS = "/messages/count_tokens"
_SETTING_FORMAT = {
    "OpenAIChatCompletions": ApiFormat.OPENAI_CHAT,
    "OpenAIResponses": ApiFormat.OPENAI_RESPONSES,
    "AnthropicMessages": ApiFormat.ANTHROPIC_MESSAGES,
}
_SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


class _NoSpan:
    """What an untraced proxy uses for a span and a tracer: every call does nothing."""

    def __enter__(self) -> _NoSpan:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def set_attribute(self, key: str, value: Any) -> None:
        return None

    def set_attributes(self, attributes: Any) -> None:
        return None

    def set_status(self, status: Any) -> None:
        return None


_NO_SPAN = _NoSpan()


class _NoTracer:
    def start_as_current_span(self, name: str, **_: Any) -> _NoSpan:
        return _NO_SPAN


def _json_bytes(body: Any) -> bytes:
    return fastjson.dumps(body)


class _Json(Response):
    """A JSON answer, encoded by the same library as every other body the proxy sends (orjson)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return _json_bytes(content)


class _Disconnect:
    """Watches `receive` for the client going away once the body has been read."""

    def __init__(self, receive: Receive) -> None:
        self.event = asyncio.Event()
        self._task = asyncio.create_task(self._watch(receive))

    async def _watch(self, receive: Receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.event.set()
                return

    @property
    def gone(self) -> bool:
        return self.event.is_set()

    def stop(self) -> None:
        self._task.cancel()


@dataclass
class _Call:
    """One model call in flight."""

    fmt: ClientFormat
    prepared: Prepared
    raw_request: bytes
    send: Send
    disconnect: _Disconnect
    span: Any
    """The call's span (a `_NoSpan` when untraced)."""
    encoder: StreamEncoder | None
    headers_sent: bool = False
    ttft: float | None = None
    t0: float = field(default_factory=time.perf_counter)


class _ModelCalls:
    """One client API's model-call endpoint. An ASGI callable, not a request function, so Starlette's
    `Route` hands it scope, receive and send as the server gave them: the relay needs `receive` after
    the body (to see the client go away) and writes the engine's stream itself."""

    def __init__(self, proxy: ProxyApp, fmt: ClientFormat) -> None:
        self.proxy = proxy
        self.fmt = fmt

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        raw, body = await self.proxy._read_json(Headers(scope=scope), receive)
        await self.proxy._model_call(self.fmt, raw, body, receive, send)


class ProxyApp:
    """One trial's proxy. Give it to any ASGI server (the CLI uses uvicorn)."""

    def __init__(
        self,
        settings: ProxySettings,
        *,
        tracer_provider: TracerProvider | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        self.settings = settings
        self.metrics = metrics or Metrics()
        # Untraced, spans are not even made: the API's no-op spans still attach and detach a context
        # three times per call (about 6% of the proxy's CPU per call).
        self.tracer: Any = (
            tracer_provider.get_tracer("legorl.proxy") if tracer_provider is not None else _NoTracer()
        )
        # Traced (a provider was given): every call's span hangs under the trial's root span, which
        # the run controller emits with the same ids when it collects the trial, and the engine gets
        # a traceparent. Without one, no context is built and no header is sent.
        self._trial_context = (
            trial_context(settings.run, settings.trial) if tracer_provider is not None else None
        )
        self._trial_attributes = {"legorl.run": settings.run, "legorl.trial": settings.trial}
        self.trial: Trial | None = None
        self.collected = False
        """The trajectory was read since the trial ended: what the journal holds has been recorded."""
        self.upstream: Upstream | None = None
        self.gate = ClaimGate(Path(settings.claim_fifo)) if settings.claim_fifo else None
        self._admission: asyncio.Semaphore | None = None
        self._startup_lock: asyncio.Lock | None = None
        self.expected_format = _SETTING_FORMAT.get(settings.api_format or "")
        # The model calls first: the router tries the routes in order.
        self.router = Router(
            [
                *(Route(path, _ModelCalls(self, fmt), methods=["POST"]) for path, fmt in _FORMATS.items()),
                Route(_COUNT_TOKENS, self._count_tokens, methods=["POST"]),
                Route("/models", self._models),
                Route("/health", self._health),
                Route("/healthz", self._health),
                Route("/ready", self._ready),
                Route("/metrics", self._metrics),
                Route("/trajectory", self._trajectory),
                Route("/turns", self._turns),
                Route("/changes", self._changes),
                Route("/finish", self._finish, methods=["POST"]),
                Route("/claim", self._claim, methods=["GET", "POST"]),
                Route("/", self._probe, methods=["HEAD"]),
            ],
            # A trailing slash is served, not redirected (`__call__` strips it).
            redirect_slashes=False,
            lifespan=self._lifespan,
        )

    # -- lifecycle -------------------------------------------------------------------------------

    async def startup(self) -> None:
        """Open the journal (recovering it) and the engine client; idempotent."""
        if self.trial is not None:
            return
        if self.gate is not None:
            self.gate.make()  # before the server listens: the agent starts once the proxy does
        self.trial = await asyncio.to_thread(Trial, self.settings, self.metrics)
        self.upstream = Upstream(self.settings, self.metrics)
        if self.settings.admission_max_sessions:
            self._admission = asyncio.Semaphore(self.settings.admission_max_sessions)

    async def shutdown(self) -> None:
        if self.upstream is not None:
            await self.upstream.close()
        if self.trial is not None:
            await asyncio.to_thread(self.trial.close)

    @asynccontextmanager
    async def _lifespan(self, app: object) -> AsyncIterator[None]:
        # A failed startup reaches the server as Starlette's `lifespan.startup.failed`, with the
        # traceback, which uvicorn logs before it exits.
        await self.startup()
        try:
            yield
        finally:
            await self.shutdown()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # Under an app, Starlette's router raises its misses (no such path: 404, not that method: 405)
        # as HTTPException, which is answered below in the client's own error format.
        scope["app"] = self
        if scope["type"] != "http":
            await self.router(scope, receive, send)  # the lifespan
            return
        if self.trial is None:  # a server that runs no lifespan
            if self._startup_lock is None:
                self._startup_lock = asyncio.Lock()
            async with self._startup_lock:
                await self.startup()
        # The routes are named without the optional `/v1` prefix and trailing slash.
        path = scope["path"].rstrip("/") or "/"
        scope["path"] = path[3:] if path.startswith("/v1/") else path
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.router(scope, receive, tracked)
        except HTTPException as miss:
            await self._send_error(scope, receive, send, self._no_route(scope, miss))
        except ProxyError as error:
            if not started:  # mid-answer, the format's own error event has already been sent
                await self._send_error(scope, receive, send, error)
        except Exception as exc:  # a bug must still answer in the client's format
            log.exception("unexpected error serving %s %s", scope["method"], scope["path"])
            self.metrics.inc("legorl_proxy_errors_total", kind="proxy_error")
            if started:
                return  # mid-answer: nothing well-formed can follow; the client sees a cut stream
            failure = ProxyError("proxy_error", f"the proxy failed: {type(exc).__name__}: {exc}")
            await self._send_error(scope, receive, send, failure)

    @staticmethod
    def _no_route(scope: Scope, miss: HTTPException) -> ProxyError:
        path = scope["path"]
        # A client API's path with the wrong method is that API's 405; the proxy's own endpoints, like
        # any other path, have no route for it.
        if miss.status_code == 405 and (path in _FORMATS or path == _COUNT_TOKENS):
            return ProxyError("method_not_allowed", f"{path} takes POST")
        return ProxyError("not_found", f"no route {scope['method']} {path}")

    async def _send_error(self, scope: Scope, receive: Receive, send: Send, error: ProxyError) -> None:
        # An ended trial's errors are permanent: tell the SDKs (which retry 409 and 5xx by default)
        # not to ask again, so the harness stops instead of hammering a trial that is over.
        over = self.trial is not None and self.trial.end is not None
        headers = {"x-should-retry": "false"} if over else None
        await _Json(error_body(self._format_for(scope), error), error.http_status, headers)(
            scope, receive, send
        )

    @staticmethod
    def _format_for(scope: Scope) -> ApiFormat | None:
        path = scope["path"]
        if path.startswith("/messages") or "anthropic-version" in Headers(scope=scope):
            return ApiFormat.ANTHROPIC_MESSAGES
        if path == "/responses":
            return ApiFormat.OPENAI_RESPONSES
        return ApiFormat.OPENAI_CHAT

    async def _read_json(self, headers: Headers, receive: Receive) -> tuple[bytes, dict[str, Any]]:
        """The request body as it arrived (recorded on the turn as the harness sent it) and as JSON."""
        cap = self.settings.max_body_bytes
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > cap:
            raise ProxyError("too_large", f"the request body is over the proxy's {cap}-byte limit")
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ProxyError("invalid_request", "the client went away before sending its body")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > cap:
                raise ProxyError("too_large", f"the request body is over the proxy's {cap}-byte limit")
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        raw = b"".join(chunks)
        try:
            # Strict: NaN/Infinity, lone surrogates and nesting past 1024 levels are refused here,
            # since none of them could be sent on to the engine.
            body = fastjson.loads(raw)
        except fastjson.JSONDecodeError as exc:
            raise ProxyError("invalid_request", f"the request body is not valid JSON: {exc}") from exc
        if not isinstance(body, dict):
            raise ProxyError("invalid_request", "the request body must be a JSON object")
        return raw, body

    # -- model calls -----------------------------------------------------------------------------

    async def _model_call(
        self, fmt: ClientFormat, raw: bytes, body: dict[str, Any], receive: Receive, send: Send
    ) -> None:
        assert self.trial is not None and self.upstream is not None
        api_format: ApiFormat = fmt.API_FORMAT
        if self.expected_format is not None and api_format != self.expected_format:
            self.metrics.inc("legorl_proxy_unexpected_format_total", api_format=api_format.value)
        started = time.perf_counter()
        outcome = "error"
        self.metrics.add("legorl_proxy_in_flight", 1)
        with self.tracer.start_as_current_span(
            f"proxy {api_format.value}",
            context=self._trial_context,
            kind=SpanKind.SERVER,
            attributes={"legorl.api_format": api_format.value, **self._trial_attributes},
        ) as span:
            disconnect = _Disconnect(receive)
            try:
                try:
                    self.trial.admit()
                except ProxyError as error:
                    await self.trial.fail(error)
                    raise
                try:
                    prepared = fmt.prepare(body, self.settings)
                    self.trial.restore_tool_arguments(prepared.body["messages"])
                    span.set_attribute("legorl.stream", prepared.stream)
                    call = _Call(
                        fmt=fmt,
                        prepared=prepared,
                        raw_request=raw,
                        send=send,
                        disconnect=disconnect,
                        span=span,
                        encoder=fmt.Encoder(prepared) if prepared.stream else None,
                    )
                    if self._admission is not None:
                        async with self._admission:
                            outcome = await self._serve(call)
                    else:
                        outcome = await self._serve(call)
                finally:
                    self.trial.release()
            except ProxyError as error:
                span.set_status(Status(StatusCode.ERROR, error.message))
                span.set_attribute("legorl.error_kind", error.kind)
                if error.kind != "trial_finished":
                    await self.trial.fail(error)
                raise
            finally:
                disconnect.stop()
                self.metrics.add("legorl_proxy_in_flight", -1)
                elapsed = time.perf_counter() - started
                self.metrics.observe("legorl_proxy_request_seconds", elapsed, api_format=api_format.value)
                self.metrics.inc("legorl_proxy_requests_total", api_format=api_format.value, outcome=outcome)

    async def _serve(self, call: _Call) -> str:
        """One call to the engine; returns the outcome label for the metrics."""
        assert self.trial is not None and self.upstream is not None
        if self.settings.admission_kv_usage is not None and self.trial.next_index == 0:
            await self._admit_session()
        started_at = datetime.now(UTC)
        served = Served()
        version_before = await self.upstream.policy_version() if self.upstream.reads_versions else None
        try:
            engine_started = time.perf_counter()
            try:
                with self.tracer.start_as_current_span(
                    "engine chat.completions", kind=SpanKind.CLIENT, attributes=self._trial_attributes
                ):
                    headers = trace_headers() if self._trial_context is not None else None
                    comp = await self._engine(call, headers, served)
            finally:
                self.metrics.observe("legorl_proxy_engine_seconds", time.perf_counter() - engine_started)
            if comp is None:
                return "disconnected"
            if comp.finish_reason == "abort":
                raise ProxyError(
                    "engine_error", "the engine aborted the call (a weight update with pause mode abort?)"
                )
            versions = await self.upstream.call_versions(version_before, served)
            final = _json_bytes(call.fmt.response(call.prepared, comp))
            turn = self.trial.build_turn(
                call.fmt.API_FORMAT,
                comp,
                versions=versions,
                started_at=started_at,
                ttft=call.ttft,
                request_body=call.raw_request.decode(errors="replace"),
                response_body=final.decode(),
            )
            if call.disconnect.gone:
                return "disconnected"  # never acknowledged: the harness will ask again
            with self.tracer.start_as_current_span("journal append"):
                turn = await self.trial.record(turn)
            self.trial.remember_tool_calls(comp.tool_calls)
        except ProxyError as error:
            if not call.headers_sent:
                raise
            # Mid-stream: the status line is gone, so the failure travels as the format's error event.
            assert call.encoder is not None
            await self.trial.fail(error)
            await self._write(call.send, call.encoder.error(error))
            await call.send({"type": "http.response.body", "body": b"", "more_body": False})
            call.span.set_status(Status(StatusCode.ERROR, error.message))
            return "error"
        call.span.set_attributes(
            {
                "legorl.turn": turn.index,
                "legorl.prompt_tokens": turn.prompt_tokens,
                "legorl.completion_tokens": turn.completion_tokens,
                "legorl.finish_reason": turn.finish_reason,
                "legorl.policy_versions": turn.policy_versions,
            }
        )
        if call.ttft is not None:
            call.span.set_attribute("legorl.ttft_seconds", call.ttft)
            self.metrics.observe("legorl_proxy_ttft_seconds", call.ttft)
        await self._reply(call, comp, final)
        return "ok"

    async def _admit_session(self) -> None:
        """Hold a new session while the engine's KV cache is full (see `admission_kv_usage`)."""
        assert self.upstream is not None and self.settings.admission_kv_usage is not None
        started = time.perf_counter()
        deadline = started + self.settings.admission_max_wait_seconds
        while True:
            usage = await self.upstream.kv_cache_usage()
            if usage is None or usage < self.settings.admission_kv_usage:
                break
            if time.perf_counter() >= deadline:
                self.metrics.inc("legorl_proxy_admission_timeouts_total")
                log.warning(
                    "engine KV cache still %.0f%% full after waiting; admitting the session", usage * 100
                )
                break
            await asyncio.sleep(self.settings.admission_poll_seconds)
        self.metrics.observe("legorl_proxy_admission_wait_seconds", time.perf_counter() - started)

    async def _engine(self, call: _Call, headers: dict[str, str] | None, served: Served) -> Completion | None:
        """The engine's whole answer, streaming deltas on to the harness as they come when both
        sides stream; None if the harness went away mid-stream. `headers` go to the engine with
        the call (the trace's `traceparent`); `served` gets what the engine said besides."""
        assert self.upstream is not None
        body = call.prepared.body
        streaming = call.encoder is not None and not self.settings.capture_routed_experts
        body["stream"] = streaming
        if not streaming:
            body.pop("stream_options", None)
            return completion_from_response(await self.upstream.complete(body, headers, served))
        assert call.encoder is not None
        acc = StreamAccumulator()
        async with aclosing(self.upstream.stream(body, headers, served)) as chunks:
            async for batch in chunks:
                out: list[bytes] = []
                for data in batch:
                    events = acc.feed(data)
                    if not call.headers_sent and acc.started:
                        await call.send(
                            {"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS}
                        )
                        out.extend(call.encoder.head(acc.completion))
                        call.headers_sent = True
                    for event in events:
                        if call.ttft is None and isinstance(event, TextDelta | ToolCallStart):
                            call.ttft = time.perf_counter() - call.t0
                        out.extend(call.encoder.event(event))
                # One write per batch the engine sent, whatever it carried.
                await self._write(call.send, out)
                if call.disconnect.gone:
                    # Closing the stream aborts the request in the engine too.
                    return None
        return acc.result()

    async def _reply(self, call: _Call, comp: Completion, final: bytes) -> None:
        """The answer, or the end of the stream, once the turn is durable."""
        if call.encoder is None:
            await call.send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [
                        (b"content-type", b"application/json"),
                        (b"content-length", str(len(final)).encode()),
                    ],
                }
            )
            await call.send({"type": "http.response.body", "body": final})
            return
        out: list[bytes] = []
        if not call.headers_sent:
            # The engine was called unstreamed (routing capture): replay the whole answer as a stream.
            await call.send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
            out.extend(call.encoder.head(comp))
            for event in events_from_completion(comp):
                out.extend(call.encoder.event(event))
        out.extend(call.encoder.tail(comp))
        await call.send({"type": "http.response.body", "body": b"".join(out), "more_body": False})

    @staticmethod
    async def _write(send: Send, chunks: list[bytes]) -> None:
        if chunks:
            await send({"type": "http.response.body", "body": b"".join(chunks), "more_body": True})

    async def _count_tokens(self, request: Request) -> Response:
        assert self.upstream is not None
        _, body = await self._read_json(request.headers, request.receive)
        body = {**body, "max_tokens": body.get("max_tokens") or 1}
        prepared = anthropic.prepare(body, self.settings)
        tokenize: dict[str, Any] = {
            "model": self.settings.served_model_name,
            "messages": prepared.body["messages"],
            "add_generation_prompt": True,
        }
        if "tools" in prepared.body:
            tokenize["tools"] = prepared.body["tools"]
        data = await self.upstream.tokenize(tokenize)
        count = data.get("count")
        if not isinstance(count, int):
            raise ProxyError("engine_error", "the engine's /tokenize answer has no count")
        return _Json({"input_tokens": count})

    # -- everything else -------------------------------------------------------------------------

    async def _models(self, request: Request) -> Response:
        name = self.settings.served_model_name
        if "anthropic-version" in request.headers:
            model: dict[str, Any] = {
                "type": "model",
                "id": name,
                "display_name": name,
                "created_at": "1970-01-01T00:00:00Z",
            }
            return _Json({"data": [model], "has_more": False, "first_id": name, "last_id": name})
        listed: dict[str, Any] = {"id": name, "object": "model", "created": 0, "owned_by": "legorl"}
        return _Json({"object": "list", "data": [listed]})

    async def _probe(self, request: Request) -> Response:
        return Response()

    async def _health(self, request: Request) -> Response:
        return _Json({"status": "ok"})

    async def _ready(self, request: Request) -> Response:
        ready = self.trial is not None
        return _Json({"ready": ready}, 200 if ready else 503)

    async def _metrics(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def _trajectory(self, request: Request) -> Response:
        assert self.trial is not None
        tokens = request.query_params.get("tokens") != "false"
        body = _Json(self.trial.trajectory(tokens=tokens))
        if tokens and self.trial.end is not None:
            self.collected = True  # a draining proxy may stop now (main.serve)
        return body

    async def _turns(self, request: Request) -> Response:
        assert self.trial is not None
        return _Json({"turns": [turn_to_record(t) for t in self.trial.turns]})

    async def _changes(self, request: Request) -> Response:
        """The agent's changes against setup's baseline (read-only mounts; meant for after the
        agent has exited). The change set is read without running anything in the workspace."""
        settings = self.settings
        if not (settings.workspace and settings.baseline):
            raise ProxyError("not_found", "this proxy has no --workspace/--baseline, so no /changes")
        workspace, baseline = Path(settings.workspace), Path(settings.baseline)

        def capture() -> dict[str, Any]:
            return changes.capture(workspace, changes.load_baseline(baseline)).to_dict()

        try:
            result = await asyncio.to_thread(capture)
        except (OSError, ValueError, KeyError) as exc:
            raise ProxyError("proxy_error", f"could not read the workspace's changes: {exc}") from exc
        return _Json(result)

    async def _claim(self, request: Request) -> Response:
        """A warm trial pod's gate: `GET` its state, `POST` open it (idempotent). 200 once the agent has
        its `go`; 202 while the agent is not waiting yet (it gets the line when it comes)."""
        if self.gate is None:
            raise ProxyError("not_found", "this proxy has no --claim-fifo: its pod is not a warm one")
        state = self.gate.claim() if request.method == "POST" else self.gate.state
        body = {"state": state, "claimedAt": self.gate.claimed_at, "releasedAt": self.gate.released_at}
        return _Json(body, 202 if state == "pending" else 200)

    async def _finish(self, request: Request) -> Response:
        assert self.trial is not None
        _, body = await self._read_json(request.headers, request.receive)
        reason = body.get("reason")
        try:
            termination = TerminationReason(str(reason))
        except ValueError:
            allowed = ", ".join(r.value for r in TerminationReason)
            raise ProxyError("invalid_request", f"reason must be one of: {allowed}", param="reason") from None
        exit_code = body.get("exitCode")
        if exit_code is not None and (isinstance(exit_code, bool) or not isinstance(exit_code, int)):
            raise ProxyError("invalid_request", "exitCode must be an integer", param="exitCode")
        detail = body.get("detail")
        if detail is not None and not isinstance(detail, str):
            raise ProxyError("invalid_request", "detail must be a string", param="detail")
        end = await self.trial.finish(termination, detail, exit_code)
        return _Json({"end": end.to_json(), **self.trial.trajectory(tokens=False)})

"""The proxy as harnesses meet it: served by uvicorn, driven by the official SDKs, backed by a fake
vLLM (also under uvicorn) that fails on cue; every answer checked against the journal.

The fake engine is wrapped so the tests know what it really sent (the bytes of each answer, parsed
back into token ids and log-probs), how many calls it had in flight at once, and so that it drops a
request whose client went away, as vLLM does.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import struct
import threading
import time
from collections.abc import Callable, Iterator, MutableMapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anthropic
import httpx
import numpy as np
import numpy.typing as npt
import openai
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from legorl.api.termination import TerminationReason
from legorl.api.trajectory import Segment
from legorl.proxy.app import ProxyApp
from legorl.proxy.journal import read_journal
from legorl.proxy.settings import ProxySettings
from legorl.proxy.testing import FakeEngine, render_prompt
from legorl.telemetry.traces import trial_span_id, trial_trace_id
from legorl.trainer.engine.versions import WeightVersions
from legorl.trialproxy.client import ProxyClient
from tests.support.asgi_server import free_port, serve

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]

TOOLS_CHAT: Any = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a shell command.",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
        },
    }
]
TOOLS_ANTHROPIC: Any = [
    {
        "name": "bash",
        "description": "Run a shell command.",
        "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}},
    }
]
TOOLS_RESPONSES: Any = [
    {
        "type": "function",
        "name": "bash",
        "description": "Run a shell command.",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
        "strict": False,
    }
]
TOOL_ARGUMENTS = {"command": "ls -la"}  # what the fake engine always calls its tool with
LONG = "SAY: " + "the quick brown fox jumps over the lazy dog " * 2


# -- the fake engine, instrumented ----------------------------------------------------------------


@dataclass
class Answer:
    """One chat completion the engine sent, read back from the bytes on the wire."""

    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    completion_logprobs: list[float]
    finish_reason: str | None
    complete: bool
    """A whole JSON body, or a stream that reached `[DONE]`."""
    routed_experts: npt.NDArray[Any] | None = None
    """The routing it attached (see `RecordingEngine.routing`)."""


def parse_answer(raw: bytes) -> Answer | None:
    text = raw.decode(errors="replace")
    if text.startswith("data:"):
        answer = Answer([], [], [], None, complete=False)
        for line in text.splitlines():
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                answer.complete = True
                continue
            chunk = json.loads(payload)
            if chunk.get("prompt_token_ids") is not None:
                answer.prompt_token_ids = chunk["prompt_token_ids"]
            for choice in chunk.get("choices") or []:
                answer.completion_token_ids += choice.get("token_ids") or []
                entries = (choice.get("logprobs") or {}).get("content") or []
                answer.completion_logprobs += [e["logprob"] for e in entries]
                answer.finish_reason = choice.get("finish_reason") or answer.finish_reason
        return answer
    try:
        body = json.loads(text)
    except ValueError:
        return None
    choice = body["choices"][0]
    routing = choice.get("routed_experts")
    return Answer(
        body["prompt_token_ids"],
        choice["token_ids"],
        [e["logprob"] for e in choice["logprobs"]["content"]],
        choice["finish_reason"],
        complete=True,
        routed_experts=decode_routing(routing) if routing else None,
    )


def encode_routing(rows: int, layers: int, top_k: int) -> str:
    """vLLM's routed experts for a sequence: base64 of a `.npy` (tokens - 1, layers, top_k)."""
    array = (np.arange(rows * layers * top_k, dtype=np.int32) * 7 % 61).reshape(rows, layers, top_k)
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode()


def decode_routing(encoded: str) -> Any:
    return np.load(io.BytesIO(base64.b64decode(encoded)), allow_pickle=False)


class RecordingEngine:
    """`FakeEngine` plus a record of what it answered; a chat call whose client disconnects is
    cancelled (vLLM aborts such requests), so a hung call never outlives the test's server. One
    more marker: `REFUSE` gets vLLM's 400 for a request it will not serve (not an overflow)."""

    def __init__(self, **kwargs: Any) -> None:
        self.fake = FakeEngine(**kwargs)
        self.inner: Any = self.fake
        """What serves: the fake, or the fake behind legorl's weight-versions middleware (as vLLM is)."""
        self.answers: list[Answer] = []
        self.paths: list[str] = []
        self.headers: list[dict[str, str]] = []
        """Request headers of each chat call (the trace's `traceparent`)."""
        self.in_flight = 0
        self.max_in_flight = 0
        self.aborted = 0
        self.routing: tuple[int, int] | None = None
        """(layers, top_k): attach routed experts to whole answers, as vLLM's
        `--enable-return-routed-experts` does."""
        self.garbage_tokenize = False
        """Answer `/tokenize` with a 200 that is not JSON."""

    def reset(
        self, *, chunk_tokens: int = 4, delay_per_chunk: float = 0.0, names_versions: bool = False
    ) -> None:
        """A clean slate for the next test (the engine is served once per module). `names_versions`:
        put the real `WeightVersions` middleware in front of the fake, reading the fake's version."""
        self.fake.chunk_tokens, self.fake.delay_per_chunk = chunk_tokens, delay_per_chunk
        self.inner = (
            WeightVersions(self.fake, read_version=self._fake_version) if names_versions else self.fake
        )
        self.fake.version, self.fake.unavailable, self.fake.kv_usage = "0", 0, 0.0
        self.fake.requests.clear()
        self.answers.clear()
        self.paths.clear()
        self.headers.clear()
        self.max_in_flight = self.in_flight
        self.aborted = 0
        self.routing = None
        self.garbage_tokenize = False

    async def _fake_version(self, scope: Scope) -> str:
        return self.fake.version

    @property
    def good_answers(self) -> list[Answer]:
        return [a for a in self.answers if a.complete]

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.inner(scope, receive, send)
            return
        self.paths.append(scope["path"])
        if scope["path"] == "/tokenize" and self.garbage_tokenize:
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"<html>busy</html>"})
            return
        if scope["path"] != "/v1/chat/completions":
            await self.inner(scope, receive, send)
            return
        self.headers.append({k.decode().lower(): v.decode() for k, v in scope.get("headers", [])})
        received: list[Message] = []
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            received.append(message)
            if not message.get("more_body"):
                break
        replay = iter(received)
        request = json.loads(b"".join(m.get("body", b"") for m in received) or b"{}")
        if "REFUSE" in json.dumps(request.get("messages", [])[-1:]):
            # vLLM's 400 for a request it will not serve that is no overflow.
            error = {"message": "tool_choice names a tool that is not in tools", "type": "BadRequestError"}
            await FakeEngine._json(send, 400, {"error": {**error, "code": 400}})
            return
        routing = self.routing if not request.get("stream") else None
        status = 0
        body = bytearray()
        done = False

        async def inner_receive() -> Message:
            with contextlib.suppress(StopIteration):
                return next(replay)
            await asyncio.Event().wait()  # the fake never asks again; block like a live request
            raise AssertionError("unreachable")

        async def inner_send(message: Message) -> None:
            nonlocal status, done
            if message["type"] == "http.response.start":
                status = message["status"]
                if routing is not None and status == 200:
                    return  # sent with the body, once the routing is attached
            else:
                body.extend(message.get("body", b""))
                done = not message.get("more_body", False)
                if routing is not None and status == 200:
                    if done:
                        await send_with_routing(json.loads(bytes(body)), *routing)
                    return
            await send(message)

        async def send_with_routing(answer: dict[str, Any], layers: int, top_k: int) -> None:
            choice = answer["choices"][0]
            rows = len(answer["prompt_token_ids"]) + len(choice["token_ids"]) - 1
            choice["routed_experts"] = encode_routing(rows, layers, top_k)
            data = json.dumps(answer).encode()
            body[:] = data
            headers = [(b"content-type", b"application/json")]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": data})

        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        task = asyncio.ensure_future(self.inner(scope, inner_receive, inner_send))
        watcher = asyncio.ensure_future(receive())
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not task.done() and not done:
                self.aborted += 1
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        finally:
            self.in_flight -= 1
            watcher.cancel()
        if status == 200:
            answer = parse_answer(bytes(body))
            if answer is not None:
                self.answers.append(answer)


@dataclass
class Engine:
    app: RecordingEngine
    url: str

    def post(self, path: str, body: dict[str, Any]) -> None:
        with httpx.Client(verify=False) as client:  # plain HTTP on loopback: no CA bundle to load
            client.post(self.url + path, json=body).raise_for_status()


@contextmanager
def engine_served(**kwargs: Any) -> Iterator[Engine]:
    app = RecordingEngine(**kwargs)
    with serve(app) as url:
        yield Engine(app, url)


# -- the proxy under test -------------------------------------------------------------------------


@dataclass
class Stack:
    """One proxy, its engine, and SDK clients pointed at it."""

    url: str
    app: ProxyApp
    engine: Engine
    journal: Path
    turns_before: int = 0
    """Turns journaled before the current test (a proxy shared by several tests)."""
    oai: openai.OpenAI = field(init=False)
    anth: anthropic.Anthropic = field(init=False)
    http: httpx.Client = field(init=False)

    def __post_init__(self) -> None:
        # No SDK retries: each test decides what one call sees. Plain HTTP on loopback, so the
        # clients skip loading a CA bundle (a tenth of a second each).
        self.oai = openai.OpenAI(
            base_url=f"{self.url}/v1",
            api_key="sk-test",
            max_retries=0,
            timeout=30,
            http_client=openai.DefaultHttpxClient(verify=False),
        )
        self.anth = anthropic.Anthropic(
            base_url=self.url,
            api_key="sk-test",
            max_retries=0,
            timeout=30,
            http_client=anthropic.DefaultHttpxClient(verify=False),
        )
        self.http = httpx.Client(base_url=self.url, timeout=30, verify=False)

    def close(self) -> None:
        self.oai.close()
        self.anth.close()
        self.http.close()

    def trajectory(self) -> dict[str, Any]:
        response = self.http.get("/trajectory")
        assert response.status_code == 200
        body: dict[str, Any] = response.json()
        return body

    def metrics(self) -> str:
        return self.http.get("/metrics").text

    def finish(self, reason: str, **extra: Any) -> httpx.Response:
        return self.http.post("/finish", json={"reason": reason, **extra})


@contextmanager
def proxy_served(
    engine: Engine, journal: Path, *, tracer_provider: TracerProvider | None = None, **settings: Any
) -> Iterator[Stack]:
    upstream = settings.pop("upstream", engine.url)
    app = ProxyApp(
        ProxySettings(upstream=upstream, journal=journal, **settings), tracer_provider=tracer_provider
    )
    with serve(app) as url:
        stack = Stack(url, app, engine, journal)
        try:
            yield stack
        finally:
            stack.close()


MakeStack = Callable[..., Stack]


@pytest.fixture(scope="module")
def shared_engine() -> Iterator[Engine]:
    with engine_served() as engine:
        yield engine


@pytest.fixture
def engine(shared_engine: Engine) -> Engine:
    shared_engine.app.reset()
    return shared_engine


@pytest.fixture
def make_stack(tmp_path: Path, engine: Engine) -> Iterator[MakeStack]:
    """`make_stack(engine=..., engine_options={}, **settings)`: a proxy on a fresh journal, in
    front of the module's engine (reset, then given `engine_options`) unless told another."""
    with ExitStack() as exits:
        count = 0

        def make(
            *,
            engine: Engine = engine,
            engine_options: dict[str, Any] | None = None,
            tracer_provider: TracerProvider | None = None,
            **settings: Any,
        ) -> Stack:
            nonlocal count
            count += 1
            if engine_options is not None:
                engine.app.reset(**engine_options)
            journal = tmp_path / f"journal-{count}"
            return exits.enter_context(
                proxy_served(engine, journal, tracer_provider=tracer_provider, **settings)
            )

        yield make


@pytest.fixture
def stack(make_stack: MakeStack) -> Stack:
    return make_stack()


@pytest.fixture(scope="module")
def shared_stacks(shared_engine: Engine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[MakeStack]:
    """Proxies kept for the module, one per settings, started when first asked for."""
    with ExitStack() as exits:
        cache: dict[tuple[tuple[str, Any], ...], Stack] = {}

        def get(**settings: Any) -> Stack:
            key = tuple(sorted(settings.items()))
            if key not in cache:
                journal = tmp_path_factory.mktemp("shared") / "journal"
                cache[key] = exits.enter_context(proxy_served(shared_engine, journal, **settings))
            return cache[key]

        yield get


@pytest.fixture
def make_shared(shared_stacks: MakeStack, engine: Engine) -> MakeStack:
    """`make_shared(**settings)`: a proxy shared by the tests that leave its trial running (one
    per test costs a server start and stop); each test sees the engine reset and checks only the
    turns it added (`Stack.turns_before`)."""

    def make(**settings: Any) -> Stack:
        stack = shared_stacks(**settings)
        stack.turns_before = len(journal_turns(stack.journal))
        assert stack.trajectory()["state"] == "running"
        return stack

    return make


@pytest.fixture
def shared(make_shared: MakeStack) -> Stack:
    return make_shared()


def journal_turns(directory: Path) -> list[dict[str, Any]]:
    """The turn records of a journal, which must have no torn bytes."""
    recovered = read_journal(directory)
    assert recovered.dropped_bytes == 0
    return [r for r in recovered.records if r["type"] == "turn"]


def tokens(record: dict[str, Any] | Answer) -> tuple[list[int], list[int], list[float]]:
    if isinstance(record, Answer):
        return record.prompt_token_ids, record.completion_token_ids, record.completion_logprobs
    return record["prompt_token_ids"], record["completion_token_ids"], record["completion_logprobs"]


def assert_journal_matches_engine(stack: Stack) -> list[dict[str, Any]]:
    """The test's turns in the journal = in GET /turns = the engine's complete answers during the
    test, token for token, in order; returns them."""
    everything = journal_turns(stack.journal)
    assert [t["index"] for t in everything] == list(range(len(everything)))
    on_disk = everything[stack.turns_before :]
    served = stack.http.get("/turns").json()["turns"][stack.turns_before :]
    answers = stack.engine.app.good_answers
    assert [tokens(t) for t in on_disk] == [tokens(a) for a in answers]
    assert [tokens(t) for t in served] == [tokens(a) for a in answers]
    assert [t["finish_reason"] for t in on_disk] == [a.finish_reason for a in answers]
    return on_disk


def metric(text: str, name: str, **labels: str) -> float:
    """One sample of the Prometheus text (0 when absent)."""
    inner = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    wanted = f"{name}{{{inner}}}" if labels else name
    for line in text.splitlines():
        key, _, value = line.rpartition(" ")
        if key == wanted:
            return float(value)
    return 0.0


def wait_for(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)


# -- one call per format through its SDK ----------------------------------------------------------


@dataclass
class Reply:
    text: str
    tool_calls: list[tuple[str, dict[str, Any]]]
    """(name, parsed arguments) per tool call."""
    stop: str
    """The format's own finish / stop reason / status."""
    usage: tuple[int, int]
    """(prompt, completion) tokens as the client was told."""


def chat_call(stack: Stack, text: str, *, stream: bool = False, **kwargs: Any) -> Reply:
    messages: Any = kwargs.pop("messages", [{"role": "user", "content": text}])
    if not stream:
        done = stack.oai.chat.completions.create(model="gpt-test", messages=messages, **kwargs)
        choice = done.choices[0]
        calls = [
            (c.function.name, json.loads(c.function.arguments))
            for c in choice.message.tool_calls or []
            if c.type == "function"
        ]
        assert done.usage is not None
        usage = (done.usage.prompt_tokens, done.usage.completion_tokens)
        return Reply(choice.message.content or "", calls, choice.finish_reason, usage)
    chunks = stack.oai.chat.completions.create(
        model="gpt-test", messages=messages, stream=True, stream_options={"include_usage": True}, **kwargs
    )
    out, finish, told = "", "", None
    args: dict[int, list[str]] = {}
    for chunk in chunks:
        told = chunk.usage or told
        for choice in chunk.choices:
            out += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                entry = args.setdefault(call.index, ["", ""])
                if call.function and call.function.name:
                    entry[0] = call.function.name
                if call.function and call.function.arguments:
                    entry[1] += call.function.arguments
            finish = choice.finish_reason or finish
    assert told is not None, "include_usage asked for a usage chunk"
    calls = [(n, json.loads(a)) for n, a in args.values()]
    return Reply(out, calls, finish, (told.prompt_tokens, told.completion_tokens))


def anthropic_call(stack: Stack, text: str, *, stream: bool = False, **kwargs: Any) -> Reply:
    messages: Any = kwargs.pop("messages", [{"role": "user", "content": text}])
    kwargs.setdefault("max_tokens", 256)
    if stream:
        with stack.anth.messages.stream(model="claude-test", messages=messages, **kwargs) as events:
            message = events.get_final_message()
    else:
        message = stack.anth.messages.create(model="claude-test", messages=messages, **kwargs)
    out = "".join(b.text for b in message.content if b.type == "text")
    calls = [(b.name, dict(b.input)) for b in message.content if b.type == "tool_use"]
    usage = (message.usage.input_tokens, message.usage.output_tokens)
    return Reply(out, calls, str(message.stop_reason), usage)


def responses_call(stack: Stack, text: str, *, stream: bool = False, **kwargs: Any) -> Reply:
    given: Any = kwargs.pop("input", text)
    if stream:
        events = list(stack.oai.responses.create(model="gpt-test", input=given, stream=True, **kwargs))
        kinds = [e.type for e in events]
        assert kinds[:2] == ["response.created", "response.in_progress"], kinds
        assert [e.sequence_number for e in events] == list(range(len(events)))
        last = events[-1]
        assert last.type == "response.completed", kinds
        response = last.response
    else:
        response = stack.oai.responses.create(model="gpt-test", input=given, **kwargs)
    calls = [(o.name, json.loads(o.arguments)) for o in response.output if o.type == "function_call"]
    assert response.usage is not None
    usage = (response.usage.input_tokens, response.usage.output_tokens)
    return Reply(response.output_text, calls, str(response.status), usage)


CALLS: dict[str, Callable[..., Reply]] = {
    "chat": chat_call,
    "anthropic": anthropic_call,
    "responses": responses_call,
}
FORMATS = list(CALLS)


# -- each format, streaming and not, with and without tools ----------------------------------------


@pytest.mark.parametrize("tools", [False, True], ids=["text", "tools"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_chat_completions(shared: Stack, stream: bool, tools: bool) -> None:
    stack = shared
    prompt = "CALL_TOOL please" if tools else "SAY: hello there"
    messages: list[Any] = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": prompt}, {"type": "text", "text": "!"}]},
    ]
    extra: dict[str, Any] = {"tools": TOOLS_CHAT} if tools else {}
    reply = chat_call(
        stack, "", stream=stream, messages=messages, stop=["\n\n"], temperature=0.7, top_p=0.9, **extra
    )
    if tools:
        assert (reply.text, reply.tool_calls, reply.stop) == ("", [("bash", TOOL_ARGUMENTS)], "tool_calls")
    else:
        assert (reply.text, reply.tool_calls, reply.stop) == ("hello there!", [], "stop")
    sent = stack.engine.app.fake.requests[-1]
    assert sent["messages"] == messages
    assert (sent["stop"], sent["temperature"], sent["top_p"]) == (["\n\n"], 0.7, 0.9)
    assert sent["logprobs"] is True and sent["return_token_ids"] is True
    assert sent["stream"] is stream
    assert ("tools" in sent) is tools
    [turn] = assert_journal_matches_engine(stack)
    assert reply.usage == (len(turn["prompt_token_ids"]), len(turn["completion_token_ids"]))
    assert turn["api_format"] == "openai_chat"
    assert turn["prompt_token_ids"] == render_prompt(messages)


@pytest.mark.parametrize("tools", [False, True], ids=["text", "tools"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_anthropic_messages(shared: Stack, stream: bool, tools: bool) -> None:
    stack = shared
    prompt = "CALL_TOOL please" if tools else "SAY: hello there"
    # Claude Code's shape: system as text blocks with cache_control, content as a list of blocks.
    system: Any = [
        {"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": "Really."},
    ]
    messages: Any = [
        {"role": "user", "content": [{"type": "text", "text": prompt}, {"type": "text", "text": "!"}]}
    ]
    extra: dict[str, Any] = {"tools": TOOLS_ANTHROPIC} if tools else {}
    reply = anthropic_call(
        stack,
        "",
        stream=stream,
        messages=messages,
        system=system,
        stop_sequences=["\n\nHuman:"],
        # This SDK has no sampling keywords any more; harnesses still send them.
        extra_body={"temperature": 0.5, "top_p": 0.8},
        **extra,
    )
    if tools:
        assert (reply.text, reply.tool_calls, reply.stop) == ("", [("bash", TOOL_ARGUMENTS)], "tool_use")
    else:
        assert (reply.text, reply.tool_calls, reply.stop) == ("hello there\n!", [], "end_turn")
    sent = stack.engine.app.fake.requests[-1]
    assert sent["messages"] == [
        {"role": "system", "content": "You are terse.\nReally."},
        {"role": "user", "content": f"{prompt}\n!"},
    ]
    assert (sent["stop"], sent["temperature"], sent["top_p"], sent["max_tokens"]) == (
        ["\n\nHuman:"],
        0.5,
        0.8,
        256,
    )
    if tools:
        assert sent["tools"] == [
            {
                "type": "function",
                "function": {
                    "name": "bash",
                    "description": "Run a shell command.",
                    "parameters": TOOLS_ANTHROPIC[0]["input_schema"],
                },
            }
        ]
    [turn] = assert_journal_matches_engine(stack)
    assert reply.usage == (len(turn["prompt_token_ids"]), len(turn["completion_token_ids"]))
    assert turn["api_format"] == "anthropic_messages"


@pytest.mark.parametrize("tools", [False, True], ids=["text", "tools"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_responses(shared: Stack, stream: bool, tools: bool) -> None:
    stack = shared
    prompt = "CALL_TOOL please" if tools else "SAY: hello there"
    # Codex's shape: the system prompt as a developer item, content as input_text parts.
    given: Any = [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be terse."}]},
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": prompt}, {"type": "input_text", "text": "!"}],
        },
    ]
    extra: dict[str, Any] = {"tools": TOOLS_RESPONSES} if tools else {}
    reply = responses_call(
        stack,
        "",
        stream=stream,
        input=given,
        instructions="Instructions.",
        temperature=0.3,
        top_p=0.7,
        **extra,
    )
    if tools:
        assert (reply.text, reply.tool_calls, reply.stop) == ("", [("bash", TOOL_ARGUMENTS)], "completed")
    else:
        assert (reply.text, reply.tool_calls, reply.stop) == ("hello there\n!", [], "completed")
    sent = stack.engine.app.fake.requests[-1]
    assert sent["messages"] == [
        # The instructions and the developer item: leading system messages, joined into one.
        {"role": "system", "content": "Instructions.\n\nBe terse."},
        {"role": "user", "content": f"{prompt}\n!"},
    ]
    assert (sent["temperature"], sent["top_p"]) == (0.3, 0.7)
    [turn] = assert_journal_matches_engine(stack)
    assert reply.usage == (len(turn["prompt_token_ids"]), len(turn["completion_token_ids"]))
    assert turn["api_format"] == "openai_responses"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_max_tokens_cuts_the_answer(shared: Stack, fmt: str, stream: bool) -> None:
    stack = shared
    limit = {"chat": {"max_tokens": 5}, "anthropic": {"max_tokens": 5}, "responses": {"max_output_tokens": 5}}
    reply = CALLS[fmt](stack, LONG, stream=stream, **limit[fmt])
    expected_stop = {"chat": "length", "anthropic": "max_tokens", "responses": "incomplete"}[fmt]
    assert reply.stop == expected_stop
    assert reply.text == LONG.removeprefix("SAY: ")[:5]
    assert stack.engine.app.fake.requests[-1]["max_tokens"] == 5
    [turn] = assert_journal_matches_engine(stack)
    assert turn["finish_reason"] == "length"
    assert reply.usage == (len(turn["prompt_token_ids"]), 5)


def test_responses_reports_why_it_is_incomplete(shared: Stack) -> None:
    stack = shared
    response = stack.oai.responses.create(model="gpt-test", input=LONG, max_output_tokens=5)
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"


def test_proxy_sampling_settings_win_over_the_harness(make_stack: MakeStack) -> None:
    stack = make_stack(temperature=1.0, top_p=1.0, max_tokens=8)
    chat_call(stack, "SAY: hi", temperature=0.1, top_p=0.2, max_tokens=100)
    sent = stack.engine.app.fake.requests[-1]
    assert (sent["temperature"], sent["top_p"], sent["max_tokens"]) == (1.0, 1.0, 8)


# -- trajectories: segments, merges, ends ----------------------------------------------------------


def _chat_conversation(stack: Stack) -> None:
    history: list[dict[str, Any]] = [{"role": "system", "content": "Be terse."}]
    for i in range(3):
        history.append({"role": "user", "content": f"SAY: reply {i}"})
        reply = chat_call(stack, "", messages=list(history))
        history.append({"role": "assistant", "content": reply.text})


def _anthropic_conversation(stack: Stack) -> None:
    history: list[Any] = [{"role": "user", "content": "CALL_TOOL"}]
    for i in range(2):
        message = stack.anth.messages.create(
            model="claude-test", max_tokens=100, messages=list(history), tools=TOOLS_ANTHROPIC
        )
        [use] = [b for b in message.content if b.type == "tool_use"]
        history.append(
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in message.content]}
        )
        history.append(
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": use.id, "content": f"file{i}"},
                    {"type": "text", "text": "CALL_TOOL"},
                ],
            }
        )
    anthropic_call(stack, "", messages=history)


def _responses_conversation(stack: Stack) -> None:
    items: list[Any] = [{"role": "user", "content": "CALL_TOOL"}]
    for i in range(2):
        response = stack.oai.responses.create(model="gpt-test", input=items, tools=TOOLS_RESPONSES)
        [call] = [o for o in response.output if o.type == "function_call"]
        items.append(
            {
                "type": "function_call",
                "id": call.id,
                "call_id": call.call_id,
                "name": call.name,
                "arguments": call.arguments,
            }
        )
        items.append({"type": "function_call_output", "call_id": call.call_id, "output": f"file{i}"})
        items.append({"role": "user", "content": "CALL_TOOL"})
    responses_call(stack, "", input=items)


@pytest.mark.parametrize(
    ("sent_back", "merges"),
    [
        ('{"command":"ls -la"}', True),  # OpenCode's re-serialisation: the same JSON, other spacing
        ('{\n  "command": "ls -la"\n}', True),
        ('{"command":"ls"}', False),  # another value: sent as the harness wrote it, a new segment
        ("not json", False),
    ],
    ids=["compact", "indented", "other-value", "not-json"],
)
def test_tool_calls_sent_back_re_serialised_still_merge(stack: Stack, sent_back: str, merges: bool) -> None:
    first = stack.oai.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "CALL_TOOL"}], tools=TOOLS_CHAT
    )
    [call] = first.choices[0].message.tool_calls or []
    assert call.type == "function"
    assert call.function.arguments == json.dumps(TOOL_ARGUMENTS)  # the engine's own spelling
    history: Any = [
        {"role": "user", "content": "CALL_TOOL"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": call.id, "type": "function", "function": {"name": "bash", "arguments": sent_back}}
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "a.py"},
        {"role": "user", "content": "SAY: done"},
    ]
    stack.oai.chat.completions.create(model="m", messages=history, tools=TOOLS_CHAT)
    sent = stack.engine.app.fake.requests[-1]["messages"][1]["tool_calls"][0]["function"]["arguments"]
    assert sent == (call.function.arguments if merges else sent_back)
    trajectory = stack.trajectory()
    assert (trajectory["mergedTurnShare"], len(trajectory["segments"])) == ((1.0, 1) if merges else (0.0, 2))
    restored = metric(stack.metrics(), "legorl_proxy_tool_arguments_restored_total")
    assert restored == (1 if merges else 0)
    assert_journal_matches_engine(stack)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_conversation_merges_into_one_segment(stack: Stack, fmt: str) -> None:
    {"chat": _chat_conversation, "anthropic": _anthropic_conversation, "responses": _responses_conversation}[
        fmt
    ](stack)
    turns = assert_journal_matches_engine(stack)
    assert len(turns) == 3
    trajectory = stack.trajectory()
    assert trajectory["turns"] == 3
    assert trajectory["mergedTurnShare"] == 1.0
    [segment] = trajectory["segments"]
    assert segment["turn_indices"] == [0, 1, 2]
    last = turns[-1]
    assert segment["token_ids"] == last["prompt_token_ids"] + last["completion_token_ids"]
    # Sampled tokens are in the loss with their log-probs; everything else is not.
    sampled = {
        len(t["prompt_token_ids"]) + i: lp for t in turns for i, lp in enumerate(t["completion_logprobs"])
    }
    assert segment["loss_mask"] == [int(i in sampled) for i in range(len(segment["token_ids"]))]
    assert segment["behavior_logprobs"] == [sampled.get(i, 0.0) for i in range(len(segment["token_ids"]))]
    assert stack.http.get("/trajectory?tokens=false").json()["segments"] == 1


def test_a_rewritten_history_starts_a_new_segment(stack: Stack) -> None:
    first = chat_call(stack, "SAY: one")
    chat_call(
        stack,
        "",
        messages=[
            {"role": "user", "content": "SAY: one"},
            {"role": "assistant", "content": first.text},
            {"role": "user", "content": "SAY: two"},
        ],
    )
    # A compacting harness rewrites what came before.
    chat_call(
        stack,
        "",
        messages=[
            {"role": "user", "content": "(summary of the conversation)"},
            {"role": "user", "content": "SAY: three"},
        ],
    )
    assert_journal_matches_engine(stack)
    trajectory = stack.trajectory()
    assert trajectory["mergedTurnShare"] == 0.5
    assert [s["turn_indices"] for s in trajectory["segments"]] == [[0, 1], [2]]
    assert trajectory["finishReasons"] == {"stop": 3}
    assert trajectory["state"] == "running" and trajectory["end"] is None


def test_finish_records_the_harness_exit(stack: Stack) -> None:
    chat_call(stack, "SAY: done")
    response = stack.finish("completed", exitCode=0, detail="all tests pass")
    assert response.status_code == 200
    body = response.json()
    assert body["end"]["reason"] == "completed"
    assert body["end"]["source"] == "harness"
    assert (body["end"]["exitCode"], body["end"]["detail"]) == (0, "all tests pass")
    assert body["state"] == "ended" and body["turns"] == 1
    assert stack.trajectory()["end"] == body["end"]
    # A second exit (a wrapper script reporting too) keeps the first.
    again = stack.finish("agent_error", exitCode=1)
    assert again.status_code == 200
    assert again.json()["end"] == body["end"]


def test_the_trial_backends_client_reads_the_proxys_answers_as_the_typed_summary(stack: Stack) -> None:
    """`ProxyClient` (both trial backends) decodes `/finish` and `/trajectory` into `TrajectorySummary`,
    which encodes back to exactly what the proxy sent."""
    chat_call(stack, "SAY: done")
    client = ProxyClient(stack.http, stack.url)
    ended = client.finish(TerminationReason.AGENT_ERROR, 1, "harness exit code 1")
    assert ended.end is not None
    assert (ended.end.reason, ended.end.source, ended.end.exit_code) == (
        TerminationReason.AGENT_ERROR,
        "harness",
        1,
    )
    assert (ended.state, ended.turns, ended.segments) == ("ended", 1, 1)  # no tokens in /finish's answer
    summary = client.trajectory()
    assert summary.end == ended.end
    assert [s.turn_indices for s in summary.segment_list] == [[0]]
    assert summary.to_json() == stack.trajectory()
    assert client.trajectory(tokens=False).segments == 1
    records = read_journal(stack.journal).records
    assert [r["type"] for r in records] == ["turn", "end"]
    # The trial is over: a further call is refused in the client's format.
    with pytest.raises(openai.ConflictError) as info:
        chat_call(stack, "SAY: more")
    assert info.value.code == "trial_finished"
    assert_journal_matches_engine(stack)


@pytest.mark.parametrize(
    ("exit_reason", "recorded"),
    [("agent_error", "context_overflow"), ("agent_timeout", "context_overflow"), ("completed", "completed")],
)
def test_an_exit_right_after_an_overflow_is_a_context_overflow(
    stack: Stack, exit_reason: str, recorded: str
) -> None:
    chat_call(stack, "SAY: fine")
    with pytest.raises(openai.BadRequestError):
        chat_call(stack, "OVERFLOW")
    end = stack.finish(exit_reason, exitCode=1).json()["end"]
    assert end["reason"] == recorded
    assert end["source"] == "harness"


def test_an_overflow_followed_by_a_good_call_is_not_blamed(stack: Stack) -> None:
    with pytest.raises(openai.BadRequestError):
        chat_call(stack, "OVERFLOW")
    chat_call(stack, "SAY: recovered")
    assert stack.finish("agent_error").json()["end"]["reason"] == "agent_error"


@pytest.mark.parametrize(
    "body",
    [
        {"reason": "exploded"},
        {},
        {"reason": None},
        {"reason": "completed", "exitCode": "0"},
        {"reason": "completed", "exitCode": True},
        {"reason": "completed", "detail": 3},
    ],
    ids=["unknown", "missing", "null", "exit-code-string", "exit-code-bool", "detail-number"],
)
def test_finish_refuses_a_bad_body(shared: Stack, body: dict[str, Any]) -> None:
    stack = shared
    journaled = len(read_journal(stack.journal).records)
    response = stack.http.post("/finish", json=body)
    error = assert_openai_error(response, 400, "invalid_request")
    assert error["param"] == (
        "detail" if "detail" in body else "exitCode" if "exitCode" in body else "reason"
    )
    assert stack.trajectory()["state"] == "running"
    assert len(read_journal(stack.journal).records) == journaled


# -- errors, in the client's own format -----------------------------------------------------------


def assert_openai_error(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert set(body) == {"error"}
    error: dict[str, Any] = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["code"] == code
    return error


def assert_anthropic_error(response: httpx.Response, status: int, kind: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert body["type"] == "error" and set(body) == {"type", "error"}
    error: dict[str, Any] = body["error"]
    assert error["type"] == kind
    assert isinstance(error["message"], str) and error["message"]
    return error


GOOD: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"model": "m", "messages": [{"role": "user", "content": "SAY: hi"}]},
    "/v1/responses": {"model": "m", "input": "SAY: hi"},
    "/v1/messages": {"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "SAY: hi"}]},
}

BAD_REQUESTS: list[tuple[str, Any, str | None]] = [
    # (route, body: bytes as they are or a JSON value, the param an OpenAI error names)
    ("/v1/chat/completions", b'{"model": "m", "messages": [', None),
    ("/v1/chat/completions", b"\xff\xfe not utf-8", None),
    ("/v1/chat/completions", b"", None),
    *(
        (  # found by test_proxy_fuzz: a 500 ("'int' object is not iterable") before
            "/v1/chat/completions",
            {
                **GOOD["/v1/chat/completions"],
                "messages": [
                    {"role": "user", "content": "List files."},
                    {"role": "assistant", "content": None, "tool_calls": calls},
                    {"role": "user", "content": "Go on."},
                ],
            },
            "messages[1].tool_calls",
        )
        for calls in (
            -1,
            "bash",
            [5],
            [{"id": "c1", "type": "function"}],
            [{"id": ["c1"], "type": "function", "function": {"name": "bash", "arguments": "{}"}}],
        )
    ),
    ("/v1/chat/completions", [GOOD["/v1/chat/completions"]], None),
    ("/v1/chat/completions", {**GOOD["/v1/chat/completions"], "max_tokens": "ten"}, "max_tokens"),
    ("/v1/chat/completions", {**GOOD["/v1/chat/completions"], "max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", {**GOOD["/v1/chat/completions"], "messages": "SAY: hi"}, "messages"),
    ("/v1/chat/completions", {**GOOD["/v1/chat/completions"], "messages": []}, "messages"),
    ("/v1/chat/completions", {**GOOD["/v1/chat/completions"], "messages": [{"content": "x"}]}, "messages[0]"),
    ("/v1/chat/completions", {**GOOD["/v1/chat/completions"], "stream": "yes"}, "stream"),
    ("/v1/chat/completions", {**GOOD["/v1/chat/completions"], "temperature": 9}, "temperature"),
    ("/v1/chat/completions", {**GOOD["/v1/chat/completions"], "n": 2}, "n"),
    ("/v1/chat/completions", {"messages": GOOD["/v1/chat/completions"]["messages"]}, "model"),
    (
        "/v1/chat/completions",
        {
            **GOOD["/v1/chat/completions"],
            "tools": [{"type": "function", "function": {"name": "x", "parameters": "s"}}],
        },
        "tools[0]",
    ),
    ("/v1/chat/completions", {**GOOD["/v1/chat/completions"], "tools": [{"type": "function"}]}, "tools[0]"),
    ("/v1/chat/completions", {**GOOD["/v1/chat/completions"], "tools": {"bash": {}}}, "tools"),
    ("/v1/responses", b"{", None),
    ("/v1/responses", ["SAY: hi"], None),
    ("/v1/responses", {**GOOD["/v1/responses"], "max_output_tokens": "ten"}, "max_output_tokens"),
    ("/v1/responses", {**GOOD["/v1/responses"], "input": 5}, "input"),
    ("/v1/responses", {**GOOD["/v1/responses"], "input": [{"role": "robot", "content": "x"}]}, "input[0]"),
    ("/v1/responses", {**GOOD["/v1/responses"], "stream": "yes"}, "stream"),
    ("/v1/responses", {**GOOD["/v1/responses"], "instructions": ["x"]}, "instructions"),
    ("/v1/responses", {**GOOD["/v1/responses"], "previous_response_id": "resp_1"}, "previous_response_id"),
    (
        "/v1/responses",
        {**GOOD["/v1/responses"], "tools": [{"type": "function", "parameters": {}}]},
        "tools[0]",
    ),
    ("/v1/messages", b"{oops}", None),
    ("/v1/messages", 42, None),
    ("/v1/messages", {k: v for k, v in GOOD["/v1/messages"].items() if k != "max_tokens"}, None),
    ("/v1/messages", {**GOOD["/v1/messages"], "max_tokens": "ten"}, None),
    ("/v1/messages", {**GOOD["/v1/messages"], "messages": {"role": "user"}}, None),
    ("/v1/messages", {**GOOD["/v1/messages"], "messages": [{"role": "user", "content": 5}]}, None),
    ("/v1/messages", {**GOOD["/v1/messages"], "stream": "yes"}, None),
    ("/v1/messages", {**GOOD["/v1/messages"], "system": {"text": "x"}}, None),
    ("/v1/messages", {**GOOD["/v1/messages"], "tools": [{"name": "bash"}]}, None),
    ("/v1/messages", {**GOOD["/v1/messages"], "tools": [{"name": "bash", "input_schema": []}]}, None),
    ("/v1/messages", {**GOOD["/v1/messages"], "tools": [{"name": "", "input_schema": {}}]}, None),
    (
        "/v1/messages",
        {**GOOD["/v1/messages"], "tools": TOOLS_ANTHROPIC, "tool_choice": {"type": "sometimes"}},
        None,
    ),
]


@pytest.mark.parametrize(("route", "body", "param"), BAD_REQUESTS)
def test_a_bad_request_is_a_400_in_the_client_format(
    shared: Stack, route: str, body: Any, param: str | None
) -> None:
    stack = shared
    engine_calls = len(stack.engine.app.paths)
    journaled = len(read_journal(stack.journal).records)
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = stack.http.post(route, content=content, headers={"content-type": "application/json"})
    if route == "/v1/messages":
        assert_anthropic_error(response, 400, "invalid_request_error")
    else:
        error = assert_openai_error(response, 400, "invalid_request")
        assert error["type"] == "invalid_request_error"
        assert error["param"] == param
    # Nothing reached the engine, nothing was journaled, and the trial goes on.
    assert len(stack.engine.app.paths) == engine_calls
    assert len(read_journal(stack.journal).records) == journaled
    assert stack.trajectory()["state"] == "running"
    assert stack.http.post(route, json=GOOD[route]).status_code == 200
    assert len(journal_turns(stack.journal)) == journaled + 1


def test_the_sdks_raise_bad_request_for_a_bad_request(shared: Stack) -> None:
    stack = shared
    with pytest.raises(openai.BadRequestError) as chat_error:
        chat_call(stack, "SAY: hi", extra_body={"max_tokens": "ten"})
    assert chat_error.value.param == "max_tokens"
    with pytest.raises(openai.BadRequestError):
        responses_call(stack, "SAY: hi", extra_body={"input": 5})
    with pytest.raises(openai.BadRequestError):
        chat_call(stack, "SAY: hi", tools=[{"type": "function", "function": {"name": ""}}])
    with pytest.raises(anthropic.BadRequestError) as anthropic_error:
        anthropic_call(stack, "SAY: hi", extra_body={"max_tokens": "ten"})
    assert anthropic_error.value.type == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError):
        anthropic_call(stack, "SAY: hi", tools=[{"name": "bash", "input_schema": "object"}])
    chat_call(stack, "SAY: still serving")
    assert len(assert_journal_matches_engine(stack)) == 1


def test_routes_and_methods(shared: Stack) -> None:
    stack = shared
    assert_openai_error(stack.http.get("/v1/nothing"), 404, "not_found")
    assert_openai_error(stack.http.post("/v2/chat/completions", json={}), 404, "not_found")
    assert_anthropic_error(
        stack.http.get("/v1/nothing", headers={"anthropic-version": "2023-06-01"}), 404, "not_found_error"
    )
    assert_openai_error(stack.http.get("/v1/chat/completions"), 405, "method_not_allowed")
    assert_openai_error(stack.http.put("/v1/responses", json={}), 405, "method_not_allowed")
    assert_anthropic_error(stack.http.get("/v1/messages"), 405, "invalid_request_error")
    assert_openai_error(stack.http.get("/finish"), 404, "not_found")
    assert_openai_error(stack.http.post("/trajectory"), 404, "not_found")
    with pytest.raises(openai.NotFoundError):
        stack.oai.post("/no/such/route", cast_to=object, body={})
    with pytest.raises(anthropic.NotFoundError):
        stack.anth.post("/v1/no/such/route", cast_to=object, body={})
    # Without the /v1 prefix and with a query string (Claude Code's `?beta=true`) all the same.
    assert stack.http.post("/chat/completions", json=GOOD["/v1/chat/completions"]).status_code == 200
    assert stack.http.post("/v1/messages?beta=true", json=GOOD["/v1/messages"]).status_code == 200
    assert stack.http.post("/v1/messages/", json=GOOD["/v1/messages"]).status_code == 200
    assert len(assert_journal_matches_engine(stack)) == 3


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/messages", "/finish"])
@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_body_over_the_cap_is_a_413(make_shared: MakeStack, route: str, chunked: bool) -> None:
    stack = make_shared(max_body_bytes=4096)
    big = json.dumps({**GOOD.get(route, {}), "padding": "x" * 5000}).encode()
    if chunked:

        def pieces() -> Iterator[bytes]:
            for i in range(0, len(big), 1000):
                yield big[i : i + 1000]

        response = stack.http.post(route, content=pieces(), headers={"content-type": "application/json"})
        assert "content-length" not in response.request.headers
    else:
        response = stack.http.post(route, content=big, headers={"content-type": "application/json"})
    if route == "/v1/messages":
        assert_anthropic_error(response, 413, "request_too_large")
    else:
        assert_openai_error(response, 413, "too_large")
    assert stack.engine.app.fake.requests == []
    # Just under the cap passes.
    assert stack.http.post("/v1/chat/completions", json=GOOD["/v1/chat/completions"]).status_code == 200
    assert len(assert_journal_matches_engine(stack)) == 1


def test_the_sdks_see_a_413(make_shared: MakeStack) -> None:
    stack = make_shared(max_body_bytes=4096)
    with pytest.raises(openai.APIStatusError) as info:
        chat_call(stack, "SAY: " + "x" * 5000)
    assert info.value.status_code == 413
    with pytest.raises(anthropic.APIStatusError) as anthropic_info:
        anthropic_call(stack, "SAY: " + "x" * 5000)
    assert anthropic_info.value.status_code == 413
    assert stack.trajectory()["state"] == "running"


OVERFLOW_ERRORS: dict[str, tuple[type[Exception], str]] = {
    "chat": (openai.BadRequestError, "context_length_exceeded"),
    "responses": (openai.BadRequestError, "context_length_exceeded"),
    "anthropic": (anthropic.BadRequestError, "invalid_request_error"),
}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_prompt_over_the_context_is_the_client_error(shared: Stack, fmt: str, stream: bool) -> None:
    stack = shared
    overflows = stack.trajectory()["errors"].get("context_overflow", 0)
    kind, code = OVERFLOW_ERRORS[fmt]
    with pytest.raises(kind) as info:
        CALLS[fmt](stack, "OVERFLOW", stream=stream)
    error = info.value
    assert getattr(error, "status_code", None) == 400
    assert code in json.dumps(getattr(error, "body", None))
    assert "maximum context length" in str(error)
    # The harness may compact and go on: the trial is still running.
    CALLS[fmt](stack, "SAY: shorter", stream=stream)
    trajectory = stack.trajectory()
    assert trajectory["state"] == "running"
    assert trajectory["errors"]["context_overflow"] == overflows + 1
    assert len(assert_journal_matches_engine(stack)) == 1


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_request_the_engine_refuses_is_the_client_error(shared: Stack, fmt: str) -> None:
    stack = shared
    refused = stack.trajectory()["errors"].get("invalid_request", 0)
    kind = anthropic.BadRequestError if fmt == "anthropic" else openai.BadRequestError
    with pytest.raises(kind) as info:
        CALLS[fmt](stack, "REFUSE")
    assert "the engine rejected the request: tool_choice names a tool" in str(info.value)
    if fmt != "anthropic":
        assert info.value.code == "invalid_request"  # type: ignore[attr-defined]
    CALLS[fmt](stack, "SAY: fine then")
    trajectory = stack.trajectory()
    assert trajectory["state"] == "running"
    assert trajectory["errors"]["invalid_request"] == refused + 1
    assert len(assert_journal_matches_engine(stack)) == 1


ENGINE_FAILURES = [
    pytest.param(marker, stream, id=f"{marker}-{'stream' if stream else 'whole'}")
    for marker, stream in [
        ("FAIL500", False),
        ("FAIL500", True),
        ("GARBAGE", False),
        ("GARBAGE", True),
        ("HANG", False),
        ("HANG", True),
        ("DROP", True),  # a stream cut off half-way; the others fail before the first token
    ]
]


@pytest.mark.parametrize(("marker", "stream"), ENGINE_FAILURES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_an_engine_failure_ends_the_trial(make_stack: MakeStack, fmt: str, marker: str, stream: bool) -> None:
    stack = make_stack(read_timeout_seconds=0.3, engine_options={"chunk_tokens": 2})
    prompt = f"{marker} {LONG}"
    if marker == "DROP":
        # Tokens have already gone out, so the failure comes as the format's error event.
        if fmt == "chat":
            with pytest.raises(openai.APIError) as chat_info:
                chat_call(stack, prompt, stream=True)
            assert not isinstance(chat_info.value, openai.APIStatusError)
            assert chat_info.value.code == "engine_error"
        elif fmt == "anthropic":
            with pytest.raises(anthropic.APIStatusError) as anthropic_info:
                anthropic_call(stack, prompt, stream=True)
            assert anthropic_info.value.body == {
                "type": "error",
                "error": {"type": "api_error", "message": anthropic_info.value.body["error"]["message"]},  # type: ignore[index]
            }
        else:
            # The SDK yields the error event rather than raising; the stream then ends the way
            # OpenAI ends a failed response, with response.failed (never response.completed).
            events = list(stack.oai.responses.create(model="gpt-test", input=prompt, stream=True))
            assert [e.type for e in events[-2:]] == ["error", "response.failed"]
            assert events[-2].code == "engine_error"  # type: ignore[union-attr]
            assert events[-1].response.status == "failed"  # type: ignore[union-attr]
            assert "response.completed" not in [e.type for e in events]
    else:
        status = 504 if marker == "HANG" else 502
        started = time.monotonic()
        # Nothing went out yet: a status the SDKs raise on, even for a stream.
        if fmt == "anthropic":
            with pytest.raises(anthropic.InternalServerError) as info:
                anthropic_call(stack, prompt, stream=stream)
            assert info.value.status_code == status
            assert info.value.body["error"]["type"] == "api_error"  # type: ignore[index]
        else:
            with pytest.raises(openai.InternalServerError) as oinfo:
                CALLS[fmt](stack, prompt, stream=stream)
            assert oinfo.value.status_code == status
            assert oinfo.value.code == "engine_error"
            assert oinfo.value.type == "server_error"
        assert time.monotonic() - started < 10  # not the SDK's 30 s timeout
    trajectory = stack.trajectory()
    assert trajectory["state"] == "ended"
    assert trajectory["end"]["reason"] == "engine_error"
    assert trajectory["end"]["source"] == "proxy"
    assert trajectory["errors"] == {"engine_error": 1}
    # Fail closed: no turn for the failed call, and no more calls in this trial.
    assert journal_turns(stack.journal) == []
    assert [r["type"] for r in read_journal(stack.journal).records] == ["end"]
    if fmt == "anthropic":
        with pytest.raises(anthropic.ConflictError):
            anthropic_call(stack, "SAY: again")
    else:
        with pytest.raises(openai.ConflictError):
            CALLS[fmt](stack, "SAY: again")
    # The harness's own exit does not overwrite the proxy's finding.
    assert stack.finish("agent_error").json()["end"]["reason"] == "engine_error"
    assert stack.http.get("/health").status_code == 200
    if fmt == "chat":  # (once per failure: the failure is the engine's, not the format's)
        # The engine (and its connections) are fine for the next trial's proxy.
        fresh = make_stack()
        CALLS[fmt](fresh, "SAY: next trial", stream=stream)
        assert len(journal_turns(fresh.journal)) == 1


def test_a_dropped_stream_is_not_journaled_even_though_tokens_went_out(make_stack: MakeStack) -> None:
    stack = make_stack(engine_options={"chunk_tokens": 2})
    seen = ""
    with pytest.raises(openai.APIError):
        for chunk in stack.oai.chat.completions.create(
            model="gpt-test", messages=[{"role": "user", "content": f"DROP {LONG}"}], stream=True
        ):
            seen += "".join(c.delta.content or "" for c in chunk.choices)
    assert seen, "part of the answer streamed before the drop"
    [answer] = stack.engine.app.answers
    assert not answer.complete
    assert read_journal(stack.journal).records[-1]["reason"] == "engine_error"
    assert journal_turns(stack.journal) == []
    assert 'outcome="error"' in stack.metrics()


def test_a_503_storm_is_retried_through(make_stack: MakeStack) -> None:
    stack = make_stack(retry_initial_seconds=0.01, retry_max_seconds=0.05, retry_budget_seconds=10)
    for fmt in FORMATS:
        stack.engine.post("/fake/unavailable", {"count": 3})
        CALLS[fmt](stack, f"SAY: after the swap ({fmt})", stream=fmt == "anthropic")
    text = stack.metrics()
    assert metric(text, "legorl_proxy_engine_retries_total") >= 9
    assert metric(text, "legorl_proxy_upstream_errors_total", status="503") >= 1
    assert len(assert_journal_matches_engine(stack)) == 3
    assert stack.trajectory()["state"] == "running"


def test_a_503_storm_longer_than_the_budget_is_an_engine_error(make_stack: MakeStack) -> None:
    stack = make_stack(retry_initial_seconds=0.01, retry_max_seconds=0.05, retry_budget_seconds=0.4)
    stack.engine.post("/fake/unavailable", {"count": 100_000})
    started = time.monotonic()
    with pytest.raises(anthropic.InternalServerError) as info:
        anthropic_call(stack, "SAY: hi")
    elapsed = time.monotonic() - started
    assert 0.4 <= elapsed < 10
    assert info.value.status_code == 503
    assert metric(stack.metrics(), "legorl_proxy_engine_retries_total") >= 1
    assert stack.trajectory()["end"]["reason"] == "engine_error"
    assert journal_turns(stack.journal) == []


@pytest.mark.parametrize(
    "version_source",
    [
        "fixed",
        pytest.param(
            "engine",
        ),
    ],
)
def test_an_engine_that_is_down_fails_after_the_retry_budget(
    make_stack: MakeStack, version_source: str
) -> None:
    stack = make_stack(
        upstream=f"http://127.0.0.1:{free_port()}",
        policy_version_source=version_source,
        retry_initial_seconds=0.01,
        retry_max_seconds=0.05,
        retry_budget_seconds=0.5,
    )
    started = time.monotonic()
    with pytest.raises(openai.InternalServerError) as info:
        chat_call(stack, "SAY: hi")
    assert info.value.code == "engine_error"
    assert time.monotonic() - started >= 0.5
    assert metric(stack.metrics(), "legorl_proxy_engine_retries_total") >= 2
    assert stack.trajectory()["end"]["reason"] == "engine_error"


@pytest.mark.parametrize(
    "version_source",
    [
        "fixed",
        pytest.param(
            "engine",
        ),
    ],
)
def test_a_restarting_engine_is_waited_for(
    make_stack: MakeStack, tmp_path: Path, version_source: str
) -> None:
    port = free_port()
    stack = make_stack(
        engine=Engine(RecordingEngine(), f"http://127.0.0.1:{port}"),
        policy_version_source=version_source,
        retry_initial_seconds=0.05,
        retry_max_seconds=0.1,
        retry_budget_seconds=10,
    )
    up = threading.Event()
    stop = threading.Event()

    def start_engine_late() -> None:
        time.sleep(0.5)
        with serve(stack.engine.app, port=port):
            up.set()
            stop.wait(20)

    thread = threading.Thread(target=start_engine_late, daemon=True)
    started = time.monotonic()
    thread.start()
    try:
        chat_call(stack, "SAY: you are back")
        # The call waited for the engine that starts 0.5 s in, and that engine answered it. (`up` is set
        # only once `serve` has seen uvicorn start, which a retry may beat by a few ms: wait for it.)
        assert time.monotonic() - started >= 0.5
        assert up.wait(10)
        assert len(assert_journal_matches_engine(stack)) == 1
    finally:
        stop.set()
        thread.join(timeout=20)


def test_a_client_that_goes_away_mid_stream(make_stack: MakeStack) -> None:
    stack = make_stack(engine_options={"chunk_tokens": 1, "delay_per_chunk": 0.02})
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": LONG}]}
    with (
        httpx.Client(base_url=stack.url) as client,
        client.stream("POST", "/v1/chat/completions", json=body) as response,
    ):
        assert response.status_code == 200
        first = next(response.iter_bytes())
        assert first.startswith(b"data: ")
    # The proxy notices, aborts the engine call and records nothing for it.
    wait_for(
        lambda: (
            metric(
                stack.metrics(),
                "legorl_proxy_requests_total",
                api_format="openai_chat",
                outcome="disconnected",
            )
            == 1
        )
    )
    wait_for(lambda: stack.engine.app.aborted == 1)
    assert metric(stack.metrics(), "legorl_proxy_in_flight") == 0
    assert read_journal(stack.journal).records == []
    assert stack.trajectory()["state"] == "running"
    # And keeps serving.
    chat_call(stack, "SAY: hello again", stream=True)
    [turn] = journal_turns(stack.journal)
    assert tokens(turn) == tokens(stack.engine.app.good_answers[-1])


def test_an_engine_gone_silent_mid_stream_ends_the_stream_with_an_error(make_stack: MakeStack) -> None:
    stack = make_stack(read_timeout_seconds=0.5, engine_options={"chunk_tokens": 1, "delay_per_chunk": 1.5})
    with pytest.raises(anthropic.APIStatusError) as info:
        anthropic_call(stack, "SAY: slowly", stream=True)
    assert info.value.status_code == 200  # the status line had gone out with message_start
    assert "went silent" in str(info.value)
    assert stack.trajectory()["end"]["reason"] == "engine_error"
    assert journal_turns(stack.journal) == []
    wait_for(lambda: stack.engine.app.aborted == 1)


def test_routed_experts_without_routing_fail_closed(make_stack: MakeStack) -> None:
    stack = make_stack(capture_routed_experts=True)
    with pytest.raises(openai.InternalServerError) as info:
        chat_call(stack, "SAY: hi", stream=True)
    assert "routed experts" in str(info.value)
    assert stack.trajectory()["end"]["reason"] == "engine_error"
    assert journal_turns(stack.journal) == []


TOOLS_BY_FORMAT = {
    "chat": {"tools": TOOLS_CHAT},
    "anthropic": {"tools": TOOLS_ANTHROPIC},
    "responses": {"tools": TOOLS_RESPONSES},
}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_routed_experts_are_captured(make_shared: MakeStack, fmt: str, stream: bool) -> None:
    stack = make_shared(capture_routed_experts=True)
    stack.engine.app.routing = (3, 2)
    # vLLM returns routing only on whole answers: a streaming harness gets the answer replayed.
    assert CALLS[fmt](stack, "SAY: routed", stream=stream).text == "routed"
    tool = CALLS[fmt](stack, "CALL_TOOL", stream=stream, **TOOLS_BY_FORMAT[fmt])
    assert tool.tool_calls == [("bash", TOOL_ARGUMENTS)]
    assert [r["stream"] for r in stack.engine.app.fake.requests] == [False, False]
    turns = assert_journal_matches_engine(stack)
    for turn, answer in zip(turns, stack.engine.app.good_answers, strict=True):
        # Journaled as the engine's array: vLLM's int32 ids here are all below 61, so uint8.
        assert isinstance(turn["routed_experts"], np.ndarray) and turn["routed_experts"].dtype == np.uint8
        np.testing.assert_array_equal(turn["routed_experts"], answer.routed_experts)
        rows = len(turn["prompt_token_ids"]) + len(turn["completion_token_ids"]) - 1
        assert turn["routed_experts_shape"] == [rows, 3, 2]
        assert turn["routed_experts"].shape == (rows, 3, 2)
    segments = stack.trajectory()["segments"][-2:]  # two unrelated prompts: a segment each
    assert [s["turn_indices"] for s in segments] == [[t["index"]] for t in turns]
    # GET /trajectory sends routing as base64 arrays, which the run controller decodes without lists.
    assert [s["routed_experts"]["$array"] for s in segments] == ["u1", "u1"]
    for seg, turn in zip((Segment.from_json(s) for s in segments), turns, strict=True):
        assert seg.routed_experts is not None
        np.testing.assert_array_equal(seg.routed_experts, turn["routed_experts"])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_the_client_gets_the_logprobs_it_asked_for(shared: Stack, stream: bool) -> None:
    stack = shared
    messages: Any = [{"role": "user", "content": "SAY: hi there"}]
    if stream:
        chunks = stack.oai.chat.completions.create(
            model="gpt-test", messages=messages, logprobs=True, top_logprobs=2, stream=True
        )
        seen = [
            e.logprob for c in chunks for ch in c.choices if ch.logprobs for e in ch.logprobs.content or []
        ]
    else:
        done = stack.oai.chat.completions.create(
            model="gpt-test", messages=messages, logprobs=True, top_logprobs=2
        )
        assert done.choices[0].logprobs is not None
        seen = [e.logprob for e in done.choices[0].logprobs.content or []]
    assert stack.engine.app.fake.requests[-1]["top_logprobs"] == 2
    [turn] = assert_journal_matches_engine(stack)
    journaled = turn["completion_logprobs"]
    # Every token's, a stream's end-of-turn token (a chunk without text) included.
    assert seen == journaled
    quiet = stack.oai.chat.completions.create(model="gpt-test", messages=messages)
    assert quiet.choices[0].logprobs is None


def test_turns_keep_the_bodies_the_harness_exchanged(make_stack: MakeStack) -> None:
    stack = make_stack()
    request = {"model": "gpt-test", "messages": [{"role": "user", "content": "SAY: keep me"}], "seed": 3}
    answer = stack.http.post("/v1/chat/completions", json=request).json()
    [turn] = journal_turns(stack.journal)
    assert json.loads(turn["request_body"]) == request
    assert json.loads(turn["response_body"]) == answer
    quiet = make_stack(record_bodies=False)
    quiet.http.post("/v1/chat/completions", json=request).raise_for_status()
    [turn] = journal_turns(quiet.journal)
    assert (turn["request_body"], turn["response_body"]) == (None, None)


def test_concurrent_calls_are_each_journaled_once(make_stack: MakeStack) -> None:
    stack = make_stack(engine_options={"chunk_tokens": 2, "delay_per_chunk": 0.005})

    def call(i: int) -> str:
        return CALLS[FORMATS[i % 3]](stack, f"SAY: session {i}", stream=i % 2 == 0).text

    with ThreadPoolExecutor(max_workers=6) as pool:
        replies = list(pool.map(call, range(12)))
    assert replies == [f"session {i}" for i in range(12)]
    turns = journal_turns(stack.journal)  # in the order they finished, not the order they began
    assert sorted(t["index"] for t in turns) == list(range(12))
    assert sorted(map(tokens, turns)) == sorted(map(tokens, stack.engine.app.good_answers))
    assert stack.http.get("/turns").json()["turns"] == turns
    trajectory = stack.trajectory()
    assert (trajectory["turns"], len(trajectory["segments"]), trajectory["mergedTurnShare"]) == (12, 12, 0.0)
    assert metric(stack.metrics(), "legorl_proxy_journal_batch_records_count") >= 1


# -- policy versions, turn budget -----------------------------------------------------------------


def swap_weights(engine: Engine, version: str) -> None:
    """A weight swap as the trainer drives it (vLLM's RL routes, pause mode keep)."""
    engine.post("/pause", {})
    engine.post("/finish_weight_update", {"weight_version": version})
    engine.post("/resume", {})


# Both ways the proxy learns the versions: named by the engine with each answer (legorl's middleware, as the
# fleet's vLLM runs it), or read from /weight_info before and after each call (an engine without it).
NAMING = pytest.mark.parametrize("names", [True, False], ids=["engine-names-versions", "weight-info-reads"])


def assert_version_reads(stack: Stack, names: bool) -> None:
    reads = stack.engine.app.paths.count("/weight_info")
    if names:
        # One read before the first call, before the proxy has seen an answer naming its versions.
        assert reads == 1, stack.engine.app.paths
    else:
        assert reads == 2 * len(stack.engine.app.good_answers)


@NAMING
def test_turns_carry_the_policy_version_the_engine_served(make_stack: MakeStack, names: bool) -> None:
    stack = make_stack(engine_options={"names_versions": names})
    chat_call(stack, "SAY: one")
    swap_weights(stack.engine, "v1")
    anthropic_call(stack, "SAY: two", stream=True)
    swap_weights(stack.engine, "v2")
    responses_call(stack, "SAY: three")
    chat_call(stack, "SAY: four", stream=True)
    turns = assert_journal_matches_engine(stack)
    assert [t["policy_versions"] for t in turns] == [["0"], ["v1"], ["v2"], ["v2"]]
    assert stack.trajectory()["policyVersions"] == ["0", "v1", "v2"]
    assert_version_reads(stack, names)


@NAMING
def test_the_weights_an_engine_started_with_are_recorded_as_v0(make_stack: MakeStack, names: bool) -> None:
    """vLLM names its startup weights `default` until a weight update; they are the run's checkpoint, v0. On a
    real node every step-1 trial recorded `default`, so the trainer found no trial of the version it trained
    and step 1 had no fidelity figure."""
    stack = make_stack(engine_options={"names_versions": names})
    swap_weights(stack.engine, "default")  # the fake engine then names its weights as vLLM does at start
    chat_call(stack, "SAY: one")
    swap_weights(stack.engine, "v1")
    chat_call(stack, "SAY: two", stream=True)
    turns = assert_journal_matches_engine(stack)
    assert [t["policy_versions"] for t in turns] == [["v0"], ["v1"]]
    assert stack.trajectory()["policyVersions"] == ["v0", "v1"]


@NAMING
def test_a_weight_swap_during_a_stream_records_both_versions(make_stack: MakeStack, names: bool) -> None:
    stack = make_stack(engine_options={"chunk_tokens": 1, "delay_per_chunk": 0.05, "names_versions": names})
    chat_call(stack, "SAY: before")  # the proxy has seen how this engine reports versions
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "SAY: a longer answer"}]}
    with stack.http.stream("POST", "/v1/chat/completions", json=body) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        swap_weights(stack.engine, "v1")  # the engine holds the stream while paused, then goes on
        rest = list(lines)
    assert "data: [DONE]" in rest
    assert not any("legorl-weight-versions" in line for line in rest)  # the engine's note is not passed on
    chat_call(stack, "SAY: after", stream=True)
    turns = assert_journal_matches_engine(stack)
    assert [t["policy_versions"] for t in turns] == [["0"], ["0", "v1"], ["v1"]]
    assert [s["policy_versions"] for s in stack.trajectory()["segments"]] == [["0"], ["0", "v1"], ["v1"]]
    assert_version_reads(stack, names)


@NAMING
def test_a_call_held_through_a_swap_records_both_versions(make_stack: MakeStack, names: bool) -> None:
    # Unstreamed: the engine is paused when the call arrives and answers once resumed on new weights.
    stack = make_stack(engine_options={"names_versions": names})
    chat_call(stack, "SAY: before")
    stack.engine.post("/pause", {})
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(chat_call, stack, "SAY: held")
        wait_for(lambda: stack.engine.app.in_flight == 1)
        stack.engine.post("/finish_weight_update", {"weight_version": "v1"})
        stack.engine.post("/resume", {})
        held.result(timeout=10)
    turns = assert_journal_matches_engine(stack)
    assert [t["policy_versions"] for t in turns] == [["0"], ["0", "v1"]]
    assert_version_reads(stack, names)


def test_an_engine_that_stops_naming_versions_is_read_again(make_stack: MakeStack) -> None:
    # The fleet's engine restarted without the middleware: the call that finds out has no read from
    # before it, so its start is unknown; the next ones read /weight_info before and after again.
    stack = make_stack(engine_options={"names_versions": True})
    chat_call(stack, "SAY: one")
    stack.engine.app.inner = stack.engine.app.fake
    chat_call(stack, "SAY: two")
    chat_call(stack, "SAY: three", stream=True)
    turns = assert_journal_matches_engine(stack)
    assert [t["policy_versions"] for t in turns] == [["0"], ["unknown", "0"], ["0"]]
    assert stack.engine.app.paths.count("/weight_info") == 1 + 1 + 2


def test_a_fixed_policy_version_is_recorded_without_asking_the_engine(make_stack: MakeStack) -> None:
    stack = make_stack(policy_version_source="fixed", policy_version="step-7")
    stack.engine.post("/fake/version", {"version": "v9"})
    chat_call(stack, "SAY: one")
    chat_call(stack, "SAY: two", stream=True)
    assert [t["policy_versions"] for t in journal_turns(stack.journal)] == [["step-7"], ["step-7"]]
    assert "/weight_info" not in stack.engine.app.paths


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_call_after_the_turn_budget_is_refused(make_stack: MakeStack, fmt: str) -> None:
    stack = make_stack(max_turns=2)
    CALLS[fmt](stack, "SAY: one")
    CALLS[fmt](stack, "SAY: two", stream=True)
    conflict = anthropic.ConflictError if fmt == "anthropic" else openai.ConflictError
    with pytest.raises(conflict) as info:
        CALLS[fmt](stack, "SAY: three")
    assert "turn budget" in str(info.value)
    raw = stack.http.post(
        {"chat": "/v1/chat/completions", "anthropic": "/v1/messages", "responses": "/v1/responses"}[fmt],
        json=GOOD[
            {"chat": "/v1/chat/completions", "anthropic": "/v1/messages", "responses": "/v1/responses"}[fmt]
        ],
    )
    if fmt == "anthropic":
        assert_anthropic_error(raw, 409, "invalid_request_error")
    else:
        assert_openai_error(raw, 409, "trial_finished")
    end = stack.trajectory()["end"]
    assert (end["reason"], end["source"]) == ("turn_limit", "proxy")
    assert len(stack.engine.app.fake.requests) == 2
    assert len(assert_journal_matches_engine(stack)) == 2
    assert stack.finish("completed").json()["end"]["reason"] == "turn_limit"


@pytest.mark.parametrize("how", ["finished", "engine-failure"])
def test_a_trial_that_is_over_is_not_retried_by_the_sdks(stack: Stack, how: str) -> None:
    if how == "finished":
        stack.finish("completed")
    retrying = stack.oai.with_options(max_retries=2)  # the SDK's default
    with pytest.raises(openai.APIStatusError):
        retrying.chat.completions.create(model="m", messages=[{"role": "user", "content": "FAIL500"}])
    attempts = metric(
        stack.metrics(), "legorl_proxy_requests_total", api_format="openai_chat", outcome="error"
    )
    assert attempts == 1


# -- the other routes -----------------------------------------------------------------------------


def test_models_health_and_the_head_probe(shared: Stack) -> None:
    stack = shared
    assert [m.id for m in stack.oai.models.list()] == ["policy"]
    listed = list(stack.anth.models.list())
    assert [(m.id, m.type, m.display_name) for m in listed] == [("policy", "model", "policy")]
    plain = stack.http.get("/v1/models").json()
    assert plain == {
        "object": "list",
        "data": [{"id": "policy", "object": "model", "created": 0, "owned_by": "legorl"}],
    }
    assert stack.http.get("/models").json() == plain
    head = stack.http.head("/")
    assert (head.status_code, head.content) == (200, b"")
    assert stack.http.get("/health").json() == {"status": "ok"}
    assert stack.http.get("/healthz").status_code == 200
    assert stack.http.get("/ready").json() == {"ready": True}


def test_a_system_message_after_the_prompt_reaches_the_engine_as_a_user_message(shared: Stack) -> None:
    # Claude Code sends one after the user's prompt; Qwen3-family templates refuse a system message that
    # is not first (tests/proxy/test_proxy_formats.py renders one).
    stack = shared
    stack.anth.messages.create(
        model="claude-test",
        max_tokens=64,
        system="Be terse.",
        messages=[
            {"role": "user", "content": "SAY: done"},
            {"role": "system", "content": "Available agent types: general."},
        ],
    )
    sent = stack.engine.app.fake.requests[-1]
    assert sent["messages"] == [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "SAY: done"},
        {"role": "user", "content": "Available agent types: general."},
    ]
    [turn] = journal_turns(stack.journal)[stack.turns_before :]
    assert turn["prompt_token_ids"] == render_prompt(sent["messages"])


def test_count_tokens_uses_the_engine_template(shared: Stack) -> None:
    stack = shared
    counted = stack.anth.messages.count_tokens(
        model="claude-test",
        system="Be terse.",
        messages=[
            {"role": "user", "content": "List the files."},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "t1", "name": "bash", "input": {"command": "ls"}}],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "a.py"}]},
        ],
        tools=TOOLS_ANTHROPIC,
    )
    expected = render_prompt(
        [
            {"role": "system", "content": "Be terse."},
            {"role": "user", "content": "List the files."},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "t1",
                        "type": "function",
                        "function": {"name": "bash", "arguments": '{"command": "ls"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "t1", "content": "a.py"},
        ]
    )
    assert counted.input_tokens == len(expected)
    # Counting is no model call: no turn, nothing for the chat engine.
    assert len(journal_turns(stack.journal)) == stack.turns_before
    assert stack.engine.app.fake.requests == []
    with pytest.raises(anthropic.BadRequestError):
        stack.anth.messages.count_tokens(model="claude-test", messages=[])


def test_count_tokens_with_an_engine_answering_garbage(shared: Stack) -> None:
    stack = shared
    stack.engine.app.garbage_tokenize = True
    response = stack.http.post(
        "/v1/messages/count_tokens", json={"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    )
    assert_anthropic_error(response, 502, "api_error")


def test_metrics(stack: Stack) -> None:
    chat_call(stack, "SAY: one")
    chat_call(
        stack,
        "",
        messages=[
            {"role": "user", "content": "SAY: one"},
            {"role": "assistant", "content": "one"},
            {"role": "user", "content": "SAY: two"},
        ],
    )
    anthropic_call(stack, "SAY: three", stream=True)
    with pytest.raises(anthropic.BadRequestError):
        anthropic_call(stack, "OVERFLOW")
    with pytest.raises(openai.BadRequestError):
        chat_call(stack, "SAY: x", extra_body={"temperature": "hot"})
    text = stack.metrics()
    assert stack.http.get("/metrics").headers["content-type"].startswith("text/plain; version=0.0.4")
    assert metric(text, "legorl_proxy_requests_total", api_format="openai_chat", outcome="ok") == 2
    assert metric(text, "legorl_proxy_requests_total", api_format="openai_chat", outcome="error") == 1
    assert metric(text, "legorl_proxy_requests_total", api_format="anthropic_messages", outcome="ok") == 1
    assert metric(text, "legorl_proxy_requests_total", api_format="anthropic_messages", outcome="error") == 1
    assert metric(text, "legorl_proxy_errors_total", kind="context_overflow") == 1
    assert metric(text, "legorl_proxy_errors_total", kind="invalid_request") == 1
    turns = assert_journal_matches_engine(stack)
    assert metric(text, "legorl_proxy_tokens_in_total") == sum(len(t["prompt_token_ids"]) for t in turns)
    assert metric(text, "legorl_proxy_tokens_out_total") == sum(len(t["completion_token_ids"]) for t in turns)
    assert metric(text, "legorl_proxy_journal_fsync_seconds_count") == 3
    assert metric(text, "legorl_proxy_journal_fsync_seconds_bucket", le="+Inf") == 3
    assert metric(text, "legorl_proxy_turns") == 3
    assert metric(text, "legorl_proxy_segment_merge_ratio") == 0.5
    assert metric(text, "legorl_proxy_ttft_seconds_count") == 1
    assert metric(text, "legorl_proxy_request_seconds_count", api_format="openai_chat") == 3
    # Four calls reached the engine (the bad temperature never left the proxy); one got its 400.
    assert metric(text, "legorl_proxy_engine_seconds_count") == 4
    assert metric(text, "legorl_proxy_upstream_errors_total", status="400") == 1
    assert metric(text, "legorl_proxy_in_flight") == 0
    # No tracer provider, no trace context: nothing extra goes to the engine.
    assert not any("traceparent" in headers for headers in stack.engine.app.headers)


def test_unexpected_formats_are_counted(make_stack: MakeStack) -> None:
    stack = make_stack(api_format="AnthropicMessages")
    anthropic_call(stack, "SAY: expected")
    chat_call(stack, "SAY: unexpected")
    text = stack.metrics()
    assert metric(text, "legorl_proxy_unexpected_format_total", api_format="openai_chat") == 1
    assert metric(text, "legorl_proxy_unexpected_format_total", api_format="anthropic_messages") == 0


def test_traces(make_stack: MakeStack) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    stack = make_stack(tracer_provider=provider)
    chat_call(stack, "SAY: whole")
    anthropic_call(stack, "SAY: streamed", stream=True)
    with pytest.raises(openai.BadRequestError):
        chat_call(stack, "OVERFLOW")

    def servers() -> list[ReadableSpan]:
        return [s for s in exporter.get_finished_spans() if s.kind == SpanKind.SERVER]

    wait_for(lambda: len(servers()) == 3)
    spans = exporter.get_finished_spans()
    whole, streamed, failed = sorted(servers(), key=lambda s: s.start_time or 0)
    turns = journal_turns(stack.journal)
    for span, turn in ((whole, turns[0]), (streamed, turns[1])):
        attributes = dict(span.attributes or {})
        assert attributes["legorl.prompt_tokens"] == len(turn["prompt_token_ids"])
        assert attributes["legorl.completion_tokens"] == len(turn["completion_token_ids"])
        assert attributes["legorl.finish_reason"] == "stop"
        assert attributes["legorl.turn"] == turn["index"]
        assert span.status.is_ok
        # The engine call is a client span under the server span.
        [client] = [
            s
            for s in spans
            if s.kind == SpanKind.CLIENT
            and s.parent
            and span.context
            and s.parent.span_id == span.context.span_id
        ]
        assert client.name == "engine chat.completions"
    assert whole.name == "proxy openai_chat" and streamed.name == "proxy anthropic_messages"
    assert (whole.attributes or {})["legorl.stream"] is False
    assert "legorl.ttft_seconds" not in (whole.attributes or {})
    ttft = (streamed.attributes or {})["legorl.ttft_seconds"]
    assert isinstance(ttft, float) and ttft > 0
    assert not failed.status.is_ok
    assert (failed.attributes or {})["legorl.error_kind"] == "context_overflow"
    assert {s.name for s in spans} >= {"journal append"}
    # Every call's span hangs under the trial's root span (ids derived from run and trial, which the
    # run controller emits when it collects the trial), and carries the trial id.
    settings = stack.app.settings
    for span in servers():
        assert span.context is not None and span.parent is not None
        assert span.context.trace_id == trial_trace_id(settings.run, settings.trial)
        assert span.parent.span_id == trial_span_id(settings.run, settings.trial)
        assert (span.attributes or {})["legorl.trial"] == settings.trial
        assert (span.attributes or {})["legorl.run"] == settings.run
    # The engine got a W3C traceparent naming the client span of its call.
    clients = {s.context.span_id: s for s in spans if s.kind == SpanKind.CLIENT and s.context}
    parents = [h["traceparent"] for h in stack.engine.app.headers]
    assert len(parents) == 3
    for traceparent in parents:
        version, trace_id, span_id, flags = traceparent.split("-")
        assert (version, flags) == ("00", "01")
        assert int(trace_id, 16) == trial_trace_id(settings.run, settings.trial)
        assert (clients[int(span_id, 16)].attributes or {})["legorl.trial"] == settings.trial


# -- restart, admission ---------------------------------------------------------------------------


def test_a_restarted_proxy_continues_the_trial(tmp_path: Path, engine: Engine) -> None:
    journal = tmp_path / "journal"
    with proxy_served(engine, journal) as first:
        chat_call(first, "SAY: one")
        chat_call(
            first,
            "",
            messages=[
                {"role": "user", "content": "SAY: one"},
                {"role": "assistant", "content": "one"},
                {"role": "user", "content": "SAY: two"},
            ],
        )
        before = first.trajectory()
        assert before.pop("journalDroppedBytes") == 0
        turns_before = first.http.get("/turns").json()
    # The crash that stopped it tore a record it was writing (never acknowledged).
    torn = struct.pack("<II", 500, 0) + b'{"type": "turn", "ind'
    with (journal / "journal.log").open("ab") as log:
        log.write(torn)
    assert read_journal(journal).dropped_bytes == len(torn)
    with proxy_served(engine, journal) as second:
        assert read_journal(journal).dropped_bytes == 0  # cut back to the last whole record
        resumed = second.trajectory()
        assert resumed.pop("journalDroppedBytes") == len(torn)
        assert resumed == before
        assert metric(second.metrics(), "legorl_proxy_journal_dropped_bytes") == len(torn)
        assert second.http.get("/turns").json() == turns_before
        chat_call(second, "SAY: three", stream=True)
        assert [t["index"] for t in journal_turns(journal)] == [0, 1, 2]
        assert second.trajectory()["turns"] == 3
        assert second.finish("completed").status_code == 200
        ended = second.trajectory()
    with proxy_served(engine, journal) as third:
        again = third.trajectory()
        assert again.pop("journalDroppedBytes") == 0  # the second cut the tail for good
        assert again == {k: v for k, v in ended.items() if k != "journalDroppedBytes"}
        assert again["end"]["reason"] == "completed"
        with pytest.raises(openai.ConflictError):
            chat_call(third, "SAY: four")
        assert third.finish("agent_error").json()["end"]["reason"] == "completed"
    turns = journal_turns(journal)
    assert [tokens(t) for t in turns] == [tokens(a) for a in engine.app.good_answers]


@pytest.mark.parametrize(("sessions", "most_in_engine"), [(None, 2), (1, 1)])
def test_admission_limits_calls_in_the_engine(
    make_stack: MakeStack, sessions: int | None, most_in_engine: int
) -> None:
    stack = make_stack(
        admission_max_sessions=sessions, engine_options={"chunk_tokens": 1, "delay_per_chunk": 0.04}
    )
    results: list[str] = []

    def call(i: int) -> None:
        results.append(chat_call(stack, f"SAY: caller {i} here", stream=True).text)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert sorted(results) == ["caller 0 here", "caller 1 here"]
    assert stack.engine.app.max_in_flight == most_in_engine
    turns = journal_turns(stack.journal)
    assert sorted(map(tokens, turns)) == sorted(map(tokens, stack.engine.app.good_answers))


# -- Codex's custom (freeform) and namespace tools, through the SDK ---------------------------------

CODEX_TOOLS: Any = [
    {"type": "custom", "name": "apply_patch", "description": "Edit files with a patch."},
    {
        "type": "namespace",
        "name": "mcp__github__",
        "description": "Tools of the github MCP server.",
        "tools": [
            {
                "type": "function",
                "name": "search_issues",
                "parameters": {"type": "object", "properties": {"query": {"type": "string"}}},
            }
        ],
    },
]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_custom_and_namespaced_tool_calls_round_trip(stack: Stack, stream: bool) -> None:
    """The SDK reads the engine's calls as a `custom_tool_call` and a `function_call` with its namespace,
    and sent back as history they reach the engine as calls to its own function names. The fake engine
    calls every tool with `{"command": "ls -la"}`, not the `{"input": ...}` a custom tool asks for: that
    text goes to the harness as the input, and comes back to the engine as `{"input": <that text>}`."""

    def call(items: Any, choice: Any) -> Any:
        if not stream:
            return stack.oai.responses.create(
                model="gpt-test", input=items, tools=CODEX_TOOLS, tool_choice=choice
            )
        events = list(
            stack.oai.responses.create(
                model="gpt-test", input=items, tools=CODEX_TOOLS, tool_choice=choice, stream=True
            )
        )
        assert events[-1].type == "response.completed"
        return events[-1].response

    items: list[Any] = [{"role": "user", "content": "Patch it."}]
    first = call(items, {"type": "custom", "name": "apply_patch"})
    [patch] = first.output
    assert patch.type == "custom_tool_call"
    assert (patch.name, patch.input) == ("apply_patch", json.dumps(TOOL_ARGUMENTS))
    sent = stack.engine.app.fake.requests[-1]
    assert [t["function"]["name"] for t in sent["tools"]] == ["apply_patch", "mcp__github__search_issues"]
    assert sent["tool_choice"] == {"type": "function", "function": {"name": "apply_patch"}}

    items += [
        patch.model_dump(exclude_none=True),
        {"type": "custom_tool_call_output", "call_id": patch.call_id, "output": "Done!"},
    ]
    second = call(items, {"type": "function", "name": "search_issues", "namespace": "mcp__github__"})
    [search] = second.output
    assert search.type == "function_call"
    assert (search.namespace, search.name, search.arguments) == (
        "mcp__github__",
        "search_issues",
        json.dumps(TOOL_ARGUMENTS),
    )
    sent = stack.engine.app.fake.requests[-1]
    assert sent["tool_choice"] == {"type": "function", "function": {"name": "mcp__github__search_issues"}}
    # The custom call went back to the engine as the call it made, arguments in its own spelling.
    assert sent["messages"][1]["tool_calls"] == [
        {
            "id": patch.call_id,
            "type": "function",
            "function": {
                "name": "apply_patch",
                "arguments": json.dumps({"input": json.dumps(TOOL_ARGUMENTS)}),
            },
        }
    ]
    assert sent["messages"][2] == {"role": "tool", "tool_call_id": patch.call_id, "content": "Done!"}

    items += [
        search.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": search.call_id, "output": "none"},
    ]
    items.append({"role": "user", "content": "SAY: done"})
    last = call(items, "auto")
    assert last.output_text == "done"
    sent = stack.engine.app.fake.requests[-1]
    assert sent["messages"][3]["tool_calls"] == [
        {
            "id": search.call_id,
            "type": "function",
            "function": {"name": "mcp__github__search_issues", "arguments": json.dumps(TOOL_ARGUMENTS)},
        }
    ]
    assert len(assert_journal_matches_engine(stack)) == 3

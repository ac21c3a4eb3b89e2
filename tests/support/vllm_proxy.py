"""The proxy against a real engine, shared by the tests that need one: vLLM (CPU, fp32) serving the tiny
random Qwen3-MoE (`tests/support/engine.py`), behind a recording tap, and the checks that hold the proxy's
journal to what vLLM sent.

The tap is an ASGI pass-through between the proxy and vLLM that keeps the exact bytes vLLM sent for
every chat completion; `check_journal` holds every journaled turn to those bytes (prompt and completion
token ids, log-probs, finish reason). A test may give the tap a `rewrite` for the requests it forwards
(test code only: the harness CLI tests use it to force one tool call from the random model); the tap
records what vLLM was sent, so the journal is still held to vLLM's own answer.

`tests/conftest.py` serves one such engine to every test that asks for `vllm_engine` (`start_engine`);
`open_proxy` puts a `legorl proxy` (the real `ProxyApp` under uvicorn) in front of it.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterator, MutableMapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai

from legorl.api.trajectory import Turn
from legorl.proxy.app import ProxyApp
from legorl.proxy.journal import read_journal, turn_from_record
from legorl.proxy.settings import ProxySettings
from tests.support.asgi_server import serve
from tests.support.engine import SERVED_MODEL_NAME, VllmServer, make_tiny_model

Scope = MutableMapping[str, Any]
Rewrite = Callable[[dict[str, Any]], dict[str, Any] | None]

WEIGHT_VERSION = "v0"
"""What the proxy records for the engine's startup weights: vLLM's /weight_info says `default` until a
weight update, and those weights are the run's checkpoint, v0 (legorl.api.weight_versions)."""
MAX_MODEL_LEN = 32768
"""The shared engine's context: the tiny model's whole `max_position_embeddings`. The harness CLIs'
prompts are long with the tiny byte-level tokenizer (first prompts measured: Codex 17.3k tokens,
OpenCode 13.4k, Claude Code 22.3k with all its tools), far beyond the 8192 the SDK tests need."""


# -- what vLLM sent, read back from the tap's bytes --------------------------------------------


@dataclass
class Answer:
    """One chat completion as vLLM sent it (a whole body, or a stream folded up)."""

    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    completion_logprobs: list[float]
    logprob_entries: list[dict[str, Any]]
    finish_reason: str | None
    stop_reason: Any
    content: str
    tool_calls: list[dict[str, str]]
    """id, name and arguments of each tool call (a stream's argument deltas concatenated)."""


def sse_payloads(raw: bytes) -> list[str]:
    payloads = []
    for line in raw.decode().splitlines():
        if line.startswith("data:"):
            payloads.append(line[5:].strip())
    return payloads


def parse_answer(raw: bytes, stream: bool) -> Answer:
    if not stream:
        body = json.loads(raw)
        choice = body["choices"][0]
        entries = choice["logprobs"]["content"]
        message = choice["message"]
        return Answer(
            prompt_token_ids=body["prompt_token_ids"],
            completion_token_ids=choice["token_ids"],
            completion_logprobs=[e["logprob"] for e in entries],
            logprob_entries=entries,
            finish_reason=choice["finish_reason"],
            stop_reason=choice.get("stop_reason"),
            content=message.get("content") or "",
            tool_calls=[
                {"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                for c in message.get("tool_calls") or []
            ],
        )
    payloads = sse_payloads(raw)
    assert payloads and payloads[-1] == "[DONE]", "vLLM's stream did not end with [DONE]"
    prompt: list[int] = []
    tokens: list[int] = []
    entries = []
    finish, stop = None, None
    content = ""
    calls: dict[int, dict[str, str]] = {}
    for payload in payloads[:-1]:
        chunk = json.loads(payload)
        if chunk.get("prompt_token_ids") is not None:
            prompt = chunk["prompt_token_ids"]
        for choice in chunk.get("choices") or []:
            tokens.extend(choice.get("token_ids") or [])
            entries.extend((choice.get("logprobs") or {}).get("content") or [])
            delta = choice.get("delta") or {}
            content += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                slot = calls.setdefault(call["index"], {"id": "", "name": "", "arguments": ""})
                slot["id"] = slot["id"] or call.get("id") or ""
                function = call.get("function") or {}
                slot["name"] = slot["name"] or function.get("name") or ""
                slot["arguments"] += function.get("arguments") or ""
            if choice.get("finish_reason"):
                finish, stop = choice["finish_reason"], choice.get("stop_reason")
    return Answer(
        prompt_token_ids=prompt,
        completion_token_ids=tokens,
        completion_logprobs=[e["logprob"] for e in entries],
        logprob_entries=entries,
        finish_reason=finish,
        stop_reason=stop,
        content=content,
        tool_calls=[calls[i] for i in sorted(calls)],
    )


@dataclass
class Exchange:
    """One `POST /v1/chat/completions` the proxy made, and vLLM's exact answer."""

    request: dict[str, Any]
    """What vLLM was sent (the proxy's request, after the tap's `rewrite` if it changed it)."""
    sent_by_proxy: dict[str, Any]
    """What the proxy sent."""
    status: int = 0
    raw: bytearray = field(default_factory=bytearray)
    done: bool = False

    @property
    def stream(self) -> bool:
        return bool(self.request.get("stream"))

    def answer(self) -> Answer:
        assert self.done, "the tap has not seen the whole answer"
        assert self.status == 200, bytes(self.raw)
        return parse_answer(bytes(self.raw), self.stream)


_HOP_HEADERS = {b"host", b"content-length", b"connection", b"transfer-encoding", b"keep-alive"}


class Tap:
    """An ASGI pass-through to vLLM that records every chat completion's exact answer.

    The bytes are recorded before they are forwarded, so by the time the proxy has read an answer
    (and journaled it) the tap holds all of it. `rewrite`, when set, sees each chat completion
    request the proxy makes and may return another body to send vLLM instead (None: unchanged).
    """

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.exchanges: list[Exchange] = []
        self.rewrite: Rewrite | None = None
        self._client: httpx.AsyncClient | None = None

    def clear(self) -> None:
        self.exchanges.clear()
        self.rewrite = None

    def chat(self) -> list[Exchange]:
        return list(self.exchanges)

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    self._client = httpx.AsyncClient(base_url=self.upstream, timeout=300)
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    if self._client is not None:
                        await self._client.aclose()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        assert self._client is not None
        body = bytearray()
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        method, path = scope["method"], scope["path"]
        query = scope.get("query_string", b"").decode()
        headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() not in _HOP_HEADERS]
        chat = method == "POST" and path == "/v1/chat/completions"
        sent_by_proxy = json.loads(body) if chat else {}
        sent = sent_by_proxy
        if chat and self.rewrite is not None:
            changed = self.rewrite(json.loads(body))
            if changed is not None:
                sent, body = changed, bytearray(json.dumps(changed).encode())
        request = self._client.build_request(
            method, path + (f"?{query}" if query else ""), content=bytes(body), headers=headers
        )
        response = await self._client.send(request, stream=True)
        exchange: Exchange | None = None
        if chat:
            exchange = Exchange(request=sent, sent_by_proxy=sent_by_proxy, status=response.status_code)
            self.exchanges.append(exchange)
        try:
            out_headers = [
                (k.encode(), v.encode())
                for k, v in response.headers.items()
                if k.encode() not in _HOP_HEADERS and k.lower() != "content-encoding"
            ]
            await send(
                {"type": "http.response.start", "status": response.status_code, "headers": out_headers}
            )
            async for chunk in response.aiter_bytes():
                if exchange is not None:
                    exchange.raw += chunk
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            if exchange is not None:
                exchange.done = True
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await response.aclose()


# -- the engine and a proxy in front of it ---------------------------------------------------------


@dataclass
class Engine:
    vllm_url: str
    tap_url: str
    tap: Tap
    model_dir: Path
    startup_seconds: float

    def tokenize(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """vLLM's own rendering of chat messages (its template, its tokenizer), generation prompt on."""
        body: dict[str, Any] = {
            "model": SERVED_MODEL_NAME,
            "messages": messages,
            "add_generation_prompt": True,
        }
        if tools:
            body["tools"] = tools
        response = httpx.post(f"{self.vllm_url}/tokenize", json=body, timeout=60)
        assert response.status_code == 200, response.text
        data = response.json()
        assert data["count"] == len(data["tokens"])
        tokens: list[int] = data["tokens"]
        return tokens

    def detokenize(self, tokens: list[int]) -> str:
        response = httpx.post(
            f"{self.vllm_url}/detokenize", json={"model": SERVED_MODEL_NAME, "tokens": tokens}
        )
        assert response.status_code == 200, response.text
        text: str = response.json()["prompt"]
        return text


@dataclass
class Proxy:
    url: str
    journal: Path
    engine: Engine
    http: httpx.Client
    clients: list[openai.OpenAI | anthropic.Anthropic] = field(default_factory=list)
    """Every SDK client handed out; the fixture closes them. A client left to the garbage collector
    closes its pooled keep-alive socket there, in whichever later test that happens to be, as a
    ResourceWarning that pytest reports against that test."""

    @property
    def tap(self) -> Tap:
        return self.engine.tap

    def openai(self) -> openai.OpenAI:
        client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="dummy", max_retries=0, timeout=120)
        self.clients.append(client)
        return client

    def anthropic(self) -> anthropic.Anthropic:
        client = anthropic.Anthropic(base_url=self.url, api_key="dummy", max_retries=0, timeout=120)
        self.clients.append(client)
        return client

    def turns(self) -> list[Turn]:
        recovered = read_journal(self.journal)
        assert recovered.dropped_bytes == 0
        turns = [turn_from_record(r) for r in recovered.records if r.get("type") == "turn"]
        return sorted(turns, key=lambda t: t.index)

    def trajectory(self) -> dict[str, Any]:
        response = self.http.get("/trajectory")
        assert response.status_code == 200, response.text
        data: dict[str, Any] = response.json()
        return data

    def metrics(self) -> str:
        return self.http.get("/metrics").text


@contextmanager
def start_engine(root: Path) -> Iterator[Engine]:
    """vLLM serving the tiny model (made under `root`) with a tap in front; stopped on exit."""
    model_dir = make_tiny_model(root / "model", seed=0)
    with VllmServer(model_dir, max_model_len=MAX_MODEL_LEN, log_path=root / "vllm.log") as server:
        tap = Tap(server.url)
        with serve(tap) as tap_url:
            yield Engine(server.url, tap_url, tap, model_dir, server.startup_seconds or 0.0)


@contextmanager
def open_proxy(engine: Engine, folder: Path, **settings: Any) -> Iterator[Proxy]:
    """A proxy (`ProxyApp` under uvicorn) in front of `engine`'s tap, journaling under `folder`; the
    tap's record and rewrite are cleared first. `settings`: more `ProxySettings` fields."""
    engine.tap.clear()
    config = ProxySettings(
        upstream=engine.tap_url,
        journal=folder / "journal",
        read_timeout_seconds=300,
        retry_budget_seconds=10,
        **settings,
    )
    with serve(ProxyApp(config)) as url, httpx.Client(base_url=url, timeout=60) as http:
        handle = Proxy(url, folder / "journal", engine, http)
        try:
            yield handle
        finally:
            for client in handle.clients:
                client.close()


# -- checks ----------------------------------------------------------------------------------------


def assert_turn_is_what_vllm_sent(turn: Turn, answer: Answer) -> None:
    where = f"turn {turn.index}"
    assert turn.prompt_token_ids == answer.prompt_token_ids, where
    assert turn.completion_token_ids == answer.completion_token_ids, where
    assert turn.completion_logprobs == answer.completion_logprobs, where
    assert turn.finish_reason == answer.finish_reason, where
    assert turn.policy_versions == [WEIGHT_VERSION], where
    assert turn.prompt_token_ids and turn.completion_token_ids, where
    assert all(lp <= 0.0 and math.isfinite(lp) for lp in turn.completion_logprobs), where


def check_journal(proxy: Proxy, *, ordered: bool = True) -> list[tuple[Turn, Answer]]:
    """Every journaled turn equals, exactly, an answer vLLM sent through the tap, and every
    answer vLLM sent was journaled. `ordered`: calls were made one after another, so turn i is
    the i-th chat completion (else they are matched by their prompt, unique per call)."""
    turns = proxy.turns()
    exchanges = proxy.tap.chat()
    assert len(turns) == len(exchanges), (len(turns), len(exchanges))
    assert [t.index for t in turns] == list(range(len(turns)))
    answers = [e.answer() for e in exchanges]
    if ordered:
        pairs = list(zip(turns, answers, strict=True))
    else:
        by_prompt = {tuple(a.prompt_token_ids): a for a in answers}
        assert len(by_prompt) == len(answers), "prompts must be unique to match turns to answers"
        pairs = [(t, by_prompt[tuple(t.prompt_token_ids)]) for t in turns]
    for turn, answer in pairs:
        assert_turn_is_what_vllm_sent(turn, answer)
    return pairs


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of a metric's series whose labels include `labels` (0 when absent)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        match = re.fullmatch(r"([a-z_]+)(\{(.*)\})? (\S+)", line)
        if not match or match.group(1) != name:
            continue
        found = dict(re.findall(r'([a-z_]+)="([^"]*)"', match.group(3) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            total += float(match.group(4))
    return total


def assert_no_failed_calls(proxy: Proxy, calls: int) -> None:
    text = proxy.metrics()
    assert metric(text, "legorl_proxy_requests_total", outcome="ok") == calls, text
    assert metric(text, "legorl_proxy_requests_total") == calls, text
    assert metric(text, "legorl_proxy_errors_total") == 0, text
    trajectory = proxy.trajectory()
    assert trajectory["errors"] == {}
    assert trajectory["state"] == "running"
    assert trajectory["policyVersions"] == [WEIGHT_VERSION]

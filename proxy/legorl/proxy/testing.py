"""A fake rollout engine that speaks vLLM's chat API, for tests and the overhead benchmark.

It stands in for vLLM only where a real engine would hide what is measured (the proxy's own
latency) or cannot be made to fail on cue (503 storms, garbage, hangs, dropped streams). Its
"chat template" renders each message as `[START, role] + utf-8 bytes + [END]` (bytes shifted past
the special ids), so a follow-up prompt extends the previous prompt + completion exactly, like a
well-behaved real template, and a rewritten history does not.

Markers in the last user message steer it: `CALL_TOOL` (answer with a tool call), `OVERFLOW`
(vLLM's 400 for a too-long prompt), `GARBAGE` (a 200 that is not JSON), `HANG` (never answer),
`DROP` (close the stream half-way), `FAIL500` (an internal error), `SAY:<text>` (reply <text>).
`POST /fake/unavailable {"count": N}` makes the next N calls answer 503 (a weight swap);
`POST /fake/version {"version": "v1"}` changes what `/weight_info` reports;
`POST /pause`, `POST /finish_weight_update {"weight_version": "v1"}` and `POST /resume` swap weights as
vLLM's RL routes do with `mode=keep` (a paused engine holds its calls and streams where they are);
`POST /fake/kv {"usage": 0.97}` sets the KV cache usage `/metrics` reports.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

__all__ = ["FakeEngine", "render_prompt"]

START, END, ASSISTANT_ROLE = 1, 2, 3
_ROLE_IDS = {"system": 4, "user": 5, "assistant": ASSISTANT_ROLE, "tool": 6}
_OFFSET = 16

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return json.dumps(content)


def _message_text(message: dict[str, Any]) -> str:
    text = _text(message.get("content"))
    for call in message.get("tool_calls") or []:
        function = call.get("function", {})
        text += json.dumps({"name": function.get("name"), "arguments": function.get("arguments")})
    return text


def _encode(text: str) -> list[int]:
    return [b + _OFFSET for b in text.encode()]


def render_prompt(messages: list[dict[str, Any]]) -> list[int]:
    """The fake's prompt token ids for `messages` (with the generation prompt)."""
    ids: list[int] = []
    for message in messages:
        ids += [START, _ROLE_IDS.get(message.get("role", "user"), 5), *_encode(_message_text(message)), END]
    return [*ids, START, ASSISTANT_ROLE]


def _logprob(token: int, position: int) -> float:
    # Deterministic, distinct, and float32-exact so equality checks are meaningful.
    return float(-((token * 31 + position * 7) % 97 + 1) / 128)


class FakeEngine:
    """An ASGI app; serve it with uvicorn on a port of its own."""

    def __init__(self, *, chunk_tokens: int = 4, delay_per_chunk: float = 0.0, reply: str = "ok") -> None:
        self.chunk_tokens = chunk_tokens
        self.delay_per_chunk = delay_per_chunk
        self.reply = reply
        self.version = "0"
        self.unavailable = 0
        self.calls = 0
        self.requests: list[dict[str, Any]] = []
        self.record_requests = True
        self.kv_usage = 0.0
        self._running: asyncio.Event | None = None

    async def running(self) -> None:
        """Returns at once unless paused; then when resumed."""
        if self._running is not None:
            await self._running.wait()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            if scope["type"] == "lifespan":
                while True:
                    message = await receive()
                    await send({"type": message["type"] + ".complete"})
                    if message["type"] == "lifespan.shutdown":
                        return
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        path, method = scope["path"], scope["method"]
        data = json.loads(body) if body else {}
        if path == "/weight_info":
            await self._json(send, 200, {"weight_version": self.version})
        elif path == "/fake/unavailable":
            self.unavailable = int(data.get("count", 1))
            await self._json(send, 200, {})
        elif path == "/metrics":
            text = f'vllm:kv_cache_usage_perc{{engine="0",model_name="policy"}} {self.kv_usage}\n'
            await send(
                {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]}
            )
            await send({"type": "http.response.body", "body": text.encode()})
        elif path == "/fake/kv":
            self.kv_usage = float(data["usage"])
            await self._json(send, 200, {})
        elif path == "/fake/version":
            self.version = str(data["version"])
            await self._json(send, 200, {})
        elif path == "/pause" and method == "POST":
            if self._running is None:
                self._running = asyncio.Event()
            self._running.clear()
            await self._json(send, 200, {"status": "paused"})
        elif path == "/resume" and method == "POST":
            if self._running is not None:
                self._running.set()
            await self._json(send, 200, {"status": "resumed"})
        elif path == "/finish_weight_update" and method == "POST":
            self.version = str(data["weight_version"])
            await self._json(send, 200, {"message": "Weight update finished"})
        elif path == "/tokenize":
            ids = render_prompt(data.get("messages", []))
            await self._json(send, 200, {"count": len(ids), "tokens": ids, "max_model_len": 4096})
        elif path == "/v1/chat/completions" and method == "POST":
            await self._chat(data, send)
        else:
            await self._json(
                send, 404, {"error": {"message": "not found", "type": "NotFoundError", "code": 404}}
            )

    @staticmethod
    async def _json(send: Send, status: int, body: Any) -> None:
        data = json.dumps(body).encode()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": data})

    def _answer(self, request: dict[str, Any], last: str) -> tuple[str, list[dict[str, Any]], str]:
        tools = request.get("tools") or []
        wants_tool = request.get("tool_choice") not in (None, "auto", "none") or "CALL_TOOL" in last
        if tools and wants_tool:
            name = tools[0]["function"]["name"]
            choice = request.get("tool_choice")
            if isinstance(choice, dict):
                name = choice["function"]["name"]
            arguments = json.dumps({"command": "ls -la"})
            call = {
                "id": f"call_{self.calls}",
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            }
            return "", [call], "tool_calls"
        text = last.split("SAY:", 1)[1].strip() if "SAY:" in last else self.reply
        return text, [], "stop"

    async def _chat(self, request: dict[str, Any], send: Send) -> None:  # noqa: PLR0915 - one fake, read top to bottom
        self.calls += 1
        if self.record_requests:
            self.requests.append(request)
        if self.unavailable > 0:
            self.unavailable -= 1
            await self._json(
                send, 503, {"error": {"message": "engine paused for a weight update", "code": 503}}
            )
            return
        messages = request.get("messages", [])
        last = _text(messages[-1].get("content")) if messages else ""
        if "OVERFLOW" in last:
            message = (
                "This model's maximum context length is 4096 tokens. However, you requested 9000 tokens "
                "(8000 in the messages, 1000 in the completion). Please reduce the length."
            )
            await self._json(
                send, 400, {"error": {"message": message, "type": "BadRequestError", "code": 400}}
            )
            return
        if "FAIL500" in last:
            await self._json(
                send, 500, {"error": {"message": "EngineCore died", "type": "InternalServerError"}}
            )
            return
        if "GARBAGE" in last:
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"application/json")],
                }
            )
            await send({"type": "http.response.body", "body": b"<html>not json"})
            return
        if "HANG" in last:
            await asyncio.sleep(3600)
        await self.running()
        prompt = render_prompt(messages)
        text, calls, finish = self._answer(request, last)
        content_ids = _encode(text or "".join(json.dumps(c["function"]) for c in calls))
        max_tokens = request.get("max_tokens")
        if max_tokens is not None and len(content_ids) + 1 > max_tokens:
            content_ids = content_ids[:max_tokens]
            text = bytes(i - _OFFSET for i in content_ids).decode(errors="ignore") if text else ""
            finish, calls = "length", []
            completion = content_ids
        else:
            completion = [*content_ids, END]
        offset = len(prompt)
        logprobs = [_logprob(t, offset + i) for i, t in enumerate(completion)]
        entries: list[dict[str, Any]] = [
            {"token": f"token_id:{t}", "logprob": lp, "bytes": None, "top_logprobs": []}
            for t, lp in zip(completion, logprobs, strict=True)
        ]
        created = int(time.time())
        cid = f"chatcmpl-fake{self.calls}"
        usage = {
            "prompt_tokens": len(prompt),
            "completion_tokens": len(completion),
            "total_tokens": len(prompt) + len(completion),
        }
        if not request.get("stream"):
            reply: dict[str, Any] = {"role": "assistant", "content": text or None, "tool_calls": calls}
            body = {
                "id": cid,
                "object": "chat.completion",
                "created": created,
                "model": request.get("model"),
                "choices": [
                    {
                        "index": 0,
                        "message": reply,
                        "logprobs": {"content": entries},
                        "finish_reason": finish,
                        "stop_reason": None,
                        "token_ids": completion,
                    }
                ],
                "usage": usage,
                "prompt_token_ids": prompt,
            }
            await self._json(send, 200, body)
            return
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )

        async def chunk(payload: dict[str, Any]) -> None:
            line = b"data: " + json.dumps(payload).encode() + b"\n\n"
            await send({"type": "http.response.body", "body": line, "more_body": True})

        base = {
            "id": cid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": request.get("model"),
        }
        await chunk(
            {
                **base,
                "choices": [
                    {
                        "index": 0,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                        "token_ids": [],
                    }
                ],
                "prompt_token_ids": prompt,
            }
        )
        step = max(1, self.chunk_tokens)
        n_chunks = math.ceil(len(completion) / step)
        for k in range(n_chunks):
            if self.delay_per_chunk:
                await asyncio.sleep(self.delay_per_chunk)
            await self.running()
            if "DROP" in last and k >= n_chunks // 2:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
            ids = completion[k * step : (k + 1) * step]
            delta: dict[str, Any] = {}
            if text:
                delta["content"] = bytes(i - _OFFSET for i in ids if i >= _OFFSET).decode(errors="ignore")
            elif calls and k == 0:
                delta["tool_calls"] = [
                    {
                        "index": 0,
                        "id": calls[0]["id"],
                        "type": "function",
                        "function": {
                            "name": calls[0]["function"]["name"],
                            "arguments": calls[0]["function"]["arguments"],
                        },
                    }
                ]
            last_chunk = k == n_chunks - 1
            await chunk(
                {
                    **base,
                    "choices": [
                        {
                            "index": 0,
                            "delta": delta,
                            "logprobs": {"content": entries[k * step : (k + 1) * step]},
                            "finish_reason": finish if last_chunk else None,
                            "stop_reason": None,
                            "token_ids": ids,
                        }
                    ],
                }
            )
        await chunk({**base, "choices": [], "usage": usage})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

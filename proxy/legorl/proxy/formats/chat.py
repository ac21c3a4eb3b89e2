"""OpenAI Chat Completions: the harness's request checked and sent on, the answer in its schema."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from legorl.api.trajectory import ApiFormat
from legorl.proxy.errors import ProxyError, error_body
from legorl.proxy.formats.common import (
    Completion,
    Event,
    LogprobsDelta,
    Prepared,
    ReasoningDelta,
    TextDelta,
    ToolCallArgs,
    ToolCallStart,
    check_function_tool,
    engine_body,
    number,
    positive_int,
    sse,
    string_list,
    tool_list,
)

if TYPE_CHECKING:
    from legorl.proxy.settings import ProxySettings

API_FORMAT = ApiFormat.OPENAI_CHAT

_ROLES = {"system", "developer", "user", "assistant", "tool", "function"}
# Passed to the engine as they are; sampling penalties are not: the trainer scores the raw
# policy, so anything that reshapes the sampling distribution would bias the behaviour log-probs.
_FORWARDED = ("seed", "response_format", "parallel_tool_calls")


def _messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise ProxyError("invalid_request", "messages must be a non-empty list", param="messages")
    out = []
    for i, message in enumerate(value):
        if (
            not isinstance(message, dict)
            or not isinstance(message.get("role"), str)
            or message["role"] not in _ROLES
        ):
            raise ProxyError(
                "invalid_request",
                f"messages[{i}] must be an object with a role in {sorted(_ROLES)}",
                param=f"messages[{i}]",
            )
        calls = message.get("tool_calls")
        if calls is not None and (not isinstance(calls, list) or not all(_is_tool_call(c) for c in calls)):
            raise ProxyError(
                "invalid_request",
                f"messages[{i}].tool_calls must be a list of {{id: string, function: {{...}}}} objects",
                param=f"messages[{i}].tool_calls",
            )
        # Chat templates know `system`; `developer` is the newer name for the same thing.
        out.append({**message, "role": "system"} if message["role"] == "developer" else message)
    return out


def _is_tool_call(call: Any) -> bool:
    """An assistant message's tool call as the engine's chat template reads it: an object with a `function`
    object and, where it has one, a string id."""
    if not isinstance(call, dict):
        return False
    return isinstance(call.get("function"), dict) and isinstance(call.get("id", ""), str)


def _tools(value: Any) -> list[dict[str, Any]] | None:
    value = tool_list(value)
    if value is None:
        return None
    for i, tool in enumerate(value):
        if (
            not isinstance(tool, dict)
            or tool.get("type") != "function"
            or not isinstance(tool.get("function"), dict)
        ):
            raise ProxyError(
                "invalid_request",
                f"tools[{i}] must be {{type: function, function: {{...}}}}",
                param=f"tools[{i}]",
            )
        check_function_tool(tool["function"].get("name"), tool["function"].get("parameters"), f"tools[{i}]")
    return value or None


def prepare(body: dict[str, Any], settings: ProxySettings) -> Prepared:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ProxyError("invalid_request", "model is required", param="model")
    if body.get("n") not in (None, 1):
        raise ProxyError("invalid_request", "n must be 1: the run controller samples groups", param="n")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ProxyError("invalid_request", "stream must be a boolean", param="stream")
    want_logprobs = body.get("logprobs") is True
    top = body.get("top_logprobs")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= 20):
        raise ProxyError(
            "invalid_request", "top_logprobs must be an integer in [0, 20]", param="top_logprobs"
        )
    options = body.get("stream_options") or {}
    max_tokens = positive_int(body, "max_completion_tokens") or positive_int(body, "max_tokens")
    upstream = engine_body(
        messages=_messages(body.get("messages")),
        stream=stream,
        settings=settings,
        max_tokens=max_tokens,
        temperature=number(body, "temperature", low=0.0, high=2.0),
        top_p=number(body, "top_p", low=0.0, high=1.0),
        stop=string_list(body.get("stop"), "stop"),
        tools=_tools(body.get("tools")),
        tool_choice=body.get("tool_choice"),
        top_logprobs=top if want_logprobs else None,
        extra={k: body[k] for k in _FORWARDED if k in body},
    )
    return Prepared(
        body=upstream,
        stream=stream,
        client_model=model,
        options={
            "logprobs": want_logprobs,
            "include_usage": isinstance(options, dict) and options.get("include_usage") is True,
        },
    )


def _usage(comp: Completion) -> dict[str, int]:
    return {
        "prompt_tokens": comp.prompt_tokens,
        "completion_tokens": comp.completion_tokens,
        "total_tokens": comp.prompt_tokens + comp.completion_tokens,
    }


def _tool_calls(comp: Completion) -> list[dict[str, Any]]:
    return [
        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in comp.tool_calls
    ]


def response(prepared: Prepared, comp: Completion) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": comp.text or None}
    if comp.reasoning:
        message["reasoning_content"] = comp.reasoning
    if comp.tool_calls:
        message["tool_calls"] = _tool_calls(comp)
    return {
        "id": comp.id,
        "object": "chat.completion",
        "created": comp.created,
        "model": prepared.client_model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": {"content": comp.logprobs_content} if prepared.options["logprobs"] else None,
                "finish_reason": comp.finish_reason,
            }
        ],
        "usage": _usage(comp),
    }


class Encoder:
    """Chat Completions chunks from normalised stream events."""

    def __init__(self, prepared: Prepared) -> None:
        self.prepared = prepared
        self._id = ""
        self._created = 0

    def _chunk(self, delta: dict[str, Any], **extra: Any) -> bytes:
        return sse(
            {
                "id": self._id,
                "object": "chat.completion.chunk",
                "created": self._created,
                "model": self.prepared.client_model,
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None, **extra}],
            }
        )

    def head(self, comp: Completion) -> list[bytes]:
        self._id, self._created = comp.id, comp.created
        return [self._chunk({"role": "assistant", "content": ""})]

    def event(self, event: Event) -> list[bytes]:
        if isinstance(event, TextDelta):
            logprobs = {"content": event.logprobs} if self.prepared.options["logprobs"] else None
            return [self._chunk({"content": event.text}, logprobs=logprobs)]
        if isinstance(event, LogprobsDelta):
            if not self.prepared.options["logprobs"]:
                return []
            return [self._chunk({}, logprobs={"content": event.logprobs})]
        if isinstance(event, ReasoningDelta):
            return [self._chunk({"reasoning_content": event.text})]
        if isinstance(event, ToolCallStart):
            call = {"index": event.index, "id": event.id, "type": "function"}
            return [
                self._chunk({"tool_calls": [{**call, "function": {"name": event.name, "arguments": ""}}]})
            ]
        if isinstance(event, ToolCallArgs):
            return [
                self._chunk({"tool_calls": [{"index": event.index, "function": {"arguments": event.delta}}]})
            ]
        return []

    def tail(self, comp: Completion) -> list[bytes]:
        out = [self._chunk({}, finish_reason=comp.finish_reason)]
        if self.prepared.options["include_usage"]:
            out.append(
                sse(
                    {
                        "id": self._id,
                        "object": "chat.completion.chunk",
                        "created": self._created,
                        "model": self.prepared.client_model,
                        "choices": [],
                        "usage": _usage(comp),
                    }
                )
            )
        out.append(sse("[DONE]"))
        return out

    def error(self, error: ProxyError) -> list[bytes]:
        # OpenAI's SDKs raise on a chunk that carries `error`; no [DONE] follows a failed stream.
        return [sse(error_body(API_FORMAT, error))]

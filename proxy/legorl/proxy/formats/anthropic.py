"""Anthropic Messages: content blocks and tool_use translated to chat messages, and back.

What Claude Code sends beyond the engine's reach is accepted and dropped, not refused:
`thinking`, `cache_control`, `metadata`, `context_management`, `output_config`, betas, and
`role: "system"` entries inside `messages` (they become user messages where they are, see
`common.system_first`).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from legorl.api.trajectory import ApiFormat
from legorl.proxy.errors import ProxyError, error_body
from legorl.proxy.formats.common import (
    Completion,
    Event,
    Prepared,
    TextDelta,
    ToolCallArgs,
    ToolCallStart,
    engine_body,
    function_tool,
    new_id,
    number,
    parse_arguments,
    positive_int,
    sse,
    string_list,
    tool_list,
)

if TYPE_CHECKING:
    from legorl.proxy.settings import ProxySettings

API_FORMAT = ApiFormat.ANTHROPIC_MESSAGES


def _text_of(content: Any, where: str) -> str:
    """Plain text of a string or a list of text blocks (other blocks are not text: dropped)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ProxyError("invalid_request", f"{where} must be a string or a list of blocks", param=where)
    parts = []
    for i, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise ProxyError("invalid_request", f"{where}[{i}] must be a block with a type", param=where)
        if block["type"] == "text":
            if not isinstance(block.get("text"), str):
                raise ProxyError("invalid_request", f"{where}[{i}].text must be a string", param=where)
            parts.append(block["text"])
    return "\n".join(parts)


def _image_part(block: dict[str, Any]) -> dict[str, Any] | None:
    source = block.get("source")
    if not isinstance(source, dict):
        return None
    if source.get("type") == "base64":
        url = f"data:{source.get('media_type', 'image/png')};base64,{source.get('data', '')}"
    elif source.get("type") == "url":
        url = source.get("url", "")
    else:
        return None
    return {"type": "image_url", "image_url": {"url": url}}


def _user_message(blocks: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    """Tool results become `tool` messages (they answer the previous assistant turn, so they come
    first); text and images become one user message."""
    out: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for i, block in enumerate(blocks):
        kind = block["type"]
        if kind == "tool_result":
            tool_id = block.get("tool_use_id")
            if not isinstance(tool_id, str):
                raise ProxyError("invalid_request", f"{where}[{i}].tool_use_id must be a string", param=where)
            text = _text_of(block.get("content"), f"{where}[{i}].content")
            if block.get("is_error"):
                text = f"Error: {text}"
            out.append({"role": "tool", "tool_call_id": tool_id, "content": text})
        elif kind == "text":
            parts.append({"type": "text", "text": _text_of([block], f"{where}[{i}]")})
        elif kind == "image":
            image = _image_part(block)
            if image is not None:
                parts.append(image)
    if parts:
        if all(p["type"] == "text" for p in parts):
            out.append({"role": "user", "content": "\n".join(p["text"] for p in parts)})
        else:
            out.append({"role": "user", "content": parts})
    return out


def _assistant_message(blocks: list[dict[str, Any]], where: str) -> dict[str, Any]:
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for i, block in enumerate(blocks):
        if block["type"] == "text":
            texts.append(_text_of([block], f"{where}[{i}]"))
        elif block["type"] == "tool_use":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise ProxyError(
                    "invalid_request", f"{where}[{i}]: tool_use needs an id and a name", param=where
                )
            calls.append(
                {
                    "id": block["id"],
                    "type": "function",
                    "function": {"name": block["name"], "arguments": json.dumps(block.get("input") or {})},
                }
            )
        # thinking / redacted_thinking blocks: the engine regenerates its own reasoning.
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
    if calls:
        message["tool_calls"] = calls
    return message


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    system = _text_of(body.get("system"), "system")
    if system:
        out.append({"role": "system", "content": system})
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ProxyError("invalid_request", "messages: at least one message is required", param="messages")
    for i, message in enumerate(messages):
        where = f"messages.{i}"
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant", "system"):
            raise ProxyError("invalid_request", f"{where}: role must be user or assistant", param=where)
        content = message.get("content")
        if isinstance(content, str):
            blocks: list[dict[str, Any]] = [{"type": "text", "text": content}]
        elif isinstance(content, list):
            for j, block in enumerate(content):
                if not isinstance(block, dict) or not isinstance(block.get("type"), str):
                    raise ProxyError(
                        "invalid_request", f"{where}.content.{j}: a block needs a type", param=where
                    )
            blocks = content
        else:
            raise ProxyError("invalid_request", f"{where}.content must be a string or a list", param=where)
        role = message["role"]
        if role == "system":
            out.append({"role": "system", "content": _text_of(blocks, f"{where}.content")})
        elif role == "user":
            out.extend(_user_message(blocks, f"{where}.content"))
        else:
            out.append(_assistant_message(blocks, f"{where}.content"))
    return out


def _tools(value: Any) -> list[dict[str, Any]] | None:
    tools = []
    for i, tool in enumerate(tool_list(value) or []):
        if not isinstance(tool, dict):
            raise ProxyError("invalid_request", f"tools.{i} must be an object", param="tools")
        if tool.get("type") not in (None, "custom") and "input_schema" not in tool:
            continue  # server tools (web_search, bash_20250124...) run at the vendor, not here
        schema = tool.get("input_schema")
        if schema is None:
            raise ProxyError("invalid_request", f"tools.{i}.input_schema: field required", param="tools")
        tools.append(function_tool(tool, schema, f"tools.{i}"))
    return tools or None


def _tool_choice(value: Any) -> Any:
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "auto":
        return "auto"
    if kind == "any":
        return "required"
    if kind == "none":
        return "none"
    if kind == "tool" and isinstance(value.get("name"), str):
        return {"type": "function", "function": {"name": value["name"]}}
    raise ProxyError("invalid_request", "tool_choice.type must be auto, any, tool (with a name) or none")


def prepare(body: dict[str, Any], settings: ProxySettings) -> Prepared:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ProxyError("invalid_request", "model: field required", param="model")
    max_tokens = positive_int(body, "max_tokens")
    if max_tokens is None:
        raise ProxyError("invalid_request", "max_tokens: field required", param="max_tokens")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ProxyError("invalid_request", "stream must be a boolean", param="stream")
    tools = _tools(body.get("tools"))
    upstream = engine_body(
        messages=_messages(body),
        stream=stream,
        settings=settings,
        max_tokens=max_tokens,
        temperature=number(body, "temperature", low=0.0, high=2.0),
        top_p=number(body, "top_p", low=0.0, high=1.0),
        stop=string_list(body.get("stop_sequences"), "stop_sequences"),
        tools=tools,
        tool_choice=_tool_choice(body.get("tool_choice")) if tools else None,
    )
    return Prepared(body=upstream, stream=stream, client_model=model)


def _stop_reason(comp: Completion) -> tuple[str, str | None]:
    # A call cut by the token budget is `max_tokens` even if a tool call had begun, as Anthropic
    # reports it: the harness must not run a half-written call.
    if comp.finish_reason == "length":
        return "max_tokens", None
    if comp.tool_calls:
        return "tool_use", None
    if comp.finish_reason == "content_filter":
        return "refusal", None
    if isinstance(comp.stop_reason, str):
        return "stop_sequence", comp.stop_reason
    return "end_turn", None


def response(prepared: Prepared, comp: Completion) -> dict[str, Any]:
    content: list[dict[str, Any]] = []
    if comp.text:
        content.append({"type": "text", "text": comp.text})
    for call in comp.tool_calls:
        content.append(
            {"type": "tool_use", "id": call.id, "name": call.name, "input": parse_arguments(call.arguments)}
        )
    stop_reason, stop_sequence = _stop_reason(comp)
    return {
        "id": f"msg_{comp.id.removeprefix('chatcmpl-')}",
        "type": "message",
        "role": "assistant",
        "model": prepared.client_model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": {"input_tokens": comp.prompt_tokens, "output_tokens": comp.completion_tokens},
    }


class Encoder:
    """Anthropic's stream: message_start, content blocks, message_delta, message_stop."""

    def __init__(self, prepared: Prepared) -> None:
        self.prepared = prepared
        self._block = -1
        self._open: str | None = None  # "text" or "tool_use"
        self._arguments = ""

    def head(self, comp: Completion) -> list[bytes]:
        message: dict[str, Any] = {
            "id": f"msg_{comp.id.removeprefix('chatcmpl-')}" if comp.id else new_id("msg_"),
            "type": "message",
            "role": "assistant",
            "model": self.prepared.client_model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": len(comp.prompt_token_ids), "output_tokens": 0},
        }
        return [sse({"type": "message_start", "message": message}, "message_start")]

    def _close(self) -> list[bytes]:
        if self._open is None:
            return []
        out = []
        if self._open == "tool_use":
            # Anthropic's SDKs parse the concatenated input_json_delta pieces as one JSON object
            # and fail the whole stream when they are not; the engine's raw pieces (whitespace
            # padding, a call cut mid-way) may not be. So the arguments go out once, normalised,
            # when the block closes.
            arguments = json.dumps(parse_arguments(self._arguments))
            out.append(self._delta({"type": "input_json_delta", "partial_json": arguments}))
            self._arguments = ""
        self._open = None
        out.append(sse({"type": "content_block_stop", "index": self._block}, "content_block_stop"))
        return out

    def _start(self, block: dict[str, Any], kind: str) -> list[bytes]:
        out = self._close()
        self._block += 1
        self._open = kind
        event = {"type": "content_block_start", "index": self._block, "content_block": block}
        out.append(sse(event, "content_block_start"))
        return out

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return sse(
            {"type": "content_block_delta", "index": self._block, "delta": delta}, "content_block_delta"
        )

    def event(self, event: Event) -> list[bytes]:
        out: list[bytes] = []
        if isinstance(event, TextDelta):
            if self._open != "text":
                out.extend(self._start({"type": "text", "text": ""}, "text"))
            out.append(self._delta({"type": "text_delta", "text": event.text}))
        elif isinstance(event, ToolCallStart):
            out.extend(
                self._start({"type": "tool_use", "id": event.id, "name": event.name, "input": {}}, "tool_use")
            )
        elif isinstance(event, ToolCallArgs):
            self._arguments += event.delta
        return out

    def tail(self, comp: Completion) -> list[bytes]:
        out = self._close()
        stop_reason, stop_sequence = _stop_reason(comp)
        delta = {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
            "usage": {"output_tokens": comp.completion_tokens},
        }
        out.append(sse(delta, "message_delta"))
        out.append(sse({"type": "message_stop"}, "message_stop"))
        return out

    def error(self, error: ProxyError) -> list[bytes]:
        return [sse(error_body(API_FORMAT, error), "error")]

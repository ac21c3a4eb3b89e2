"""OpenAI Responses: input items translated to chat messages, the answer as output items.

Codex resends the whole history every turn (`store: false`), so a stateless translation is
complete; `previous_response_id` (server-side history) is refused with a clear error. Hosted tools
(`web_search`, ...) and reasoning items are dropped: the engine cannot run them.

The engine knows only function tools; two other kinds of client tool become function tools, and
the engine's calls to them go back to the client as the item it expects:

- a custom (freeform) tool (`{"type": "custom", "name", "description", "format"}`, Codex's
  `apply_patch` with a Lark grammar) becomes a function with one string argument, `input`
  (the format's grammar in its description); a call comes back as a `custom_tool_call` with that
  text as its `input`, and the client's `custom_tool_call` / `custom_tool_call_output` history
  items go to the engine as a call with arguments `{"input": ...}` and its tool result;
- a namespace (`{"type": "namespace", "name", "description", "tools": [...]}`, Codex's MCP servers
  and sub-agent tools) is flattened: each tool in it becomes a function named
  `<namespace>__<name>` (`<namespace><name>` when the namespace already ends in `_`, as Codex's
  `mcp__server__` do); a call comes back with `name` and `namespace` apart, as Codex parses it, and
  history items that carry a `namespace` are named the same way for the engine.

The stream always ends with `response.completed` (a truncated answer carries status
`incomplete`), because Codex retries any stream that does not.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
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
    positive_int,
    sse,
    tool_list,
)

if TYPE_CHECKING:
    from legorl.proxy.settings import ProxySettings

API_FORMAT = ApiFormat.OPENAI_RESPONSES

_TEXT_PARTS = {"input_text", "output_text", "text", "refusal"}
CUSTOM_INPUT = "input"
"""The one argument of the function a custom (freeform) tool becomes: the tool's raw text input."""


@dataclass(frozen=True)
class ClientTool:
    """A tool the client knows otherwise than as the engine's function of the same name."""

    name: str
    """The tool's own name (without its namespace)."""
    namespace: str | None = None
    custom: bool = False
    """A custom (freeform) tool: its calls go back as `custom_tool_call` items."""


def qualified_name(namespace: str | None, name: str) -> str:
    """The engine's name for tool `name` of `namespace` (the name itself outside a namespace)."""
    if not namespace:
        return name
    return f"{namespace}{name}" if namespace.endswith("_") else f"{namespace}__{name}"


def custom_input(arguments: str) -> str:
    """A custom tool's input from the engine's call arguments: the `input` string the schema asks
    for, or the arguments as they are when the model wrote something else (the client then reports
    the bad input to the model, as it would a bad patch)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    text = value.get(CUSTOM_INPUT) if isinstance(value, dict) else None
    return text if isinstance(text, str) else arguments


def _custom_arguments(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise ProxyError("invalid_request", f"{where}: custom_tool_call needs an input string", param=where)
    # The spelling of vLLM's tool parsers (json.dumps defaults); the proxy puts the engine's own
    # string back where it knows the call (Trial.restore_tool_arguments).
    return json.dumps({CUSTOM_INPUT: value}, ensure_ascii=False)


def _content(value: Any, where: str) -> str | list[dict[str, Any]]:
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise ProxyError("invalid_request", f"{where} must be a string or a list of parts", param=where)
    parts: list[dict[str, Any]] = []
    for i, part in enumerate(value):
        if not isinstance(part, dict):
            raise ProxyError("invalid_request", f"{where}[{i}] must be an object", param=where)
        kind = part.get("type")
        if isinstance(kind, str) and kind in _TEXT_PARTS:
            text = part.get("text", part.get("refusal"))
            if not isinstance(text, str):
                raise ProxyError("invalid_request", f"{where}[{i}].text must be a string", param=where)
            parts.append({"type": "text", "text": text})
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
    if all(p["type"] == "text" for p in parts):
        return "\n".join(p["text"] for p in parts)
    return parts


def _output_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "\n".join(
            p.get("text", "") for p in value if isinstance(p, dict) and isinstance(p.get("text"), str)
        )
    return json.dumps(value)


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise ProxyError("invalid_request", "instructions must be a string", param="instructions")
        out.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise ProxyError(
            "invalid_request", "input must be a string or a non-empty list of items", param="input"
        )
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise ProxyError("invalid_request", f"{where} must be an object", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise ProxyError(
                    "invalid_request",
                    f"{where}.role must be user, assistant, system or developer",
                    param=where,
                )
            content = _content(item.get("content"), f"{where}.content")
            out.append({"role": "system" if role == "developer" else role, "content": content})
        elif kind in ("function_call", "custom_tool_call"):
            name, call_id = item.get("name"), item.get("call_id")
            if not isinstance(name, str) or not isinstance(call_id, str):
                raise ProxyError("invalid_request", f"{where}: {kind} needs name and call_id", param=where)
            namespace = item.get("namespace")
            arguments = (
                str(item.get("arguments") or "")
                if kind == "function_call"
                else _custom_arguments(item.get("input"), where)
            )
            call = {
                "id": call_id,
                "type": "function",
                "function": {
                    "name": qualified_name(namespace if isinstance(namespace, str) else None, name),
                    "arguments": arguments,
                },
            }
            # An assistant turn is one chat message: its text item and the calls after it (and
            # parallel calls) belong together, as the engine produced them, so the re-rendered
            # history extends the last prompt exactly.
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            call_id = item.get("call_id")
            if not isinstance(call_id, str):
                raise ProxyError("invalid_request", f"{where}: {kind} needs call_id", param=where)
            out.append({"role": "tool", "tool_call_id": call_id, "content": _output_text(item.get("output"))})
        # reasoning, web_search_call and other hosted-tool items: nothing the engine can replay.
    return out


def _custom_tool(tool: dict[str, Any], name: str, where: str) -> dict[str, Any]:
    """A custom (freeform) tool as a function taking its raw text as one string, `input`."""
    fmt = tool.get("format")
    hint = "The tool's input: raw text, not JSON."
    if isinstance(fmt, dict) and fmt.get("type") == "grammar" and isinstance(fmt.get("definition"), str):
        syntax = fmt.get("syntax") if isinstance(fmt.get("syntax"), str) else "grammar"
        hint = f"The tool's input: raw text, not JSON, in this {syntax} grammar:\n{fmt['definition']}"
    parameters = {
        "type": "object",
        "properties": {CUSTOM_INPUT: {"type": "string", "description": hint}},
        "required": [CUSTOM_INPUT],
        "additionalProperties": False,
    }
    return function_tool({**tool, "name": name}, parameters, where)


def _tools(value: Any) -> tuple[list[dict[str, Any]], dict[str, ClientTool]]:
    """The engine's function tools, and the client's own view of those that are not plain
    functions (by the engine's name)."""
    tools: list[dict[str, Any]] = []
    client: dict[str, ClientTool] = {}
    seen: set[str] = set()

    def add(tool: dict[str, Any], namespace: str | None, where: str) -> None:
        kind, name = tool.get("type"), tool.get("name")
        if kind not in ("function", "custom"):
            return  # hosted tools (web_search, tool_search...): the engine cannot run them
        if not isinstance(name, str) or not name:
            raise ProxyError("invalid_request", f"{where}: a tool needs a non-empty string name", param=where)
        engine_name = qualified_name(namespace, name)
        if engine_name in seen:
            return  # the engine could not tell two tools of one name apart: the first one stays
        seen.add(engine_name)
        if kind == "custom":
            tools.append(_custom_tool(tool, engine_name, where))
        else:
            parameters = tool.get("parameters") or {"type": "object"}
            tools.append(function_tool({**tool, "name": engine_name}, parameters, where))
        if kind == "custom" or namespace:
            client[engine_name] = ClientTool(name, namespace, custom=kind == "custom")

    for i, tool in enumerate(tool_list(value) or []):
        if not isinstance(tool, dict):
            raise ProxyError("invalid_request", f"tools[{i}] must be an object", param="tools")
        if tool.get("type") == "namespace":
            namespace, members = tool.get("name"), tool.get("tools")
            if not isinstance(namespace, str) or not namespace or not isinstance(members, list):
                raise ProxyError(
                    "invalid_request",
                    f"tools[{i}]: a namespace needs a name and a list of tools",
                    param="tools",
                )
            for j, member in enumerate(members):
                if not isinstance(member, dict):
                    raise ProxyError(
                        "invalid_request", f"tools[{i}].tools[{j}] must be an object", param="tools"
                    )
                add(member, namespace, f"tools[{i}].tools[{j}]")
        else:
            add(tool, None, f"tools[{i}]")
    return tools, client


def _tool_choice(value: Any) -> Any:
    if value is None or value in ("auto", "none", "required"):
        return value
    if (
        isinstance(value, dict)
        and value.get("type") in ("function", "custom")
        and isinstance(value.get("name"), str)
    ):
        namespace = value.get("namespace")
        name = qualified_name(namespace if isinstance(namespace, str) else None, value["name"])
        return {"type": "function", "function": {"name": name}}
    if isinstance(value, dict):
        return "auto"  # hosted-tool choices: the engine has none of those tools
    raise ProxyError(
        "invalid_request", "tool_choice must be auto, none, required or a function", param="tool_choice"
    )


def prepare(body: dict[str, Any], settings: ProxySettings) -> Prepared:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ProxyError("invalid_request", "model is required", param="model")
    if body.get("previous_response_id"):
        raise ProxyError(
            "invalid_request",
            "previous_response_id is not supported: the proxy stores no responses; send the whole input",
            param="previous_response_id",
        )
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ProxyError("invalid_request", "stream must be a boolean", param="stream")
    tools, client_tools = _tools(body.get("tools"))
    upstream = engine_body(
        messages=_messages(body),
        stream=stream,
        settings=settings,
        max_tokens=positive_int(body, "max_output_tokens"),
        temperature=number(body, "temperature", low=0.0, high=2.0),
        top_p=number(body, "top_p", low=0.0, high=1.0),
        tools=tools or None,
        tool_choice=_tool_choice(body.get("tool_choice")) if tools else None,
    )
    echo = {
        "instructions": body.get("instructions"),
        "tools": body.get("tools") or [],
        "tool_choice": body.get("tool_choice") or "auto",
        "parallel_tool_calls": bool(body.get("parallel_tool_calls", True)),
        "temperature": upstream.get("temperature"),
        "top_p": upstream.get("top_p"),
        "max_output_tokens": body.get("max_output_tokens"),
    }
    return Prepared(
        body=upstream, stream=stream, client_model=model, options={"echo": echo, "tools": client_tools}
    )


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if text else [],
    }


def _call_item(
    prepared: Prepared, call_id: str, engine_name: str, arguments: str, status: str
) -> dict[str, Any]:
    """The output item for one engine tool call, as the client knows the tool: a `function_call`
    (with its `namespace`), or a `custom_tool_call` whose `input` is the call's text."""
    tool: ClientTool | None = prepared.options.get("tools", {}).get(engine_name)
    item: dict[str, Any]
    if tool is not None and tool.custom:
        item = {
            "type": "custom_tool_call",
            "id": new_id("ctc_"),
            "call_id": call_id,
            "name": tool.name,
            "input": custom_input(arguments) if arguments else "",
            "status": status,
        }
    else:
        item = {
            "type": "function_call",
            "id": new_id("fc_"),
            "call_id": call_id,
            "name": tool.name if tool is not None else engine_name,
            "arguments": arguments,
            "status": status,
        }
    if tool is not None and tool.namespace:
        item["namespace"] = tool.namespace
    return item


def _response(
    prepared: Prepared,
    *,
    response_id: str,
    created: float,
    status: str,
    output: list[dict[str, Any]],
    comp: Completion | None,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "status": status,
        "model": prepared.client_model,
        "output": output,
        "error": None,
        "incomplete_details": None,
        **prepared.options["echo"],
    }
    if comp is not None:
        if comp.finish_reason == "length":
            body["incomplete_details"] = {"reason": "max_output_tokens"}
        body["usage"] = {
            "input_tokens": comp.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": comp.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": comp.prompt_tokens + comp.completion_tokens,
        }
    return body


def _status(comp: Completion) -> str:
    return "incomplete" if comp.finish_reason == "length" else "completed"


def response(prepared: Prepared, comp: Completion) -> dict[str, Any]:
    output = []
    if comp.text:
        output.append(_message_item(new_id("msg_"), comp.text, "completed"))
    for call in comp.tool_calls:
        output.append(_call_item(prepared, call.id, call.name, call.arguments, "completed"))
    return _response(
        prepared,
        response_id=new_id("resp_"),
        created=comp.created,
        status=_status(comp),
        output=output,
        comp=comp,
    )


class Encoder:
    """The Responses event stream, every event numbered."""

    def __init__(self, prepared: Prepared) -> None:
        self.prepared = prepared
        self._seq = 0
        self._id = new_id("resp_")
        self._created = time.time()
        self._output: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None
        self._text = ""
        self._arguments = ""
        """The open tool call's arguments, as the engine streamed them."""

    def _event(self, kind: str, **data: Any) -> bytes:
        event = {"type": kind, "sequence_number": self._seq, **data}
        self._seq += 1
        return sse(event, kind)

    def head(self, comp: Completion) -> list[bytes]:
        self._created = comp.created or self._created
        response = _response(
            self.prepared,
            response_id=self._id,
            created=self._created,
            status="in_progress",
            output=[],
            comp=None,
        )
        return [
            self._event("response.created", response=response),
            self._event("response.in_progress", response=response),
        ]

    def _close(self) -> list[bytes]:
        item, self._open = self._open, None
        if item is None:
            return []
        index = len(self._output)
        out = []
        if item["type"] == "message":
            part = {"type": "output_text", "text": self._text, "annotations": [], "logprobs": []}
            where = {"item_id": item["id"], "output_index": index, "content_index": 0}
            out.append(self._event("response.output_text.done", **where, text=self._text, logprobs=[]))
            out.append(self._event("response.content_part.done", **where, part=part))
            item = _message_item(item["id"], self._text, "completed")
        elif item["type"] == "custom_tool_call":
            # The input is the `input` string inside the engine's JSON arguments: known whole only
            # once the call is complete, so it goes out as one delta.
            text = custom_input(self._arguments) if self._arguments else ""
            where = {"item_id": item["id"], "output_index": index}
            if text:
                out.append(self._event("response.custom_tool_call_input.delta", **where, delta=text))
            out.append(self._event("response.custom_tool_call_input.done", **where, input=text))
            item = {**item, "input": text, "status": "completed"}
        else:
            out.append(
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    name=item["name"],
                    arguments=self._arguments,
                )
            )
            item = {**item, "arguments": self._arguments, "status": "completed"}
        out.append(self._event("response.output_item.done", output_index=index, item=item))
        self._output.append(item)
        return out

    def event(self, event: Event) -> list[bytes]:
        out: list[bytes] = []
        index = len(self._output)
        if isinstance(event, TextDelta):
            if self._open is None or self._open["type"] != "message":
                out.extend(self._close())
                index = len(self._output)
                self._open = {"type": "message", "id": new_id("msg_")}
                self._text = ""
                item = {**_message_item(self._open["id"], "", "in_progress"), "content": []}
                out.append(self._event("response.output_item.added", output_index=index, item=item))
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                out.append(
                    self._event(
                        "response.content_part.added",
                        item_id=self._open["id"],
                        output_index=index,
                        content_index=0,
                        part=part,
                    )
                )
            self._text += event.text
            out.append(
                self._event(
                    "response.output_text.delta",
                    item_id=self._open["id"],
                    output_index=index,
                    content_index=0,
                    delta=event.text,
                    logprobs=[],
                )
            )
        elif isinstance(event, ToolCallStart):
            out.extend(self._close())
            index = len(self._output)
            self._open = _call_item(self.prepared, event.id, event.name, "", "in_progress")
            self._arguments = ""
            out.append(self._event("response.output_item.added", output_index=index, item=dict(self._open)))
        elif isinstance(event, ToolCallArgs) and self._open is not None and self._open["type"] != "message":
            self._arguments += event.delta
            if self._open["type"] == "function_call":
                out.append(
                    self._event(
                        "response.function_call_arguments.delta",
                        item_id=self._open["id"],
                        output_index=index,
                        delta=event.delta,
                    )
                )
        return out

    def tail(self, comp: Completion) -> list[bytes]:
        out = self._close()
        response = _response(
            self.prepared,
            response_id=self._id,
            created=self._created,
            status=_status(comp),
            output=self._output,
            comp=comp,
        )
        out.append(self._event("response.completed", response=response))
        return out

    def error(self, error: ProxyError) -> list[bytes]:
        body = error_body(API_FORMAT, error)["error"]
        response = _response(
            self.prepared,
            response_id=self._id,
            created=self._created,
            status="failed",
            output=self._output,
            comp=None,
        )
        response["error"] = {"code": "server_error", "message": error.message}
        return [
            self._event("error", code=body["code"], message=body["message"], param=body["param"]),
            # The response's own terminal event, as OpenAI ends a failed stream.
            self._event("response.failed", response=response),
        ]

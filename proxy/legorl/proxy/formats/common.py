"""What the three client formats share: the engine's answer in one normalised shape.

Every client format is translated to one upstream call, vLLM's `/v1/chat/completions` with
`return_token_ids` and `logprobs` on, so the chat template, the tool parser and the tokenizer are
the engine's own and there is one capture path. The answer (a whole response, or a stream of
chunks) is normalised here into a `Completion` plus stream `Event`s; each format module turns
those into its own schema.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from legorl.proxy import _json as fastjson
from legorl.proxy.errors import ProxyError

if TYPE_CHECKING:
    from legorl.api.trajectory import ApiFormat
    from legorl.proxy.settings import ProxySettings

__all__ = [
    "Completion",
    "Event",
    "LogprobsDelta",
    "Prepared",
    "ReasoningDelta",
    "StreamAccumulator",
    "TextDelta",
    "ToolCall",
    "ToolCallArgs",
    "ToolCallStart",
    "completion_from_response",
    "new_id",
]


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


@dataclass
class Prepared:
    """A client request translated for the engine."""

    body: dict[str, Any]
    """The `/v1/chat/completions` body sent upstream."""
    stream: bool
    """The client asked for a stream."""
    client_model: str
    """The model name the client asked for (echoed back; the engine serves its own)."""
    options: dict[str, Any] = field(default_factory=dict)
    """Format-specific things the answer needs (whether logprobs or usage were asked for...)."""


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str


@dataclass
class Completion:
    """One engine call, normalised: what the client sees and what the journal records."""

    id: str
    created: int
    text: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    finish_reason: str = "stop"
    stop_reason: str | int | None = None
    """The stop string (or token id) that ended generation, when one did."""
    prompt_token_ids: list[int] = field(default_factory=list)
    completion_token_ids: list[int] = field(default_factory=list)
    completion_logprobs: list[float] = field(default_factory=list)
    logprobs_content: list[dict[str, Any]] = field(default_factory=list)
    """The engine's per-token logprob entries (returned to clients that asked for them)."""
    routed_experts: str | None = None
    """The engine's base64 `.npy` of routed experts, undecoded."""
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass(frozen=True)
class TextDelta:
    text: str
    logprobs: list[dict[str, Any]]


@dataclass(frozen=True)
class LogprobsDelta:
    """Sampled tokens that carry no text of their own (end of sequence, a partial UTF-8 byte,
    tool-call syntax the parser holds back): only their log-probs, for clients that asked."""

    logprobs: list[dict[str, Any]]


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArgs:
    index: int
    delta: str


Event = TextDelta | LogprobsDelta | ReasoningDelta | ToolCallStart | ToolCallArgs


class StreamEncoder(Protocol):
    """A format's stream: its events, as SSE bytes, from the normalised `Completion` and `Event`s."""

    def head(self, comp: Completion) -> list[bytes]:
        """What opens the stream, once the engine's first chunk is in."""
        ...

    def event(self, event: Event) -> list[bytes]:
        """One normalised event in the format's own events (maybe none)."""
        ...

    def tail(self, comp: Completion) -> list[bytes]:
        """What closes the stream, once the engine's answer is whole."""
        ...

    def error(self, error: ProxyError) -> list[bytes]:
        """The format's own error event, for a failure after the stream began."""
        ...


class ClientFormat(Protocol):
    """One client API; each of `formats.chat`, `formats.responses` and `formats.anthropic` is one."""

    API_FORMAT: ApiFormat

    def prepare(self, body: dict[str, Any], settings: ProxySettings) -> Prepared:
        """The client's request as one engine call; ProxyError (4xx) on a malformed request."""
        ...

    def response(self, prepared: Prepared, comp: Completion) -> dict[str, Any]:
        """The whole answer in the client's schema."""
        ...

    def Encoder(self, prepared: Prepared) -> StreamEncoder:  # a class in each module
        """The stream encoder of one streamed call."""
        ...


def _garbage(message: str) -> ProxyError:
    return ProxyError("engine_error", f"the engine sent a malformed answer: {message}")


def _int_list(value: Any, what: str) -> list[int]:
    # Prompts are thousands of ids, checked on every call: `sum` runs in C and raises on anything that is
    # not a number, and its result is an int only if every item was one (JSON's true/false would pass as
    # 1/0; no engine sends them). About 4x cheaper than a per-item type check.
    if type(value) is not list:
        raise _garbage(f"{what} is not a list of token ids")
    try:
        total = sum(value)
    except TypeError:
        total = None
    if type(total) is not int:
        raise _garbage(f"{what} is not a list of token ids")
    return value


def _logprob_values(entries: list[dict[str, Any]]) -> list[float]:
    try:
        values = [entry["logprob"] for entry in entries]
    except (TypeError, KeyError):
        values = []
    else:
        if set(map(type, values)) <= {float}:  # what an engine sends: done in C
            return values
    out = []
    for entry in entries:
        value = entry.get("logprob") if isinstance(entry, dict) else None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _garbage("a logprob entry has no numeric logprob")
        out.append(float(value))
    return out


def _choice(body: dict[str, Any]) -> dict[str, Any]:
    choices = body.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        raise _garbage("expected exactly one choice")
    return choices[0]


def completion_from_response(body: Any) -> Completion:
    """Normalise a non-streaming `/v1/chat/completions` answer."""
    if not isinstance(body, dict):
        raise _garbage("the body is not a JSON object")
    choice = _choice(body)
    message = choice.get("message")
    if not isinstance(message, dict):
        raise _garbage("the choice has no message")
    logprobs = choice.get("logprobs") or {}
    entries = logprobs.get("content") or [] if isinstance(logprobs, dict) else []
    tool_calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        tool_calls.append(
            ToolCall(
                id=str(call.get("id") or new_id("call_")),
                name=str(function.get("name", "")),
                arguments=str(function.get("arguments") or ""),
            )
        )
    usage = body.get("usage") or {}
    prompt_ids = _int_list(body.get("prompt_token_ids"), "prompt_token_ids")
    completion_ids = _int_list(choice.get("token_ids"), "token_ids")
    return Completion(
        id=str(body.get("id") or new_id("chatcmpl-")),
        created=int(body.get("created") or time.time()),
        text=message.get("content") or "",
        reasoning=message.get("reasoning_content") or message.get("reasoning") or "",
        tool_calls=tool_calls,
        finish_reason=str(choice.get("finish_reason") or "stop"),
        stop_reason=choice.get("stop_reason"),
        prompt_token_ids=prompt_ids,
        completion_token_ids=completion_ids,
        completion_logprobs=_logprob_values(entries),
        logprobs_content=list(entries),
        routed_experts=choice.get("routed_experts"),
        prompt_tokens=int(usage.get("prompt_tokens") or len(prompt_ids)),
        completion_tokens=int(usage.get("completion_tokens") or len(completion_ids)),
    )


class StreamAccumulator:
    """Folds a `/v1/chat/completions` SSE stream into events and, at the end, a `Completion`."""

    def __init__(self) -> None:
        self.completion = Completion(id=new_id("chatcmpl-"), created=int(time.time()))
        self.started = False
        """True once the first chunk with a choice or the prompt's token ids arrived."""
        self.finished = False
        self._tool_index: dict[int, int] = {}
        self._prompt_seen = False

    def feed(self, data: bytes | str) -> list[Event]:
        """One SSE `data:` payload; returns the client-visible events it carries."""
        if data.strip() in (b"[DONE]", "[DONE]"):
            self.finished = True
            return []
        try:
            chunk = fastjson.loads(data)
        except fastjson.JSONDecodeError as exc:
            raise _garbage(f"a stream chunk is not JSON ({exc})") from exc
        if not isinstance(chunk, dict):
            raise _garbage("a stream chunk is not a JSON object")
        if "error" in chunk and "choices" not in chunk:
            error = chunk["error"]
            message = error.get("message") if isinstance(error, dict) else str(error)
            raise ProxyError("engine_error", f"the engine failed mid-stream: {message}")
        comp = self.completion
        if chunk.get("id"):
            comp.id = str(chunk["id"])
        if chunk.get("created"):
            comp.created = int(chunk["created"])
        if chunk.get("prompt_token_ids") is not None:
            comp.prompt_token_ids = _int_list(chunk["prompt_token_ids"], "prompt_token_ids")
            self._prompt_seen = True
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            comp.prompt_tokens = int(usage.get("prompt_tokens") or comp.prompt_tokens)
            comp.completion_tokens = int(usage.get("completion_tokens") or comp.completion_tokens)
        events: list[Event] = []
        choices = chunk.get("choices") or []
        if not isinstance(choices, list) or len(choices) > 1:
            raise _garbage("expected at most one choice per chunk")
        for choice in choices:
            self.started = True
            events.extend(self._choice(choice))
        if self._prompt_seen:
            self.started = True
        return events

    def _choice(self, choice: dict[str, Any]) -> list[Event]:
        comp = self.completion
        events: list[Event] = []
        if choice.get("token_ids"):
            comp.completion_token_ids.extend(_int_list(choice["token_ids"], "token_ids"))
        logprobs = choice.get("logprobs")
        entries = (logprobs.get("content") or []) if isinstance(logprobs, dict) else []
        comp.completion_logprobs.extend(_logprob_values(entries))
        comp.logprobs_content.extend(entries)
        if choice.get("routed_experts") is not None:
            comp.routed_experts = choice["routed_experts"]
        delta = choice.get("delta") or {}
        reasoning = delta.get("reasoning_content") or delta.get("reasoning")
        if reasoning:
            comp.reasoning += reasoning
            events.append(ReasoningDelta(reasoning))
        if delta.get("content"):
            comp.text += delta["content"]
            events.append(TextDelta(delta["content"], list(entries)))
        elif entries:
            events.append(LogprobsDelta(list(entries)))
        for call in delta.get("tool_calls") or []:
            index = int(call.get("index", 0))
            function = call.get("function") or {}
            if index not in self._tool_index:
                self._tool_index[index] = len(comp.tool_calls)
                tool = ToolCall(
                    id=str(call.get("id") or new_id("call_")),
                    name=str(function.get("name") or ""),
                    arguments="",
                )
                comp.tool_calls.append(tool)
                events.append(ToolCallStart(self._tool_index[index], tool.id, tool.name))
            tool = comp.tool_calls[self._tool_index[index]]
            if function.get("name") and not tool.name:
                tool.name = function["name"]
            if function.get("arguments"):
                tool.arguments += function["arguments"]
                events.append(ToolCallArgs(self._tool_index[index], function["arguments"]))
        if choice.get("finish_reason"):
            comp.finish_reason = str(choice["finish_reason"])
            comp.stop_reason = choice.get("stop_reason")
        return events

    def result(self) -> Completion:
        comp = self.completion
        if not self.finished:
            raise _garbage("the stream ended before [DONE]")
        if not comp.prompt_tokens:
            comp.prompt_tokens = len(comp.prompt_token_ids)
        if not comp.completion_tokens:
            comp.completion_tokens = len(comp.completion_token_ids)
        return comp


def number(body: dict[str, Any], key: str, *, low: float, high: float) -> float | None:
    """An optional numeric field, checked, or a 400 that names it."""
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise ProxyError("invalid_request", f"{key} must be a number in [{low}, {high}]", param=key)
    return float(value)


def positive_int(body: dict[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ProxyError("invalid_request", f"{key} must be a positive integer", param=key)
    return value


def string_list(value: Any, key: str) -> list[str] | None:
    if value is None:
        return None
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return value
    raise ProxyError("invalid_request", f"{key} must be a string or a list of strings", param=key)


def check_function_tool(name: Any, parameters: Any, where: str) -> None:
    """A function tool the engine's template and parser can use: a name and an object schema."""
    if not isinstance(name, str) or not name:
        raise ProxyError("invalid_request", f"{where}: a tool needs a non-empty string name", param=where)
    if parameters is not None and not isinstance(parameters, dict):
        raise ProxyError(
            "invalid_request", f"{where} ({name}): the tool's schema must be a JSON object", param=where
        )


def tool_list(value: Any) -> list[Any] | None:
    """The request's `tools`, checked to be a list (None when absent)."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise ProxyError("invalid_request", "tools must be a list", param="tools")
    return value


def function_tool(tool: dict[str, Any], parameters: Any, where: str) -> dict[str, Any]:
    """An Anthropic or Responses function tool as the engine's chat `tools` entry."""
    check_function_tool(tool.get("name"), parameters, where)
    function: dict[str, Any] = {"name": tool["name"], "parameters": parameters}
    if isinstance(tool.get("description"), str):
        function["description"] = tool["description"]
    if isinstance(tool.get("strict"), bool):
        # The engine constrains arguments to the schema only for strict tools. Passed on only
        # when the harness says so: its grammar may not support every schema a harness sends.
        function["strict"] = tool["strict"]
    return {"type": "function", "function": function}


def _text_content(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def system_first(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages every chat template accepts: system messages only at the start, as one.

    Harnesses send system messages later on (Claude Code puts one after the user's prompt); the
    chat templates of the Qwen3 family refuse a system message that is not first. The leading system
    messages are joined into one (blank line between), and a later one becomes a user message with its
    text unchanged, where it was. Merging it into the first system message instead would rewrite the
    start of the prompt whenever a harness adds one: every later turn would stop extending the
    previous one (no merged segments) and the engine's prefix cache would miss; re-roling keeps the
    prompt growing at the end, at the cost of the model reading that text as the user's. The engine
    renders and tokenizes what it is sent, so the tokens the trainer sees are still the engine's.
    """
    lead = 0
    while lead < len(messages) and messages[lead].get("role") == "system":
        lead += 1
    if lead <= 1 and all(m.get("role") != "system" for m in messages[lead:]):
        return messages
    out: list[dict[str, Any]] = []
    if lead:
        first = messages[0] if lead == 1 else {"role": "system"}
        if lead > 1:
            first["content"] = "\n\n".join(_text_content(m.get("content")) for m in messages[:lead])
        out.append(first)
    for message in messages[lead:]:
        if message.get("role") == "system":
            out.append({"role": "user", "content": message.get("content")})
        else:
            out.append(message)
    return out


def engine_body(
    *,
    messages: list[dict[str, Any]],
    stream: bool,
    settings: ProxySettings,
    max_tokens: int | None,
    temperature: float | None,
    top_p: float | None,
    stop: list[str] | None = None,
    tools: list[dict[str, Any]] | None = None,
    tool_choice: Any = None,
    top_logprobs: int | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The `/v1/chat/completions` body sent to the engine, with capture on and the run's sampling
    enforced over the harness's."""
    body: dict[str, Any] = {
        "model": settings.served_model_name,
        "messages": system_first(messages),
        "stream": stream,
        "logprobs": True,
        "return_token_ids": True,
    }
    if top_logprobs:
        body["top_logprobs"] = top_logprobs
    if stream:
        body["stream_options"] = {"include_usage": True}
    cap = settings.max_tokens
    if max_tokens is not None or cap is not None:
        body["max_tokens"] = min(v for v in (max_tokens, cap) if v is not None)
    temperature = settings.temperature if settings.temperature is not None else temperature
    if temperature is not None:
        body["temperature"] = temperature
    top_p = settings.top_p if settings.top_p is not None else top_p
    if top_p is not None:
        body["top_p"] = top_p
    if stop:
        body["stop"] = stop
    if tools:
        body["tools"] = tools
        if tool_choice is not None:
            body["tool_choice"] = tool_choice
    if extra:
        body.update(extra)
    return body


def events_from_completion(comp: Completion) -> list[Event]:
    """A whole answer replayed as stream events (when the engine had to be called unstreamed)."""
    events: list[Event] = []
    if comp.reasoning:
        events.append(ReasoningDelta(comp.reasoning))
    if comp.text:
        events.append(TextDelta(comp.text, comp.logprobs_content))
    for i, call in enumerate(comp.tool_calls):
        events.append(ToolCallStart(i, call.id, call.name))
        if call.arguments:
            events.append(ToolCallArgs(i, call.arguments))
    return events


def sse(data: dict[str, Any] | str, event: str | None = None) -> bytes:
    """One server-sent event."""
    payload = data.encode() if isinstance(data, str) else fastjson.dumps(data)
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + payload + b"\n\n"


def parse_arguments(arguments: str) -> dict[str, Any]:
    """Tool-call arguments as an object, for formats that carry them parsed (Anthropic's input).
    Arguments a model produced that are not a JSON object are kept, wrapped, not dropped."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return {"_raw_arguments": arguments}
    return value if isinstance(value, dict) else {"_raw_arguments": arguments}

"""Format translation: harness requests to the engine's body, recorded vLLM answers to each client's schema.

The requests are shaped like what Claude Code, Codex and an OpenAI-chat harness send; the engine answers
are recorded from vLLM (see tests/fixtures/proxy/README.md). Every body and stream event the proxy
produces is validated with the official SDKs' models, and the streams are also read by the SDK clients
themselves over HTTP.
"""

from __future__ import annotations

import base64
import copy
import io
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import ModuleType
from typing import Any

import anthropic
import numpy as np
import openai
import pytest
from anthropic.types import Message, RawMessageStreamEvent
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from legorl.api.trajectory import ApiFormat
from legorl.proxy.errors import ProxyError, error_body
from legorl.proxy.formats import anthropic as anthropic_format
from legorl.proxy.formats import chat as chat_format
from legorl.proxy.formats import responses as responses_format
from legorl.proxy.formats.common import (
    Completion,
    Prepared,
    StreamAccumulator,
    TextDelta,
    ToolCall,
    ToolCallArgs,
    ToolCallStart,
    completion_from_response,
    events_from_completion,
    system_first,
)
from legorl.proxy.settings import ProxySettings
from legorl.proxy.trial import decode_routed_experts

FIXTURES = Path(__file__).parents[1] / "fixtures" / "proxy"
ANTHROPIC_EVENT: TypeAdapter[Any] = TypeAdapter(RawMessageStreamEvent)
RESPONSES_EVENT: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
# A model name the Anthropic SDK does not warn about (it warns on deprecated ones).
SDK_MODEL = "claude-haiku-4-5"

RECORDED = [
    "vllm_text_length",
    "vllm_text_stop_sequence",
    "vllm_text_end_turn",
    "vllm_tool_call",
    "vllm_parallel_tool_calls",
]
RECORDED_STREAMS = ["vllm_text_length", "vllm_text_end_turn", "vllm_tool_call", "vllm_parallel_tool_calls"]
TOOL_ANSWERS = ["vllm_tool_call", "vllm_parallel_tool_calls"]


def fixture(name: str) -> Any:
    return json.loads((FIXTURES / name).read_text())


def recorded(name: str) -> dict[str, Any]:
    """A recorded non-streaming `/v1/chat/completions` answer."""
    body: dict[str, Any] = fixture(f"{name}.json")
    return body


def stream_payloads(name: str) -> list[str]:
    """The `data:` payloads of a recorded stream, in order."""
    text = (FIXTURES / f"{name}.sse").read_text()
    return [line.removeprefix("data: ") for line in text.splitlines() if line.startswith("data: ")]


def stream_chunks(name: str) -> list[dict[str, Any]]:
    return [json.loads(p) for p in stream_payloads(name) if p != "[DONE]"]


def settings(**changes: Any) -> ProxySettings:
    return ProxySettings(upstream="http://engine:8000", journal=Path("unused-journal"), **changes)


def message_of(name: str) -> dict[str, Any]:
    message: dict[str, Any] = recorded(name)["choices"][0]["message"]
    return message


def streamed_message(name: str) -> dict[str, Any]:
    """The assistant message a recorded stream carries, put together from its deltas (by index)."""
    choices = [choice for chunk in stream_chunks(name) for choice in chunk["choices"]]
    calls: dict[int, dict[str, Any]] = {}
    for choice in choices:
        for delta in choice["delta"].get("tool_calls") or []:
            call = calls.setdefault(
                delta["index"], {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
            )
            call["id"] = delta.get("id") or call["id"]
            call["function"]["name"] = delta.get("function", {}).get("name") or call["function"]["name"]
            call["function"]["arguments"] += delta.get("function", {}).get("arguments") or ""
    text = "".join(c["delta"].get("content") or "" for c in choices)
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message


def with_parsed_arguments(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages with tool-call arguments parsed, to compare their values rather than their spelling."""
    out = copy.deepcopy(messages)
    for message in out:
        for call in message.get("tool_calls") or []:
            assert isinstance(call["function"]["arguments"], str)
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    return out


# ---------------------------------------------------------------------------------------------------
# Requests: what the engine is asked
# ---------------------------------------------------------------------------------------------------


def test_a_chat_request_goes_to_the_engine_with_capture_on_and_penalties_dropped() -> None:
    request = fixture("chat_request.json")
    prepared = chat_format.prepare(copy.deepcopy(request), settings())

    assert prepared.stream is False
    assert prepared.client_model == "gpt-4.1-mini"
    assert prepared.options == {"logprobs": True, "include_usage": False}
    developer, *rest = request["messages"]
    assert prepared.body == {
        "model": "policy",
        # `developer` is the chat templates' `system`; multi-part content and tool calls go as sent.
        "messages": [{"role": "system", "content": developer["content"]}, *rest],
        "stream": False,
        "logprobs": True,
        "return_token_ids": True,
        "top_logprobs": 2,
        "max_tokens": 4096,
        "temperature": 0.2,
        "top_p": 0.95,
        "stop": ["</s>", "\nObservation:"],
        "tools": request["tools"],
        "tool_choice": "auto",
        "seed": 1234,
        "response_format": {"type": "text"},
        "parallel_tool_calls": False,
    }


def test_a_claude_code_request_becomes_chat_messages() -> None:
    request = fixture("anthropic_claude_code_request.json")
    prepared = anthropic_format.prepare(copy.deepcopy(request), settings())

    assert prepared.stream is True
    assert prepared.client_model == "claude-sonnet-4-5-20250929"
    messages = request["messages"]
    bash_input = messages[1]["content"][2]["input"]
    read_input = messages[3]["content"][1]["input"]
    grep_input = messages[3]["content"][2]["input"]
    tools = request["tools"]
    expected_messages = [
        {
            "role": "system",
            "content": "You are Claude Code, Anthropic's official CLI for Claude.\n"
            + request["system"][1]["text"],
        },
        {
            "role": "user",
            "content": messages[0]["content"][0]["text"] + "\n" + messages[0]["content"][1]["text"],
        },
        # Thinking blocks are dropped (the engine regenerates its own reasoning).
        {
            "role": "assistant",
            "content": "I'll run the failing test first.",
            "tool_calls": [
                {
                    "id": "toolu_01A09q90qw90lq917835lq9",
                    "type": "function",
                    "function": {"name": "Bash", "arguments": bash_input},
                }
            ],
        },
        # A tool result answers the assistant turn before it, so it comes before the user's text.
        {
            "role": "tool",
            "tool_call_id": "toolu_01A09q90qw90lq917835lq9",
            "content": "Error: " + messages[2]["content"][0]["content"],
        },
        {"role": "user", "content": messages[2]["content"][1]["text"]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "toolu_01BSHsP2kN9TtF3bDUqjz3aL",
                    "type": "function",
                    "function": {"name": "Read", "arguments": read_input},
                },
                {
                    "id": "toolu_01Cq7xWmF2yVnRk8LdE4pT6Z",
                    "type": "function",
                    "function": {"name": "Grep", "arguments": grep_input},
                },
            ],
        },
        {
            "role": "tool",
            "tool_call_id": "toolu_01BSHsP2kN9TtF3bDUqjz3aL",
            "content": "     1\tdef parse(tokens):\n     2\t    return tokens[0]\n",
        },
        {
            "role": "tool",
            "tool_call_id": "toolu_01Cq7xWmF2yVnRk8LdE4pT6Z",
            "content": "tests/test_parser.py:4:    assert parse([]) is None",
        },
        # A system message after the conversation began goes on as a user message, where it was
        # (Qwen3-family templates refuse a system message that is not first; see common.system_first).
        {"role": "user", "content": "Note: /repo/parser.py was modified by the user after it was read."},
        {"role": "user", "content": "Keep the change minimal."},
    ]
    body = dict(prepared.body)
    assert with_parsed_arguments(body.pop("messages")) == expected_messages
    assert body == {
        "model": "policy",
        "stream": True,
        "stream_options": {"include_usage": True},
        "logprobs": True,
        "return_token_ids": True,
        "max_tokens": 32000,
        "temperature": 1,
        # The server tool (web_search_20250305) runs at the vendor: not offered to the engine.
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": tool["name"],
                    "description": tool["description"],
                    "parameters": tool["input_schema"],
                },
            }
            for tool in tools[:3]
        ],
    }
    # Nothing of Anthropic's own machinery reaches the engine.
    sent = json.dumps(prepared.body)
    for dropped in (
        "cache_control",
        "signature",
        "redacted_thinking",
        "budget_tokens",
        "user_id",
        "clear_thinking",
    ):
        assert dropped not in sent


def test_a_codex_request_becomes_chat_messages() -> None:
    request = fixture("responses_codex_request.json")
    prepared = responses_format.prepare(copy.deepcopy(request), settings())

    assert prepared.stream is True
    assert prepared.client_model == "gpt-5-codex"
    items = request["input"]
    shell, update_plan, _, github = request["tools"]
    expected_messages = [
        # The instructions and the developer item lead: joined into one system message.
        {"role": "system", "content": request["instructions"] + "\n\n" + items[0]["content"][0]["text"]},
        {"role": "user", "content": items[1]["content"][0]["text"]},
        {"role": "user", "content": items[2]["content"][0]["text"]},
        {"role": "user", "content": "tests/test_parser.py::test_empty_input fails. Fix it."},
        # The reasoning item is dropped; the call keeps Codex's call_id and its arguments verbatim.
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_JmR4vB8tQ2nX6kP0sW3yZ5aE",
                    "type": "function",
                    "function": {"name": "shell", "arguments": items[5]["arguments"]},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_JmR4vB8tQ2nX6kP0sW3yZ5aE", "content": items[6]["output"]},
        # Two consecutive calls are one assistant turn.
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_Tq7wE2rY9uI4oP1aS6dF3gH8",
                    "type": "function",
                    "function": {"name": "shell", "arguments": items[8]["arguments"]},
                },
                {
                    "id": "call_Zx3cV6bN9mQ2wE5rT8yU1iO4",
                    "type": "function",
                    "function": {"name": "shell", "arguments": items[9]["arguments"]},
                },
            ],
        },
        {
            "role": "tool",
            "tool_call_id": "call_Tq7wE2rY9uI4oP1aS6dF3gH8",
            "content": "def parse(tokens):\n    return tokens[0]\n",
        },
        {
            "role": "tool",
            "tool_call_id": "call_Zx3cV6bN9mQ2wE5rT8yU1iO4",
            "content": items[11]["output"][0]["text"],
        },
        # The web_search_call item is dropped.
        {"role": "assistant", "content": items[13]["content"][0]["text"]},
        {"role": "user", "content": "Go ahead."},
    ]
    assert prepared.body == {
        "model": "policy",
        "messages": expected_messages,
        "stream": True,
        "stream_options": {"include_usage": True},
        "logprobs": True,
        "return_token_ids": True,
        # web_search (hosted) is not offered to the engine; the namespace's tool is, flattened.
        "tools": [
            *(
                {
                    "type": "function",
                    "function": {
                        "name": t["name"],
                        "description": t["description"],
                        "parameters": t["parameters"],
                        # The harness's own strictness is passed on, never assumed.
                        "strict": t["strict"],
                    },
                }
                for t in (shell, update_plan)
            ),
            {
                "type": "function",
                "function": {
                    "name": "mcp__github__search_issues",
                    "description": "Search issues.",
                    "parameters": github["tools"][0]["parameters"],
                },
            },
        ],
        "tool_choice": "auto",
    }
    sent = json.dumps(prepared.body)
    for dropped in ("encrypted_content", "prompt_cache_key", "reasoning.encrypted_content", "web_search"):
        assert dropped not in sent


def minimal_requests() -> dict[str, tuple[ModuleType, dict[str, Any]]]:
    return {
        "chat": (chat_format, {"model": "gpt-4.1-mini", "messages": [{"role": "user", "content": "hi"}]}),
        "anthropic": (
            anthropic_format,
            {
                "model": "claude-sonnet-4-5",
                "max_tokens": 8192,
                "messages": [{"role": "user", "content": "hi"}],
            },
        ),
        "responses": (responses_format, {"model": "gpt-5-codex", "input": "hi"}),
    }


MAX_TOKENS_FIELD = {
    "chat": "max_completion_tokens",
    "anthropic": "max_tokens",
    "responses": "max_output_tokens",
}


@pytest.mark.parametrize("name", ["chat", "anthropic", "responses"])
def test_the_runs_sampling_overrides_the_harnesses(name: str) -> None:
    fmt, request = minimal_requests()[name]
    request = {**request, "temperature": 0.2, "top_p": 0.5, MAX_TOKENS_FIELD[name]: 8192}
    body = fmt.prepare(request, settings(temperature=1.0, top_p=0.9, max_tokens=1024)).body
    assert (body["temperature"], body["top_p"], body["max_tokens"]) == (1.0, 0.9, 1024)

    # Without run settings, the harness's own sampling stands.
    body = fmt.prepare(request, settings()).body
    assert (body["temperature"], body["top_p"], body["max_tokens"]) == (0.2, 0.5, 8192)


@pytest.mark.parametrize(
    ("asked", "cap", "sent"),
    [(4096, None, 4096), (4096, 1024, 1024), (512, 1024, 512), (None, 1024, 1024), (None, None, None)],
)
@pytest.mark.parametrize("name", ["chat", "responses"])
def test_max_tokens_is_the_smaller_of_the_harnesses_and_the_runs(
    name: str, asked: int | None, cap: int | None, sent: int | None
) -> None:
    fmt, request = minimal_requests()[name]
    if asked is not None:
        request = {**request, MAX_TOKENS_FIELD[name]: asked}
    body = fmt.prepare(request, settings(max_tokens=cap)).body
    assert body.get("max_tokens") == sent


def test_anthropic_max_tokens_is_capped_by_the_run() -> None:
    request = fixture("anthropic_claude_code_request.json")
    assert anthropic_format.prepare(request, settings(max_tokens=2048)).body["max_tokens"] == 2048


def test_chat_takes_the_legacy_max_tokens_too() -> None:
    request = {"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 300}
    assert chat_format.prepare(request, settings()).body["max_tokens"] == 300


@pytest.mark.parametrize("name", ["chat", "anthropic", "responses"])
@pytest.mark.parametrize("stream", [True, False])
def test_capture_is_always_on_and_streams_ask_for_usage(name: str, stream: bool) -> None:
    fmt, request = minimal_requests()[name]
    # Whatever the harness says about logprobs, the engine is asked for them.
    prepared = fmt.prepare({**request, "stream": stream, "logprobs": False}, settings())
    assert prepared.stream is stream
    assert prepared.body["stream"] is stream
    assert prepared.body["logprobs"] is True
    assert prepared.body["return_token_ids"] is True
    assert prepared.body["model"] == "policy"
    if stream:
        assert prepared.body["stream_options"] == {"include_usage": True}
    else:
        assert "stream_options" not in prepared.body


def test_chat_passes_the_clients_usage_and_logprob_asks_to_the_answer_only() -> None:
    base = {"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    plain = chat_format.prepare(base, settings())
    assert plain.options == {"logprobs": False, "include_usage": False}
    assert "top_logprobs" not in plain.body
    asked = chat_format.prepare(
        {**base, "logprobs": True, "top_logprobs": 5, "stream_options": {"include_usage": True}}, settings()
    )
    assert asked.options == {"logprobs": True, "include_usage": True}
    assert asked.body["top_logprobs"] == 5


@pytest.mark.parametrize("n", [2, 0, "1"])
def test_chat_n_other_than_one_is_refused(n: Any) -> None:
    with pytest.raises(ProxyError) as caught:
        chat_format.prepare(
            {"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}], "n": n}, settings()
        )
    assert (caught.value.kind, caught.value.param) == ("invalid_request", "n")
    assert chat_format.prepare(
        {"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}], "n": 1}, settings()
    ).body["messages"] == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("choice", "sent"),
    [
        ({"type": "auto"}, "auto"),
        ({"type": "any"}, "required"),
        ({"type": "none"}, "none"),
        ({"type": "tool", "name": "Bash"}, {"type": "function", "function": {"name": "Bash"}}),
        ({"type": "auto", "disable_parallel_tool_use": True}, "auto"),
    ],
)
def test_anthropic_tool_choice_maps_to_chat(choice: dict[str, Any], sent: Any) -> None:
    request = fixture("anthropic_claude_code_request.json")
    assert (
        anthropic_format.prepare({**request, "tool_choice": choice}, settings()).body["tool_choice"] == sent
    )


@pytest.mark.parametrize(
    ("choice", "sent"),
    [
        ("auto", "auto"),
        ("none", "none"),
        ("required", "required"),
        ({"type": "function", "name": "shell"}, {"type": "function", "function": {"name": "shell"}}),
        ({"type": "web_search"}, "auto"),
        (
            {"type": "custom", "name": "apply_patch"},
            {"type": "function", "function": {"name": "apply_patch"}},
        ),
        (
            {"type": "function", "name": "search_issues", "namespace": "mcp__github"},
            {"type": "function", "function": {"name": "mcp__github__search_issues"}},
        ),
    ],
)
def test_responses_tool_choice_maps_to_chat(choice: Any, sent: Any) -> None:
    request = fixture("responses_codex_request.json")
    assert (
        responses_format.prepare({**request, "tool_choice": choice}, settings()).body["tool_choice"] == sent
    )


def test_anthropic_stop_sequences_and_images_reach_the_engine() -> None:
    request = {
        "model": "claude-haiku-4-5",
        "max_tokens": 256,
        "stop_sequences": ["\n\nHuman:", "</answer>"],
        "messages": [
            {
                "role": "user",
                "content": [
                    {
                        "type": "image",
                        "source": {"type": "base64", "media_type": "image/jpeg", "data": "/9j/4AAQ"},
                    },
                    {"type": "image", "source": {"type": "url", "url": "https://example.com/screen.png"}},
                    {"type": "text", "text": "What is on the screen?"},
                ],
            }
        ],
    }
    body = anthropic_format.prepare(request, settings()).body
    assert body["stop"] == ["\n\nHuman:", "</answer>"]
    assert body["messages"] == [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,/9j/4AAQ"}},
                {"type": "image_url", "image_url": {"url": "https://example.com/screen.png"}},
                {"type": "text", "text": "What is on the screen?"},
            ],
        }
    ]


def test_tool_results_come_before_the_text_they_were_sent_with() -> None:
    request = {
        "model": "claude-sonnet-4-5",
        "max_tokens": 100,
        "messages": [
            {"role": "user", "content": "run it"},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {}}],
            },
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "<system-reminder>keep going</system-reminder>"},
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_1",
                        "content": [{"type": "text", "text": "done"}],
                    },
                    {"type": "text", "text": "and then?"},
                ],
            },
        ],
    }
    messages = anthropic_format.prepare(request, settings()).body["messages"]
    assert messages[2:] == [
        {"role": "tool", "tool_call_id": "toolu_1", "content": "done"},
        {"role": "user", "content": "<system-reminder>keep going</system-reminder>\nand then?"},
    ]


def test_only_server_tools_means_no_tools_for_the_engine() -> None:
    request = {
        "model": "claude-sonnet-4-5",
        "max_tokens": 100,
        "messages": [{"role": "user", "content": "search"}],
        "tools": [{"type": "web_search_20250305", "name": "web_search", "max_uses": 3}],
        "tool_choice": {"type": "any"},
    }
    body = anthropic_format.prepare(request, settings()).body
    assert "tools" not in body
    assert "tool_choice" not in body

    codex = {
        "model": "gpt-5-codex",
        "input": "search",
        "tools": [{"type": "web_search"}],
        "tool_choice": "required",
    }
    body = responses_format.prepare(codex, settings()).body
    assert "tools" not in body
    assert "tool_choice" not in body


def test_a_responses_input_string_is_one_user_message() -> None:
    body = responses_format.prepare(
        {"model": "gpt-5", "input": "hello", "max_output_tokens": 64}, settings()
    ).body
    assert body["messages"] == [{"role": "user", "content": "hello"}]
    assert body["max_tokens"] == 64


def test_previous_response_id_is_refused() -> None:
    request = {**fixture("responses_codex_request.json"), "previous_response_id": "resp_0123456789abcdef"}
    with pytest.raises(ProxyError) as caught:
        responses_format.prepare(request, settings())
    assert (caught.value.kind, caught.value.param) == ("invalid_request", "previous_response_id")
    assert "previous_response_id" in caught.value.message


def test_anthropic_without_max_tokens_is_refused() -> None:
    request = fixture("anthropic_claude_code_request.json")
    del request["max_tokens"]
    with pytest.raises(ProxyError) as caught:
        anthropic_format.prepare(request, settings())
    assert (caught.value.kind, caught.value.param, caught.value.http_status) == (
        "invalid_request",
        "max_tokens",
        400,
    )
    assert "max_tokens" in caught.value.message


BASH_TOOL = {"name": "Bash", "input_schema": {"type": "object", "properties": {}}}
SHELL_TOOL = {"type": "function", "name": "shell", "parameters": {"type": "object"}}

# (format, change to its minimal request, field the error must name, the error's param)
BAD_REQUESTS: list[tuple[str, dict[str, Any], str, str | None]] = [
    ("chat", {"model": None}, "model", "model"),
    ("chat", {"messages": []}, "messages", "messages"),
    ("chat", {"messages": "hi"}, "messages", "messages"),
    ("chat", {"messages": [{"role": "robot", "content": "hi"}]}, "messages[0]", "messages[0]"),
    ("chat", {"messages": ["hi"]}, "messages[0]", "messages[0]"),
    ("chat", {"stream": "true"}, "stream", "stream"),
    ("chat", {"temperature": "0.2"}, "temperature", "temperature"),
    ("chat", {"temperature": 2.5}, "temperature", "temperature"),
    ("chat", {"top_p": True}, "top_p", "top_p"),
    ("chat", {"max_completion_tokens": 0}, "max_completion_tokens", "max_completion_tokens"),
    ("chat", {"max_tokens": "256"}, "max_tokens", "max_tokens"),
    ("chat", {"stop": 7}, "stop", "stop"),
    ("chat", {"stop": ["a", 1]}, "stop", "stop"),
    ("chat", {"tools": {"type": "function"}}, "tools", "tools"),
    ("chat", {"tools": [{"type": "retrieval"}]}, "tools[0]", "tools[0]"),
    (
        "chat",
        {"tools": [{"type": "function", "function": {"name": "b", "parameters": "object"}}]},
        "tools[0]",
        "tools[0]",
    ),
    ("chat", {"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools[0]", "tools[0]"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "top_logprobs"),
    ("anthropic", {"model": ""}, "model", "model"),
    ("anthropic", {"max_tokens": "1024"}, "max_tokens", "max_tokens"),
    ("anthropic", {"max_tokens": 0}, "max_tokens", "max_tokens"),
    ("anthropic", {"messages": []}, "messages", "messages"),
    ("anthropic", {"messages": [{"role": "tool", "content": "x"}]}, "messages.0", "messages.0"),
    ("anthropic", {"messages": [{"role": "user", "content": 5}]}, "messages.0", "messages.0"),
    (
        "anthropic",
        {"messages": [{"role": "user", "content": [{"text": "untyped"}]}]},
        "messages.0",
        "messages.0",
    ),
    (
        "anthropic",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
        "messages.0.content[0]",
        "messages.0.content[0]",
    ),
    (
        "anthropic",
        {
            "messages": [
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": 5, "content": "x"}]}
            ]
        },
        "tool_use_id",
        "messages.0.content",
    ),
    (
        "anthropic",
        {"messages": [{"role": "assistant", "content": [{"type": "tool_use", "name": "Bash", "input": {}}]}]},
        "messages.0",
        "messages.0.content",
    ),
    ("anthropic", {"system": 5}, "system", "system"),
    ("anthropic", {"system": [{"type": "text", "text": None}]}, "system", "system"),
    ("anthropic", {"tools": {"name": "Bash"}}, "tools", "tools"),
    ("anthropic", {"tools": [{"name": "Bash"}]}, "input_schema", "tools"),
    ("anthropic", {"tools": [{"name": "Bash", "input_schema": "object"}]}, "tools.0", "tools.0"),
    ("anthropic", {"tools": [{"input_schema": {"type": "object"}}]}, "tools.0", "tools.0"),
    ("anthropic", {"tools": [BASH_TOOL], "tool_choice": {"type": "sometimes"}}, "tool_choice", None),
    ("anthropic", {"stream": 1}, "stream", "stream"),
    ("anthropic", {"temperature": "1"}, "temperature", "temperature"),
    ("anthropic", {"top_p": -0.1}, "top_p", "top_p"),
    ("anthropic", {"stop_sequences": [1, 2]}, "stop_sequences", "stop_sequences"),
    ("responses", {"model": 5}, "model", "model"),
    ("responses", {"input": []}, "input", "input"),
    ("responses", {"input": 5}, "input", "input"),
    ("responses", {"input": [5]}, "input[0]", "input[0]"),
    ("responses", {"input": [{"type": "message", "role": "tool", "content": "x"}]}, "input[0]", "input[0]"),
    (
        "responses",
        {"input": [{"type": "message", "role": "user", "content": 5}]},
        "input[0].content",
        "input[0].content",
    ),
    (
        "responses",
        {"input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": 5}]}]},
        "input[0].content",
        "input[0].content",
    ),
    (
        "responses",
        {"input": [{"type": "function_call", "name": "shell", "arguments": "{}"}]},
        "input[0]",
        "input[0]",
    ),
    ("responses", {"input": [{"type": "function_call_output", "output": "x"}]}, "input[0]", "input[0]"),
    ("responses", {"instructions": ["be brief"]}, "instructions", "instructions"),
    ("responses", {"tools": {"type": "function"}}, "tools", "tools"),
    ("responses", {"tools": ["shell"]}, "tools[0]", "tools"),
    ("responses", {"tools": [{**SHELL_TOOL, "parameters": ["command"]}]}, "tools[0]", "tools[0]"),
    ("responses", {"tools": [{"type": "function", "parameters": {}}]}, "tools[0]", "tools[0]"),
    ("responses", {"tools": [SHELL_TOOL], "tool_choice": 5}, "tool_choice", "tool_choice"),
    ("responses", {"max_output_tokens": -5}, "max_output_tokens", "max_output_tokens"),
    ("responses", {"stream": "yes"}, "stream", "stream"),
    ("responses", {"temperature": 9}, "temperature", "temperature"),
]


@pytest.mark.parametrize(
    ("name", "change", "field", "param"),
    BAD_REQUESTS,
    ids=[f"{name}-{'-'.join(change)}-{i}" for i, (name, change, _, _) in enumerate(BAD_REQUESTS)],
)
def test_wrong_types_are_refused_with_the_field_named(
    name: str, change: dict[str, Any], field: str, param: str | None
) -> None:
    fmt, request = minimal_requests()[name]
    with pytest.raises(ProxyError) as caught:
        fmt.prepare({**request, **change}, settings())
    error = caught.value
    assert error.kind == "invalid_request"
    assert error.http_status == 400
    assert field in error.message
    assert error.param == param


# ---------------------------------------------------------------------------------------------------
# Engine answers: normalised
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", RECORDED)
def test_a_recorded_answer_normalises_with_its_exact_tokens(name: str) -> None:
    body = recorded(name)
    choice = body["choices"][0]
    comp = completion_from_response(copy.deepcopy(body))

    assert comp.id == body["id"]
    assert comp.created == body["created"]
    assert comp.prompt_token_ids == body["prompt_token_ids"]
    assert comp.completion_token_ids == choice["token_ids"]
    assert comp.completion_logprobs == [entry["logprob"] for entry in choice["logprobs"]["content"]]
    assert comp.logprobs_content == choice["logprobs"]["content"]
    assert comp.text == (choice["message"]["content"] or "")
    assert comp.finish_reason == choice["finish_reason"]
    assert comp.stop_reason == choice["stop_reason"]
    assert [(c.id, c.name, c.arguments) for c in comp.tool_calls] == [
        (c["id"], c["function"]["name"], c["function"]["arguments"])
        for c in choice["message"].get("tool_calls") or []
    ]
    assert (comp.prompt_tokens, comp.completion_tokens) == (
        body["usage"]["prompt_tokens"],
        body["usage"]["completion_tokens"],
    )
    assert comp.routed_experts is None


@pytest.mark.parametrize("name", RECORDED_STREAMS)
def test_a_recorded_stream_accumulates_to_exactly_its_tokens(name: str) -> None:
    chunks = stream_chunks(name)
    choices = [choice for chunk in chunks for choice in chunk["choices"]]
    acc = StreamAccumulator()
    assert acc.started is False
    for i, payload in enumerate(stream_payloads(name)):
        acc.feed(payload)
        if i == 0:
            # The first chunk carries the prompt's token ids: enough to start the client's stream.
            assert acc.started is True
            assert acc.completion.prompt_token_ids == chunks[0]["prompt_token_ids"]
    comp = acc.result()

    assert comp.id == chunks[0]["id"]
    assert comp.prompt_token_ids == chunks[0]["prompt_token_ids"]
    assert comp.completion_token_ids == [t for c in choices for t in c.get("token_ids") or []]
    entries = [e for c in choices for e in ((c.get("logprobs") or {}).get("content") or [])]
    assert comp.completion_logprobs == [e["logprob"] for e in entries]
    assert len(comp.completion_logprobs) == len(comp.completion_token_ids)
    assert comp.text == "".join(c["delta"].get("content") or "" for c in choices)
    (finish,) = [c for c in choices if c.get("finish_reason")]
    assert comp.finish_reason == finish["finish_reason"]
    assert comp.stop_reason == finish["stop_reason"]
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == []
    assert (comp.prompt_tokens, comp.completion_tokens) == (
        usage["prompt_tokens"],
        usage["completion_tokens"],
    )

    # The tool calls the recording streamed, put together by index.
    calls = streamed_message(name).get("tool_calls") or []
    assert [(c.id, c.name, c.arguments) for c in comp.tool_calls] == [
        (c["id"], c["function"]["name"], c["function"]["arguments"]) for c in calls
    ]
    for call in comp.tool_calls:
        json.loads(call.arguments)


def test_a_stream_and_a_whole_answer_of_the_same_request_agree() -> None:
    # Both recorded with the same request and seed.
    whole = completion_from_response(recorded("vllm_text_length"))
    acc = StreamAccumulator()
    for payload in stream_payloads("vllm_text_length"):
        acc.feed(payload)
    streamed = acc.result()
    assert streamed.prompt_token_ids == whole.prompt_token_ids
    assert streamed.completion_token_ids == whole.completion_token_ids
    assert streamed.completion_logprobs == whole.completion_logprobs
    assert streamed.text == whole.text
    assert streamed.finish_reason == whole.finish_reason == "length"


def npy_base64(array: np.ndarray[Any, Any]) -> str:
    """vLLM's encoding of routed experts (vllm.utils.serial_utils.numpy2base64)."""
    with io.BytesIO() as buffer:
        np.save(buffer, array, allow_pickle=False)
        return base64.b64encode(buffer.getbuffer()).decode("ascii")


def test_routed_experts_ride_along_undecoded() -> None:
    body = recorded("vllm_text_end_turn")
    choice = body["choices"][0]
    tokens = len(body["prompt_token_ids"]) + len(choice["token_ids"])
    routing = np.arange((tokens - 1) * 2 * 4, dtype=np.int32).reshape(tokens - 1, 2, 4) % 64
    choice["routed_experts"] = npy_base64(routing)

    comp = completion_from_response(body)
    assert comp.routed_experts == choice["routed_experts"]
    assert comp.routed_experts is not None
    routed = decode_routed_experts(comp.routed_experts)
    assert routed.shape == (len(comp.prompt_token_ids) + len(comp.completion_token_ids) - 1, 2, 4)
    assert routed.dtype == np.uint8  # int32 ids all below 256: narrowed
    np.testing.assert_array_equal(routed, routing)


def without_token_ids(body: dict[str, Any]) -> dict[str, Any]:
    del body["choices"][0]["token_ids"]
    return body


def two_choices(body: dict[str, Any]) -> dict[str, Any]:
    body["choices"].append({**body["choices"][0], "index": 1})
    return body


def logprob_without_value(body: dict[str, Any]) -> dict[str, Any]:
    del body["choices"][0]["logprobs"]["content"][0]["logprob"]
    return body


def no_prompt_ids(body: dict[str, Any]) -> dict[str, Any]:
    body["prompt_token_ids"] = None
    return body


@pytest.mark.parametrize("spoil", [without_token_ids, two_choices, logprob_without_value, no_prompt_ids])
def test_a_malformed_answer_is_an_engine_error(spoil: Any) -> None:
    with pytest.raises(ProxyError) as caught:
        completion_from_response(spoil(recorded("vllm_text_length")))
    assert (caught.value.kind, caught.value.http_status) == ("engine_error", 502)


@pytest.mark.parametrize(
    "payloads",
    [
        ["{not json"],
        ['{"error": {"message": "CUDA out of memory", "type": "InternalServerError", "code": 500}}'],
        ['{"id": "x", "choices": [{"index": 0, "delta": {}}, {"index": 1, "delta": {}}]}'],
        ['{"id": "x", "choices": [{"index": 0, "delta": {"content": "a"}, "token_ids": ["a"]}]}'],
        ["[1, 2]"],
    ],
    ids=["not-json", "error-chunk", "two-choices", "token-ids-not-ints", "not-an-object"],
)
def test_a_malformed_stream_chunk_is_an_engine_error(payloads: list[str]) -> None:
    acc = StreamAccumulator()
    with pytest.raises(ProxyError) as caught:
        for payload in payloads:
            acc.feed(payload)
    assert caught.value.kind == "engine_error"


def test_a_stream_cut_before_done_is_an_engine_error() -> None:
    acc = StreamAccumulator()
    for payload in stream_payloads("vllm_text_length")[:-1]:
        acc.feed(payload)
    with pytest.raises(ProxyError) as caught:
        acc.result()
    assert caught.value.kind == "engine_error"
    assert "[DONE]" in caught.value.message


# ---------------------------------------------------------------------------------------------------
# Whole answers in each client's schema
# ---------------------------------------------------------------------------------------------------

ANTHROPIC_STOP = {
    "vllm_text_length": ("max_tokens", None),
    "vllm_text_stop_sequence": ("stop_sequence", "e"),
    "vllm_text_end_turn": ("end_turn", None),
    "vllm_tool_call": ("tool_use", None),
    "vllm_parallel_tool_calls": ("tool_use", None),
}


@pytest.mark.parametrize("name", RECORDED)
def test_anthropic_answers_validate_and_carry_the_engines_content(name: str) -> None:
    body = recorded(name)
    message = message_of(name)
    prepared = anthropic_format.prepare(fixture("anthropic_claude_code_request.json"), settings())
    answer = anthropic_format.response(prepared, completion_from_response(body))

    parsed = Message.model_validate(answer, strict=True)
    assert parsed.model == "claude-sonnet-4-5-20250929"
    assert parsed.id.startswith("msg_")
    assert (parsed.stop_reason, parsed.stop_sequence) == ANTHROPIC_STOP[name]
    assert parsed.usage.input_tokens == body["usage"]["prompt_tokens"]
    assert parsed.usage.output_tokens == body["usage"]["completion_tokens"]
    expected: list[dict[str, Any]] = []
    if message["content"]:
        expected.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        expected.append(
            {
                "type": "tool_use",
                "id": call["id"],
                "name": call["function"]["name"],
                "input": json.loads(call["function"]["arguments"]),
            }
        )
    assert answer["content"] == expected


def test_a_stop_token_ends_an_anthropic_turn_without_a_stop_sequence() -> None:
    # vLLM reports a stop *token* (stop_token_ids) as its id, a stop *string* as the string.
    body = recorded("vllm_text_end_turn")
    body["choices"][0]["stop_reason"] = body["choices"][0]["token_ids"][-1]
    prepared = anthropic_format.prepare(fixture("anthropic_claude_code_request.json"), settings())
    answer = anthropic_format.response(prepared, completion_from_response(body))
    Message.model_validate(answer, strict=True)
    assert (answer["stop_reason"], answer["stop_sequence"]) == ("end_turn", None)


def test_anthropic_keeps_arguments_that_are_not_an_object() -> None:
    body = recorded("vllm_tool_call")
    body["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] = '["ls", "-la"]'
    prepared = anthropic_format.prepare(fixture("anthropic_claude_code_request.json"), settings())
    answer = anthropic_format.response(prepared, completion_from_response(body))
    Message.model_validate(answer, strict=True)
    assert answer["content"][-1]["input"] == {"_raw_arguments": '["ls", "-la"]'}


@pytest.mark.parametrize("name", RECORDED)
def test_responses_answers_validate_and_carry_the_engines_content(name: str) -> None:
    body = recorded(name)
    message = message_of(name)
    request = fixture("responses_codex_request.json")
    prepared = responses_format.prepare(request, settings())
    answer = responses_format.response(prepared, completion_from_response(body))

    parsed = Response.model_validate(answer, strict=True)
    assert parsed.model == "gpt-5-codex"
    assert parsed.instructions == request["instructions"]
    truncated = body["choices"][0]["finish_reason"] == "length"
    assert parsed.status == ("incomplete" if truncated else "completed")
    if truncated:
        assert answer["incomplete_details"] == {"reason": "max_output_tokens"}
    else:
        assert answer["incomplete_details"] is None
    assert parsed.usage is not None
    assert parsed.usage.input_tokens == body["usage"]["prompt_tokens"]
    assert parsed.usage.output_tokens == body["usage"]["completion_tokens"]
    assert parsed.usage.total_tokens == body["usage"]["total_tokens"]

    kinds = [item["type"] for item in answer["output"]]
    calls = message.get("tool_calls") or []
    assert kinds == ["message"] * bool(message["content"]) + ["function_call"] * len(calls)
    if message["content"]:
        assert parsed.output_text == message["content"]
        assert answer["output"][0]["role"] == "assistant"
        assert answer["output"][0]["status"] == "completed"
    function_calls = [item for item in answer["output"] if item["type"] == "function_call"]
    assert [(f["call_id"], f["name"], f["arguments"]) for f in function_calls] == [
        (c["id"], c["function"]["name"], c["function"]["arguments"]) for c in calls
    ]
    ids = [item["id"] for item in answer["output"]]
    assert len(set(ids)) == len(ids)


@pytest.mark.parametrize("logprobs", [True, False])
@pytest.mark.parametrize("name", RECORDED)
def test_chat_answers_validate_and_carry_logprobs_only_when_asked(name: str, logprobs: bool) -> None:
    body = recorded(name)
    choice = body["choices"][0]
    request = {"model": "gpt-4.1-mini", "messages": [{"role": "user", "content": "hi"}], "logprobs": logprobs}
    prepared = chat_format.prepare(request, settings())
    answer = chat_format.response(prepared, completion_from_response(body))

    parsed = ChatCompletion.model_validate(answer, strict=True)
    assert parsed.id == body["id"]
    assert parsed.model == "gpt-4.1-mini"
    assert parsed.choices[0].finish_reason == choice["finish_reason"]
    assert parsed.choices[0].message.content == choice["message"]["content"]
    assert answer["choices"][0]["message"].get("tool_calls") == (choice["message"].get("tool_calls") or None)
    assert answer["usage"] == {
        "prompt_tokens": body["usage"]["prompt_tokens"],
        "completion_tokens": body["usage"]["completion_tokens"],
        "total_tokens": body["usage"]["total_tokens"],
    }
    if logprobs:
        assert answer["choices"][0]["logprobs"] == {"content": choice["logprobs"]["content"]}
    else:
        assert answer["choices"][0]["logprobs"] is None
    # vLLM's extras stay between the proxy and the engine.
    assert "prompt_token_ids" not in answer
    assert "token_ids" not in answer["choices"][0]


# ---------------------------------------------------------------------------------------------------
# Streams in each client's schema
# ---------------------------------------------------------------------------------------------------


def parse_sse(data: bytes) -> list[tuple[str | None, str]]:
    """(event name, data) of each server-sent event, checking the framing as it goes."""
    text = data.decode()
    assert text.endswith("\n\n")
    events = []
    for block in text[:-2].split("\n\n"):
        name, payload = None, []
        for line in block.split("\n"):
            key, sep, value = line.partition(": ")
            assert sep, line
            if key == "event":
                name = value
            else:
                assert key == "data", line
                payload.append(value)
        events.append((name, "\n".join(payload)))
    return events


def encode_live(fmt: ModuleType, prepared: Prepared, name: str) -> tuple[bytes, Completion]:
    """The client's stream as the app writes it while the engine streams `name`."""
    acc = StreamAccumulator()
    encoder = fmt.Encoder(prepared)
    out: list[bytes] = []
    started = False
    for payload in stream_payloads(name):
        events = acc.feed(payload)
        if not started and acc.started:
            out += encoder.head(acc.completion)
            started = True
        for event in events:
            out += encoder.event(event)
    comp = acc.result()
    out += encoder.tail(comp)
    return b"".join(out), comp


def encode_replayed(fmt: ModuleType, prepared: Prepared, name: str) -> tuple[bytes, Completion]:
    """The client's stream replayed from a whole answer (the engine called unstreamed)."""
    comp = completion_from_response(recorded(name))
    encoder = fmt.Encoder(prepared)
    out: list[bytes] = list(encoder.head(comp))
    for event in events_from_completion(comp):
        out += encoder.event(event)
    out += encoder.tail(comp)
    return b"".join(out), comp


ENCODINGS = {"live": encode_live, "replayed": encode_replayed}


def answer_of(name: str, how: str) -> dict[str, Any]:
    """The engine's message behind an encoding: the stream's for a live one, the whole answer's else."""
    return streamed_message(name) if how == "live" else message_of(name)


@pytest.mark.parametrize("how", ENCODINGS)
@pytest.mark.parametrize("name", RECORDED_STREAMS)
def test_anthropic_streams_validate_and_end_with_message_stop(name: str, how: str) -> None:
    prepared = anthropic_format.prepare(fixture("anthropic_claude_code_request.json"), settings())
    data, comp = ENCODINGS[how](anthropic_format, prepared, name)
    events = []
    for event_name, payload in parse_sse(data):
        event = json.loads(payload)
        assert event_name == event["type"]
        ANTHROPIC_EVENT.validate_python(event, strict=True)
        events.append(event)

    types = [e["type"] for e in events]
    assert types[0] == "message_start"
    assert types[-2:] == ["message_delta", "message_stop"]
    assert events[0]["message"]["usage"]["input_tokens"] == len(comp.prompt_token_ids)
    assert events[-2]["delta"]["stop_reason"] == ANTHROPIC_STOP[name][0]
    assert events[-2]["usage"]["output_tokens"] == comp.completion_tokens

    # Blocks open and close in order, one at a time, numbered from 0.
    blocks: list[dict[str, Any]] = []
    open_index = None
    for event in events[1:-2]:
        if event["type"] == "content_block_start":
            assert open_index is None
            assert event["index"] == len(blocks)
            open_index = event["index"]
            blocks.append({**event["content_block"], "text_parts": [], "json_parts": []})
        elif event["type"] == "content_block_delta":
            assert event["index"] == open_index
            delta = event["delta"]
            if delta["type"] == "text_delta":
                blocks[-1]["text_parts"].append(delta["text"])
            else:
                assert delta["type"] == "input_json_delta"
                blocks[-1]["json_parts"].append(delta["partial_json"])
        else:
            assert event == {"type": "content_block_stop", "index": open_index}
            open_index = None
    assert open_index is None

    message = answer_of(name, how)
    expected: list[tuple[str, Any]] = []
    if message["content"]:
        expected.append(("text", message["content"]))
    for call in message.get("tool_calls") or []:
        expected.append(("tool_use", (call["function"]["name"], json.loads(call["function"]["arguments"]))))
    got: list[tuple[str, Any]] = []
    for block in blocks:
        if block["type"] == "text":
            got.append(("text", "".join(block["text_parts"])))
        else:
            got.append(("tool_use", (block["name"], json.loads("".join(block["json_parts"])))))
    assert got == expected


@pytest.mark.parametrize("how", ENCODINGS)
@pytest.mark.parametrize("name", RECORDED_STREAMS)
def test_responses_streams_validate_and_end_with_response_completed(name: str, how: str) -> None:
    request = fixture("responses_codex_request.json")
    prepared = responses_format.prepare(request, settings())
    data, comp = ENCODINGS[how](responses_format, prepared, name)
    events = []
    for event_name, payload in parse_sse(data):
        event = json.loads(payload)
        assert event_name == event["type"]
        RESPONSES_EVENT.validate_python(event, strict=True)
        events.append(event)

    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[0]["response"]["status"] == "in_progress"
    assert events[-1]["type"] == "response.completed"
    final = Response.model_validate(events[-1]["response"], strict=True)
    assert final.id == events[0]["response"]["id"]
    assert final.status == ("incomplete" if comp.finish_reason == "length" else "completed")
    assert final.usage is not None
    assert final.usage.output_tokens == comp.completion_tokens

    message = answer_of(name, how)
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == (message["content"] or "")
    if message["content"]:
        assert final.output_text == message["content"]
    # Each output item is added, then done, with its final form in the completed response.
    added = [e for e in events if e["type"] == "response.output_item.added"]
    done = [e for e in events if e["type"] == "response.output_item.done"]
    assert (
        [e["output_index"] for e in added]
        == [e["output_index"] for e in done]
        == list(range(len(final.output)))
    )
    assert [e["item"] for e in done] == events[-1]["response"]["output"]
    calls = [item for item in events[-1]["response"]["output"] if item["type"] == "function_call"]
    assert [(c["call_id"], c["name"], c["arguments"]) for c in calls] == [
        (c["id"], c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []
    ]
    for call in calls:
        deltas = [
            e["delta"]
            for e in events
            if e["type"] == "response.function_call_arguments.delta" and e["item_id"] == call["id"]
        ]
        assert "".join(deltas) == call["arguments"]


# -- Codex's custom (freeform) and namespace tools ---------------------------------------------------

# What Codex 0.171 sends (its request, captured): apply_patch as a custom tool with a Lark grammar, tools
# grouped in a namespace (its sub-agent tools, MCP servers), and history items of both kinds.
APPLY_PATCH_GRAMMAR = (
    'start: begin_patch hunk+ end_patch\nbegin_patch: "*** Begin Patch" LF\nend_patch: "*** End Patch" LF?\n'
    'hunk: add_hunk\nadd_hunk: "*** Add File: " filename LF add_line+\nfilename: /(.+)/\n'
    'add_line: "+" /(.*)/ LF -> line\n%import common.LF\n'
)
APPLY_PATCH: Any = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Use the `apply_patch` tool to edit files. This is a FREEFORM tool.",
    "format": {"type": "grammar", "syntax": "lark", "definition": APPLY_PATCH_GRAMMAR},
}
EXEC_COMMAND: Any = {
    "type": "function",
    "name": "exec_command",
    "description": "Runs a command in a PTY.",
    "strict": False,
    "parameters": {
        "type": "object",
        "properties": {"cmd": {"type": "string"}},
        "required": ["cmd"],
        "additionalProperties": False,
    },
}
AGENTS: Any = {
    "type": "namespace",
    "name": "multi_agent_v1",
    "description": "Tools for spawning and managing sub-agents.",
    "tools": [
        {
            "type": "function",
            "name": "spawn_agent",
            "description": "Spawn a sub-agent.",
            "strict": False,
            "parameters": {"type": "object", "properties": {"message": {"type": "string"}}},
        },
        {"type": "custom", "name": "note", "description": "Write a note."},
    ],
}
GITHUB: Any = {
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
}
PATCH = '*** Begin Patch\n*** Add File: hello.txt\n+hello "world"\n*** End Patch\n'
CODEX_TOOLS = [EXEC_COMMAND, APPLY_PATCH, AGENTS, GITHUB, {"type": "web_search"}]


def codex_tools_request(**changes: Any) -> dict[str, Any]:
    return {
        "model": "policy",
        "stream": True,
        "tools": copy.deepcopy(CODEX_TOOLS),
        "tool_choice": "auto",
        "input": [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Add it."}]}
        ],
        **changes,
    }


def test_custom_and_namespace_tools_reach_the_engine_as_functions() -> None:
    prepared = responses_format.prepare(codex_tools_request(), settings())
    custom_parameters = {
        "type": "object",
        "properties": {
            "input": {
                "type": "string",
                "description": "The tool's input: raw text, not JSON, in this lark grammar:\n"
                + APPLY_PATCH_GRAMMAR,
            }
        },
        "required": ["input"],
        "additionalProperties": False,
    }
    assert prepared.body["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "exec_command",
                "description": EXEC_COMMAND["description"],
                "parameters": EXEC_COMMAND["parameters"],
                "strict": False,
            },
        },
        # A custom tool: one string argument, the grammar in its description; never strict (the
        # engine cannot hold the text to a Lark grammar anyway).
        {
            "type": "function",
            "function": {
                "name": "apply_patch",
                "description": APPLY_PATCH["description"],
                "parameters": custom_parameters,
            },
        },
        # A namespace's tools, flattened: <namespace>__<name>, or <namespace><name> after a "_".
        {
            "type": "function",
            "function": {
                "name": "multi_agent_v1__spawn_agent",
                "description": "Spawn a sub-agent.",
                "parameters": AGENTS["tools"][0]["parameters"],
                "strict": False,
            },
        },
        {
            "type": "function",
            "function": {
                "name": "multi_agent_v1__note",
                "description": "Write a note.",
                "parameters": {
                    **custom_parameters,
                    "properties": {
                        "input": {"type": "string", "description": "The tool's input: raw text, not JSON."}
                    },
                },
            },
        },
        {
            "type": "function",
            "function": {
                "name": "mcp__github__search_issues",
                "parameters": GITHUB["tools"][0]["parameters"],
            },
        },
    ]
    assert prepared.body["tool_choice"] == "auto"


def test_custom_and_namespaced_history_items_become_the_engines_calls() -> None:
    items: Any = [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Add it."}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAAA"},
        {
            "type": "custom_tool_call",
            "id": "ctc_1",
            "status": "completed",
            "call_id": "call_patch",
            "name": "apply_patch",
            "input": PATCH,
        },
        {
            "type": "custom_tool_call_output",
            "call_id": "call_patch",
            "output": [{"type": "input_text", "text": "Success. Updated the following files:\nA hello.txt"}],
        },
        {
            "type": "function_call",
            "id": "fc_2",
            "call_id": "call_search",
            "namespace": "mcp__github__",
            "name": "search_issues",
            "arguments": '{"query":"parser"}',
        },
        {
            "type": "function_call",
            "id": "fc_3",
            "call_id": "call_spawn",
            "namespace": "multi_agent_v1",
            "name": "spawn_agent",
            "arguments": "{}",
        },
        {"type": "function_call_output", "call_id": "call_search", "output": "no issues"},
        {"type": "custom_tool_call_output", "call_id": "call_spawn", "output": "agent-1"},
    ]
    prepared = responses_format.prepare(codex_tools_request(input=items), settings())
    assert prepared.body["messages"] == [
        {"role": "user", "content": "Add it."},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_patch",
                    "type": "function",
                    # vLLM's tool parsers spell arguments with json.dumps' defaults.
                    "function": {"name": "apply_patch", "arguments": json.dumps({"input": PATCH})},
                }
            ],
        },
        {
            "role": "tool",
            "tool_call_id": "call_patch",
            "content": "Success. Updated the following files:\nA hello.txt",
        },
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_search",
                    "type": "function",
                    "function": {"name": "mcp__github__search_issues", "arguments": '{"query":"parser"}'},
                },
                {
                    "id": "call_spawn",
                    "type": "function",
                    "function": {"name": "multi_agent_v1__spawn_agent", "arguments": "{}"},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "call_search", "content": "no issues"},
        {"role": "tool", "tool_call_id": "call_spawn", "content": "agent-1"},
    ]


def test_a_custom_tool_call_needs_its_input() -> None:
    item = {"type": "custom_tool_call", "call_id": "call_1", "name": "apply_patch"}
    with pytest.raises(ProxyError) as caught:
        responses_format.prepare(codex_tools_request(input=[item]), settings())
    assert caught.value.kind == "invalid_request"
    assert "custom_tool_call needs an input string" in caught.value.message


@pytest.mark.parametrize(
    "tool",
    [
        {"type": "namespace", "tools": []},
        {"type": "namespace", "name": "ns"},
        {"type": "namespace", "name": "ns", "tools": ["spawn_agent"]},
        {"type": "custom"},
    ],
)
def test_a_malformed_namespace_or_custom_tool_is_refused(tool: dict[str, Any]) -> None:
    with pytest.raises(ProxyError) as caught:
        responses_format.prepare(codex_tools_request(tools=[tool]), settings())
    assert caught.value.kind == "invalid_request"
    assert caught.value.param == "tools" or "tools[0]" in (caught.value.param or "")


def _codex_tool_completion() -> Completion:
    """An engine answer calling the custom tool, a namespaced one and a plain one."""
    return Completion(
        id="chatcmpl-1",
        created=1700000000,
        text="Adding the file.",
        tool_calls=[
            ToolCall("call_patch", "apply_patch", json.dumps({"input": PATCH})),
            ToolCall("call_search", "mcp__github__search_issues", '{"query": "parser"}'),
            ToolCall("call_ls", "exec_command", '{"cmd": "ls"}'),
        ],
        finish_reason="tool_calls",
        prompt_token_ids=[1, 2, 3],
        completion_token_ids=[4, 5, 6, 7],
        completion_logprobs=[-0.5, -0.25, -0.125, -1.0],
        prompt_tokens=3,
        completion_tokens=4,
    )


CODEX_ITEMS = [
    ("message", None),
    ("custom_tool_call", {"call_id": "call_patch", "name": "apply_patch", "input": PATCH}),
    (
        "function_call",
        {
            "call_id": "call_search",
            "name": "search_issues",
            "namespace": "mcp__github__",
            "arguments": '{"query": "parser"}',
        },
    ),
    ("function_call", {"call_id": "call_ls", "name": "exec_command", "arguments": '{"cmd": "ls"}'}),
]
"""The output items Codex must get for `_codex_tool_completion()` (the fields that matter)."""


def assert_codex_items(output: list[dict[str, Any]]) -> None:
    assert [item["type"] for item in output] == [kind for kind, _ in CODEX_ITEMS]
    for item, (_, fields) in zip(output, CODEX_ITEMS, strict=True):
        if fields is not None:
            assert {k: item.get(k) for k in fields} == fields, item
            assert item["status"] == "completed"
    assert "namespace" not in output[1] and "namespace" not in output[3]
    assert output[1]["id"].startswith("ctc_") and len({item["id"] for item in output}) == len(output)


def test_calls_to_custom_and_namespaced_tools_come_back_as_codex_items() -> None:
    prepared = responses_format.prepare(codex_tools_request(stream=False), settings())
    answer = responses_format.response(prepared, _codex_tool_completion())
    parsed = Response.model_validate(answer, strict=True)
    assert_codex_items(answer["output"])
    assert parsed.output[1].type == "custom_tool_call" and parsed.output[1].input == PATCH
    assert parsed.output[2].type == "function_call" and parsed.output[2].namespace == "mcp__github__"


@pytest.mark.parametrize("pieces", [1, 7], ids=["whole", "in-pieces"])
def test_streamed_calls_to_custom_and_namespaced_tools(pieces: int) -> None:
    prepared = responses_format.prepare(codex_tools_request(), settings())
    comp = _codex_tool_completion()
    encoder = responses_format.Encoder(prepared)
    out = list(encoder.head(comp))
    out += encoder.event(TextDelta(comp.text, []))
    for i, call in enumerate(comp.tool_calls):
        out += encoder.event(ToolCallStart(i, call.id, call.name))
        size = -(-len(call.arguments) // pieces)
        for start in range(0, len(call.arguments), size):
            out += encoder.event(ToolCallArgs(i, call.arguments[start : start + size]))
    out += encoder.tail(comp)
    events = []
    for event_name, payload in parse_sse(b"".join(out)):
        event = json.loads(payload)
        assert event_name == event["type"]
        RESPONSES_EVENT.validate_python(event, strict=True)
        events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["type"] == "response.completed"
    final = events[-1]["response"]["output"]
    assert_codex_items(final)
    assert [e["item"] for e in events if e["type"] == "response.output_item.done"] == final
    added = [e["item"] for e in events if e["type"] == "response.output_item.added"]
    assert added[1] == {**final[1], "input": "", "status": "in_progress"}
    assert added[2]["namespace"] == "mcp__github__" and added[2]["name"] == "search_issues"
    # The custom call's input is text, not the engine's JSON: it goes out once the call is whole.
    patch_id = final[1]["id"]
    of_patch = [e for e in events if e.get("item_id") == patch_id]
    assert [e["type"] for e in of_patch] == [
        "response.custom_tool_call_input.delta",
        "response.custom_tool_call_input.done",
    ]
    assert of_patch[0]["delta"] == of_patch[1]["input"] == PATCH
    for call in final[2:]:
        deltas = [
            e["delta"]
            for e in events
            if e["type"] == "response.function_call_arguments.delta" and e["item_id"] == call["id"]
        ]
        assert "".join(deltas) == call["arguments"]


@pytest.mark.parametrize(
    "arguments",
    ['{"patch": "x"}', '{"input": 5}', "*** Begin Patch", '["x"]'],
    ids=["other-key", "not-a-string", "not-json", "not-an-object"],
)
def test_a_custom_call_the_model_got_wrong_goes_back_as_written(arguments: str) -> None:
    prepared = responses_format.prepare(codex_tools_request(stream=False), settings())
    comp = _codex_tool_completion()
    comp.tool_calls = [ToolCall("call_patch", "apply_patch", arguments)]
    answer = responses_format.response(prepared, comp)
    Response.model_validate(answer, strict=True)
    [_, item] = answer["output"]
    assert (item["type"], item["input"]) == ("custom_tool_call", arguments)


def test_the_items_codex_gets_back_re_render_the_engines_calls() -> None:
    """What Codex sends back of the answer (its items, verbatim) is, for the engine, the calls it made."""
    prepared = responses_format.prepare(codex_tools_request(stream=False), settings())
    comp = _codex_tool_completion()
    output = responses_format.response(prepared, comp)["output"]
    history = codex_tools_request()["input"] + output
    sent = responses_format.prepare(codex_tools_request(input=history), settings()).body["messages"]
    assert sent[1]["content"] == comp.text
    assert [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in sent[1]["tool_calls"]] == [
        (c.id, c.name, c.arguments) for c in comp.tool_calls
    ]


@pytest.mark.parametrize("options", [{}, {"logprobs": True, "stream_options": {"include_usage": True}}])
@pytest.mark.parametrize("how", ENCODINGS)
@pytest.mark.parametrize("name", RECORDED_STREAMS)
def test_chat_streams_validate_and_end_with_done(name: str, how: str, options: dict[str, Any]) -> None:
    request = {
        "model": "gpt-4.1-mini",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        **options,
    }
    prepared = chat_format.prepare(request, settings())
    data, comp = ENCODINGS[how](chat_format, prepared, name)
    events = parse_sse(data)
    assert events[-1] == (None, "[DONE]")
    chunks = []
    for event_name, payload in events[:-1]:
        assert event_name is None
        chunk = json.loads(payload)
        ChatCompletionChunk.model_validate(chunk, strict=True)
        assert (chunk["id"], chunk["model"]) == (comp.id, "gpt-4.1-mini")
        chunks.append(chunk)

    if options:
        *chunks, usage = chunks
        assert usage["choices"] == []
        assert usage["usage"] == {
            "prompt_tokens": comp.prompt_tokens,
            "completion_tokens": comp.completion_tokens,
            "total_tokens": comp.prompt_tokens + comp.completion_tokens,
        }
    assert all("usage" not in chunk for chunk in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    finishes = [c["choices"][0]["finish_reason"] for c in chunks]
    assert finishes[:-1] == [None] * (len(chunks) - 1)
    assert finishes[-1] == message_finish(name)

    message = answer_of(name, how)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("content") or "" for d in deltas) == (message["content"] or "")
    calls: dict[int, dict[str, str]] = {}
    for delta in deltas:
        for part in delta.get("tool_calls") or []:
            call = calls.setdefault(part["index"], {"id": "", "name": "", "arguments": ""})
            call["id"] = part.get("id") or call["id"]
            call["name"] = part["function"].get("name") or call["name"]
            call["arguments"] += part["function"].get("arguments") or ""
    assert [calls[i] for i in sorted(calls)] == [
        {"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]}
        for c in message.get("tool_calls") or []
    ]
    logprobs = [e for c in chunks for e in ((c["choices"][0].get("logprobs") or {}).get("content") or [])]
    if not options:
        assert logprobs == []
    elif how == "live":
        # Every sampled token's logprob, in order: tokens without text of their own (the end of
        # turn, tool-call syntax) ride on chunks with an empty delta.
        assert logprobs == [
            e
            for chunk in stream_chunks(name)
            for choice in chunk["choices"]
            for e in ((choice.get("logprobs") or {}).get("content") or [])
        ]
    elif comp.text:
        # Replayed from a whole answer: the text arrives in one chunk, with every logprob.
        assert logprobs == comp.logprobs_content


def message_finish(name: str) -> str:
    finish: str = recorded(name)["choices"][0]["finish_reason"]
    return finish


# ---------------------------------------------------------------------------------------------------
# The SDK clients themselves read what the proxy writes
# ---------------------------------------------------------------------------------------------------


class _CannedServer(ThreadingHTTPServer):
    status = 200
    content_type = "application/json"
    body = b""


class _Canned(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        server = self.server
        assert isinstance(server, _CannedServer)
        self.rfile.read(int(self.headers.get("content-length") or 0))
        self.send_response(server.status)
        self.send_header("content-type", server.content_type)
        self.send_header("content-length", str(len(server.body)))
        self.end_headers()
        self.wfile.write(server.body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@contextmanager
def serving(body: bytes, *, status: int = 200, content_type: str = "text/event-stream") -> Iterator[str]:
    """A local HTTP server answering every POST with `body` (what the proxy would have written)."""
    server = _CannedServer(("127.0.0.1", 0), _Canned)
    server.status, server.content_type, server.body = status, content_type, body
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.mark.parametrize("name", RECORDED_STREAMS)
def test_the_anthropic_sdk_reads_the_stream(name: str) -> None:
    prepared = anthropic_format.prepare(fixture("anthropic_claude_code_request.json"), settings())
    data, comp = encode_live(anthropic_format, prepared, name)
    with (
        serving(data) as url,
        anthropic.Anthropic(api_key="test", base_url=url, max_retries=0) as client,
        client.messages.stream(
            model=SDK_MODEL, max_tokens=1024, messages=[{"role": "user", "content": "hi"}]
        ) as stream,
    ):
        final = stream.get_final_message()
    assert final.stop_reason == ANTHROPIC_STOP[name][0]
    assert final.usage.output_tokens == comp.completion_tokens
    message = streamed_message(name)
    assert [b.text for b in final.content if b.type == "text"] == (
        [message["content"]] if message["content"] else []
    )
    assert [(b.id, b.name, b.input) for b in final.content if b.type == "tool_use"] == [
        (c["id"], c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in message.get("tool_calls") or []
    ]


@pytest.mark.parametrize("name", RECORDED_STREAMS)
def test_the_openai_sdk_reads_the_responses_stream(name: str) -> None:
    prepared = responses_format.prepare(fixture("responses_codex_request.json"), settings())
    data, comp = encode_live(responses_format, prepared, name)
    with (
        serving(data) as url,
        openai.OpenAI(api_key="test", base_url=f"{url}/v1", max_retries=0) as client,
        client.responses.stream(model="gpt-5-codex", input="hi") as stream,
    ):
        final = stream.get_final_response()
    message = streamed_message(name)
    assert final.output_text == (message["content"] or "")
    assert [(o.call_id, o.name, o.arguments) for o in final.output if o.type == "function_call"] == [
        (c["id"], c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []
    ]
    assert final.status == ("incomplete" if comp.finish_reason == "length" else "completed")


@pytest.mark.parametrize("name", RECORDED_STREAMS)
def test_the_openai_sdk_reads_the_chat_stream(name: str) -> None:
    request = {"model": "gpt-4.1-mini", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    prepared = chat_format.prepare({**request, "stream_options": {"include_usage": True}}, settings())
    data, comp = encode_live(chat_format, prepared, name)
    with (
        serving(data) as url,
        openai.OpenAI(api_key="test", base_url=f"{url}/v1", max_retries=0) as client,
        client.chat.completions.stream(
            model="gpt-4.1-mini", messages=[{"role": "user", "content": "hi"}]
        ) as stream,
    ):
        if message_finish(name) == "length":
            # The SDK's stream helper refuses a truncated answer, knowing it from the finish reason.
            with pytest.raises(openai.LengthFinishReasonError):
                stream.get_final_completion()
            return
        final = stream.get_final_completion()
    message = streamed_message(name)
    choice = final.choices[0]
    assert choice.finish_reason == message_finish(name)
    assert (choice.message.content or "") == (message["content"] or "")
    assert [(c.id, c.function.name, c.function.arguments) for c in choice.message.tool_calls or []] == [
        (c["id"], c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []
    ]
    assert final.usage is not None
    assert final.usage.completion_tokens == comp.completion_tokens


# ---------------------------------------------------------------------------------------------------
# An answer sent back as history is the message the engine produced
# ---------------------------------------------------------------------------------------------------


def engine_message(name: str) -> dict[str, Any]:
    """The assistant message as vLLM returned it: what the next prompt must render again."""
    message = message_of(name)
    out: dict[str, Any] = {"role": "assistant", "content": message["content"]}
    if message.get("tool_calls"):
        out["tool_calls"] = [
            {"id": c["id"], "type": "function", "function": dict(c["function"])}
            for c in message["tool_calls"]
        ]
    return out


def tool_results(name: str) -> list[str]:
    return [c["id"] for c in message_of(name).get("tool_calls") or []]


@pytest.mark.parametrize("name", TOOL_ANSWERS)
def test_an_anthropic_answer_sent_back_is_the_engines_own_message(name: str) -> None:
    prepared = anthropic_format.prepare(fixture("anthropic_claude_code_request.json"), settings())
    answer = anthropic_format.response(prepared, completion_from_response(recorded(name)))
    follow_up = {
        "model": "claude-sonnet-4-5-20250929",
        "max_tokens": 1024,
        "messages": [
            {"role": "user", "content": "List the files in the repository."},
            {"role": "assistant", "content": answer["content"]},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": i, "content": "ok"} for i in tool_results(name)
                ],
            },
        ],
    }
    messages = anthropic_format.prepare(follow_up, settings()).body["messages"]
    assert messages[1] == engine_message(name)
    assert messages[2:] == [{"role": "tool", "tool_call_id": i, "content": "ok"} for i in tool_results(name)]


@pytest.mark.parametrize(
    "name",
    [
        "vllm_tool_call",
        "vllm_parallel_tool_calls",
    ],
)
def test_a_responses_answer_sent_back_is_the_engines_own_message(name: str) -> None:
    prepared = responses_format.prepare(fixture("responses_codex_request.json"), settings())
    answer = responses_format.response(prepared, completion_from_response(recorded(name)))
    follow_up = {
        "model": "gpt-5-codex",
        "input": [
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "List the files."}],
            },
            *answer["output"],
            *({"type": "function_call_output", "call_id": i, "output": "ok"} for i in tool_results(name)),
        ],
    }
    messages = responses_format.prepare(follow_up, settings()).body["messages"]
    assert messages[1:] == [
        engine_message(name),
        *({"role": "tool", "tool_call_id": i, "content": "ok"} for i in tool_results(name)),
    ]


@pytest.mark.parametrize("name", TOOL_ANSWERS)
def test_a_chat_answer_sent_back_is_the_engines_own_message(name: str) -> None:
    prepared = chat_format.prepare(
        {"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}, settings()
    )
    answer = chat_format.response(prepared, completion_from_response(recorded(name)))
    returned = ChatCompletion.model_validate(answer).choices[0].message
    follow_up = {
        "model": "gpt-4",
        "messages": [
            {"role": "user", "content": "hi"},
            returned.model_dump(
                exclude_none=True, exclude={"annotations", "audio", "function_call", "refusal"}
            ),
        ],
    }
    messages = chat_format.prepare(follow_up, settings()).body["messages"]
    expected = engine_message(name)
    if expected["content"] is None:
        del expected["content"]
    assert messages[1] == expected


# ---------------------------------------------------------------------------------------------------
# Errors in each client's shape
# ---------------------------------------------------------------------------------------------------

# kind: (HTTP status, Anthropic error type, OpenAI error type, OpenAI code)
ERROR_SHAPES = {
    "invalid_request": (400, "invalid_request_error", "invalid_request_error", "invalid_request"),
    "not_found": (404, "not_found_error", "invalid_request_error", "not_found"),
    "method_not_allowed": (405, "invalid_request_error", "invalid_request_error", "method_not_allowed"),
    "too_large": (413, "request_too_large", "invalid_request_error", "too_large"),
    "context_overflow": (400, "invalid_request_error", "invalid_request_error", "context_length_exceeded"),
    "engine_error": (502, "api_error", "server_error", "engine_error"),
    "proxy_error": (500, "api_error", "server_error", "proxy_error"),
    "trial_finished": (409, "invalid_request_error", "invalid_request_error", "trial_finished"),
}


@pytest.mark.parametrize("kind", ERROR_SHAPES)
def test_error_bodies_have_each_vendors_shape(kind: Any) -> None:
    status, anthropic_type, openai_type, code = ERROR_SHAPES[kind]
    error = ProxyError(kind, "something went wrong", param="max_tokens")
    assert error.http_status == status

    body = error_body(ApiFormat.ANTHROPIC_MESSAGES, error)
    assert body == {"type": "error", "error": {"type": anthropic_type, "message": "something went wrong"}}
    if anthropic_type != "request_too_large":
        # The SDK's union of error objects lacks the documented 413 type (Cloudflare sends it).
        anthropic.types.ErrorResponse.model_validate(body, strict=True)

    for api_format in (ApiFormat.OPENAI_CHAT, ApiFormat.OPENAI_RESPONSES, None):
        body = error_body(api_format, error)
        assert body == {
            "error": {
                "message": "something went wrong",
                "type": openai_type,
                "param": "max_tokens",
                "code": code,
            }
        }
        openai.types.ErrorObject.model_validate(body["error"], strict=True)


def test_the_openai_sdk_raises_with_the_errors_code_and_param() -> None:
    error = ProxyError("context_overflow", "the prompt (40000 tokens) does not fit", param="messages")
    body = json.dumps(error_body(ApiFormat.OPENAI_CHAT, error)).encode()
    with (
        serving(body, status=error.http_status, content_type="application/json") as url,
        openai.OpenAI(api_key="test", base_url=f"{url}/v1", max_retries=0) as client,
        pytest.raises(openai.BadRequestError) as caught,
    ):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])
    assert caught.value.code == "context_length_exceeded"
    assert caught.value.param == "messages"
    assert caught.value.status_code == 400


def test_the_anthropic_sdk_raises_with_the_errors_type() -> None:
    error = ProxyError("engine_error", "the engine stayed unavailable for 120 s")
    body = json.dumps(error_body(ApiFormat.ANTHROPIC_MESSAGES, error)).encode()
    with (
        serving(body, status=error.http_status, content_type="application/json") as url,
        anthropic.Anthropic(api_key="test", base_url=url, max_retries=0) as client,
        pytest.raises(anthropic.APIStatusError) as caught,
    ):
        client.messages.create(model=SDK_MODEL, max_tokens=10, messages=[{"role": "user", "content": "hi"}])
    assert caught.value.status_code == 502
    assert caught.value.body == {"type": "error", "error": {"type": "api_error", "message": error.message}}


def test_a_failed_chat_stream_makes_the_openai_sdk_raise() -> None:
    prepared = chat_format.prepare(
        {"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}], "stream": True}, settings()
    )
    comp = completion_from_response(recorded("vllm_text_length"))
    encoder = chat_format.Encoder(prepared)
    data = b"".join(
        [*encoder.head(comp), *encoder.error(ProxyError("engine_error", "the engine dropped the stream"))]
    )
    with (
        serving(data) as url,
        openai.OpenAI(api_key="test", base_url=f"{url}/v1", max_retries=0) as client,
        pytest.raises(openai.APIError, match="the engine dropped the stream"),
    ):
        for _ in client.chat.completions.create(
            model="gpt-4", messages=[{"role": "user", "content": "hi"}], stream=True
        ):
            pass


def test_failed_anthropic_and_responses_streams_end_with_an_error_event() -> None:
    comp = completion_from_response(recorded("vllm_text_length"))
    error = ProxyError("engine_error", "the engine dropped the stream")

    prepared = anthropic_format.prepare(fixture("anthropic_claude_code_request.json"), settings())
    encoder = anthropic_format.Encoder(prepared)
    ((name, payload),) = parse_sse(b"".join(encoder.error(error)))
    assert name == "error"
    anthropic.types.ErrorResponse.model_validate(json.loads(payload), strict=True)
    assert json.loads(payload)["error"]["type"] == "api_error"

    prepared = responses_format.prepare(fixture("responses_codex_request.json"), settings())
    responses_encoder = responses_format.Encoder(prepared)
    head = parse_sse(b"".join(responses_encoder.head(comp)))
    ((name, payload), (failed_name, failed_payload)) = parse_sse(b"".join(responses_encoder.error(error)))
    event = json.loads(payload)
    assert name == "error"
    RESPONSES_EVENT.validate_python(event, strict=True)
    assert (event["code"], event["message"]) == ("engine_error", "the engine dropped the stream")
    assert event["sequence_number"] == len(head)
    # Then the response's own terminal event, as OpenAI ends a failed response.
    failed = json.loads(failed_payload)
    assert failed_name == "response.failed"
    RESPONSES_EVENT.validate_python(failed, strict=True)
    assert failed["response"]["status"] == "failed"
    assert failed["sequence_number"] == len(head) + 1


# Qwen3's rule, as its chat templates spell it: a system message anywhere but first is an error.
STRICT_TEMPLATE = """\
{%- for message in messages %}
    {%- if message.role == 'system' and not loop.first %}
        {{- raise_exception('System message must be at the beginning.') }}
    {%- endif %}
    {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endfor %}
{{- '<|im_start|>assistant\\n' }}"""


def test_system_messages_after_the_first_are_sent_so_a_strict_template_renders_them() -> None:
    from transformers.utils.chat_template_utils import render_jinja_template  # noqa: PLC0415

    def render(messages: list[dict[str, Any]]) -> str:
        rendered: Any = render_jinja_template(conversations=[messages], chat_template=STRICT_TEMPLATE)
        return str(rendered[0][0])

    harness = [
        {"role": "system", "content": "You are Claude Code."},
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Fix the test."},
        {"role": "system", "content": "Available agent types: general."},
    ]
    with pytest.raises(Exception, match="System message must be at the beginning"):
        render(harness)
    sent = system_first(harness)
    assert sent == [
        {"role": "system", "content": "You are Claude Code.\n\nBe terse."},
        {"role": "user", "content": "Fix the test."},
        {"role": "user", "content": "Available agent types: general."},
    ]
    assert render(sent).endswith(
        "<|im_start|>user\nAvailable agent types: general.<|im_end|>\n<|im_start|>assistant\n"
    )
    # What is already well-formed is sent as it is (the same list: nothing copied).
    plain = harness[1:3]
    assert system_first(plain) is plain
    assert system_first(harness[2:3]) == harness[2:3]

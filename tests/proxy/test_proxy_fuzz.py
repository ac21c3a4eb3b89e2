"""Fuzzing the proxy's POST routes with hypothesis: whatever a harness sends, the proxy answers in the
client's own format with a status below 500 (or a well-formed engine error), keeps serving, and
keeps a journal that reads back whole with exactly one turn per successful call.

What is tried (a proxy and a fake engine served once for the module, each under uvicorn):

- `test_arbitrary_bodies`: every POST route (`/v1/chat/completions`, `/v1/responses`,
  `/v1/messages`, `/v1/messages/count_tokens`; `/finish` apart) with any JSON value (objects
  keyed by the routes' own field names or random text, arrays, scalars) or random bytes.
- `test_mutated_requests`: realistic requests (a bare one and a full one per route: the shapes
  Claude Code, Codex and OpenCode send) with up to two mutations each: a field or list item
  dropped, replaced by a random JSON value, given another type (string, list, object, null, 0,
  -1, true, "", its own JSON text), or another value of its type (text, number, a list doubled,
  reversed or emptied, an object emptied or given extra keys).
- `test_finish`: `/finish` (on a proxy of its own, since a valid reason ends the trial) with
  random and mutated bodies: a 400 or the first end state, which no later call changes.

A typical run (`--hypothesis-show-statistics`, 150 examples each, ~15 s in all): arbitrary
bodies are all 400s (a random value is practically never a valid request); mutated requests give
about 25% 200s (streamed and whole, count_tokens included) and 75% 400s; `/finish` about 15% 200s.
No 5xx, no torn journal. A run of 2,500 examples each (4 min) found five crashes, now fixed and
pinned by the regression cases at the end; the fake engine refused 11 of the translated
requests (chat messages whose `tool_calls` or content parts are malformed: the chat format passes
them through for the engine to judge).

Kept out of the generated inputs: the fake engine's failure markers (OVERFLOW, HANG...: failures
on cue are test_proxy_app's business) and NaN/Infinity and lone surrogates, which hypothesis makes
neither of by default (the regression cases at the end send both).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

from legorl.api.termination import TerminationReason
from legorl.proxy.app import ProxyApp
from legorl.proxy.journal import read_journal
from legorl.proxy.settings import ProxySettings
from legorl.proxy.testing import FakeEngine
from tests.support.asgi_server import serve

FUZZ = settings(
    max_examples=150,
    deadline=None,
    database=None,  # nothing written into the repository; failures print their example
    suppress_health_check=[HealthCheck.too_slow],
)
MARKERS = ("OVERFLOW", "GARBAGE", "HANG", "DROP", "FAIL500")
MODEL_ROUTES = ("/v1/chat/completions", "/v1/responses", "/v1/messages")
ROUTES = (*MODEL_ROUTES, "/v1/messages/count_tokens")
ANTHROPIC_ERROR_TYPES = {"invalid_request_error", "not_found_error", "request_too_large", "api_error"}


# -- the fake engine, made to refuse what it cannot parse -----------------------------------------


class ParsingEngine:
    """`FakeEngine` that answers what it cannot parse with vLLM's 400 instead of crashing into a
    500: the proxy passes some client fields through unchecked (vLLM validates them), and a 500
    would rightly end the trial as an engine error, leaving nothing more to fuzz."""

    def __init__(self) -> None:
        self.fake = FakeEngine()
        self.refused: list[str] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        started = False

        async def tracking_send(message: Any) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.fake(scope, receive, tracking_send)
        except Exception as exc:  # any crash of the fake on a bad request is its refusal
            if started:
                raise
            self.refused.append(f"{type(exc).__name__}: {exc}")
            message = f"1 validation error: {type(exc).__name__}"
            data = json.dumps({"error": {"message": message, "type": "BadRequestError", "code": 400}})
            headers = [(b"content-type", b"application/json")]
            await send({"type": "http.response.start", "status": 400, "headers": headers})
            await send({"type": "http.response.body", "body": data.encode()})


@dataclass
class Served:
    url: str
    journal: Path
    engine: ParsingEngine
    http: httpx.Client
    successes: int = 0
    """Model calls answered 200 so far: the journal must hold exactly this many turns."""


@pytest.fixture(scope="module")
def engine_url() -> Iterator[tuple[ParsingEngine, str]]:
    engine = ParsingEngine()
    with serve(engine) as url:
        yield engine, url


@contextmanager
def served(engine: tuple[ParsingEngine, str], journal: Path) -> Iterator[Served]:
    settings_ = ProxySettings(
        upstream=engine[1], journal=journal, max_body_bytes=64 * 1024, read_timeout_seconds=5
    )
    with serve(ProxyApp(settings_)) as url, httpx.Client(base_url=url, timeout=30, verify=False) as http:
        yield Served(url, journal, engine[0], http)


@pytest.fixture(scope="module")
def proxy(
    engine_url: tuple[ParsingEngine, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Served]:
    with served(engine_url, tmp_path_factory.mktemp("fuzz") / "journal") as proxy:
        yield proxy


@pytest.fixture(scope="module")
def finish_proxy(
    engine_url: tuple[ParsingEngine, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Served]:
    with served(engine_url, tmp_path_factory.mktemp("finish") / "journal") as proxy:
        yield proxy


# -- what is generated ----------------------------------------------------------------------------

FIELDS = [
    "model", "messages", "input", "instructions", "system", "role", "content", "type", "text",
    "tools", "tool_choice", "tool_calls", "function", "name", "arguments", "parameters",
    "input_schema", "max_tokens", "max_output_tokens", "max_completion_tokens", "stream",
    "stream_options", "temperature", "top_p", "stop", "stop_sequences", "n", "logprobs",
    "top_logprobs", "tool_use_id", "tool_call_id", "call_id", "id", "output", "source", "reason",
    "exitCode", "detail",
]  # fmt: skip
keys = st.sampled_from(FIELDS) | st.text(max_size=8)
scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=24)
    | st.sampled_from(["user", "assistant", "system", "developer", "tool", "function", "text", "auto"])
)
json_values = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(keys, children, max_size=5),
    max_leaves=24,
)

CHAT_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a command.",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "$schema": "x"},
        },
    }
]
BASES: dict[str, list[dict[str, Any]]] = {
    "/v1/chat/completions": [
        {"model": "gpt-test", "messages": [{"role": "user", "content": "SAY: hi"}]},
        {
            "model": "gpt-test",
            "messages": [
                {"role": "developer", "content": "Be terse."},
                {"role": "user", "content": [{"type": "text", "text": "List files."}]},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "bash", "arguments": '{"command":"ls"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "a.py"}]},
                {"role": "user", "content": "CALL_TOOL"},
            ],
            "tools": CHAT_TOOLS,
            "tool_choice": "auto",
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": 0.7,
            "top_p": 0.9,
            "max_tokens": 64,
            "stop": ["\n\n"],
            "logprobs": True,
            "top_logprobs": 2,
            "seed": 1,
            "n": 1,
        },
    ],
    "/v1/responses": [
        {"model": "gpt-test", "input": "SAY: hi"},
        {
            "model": "gpt-test",
            "instructions": "Be terse.",
            "input": [
                {
                    "type": "message",
                    "role": "developer",
                    "content": [{"type": "input_text", "text": "Rules."}],
                },
                {
                    "type": "message",
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "Look."},
                        {"type": "input_image", "image_url": "data:image/png;base64,AAAA"},
                    ],
                },
                {"type": "reasoning", "id": "rs_1", "summary": []},
                {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "bash", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "a.py"},
                {"role": "user", "content": "SAY: done"},
            ],
            "tools": [
                {"type": "function", "name": "bash", "parameters": {"type": "object"}, "strict": False},
                {"type": "web_search"},
                {"type": "namespace", "name": "ns", "tools": []},
            ],
            "tool_choice": "auto",
            "parallel_tool_calls": False,
            "stream": True,
            "max_output_tokens": 64,
            "temperature": 1.0,
            "store": False,
            "include": ["reasoning.encrypted_content"],
            "prompt_cache_key": "k",
        },
    ],
    "/v1/messages": [
        {"model": "claude-test", "max_tokens": 32, "messages": [{"role": "user", "content": "SAY: hi"}]},
        {
            "model": "claude-test",
            "max_tokens": 64,
            "system": [{"type": "text", "text": "Be terse.", "cache_control": {"type": "ephemeral"}}],
            "messages": [
                {"role": "system", "content": "More rules."},
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "Look."},
                        {
                            "type": "image",
                            "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"},
                        },
                    ],
                },
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "hmm", "signature": "s"},
                        {"type": "text", "text": "Running."},
                        {"type": "tool_use", "id": "t1", "name": "bash", "input": {"command": "ls"}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "t1",
                            "content": [{"type": "text", "text": "a.py"}],
                        },
                        {"type": "text", "text": "CALL_TOOL"},
                    ],
                },
            ],
            "tools": [
                {"name": "bash", "description": "Run.", "input_schema": {"type": "object"}},
                {"type": "web_search_20250305", "name": "web_search"},
            ],
            "tool_choice": {"type": "auto"},
            "thinking": {"type": "enabled", "budget_tokens": 1024},
            "metadata": {"user_id": "u"},
            "stop_sequences": ["\n\nHuman:"],
            "temperature": 1.0,
            "stream": True,
        },
    ],
    "/v1/messages/count_tokens": [
        {
            "model": "claude-test",
            "system": "Be terse.",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "tools": [{"name": "bash", "input_schema": {"type": "object"}}],
        }
    ],
    "/finish": [{"reason": "agent_error", "exitCode": 1, "detail": "the harness gave up"}],
}

RETYPES: list[Callable[[Any], Any]] = [
    str,
    lambda v: [v],
    lambda v: {"value": v},
    lambda v: None,
    lambda v: 0,
    lambda v: -1,
    lambda v: True,
    lambda v: "",
    json.dumps,
]


def _slots(value: Any, out: list[tuple[Any, Any]]) -> list[tuple[Any, Any]]:
    """Every (container, key or index) inside a JSON value."""
    if isinstance(value, dict):
        for key in value:
            out.append((value, key))
            _slots(value[key], out)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            out.append((value, index))
            _slots(item, out)
    return out


def _same_type(value: Any) -> st.SearchStrategy[Any]:
    """Another value of the same JSON type: what passes a type check but may still surprise."""
    if isinstance(value, bool):
        return st.booleans()
    if isinstance(value, int):
        return st.integers(min_value=-5, max_value=100_000)
    if isinstance(value, float):
        return st.floats(min_value=-3, max_value=3)
    if isinstance(value, str):
        return st.text(max_size=24) | st.sampled_from(["", " ", "{", "user", "function", "text"])
    if isinstance(value, list):
        return st.just(value + value) | st.just(value[::-1]) | st.just([])
    if isinstance(value, dict):
        return st.just({}) | st.dictionaries(keys, json_values, max_size=3).map(
            lambda extra: {**value, **extra}
        )
    return st.none()


@st.composite
def mutated(draw: st.DrawFn, route: str) -> Any:
    body = copy.deepcopy(draw(st.sampled_from(BASES[route])))
    for _ in range(draw(st.integers(0, 2))):
        slots = _slots(body, [])
        if not slots:
            break
        container, key = draw(st.sampled_from(slots))
        how = draw(st.sampled_from(["drop", "replace", "retype", "tweak"]))
        if how == "drop":
            del container[key]
        elif how == "replace":
            container[key] = draw(json_values)
        elif how == "retype":
            container[key] = draw(st.sampled_from(RETYPES))(container[key])
        else:
            container[key] = draw(_same_type(container[key]))
        note(f"mutation: {how}")
    return body


def note(text: str) -> None:
    """Count an outcome for `--hypothesis-show-statistics` (outside a fuzz test: nothing)."""
    if currently_in_test_context():
        event(text)


# -- what every answer must be --------------------------------------------------------------------


def _sse_events(text: str) -> list[tuple[str | None, str]]:
    events = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        name = None
        data = ""
        for line in block.split("\n"):
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data += line[5:].strip()
        events.append((name, data))
    return events


def check_success(route: str, response: httpx.Response) -> None:
    if response.headers["content-type"].startswith("text/event-stream"):
        events = _sse_events(response.text)
        assert events, "an empty stream"
        last_name, last_data = events[-1]
        if route == "/v1/chat/completions":
            assert last_data == "[DONE]"
            for _, data in events[:-1]:
                assert json.loads(data)["object"] == "chat.completion.chunk"
        elif route == "/v1/responses":
            assert last_name == "response.completed"
            sequence = [json.loads(data)["sequence_number"] for _, data in events]
            assert sequence == list(range(len(events)))
        else:
            assert last_name == "message_stop"
            assert events[0][0] == "message_start"
        note(f"{route} -> 200 stream")
        return
    body = response.json()
    if route == "/v1/chat/completions":
        assert body["object"] == "chat.completion"
        assert body["choices"][0]["message"]["role"] == "assistant"
    elif route == "/v1/responses":
        assert body["object"] == "response"
        assert body["status"] in ("completed", "incomplete")
    elif route == "/v1/messages":
        assert body["type"] == "message" and body["role"] == "assistant"
        assert body["stop_reason"] in ("end_turn", "tool_use", "max_tokens", "stop_sequence")
    elif route == "/v1/messages/count_tokens":
        assert isinstance(body["input_tokens"], int) and body["input_tokens"] > 0
    note(f"{route} -> 200")


def check_error(route: str, response: httpx.Response) -> None:
    status = response.status_code
    assert response.headers["content-type"] == "application/json", response.text[:300]
    body = response.json()
    if route.startswith("/v1/messages"):
        assert set(body) == {"type", "error"} and body["type"] == "error", body
        assert set(body["error"]) == {"type", "message"}, body
        assert body["error"]["type"] in ANTHROPIC_ERROR_TYPES
        engine_error = body["error"]["type"] == "api_error"
    else:
        assert set(body) == {"error"}, body
        error = body["error"]
        assert set(error) == {"message", "type", "param", "code"}, body
        assert isinstance(error["code"], str) and isinstance(error["type"], str)
        assert error["param"] is None or isinstance(error["param"], str)
        engine_error = error["code"] == "engine_error"
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    assert status < 500 or (status in (502, 503, 504) and engine_error), (status, body)
    note(f"{route} -> {status}")


def send(proxy: Served, route: str, content: bytes) -> httpx.Response:
    response = proxy.http.post(route, content=content, headers={"content-type": "application/json"})
    if response.status_code == 200:
        check_success(route, response)
        if route in MODEL_ROUTES:
            proxy.successes += 1
    else:
        check_error(route, response)
    # The journal reads back whole, with one turn per successful call and nothing else.
    recovered = read_journal(proxy.journal)
    assert recovered.dropped_bytes == 0
    assert [r["type"] for r in recovered.records] == ["turn"] * proxy.successes
    return response


def _content(body: Any) -> bytes:
    return body if isinstance(body, bytes) else json.dumps(body).encode()


# -- the fuzz tests -------------------------------------------------------------------------------


@pytest.mark.parametrize("route", ROUTES)
def test_the_unmutated_requests_are_served(proxy: Served, route: str) -> None:
    for body in BASES[route]:
        response = send(proxy, route, _content(body))
        assert response.status_code == 200, response.text


@FUZZ
@given(
    route=st.sampled_from(ROUTES),
    body=json_values | st.dictionaries(keys, json_values, max_size=8) | st.binary(max_size=64),
)
def test_arbitrary_bodies(proxy: Served, route: str, body: Any) -> None:
    content = _content(body)
    assume(not any(m.encode() in content for m in MARKERS))
    send(proxy, route, content)


@FUZZ
@given(data=st.data(), route=st.sampled_from(ROUTES))
def test_mutated_requests(proxy: Served, data: st.DataObject, route: str) -> None:
    body = data.draw(mutated(route))
    content = _content(body)
    assume(not any(m.encode() in content for m in MARKERS))
    send(proxy, route, content)


def test_the_trial_survived_the_fuzz(proxy: Served) -> None:
    """No input a harness can send ends the trial or stops the proxy (runs after the fuzz)."""
    good = BASES["/v1/chat/completions"][0]
    send(proxy, "/v1/chat/completions", json.dumps(good).encode())
    trajectory = proxy.http.get("/trajectory?tokens=false").json()
    assert trajectory["state"] == "running", trajectory
    assert trajectory["turns"] == proxy.successes
    assert "engine_error" not in trajectory["errors"]
    assert proxy.http.get("/health").status_code == 200
    print(f"fuzz: {proxy.successes} turns; the fake engine refused {len(proxy.engine.refused)} requests")
    for refusal in proxy.engine.refused:
        print("  refused:", refusal)


@FUZZ
@given(
    body=st.dictionaries(keys, json_values, max_size=4)
    | mutated("/finish")
    | st.fixed_dictionaries(
        {"reason": st.sampled_from([r.value for r in TerminationReason])},
        optional={"exitCode": json_values, "detail": json_values},
    )
)
def test_finish(finish_proxy: Served, body: Any) -> None:
    before = finish_proxy.http.get("/trajectory?tokens=false").json()["end"]
    response = finish_proxy.http.post("/finish", content=_content(body))
    if response.status_code == 200:
        end = response.json()["end"]
        assert end["reason"] in {r.value for r in TerminationReason}
        assert before is None or end == before, "a later /finish changed the end state"
        note("finish -> 200")
    else:
        assert response.status_code == 400
        check_error("/finish", response)
        assert response.json()["error"]["param"] in ("reason", "exitCode", "detail", None)
    recovered = read_journal(finish_proxy.journal)
    assert recovered.dropped_bytes == 0
    ends = [r for r in recovered.records if r["type"] == "end"]
    assert len(ends) == (0 if finish_proxy.http.get("/trajectory").json()["end"] is None else 1)


# -- crashes the fuzz found -----------------------------------------------------------------------

CRASHES = [
    pytest.param(
        "/v1/chat/completions",
        b'{"model": "m", "messages": [{"role": ["user"], "content": "hi"}]}',
        id="chat-unhashable-role",
    ),
    pytest.param(
        "/v1/responses",
        b'{"model": "m", "input": [{"role": "user", "content": [{"type": [], "text": "x"}]}]}',
        id="responses-unhashable-part-type",
    ),
    pytest.param(
        "/v1/messages",
        b'{"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": '
        b'[{"type": "image", "source": "https://example.com/a.png"}]}]}',
        id="anthropic-image-source-string",
    ),
    pytest.param(
        "/v1/chat/completions",
        b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "seed": NaN}',
        id="chat-nan",
    ),
    pytest.param(
        "/v1/messages",
        b'{"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "a\\ud800b"}]}',
        id="anthropic-lone-surrogate",
    ),
]


@pytest.mark.parametrize(("route", "content"), CRASHES)
def test_a_malformed_request_never_crashes_the_proxy(
    engine_url: tuple[ParsingEngine, str], tmp_path: Path, route: str, content: bytes
) -> None:
    with served(engine_url, tmp_path / "journal") as proxy:
        response = proxy.http.post(route, content=content, headers={"content-type": "application/json"})
        assert response.status_code < 500, response.text
        if response.status_code != 200:
            check_error(route, response)
        assert proxy.http.get("/trajectory").json()["state"] == "running"

"""The engine client (`legorl.proxy.http1`, and `Upstream`'s SSE reader on it) against raw servers on
loopback that answer byte for byte what each test scripts: chunked and sized bodies split anywhere
across socket reads, keep-alive reuse, a pooled connection the engine closed while idle, refusals,
silences and answers cut off mid-body."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from legorl.proxy import http1
from legorl.proxy.errors import ProxyError
from legorl.proxy.metrics import Metrics
from legorl.proxy.settings import ProxySettings
from legorl.proxy.upstream import Upstream

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    """One request (head and a content-length body), or b"" at EOF."""
    head = await reader.readuntil(b"\r\n\r\n") if not reader.at_eof() else b""
    if not head:
        return b""
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return head + (await reader.readexactly(length) if length else b"")


def _closing(handler: Handler) -> Handler:
    """The handler, its connection closed however it ends (also when the test's loop cancels it)."""

    async def run(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    return run


async def _serve(handler: Handler) -> tuple[asyncio.Server, str]:
    server = await asyncio.start_server(_closing(handler), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}"


def _client(url: str, **options: float) -> http1.Client:
    settings: dict[str, float] = {
        "connect_timeout": 2.0,
        "read_timeout": 2.0,
        "max_connections": 4,
        "keepalive_expiry": 60.0,
    }
    settings.update(options)
    return http1.Client(
        url,
        connect_timeout=settings["connect_timeout"],
        read_timeout=settings["read_timeout"],
        max_connections=int(settings["max_connections"]),
        keepalive_expiry=settings["keepalive_expiry"],
    )


async def _write_apart(writer: asyncio.StreamWriter, pieces: list[bytes]) -> None:
    """Each piece in a socket write of its own, far enough apart to arrive as separate reads."""
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for piece in pieces:
        writer.write(piece)
        await writer.drain()
        await asyncio.sleep(0.02)


SSE_PIECES = [b'data: {"a": 1}\r', b"\n\r\nda", b'ta: {"b": 2}\r\n\r', b"\ndata: [DONE]\r\n\r\n"]


def _chunked(pieces: list[bytes]) -> list[bytes]:
    """The pieces as HTTP chunks, the chunk framing itself split across writes too."""
    out = [b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"]
    for piece in pieces:
        frame = b"%x\r\n" % len(piece) + piece + b"\r\n"
        out += [frame[:2], frame[2:]]
    out.append(b"0\r\n\r\n")
    return out


def test_sse_events_split_across_reads_and_chunks_with_crlf_are_reassembled(tmp_path: Path) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        await _write_apart(writer, _chunked(SSE_PIECES))
        writer.close()

    async def run() -> list[list[bytes]]:
        server, url = await _serve(handler)
        upstream = Upstream(ProxySettings(upstream=url, journal=tmp_path), Metrics())
        try:
            return [batch async for batch in upstream.stream({"model": "m"})]
        finally:
            await upstream.close()
            server.close()

    batches = asyncio.run(run())
    assert [payload for batch in batches for payload in batch] == [b'{"a": 1}', b'{"b": 2}', b"[DONE]"]
    assert len(batches) >= 2, "the payloads arrived in separate reads and were relayed as they came"


def test_keep_alive_reuses_one_connection_and_sized_bodies_split_anywhere() -> None:
    connections = 0
    body = b'{"answer": "' + b"x" * 5000 + b'"}'
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body)

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        while request := await _read_request(reader):
            assert request.startswith(b"POST /v1/x HTTP/1.1\r\n")
            assert b"\r\nhost: 127.0.0.1:" in request and request.endswith(b'{"q":1}')
            whole = head + body
            await _write_apart(writer, [whole[:7], whole[7:40], whole[40:3000], whole[3000:]])
        writer.close()

    async def run() -> list[bytes]:
        server, url = await _serve(handler)
        client = _client(url)
        got = []
        try:
            for _ in range(3):
                headers = {"content-type": "application/json"}
                response = await client.request("POST", "/v1/x", b'{"q":1}', headers)
                assert response.status == 200 and response.headers["content-type"] == "application/json"
                got.append(await response.read())
                response.close()
        finally:
            await client.aclose()
            server.close()
        return got

    assert asyncio.run(run()) == [body] * 3
    assert connections == 1


def test_a_pooled_connection_the_engine_closed_while_idle_is_replaced_at_once() -> None:
    served = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal served
        await _read_request(reader)
        served += 1
        # Keep-alive promised, then the connection closed right after the answer (an engine restart,
        # an idle timeout): the next request on it never reaches the engine.
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        writer.close()

    async def run() -> list[bytes]:
        server, url = await _serve(handler)
        client = _client(url)
        got = []
        try:
            for _ in range(3):
                status, content = await client.get("/ping")
                assert status == 200
                got.append(content)
                await asyncio.sleep(0.05)
        finally:
            await client.aclose()
            server.close()
        return got

    assert asyncio.run(run()) == [b"ok"] * 3
    assert served == 3


def test_refused_silent_and_cut_off_answers_say_what_they_are() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        await asyncio.sleep(5)

    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly part")
        await writer.drain()
        writer.close()

    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"SPDY/9 what\r\n\r\n")
        await writer.drain()

    async def closes(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.close()

    async def run() -> None:
        with socket.socket() as sock:  # a port nobody listens on
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        with pytest.raises(http1.Unreached, match="cannot connect"):
            await _client(f"http://127.0.0.1:{port}").get("/")
        for handler, error, match in [
            (silent, http1.ReadTimeout, "silent"),
            (cut, http1.ProtocolError, "mid-answer"),
            (garbage, http1.ProtocolError, "not HTTP/1.1"),
            (closes, http1.Unreached, "before answering"),
        ]:
            server, url = await _serve(handler)
            client = _client(url, read_timeout=0.3)
            try:
                with pytest.raises(error, match=match):
                    response = await client.request("GET", "/")
                    try:
                        await response.read()
                    finally:
                        response.close()
            finally:
                await client.aclose()
                server.close()

    asyncio.run(run())


def test_the_pool_cap_holds_and_a_full_pool_times_out() -> None:
    in_flight = peak = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal in_flight, peak
        while await _read_request(reader):
            in_flight += 1
            peak = max(peak, in_flight)
            await asyncio.sleep(0.05)
            in_flight -= 1
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
            await writer.drain()

    async def run() -> None:
        server, url = await _serve(handler)
        client = _client(url, max_connections=2)
        try:
            results = await asyncio.gather(*(client.get("/") for _ in range(6)))
            assert results == [(200, b"")] * 6
            held = await client.request("GET", "/")
            held2 = await client.request("GET", "/")
            client.pool_timeout = 0.1
            with pytest.raises(http1.Unreached, match="busy"):
                await client.request("GET", "/")
            held.close()
            held2.close()
        finally:
            await client.aclose()
            server.close()

    asyncio.run(run())
    assert peak == 2


def test_a_unix_socket_engine(tmp_path: Path) -> None:
    path = tmp_path / "engine.sock"

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        request = await _read_request(reader)
        assert b"\r\nhost: engine\r\n" in request
        writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 4\r\n\r\nnope")
        await writer.drain()

    async def run() -> tuple[int, bytes]:
        server = await asyncio.start_unix_server(_closing(handler), str(path))
        client = _client(f"unix://{path}")
        try:
            return await client.get("/weight_info")
        finally:
            await client.aclose()
            server.close()

    assert asyncio.run(run()) == (404, b"nope")


def test_an_engine_error_answer_is_classified(tmp_path: Path) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        body = b'{"error": {"message": "This model\'s maximum context length is 10 tokens."}}'
        writer.write(b"HTTP/1.1 400 Bad Request\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
        await writer.drain()

    async def run() -> None:
        server, url = await _serve(handler)
        upstream = Upstream(ProxySettings(upstream=url, journal=tmp_path), Metrics())
        try:
            with pytest.raises(ProxyError) as info:
                await upstream.complete({"model": "m"})
            assert info.value.kind == "context_overflow"
        finally:
            await upstream.close()
            server.close()

    asyncio.run(run())

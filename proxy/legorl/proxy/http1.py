"""The proxy's HTTP/1.1 client to the engine: keep-alive connections over asyncio protocols, llhttp parsing.

Every model call crosses this client twice (request out, answer in), so its cost is paid on every turn.
httpx (over httpcore, h11 and anyio) spent about a millisecond of CPU per call here, as much as the rest of
the proxy together; this client does the same job in a fraction of that (`benchmarks/proxy_overhead.py`).
It does exactly what the proxy needs and no more: one origin (TCP, TLS or a Unix socket), requests with
a whole body, responses read whole or as they arrive (one piece per socket read), a pool of keep-alive
connections with a cap, and errors that say whether the request can have reached the engine:

- `Unreached`: the connection could not be opened in time, the pool stayed full, or the engine closed the
  connection before a byte of its answer: nothing was processed, so asking again is safe.
- `ReadTimeout`: the engine went silent for longer than the read timeout (before or inside its answer).
- `ProtocolError`: the engine dropped the connection inside its answer, or sent something that is not
  HTTP/1.1.

A connection that sat idle in the pool can have been closed by the engine just as a request is sent on
it; such a request is sent again at once on a fresh connection (it never reached the engine), as
browsers and httpx do.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import AsyncIterator, Mapping
from typing import cast
from urllib.parse import unquote, urlsplit

import httptools

__all__ = ["Client", "HttpError", "ProtocolError", "ReadTimeout", "Response", "Unreached"]

_PAUSE_BYTES = 1 << 20
"""Body bytes buffered before the socket stops being read (a consumer slower than the engine)."""


class HttpError(Exception):
    """A request that got no (whole) answer."""


class Unreached(HttpError):
    """Nothing reached the engine, or it answered nothing: safe to send again."""


class ReadTimeout(HttpError):
    """The engine went silent for longer than the read timeout."""


class ProtocolError(HttpError):
    """The answer was cut off or is not HTTP/1.1."""


class _Connection(asyncio.Protocol):
    """One keep-alive connection; one request at a time."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = time.monotonic()
        self.reused = False
        self._parser = httptools.HttpResponseParser(self)
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self.headers_done = False
        self.complete = False
        self.reusable = False
        self.received = False
        """Any byte of the current answer arrived."""
        self.error: HttpError | None = None
        self._body: list[bytes] = []
        self._buffered = 0
        self._paused = False
        self._waiter: asyncio.Future[None] | None = None
        self._header_name = b""

    # -- asyncio.Protocol -------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.received = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(ProtocolError(f"the engine sent something that is not HTTP/1.1: {exc}"))
            self.close()
            return
        if self._buffered > _PAUSE_BYTES and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool | None:
        return None  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.complete:
            why = f": {exc}" if exc else ""
            if not self.received:
                self._fail(Unreached(f"the engine closed the connection before answering{why}"))
            else:
                self._fail(ProtocolError(f"the engine dropped the connection mid-answer{why}"))
        self._wake()

    # -- httptools callbacks ----------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        self.headers_done = True

    def on_body(self, body: bytes) -> None:
        self._body.append(body)
        self._buffered += len(body)

    def on_message_complete(self) -> None:
        # Read here: the parser forgets it once the message is over.
        self.reusable = self._parser.should_keep_alive()
        self.complete = True

    # -- for the client ---------------------------------------------------------------------------

    def _fail(self, error: HttpError) -> None:
        if self.error is None:
            self.error = error

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def send(self, data: bytes) -> None:
        self._reset()
        assert self.transport is not None
        self.transport.write(data)

    async def wait(self, timeout: float) -> None:
        """Until more of the answer (or an error) arrived; ReadTimeout after `timeout` seconds of silence."""
        waiter = self._waiter = self.loop.create_future()
        handle = self.loop.call_later(timeout, _expire, waiter)
        try:
            await waiter
        finally:
            handle.cancel()
            self._waiter = None

    def take_body(self) -> bytes:
        body = b"".join(self._body) if len(self._body) != 1 else self._body[0]
        self._body.clear()
        self._buffered = 0
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return body

    @property
    def keep_alive(self) -> bool:
        return not self.closed and self.complete and self.reusable

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(ReadTimeout("the engine went silent"))


class Response:
    """An answer whose status line and headers have arrived; its body is read with `read` or `chunks`.
    `close()` (also after an error) hands the connection back, or closes it if it cannot be reused."""

    def __init__(self, client: Client, conn: _Connection) -> None:
        self._client = client
        self._conn = conn
        self.status = conn.status
        self.headers = conn.headers
        self._released = False

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives: the bytes of one or more socket reads at a time, never empty."""
        conn = self._conn
        while True:
            if conn._body:
                yield conn.take_body()
                continue
            if conn.complete:
                return
            if conn.error is not None:
                raise conn.error
            await conn.wait(self._client.read_timeout)

    async def read(self) -> bytes:
        """The whole body."""
        conn = self._conn
        while not conn.complete:
            if conn.error is not None:
                raise conn.error
            await conn.wait(self._client.read_timeout)
        return conn.take_body()

    def close(self) -> None:
        if self._released:
            return
        self._released = True
        self._client._release(self._conn)


class Client:
    """A pool of keep-alive HTTP/1.1 connections to one origin: `http://host:port`, `https://...` or
    `unix:///path/to.sock`."""

    def __init__(
        self,
        url: str,
        *,
        connect_timeout: float,
        read_timeout: float,
        max_connections: int,
        keepalive_expiry: float,
        pool_timeout: float | None = None,
    ) -> None:
        parts = urlsplit(url)
        self._unix: str | None = None
        self._ssl: ssl.SSLContext | None = None
        if parts.scheme == "unix":
            self._unix = unquote(parts.path)
            self._host, self._port, host_header = "", 0, "engine"
        elif parts.scheme in ("http", "https"):
            self._host = parts.hostname or "localhost"
            self._port = parts.port or (443 if parts.scheme == "https" else 80)
            host_header = parts.netloc
            if parts.scheme == "https":
                self._ssl = ssl.create_default_context()
        else:
            raise ValueError(f"the engine URL must be http://, https:// or unix://, got {url!r}")
        self._prefix = parts.path.rstrip("/") if parts.scheme != "unix" else ""
        self._host_line = f"host: {host_header}\r\n".encode("latin-1")
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.pool_timeout = read_timeout if pool_timeout is None else pool_timeout
        self.keepalive_expiry = keepalive_expiry
        self._idle: list[_Connection] = []
        self._slots = asyncio.Semaphore(max_connections)
        self._closed = False

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        conn = _Connection(loop)
        try:
            if self._unix is not None:
                connecting = loop.create_unix_connection(lambda: conn, self._unix)
            else:
                connecting = loop.create_connection(
                    lambda: conn,
                    self._host,
                    self._port,
                    ssl=self._ssl,
                    server_hostname=self._host if self._ssl else None,
                )
            await asyncio.wait_for(connecting, self.connect_timeout)
        except TimeoutError as exc:
            raise Unreached(f"no connection to the engine within {self.connect_timeout:g}s") from exc
        except OSError as exc:
            raise Unreached(f"cannot connect to the engine: {exc}") from exc
        return conn

    def _pooled(self) -> _Connection | None:
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed and now - conn.idle_since < self.keepalive_expiry:
                conn.reused = True
                return conn
            conn.close()
        return None

    async def request(
        self, method: str, path: str, body: bytes | None = None, headers: Mapping[str, str] | None = None
    ) -> Response:
        """Send a request; returns once the answer's headers arrived. Close the response when done."""
        if self._closed:
            raise Unreached("the engine client is closed")
        head = [f"{method} {self._prefix}{path} HTTP/1.1\r\n".encode("latin-1"), self._host_line]
        for name, value in (headers or {}).items():
            head.append(f"{name}: {value}\r\n".encode("latin-1"))
        if body is not None:
            head.append(b"content-length: %d\r\n" % len(body))
        head.append(b"\r\n")
        if body:
            head.append(body)
        data = b"".join(head)
        if self._slots.locked():  # (wait_for makes a task: only when the pool is full)
            try:
                await asyncio.wait_for(self._slots.acquire(), self.pool_timeout)
            except TimeoutError as exc:
                busy = f"every connection to the engine stayed busy for {self.pool_timeout:g}s"
                raise Unreached(busy) from exc
        else:
            await self._slots.acquire()
        conn: _Connection | None = None
        try:
            conn = self._pooled()
            while True:
                if conn is None:
                    conn = await self._connect()
                conn.send(data)
                try:
                    while not conn.headers_done:
                        if conn.error is not None:
                            raise conn.error
                        await conn.wait(self.read_timeout)
                except Unreached:
                    # A pooled connection the engine had closed while it was idle: nothing was
                    # processed; once more on a fresh one.
                    if conn.reused:
                        conn.close()
                        conn = None
                        continue
                    raise
                return Response(self, conn)
        except BaseException:
            if conn is not None:
                conn.close()
            self._slots.release()
            raise

    def _release(self, conn: _Connection) -> None:
        if conn.keep_alive and not self._closed:
            conn.idle_since = time.monotonic()
            self._idle.append(conn)
        else:
            conn.close()
        self._slots.release()

    async def aclose(self) -> None:
        self._closed = True
        for conn in self._idle:
            conn.close()
        self._idle.clear()

    async def get(self, path: str) -> tuple[int, bytes]:
        """A GET's status and whole body."""
        response = await self.request("GET", path)
        try:
            return response.status, await response.read()
        finally:
            response.close()

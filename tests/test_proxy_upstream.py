"""The engine client's SSE reader: events split anywhere across network reads, CRLF or LF."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import httpx

from legorl.proxy.metrics import Metrics
from legorl.proxy.settings import ProxySettings
from legorl.proxy.upstream import Upstream

PIECES = [b'data: {"a": 1}\r', b"\n\r\nda", b'ta: {"b": 2}\r\n\r', b"\ndata: [DONE]\r\n\r\n"]


class _Chunks(httpx.AsyncByteStream):
    async def __aiter__(self) -> AsyncIterator[bytes]:
        for piece in PIECES:
            yield piece


def test_events_split_across_reads_with_crlf_are_reassembled(tmp_path: Path) -> None:
    async def run() -> list[list[bytes]]:
        upstream = Upstream(ProxySettings(upstream="http://engine", journal=tmp_path), Metrics())
        await upstream.client.aclose()
        upstream.client = httpx.AsyncClient(
            base_url="http://engine",
            transport=httpx.MockTransport(lambda request: httpx.Response(200, stream=_Chunks())),
        )
        try:
            return [batch async for batch in upstream.stream({"model": "m"})]
        finally:
            await upstream.close()

    batches = asyncio.run(run())
    assert [payload for batch in batches for payload in batch] == [b'{"a": 1}', b'{"b": 2}', b"[DONE]"]

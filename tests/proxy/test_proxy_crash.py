"""Crash safety of the proxy: SIGKILL mid-burst loses no acknowledged turn and duplicates none.

The proxy runs as a real `legorl proxy` process in front of the fake engine (served in this
process); up to 40 concurrent multi-turn sessions, half streaming over raw HTTP (acknowledged = the
stream ended with `[DONE]`), half through the OpenAI SDK unstreamed (acknowledged = the SDK
returned the completion). Every call asks the fake engine to say a marker text unique to that call
(`SAY:c1-s07-t03`), so each journaled turn names the call it came from: the completion token ids
decode back to the marker through the fake's byte mapping.

A harness may act on an acknowledged turn, so each must be in the journal exactly once after a
crash; a turn journaled but never acknowledged (killed between the fsync and the answer) is
allowed, and is the harness's to ask again.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import struct
import subprocess
import sys
import time
import zlib
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from legorl.proxy.journal import FILENAME, read_journal
from legorl.proxy.testing import END, FakeEngine, render_prompt
from tests.support.asgi_server import free_port, serve

pytestmark = pytest.mark.slow

SESSIONS = 40
"""Concurrent sessions per burst: even ones stream, odd ones do not."""
TURNS = 40
"""Turns each session would take; far more than happen before the kill."""
KILL_AFTER = (30, 110, 220)
"""Acknowledged turns before the kill, per cycle: early, mid-burst and late."""
# The fake engine's tokens are utf-8 bytes shifted past its special ids; read the shift off it.
OFFSET = render_prompt([{"role": "user", "content": "\0"}])[2]


def decode(ids: list[int]) -> str:
    """The fake engine's token ids back to text (its special ids dropped)."""
    return bytes(t - OFFSET for t in ids if t >= OFFSET).decode()


class Proxy:
    """`legorl proxy` as a child process on a fixed port and journal, so it can be killed and restarted."""

    def __init__(
        self, upstream: str, journal: Path, port: int, log: Path, extra: tuple[str, ...] = ()
    ) -> None:
        self.upstream, self.journal, self.port, self.log = upstream, journal, port, log
        self.extra = extra
        self.url = f"http://127.0.0.1:{port}"
        self.process: subprocess.Popen[bytes] | None = None
        # One client for every plain request: a new httpx client costs a TLS context (~0.1 s).
        self.http = httpx.Client(base_url=self.url, timeout=30)

    def start(self) -> None:
        command = [
            sys.executable, "-m", "legorl.cli", "proxy",
            "--upstream", self.upstream,
            "--journal", str(self.journal),
            "--port", str(self.port),
            "--policy-version-source", "fixed",
            "--log-level", "INFO",
            *self.extra,
        ]  # fmt: skip
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"the proxy exited with {self.process.returncode}:\n{self.log.read_text()}"
                )
            try:
                if self.http.get("/ready", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass  # not listening yet
            if time.monotonic() > deadline:
                raise RuntimeError(f"the proxy did not get ready:\n{self.log.read_text()}")
            time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL: no shutdown, no flush, no closing of the journal."""
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def stop(self) -> None:
        self.http.close()
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@contextmanager
def engine_and_proxy(tmp_path: Path) -> Iterator[Proxy]:
    engine = FakeEngine()
    engine.record_requests = False  # thousands of calls; the test reads the journal instead
    with serve(engine) as upstream:
        proxy = Proxy(upstream, tmp_path / "journal", free_port(), tmp_path / "proxy.log")
        try:
            proxy.start()
            yield proxy
        finally:
            proxy.stop()


@dataclass
class Ledger:
    """What the client side saw of one burst."""

    acked: list[str] = field(default_factory=list)
    """Markers of the calls that got a whole, successful answer."""
    failed: int = 0
    """Calls that failed (the kill); each ends its session."""
    last_sent: dict[int, str] = field(default_factory=dict)
    """Each session's last call: the only one it may have had in flight at the kill."""
    acked_at_kill: int = -1


async def _streamed(client: httpx.AsyncClient, messages: list[dict[str, Any]]) -> str | None:
    """The streamed text, or None if the stream did not end with [DONE]."""
    text, done = "", False
    async with client.stream(
        "POST", "/v1/chat/completions", json={"model": "gpt-x", "messages": messages, "stream": True}
    ) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                continue
            for choice in json.loads(data).get("choices", []):
                text += choice["delta"].get("content") or ""
    return text if done else None


async def _session(
    cycle: int, index: int, http: httpx.AsyncClient, sdk: openai.AsyncOpenAI, ledger: Ledger
) -> None:
    messages: list[Any] = []  # dicts; the SDK types them as TypedDicts
    for turn in range(TURNS):
        marker = f"c{cycle}-s{index:02d}-t{turn:02d}"
        messages.append({"role": "user", "content": f"SAY:{marker}"})
        ledger.last_sent[index] = marker
        text: str | None
        try:
            if index % 2 == 0:
                text = await _streamed(http, messages)
            else:
                completion = await sdk.chat.completions.create(model="gpt-x", messages=messages)
                text = completion.choices[0].message.content
        except (httpx.HTTPError, openai.APIError):
            text = None
        if text is None:
            ledger.failed += 1
            return
        assert text == marker
        ledger.acked.append(marker)
        messages.append({"role": "assistant", "content": text})


async def _burst(proxy: Proxy, cycle: int, kill_after: int) -> Ledger:
    """SESSIONS sessions against the proxy; SIGKILL it once `kill_after` turns are acknowledged."""
    ledger = Ledger()
    limits = httpx.Limits(max_connections=SESSIONS, max_keepalive_connections=SESSIONS)
    async with (
        httpx.AsyncClient(base_url=proxy.url, limits=limits, timeout=30) as http,
        openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="unused", max_retries=0, timeout=30) as sdk,
    ):

        async def killer() -> None:
            while len(ledger.acked) < kill_after:
                await asyncio.sleep(0.001)
            ledger.acked_at_kill = len(ledger.acked)
            # Blocking on purpose: nothing else on this loop runs until the proxy is dead.
            proxy.kill()

        sessions = [asyncio.create_task(_session(cycle, i, http, sdk, ledger)) for i in range(SESSIONS)]
        await asyncio.wait_for(asyncio.gather(killer(), *sessions), timeout=60)
    return ledger


def _journal_texts(journal: Path) -> tuple[list[dict[str, Any]], Counter[str], int]:
    recovered = read_journal(journal)
    turns = [r for r in recovered.records if r["type"] == "turn"]
    for record in turns:
        # The answer the harness got (recorded whole) says the same as the sampled tokens.
        body = json.loads(record["response_body"])
        assert body["choices"][0]["message"]["content"] == decode(record["completion_token_ids"])
        assert record["completion_token_ids"][-1] == END
    return turns, Counter(decode(r["completion_token_ids"]) for r in turns), recovered.dropped_bytes


def test_sigkill_mid_burst_keeps_every_acknowledged_turn_once(tmp_path: Path) -> None:
    with engine_and_proxy(tmp_path) as proxy:
        acked: set[str] = set()
        unanswered: set[str] = set()
        sessions_seen: set[str] = set()
        for cycle, kill_after in enumerate(KILL_AFTER):
            ledger = asyncio.run(_burst(proxy, cycle, kill_after))
            # The kill came mid-burst: turns had been answered and calls were still in flight.
            assert ledger.acked_at_kill >= kill_after
            assert ledger.failed > 0
            assert len(ledger.acked) < SESSIONS * TURNS
            acked.update(ledger.acked)

            turns, texts, dropped = _journal_texts(proxy.journal)
            # Nothing acknowledged is lost, nothing is journaled twice.
            assert not acked - set(texts), f"acknowledged but not journaled: {sorted(acked - set(texts))[:5]}"
            assert max(texts.values()) == 1, [t for t, n in texts.items() if n > 1]
            # A turn journaled but not acknowledged was in flight at the kill (fsync'd, not answered).
            assert set(texts) - acked <= unanswered | set(ledger.last_sent.values())
            unanswered |= set(texts) - acked
            assert [r["index"] for r in turns] == list(range(len(turns)))
            sessions_seen |= {t.rsplit("-", 1)[0] for t in texts}

            proxy.start()  # same journal, same port
            if dropped:
                assert f"dropped a torn tail of {dropped} bytes" in proxy.log.read_text()
            assert read_journal(proxy.journal).dropped_bytes == 0
            served = proxy.http.get("/turns").json()["turns"]
            assert [(t["index"], t["completion_token_ids"]) for t in served] == [
                (r["index"], r["completion_token_ids"]) for r in turns
            ]
            trajectory = proxy.http.get("/trajectory").json()
            assert trajectory["state"] == "running"
            assert trajectory["turns"] == len(turns)
            # Each session's turns extend one another exactly, before and after every restart.
            assert len(trajectory["segments"]) == len(sessions_seen)
            indices = sorted(i for s in trajectory["segments"] for i in s["turn_indices"])
            assert indices == list(range(len(turns)))

        # The restarted proxy numbers on from the journal.
        client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="unused", max_retries=0)
        for turn in range(3):
            reply = client.chat.completions.create(
                model="gpt-x", messages=[{"role": "user", "content": f"SAY:after-{turn}"}]
            )
            assert reply.choices[0].message.content == f"after-{turn}"
        client.close()
        final, texts, dropped = _journal_texts(proxy.journal)
        assert dropped == 0
        assert [r["index"] for r in final] == list(range(len(final)))
        assert [decode(r["completion_token_ids"]) for r in final[-3:]] == [f"after-{t}" for t in range(3)]
        assert final[-4]["index"] == len(turns) - 1
        assert max(texts.values()) == 1
        assert not acked - set(texts)


def _torn_tails(last: dict[str, Any]) -> Iterator[tuple[str, bytes]]:
    """What a crash (power loss, not SIGKILL) can leave after the last whole record."""
    yield "short header", b"\x40\x01\x00"
    yield "short payload", struct.pack("<II", 320, 0) + b'{"type":"turn","ind'
    # A whole, valid-looking record whose checksum does not match: never replayed.
    payload = json.dumps({**last, "index": last["index"] + 1}).encode()
    yield "bad checksum", struct.pack("<II", len(payload), zlib.crc32(payload) ^ 1) + payload


def test_torn_tail_is_dropped_and_reported_on_restart(tmp_path: Path) -> None:
    with engine_and_proxy(tmp_path) as proxy:
        client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="unused", max_retries=0)
        for turn in range(2):
            client.chat.completions.create(
                model="gpt-x", messages=[{"role": "user", "content": f"SAY:w{turn}"}]
            )
        client.close()
        path = proxy.journal / FILENAME
        turns = 2
        for name, tail in _torn_tails(read_journal(proxy.journal).records[-1]):
            proxy.kill()
            whole = path.stat().st_size
            with path.open("ab") as f:
                f.write(tail)
            assert read_journal(proxy.journal).dropped_bytes == len(tail), name

            proxy.start()
            log = proxy.log.read_text()
            assert f"dropped a torn tail of {len(tail)} bytes after {turns} whole records" in log, name
            assert path.stat().st_size == whole, name
            trajectory = proxy.http.get("/trajectory").json()
            assert trajectory["turns"] == turns
            assert trajectory["state"] == "running"
            assert trajectory["journalDroppedBytes"] == len(tail), name
            assert f"legorl_proxy_journal_dropped_bytes {len(tail)}" in proxy.http.get("/metrics").text

            # The next turn appends cleanly after the last whole record, numbered on.
            response = proxy.http.post(
                "/v1/chat/completions",
                json={"model": "gpt-x", "messages": [{"role": "user", "content": f"SAY:after {name}"}]},
            )
            assert response.status_code == 200, response.text
            recovered = read_journal(proxy.journal)
            assert recovered.dropped_bytes == 0
            assert [r["index"] for r in recovered.records] == list(range(turns + 1))
            assert decode(recovered.records[-1]["completion_token_ids"]) == f"after {name}"
            turns += 1


@pytest.mark.parametrize("read", [True, False], ids=["read", "never-read"])
def test_a_terminated_proxy_serves_its_journal_until_it_is_read(tmp_path: Path, read: bool) -> None:
    """SIGTERM to a trial pod's proxy (someone deleted the pod: the kubelet stops every container at
    once) with `--drain-seconds`: it goes on serving until the controller has ended the trial and read
    its trajectory, then stops; never read, it stops when the drain time is over. Before, it stopped at
    once and the turns it had acknowledged were gone with the pod's emptyDir."""
    engine = FakeEngine()
    with serve(engine) as upstream:
        drain = 6
        proxy = Proxy(
            upstream,
            tmp_path / "journal",
            free_port(),
            tmp_path / "proxy.log",
            ("--drain-seconds", str(drain)),
        )
        try:
            proxy.start()
            client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="unused", max_retries=0)
            for turn in range(2):
                client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": f"SAY:d{turn}"}]
                )
            client.close()
            assert proxy.process is not None
            signalled = time.monotonic()
            proxy.process.send_signal(signal.SIGTERM)
            time.sleep(1.0)
            assert proxy.process.poll() is None, proxy.log.read_text()
            if read:
                proxy.http.post("/finish", json={"reason": "sandbox_error", "detail": "the pod was deleted"})
                trajectory = proxy.http.get("/trajectory").json()
                assert trajectory["turns"] == 2 and trajectory["end"]["reason"] == "sandbox_error"
                proxy.process.wait(timeout=3)
            else:
                proxy.process.wait(timeout=drain + 3)
                assert time.monotonic() - signalled >= drain - 0.5
            assert "serving the trial's journal until it is read" in proxy.log.read_text()
        finally:
            proxy.stop()

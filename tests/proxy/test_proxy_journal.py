"""The turn journal: durable appends, group commit, torn tails, write failures; vLLM's routed experts."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import errno
import io
import json
import math
import os
import struct
import threading
import zlib
from collections.abc import Callable
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from legorl.api.trajectory import ApiFormat, Turn, routing_array
from legorl.proxy.errors import ProxyError
from legorl.proxy.journal import (
    Journal,
    JournalError,
    Recovered,
    encode_record,
    read_journal,
    turn_from_record,
    turn_to_record,
)
from legorl.proxy.trial import decode_routed_experts

FILENAME = "journal.log"


def frame(payload: bytes) -> bytes:
    """A record as the journal's format documents it: u32 LE length, u32 CRC-32, payload."""
    return struct.pack("<II", len(payload), zlib.crc32(payload)) + payload


def records(count: int) -> list[dict[str, Any]]:
    return [{"type": "turn", "index": i, "text": f"record {i} " + "é" * i} for i in range(count)]


async def write(directory: Path, items: list[dict[str, Any]]) -> list[int]:
    """Append `items` one by one; the file size after each (the record boundaries)."""
    journal = Journal(directory)
    sizes = []
    try:
        for item in items:
            await journal.append(item)
            sizes.append((directory / FILENAME).stat().st_size)
    finally:
        journal.close()
    return sizes


def boundaries_of(data: bytes) -> list[int]:
    """Record end offsets, read from the length fields (independently of the journal's reader)."""
    ends, pos = [], 0
    while pos < len(data):
        (length,) = struct.unpack_from("<I", data, pos)
        pos += 8 + length
        ends.append(pos)
    assert pos == len(data)
    return ends


@pytest.mark.asyncio
async def test_appended_records_are_durable_and_read_back_after_reopening(tmp_path: Path) -> None:
    items = records(5)
    journal = Journal(tmp_path / "nested" / "journal")
    assert journal.recovered == Recovered(records=[], dropped_bytes=0)
    for i, item in enumerate(items):
        await journal.append(item)
        # On disk as soon as append returns, before any close: another reader sees it.
        assert read_journal(tmp_path / "nested" / "journal").records == items[: i + 1]
    assert read_journal(journal.directory).records == items
    journal.close()
    journal.close()  # closing twice is harmless

    data = (tmp_path / "nested" / "journal" / FILENAME).read_bytes()
    # The documented framing, byte for byte: each record's CRC matches its JSON payload.
    pos = 0
    for item in items:
        length, crc = struct.unpack_from("<II", data, pos)
        payload = data[pos + 8 : pos + 8 + length]
        assert zlib.crc32(payload) == crc
        assert json.loads(payload) == item
        pos += 8 + length
    assert pos == len(data)

    reopened = Journal(tmp_path / "nested" / "journal")
    try:
        assert reopened.recovered == Recovered(records=items, dropped_bytes=0)
        await reopened.append({"type": "end", "reason": "completed"})
    finally:
        reopened.close()
    assert read_journal(tmp_path / "nested" / "journal").records == [
        *items,
        {"type": "end", "reason": "completed"},
    ]


@pytest.mark.asyncio
async def test_concurrent_appends_are_all_durable_in_order_and_share_fsyncs(tmp_path: Path) -> None:
    batches: list[int] = []
    journal = Journal(tmp_path, on_sync=lambda seconds, count: batches.append(count))
    try:
        await asyncio.gather(*(journal.append({"type": "turn", "index": i}) for i in range(200)))
    finally:
        journal.close()
    assert [r["index"] for r in read_journal(tmp_path).records] == list(range(200))
    assert sum(batches) == 200
    # Group commit: records queued while a write was in flight share the next fsync.
    assert len(batches) < 200
    assert max(batches) > 1


@pytest.mark.asyncio
async def test_a_torn_last_record_is_cut_back_at_every_offset(tmp_path: Path) -> None:
    items = records(3)
    sizes = await write(tmp_path / "whole", items)
    data = (tmp_path / "whole" / FILENAME).read_bytes()
    assert boundaries_of(data) == sizes
    start, end = sizes[-2], sizes[-1]

    for cut in range(start + 1, end):
        directory = tmp_path / f"cut-{cut}"
        directory.mkdir()
        (directory / FILENAME).write_bytes(data[:cut])
        assert read_journal(directory) == Recovered(records=items[:-1], dropped_bytes=cut - start)

        journal = Journal(directory)
        try:
            assert journal.recovered == Recovered(records=items[:-1], dropped_bytes=cut - start)
            assert (directory / FILENAME).read_bytes() == data[:start]
            await journal.append({"type": "after", "cut": cut})
        finally:
            journal.close()
        after = read_journal(directory)
        assert after == Recovered(records=[*items[:-1], {"type": "after", "cut": cut}], dropped_bytes=0)


@pytest.mark.asyncio
async def test_a_bad_checksum_in_the_middle_drops_everything_from_there_on(tmp_path: Path) -> None:
    # Documented: the first record that fails its check starts the tail, so the whole records
    # after a corrupted one are dropped too (the journal cannot tell corruption from a torn tail).
    items = records(5)
    sizes = await write(tmp_path, items)
    path = tmp_path / FILENAME
    data = bytearray(path.read_bytes())
    crc_at = sizes[1] + 4  # the CRC field of record 2
    data[crc_at] ^= 0x01
    path.write_bytes(bytes(data))

    assert read_journal(tmp_path) == Recovered(records=items[:2], dropped_bytes=len(data) - sizes[1])
    journal = Journal(tmp_path)
    try:
        assert journal.recovered == Recovered(records=items[:2], dropped_bytes=len(data) - sizes[1])
        await journal.append({"type": "end"})
    finally:
        journal.close()
    assert read_journal(tmp_path) == Recovered(records=[*items[:2], {"type": "end"}], dropped_bytes=0)


@pytest.mark.asyncio
async def test_a_flipped_payload_byte_fails_the_checksum(tmp_path: Path) -> None:
    items = records(3)
    sizes = await write(tmp_path, items)
    path = tmp_path / FILENAME
    data = bytearray(path.read_bytes())
    data[sizes[0] + 8 + 3] ^= 0x20  # inside record 1's JSON, still valid UTF-8
    path.write_bytes(bytes(data))
    assert read_journal(tmp_path) == Recovered(records=items[:1], dropped_bytes=len(data) - sizes[0])


GARBAGE = {
    "short header": b"hello\n",
    "huge length": b"\xff\xff\xff\xff\x00\x00\x00\x00" + b"x" * 32,
    "length past the end": struct.pack("<II", 64, 0) + b"{}",
    "empty payload": frame(b""),
    "not json": frame(b"not json at all"),
    "json but not an object": frame(b"[1, 2, 3]"),
    "text": b"Traceback (most recent call last):\n  File ...\n",
}


@pytest.mark.parametrize("garbage", GARBAGE.values(), ids=GARBAGE.keys())
@pytest.mark.asyncio
async def test_garbage_after_the_records_is_a_tail_to_drop(tmp_path: Path, garbage: bytes) -> None:
    items = records(2)
    await write(tmp_path, items)
    path = tmp_path / FILENAME
    clean = path.read_bytes()
    path.write_bytes(clean + garbage)

    assert read_journal(tmp_path) == Recovered(records=items, dropped_bytes=len(garbage))
    journal = Journal(tmp_path)
    try:
        assert journal.recovered == Recovered(records=items, dropped_bytes=len(garbage))
        assert path.read_bytes() == clean
        await journal.append({"type": "next"})
    finally:
        journal.close()
    assert read_journal(tmp_path) == Recovered(records=[*items, {"type": "next"}], dropped_bytes=0)


@pytest.mark.asyncio
async def test_an_empty_journal_file_opens_clean(tmp_path: Path) -> None:
    (tmp_path / FILENAME).write_bytes(b"")
    assert read_journal(tmp_path) == Recovered(records=[], dropped_bytes=0)
    journal = Journal(tmp_path)
    try:
        assert journal.recovered == Recovered(records=[], dropped_bytes=0)
        await journal.append({"type": "first"})
    finally:
        journal.close()
    assert read_journal(tmp_path).records == [{"type": "first"}]


def test_reading_a_missing_journal_finds_nothing(tmp_path: Path) -> None:
    assert read_journal(tmp_path / "absent") == Recovered(records=[], dropped_bytes=0)
    assert not (tmp_path / "absent").exists()


@pytest.mark.asyncio
async def test_read_journal_reports_a_torn_tail_without_cutting_it(tmp_path: Path) -> None:
    items = records(3)
    sizes = await write(tmp_path, items)
    path = tmp_path / FILENAME
    torn = path.read_bytes()[: sizes[-1] - 3]
    path.write_bytes(torn)
    before = path.stat()

    assert read_journal(tmp_path) == Recovered(records=items[:2], dropped_bytes=len(torn) - sizes[1])
    assert path.read_bytes() == torn
    after = path.stat()
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)


@pytest.mark.asyncio
@pytest.mark.parametrize("alone", [False, True], ids=["writer-thread", "inline"])
async def test_a_failed_write_fails_the_append_and_every_later_one(tmp_path: Path, alone: bool) -> None:
    journal = Journal(tmp_path)
    try:
        await journal.append({"type": "turn", "index": 0}, alone=alone)
        # The disk goes away under the journal: its descriptor now refuses writes (EBADF).
        read_only = os.open(os.devnull, os.O_RDONLY)
        saved = os.dup(journal._fd)
        os.dup2(read_only, journal._fd)
        os.close(read_only)
        with pytest.raises(JournalError, match="journal write failed"):
            await journal.append({"type": "turn", "index": 1}, alone=alone)

        # The disk comes back, but a failed write may have left part of a record behind: the
        # journal keeps refusing rather than append after it.
        os.dup2(saved, journal._fd)
        os.close(saved)
        for index in (2, 3):
            with pytest.raises(JournalError):
                await journal.append({"type": "turn", "index": index}, alone=index == 2)
    finally:
        journal.close()
    assert read_journal(tmp_path) == Recovered(records=[{"type": "turn", "index": 0}], dropped_bytes=0)


@pytest.mark.asyncio
@pytest.mark.parametrize("alone", [False, True], ids=["writer-thread", "inline"])
async def test_a_failed_fsync_fails_the_append_and_every_later_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, alone: bool
) -> None:
    journal = Journal(tmp_path)
    real_fsync: Callable[[int], None] = os.fsync

    def failing_fsync(fd: int) -> None:
        if fd == journal._fd:
            raise OSError(errno.EIO, "Input/output error")
        real_fsync(fd)

    try:
        await journal.append({"type": "turn", "index": 0})
        monkeypatch.setattr(os, "fsync", failing_fsync)
        with pytest.raises(JournalError, match="Input/output error"):
            await journal.append({"type": "turn", "index": 1}, alone=alone)
        monkeypatch.undo()
        with pytest.raises(JournalError):
            await journal.append({"type": "turn", "index": 2})
    finally:
        monkeypatch.undo()
        journal.close()
    # Record 1's bytes went to the file but were never acknowledged (whether they are durable is
    # up to the disk); record 2 was refused before any write.
    assert [r["index"] for r in read_journal(tmp_path).records] in ([0], [0, 1])


@pytest.mark.asyncio
async def test_a_lone_record_is_synced_on_the_loop_and_mixed_appends_keep_their_order(tmp_path: Path) -> None:
    """A record with nothing to share its fsync with is written on the event loop's thread; records
    appended meanwhile by concurrent callers still go through the writer thread, and the file holds
    every record in the order appended, deltas included (each turn's body extends the previous one)."""
    synced_on: list[int] = []
    journal = Journal(tmp_path, on_sync=lambda seconds, count: synced_on.append(threading.get_ident()))
    body = "x" * 200
    expected = []

    def turn(index: int) -> dict[str, Any]:
        record = {"type": "turn", "index": index, "request_body": body + "y" * index}
        expected.append(record)
        return record

    try:
        await journal.append(turn(0), alone=True)
        assert synced_on == [threading.get_ident()]
        # Concurrent: queued for the writer thread; a lone one among them waits its turn in the queue.
        await asyncio.gather(
            *(journal.append(turn(i), alone=i == 3) for i in range(1, 6)),
        )
        await journal.append(turn(6), alone=True)
    finally:
        journal.close()
    assert synced_on[-1] == threading.get_ident()
    assert any(ident != threading.get_ident() for ident in synced_on)
    assert read_journal(tmp_path).records == expected


@pytest.mark.asyncio
async def test_appending_to_a_closed_journal_fails(tmp_path: Path) -> None:
    journal = Journal(tmp_path)
    journal.close()
    with pytest.raises(JournalError, match="closed"):
        await journal.append({"type": "turn"})


T0 = datetime(2025, 3, 1, 12, 0, 0, 123456, tzinfo=UTC)
# Logprobs whose float64 bits must survive: vLLM's float32 values widened, its -9999.0 floor,
# the smallest subnormal, a negative zero and values one ulp apart.
LOGPROBS = [
    float(np.float32(-0.6931472)),
    -9999.0,
    -5e-324,
    -0.0,
    -1.0000000000000002,
    -1.0,
    math.nextafter(-0.1, 0.0),
    -0.1,
    -1e-300,
    -123.456789012345678,
]


def make_turn(**changes: Any) -> Turn:
    rows = 4 + len(LOGPROBS) - 1
    turn = Turn(
        run="run-a",
        trial="trial-7",
        session="trial-7",
        index=3,
        api_format=ApiFormat.OPENAI_RESPONSES,
        prompt_token_ids=[151644, 8948, 198, 2610],
        completion_token_ids=list(range(1000, 1000 + len(LOGPROBS))),
        completion_logprobs=LOGPROBS,
        finish_reason="tool_calls",
        policy_versions=["step-3", "step-4"],
        started_at=T0,
        ended_at=T0 + timedelta(seconds=1, microseconds=7),
        # Ids up to 364: uint16, as vLLM sends them for a model of more than 256 experts.
        routed_experts=routing_array(np.arange(rows * 2 * 2, dtype=np.uint16) * 7, (rows, 2, 2)),
        ttft_seconds=0.012345678901234567,
        request_body='{"model": "gpt-5-codex", "input": "naïve \\n ✓"}',
        response_body="línea 1\nline 2 ✓",
    )
    return dataclasses.replace(turn, **changes)


def bits(values: list[float]) -> list[bytes]:
    return [struct.pack("<d", v) for v in values]


@pytest.mark.parametrize(
    "turn",
    [
        make_turn(),
        make_turn(routed_experts=np.arange(13 * 2 * 2, dtype=np.uint8).reshape(13, 2, 2)),
        make_turn(routed_experts=None, ttft_seconds=None, request_body=None),
        make_turn(
            started_at=datetime(2025, 3, 1, 17, 30, 0, 1, tzinfo=timezone(timedelta(hours=5, minutes=30))),
            ended_at=datetime(2025, 3, 1, 12, 0, 1, tzinfo=UTC),
        ),
    ],
    ids=["routed-uint16", "routed-uint8", "bare", "offset-timezone"],
)
@pytest.mark.asyncio
async def test_a_turn_survives_the_journal_exactly(tmp_path: Path, turn: Turn) -> None:
    turn.check()
    record = turn_to_record(turn)
    assert record["type"] == "turn"
    assert turn_from_record(record) == turn

    journal = Journal(tmp_path)
    try:
        await journal.append(record)
    finally:
        journal.close()
    (stored,) = read_journal(tmp_path).records
    back = turn_from_record(stored)
    assert back == turn
    assert bits(back.completion_logprobs) == bits(turn.completion_logprobs)
    assert back.started_at == turn.started_at
    assert back.started_at.utcoffset() == turn.started_at.utcoffset()
    assert back.ended_at == turn.ended_at
    assert isinstance(back.routed_experts_shape, tuple | type(None))
    if turn.routed_experts is None:
        assert back.routed_experts is None
    else:
        # The array itself, its width kept: no list of ints on the way in or out.
        assert isinstance(back.routed_experts, np.ndarray)
        assert back.routed_experts.dtype == turn.routed_experts.dtype
        assert isinstance(stored["routed_experts"], np.ndarray)
        payload = json.loads((tmp_path / FILENAME).read_bytes()[8:])
        assert payload["routed_experts"]["$array"] == (
            "u1" if turn.routed_experts.dtype == np.uint8 else "u2"
        )
        assert payload["routed_experts"]["shape"] == list(turn.routed_experts.shape)
    if turn.ttft_seconds is not None:
        assert back.ttft_seconds is not None
        assert bits([back.ttft_seconds]) == bits([turn.ttft_seconds])
    back.check()


def npy_base64(array: np.ndarray[Any, Any]) -> str:
    """What vLLM sends: the array's `.npy` bytes, base64 encoded (vllm.utils.serial_utils.numpy2base64)."""
    with io.BytesIO() as buffer:
        np.save(buffer, array, allow_pickle=False)
        return base64.b64encode(buffer.getbuffer()).decode("ascii")


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.int32, np.dtype(">u2")], ids=str)
def test_routed_experts_decode_from_vllms_npy(dtype: Any) -> None:
    tokens, layers, top_k = 9, 4, 2
    rng = np.random.default_rng(7)
    high = min(np.iinfo(np.dtype(dtype)).max, 65535) + 1
    array = rng.integers(0, high, size=(tokens - 1, layers, top_k)).astype(dtype)
    array[0, 0, 0] = high - 1  # the largest id the dtype (or uint16) holds
    routed = decode_routed_experts(npy_base64(array))
    assert routed.shape == (tokens - 1, layers, top_k)
    np.testing.assert_array_equal(routed, array)
    # vLLM's own uint8/uint16 (chosen from the model's expert count) are kept; wider ints are narrowed to
    # what holds their largest id (here 65535: uint16); always native byte order.
    assert routed.dtype == (np.uint8 if np.dtype(dtype) == np.uint8 else np.uint16)
    assert routed.dtype.isnative


def test_routed_experts_of_an_empty_sequence_decode_to_nothing() -> None:
    routed = decode_routed_experts(npy_base64(np.zeros((0, 4, 2), np.uint8)))
    assert routed.shape == (0, 4, 2) and routed.dtype == np.uint8


def _npz() -> str:
    with io.BytesIO() as buffer:
        np.savez(buffer, routed=np.zeros((2, 2, 2), np.uint8))
        return base64.b64encode(buffer.getvalue()).decode()


def _truncated() -> str:
    whole = base64.b64decode(npy_base64(np.zeros((4, 2, 2), np.int32)))
    return base64.b64encode(whole[:-5]).decode()


BAD_ROUTING = {
    "not base64": "this is not base64!",
    "base64 with a stray newline": npy_base64(np.zeros((2, 2, 2), np.uint8)) + "\n",
    "not npy": base64.b64encode(b"hello world, not an array").decode(),
    "truncated npy": _truncated(),
    "2-D": npy_base64(np.zeros((4, 2), np.uint8)),
    "4-D": npy_base64(np.zeros((4, 2, 2, 1), np.uint8)),
    "floats": npy_base64(np.zeros((4, 2, 2), np.float32)),
    "booleans": npy_base64(np.zeros((4, 2, 2), np.bool_)),
    "negative ids": npy_base64(np.full((4, 2, 2), -1, np.int32)),
    "ids past uint16": npy_base64(np.full((4, 2, 2), 65536, np.int32)),
}


@pytest.mark.parametrize("encoded", BAD_ROUTING.values(), ids=BAD_ROUTING.keys())
def test_malformed_routed_experts_are_an_engine_error(encoded: str) -> None:
    with pytest.raises(ProxyError) as caught:
        decode_routed_experts(encoded)
    assert caught.value.kind == "engine_error"
    assert caught.value.http_status == 502
    assert "routed_experts" in caught.value.message


def test_empty_routed_experts_are_an_engine_error() -> None:
    with pytest.raises(ProxyError) as caught:
        decode_routed_experts("")
    assert caught.value.kind == "engine_error"


def test_an_npz_archive_is_an_engine_error() -> None:
    with pytest.raises(ProxyError) as caught:
        decode_routed_experts(_npz())
    assert caught.value.kind == "engine_error"


def v1_journal_record(turn: Turn, *, packed_routing: bool = True) -> bytes:
    """A turn record framed exactly as the journal wrote it before routing stayed numpy: the routing as a flat
    `{"$array": "u2"}` (or, where packing failed, a plain list) next to `routed_experts_shape`."""
    assert turn.routed_experts is not None
    flat = [int(x) for x in turn.routed_experts.reshape(-1)]

    def packed(values: list[Any], code: str, kind: str) -> dict[str, str]:
        return {
            "$array": kind,
            "b64": base64.b64encode(struct.pack(f"<{len(values)}{code}", *values)).decode(),
        }

    record = {
        "type": "turn",
        "run": turn.run,
        "trial": turn.trial,
        "session": turn.session,
        "index": turn.index,
        "api_format": turn.api_format.value,
        "prompt_token_ids": packed(turn.prompt_token_ids, "i", "i4"),
        "completion_token_ids": packed(turn.completion_token_ids, "i", "i4"),
        "completion_logprobs": packed(turn.completion_logprobs, "d", "f8"),
        "finish_reason": turn.finish_reason,
        "policy_versions": turn.policy_versions,
        "started_at": turn.started_at.isoformat(),
        "ended_at": turn.ended_at.isoformat(),
        "routed_experts": packed(flat, "H", "u2") if packed_routing else flat,
        "routed_experts_shape": list(turn.routed_experts.shape),
        "ttft_seconds": turn.ttft_seconds,
        "request_body": turn.request_body,
        "response_body": turn.response_body,
        "prompt_tokens": turn.prompt_tokens,
        "completion_tokens": turn.completion_tokens,
    }
    return frame(json.dumps(record).encode())


@pytest.mark.parametrize("packed_routing", [True, False], ids=["packed-u2", "plain-list"])
@pytest.mark.asyncio
async def test_a_journal_written_before_numpy_routing_still_reads(
    tmp_path: Path, packed_routing: bool
) -> None:
    old = make_turn()
    new = make_turn(index=4, routed_experts=np.arange(13 * 2 * 2, dtype=np.uint8).reshape(13, 2, 2))
    (tmp_path / FILENAME).write_bytes(v1_journal_record(old, packed_routing=packed_routing))
    journal = Journal(tmp_path)  # a proxy restarted after the upgrade appends to the old journal
    try:
        assert journal.recovered.dropped_bytes == 0
        await journal.append(turn_to_record(new))
    finally:
        journal.close()
    first, second = (turn_from_record(r) for r in read_journal(tmp_path).records)
    assert first == old and second == new
    assert first.routed_experts is not None and first.routed_experts.dtype == np.uint16
    assert second.routed_experts is not None and second.routed_experts.dtype == np.uint8


def test_a_checksummed_record_whose_routing_does_not_decode_ends_the_journal(tmp_path: Path) -> None:
    """Like any record that does not decode: treated as the torn tail, never half-read."""
    good = v1_journal_record(make_turn())
    bad = json.loads(good[8:])
    bad["routed_experts"] = {"$array": "u2", "b64": base64.b64encode(b"\x00" * 6).decode()}  # 3 ids, not 52
    (tmp_path / FILENAME).write_bytes(good + frame(json.dumps(bad).encode()))
    recovered = read_journal(tmp_path)
    assert len(recovered.records) == 1
    assert recovered.dropped_bytes == len(frame(json.dumps(bad).encode()))


# -- request bodies stored as deltas --------------------------------------------------------------


def conversation_bodies(turns: int) -> list[str]:
    """The request bodies of a harness conversation: each sends the whole history so far."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent. " * 80}]
    bodies = []
    for k in range(turns):
        messages.append({"role": "user", "content": f"step {k}: run the tests ✓ " + "x" * 200})
        bodies.append(json.dumps({"model": "policy", "messages": messages, "stream": k % 2 == 0}))
        messages.append({"role": "assistant", "content": f"ran them, {k} failed " + "y" * 300})
    return bodies


@pytest.mark.asyncio
async def test_request_bodies_are_stored_as_deltas_and_read_back_whole(tmp_path: Path) -> None:
    bodies = conversation_bodies(50)
    turns = [turn_to_record(make_turn(index=i, request_body=b)) for i, b in enumerate(bodies)]
    # A turn without a body in the middle (record_bodies off for it): the next one is stored whole.
    turns[20] = turn_to_record(make_turn(index=20, request_body=None))
    await write(tmp_path, turns)
    size = (tmp_path / FILENAME).stat().st_size

    recovered = read_journal(tmp_path)
    assert recovered.dropped_bytes == 0
    assert [r["request_body"] for r in recovered.records] == [t["request_body"] for t in turns]
    assert [turn_from_record(r) for r in recovered.records] == [turn_from_record(t) for t in turns]

    whole = sum(len(encode_record(t)) for t in turns)
    print(f"50 turns: {size} bytes as deltas, {whole} stored whole ({size / whole:.1%})")
    assert size < whole / 5
    stored = [json.loads(payload) for payload in payloads(tmp_path)]
    assert isinstance(stored[1]["request_body"], dict)  # a delta
    assert isinstance(stored[21]["request_body"], str)  # after a turn without a body: whole


@pytest.mark.asyncio
async def test_prompts_are_stored_as_deltas_against_the_previous_prompt_and_completion(
    tmp_path: Path,
) -> None:
    # A follow-up's prompt extends the previous prompt and completion (merged turns) or rewrites it.
    prompt, turns = list(range(500)), []
    for i in range(8):
        completion = [7000 + 10 * i + k for k in range(40)]
        turns.append(
            turn_to_record(
                make_turn(
                    index=i,
                    prompt_token_ids=prompt,
                    completion_token_ids=completion,
                    completion_logprobs=[-0.5] * 40,
                    routed_experts=None,
                )
            )
        )
        prompt = prompt + completion + [151645, 198] if i != 4 else [1, 2, 3, *prompt[100:]]
    await write(tmp_path, turns)
    recovered = read_journal(tmp_path)
    assert [turn_from_record(r) for r in recovered.records] == [turn_from_record(t) for t in turns]
    stored = [json.loads(p) for p in payloads(tmp_path)]
    kinds = [type(s["prompt_token_ids"]).__name__ for s in stored]
    keeps = [s["prompt_token_ids"].get("keep") for s in stored]
    print(kinds, keeps)
    assert [k is not None for k in keeps] == [False, True, True, True, True, False, True, True]
    assert keeps[1] == 540  # the whole previous prompt and completion


@pytest.mark.asyncio
async def test_a_reopened_journal_goes_on_with_deltas_against_what_it_recovered(tmp_path: Path) -> None:
    bodies = conversation_bodies(6)
    await write(
        tmp_path, [turn_to_record(make_turn(index=i, request_body=b)) for i, b in enumerate(bodies[:3])]
    )
    # A crash tore the fourth record: the reopened journal cuts it and extends the third one's body.
    with (tmp_path / FILENAME).open("ab") as f:
        third = turn_to_record(make_turn(index=2, request_body=bodies[2]))
        f.write(encode_record(turn_to_record(make_turn(index=3, request_body=bodies[3])), third)[:-5])
    await write(
        tmp_path, [turn_to_record(make_turn(index=i, request_body=b)) for i, b in enumerate(bodies) if i >= 3]
    )
    recovered = read_journal(tmp_path)
    assert recovered.dropped_bytes == 0
    assert [r["request_body"] for r in recovered.records] == bodies
    assert all(isinstance(json.loads(p)["request_body"], dict) for p in payloads(tmp_path)[1:])


def test_a_delta_without_its_base_is_corruption_not_a_body(tmp_path: Path) -> None:
    body = conversation_bodies(2)[1]
    good = encode_record(turn_to_record(make_turn(index=0, request_body="short")))
    # Checksummed and well-formed, but it extends a body the journal does not hold.
    orphan = encode_record(
        turn_to_record(make_turn(index=1, request_body=body)),
        turn_to_record(make_turn(index=0, request_body=body[:-10])),
    )
    (tmp_path / FILENAME).write_bytes(good + orphan)
    recovered = read_journal(tmp_path)
    assert [r["request_body"] for r in recovered.records] == ["short"]
    assert recovered.dropped_bytes == len(orphan)


def payloads(directory: Path) -> list[bytes]:
    data = (directory / FILENAME).read_bytes()
    out, pos = [], 0
    while pos < len(data):
        (length,) = struct.unpack_from("<I", data, pos)
        out.append(data[pos + 8 : pos + 8 + length])
        pos += 8 + length
    return out

"""The turn journal: append-only, checksummed, fsync'd before the harness gets its answer.

One file per trial, `DIR/journal.log`, a sequence of records:

    [u32 little-endian payload length][u32 CRC-32 of the payload][payload: UTF-8 JSON]

The long numeric arrays of a turn (token ids, log-probs, routed experts) are stored inside the
JSON as base64 of their little-endian bytes (`{"$array": "i4", "b64": ...}`): writing a float's
shortest decimal repr costs about a microsecond, so a turn's few thousand numbers would make the
journal the proxy's largest cost; the bytes are exact (log-probs as float64, as vLLM sent them).
Routed experts are written as the trajectory contract's JSON form (`routing_to_json`: uint8 or
uint16 with their shape) straight from their numpy array. Records read back hold plain lists for
token ids and log-probs and a numpy array (rows, layers, top_k) for routed experts; journals
written before (routing as a flat `u2` array next to `routed_experts_shape`) read the same way.

A turn's `request_body` (the harness's whole request, kept for the trajectory viewer) and its
`prompt_token_ids` repeat the conversation so far, so stored whole they would grow the journal
quadratically with a conversation's length. Each is stored as a delta against the previous turn record
when that saves anything: `{"$delta": "previous", "keep": N, "add": ...}` is the first N items of the
previous turn's value followed by `add` (for the body: its characters; for the prompt: the previous
turn's prompt and completion token ids, which a follow-up's prompt extends). Reading rebuilds both
whole, in file order, so every reader sees what was sent.

A record is acknowledged once its bytes and the file are fsync'd; the proxy answers the harness
only after that. A crash can leave a torn tail (a short header, a short payload, or a payload
whose checksum does not match): opening the journal detects it, truncates the file back to the
last whole record and reports how many bytes it dropped. A torn record was never acknowledged, so
nothing acknowledged is lost.

Writers on the event loop hand records to one writer thread, which writes everything queued and
fsyncs once for the lot (group commit): concurrent sessions share the fsync instead of queueing
behind one another. A record with nothing to share its fsync with (the trial's only call in flight)
is written and synced on the event loop itself, which spares the two thread hand-offs.
"""

from __future__ import annotations

import array
import asyncio
import base64
import logging
import os
import struct
import sys
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from legorl.api.trajectory import Turn, decode_routing, routing_to_json
from legorl.proxy import _json as fastjson

__all__ = ["Journal", "JournalError", "Recovered", "read_journal", "turn_from_record", "turn_to_record"]

log = logging.getLogger(__name__)

FILENAME = "journal.log"
_HEADER = struct.Struct("<II")
MAX_RECORD_BYTES = 1 << 30
"""A length above this is corruption, not a record."""


class JournalError(RuntimeError):
    """The journal could not be written; the turn is not acknowledged."""


@dataclass(frozen=True)
class Recovered:
    """What opening an existing journal found."""

    records: list[dict[str, Any]]
    dropped_bytes: int
    """Bytes of a torn tail that were cut off (0 for a clean journal)."""


_PACKED: dict[str, str] = {
    "prompt_token_ids": "i4",
    "completion_token_ids": "i4",
    "completion_logprobs": "f8",
}
_TYPECODE = {"i4": "i", "f8": "d", "u2": "H"}
_DELTA_MIN_KEEP = 64
"""A shorter shared prefix is stored whole: the delta's own keys would cost about as much."""


def _shared_prefix(a: Any, b: Any) -> int:
    """Length of the longest common prefix of two strings or lists; a binary search of slice
    comparisons (C speed), not an item loop in Python."""
    low, high = 0, min(len(a), len(b))
    if a[:high] == b[:high]:
        return high
    while low < high - 1:  # a[:low] == b[:low] and a[:high] != b[:high]
        mid = (low + high) // 2
        if a[:mid] == b[:mid]:
            low = mid
        else:
            high = mid
    return low


@dataclass
class _Previous:
    """What the next turn record's deltas are against: the last turn record's body and tokens."""

    body: str | None = None
    tokens: list[int] | None = None

    @classmethod
    def of(cls, record: dict[str, Any]) -> _Previous:
        body, prompt, completion = (
            record.get("request_body"),
            record.get("prompt_token_ids"),
            record.get("completion_token_ids"),
        )
        tokens = prompt + completion if isinstance(prompt, list) and isinstance(completion, list) else None
        return cls(body if isinstance(body, str) else None, tokens)


def _delta(value: Any, previous: Any, kind: type[str] | type[list[Any]]) -> Any:
    if not isinstance(value, kind) or previous is None:
        return value
    keep = _shared_prefix(previous, value)
    if keep < _DELTA_MIN_KEEP:
        return value
    return {"$delta": "previous", "keep": keep, "add": value[keep:]}


def _whole(value: Any, previous: Any, kind: type[str] | type[list[Any]]) -> Any:
    if not isinstance(value, dict) or "$delta" not in value:
        return value
    keep, add = value.get("keep"), value.get("add")
    if (
        value["$delta"] != "previous"
        or previous is None
        or not isinstance(keep, int)
        or not 0 <= keep <= len(previous)
        or not isinstance(add, kind)
    ):
        raise ValueError("a delta without the value it extends")
    return previous[:keep] + add


def _pack(values: list[Any], kind: str) -> dict[str, str] | list[Any]:
    try:
        packed = array.array(_TYPECODE[kind], values)
    except (OverflowError, TypeError):
        return values  # out of the packed type's range: stored as a plain list, still exact
    if sys.byteorder == "big":
        packed.byteswap()
    return {"$array": kind, "b64": base64.b64encode(packed.tobytes()).decode()}


def _unpack(value: Any) -> Any:
    if not isinstance(value, dict) or value.get("$array") not in _TYPECODE:
        return value
    packed = array.array(_TYPECODE[value["$array"]])
    packed.frombytes(base64.b64decode(value["b64"]))
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tolist()


def _unpack_record(record: dict[str, Any]) -> dict[str, Any]:
    for key in _PACKED:
        if key in record:
            value = record[key]
            if isinstance(value, dict) and "$delta" in value:
                record[key] = {**value, "add": _unpack(value.get("add"))}
            else:
                record[key] = _unpack(value)
    if record.get("routed_experts") is not None:
        record["routed_experts"] = decode_routing(
            record["routed_experts"], record.get("routed_experts_shape")
        )
    return record


def _scan(data: bytes) -> tuple[list[dict[str, Any]], int]:
    """Whole records in `data` and the offset just past the last one."""
    records: list[dict[str, Any]] = []
    previous = _Previous()
    pos = 0
    while pos + _HEADER.size <= len(data):
        length, crc = _HEADER.unpack_from(data, pos)
        start = pos + _HEADER.size
        end = start + length
        if length > MAX_RECORD_BYTES or end > len(data):
            break
        payload = data[start:end]
        if zlib.crc32(payload) != crc:
            break
        try:
            record = fastjson.loads(payload)
        except fastjson.JSONDecodeError:
            break
        if not isinstance(record, dict):
            break
        try:
            record = _unpack_record(record)
            if record.get("type") == "turn":
                if "request_body" in record:
                    record["request_body"] = _whole(record["request_body"], previous.body, str)
                if "prompt_token_ids" in record:
                    record["prompt_token_ids"] = _whole(record["prompt_token_ids"], previous.tokens, list)
                previous = _Previous.of(record)
            records.append(record)
        except (ValueError, TypeError, KeyError):
            break  # a checksummed record that does not decode is corruption all the same
        pos = end
    return records, pos


def read_journal(directory: str | Path) -> Recovered:
    """Read a journal without changing it (a torn tail is reported, not cut)."""
    path = Path(directory) / FILENAME
    if not path.exists():
        return Recovered(records=[], dropped_bytes=0)
    data = path.read_bytes()
    records, end = _scan(data)
    return Recovered(records=records, dropped_bytes=len(data) - end)


def encode_record(record: dict[str, Any], previous_turn: dict[str, Any] | None = None) -> bytes:
    """A record as framed bytes; its long numeric arrays are packed and a turn's request body and prompt
    are deltas against `previous_turn`, the journal's previous turn record (see the module docstring)."""
    packed = dict(record)
    if record.get("type") == "turn" and previous_turn is not None:
        previous = _Previous.of(previous_turn)
        if "request_body" in record:
            packed["request_body"] = _delta(record["request_body"], previous.body, str)
        if "prompt_token_ids" in record:
            packed["prompt_token_ids"] = _delta(record["prompt_token_ids"], previous.tokens, list)
    for key, kind in _PACKED.items():
        value = packed.get(key)
        if isinstance(value, list):
            packed[key] = _pack(value, kind)
        elif isinstance(value, dict) and isinstance(value.get("add"), list):
            packed[key] = {**value, "add": _pack(value["add"], kind)}
    if isinstance(packed.get("routed_experts"), np.ndarray):
        packed["routed_experts"] = routing_to_json(packed["routed_experts"])
    payload = fastjson.dumps(packed)
    return _HEADER.pack(len(payload), zlib.crc32(payload)) + payload


@dataclass
class _Pending:
    data: bytes
    done: Callable[[BaseException | None], None]


class Journal:
    """An open journal: `await append(record)` returns once the record is durable."""

    def __init__(
        self,
        directory: str | Path,
        *,
        fsync: bool = True,
        on_sync: Callable[[float, int], None] | None = None,
    ) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.path = self.directory / FILENAME
        self._fsync = fsync
        self._on_sync = on_sync
        data = self.path.read_bytes() if self.path.exists() else b""
        records, end = _scan(data)
        self.recovered = Recovered(records=records, dropped_bytes=len(data) - end)
        turns = [r for r in records if r.get("type") == "turn"]
        self._previous_turn: dict[str, Any] | None = turns[-1] if turns else None
        """The last turn record, which the next one's deltas are against."""
        # O_APPEND after truncating the torn tail: every write lands at the end, whole.
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        if end != len(data):
            log.warning(
                "journal %s: dropped a torn tail of %d bytes after %d whole records",
                self.path,
                len(data) - end,
                len(records),
            )
            os.ftruncate(self._fd, end)
            os.fsync(self._fd)
        self._sync_dir()
        self._cond = threading.Condition()
        self._queue: list[_Pending] = []
        self._writing = False
        """The writer thread is writing a batch (an inline write must wait its turn)."""
        self._closed = False
        self._failed: BaseException | None = None
        self._thread = threading.Thread(target=self._writer, name="legorl-journal", daemon=True)
        self._thread.start()

    def _sync_dir(self) -> None:
        # The file's directory entry must be durable too, or a crash can lose the whole file.
        if not self._fsync:
            return
        dir_fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def _writer(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                batch, self._queue = self._queue, []
                closing = self._closed
                self._writing = bool(batch)
            error: BaseException | None = None
            try:
                if batch:
                    error = self._write_batch(batch)
            finally:
                with self._cond:
                    self._writing = False
            # Only now wake the callers: one that appends at once, alone, finds the writer idle and
            # writes inline instead of queueing behind a batch that is already on disk.
            for pending in batch:
                pending.done(error)
            if closing and not batch:
                return

    def _write_batch(self, batch: list[_Pending]) -> BaseException | None:
        """Write and sync the batch; the error that fails it, if any (its callers are told by the
        caller of this)."""
        error: BaseException | None = self._failed
        if error is None:
            try:
                blob = b"".join(p.data for p in batch)
                view = memoryview(blob)
                while view:
                    written = os.write(self._fd, view)
                    view = view[written:]
                started = time.perf_counter()
                if self._fsync:
                    os.fsync(self._fd)
                if self._on_sync is not None:
                    self._on_sync(time.perf_counter() - started, len(batch))
            except OSError as exc:
                # A failed write may have left part of a record behind; nothing after it can be
                # trusted to append cleanly, so the journal refuses every later record.
                self._failed = error = exc
                log.error("journal %s: write failed: %s", self.path, exc)
        return error

    async def append(self, record: dict[str, Any], *, alone: bool = False) -> None:
        """Write one record and wait until it is on disk; raises JournalError if it is not.

        `alone`: no other record is on its way (the caller's only call in flight). With nothing queued
        and the writer idle, the record is then written and synced here, on the event loop: there is
        nothing to commit it with, and handing it to the writer thread and back (two thread wake-ups
        and the interpreter lock passed between them) costs more CPU than the write. Concurrent calls
        still go through the writer thread, where they share one fsync.
        """
        data = encode_record(record, self._previous_turn)
        if record.get("type") == "turn":
            # In step with the file: records reach it in the order they are encoded here (one loop, one
            # queue); after a failed write the journal refuses every later record.
            self._previous_turn = record
        if alone:
            with self._cond:
                if self._closed:
                    raise JournalError("journal is closed")
                inline = not self._queue and not self._writing
            if inline:
                # Only the event loop queues records, and it is here: the writer stays idle meanwhile.
                error = self._write_batch([_Pending(data, _ignore)])
                if error is not None:
                    raise JournalError(f"journal write failed: {error}")
                return
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()

        def done(error: BaseException | None) -> None:
            loop.call_soon_threadsafe(_settle, future, error)

        with self._cond:
            if self._closed:
                raise JournalError("journal is closed")
            self._queue.append(_Pending(data, done))
            self._cond.notify()
        await asyncio.shield(future)

    def close(self) -> None:
        """Flush what is queued, stop the writer and close the file."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify()
        self._thread.join()
        os.close(self._fd)


def _ignore(error: BaseException | None) -> None:
    pass


def _settle(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(JournalError(f"journal write failed: {error}"))


def turn_to_record(turn: Turn) -> dict[str, Any]:
    """A turn as a JSON journal record (timestamps as ISO strings, floats exactly as vLLM sent them,
    routing in the contract's JSON form)."""
    return {"type": "turn", **turn.to_json()}


def turn_from_record(record: dict[str, Any]) -> Turn:
    return Turn.from_json(record)

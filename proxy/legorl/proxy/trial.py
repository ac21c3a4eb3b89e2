"""One trial as the proxy sees it: its journaled turns, its failures and how it ended.

State lives in the journal: on start the proxy reads it back (dropping a torn tail), so a
restarted proxy continues the turn numbering, keeps every acknowledged turn, and remembers an
end state it had already recorded.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import logging
from collections import Counter
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import numpy as np

from legorl.api.summary import EndSource, TrajectorySummary, TrialEnd
from legorl.api.termination import TerminationReason
from legorl.api.trajectory import ApiFormat, ExpertIds, TrajectoryError, Turn, routing_array
from legorl.proxy.errors import ProxyError
from legorl.proxy.formats.common import Completion, ToolCall
from legorl.proxy.journal import Journal, JournalError, turn_from_record, turn_to_record
from legorl.proxy.metrics import Metrics
from legorl.proxy.segments import Assembler
from legorl.proxy.settings import ProxySettings

__all__ = ["Trial", "decode_routed_experts"]

log = logging.getLogger(__name__)


def decode_routed_experts(encoded: str) -> ExpertIds:
    """vLLM's routed experts: base64 of a `.npy` array shaped (tokens - 1, layers, top_k), as a routing
    array (`legorl.api.trajectory.routing_array`: vLLM's uint8/uint16 kept, wider ints narrowed)."""
    try:
        array = np.load(io.BytesIO(base64.b64decode(encoded, validate=True)), allow_pickle=False)
    except (binascii.Error, ValueError, OSError, EOFError) as exc:
        raise ProxyError("engine_error", f"routed_experts is not a base64 .npy array: {exc}") from exc
    if not isinstance(array, np.ndarray):
        raise ProxyError("engine_error", "routed_experts is an .npz archive, not one .npy array")
    if array.ndim != 3 or array.dtype.kind not in "iu":
        raise ProxyError(
            "engine_error",
            f"routed_experts must be an integer array of 3 dimensions, got {array.dtype}{array.shape}",
        )
    try:
        return routing_array(array)
    except TrajectoryError as exc:
        raise ProxyError("engine_error", str(exc)) from exc


def _canonical(arguments: Any) -> str | None:
    """A JSON text in one spelling (sorted keys, no spaces), or None if it is not JSON."""
    if not isinstance(arguments, str):
        return None
    try:
        return json.dumps(json.loads(arguments), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    except ValueError:
        return None


class Trial:
    """The trial's turns, journaled before any harness sees an answer."""

    def __init__(self, settings: ProxySettings, metrics: Metrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.journal = Journal(settings.journal, fsync=settings.fsync, on_sync=self._on_sync)
        self.turns: list[Turn] = []
        self.tool_arguments: dict[str, str] = {}
        """The engine's own spelling of the arguments of every tool call it answered this trial, by
        call id (see `restore_tool_arguments`); in memory only: after a restart, earlier calls merge
        only if the harness sends their arguments back unchanged."""
        self.end: TrialEnd | None = None
        self.last_failure: ProxyError | None = None
        self.errors: dict[str, int] = {}
        for record in self.journal.recovered.records:
            if record.get("type") == "turn":
                self.turns.append(turn_from_record(record))
            elif record.get("type") == "end":
                self.end = TrialEnd.from_json(record)
        self.turns.sort(key=lambda t: t.index)
        self.assembler = Assembler()
        for turn in self.turns:
            self.assembler.add(turn)
        self.next_index = max((t.index for t in self.turns), default=-1) + 1
        self._reserved = 0
        if self.turns or self.end:
            log.info(
                "journal %s: resumed with %d turns%s (torn tail: %d bytes)",
                settings.journal,
                len(self.turns),
                f", ended {self.end.reason.value}" if self.end else "",
                self.journal.recovered.dropped_bytes,
            )
        self._update_gauges()
        self.metrics.set("legorl_proxy_journal_dropped_bytes", self.journal.recovered.dropped_bytes)

    def _on_sync(self, seconds: float, records: int) -> None:
        self.metrics.observe("legorl_proxy_journal_fsync_seconds", seconds)
        self.metrics.observe("legorl_proxy_journal_batch_records", records)

    def close(self) -> None:
        self.journal.close()

    def admit(self) -> None:
        """Refuse a call once the trial has ended or used its turn budget."""
        if self.end is not None:
            raise ProxyError(
                "trial_finished",
                f"this trial ended ({self.end.reason.value}); the proxy serves no more calls",
            )
        limit = self.settings.max_turns
        if limit is not None and self.next_index + self._reserved >= limit:
            raise ProxyError("trial_finished", f"the trial's turn budget ({limit} turns) is used up")
        self._reserved += 1

    def release(self) -> None:
        self._reserved -= 1

    def build_turn(
        self,
        api_format: ApiFormat,
        comp: Completion,
        *,
        versions: list[str],
        started_at: datetime,
        ttft: float | None,
        request_body: str | None,
        response_body: str | None,
    ) -> Turn:
        """Check the engine's answer against the contract and make it a turn (index set on record)."""
        if not comp.prompt_token_ids:
            raise ProxyError(
                "engine_error", "the engine returned no prompt token ids (does it support return_token_ids?)"
            )
        if len(comp.completion_logprobs) != len(comp.completion_token_ids):
            raise ProxyError(
                "engine_error",
                f"the engine returned {len(comp.completion_logprobs)} logprobs for "
                f"{len(comp.completion_token_ids)} tokens",
            )
        routed = None
        if comp.routed_experts is not None:
            routed = decode_routed_experts(comp.routed_experts)
        elif self.settings.capture_routed_experts:
            raise ProxyError(
                "engine_error",
                "the fleet is set to capture routed experts but the engine returned none "
                "(is --enable-return-routed-experts on?)",
            )
        turn = Turn(
            run=self.settings.run,
            trial=self.settings.trial,
            session=self.settings.trial,
            index=-1,
            api_format=api_format,
            prompt_token_ids=comp.prompt_token_ids,
            completion_token_ids=comp.completion_token_ids,
            completion_logprobs=comp.completion_logprobs,
            finish_reason=comp.finish_reason,
            policy_versions=versions,
            started_at=started_at,
            ended_at=datetime.now(UTC),
            routed_experts=routed,
            ttft_seconds=ttft,
            request_body=request_body if self.settings.record_bodies else None,
            response_body=response_body if self.settings.record_bodies else None,
        )
        try:
            turn.check()
        except TrajectoryError as exc:
            raise ProxyError(
                "engine_error", f"the engine's answer breaks the trajectory contract: {exc}"
            ) from exc
        return turn

    def remember_tool_calls(self, calls: list[ToolCall]) -> None:
        for call in calls:
            self.tool_arguments[call.id] = call.arguments

    def restore_tool_arguments(self, messages: list[dict[str, Any]]) -> int:
        """Put the engine's own spelling back on tool calls the harness sends back re-serialised.

        Some harnesses (OpenCode) send an earlier tool call's arguments back as they re-serialised them
        (`{"command":"ls"}` for the engine's `{"command": "ls"}`): the same JSON, other text, so the
        engine's template renders other tokens and the turn cannot extend the one that sampled the
        call. Where the call id is one the engine answered and the arguments are the same JSON value
        (compared in a canonical form: `true` is not `1`), the engine's string goes to the engine
        instead, so the prompt it renders holds the very tokens it sampled. Nothing else changes: the
        tokens recorded are still the engine's own. Returns how many calls were restored."""
        restored = 0
        for message in messages:
            if message.get("role") != "assistant":
                continue
            for call in message.get("tool_calls") or []:
                function = call.get("function") if isinstance(call, dict) else None
                call_id = call.get("id") if isinstance(function, dict) else None
                original = self.tool_arguments.get(call_id) if isinstance(call_id, str) else None
                if original is None or function is None or function.get("arguments") == original:
                    continue
                canonical = _canonical(original)
                if canonical is not None and _canonical(function.get("arguments")) == canonical:
                    function["arguments"] = original
                    restored += 1
        if restored:
            self.metrics.inc("legorl_proxy_tool_arguments_restored_total", restored)
        return restored

    async def record(self, turn: Turn) -> Turn:
        """Journal the turn durably; only then may the harness see the answer."""
        turn = replace(turn, index=self.next_index)
        self.next_index += 1
        try:
            # The only call in flight has nothing to share an fsync with: written on the loop.
            await self.journal.append(turn_to_record(turn), alone=self._reserved <= 1)
        except JournalError as exc:
            error = ProxyError("proxy_error", f"could not journal the turn: {exc}")
            await self.fail(error)
            raise error from exc
        self.turns.append(turn)
        self.assembler.add(turn)
        self.last_failure = None
        self.metrics.inc("legorl_proxy_tokens_in_total", turn.prompt_tokens)
        self.metrics.inc("legorl_proxy_tokens_out_total", turn.completion_tokens)
        self._update_gauges()
        return turn

    def _update_gauges(self) -> None:
        self.metrics.set("legorl_proxy_turns", len(self.turns))
        share = self.assembler.merged_turn_share
        if share is not None:
            self.metrics.set("legorl_proxy_segment_merge_ratio", share)

    async def fail(self, error: ProxyError) -> None:
        """Note a failed call; engine and journal failures end the trial (fail closed)."""
        self.errors[error.kind] = self.errors.get(error.kind, 0) + 1
        self.metrics.inc("legorl_proxy_errors_total", kind=error.kind)
        self.last_failure = error
        if error.kind == "engine_error":
            await self._end(TerminationReason.ENGINE_ERROR, "proxy", error.message, None)
        elif error.kind == "proxy_error":
            await self._end(TerminationReason.PROXY_ERROR, "proxy", error.message, None)
        elif error.kind == "trial_finished" and self.end is None and self.settings.max_turns is not None:
            await self._end(TerminationReason.TURN_LIMIT, "proxy", error.message, None)

    async def _end(
        self, reason: TerminationReason, source: EndSource, detail: str | None, exit_code: int | None
    ) -> None:
        if self.end is not None:
            return
        self.end = TrialEnd(
            reason=reason, source=source, detail=detail, exit_code=exit_code, ended_at=datetime.now(UTC)
        )
        try:
            await self.journal.append({"type": "end", **self.end.to_json()})
        except JournalError:
            # The end state still holds in memory; the turns that matter are already durable.
            log.exception("could not journal the trial's end state")

    async def finish(self, reason: TerminationReason, detail: str | None, exit_code: int | None) -> TrialEnd:
        """The harness's exit, reconciled with what the proxy saw: a failure the proxy already
        recorded wins, and a harness that gave up right after a prompt overflowed the context
        ended because of the overflow."""
        if self.end is None:
            if (
                reason != TerminationReason.COMPLETED
                and self.last_failure is not None
                and self.last_failure.kind == "context_overflow"
            ):
                reason, detail = TerminationReason.CONTEXT_OVERFLOW, self.last_failure.message
            await self._end(reason, "harness", detail, exit_code)
        assert self.end is not None
        return self.end

    def summary(self, *, tokens: bool = True) -> TrajectorySummary:
        """What the run controller collects: end state, segments and how well they merged."""
        assembly = self.assembler.assembly()
        versions: list[str] = []
        for turn in self.turns:
            versions.extend(v for v in turn.policy_versions if v not in versions)
        return TrajectorySummary(
            run=self.settings.run,
            trial=self.settings.trial,
            state="ended" if self.end else "running",
            end=self.end,
            turns=len(self.turns),
            policy_versions=versions,
            merged_turn_share=assembly.merged_turn_share,
            errors=dict(self.errors),
            journal_dropped_bytes=self.journal.recovered.dropped_bytes,
            finish_reasons=dict(Counter(t.finish_reason for t in self.turns)),
            segments=list(assembly.segments) if tokens else len(assembly.segments),
        )

    def trajectory(self, *, tokens: bool = True) -> dict[str, Any]:
        """`GET /trajectory`'s body: `summary` on the wire (`TrajectorySummary.to_json`)."""
        return self.summary(tokens=tokens).to_json()

"""The operator posts an Event when it changes a condition, once: the transitions are taken from the status
it last wrote, not from the watch cache, which can hold an older copy for a moment (an event of kopf's own
patch, sent before the status write, replaced the cached body while the write was in flight; under load the
next reconcile then posted every transition again: `test_failed_preflight_starts_nothing_and_a_fix_resumes`
failed 12 of 24 times with three busy loops beside it)."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

from legorl.operator.reconcile import Reconciler
from legorl.operator.render.common import RenderContext
from legorl.operator.settings import OperatorSettings


class _Client:
    """Records what the reconciler sends (the status patches and the Events)."""

    def __init__(self) -> None:
        self.patches: list[dict[str, Any]] = []
        self.events: list[tuple[str, str]] = []

    async def patch_status(self, kind: str, namespace: str, name: str, status: dict[str, Any]) -> None:
        self.patches.append(status)

    async def event(
        self, involved: dict[str, Any], *, type_: str, reason: str, message: str, now: Any
    ) -> None:
        self.events.append((type_, reason))


def _condition(status: str, reason: str) -> dict[str, Any]:
    return {"type": "Validated", "status": status, "reason": reason, "message": reason}


def _body() -> dict[str, Any]:
    """The watch's copy of the run from before any status write."""
    return {
        "apiVersion": "legorl.dev/v1alpha1",
        "kind": "RLRun",
        "metadata": {"name": "r", "namespace": "ns"},
    }


def test_a_stale_cached_copy_does_not_post_the_transitions_again() -> None:
    rec = Reconciler(settings=OperatorSettings(settle_seconds=0), ctx=RenderContext(), discovered=True)
    client = _Client()
    rec.client_ = client  # type: ignore[assignment]
    failed = {"conditions": [_condition("False", "PreflightFailed")]}

    async def run() -> None:
        await rec._write_status(_body(), copy.deepcopy(failed))
        assert client.events == [("Warning", "PreflightFailed")]
        # The next reconcile reads an older copy (no status): the status is sent again (harmless, the
        # same value), the Event is not.
        await rec._write_status(_body(), copy.deepcopy(failed))
        assert len(client.patches) == 2
        assert client.events == [("Warning", "PreflightFailed")]
        # A real change is still news, from a stale copy too.
        await rec._write_status(_body(), {"conditions": [_condition("True", "Valid")]})
        assert client.events == [("Warning", "PreflightFailed"), ("Normal", "Valid")]

    asyncio.run(run())


def test_a_new_process_posts_against_what_the_api_server_shows() -> None:
    """Nothing written yet by this process (e.g. after a restart): the cached status is the base."""
    rec = Reconciler(settings=OperatorSettings(settle_seconds=0), ctx=RenderContext(), discovered=True)
    client = _Client()
    rec.client_ = client  # type: ignore[assignment]
    body = {**_body(), "status": {"conditions": [_condition("False", "PreflightFailed")]}}
    asyncio.run(rec._write_status(body, {"conditions": [_condition("False", "PreflightFailed")]}))
    assert (client.patches, client.events) == ([], [])

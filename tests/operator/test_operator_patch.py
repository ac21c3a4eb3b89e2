"""The operator's API I/O helpers: minimal merge patches for status, and client error classes."""

from __future__ import annotations

from typing import Any

import pytest

from legorl.operator.patch import apply_merge_patch, merge_patch

CASES: list[tuple[dict[str, Any], dict[str, Any], dict[str, Any]]] = [
    ({}, {}, {}),
    ({"a": 1}, {"a": 1}, {}),
    ({"a": 1}, {"a": 2}, {"a": 2}),
    # A field the new status no longer has is deleted with null (exclude_none drops it from `new`).
    (
        {"servedPolicyVersion": "7", "readyReplicas": 2},
        {"readyReplicas": 1},
        {"servedPolicyVersion": None, "readyReplicas": 1},
    ),
    # Nested objects are diffed; lists (conditions) are replaced whole.
    (
        {"metrics": {"rewardMean": 0.5, "tokensPerSecond": 10.0}, "conditions": [{"type": "Ready"}]},
        {"metrics": {"rewardMean": 0.5}, "conditions": [{"type": "Ready"}, {"type": "Degraded"}]},
        {"metrics": {"tokensPerSecond": None}, "conditions": [{"type": "Ready"}, {"type": "Degraded"}]},
    ),
    (
        {"selfTest": {"result": "Pending"}},
        {"selfTest": {"result": "Passed", "checks": []}},
        {"selfTest": {"result": "Passed", "checks": []}},
    ),
]


@pytest.mark.parametrize(("old", "new", "expected"), CASES)
def test_merge_patch_is_minimal_and_applies(
    old: dict[str, Any], new: dict[str, Any], expected: dict[str, Any]
) -> None:
    patch = merge_patch(old, new)
    assert patch == expected
    assert apply_merge_patch(old, patch) == new


def test_connection_errors_are_transient_api_errors() -> None:
    import asyncio  # noqa: PLC0415

    from legorl.operator.kube import ApiError, Credentials, KubeClient  # noqa: PLC0415

    async def attempt() -> ApiError:
        client = KubeClient(Credentials(server="http://127.0.0.1:9"), timeout=2)
        try:
            await client.get("Deployment", "default", "x")
        except ApiError as exc:
            return exc
        finally:
            await client.close()
        raise AssertionError("no error")

    error = asyncio.run(attempt())
    assert error.status == 503 and error.transient
    assert "ConnectError" in str(error)

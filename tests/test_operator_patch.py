"""Status patches are minimal JSON merge patches that turn the stored status into the computed one."""

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

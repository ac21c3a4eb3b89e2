"""The engine → legorl version contract (`legorl.api.weight_versions`): the header/SSE encoding and the one
reader of vLLM's `GET /weight_info` answer that the operator, the UI and the trainer's weight sync share."""

from __future__ import annotations

import pytest

from legorl.api import weight_versions


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"weight_version": "v3"}, "v3"),
        ({"weight_version": "default", "other": 1}, "default"),
        ({"weight_version": ""}, None),
        ({"weight_version": 3}, None),
        ({"version": "v3"}, None),
        (["v3"], None),
        (None, None),
        ("v3", None),
    ],
)
def test_weight_info_is_read_once_for_every_reader(body: object, expected: str | None) -> None:
    assert weight_versions.from_weight_info(body) == expected


def test_the_startup_weights_are_the_runs_checkpoint() -> None:
    assert (
        weight_versions.policy_version(weight_versions.from_weight_info({"weight_version": "default"}) or "")
        == "v0"
    )
    assert weight_versions.policy_versions(["default", "v1", "v1"]) == ["v0", "v1"]
    assert weight_versions.policy_versions(None) is None


def test_the_versions_round_trip_through_the_header_and_the_stream_comment() -> None:
    versions = ["default", "v1"]
    assert weight_versions.decode(weight_versions.encode(versions)) == versions
    comment = weight_versions.sse_comment(versions)
    assert comment.startswith(weight_versions.SSE_PREFIX) and comment.endswith(b"\n\n")
    assert weight_versions.decode(comment[len(weight_versions.SSE_PREFIX) :].strip()) == versions
    for bad in ("", "[]", '[""]', "{}", "not json", '["v1", 2]'):
        assert weight_versions.decode(bad) is None, bad

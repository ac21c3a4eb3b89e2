"""The API models' own logic: conditions, phases, quantities, defaults, and the wire format."""

from __future__ import annotations

import typing
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from pydantic import TypeAdapter, ValidationError

from legorl.api import KINDS, RLRun
from legorl.api._base import ImageRef, exactly_one, parse_quantity
from legorl.api.conditions import (
    FleetReason,
    PoolReason,
    RunConditionType,
    RunPhase,
    RunReason,
    find_condition,
    rlrun_phase,
    set_condition,
)
from legorl.api.run import NATIVE_API_FORMAT, HarnessKind, RLRunSpec, Split

T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


def test_set_condition_keeps_transition_time_while_status_holds() -> None:
    conds = set_condition(
        [], type_="Ready", status="False", reason="ModelLoading", message="", generation=1, now=T0
    )
    later = T0 + timedelta(minutes=5)
    conds = set_condition(
        conds,
        type_="Ready",
        status="False",
        reason="ReplicasNotReady",
        message="1/2",
        generation=2,
        now=later,
    )
    (ready,) = conds
    assert ready.last_transition_time == "2026-11-30T12:00:00Z"
    assert ready.reason == "ReplicasNotReady"
    assert ready.observed_generation == 2
    conds = set_condition(
        conds, type_="Ready", status="True", reason="AllReplicasReady", message="", generation=2, now=later
    )
    assert conds[0].last_transition_time == "2026-11-30T12:05:00Z"


def test_set_condition_leaves_other_types_alone() -> None:
    conds = set_condition([], type_="A", status="True", reason="X", message="", generation=1, now=T0)
    conds = set_condition(conds, type_="B", status="False", reason="Y", message="", generation=1, now=T0)
    conds = set_condition(conds, type_="A", status="False", reason="Z", message="", generation=1, now=T0)
    assert [(c.type, c.status) for c in conds] == [("A", "False"), ("B", "False")]
    assert find_condition(conds, "B") is not None
    assert find_condition(conds, "C") is None


def _conds(**status: str) -> list:  # type: ignore[type-arg]
    out: list = []  # type: ignore[type-arg]
    for type_, value in status.items():
        state, reason = value.split(":")
        out = set_condition(out, type_=type_, status=state, reason=reason, message="", generation=1, now=T0)  # type: ignore[arg-type]
    return out


@pytest.mark.parametrize(
    ("conditions", "suspended", "expected"),
    [
        ({}, False, (RunPhase.PENDING, "NotStarted")),
        ({"Validated": "False:InvalidSpec"}, False, (RunPhase.INVALID, "InvalidSpec")),
        (
            {"Validated": "True:Valid", "RolloutReady": "False:FleetNotReady"},
            False,
            (RunPhase.PENDING, "FleetNotReady"),
        ),
        ({"Validated": "True:Valid", "Training": "True:Stepping"}, False, (RunPhase.RUNNING, "Stepping")),
        ({"Training": "True:Stepping"}, True, (RunPhase.SUSPENDED, "Suspended")),
        (
            {"Training": "True:Stepping", "Degraded": "True:FidelityBelowThreshold"},
            False,
            (RunPhase.DEGRADED, "FidelityBelowThreshold"),
        ),
        (
            {"Training": "False:Stopped", "Succeeded": "True:MaxStepsReached"},
            True,
            (RunPhase.SUCCEEDED, "MaxStepsReached"),
        ),
        (
            {"Failed": "True:TrainerFailed", "Degraded": "True:AsExpected"},
            False,
            (RunPhase.FAILED, "TrainerFailed"),
        ),
    ],
)
def test_rlrun_phase_is_derived_from_conditions(
    conditions: dict[str, str], suspended: bool, expected: tuple[RunPhase, str]
) -> None:
    assert rlrun_phase(_conds(**conditions), suspended) == expected


def test_every_reason_is_documented_and_camel_case() -> None:
    for enum in (FleetReason, PoolReason, RunReason, RunPhase):
        for member in enum:
            assert member.description, f"{enum.__name__}.{member.name} has no description"
            assert member.value[0].isupper() and "_" not in member.value
    assert {t.value for t in RunConditionType} == {
        "Validated",
        "RolloutReady",
        "SandboxesReady",
        "Training",
        "Succeeded",
        "Failed",
        "Degraded",
    }


@pytest.mark.parametrize(
    ("text", "value"),
    [("2", 2), ("500m", Decimal("0.5")), ("1Gi", 2**30), ("1.5G", 1_500_000_000), ("1e3", 1000), (4, 4)],
)
def test_parse_quantity(text: str | int, value: Decimal | int) -> None:
    assert parse_quantity(text) == value


@pytest.mark.parametrize("text", ["", "abc", "1XB", "1 Gi"])
def test_parse_quantity_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="not a Kubernetes quantity"):
        parse_quantity(text)


@pytest.mark.parametrize(
    "ref",
    [
        "vllm/vllm-openai:v0.33.0",
        "ghcr.io/org/img:1.2.3",
        "localhost:5000/team/img",
        "registry.k8s.io/pause:3.10",
        "img@sha256:" + "a" * 64,
    ],
)
def test_image_refs(ref: str) -> None:
    assert TypeAdapter(ImageRef).validate_python(ref) == ref


@pytest.mark.parametrize("ref", ["Upper/Case:1", "img:tag with space", "img@sha256:short", ""])
def test_bad_image_refs(ref: str) -> None:
    with pytest.raises(ValidationError):
        TypeAdapter(ImageRef).validate_python(ref)


def test_every_named_harness_has_a_native_api() -> None:
    kinds = set(typing.get_args(HarnessKind)) - {"Custom"}
    assert kinds == set(NATIVE_API_FORMAT)


def test_wire_format_round_trips() -> None:
    spec = RLRunSpec.model_validate(
        {
            "policy": {"checkpoint": {"uri": "builtin://tiny-moe"}},
            "fleet": {},
            "pool": {"source": {"images": ["task:v1"]}},
            "harness": {"kind": "Codex"},
            "tasks": {"source": {"uri": "builtin://tiny-python"}},
        }
    )
    wire = spec.to_wire()
    assert wire["algorithm"]["groupSize"] == 8
    assert wire["stop"] == {"maxSteps": 100, "maxInfraFailurePercent": 50}
    assert wire["tasks"]["split"] == {"heldOutPercent": 10}
    assert "fleetRef" not in wire
    assert RLRunSpec.model_validate(wire) == spec


def test_task_set_split_is_validation_or_test_on_the_wire() -> None:
    split = Split.model_validate({"taskSetSplit": "test"})
    assert split.task_set_split == "test"
    assert split.to_wire() == {"taskSetSplit": "test"}
    with pytest.raises(ValidationError, match="taskSetSplit"):
        Split.model_validate({"taskSetSplit": "train"})  # training tasks are never held out


def test_exactly_one_forbids_every_pair_and_requires_one() -> None:
    # Cross-field rules live in CEL only (evaluated by the API server and `legorl validate`; see
    # tests/api/test_cel.py and tests/api/test_invalid_manifests.py); this checks the rules generated.
    required, *forbidden = exactly_one("a", "b", "c", hint="why")
    assert (required.rule, required.reason) == (
        "has(self.a) || has(self.b) || has(self.c)",
        "FieldValueRequired",
    )
    assert required.message == "set one of a, b or c: why"
    assert [(r.rule, r.field_path, r.reason) for r in forbidden] == [
        ("!(has(self.a) && has(self.b))", ".b", "FieldValueForbidden"),
        ("!(has(self.a) && has(self.c))", ".c", "FieldValueForbidden"),
        ("!(has(self.b) && has(self.c))", ".c", "FieldValueForbidden"),
    ]
    assert forbidden[1].message == "set only one of a, b or c, not both a and c: why"
    # Two names keep the wording they always had.
    assert exactly_one("a", "b", hint="why")[1].message == "set only one of a or b, not both: why"
    with pytest.raises(ValueError, match="at least two"):
        exactly_one("a", hint="why")


def test_kinds_default_api_version_and_kind() -> None:
    run = RLRun.model_validate(
        {
            "metadata": {"name": "r"},
            "spec": {
                "policy": {"checkpoint": {"uri": "builtin://tiny-moe"}},
                "fleetRef": {"name": "f"},
                "poolRef": {"name": "p"},
                "harness": {"kind": "ClaudeCode"},
                "tasks": {"source": {"uri": "builtin://tiny-python"}},
            },
        }
    )
    wire = run.to_wire()
    assert wire["apiVersion"] == "legorl.dev/v1alpha1"
    assert wire["kind"] == "RLRun"
    assert set(KINDS) == {"RLRun", "SandboxPool", "RolloutFleet"}

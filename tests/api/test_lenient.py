"""The UI reads the custom resources through `legorl.api`'s models, leniently: what an older or newer
operator wrote (unknown fields, a value of another type, a part missing) shows what can be read, never a
failed page."""

from __future__ import annotations

from typing import Any

import pytest

from legorl.api.fleet import RolloutFleetStatus
from legorl.api.lenient import lenient, read_field, reported, status_of
from legorl.api.pool import SandboxPoolStatus
from legorl.api.run import RLRunSpec, RLRunStatus, StopConditions, TrajectoryFilter
from legorl.api.termination import INFRA_REASONS, TerminationReason

STATUS: dict[str, Any] = {
    "observedGeneration": 3,
    "phase": "Running",
    "step": 2,
    "policyVersion": "v2",
    "conditions": [
        {
            "type": "Training",
            "status": "True",
            "reason": "StepInProgress",
            "lastTransitionTime": "2026-12-01T01:05:00Z",
        }
    ],
    "metrics": {"rewardMean": 0.5, "heldOutSolveRate": 0.4},
    "trials": {"total": 12, "running": 2},
    "validation": {
        "requested": "2026-12-01T01:00:00Z",
        "state": "Passed",
        "checks": [{"check": "t", "result": "Passed"}],
    },
}


def test_a_valid_status_reads_whole_and_writes_back_as_it_was() -> None:
    status = lenient(RLRunStatus, STATUS)
    assert status is not None and status.metrics.held_out_solve_rate == 0.4
    assert status.model_dump(mode="json", by_alias=True, exclude_unset=True) == STATUS
    assert reported(status, "step") and not reported(status, "completion_time")


def test_unknown_fields_and_coercible_values_are_read() -> None:
    status = lenient(
        RLRunStatus, {**STATUS, "step": "3", "fromANewerOperator": {"x": 1}, "metrics": {"newFigure": 1}}
    )
    assert status is not None and status.step == 3 and status.metrics.reward_mean is None


def test_a_part_that_does_not_validate_keeps_its_default_and_the_rest_is_read() -> None:
    raw = {
        **STATUS,
        "phase": "Paused",  # a phase this UI does not know
        "metrics": {"rewardMean": "high", "heldOutSolveRate": 0.4},
        "trials": {"total": -1, "running": 2},
        "conditions": [*STATUS["conditions"], {"type": "Ready"}],  # an item without its required fields
        "validation": {"state": "Passed"},  # no `requested`: the canary's record cannot be read
    }
    status = lenient(RLRunStatus, raw)
    assert status is not None
    assert status.phase == "Pending" and status.step == 2 and status.policy_version == "v2"
    assert (status.metrics.reward_mean, status.metrics.held_out_solve_rate) == (None, 0.4)
    assert (status.trials.running, reported(status.trials, "total")) == (2, False)
    assert [c.type for c in status.conditions] == ["Training"]
    assert status.validation is None


@pytest.mark.parametrize("raw", [None, [], "Running", 3])
def test_a_status_that_is_not_an_object_reads_as_the_defaults(raw: object) -> None:
    assert lenient(RLRunStatus, raw) is None
    assert status_of(RolloutFleetStatus, {"status": raw}) == RolloutFleetStatus()
    assert status_of(SandboxPoolStatus, None).model_fields_set == set()


def test_spec_sections_read_on_their_own() -> None:
    """A run store's run.json need not be a whole RLRun: the sections it gives are read, one by one."""
    spec = {"stop": {"maxSteps": 4}, "filter": {"dropReasons": ["cancelled", "engine_error"]}}
    assert lenient(RLRunSpec, spec) is None, "policy, harness and tasks are required"
    stop = read_field(RLRunSpec, spec, "stop")
    assert isinstance(stop, StopConditions) and stop.max_steps == 4
    drop = read_field(RLRunSpec, spec, "filter")
    assert isinstance(drop, TrajectoryFilter)
    assert drop.drop_reasons == [TerminationReason.CANCELLED, TerminationReason.ENGINE_ERROR]
    assert read_field(RLRunSpec, spec, "suspend") is None, "not said: not the default"
    bad = read_field(RLRunSpec, {"filter": {"dropReasons": ["cancelled", "exploded"]}}, "filter")
    assert set(bad.drop_reasons) == INFRA_REASONS and not reported(bad, "drop_reasons")
    assert read_field(RLRunSpec, None, "stop") is None


def test_a_misspelt_field_name_fails_loudly() -> None:
    with pytest.raises(KeyError):
        reported(RLRunStatus(), "policyVersion")

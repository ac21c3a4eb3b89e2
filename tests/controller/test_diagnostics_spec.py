"""SpecFacts read the spec of an RLRun through RLRunSpec: whole when valid, else value by value."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from legorl.api.fleet import FleetTemplate
from legorl.api.lenient import partial
from legorl.api.run import Algorithm, Harness, RLRunSpec
from legorl.diagnostics import SpecFacts

FULL: dict[str, Any] = {
    "policy": {"checkpoint": {"uri": "hf://org/model"}},
    "fleet": {
        "settings": {
            "dtype": "float16",
            "routedExpertsCapture": "Disabled",
            "prefixCaching": "Disabled",
            "toolCallParser": "hermes",
        },
        "weightSync": {"pauseMode": "Wait"},
    },
    "pool": {
        "source": {"images": ["ghcr.io/org/task:1"]},
        "prePull": {"policy": "Lookahead", "lookahead": 4},
        "runtimeClassName": "gvisor",
    },
    "harness": {"kind": "OpenHands", "maxTurns": 40},
    "tasks": {"source": {"uri": "s3://tasks/t.parquet"}},
    "algorithm": {
        "groupSize": 4,
        "tasksPerStep": 8,
        "miniBatches": 2,
        "importanceCorrection": {"mode": "Masked"},
        "sampling": {"temperature": "0.7", "topP": "0.9"},
    },
    "schedule": {"mode": "Async", "maxStalenessSteps": 2},
    "filter": {"dropReasons": ["engine_error"], "zeroVarianceGroups": "Keep"},
    "trainer": {"dtype": "float32", "routingReplay": "Disabled"},
    "stop": {"maxSteps": 10, "maxInfraFailurePercent": 20},
    "fidelity": {"minCorrelation": "0.95", "windowSteps": 5, "action": "Alert"},
}
"""A valid spec that sets every value SpecFacts reads to something other than its default."""

FULL_FACTS = SpecFacts(
    min_correlation=0.95,
    window_steps=5,
    fidelity_action="Alert",
    schedule_mode="Async",
    max_staleness_steps=2,
    group_size=4,
    tasks_per_step=8,
    mini_batches=2,
    importance_mode="Masked",
    temperature=0.7,
    top_p=0.9,
    drop_reasons=["engine_error"],
    zero_variance_groups="Keep",
    max_infra_failure_percent=20,
    harness="OpenHands",
    max_turns=40,
    trainer_dtype="float32",
    routing_replay="Disabled",
    fleet_dtype="float16",
    routed_experts_capture="Disabled",
    prefix_caching="Disabled",
    tool_call_parser="hermes",
    weight_sync_pause_mode="Wait",
    pre_pull_policy="Lookahead",
    runtime_class_name="gvisor",
)
"""What the key-by-key reader gave for FULL before SpecFacts read through RLRunSpec."""


def test_a_valid_full_spec_gives_every_value() -> None:
    RLRunSpec.model_validate(FULL)  # the fixture is a valid spec: read whole, not value by value
    assert SpecFacts.from_run({"spec": FULL}) == FULL_FACTS
    assert FULL_FACTS.staleness_limit == 2


@pytest.mark.parametrize("run", [None, {}, {"spec": None}, {"spec": {}}, {"spec": []}, {"spec": "x"}])
def test_an_absent_spec_gives_the_defaults(run: dict[str, Any] | None) -> None:
    facts = SpecFacts.from_run(run)
    assert facts == SpecFacts()
    # The API's defaults; what a spec leaves to a shared fleet or pool, or to the harness's default, is None.
    assert (facts.group_size, facts.importance_mode) == (Algorithm().group_size, "Truncated")
    unknown = (facts.fleet_dtype, facts.pre_pull_policy, facts.harness, facts.max_turns)
    assert unknown == (None, None, None, None)


@pytest.mark.parametrize(
    ("section", "bad", "defaulted"),
    [
        (
            "algorithm",
            "GRPO",
            ("group_size", "tasks_per_step", "mini_batches", "importance_mode", "temperature", "top_p"),
        ),
        ("schedule", {"mode": "Later", "maxStalenessSteps": 2}, ("schedule_mode",)),
        # Values no reading can make sense of (a lenient reader coerces what it can: see below).
        (
            "fidelity",
            {"minCorrelation": "high", "windowSteps": "five", "action": "Alert"},
            ("min_correlation", "window_steps"),
        ),
        ("filter", {"dropReasons": ["bogus"], "zeroVarianceGroups": "Keep"}, ("drop_reasons",)),
        ("trainer", {"dtype": "int8", "routingReplay": "Disabled"}, ("trainer_dtype",)),
        ("stop", {"maxInfraFailurePercent": 0}, ("max_infra_failure_percent",)),
        ("harness", {"maxTurns": 0}, ("harness", "max_turns")),
    ],
)
def test_a_malformed_value_costs_only_itself(section: str, bad: Any, defaulted: tuple[str, ...]) -> None:
    spec = copy.deepcopy(FULL)
    spec[section] = bad
    facts = SpecFacts.from_run({"spec": spec})
    # The malformed values take their defaults; every other value, in that section and the others, is read.
    assert facts == FULL_FACTS.model_copy(update={name: getattr(SpecFacts(), name) for name in defaulted})


def test_values_the_reader_can_coerce_are_read() -> None:
    """One lenient reader for diagnostics and the UI (`legorl.api.lenient`): a string of digits where the
    API wants an integer says what the user meant (the API server refuses it; diagnostics reads such a spec
    from a file or a store, where nothing checked it). A number where the API wants a decimal string is not
    coerced: the decimal type takes strings only (a float would carry binary noise into the spec)."""
    spec = copy.deepcopy(FULL)
    spec["fidelity"] = {"minCorrelation": "0.95", "windowSteps": "5", "action": "Alert"}
    assert SpecFacts.from_run({"spec": spec}) == FULL_FACTS
    spec["fidelity"]["minCorrelation"] = 0.95
    assert SpecFacts.from_run({"spec": spec}) == FULL_FACTS.model_copy(
        update={"min_correlation": SpecFacts().min_correlation}
    )


def test_a_malformed_nested_value_keeps_its_siblings() -> None:
    spec = copy.deepcopy(FULL)
    spec["algorithm"]["sampling"]["temperature"] = "bogus"
    spec["fleet"]["settings"]["dtype"] = "int4"
    spec["pool"].pop("source")  # required: the pool is invalid, its other settings still count
    facts = SpecFacts.from_run({"spec": spec})
    assert facts == FULL_FACTS.model_copy(update={"temperature": 1.0, "fleet_dtype": "auto"})


def test_a_shared_fleet_or_pool_leaves_their_facts_none() -> None:
    spec = {k: v for k, v in FULL.items() if k not in ("fleet", "pool")}
    facts = SpecFacts.from_run({"spec": {**spec, "fleetRef": {"name": "f"}, "poolRef": {"name": "p"}}})
    inline = (
        "fleet_dtype",
        "routed_experts_capture",
        "prefix_caching",
        "tool_call_parser",
        "weight_sync_pause_mode",
    )
    assert all(getattr(facts, name) is None for name in (*inline, "pre_pull_policy", "runtime_class_name"))
    for value in (None, "f", ["x"]):
        assert SpecFacts.from_run({"spec": {**FULL, "fleet": value}}).fleet_dtype is None


def test_an_inline_fleet_of_defaults_is_an_inline_fleet() -> None:
    # `fleet: {}` asks for a fleet owned by the run with every engine default. The key-by-key reader took the
    # empty object for no fleet and left its facts None, as for a shared fleet whose settings are unknown.
    facts = SpecFacts.from_run({"spec": {**FULL, "fleet": {}, "pool": {"source": {"images": ["t:1"]}}}})
    engine = FleetTemplate().settings
    assert (facts.fleet_dtype, facts.routed_experts_capture, facts.prefix_caching) == (
        engine.dtype,
        engine.routed_experts_capture,
        engine.prefix_caching,
    )
    assert (facts.tool_call_parser, facts.weight_sync_pause_mode, facts.pre_pull_policy) == (
        None,
        "Keep",
        "All",
    )


def test_partial_reads_a_valid_document_as_model_validate_does() -> None:
    assert partial(RLRunSpec, FULL) == RLRunSpec.model_validate(FULL)
    assert partial(RLRunSpec, FULL).model_fields_set == RLRunSpec.model_validate(FULL).model_fields_set


def test_partial_marks_what_it_read() -> None:
    harness = partial(Harness, {"maxTurns": 7, "kind": "Nope", "unknown": 1})
    # Read: maxTurns. Not read: the invalid kind (required, so unset) and the unknown key.
    assert harness.model_fields_set == {"max_turns"}
    assert harness.max_turns == 7 and harness.version is None
    with pytest.raises(AttributeError):
        _ = harness.kind

"""The run controller's progress snapshot (`controller/state.json`): one type, read back as written, and
read without failing from a document another version wrote."""

from __future__ import annotations

import json
from dataclasses import fields

from legorl.api import progress
from legorl.api.progress import Progress


def full() -> Progress:
    return Progress(
        run="r",
        step=3,
        policy_version="v3",
        max_steps=8,
        trials_total=48,
        eval_trials=16,
        trials_running=4,
        trials_dropped=2,
        zero_variance_groups=1,
        by_reason={"completed": 40, "agent_error": 8},
        reward_mean=0.25,
        held_out_solve_rate=0.5,
        held_out_interval=(0.3, 0.7),
        baseline_solve_rate=0.4,
        fidelity_correlation=0.999,
        max_abs_logprob_delta=0.01,
        tokens_per_second=120.5,
        trials_per_minute=3.1,
        eta_seconds=600.0,
        elapsed_seconds=90.0,
        phase_seconds={"agent": 30.0, "wait_trainer": 4.5},
        fidelity_below_steps=1,
        fidelity_guard_after=2,
        degraded_reason="FidelityBelowThreshold",
        degraded_message="low",
        message="step 3 of 8",
    )


def test_every_field_has_a_decoder() -> None:
    assert {str(f.type) for f in fields(Progress)} - {"str"} <= set(progress._DECODE)


def test_a_snapshot_reads_back_as_written() -> None:
    snapshot = full()
    assert Progress.from_json(json.loads(json.dumps(snapshot.to_json()))) == snapshot
    assert Progress.from_json(Progress(run="r").to_json()) == Progress(run="r")


def test_a_document_from_another_version_is_read_without_failing() -> None:
    data = full().to_json()
    data.update({"step": "7", "new_field": {"x": 1}, "reward_mean": "not a number", "held_out_interval": [1]})
    del data["message"]
    read = Progress.from_json(data, run="ignored")
    assert read.step == 7 and read.run == "r" and read.message == ""
    assert read.reward_mean is None and read.held_out_interval is None  # unusable values: the defaults
    assert Progress.from_json(None, run="named").run == "named"

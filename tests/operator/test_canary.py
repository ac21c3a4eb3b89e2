"""The canary's verdicts from a trial record and the trainer's scoring (the whole canary, with vLLM, a
sandboxed harness and megatron-core, runs in tests/e2e/test_embedded_run.py; the operator's, against the API
mock, in tests/operator/test_operator_controller.py)."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import torch

from legorl.api.kinds import RLRun
from legorl.api.store import RunStore
from legorl.api.termination import TerminationReason
from legorl.api.trajectory import Segment, TrialRecord
from legorl.controller.canary import (
    VALIDATION_OBJECT,
    CanaryCheck,
    CanaryReport,
    parity_checks,
    preflight_check,
    trial_check,
    write_report,
)
from legorl.embedded.runner import load_run
from legorl.trainer.train import ScoredBatch

EXAMPLE = Path(__file__).parents[2] / "examples" / "tiny-local.yaml"
NOW = datetime(2026, 12, 1, tzinfo=UTC)


def record(
    reason: TerminationReason = TerminationReason.COMPLETED, reward: float | None = 0.0
) -> TrialRecord:
    segment = Segment(
        index=0,
        token_ids=[1, 2, 3, 4],
        loss_mask=[0, 1, 1, 1],
        behavior_logprobs=[0.0, -0.1, -2.0, -0.7],
        turn_indices=[0],
        policy_versions=["v0"],
    )
    return TrialRecord(
        run="tiny-local",
        trial="canary-t0-r0",
        task_id="tiny-python__intervals-001",
        group_id="canary-t0",
        split="train",
        step=0,
        harness="MiniSweAgent",
        termination_reason=reason,
        reward=reward,
        started_at=NOW,
        ended_at=NOW,
        segments=[segment],
        num_turns=2,
        stage_seconds={"agent": 20.0, "verify": 3.0},
        error="proxy: engine answered 503" if reason is TerminationReason.ENGINE_ERROR else None,
    )


def scored(
    train: list[float], behavior: list[float], replayed: bool = False, agreeing: int = 0, compared: int = 0
) -> dict[str, float]:
    """The trainer's figures, as `ScoredBatch.fidelity()` computes them."""
    t = torch.tensor(train)
    replays = torch.full_like(t, replayed, dtype=torch.bool)
    return ScoredBatch(t, torch.tensor(behavior), replays, agreeing, compared).fidelity()


def run() -> RLRun:
    return load_run(str(EXAMPLE))


def test_a_failed_task_passes_a_broken_trial_fails() -> None:
    assert trial_check(record(reward=0.0), 30).result == "Passed"
    broken = trial_check(record(TerminationReason.ENGINE_ERROR, None), 30)
    assert broken.result == "Failed" and "engine_error" in broken.message and "503" in broken.message
    unscored = trial_check(record(reward=None), 30)
    assert unscored.result == "Failed" and "verifier" in unscored.message
    assert trial_check(None, 420).result == "Failed"


def test_token_parity_fails_below_the_guard_and_routing_never_passes_silently() -> None:
    behavior = [-0.1, -2.0, -0.7, -1.2]
    token, routing = parity_checks(record(), scored(behavior, behavior), run())
    assert token.result == "Passed" and token.figures["pearson"] > 0.9999
    assert routing.result == "Warning" and "no routed experts" in routing.message
    token, _ = parity_checks(record(), scored([-1.5, -0.2, -0.1, -3.0], behavior), run())
    assert token.result == "Failed" and "below fidelity.minCorrelation 0.99" in token.message
    routed = record()
    routed = dataclasses.replace(
        routed,
        segments=[dataclasses.replace(routed.segments[0], routed_experts=np.zeros((3, 1, 2), np.uint8))],
    )
    _, routing = parity_checks(routed, scored(behavior, behavior, replayed=False), run())
    assert routing.result == "Failed" and "0.0%" in routing.message
    # Replayed, and the engine's experts are the trainer router's own choice.
    _, routing = parity_checks(routed, scored(behavior, behavior, True, 6, 6), run())
    assert routing.result == "Passed" and routing.figures["routing_agreement"] == 1.0
    # Replayed, but what was replayed is not what these weights route to (tests/trainer/test_trainer_replay.py
    # measures it on a real model with a wrong routing row).
    _, routing = parity_checks(routed, scored(behavior, behavior, True, 3, 6), run())
    assert routing.result == "Failed" and "50.00% of 6 (token, MoE layer) pairs" in routing.message
    _, routing = parity_checks(routed, scored(behavior, behavior, True, 95, 100), run())
    assert routing.result == "Warning" and "near-ties" in routing.message
    # Replay reached every token but nobody compared the experts: unmeasured is no pass.
    _, routing = parity_checks(routed, scored(behavior, behavior, replayed=True), run())
    assert routing.result == "Warning" and "unmeasured" in routing.message


def test_parity_is_not_judged_across_a_weight_sync() -> None:
    """The operator's canary is scored by the running trainer: when it moved on to another version
    between the trial and the scoring, the figures compare two policies and prove nothing either way."""
    behavior = [-0.1, -2.0, -0.7, -1.2]
    same = parity_checks(record(), {**scored(behavior, behavior), "policy_version": "v0"}, run())
    assert same[0].result == "Passed"
    token, routing = parity_checks(record(), {**scored(behavior, behavior), "policy_version": "v3"}, run())
    assert token.result == routing.result == "Warning"
    assert "trainer holds v3" in token.message and "sampled by v0" in token.message
    # Figures from JSON: NaN arrives as null, and a missing figure is no pass.
    token, _ = parity_checks(record(), {"tokens": 3, "pearson": None}, run())
    assert token.result == "Failed"


def test_preflight_and_the_stored_report(tmp_path: Path) -> None:
    assert preflight_check(run()).result == "Passed"
    body = run().to_wire()
    body["spec"]["fleet"]["settings"]["dtype"] = "bfloat16"  # the trainer stays float32
    mismatch = preflight_check(RLRun.model_validate(body))
    assert mismatch.result in ("Warning", "Failed") and "dtype" in mismatch.message
    report = CanaryReport(
        run="tiny-local",
        time="2026-12-01T00:00:00+00:00",
        seconds=95.0,
        checks=[
            CanaryCheck("preflight", "Passed", "ok"),
            CanaryCheck("routing-parity", "Warning", "no routing"),
        ],
    )
    assert report.result == "Warning" and "routing-parity  Warning" in report.text()
    store = RunStore(str(tmp_path))
    write_report(store, report)
    saved = (tmp_path / VALIDATION_OBJECT).read_text()
    assert '"result": "Warning"' in saved
    nan = CanaryReport("r", "t", 1.0, [CanaryCheck("token-parity", "Failed", "x", {"pearson": float("nan")})])
    write_report(store, nan)  # NaN is not JSON: stored as null
    stored = store.read_validation()
    assert stored is not None and stored["checks"][0]["figures"]["pearson"] is None

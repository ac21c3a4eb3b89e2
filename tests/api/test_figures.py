"""The run-progress documents (`legorl.api.figures`): one encoder and one decoder, compatible with what
earlier writers put in a run store."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from legorl.api.figures import (
    BatchSummary,
    EvalSummary,
    FiguresError,
    ScoringAnswer,
    StepFigures,
    TrainerState,
)
from legorl.api.store import RunStore


def test_step_figures_round_trip_through_the_store(tmp_path: Path) -> None:
    store = RunStore(str(tmp_path))
    figures = StepFigures(
        step=3,
        loss=0.25,
        fidelity_pearson=0.999,
        entropy=math.nan,
        kl_ref=None,
        dropped_by_reason={"infra_error": 2},
        skipped=None,
    )
    store.write_step_figures(figures)
    on_disk = json.loads((tmp_path / "metrics/trainer/step-000003.json").read_text())
    # Only the figures that were set, flat, NaN as null (as the trainer always wrote them).
    assert on_disk == {
        "step": 3,
        "loss": 0.25,
        "fidelity_pearson": 0.999,
        "entropy": None,
        "kl_ref": None,
        "dropped_by_reason.infra_error": 2,
        "skipped": None,
    }
    (back,) = store.step_figures()
    assert back.fidelity_pearson == 0.999 and back.dropped_by_reason == {"infra_error": 2}
    assert back.entropy is None and back.grad_norm is None
    assert back.to_json() == on_disk


def test_step_figures_keep_what_a_newer_trainer_added(tmp_path: Path) -> None:
    store = RunStore(str(tmp_path))
    store.write_metrics(1, {"loss": 0.5, "new_figure": 7})  # as an older or newer writer left it
    (figures,) = store.step_figures()
    assert figures.loss == 0.5 and figures.model_extra == {"new_figure": 7}
    assert figures.to_json() == {"step": 1, "loss": 0.5, "new_figure": 7}


def test_malformed_documents_name_the_bad_field() -> None:
    with pytest.raises(FiguresError, match=r"StepFigures is malformed: fidelity_pearson"):
        StepFigures.from_json({"step": 1, "fidelity_pearson": "high"})
    with pytest.raises(FiguresError, match=r"EvalSummary is malformed: interval95"):
        EvalSummary.from_json({"step": 1, "interval95": [0.1]})
    with pytest.raises(FiguresError, match=r"TrainerState is malformed: step"):
        TrainerState.from_json({"step": "three"})
    with pytest.raises(FiguresError, match=r"must be a JSON object"):
        ScoringAnswer.from_json([1, 2])  # type: ignore[arg-type]


def test_a_store_written_before_the_types_still_reads(tmp_path: Path) -> None:
    store = RunStore(str(tmp_path))
    old_eval = {
        "policy_version": "v2",
        "trials": 4,
        "scored": 3,
        "solved": 1,
        "solve_rate": 1 / 3,
        "interval95": [0.06, 0.79],
        "infra_failures": 1,
        "by_reason": {"completed": 3, "sandbox_error": 1},
        "per_task": {"t1": 0.5},
    }
    store.write_eval(2, old_eval)
    (summary,) = store.eval_summaries()
    assert summary.step == 2 and summary.interval95 == (0.06, 0.79) and summary.solved == 1
    assert summary.to_json() == {"step": 2, **old_eval}
    state = {"step": 2, "policy_version": "v2", "checkpoint": None, "updated": 1.5}
    store.write_trainer_state(state)
    typed = store.trainer_state()
    assert typed == TrainerState(**state)
    store.write_trainer_state(typed)
    assert store.read_trainer_state() == state
    store.answer_scoring("c1", {"policy_version": "v2", "error": "boom", "seconds": 0.1})
    answer = store.scoring_answer("c1")
    assert answer is not None and answer.error == "boom" and answer.pearson is None


def test_gauges_and_curves_come_from_the_fields() -> None:
    gauges = StepFigures.gauges()
    assert gauges["fidelity_pearson"] == "Pearson correlation of rollout vs. training token probabilities."
    assert "checkpoint" not in gauges and "step" not in gauges
    curves = StepFigures.curves()
    assert curves[0] == ("reward_mean", "Reward (trained-on trials)", "reward")
    assert {name for name, _, _ in curves} <= set(StepFigures.model_fields)


def test_validation_report_round_trip(tmp_path: Path) -> None:
    store = RunStore(str(tmp_path))
    assert store.validation_report() is None
    body = {
        "run": "r1",
        "time": "2026-01-01T00:00:00+00:00",
        "seconds": 12.5,
        "checks": [{"check": "trial", "result": "Passed", "message": "ok", "figures": {"reward": None}}],
        "trial": "t-1",
        "result": "Passed",
    }
    store.write_validation(body)
    report = store.validation_report()
    assert report is not None and report.checks[0].figures == {"reward": None}
    store.write_validation(report)
    assert store.read_validation() == body
    store.write_validation({**body, "checks": [{"check": "trial", "result": "Fine", "message": "?"}]})
    with pytest.raises(FiguresError, match=r"checks\.0\.result"):
        store.validation_report()


def test_a_batch_summary_reads_what_the_controller_committed_and_names_a_bad_field() -> None:
    # The controller's COMMIT.json meta as it was written before the type: same keys, same order.
    meta = {
        "trials": 8,
        "infra_failures": 1,
        "kept": 6,
        "zero_variance_groups": 1,
        "groups": 2,
        "reward_mean": 0.5,
        "policy_versions_seen": ["v0", "v1"],
        "by_reason": {"completed": 7, "sandbox_error": 1},
    }
    summary = BatchSummary.from_json(meta)
    assert summary.kept == 6 and summary.zero_variance_groups == 1 and summary.reward_mean == 0.5
    assert json.dumps(summary.to_json()) == json.dumps(meta)
    # Another writer's meta (a test, a tool): its keys are kept, the counts unknown.
    other = BatchSummary.from_json({"note": "hand-made"})
    assert other.groups is None and other.to_json() == {"note": "hand-made"}
    with pytest.raises(FiguresError, match=r"BatchSummary is malformed: groups"):
        BatchSummary.from_json({"groups": "two"})

"""Dropping zero-variance groups (`filter.zeroVarianceGroups: Drop`) saves their compute and leaves the update
as keeping them would make it.

A flat group's advantages are all 0: it adds no gradient, only size, and a batch's size is what the loss is
normalised by. Normalised over the kept groups alone (the trainer before this test), a batch in which one
group of three had reward spread took a step three times as large as with `Keep` — as large as a batch of
three informative groups, on a quarter of the answers. TRL's GRPOTrainer counts flat groups in its
normaliser; at lr 3e-4 the old one collapsed the tiny policy's tool calls where TRL's did not
(benchmarks/learning_vs_trl.py). Real megatron-core on CPU, the tiny MoE.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from legorl.api.trajectory import TrialRecord
from legorl.trainer.models.tiny import make_tiny_model
from legorl.trainer.settings import TrainerSettings

# Two real trainer steps of the tiny MoE.
pytestmark = pytest.mark.slow

PROMPTS = [[11, 42, 7, 300], [5, 900, 17], [1200, 8, 64, 33, 2]]
REWARDS = [1.0, 0.0, 0.0, 0.0] + [0.0] * 4 + [1.0] * 4
"""Groups of four: spread, all failed, all solved."""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-moe"))


def _trials(trainer: object) -> list[TrialRecord]:
    from legorl.trainer.sampling import sample, to_trial  # noqa: PLC0415

    samples = sample(
        trainer.model,  # type: ignore[attr-defined]
        trainer.arch,  # type: ignore[attr-defined]
        [p for p in PROMPTS for _ in range(4)],
        max_new_tokens=8,
        generator=torch.Generator().manual_seed(3),
    )
    return [
        to_trial(s, run="zv", trial=f"t{i}", group_id=f"g{i // 4}", reward=r, step=1, policy_version="v0")
        for i, (s, r) in enumerate(zip(samples, REWARDS, strict=True))
    ]


@pytest.mark.parametrize("aggregation", ["TokenMean", "SequenceMeanTokenMean"])
def test_dropping_flat_groups_leaves_the_update_as_keeping_them(
    tiny: Path, tmp_path: Path, aggregation: str
) -> None:
    from legorl.trainer.train import PolicyTrainer  # noqa: PLC0415

    figures = {}
    for mode in ("Keep", "Drop"):
        settings = TrainerSettings(
            run="zv",
            store_uri=str(tmp_path / mode),
            checkpoint_dir=tiny,
            device="cpu",
            learning_rate=1e-3,
            loss_aggregation=aggregation,
            drop_zero_variance_groups=mode == "Drop",
            seed=0,
        )
        trainer = PolicyTrainer(settings)
        figures[mode] = trainer.train_step(_trials(trainer), step=1)
    keep, drop = figures["Keep"], figures["Drop"]
    assert (keep.trials_kept, drop.trials_kept, drop.zero_variance_groups) == (12, 4, 2)
    # The same loss and gradient (before clipping), computed on a third of the answers.
    assert drop.grad_norm == pytest.approx(keep.grad_norm, rel=1e-4), (drop.grad_norm, keep.grad_norm)
    assert drop.loss == pytest.approx(keep.loss, rel=1e-4, abs=1e-7)
    assert (drop.loss_tokens or 0) < (keep.loss_tokens or 0)

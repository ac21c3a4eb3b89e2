"""The fidelity figures compare one policy with itself: in async mode a batch mixes trials sampled by
the version being trained with staler ones, and only the former may enter the correlation (the stale
ones differ by the updates in between — staleness, which the importance weights handle — and would make
the fidelity guard pause a healthy async run). Real megatron-core on CPU; rollouts from the reference
sampler on the same model (the same numerics, so on-policy tokens agree to ~1e-6)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from legorl.api.trajectory import TrialRecord
from legorl.trainer.models.tiny import make_tiny_model
from legorl.trainer.settings import TrainerSettings

# A real trainer step of the tiny MoE.
pytestmark = pytest.mark.slow

PROMPTS = [[11, 42, 7, 300], [5, 900, 17], [1200, 8, 64, 33, 2]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-moe"))


def _trials(
    trainer: object, version: str, tag: str, corrupt: bool, *, flat: bool = False
) -> list[TrialRecord]:
    """Two trials per prompt (a group each), rewards 0 and 1 per group; `flat`: every reward 0 (every group
    has zero variance)."""
    from legorl.trainer.sampling import sample, to_trial  # noqa: PLC0415

    prompts = [p for p in PROMPTS for _ in range(2)]
    samples = sample(
        trainer.model,  # type: ignore[attr-defined]
        trainer.arch,  # type: ignore[attr-defined]
        prompts,
        max_new_tokens=8,
        generator=torch.Generator().manual_seed(7),
    )
    out = []
    for i, s in enumerate(samples):
        trial = to_trial(
            s,
            run="fid",
            trial=f"{tag}-{i}",
            group_id=f"{tag}-g{i // 2}",
            reward=0.0 if flat else float(i % 2),
            step=2,
            policy_version=version,
        )
        if corrupt:  # what an older policy's probabilities look like to the current one: different
            segs = [
                dataclasses.replace(
                    seg,
                    behavior_logprobs=[
                        lp * 3.0 - 1.0 if m else lp
                        for lp, m in zip(seg.behavior_logprobs, seg.loss_mask, strict=True)
                    ],
                )
                for seg in trial.segments
            ]
            trial = dataclasses.replace(trial, segments=segs)
        out.append(trial)
    return out


def test_stale_trials_train_but_stay_out_of_the_fidelity_figures(tiny: Path, tmp_path: Path) -> None:
    from legorl.trainer.train import PolicyTrainer  # noqa: PLC0415

    settings = TrainerSettings(
        run="fid", store_uri=str(tmp_path), checkpoint_dir=tiny, device="cpu", max_staleness=1, seed=0
    )
    trainer = PolicyTrainer(settings)
    fresh = _trials(trainer, "v1", "fresh", corrupt=False)  # step 2 trains v1: these are on-policy
    stale = _trials(trainer, "v0", "stale", corrupt=True)
    fresh_tokens = sum(sum(seg.loss_mask) for t in fresh for seg in t.segments)
    figures = trainer.train_step(fresh + stale, step=2)
    assert figures.trials_kept == 12, figures  # the stale ones are within the limit: trained on
    assert figures.fidelity_tokens == fresh_tokens
    assert (figures.fidelity_pearson or 0.0) > 0.9999, figures
    assert (figures.loss_tokens or 0) > fresh_tokens
    assert figures.fidelity_probe_trials is None  # trained fresh tokens: nothing probed

    # Control: the same stale trials alone leave no evidence (NaN), never a low correlation ...
    alone = PolicyTrainer(settings).train_step(stale, step=2)
    assert alone.fidelity_tokens == 0
    assert alone.fidelity_pearson is not None and math.isnan(alone.fidelity_pearson)
    # ... and, if they were counted as on-policy, they would read as a fidelity failure.
    relabelled = [
        dataclasses.replace(t, segments=[dataclasses.replace(s, policy_versions=["v1"]) for s in t.segments])
        for t in stale
    ]
    counted = PolicyTrainer(settings).train_step(relabelled, step=2)
    assert counted.fidelity_pearson is not None and counted.fidelity_pearson < 0.99, counted


def test_fresh_trials_of_zero_variance_groups_keep_the_fidelity_guard_seeing(
    tiny: Path, tmp_path: Path
) -> None:
    """The trained tokens hold none sampled by the version being trained (its groups all got one reward,
    the rest of the batch is stale): the fresh trials of the zero-variance groups are measured, without
    entering the loss. Before, the step's fidelity was NaN over 0 tokens (the node run's step 2, CI)."""
    from legorl.trainer.train import PolicyTrainer  # noqa: PLC0415

    settings = TrainerSettings(
        run="fid", store_uri=str(tmp_path), checkpoint_dir=tiny, device="cpu", max_staleness=1, seed=0
    )
    trainer = PolicyTrainer(settings)
    flat = _trials(trainer, "v1", "flat", corrupt=False, flat=True)
    stale = _trials(trainer, "v0", "stale", corrupt=True)
    flat_tokens = sum(sum(seg.loss_mask) for t in flat for seg in t.segments)
    stale_tokens = sum(sum(seg.loss_mask) for t in stale for seg in t.segments)
    figures = trainer.train_step(flat + stale, step=2)
    assert (figures.trials_kept, figures.zero_variance_groups) == (6, 3), figures
    assert figures.loss_tokens == stale_tokens  # the probed trials are not trained on
    assert figures.fidelity_tokens == flat_tokens, figures
    assert figures.fidelity_probe_trials == 6
    assert (figures.fidelity_pearson or 0.0) > 0.9999, figures

    # Nothing left to train on at all: the step is skipped, its fidelity still measured, no weight moved.
    skipped_trainer = PolicyTrainer(settings)
    before = {k: v.clone() for k, v in skipped_trainer.model.state_dict().items() if torch.is_tensor(v)}
    skipped = skipped_trainer.train_step(flat, step=2)
    assert skipped.skipped == "no trials left after filtering", skipped
    assert skipped.fidelity_tokens == flat_tokens, skipped
    assert skipped.fidelity_probe_trials == 6
    assert (skipped.fidelity_pearson or 0.0) > 0.9999, skipped
    after = skipped_trainer.model.state_dict()
    assert all(torch.equal(v, after[k]) for k, v in before.items())
    # What the probe guards against: the same fresh trials with another policy's probabilities read low.
    wrong = _trials(trainer, "v1", "wrong", corrupt=True, flat=True)
    low = PolicyTrainer(settings).train_step(wrong, step=2)
    assert low.fidelity_pearson is not None and low.fidelity_pearson < 0.99, low

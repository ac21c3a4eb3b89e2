"""Learning sanity: a few GRPO steps on a toy reward raise it; with the advantage sign flipped they lower it.

Real megatron-core on CPU, the real `PolicyTrainer.train_step` (filter → group advantages → packing →
replayed recompute → clipped, importance-corrected loss → AdamW). Rollouts come from the reference sampler
on the same Megatron model (vLLM's CPU build cannot record expert routing), with routing recorded so the
steps train with replay on, as on a GPU fleet. The toy reward is the share of completion tokens whose id is
even: about half of them at the start, so every group has reward variance from the first step.
To flip the advantage sign the trials carry −reward: group normalisation is linear, so every advantage
changes sign and nothing else does.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from legorl.trainer.models.tiny import make_tiny_model
from legorl.trainer.settings import TrainerSettings

pytestmark = [pytest.mark.slow]

PROMPTS = [
    [11, 42, 7, 300],
    [5, 900, 17],
    [1200, 8, 64, 33, 2],
    [77, 1500, 12],
    [3000, 4, 250],
    [640, 19, 2048, 5],
]
GROUP = 8
NEW_TOKENS = 12
STEPS = 8


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-moe"))


def toy_reward(tokens: list[int]) -> float:
    return float(np.mean([t % 2 == 0 for t in tokens]))


def train(tiny: Path, tmp_path: Path, *, sign: float, seed: int = 1234) -> list[float]:
    """Mean toy reward of each step's rollouts (STEPS + 1 values: before and after every update)."""
    from legorl.trainer.sampling import sample, to_trial  # noqa: PLC0415
    from legorl.trainer.train import PolicyTrainer  # noqa: PLC0415

    settings = TrainerSettings(
        run="toy",
        store_uri=str(tmp_path / "store"),
        checkpoint_dir=tiny,
        learning_rate=1e-2,
        routing_replay="Enabled",
        device="cpu",
        max_tokens_per_micro_batch=256,
        seed=0,
    )
    trainer = PolicyTrainer(settings)
    generator = torch.Generator().manual_seed(seed)
    means = []
    for step in range(1, STEPS + 2):
        prompts = [p for p in PROMPTS for _ in range(GROUP)]
        samples = sample(
            trainer.model,
            trainer.arch,
            prompts,
            max_new_tokens=NEW_TOKENS,
            generator=generator,
            record_routing=True,
        )
        rewards = [toy_reward(s.token_ids[s.prompt_length :]) for s in samples]
        means.append(float(np.mean(rewards)))
        if step == STEPS + 1:
            break
        trials = [
            to_trial(
                s,
                run="toy",
                trial=f"s{step}-t{i}",
                group_id=f"s{step}-g{i // GROUP}",
                reward=sign * r,
                step=step,
                policy_version=f"v{step - 1}",
            )
            for i, (s, r) in enumerate(zip(samples, rewards, strict=True))
        ]
        figures = trainer.train_step(trials, step=step)
        assert figures.skipped is None, figures
        # Rollout and recompute are the same model and numerics, and routing is replayed: they agree.
        assert figures.replayed_token_share == 1.0
        assert (figures.fidelity_pearson or 0.0) > 0.9999, figures
    return means


# Each step's mean is over 48 × 12 sampled tokens (std ≈ 0.02), so the checks compare the last three steps
# with the first two, averaged over two sampling seeds. CPU runs are deterministic for a seed; over seeds 1–4
# and 1234 the GRPO change was +0.03 to +0.18 and the flipped one −0.08 to −0.12 (seeds 1234 and 2 here:
# +0.13/+0.18 and −0.11/−0.10), so one unlucky float path cannot decide the outcome.
SEEDS = (1234, 2)


def change(tiny: Path, tmp_path: Path, *, sign: float) -> tuple[float, list[list[float]]]:
    runs = [train(tiny, tmp_path / str(seed), sign=sign, seed=seed) for seed in SEEDS]
    deltas = [float(np.mean(m[-3:]) - np.mean(m[:2])) for m in runs]
    return float(np.mean(deltas)), runs


def test_grpo_raises_the_toy_reward(tiny: Path, tmp_path: Path) -> None:
    delta, runs = change(tiny, tmp_path, sign=1.0)
    print("toy reward per step (GRPO):", [[round(m, 3) for m in r] for r in runs], f"change {delta:+.3f}")
    assert delta > 0.05, runs


def test_flipped_advantage_lowers_the_toy_reward(tiny: Path, tmp_path: Path) -> None:
    delta, runs = change(tiny, tmp_path, sign=-1.0)
    print("toy reward per step (flipped):", [[round(m, 3) for m in r] for r in runs], f"change {delta:+.3f}")
    assert delta < -0.05, runs

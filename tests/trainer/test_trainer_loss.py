"""The trainer's loss functions (advantages, IS weights, PPO/GRPO/GSPO, KL, fidelity) by hand and autograd."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from legorl.trainer.loss import (
    Aggregation,
    aggregate,
    default_clip,
    fidelity_stats,
    group_advantages,
    importance_weights,
    kl_penalty,
    masked_mean,
    policy_loss,
)

# --- advantages --------------------------------------------------------------------------------


def test_group_mean_std_by_hand() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.7])
    groups = ["a", "a", "a", "a", "b", "b", "c"]
    adv = group_advantages(rewards, groups, "GroupMeanStd", eps=0.0)
    # Group a: mean 0.5, sample std sqrt((4 · 0.25) / 3) = sqrt(1/3).
    s = math.sqrt(1 / 3)
    expected = [0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s, 0.0, 0.0, 0.0]
    assert adv.tolist() == pytest.approx(expected, abs=1e-6)


def test_group_mean_std_with_eps_and_zero_std_and_group_of_one() -> None:
    rewards = torch.tensor([3.0, 1.0, 2.0, 2.0, 5.0])
    adv = group_advantages(rewards, ["x", "x", "y", "y", "z"], "GroupMeanStd")
    # Group x: mean 2, sample std sqrt(2): (±1)/(sqrt(2)+1e-6). y: zero std → 0. z: group of one → 0.
    d = math.sqrt(2) + 1e-6
    assert adv.tolist() == pytest.approx([1 / d, -1 / d, 0.0, 0.0, 0.0], abs=1e-7)
    assert torch.isfinite(adv).all()


def test_group_mean_does_not_divide() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 4.0])
    adv = group_advantages(rewards, ["a", "a", "a", "a", "b"], "GroupMean")
    assert adv.tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25, 0.0])


def test_group_order_does_not_matter() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.3, 0.9, 0.2])
    groups = ["g1", "g2", "g1", "g2", "g1"]
    adv = group_advantages(rewards, groups, "GroupMeanStd")
    perm = [4, 2, 0, 3, 1]
    adv_perm = group_advantages(rewards[perm], [groups[i] for i in perm], "GroupMeanStd")
    assert adv_perm.tolist() == pytest.approx(adv[perm].tolist())


def test_group_advantages_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="group ids"):
        group_advantages(torch.tensor([1.0, 2.0]), ["a"], "GroupMean")
    with pytest.raises(ValueError, match="finite"):
        group_advantages(torch.tensor([1.0, math.nan]), ["a", "a"], "GroupMean")
    with pytest.raises(ValueError, match="advantage mode"):
        group_advantages(torch.tensor([1.0]), ["a"], "Mean")  # type: ignore[arg-type]


# --- importance weights -----------------------------------------------------------------------


def _ratio_logps(ratios: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    behavior = torch.full((len(ratios), len(ratios[0])), -1.0)
    return behavior + torch.log(torch.tensor(ratios)), behavior


def test_truncated_weights_and_ess_by_hand() -> None:
    train, behavior = _ratio_logps([[0.5, 1.0, 3.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    w, stats = importance_weights(train, behavior, mask, mode="Truncated", cap=2.0)
    assert w[0].tolist() == pytest.approx([0.5, 1.0, 2.0, 0.0])
    # ESS = (0.5+1+2)^2 / (3 · (0.25+1+4)) = 12.25 / 15.75
    assert float(stats["ess"]) == pytest.approx(12.25 / 15.75)
    assert float(stats["capped_fraction"]) == pytest.approx(1 / 3)
    assert float(stats["ratio_max"]) == pytest.approx(3.0)
    assert float(stats["ratio_min"]) == pytest.approx(0.5)
    assert float(stats["ratio_mean"]) == pytest.approx(1.5)
    assert int(stats["tokens"]) == 3


def test_masked_weights_drop_tokens_above_cap() -> None:
    train, behavior = _ratio_logps([[0.25, 1.0, 3.0, 1.5]])
    mask = torch.ones(1, 4)
    w, stats = importance_weights(train, behavior, mask, mode="Masked", cap=2.0)
    assert w[0].tolist() == pytest.approx([0.25, 1.0, 0.0, 1.5])
    assert float(stats["capped_fraction"]) == pytest.approx(0.25)
    # ESS over the 4 trained tokens, the masked one included with weight 0.
    sw, sw2 = 0.25 + 1 + 1.5, 0.0625 + 1 + 2.25
    assert float(stats["ess"]) == pytest.approx(sw * sw / (4 * sw2))
    w_low, stats_low = importance_weights(train, behavior, mask, mode="Masked", cap=2.0, mask_below=True)
    assert w_low[0].tolist() == pytest.approx([0.0, 1.0, 0.0, 1.5])
    assert float(stats_low["capped_fraction"]) == pytest.approx(0.5)


def test_disabled_weights_are_one_on_the_mask_and_ess_bounds() -> None:
    train, behavior = _ratio_logps([[0.5, 4.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    w, stats = importance_weights(train, behavior, mask, mode="Disabled", cap=2.0)
    assert w.tolist() == [[1.0, 1.0, 0.0]]
    assert float(stats["ess"]) == pytest.approx(1.0)
    assert float(stats["capped_fraction"]) == 0.0
    # Ratios are still reported, for the dashboard.
    assert float(stats["ratio_max"]) == pytest.approx(4.0)
    # All weights masked away → ESS 0; no trained token → NaN, no crash.
    train2, behavior2 = _ratio_logps([[5.0, 6.0]])
    _, zero = importance_weights(train2, behavior2, torch.ones(1, 2), mode="Masked", cap=2.0)
    assert float(zero["ess"]) == 0.0
    _, empty = importance_weights(train2, behavior2, torch.zeros(1, 2), mode="Truncated", cap=2.0)
    assert math.isnan(float(empty["ess"]))


def test_importance_weights_are_detached_and_ignore_padding_garbage() -> None:
    train = torch.tensor([[-1.0, -2.0, math.inf]], requires_grad=True)
    behavior = torch.tensor([[-1.0, -1.0, -math.inf]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    w, stats = importance_weights(train, behavior, mask, mode="Truncated", cap=2.0)
    assert not w.requires_grad
    assert torch.isfinite(w).all()
    assert w[0].tolist() == pytest.approx([1.0, math.exp(-1.0), 0.0])
    assert all(bool(torch.isfinite(v)) for v in stats.values())
    with pytest.raises(ValueError, match="cap"):
        importance_weights(train, behavior, mask, mode="Truncated", cap=0.5)


# --- aggregation -------------------------------------------------------------------------------


def test_aggregation_modes_on_unequal_lengths() -> None:
    values = torch.tensor([[1.0, 1.0, 1.0, 1.0], [5.0, 0.0, 0.0, 0.0], [7.0, 7.0, 7.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    # 5 tokens: (4 + 5) / 5; per-sequence means 1 and 5 → 3; sums 4 and 5 → 4.5. Row 3 has no token.
    assert float(aggregate(values, mask, "TokenMean")) == pytest.approx(9 / 5)
    assert float(aggregate(values, mask, "SequenceMeanTokenMean")) == pytest.approx(3.0)
    assert float(aggregate(values, mask, "SequenceMeanTokenSum")) == pytest.approx(4.5)
    assert float(aggregate(values, mask, "TokenMean", normalizer=10)) == pytest.approx(0.9)
    assert float(aggregate(values, mask, "SequenceMeanTokenSum", normalizer=4)) == pytest.approx(9 / 4)
    assert float(masked_mean(values, mask)) == pytest.approx(9 / 5)
    assert masked_mean(values, mask, dim=-1).tolist() == pytest.approx([1.0, 5.0, 0.0])
    with pytest.raises(ValueError, match="aggregation"):
        aggregate(values, mask, "Mean")  # type: ignore[arg-type]


def test_normalizer_makes_micro_batches_add_up() -> None:
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(6, 5, generator=gen)
    mask = (torch.rand(6, 5, generator=gen) > 0.3).float()
    mask[:, 0] = 1.0
    cases: list[tuple[Aggregation, float]] = [
        ("TokenMean", float(mask.sum())),
        ("SequenceMeanTokenMean", 6.0),
    ]
    for mode, norm in cases:
        whole = aggregate(values, mask, mode)
        parts = [aggregate(values[i : i + 2], mask[i : i + 2], mode, normalizer=norm) for i in range(0, 6, 2)]
        assert float(torch.stack(parts).sum()) == pytest.approx(float(whole), abs=1e-6)


# --- PPO / GRPO -------------------------------------------------------------------------------


def _grad_of(ratio: float, advantage: float, algorithm: str = "GRPO") -> float:
    old = torch.tensor([[-1.0]])
    logp = (old + math.log(ratio)).clone().requires_grad_(True)
    loss, _ = policy_loss(
        logp,
        old,
        torch.tensor([[advantage]]),
        torch.ones(1, 1),
        algorithm=algorithm,  # type: ignore[arg-type]
        clip_low=0.2,
        clip_high=0.28,
        aggregation="TokenMean",
    )
    torch.autograd.backward(loss)
    assert logp.grad is not None
    return float(logp.grad)


@pytest.mark.parametrize("algorithm", ["GRPO", "PPO"])
def test_ppo_clip_gradient_zero_only_on_the_clipped_side(algorithm: str) -> None:
    # d(-r·A)/dlogp = -r·A inside the trust region.
    assert _grad_of(1.1, 2.0, algorithm) == pytest.approx(-2.2)
    assert _grad_of(0.9, -1.0, algorithm) == pytest.approx(0.9)
    # Positive advantage, ratio above 1+clip_high: clipped, no gradient.
    assert _grad_of(1.5, 2.0, algorithm) == 0.0
    # Positive advantage, ratio below 1-clip_low: the unclipped branch is the minimum, gradient flows.
    assert _grad_of(0.5, 2.0, algorithm) == pytest.approx(-1.0)
    # Negative advantage, ratio below 1-clip_low: clipped, no gradient.
    assert _grad_of(0.5, -2.0, algorithm) == 0.0
    # Negative advantage, ratio above 1+clip_high: not clipped (pessimistic bound), gradient flows.
    assert _grad_of(1.5, -2.0, algorithm) == pytest.approx(3.0)


def test_ppo_loss_value_and_clip_stats() -> None:
    old = torch.zeros(1, 4)
    ratios = torch.tensor([[1.0, 1.5, 0.5, 1.1]])
    logp = torch.log(ratios)
    adv = torch.tensor([[1.0, 1.0, -1.0, 1.0]])
    mask = torch.ones(1, 4)
    loss, stats = policy_loss(
        logp, old, adv, mask, algorithm="PPO", clip_low=0.2, clip_high=0.28, aggregation="TokenMean"
    )
    # Token losses: -1, -1.28 (clipped high), +0.8 (clipped low, -(0.8·-1)), -1.1.
    assert float(loss) == pytest.approx((-1 - 1.28 + 0.8 - 1.1) / 4)
    assert float(stats["clip_fraction"]) == pytest.approx(0.5)
    assert float(stats["clip_high_fraction"]) == pytest.approx(0.25)
    assert float(stats["clip_low_fraction"]) == pytest.approx(0.25)
    assert float(stats["ratio_mean"]) == pytest.approx(1.025)


def test_old_logp_is_treated_as_constant_and_padding_is_inert() -> None:
    old = torch.tensor([[-1.0, -2.0, 0.0]], requires_grad=True)
    logp = torch.tensor([[-1.0, -2.0, math.inf]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, _ = policy_loss(
        logp,
        old,
        torch.tensor([[1.0, -1.0, math.nan]]),
        mask,
        algorithm="GRPO",
        clip_low=0.2,
        clip_high=0.28,
        aggregation="TokenMean",
    )
    torch.autograd.backward(loss)
    assert old.grad is None
    assert logp.grad is not None
    assert logp.grad[0].tolist() == pytest.approx([-0.5, 0.5, 0.0])
    assert torch.isfinite(loss)


def test_importance_weights_multiply_the_token_loss_and_are_not_differentiated() -> None:
    old = torch.zeros(2, 3)
    gen = torch.Generator().manual_seed(1)
    logp0 = 0.1 * torch.randn(2, 3, generator=gen)
    adv = torch.tensor([[1.0] * 3, [-0.5] * 3])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    w = torch.tensor([[0.5, 2.0, 7.0], [1.0, 0.0, 1.5]], requires_grad=True)
    kwargs = {"algorithm": "GRPO", "clip_low": 0.2, "clip_high": 0.28, "aggregation": "TokenMean"}
    logp_a = logp0.clone().requires_grad_(True)
    plain, _ = policy_loss(logp_a, old, adv, mask, **kwargs)  # type: ignore[arg-type]
    logp_b = logp0.clone().requires_grad_(True)
    weighted, _ = policy_loss(logp_b, old, adv, mask, is_weights=w, **kwargs)  # type: ignore[arg-type]
    # Per-token: the weighted loss is w times the plain token loss (TokenMean over 5 tokens).
    ratio = logp0.exp()
    token = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.28) * adv)
    assert float(plain.detach()) == pytest.approx(float((token * mask).sum() / 5), abs=1e-6)
    assert float(weighted.detach()) == pytest.approx(float((token * w.detach() * mask).sum() / 5), abs=1e-6)
    torch.autograd.backward(plain)
    torch.autograd.backward(weighted)
    assert w.grad is None
    assert logp_a.grad is not None and logp_b.grad is not None
    torch.testing.assert_close(logp_b.grad, logp_a.grad * w.detach() * mask)


# --- GSPO ---------------------------------------------------------------------------------------


def test_gspo_ratio_is_exp_of_mean_log_ratio_and_gradient_matches_formula() -> None:
    gen = torch.Generator().manual_seed(2)
    old = -torch.rand(3, 5, generator=gen) - 0.5
    delta = 1e-4 * torch.randn(3, 5, generator=gen)  # inside GSPO's tiny trust region
    logp = (old + delta).clone().requires_grad_(True)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 1, 0, 1, 0]], dtype=torch.float32)
    adv_row = torch.tensor([1.0, -2.0, 0.5])
    adv = adv_row[:, None].expand(3, 5)
    low, high = default_clip("GSPO")
    # Stretch the clip range so no sequence is clipped here; clipping is tested below.
    loss, stats = policy_loss(
        logp,
        old,
        adv,
        mask,
        algorithm="GSPO",
        clip_low=0.5,
        clip_high=0.5,
        aggregation="SequenceMeanTokenMean",
    )
    n = mask.sum(-1)
    s = torch.exp(((delta * mask).sum(-1)) / n)
    assert float(loss.detach()) == pytest.approx(float(-(s * adv_row).mean()), rel=1e-6)
    assert float(stats["ratio_mean"]) == pytest.approx(
        float((s[:, None] * mask).sum() / mask.sum()), rel=1e-6
    )
    torch.autograd.backward(loss)
    # d loss / d logp[b, t] = -(1/B) · s_b · A_b / |y_b| on trained tokens, 0 elsewhere.
    expected = -(s * adv_row / n)[:, None] / 3 * mask
    assert logp.grad is not None
    torch.testing.assert_close(logp.grad, expected, rtol=1e-5, atol=1e-9)
    assert (low, high) == (3e-4, 4e-4)


def test_gspo_clips_whole_sequences() -> None:
    old = torch.zeros(2, 3)
    # Row 0: mean log-ratio 0.01 → s ≈ 1.01 > 1 + 4e-4, positive advantage → clipped, no gradient.
    # Row 1: same ratio, negative advantage → not clipped, gradient flows.
    logp = torch.full((2, 3), 0.01, requires_grad=True)
    adv = torch.tensor([[1.0] * 3, [-1.0] * 3])
    loss, stats = policy_loss(
        logp,
        old,
        adv,
        torch.ones(2, 3),
        algorithm="GSPO",
        clip_low=3e-4,
        clip_high=4e-4,
        aggregation="SequenceMeanTokenMean",
    )
    torch.autograd.backward(loss)
    assert logp.grad is not None
    assert logp.grad[0].abs().max() == 0.0
    assert logp.grad[1].tolist() == pytest.approx([math.exp(0.01) / 3 / 2] * 3)
    assert float(stats["clip_fraction"]) == pytest.approx(0.5)


def test_default_clip() -> None:
    assert default_clip("GRPO") == (0.2, 0.28)
    assert default_clip("PPO") == (0.2, 0.28)
    with pytest.raises(ValueError, match="unknown algorithm"):
        default_clip("DPO")  # type: ignore[arg-type]


@pytest.mark.parametrize("algorithm", ["GRPO", "GSPO", "PPO"])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_one_sgd_step_moves_logp_with_the_advantage(algorithm: str, sign: float) -> None:
    """A toy policy: free logits per position. Positive advantage raises the trained tokens' logp."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 6, 11, generator=gen).requires_grad_(True)
    targets = torch.randint(0, 11, (2, 6), generator=gen)
    mask = torch.tensor([[0, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1]], dtype=torch.float32)

    def logp_of(lg: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(lg, -1).gather(-1, targets[..., None])[..., 0]

    old = logp_of(logits).detach()
    low, high = default_clip(algorithm)  # type: ignore[arg-type]
    loss, _ = policy_loss(
        logp_of(logits),
        old,
        torch.full((2, 6), sign),
        mask,
        algorithm=algorithm,  # type: ignore[arg-type]
        clip_low=low,
        clip_high=high,
        aggregation="TokenMean",
    )
    torch.autograd.backward(loss)
    with torch.no_grad():
        assert logits.grad is not None
        new = logp_of(logits - 0.1 * logits.grad)
    moved = (new - old)[mask > 0]
    assert (sign * moved > 0).all(), moved
    untouched = (new - old)[mask == 0]
    assert untouched.abs().max() == 0.0


# --- KL and fidelity ---------------------------------------------------------------------------


def test_k3_is_nonnegative_zero_when_equal_and_matches_formula() -> None:
    gen = torch.Generator().manual_seed(4)
    logp = -torch.rand(4, 7, generator=gen) * 3
    ref = -torch.rand(4, 7, generator=gen) * 3
    mask = (torch.rand(4, 7, generator=gen) > 0.4).float()
    k3 = kl_penalty(logp, ref, mask)
    assert (k3 >= 0).all()
    assert (k3[mask == 0] == 0).all()
    r = torch.exp(ref - logp)
    torch.testing.assert_close(k3, (r - 1 - torch.log(r)) * mask)
    assert kl_penalty(logp, logp.clone(), torch.ones(4, 7)).abs().max() == 0.0
    # Its gradient pushes logp towards the reference: d/dlogp (r - 1 - log r) = 1 - r.
    lp = logp.clone().requires_grad_(True)
    torch.autograd.backward(aggregate(kl_penalty(lp, ref, torch.ones(4, 7)), torch.ones(4, 7), "TokenMean"))
    assert lp.grad is not None
    torch.testing.assert_close(lp.grad, (1 - r) / 28)


def test_fidelity_on_identical_inputs() -> None:
    logp = -torch.rand(3, 10, generator=torch.Generator().manual_seed(5)) * 4
    mask = torch.ones(3, 10)
    mask[0, :3] = 0
    stats = fidelity_stats(logp, logp.clone(), mask)
    assert stats.pearson == pytest.approx(1.0)
    assert stats.mean_abs_logprob_delta == 0.0
    assert stats.max_abs_logprob_delta == 0.0
    assert stats.kl == 0.0
    assert stats.tokens == 27


def test_fidelity_matches_numpy_on_random_inputs() -> None:
    gen = torch.Generator().manual_seed(6)
    train = -torch.rand(4, 50, generator=gen) * 5
    behavior = train + 0.3 * torch.randn(4, 50, generator=gen)
    mask = (torch.rand(4, 50, generator=gen) > 0.25).float()
    mask[0, 0] = 1.0
    stats = fidelity_stats(train, behavior, mask)
    keep = mask.numpy() > 0
    t = train.numpy()[keep].astype(np.float64)
    b = behavior.numpy()[keep].astype(np.float64)
    assert stats.pearson == pytest.approx(np.corrcoef(np.exp(b), np.exp(t))[0, 1], rel=1e-9)
    assert stats.mean_abs_logprob_delta == pytest.approx(np.abs(t - b).mean(), rel=1e-9)
    assert stats.max_abs_logprob_delta == pytest.approx(np.abs(t - b).max(), rel=1e-9)
    lr = t - b
    assert stats.kl == pytest.approx((np.exp(lr) - 1 - lr).mean(), rel=1e-9)
    assert stats.tokens == int(keep.sum())
    # Padding garbage outside the mask is ignored.
    train2 = train.clone()
    train2[mask == 0] = math.inf
    assert fidelity_stats(train2, behavior, mask) == stats


def test_fidelity_constant_inputs_never_crash() -> None:
    ones = torch.zeros(1, 4)  # probability 1.0 everywhere
    mask = torch.ones(1, 4)
    assert fidelity_stats(ones, ones.clone(), mask).pearson == 1.0
    other = torch.log(torch.tensor([[0.5, 0.6, 0.7, 0.8]]))
    assert math.isnan(fidelity_stats(ones, other, mask).pearson)
    assert math.isnan(fidelity_stats(other, torch.full((1, 4), -1.0), mask).pearson)
    empty = fidelity_stats(ones, other, torch.zeros(1, 4))
    assert empty.tokens == 0
    assert math.isnan(empty.pearson)

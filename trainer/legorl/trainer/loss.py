"""Pure loss functions of the trainer: group advantages, importance weights, GRPO/GSPO/PPO, KL, fidelity.

Every function takes and returns tensors and touches no global state. Shapes are written in
the type aliases and docstrings: `B` sequences (rows of a micro-batch) by `S` positions;
`mask` is 1.0 where a position's target token is trained on (sampled by the policy) and 0.0
elsewhere (prompt, tool output, padding). Values at masked-out positions never reach a result,
even when they are NaN or ±inf (padding log-probs may be anything).

Three log-probabilities of each sampled token meet here:
- `behavior_logp`: recorded by the rollout engine when it sampled the token (µ);
- `old_logp`: the trainer's own recomputation before the first optimizer step of the batch
  (π_old, detached);
- `logp`: the trainer's current, differentiable log-probability (π_θ).
The PPO ratio is π_θ/π_old and the importance weight is π_old/µ ("decoupled" PPO): clipping
bounds the update, the weight corrects for the engine sampling from a slightly different
distribution than the trainer computes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TypeAlias

import torch
from torch import Tensor

from legorl.api.run import DEFAULT_CLIP, AdvantageMode, AlgorithmName, ImportanceMode, LossAggregation

__all__ = [
    "AdvantageMode",
    "Aggregation",
    "AlgorithmName",
    "FidelityStats",
    "ImportanceMode",
    "aggregate",
    "default_clip",
    "fidelity_stats",
    "group_advantages",
    "importance_weights",
    "kl_penalty",
    "masked_mean",
    "policy_loss",
]

TokenTensor: TypeAlias = Tensor
"""Float [B, S]: one value per position of each sequence."""
MaskTensor: TypeAlias = Tensor
"""Float or bool [B, S]: 1 where the position's target token is trained on."""
Scalar: TypeAlias = Tensor
"""A 0-dim tensor."""

Aggregation: TypeAlias = LossAggregation
"""The RLRun's `lossAggregation` (`legorl.api.run.LossAggregation`)."""

# Bound on |log ratio| before exponentiating, so exp never overflows into inf·0 = NaN; a
# ratio of e^20 is already far past any cap or clip.
_MAX_LOG_RATIO = 20.0


def default_clip(algorithm: AlgorithmName) -> tuple[float, float]:
    """(clipLow, clipHigh) used when the RLRun leaves them unset: 0.2/0.28 (GRPO, PPO), 3e-4/4e-4 (GSPO)."""
    try:
        return DEFAULT_CLIP[algorithm]
    except KeyError:
        raise ValueError(f"unknown algorithm {algorithm!r}; expected GRPO, GSPO or PPO") from None


def _bool(mask: MaskTensor) -> Tensor:
    return mask if mask.dtype == torch.bool else mask > 0


def _check_shapes(*named: tuple[str, Tensor]) -> None:
    shape = named[0][1].shape
    for name, tensor in named[1:]:
        if tensor.shape != shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {tuple(shape)}")


def masked_mean(values: Tensor, mask: MaskTensor, dim: int | None = None) -> Tensor:
    """Mean of `values` where `mask` is set (over everything, or along `dim`); 0 where nothing is set."""
    keep = _bool(mask)
    total = torch.where(keep, values, torch.zeros_like(values))
    if dim is None:
        return total.sum() / keep.sum().clamp(min=1)
    return total.sum(dim) / keep.sum(dim).clamp(min=1)


def aggregate(
    token_values: TokenTensor,
    mask: MaskTensor,
    mode: Aggregation,
    *,
    normalizer: float | None = None,
) -> Scalar:
    """Combine per-token values [B, S] into one scalar.

    - `TokenMean`: Σ over all trained tokens / number of trained tokens;
    - `SequenceMeanTokenMean`: each sequence's token mean, averaged over sequences;
    - `SequenceMeanTokenSum`: each sequence's token sum, averaged over sequences.
    A sequence is a row; rows without a trained token do not count. With gradient
    accumulation over micro-batches, pass `normalizer` (the mini-batch's total trained tokens
    for `TokenMean`, its number of sequences otherwise) so that the sum of the micro-batch
    losses equals the loss of the whole mini-batch.
    """
    keep = _bool(mask)
    values = torch.where(keep, token_values, torch.zeros_like(token_values))
    if mode == "TokenMean":
        total = values.sum()
        count = keep.sum()
    elif mode in ("SequenceMeanTokenMean", "SequenceMeanTokenSum"):
        per_seq = values.sum(dim=-1)
        tokens = keep.sum(dim=-1)
        if mode == "SequenceMeanTokenMean":
            per_seq = per_seq / tokens.clamp(min=1)
        total = per_seq.sum()
        count = (tokens > 0).sum()
    else:
        raise ValueError(
            f"unknown loss aggregation {mode!r}; expected TokenMean, SequenceMeanTokenMean or "
            "SequenceMeanTokenSum"
        )
    if normalizer is not None:
        if not normalizer > 0:
            raise ValueError(f"normalizer must be positive, got {normalizer}")
        return total / normalizer
    return total / count.clamp(min=1)


def group_advantages(
    rewards: Tensor,
    group_ids: Sequence[str],
    mode: AdvantageMode,
    eps: float = 1e-6,
) -> Tensor:
    """GRPO advantages [N] of rewards [N]: reward minus its group's mean, divided by the group's std.

    `GroupMeanStd` divides by the group's sample standard deviation (Bessel-corrected, as
    GRPO's reference implementations do) plus `eps`; `GroupMean` does not divide (Dr. GRPO).
    A group whose rewards are all equal gets 0 everywhere, and so does a group of one trial.
    """
    if rewards.dim() != 1 or rewards.shape[0] != len(group_ids):
        raise ValueError(
            f"rewards has shape {tuple(rewards.shape)} for {len(group_ids)} group ids; expected [N]"
        )
    if mode not in ("GroupMeanStd", "GroupMean"):
        raise ValueError(f"unknown advantage mode {mode!r}; expected GroupMeanStd or GroupMean")
    if eps < 0:
        raise ValueError(f"eps must not be negative, got {eps}")
    if not torch.isfinite(rewards).all():
        raise ValueError("rewards must be finite; a trial without a valid reward cannot enter the loss")
    rewards = rewards if rewards.is_floating_point() else rewards.double()
    index: dict[str, int] = {}
    groups = torch.tensor([index.setdefault(g, len(index)) for g in group_ids], device=rewards.device)
    num = len(index)
    count = torch.zeros(num, dtype=rewards.dtype, device=rewards.device).index_add_(
        0, groups, torch.ones_like(rewards)
    )
    mean = torch.zeros_like(count).index_add_(0, groups, rewards) / count
    centered = rewards - mean[groups]
    if mode == "GroupMean":
        return centered
    sq = torch.zeros_like(count).index_add_(0, groups, centered * centered)
    std = torch.sqrt(sq / (count - 1).clamp(min=1))[groups]
    # A group without spread (equal rewards, or a single trial) carries no signal: exactly 0,
    # also with eps = 0.
    return torch.where(std > 0, centered / (std + eps), torch.zeros_like(centered))


def importance_weights(
    train_logp: TokenTensor,
    behavior_logp: TokenTensor,
    mask: MaskTensor,
    *,
    mode: ImportanceMode,
    cap: float,
    mask_below: bool = False,
) -> tuple[TokenTensor, dict[str, Tensor]]:
    """Token-level importance weights [B, S] (detached) that correct rollout → trainer mismatch.

    The ratio is exp(train_logp − behavior_logp) = π_old/µ per token:
    - `Truncated` (TIS): weight = min(ratio, cap);
    - `Masked` (MIS): weight = ratio where ratio ≤ cap, 0 above it (the token leaves the loss);
      with `mask_below`, tokens with ratio < 1/cap are masked too (the RLRun knob masks above
      only);
    - `Disabled`: weight 1.
    Weights are 0 where `mask` is 0.

    Stats (0-dim detached tensors): `ess` — effective sample size (Σw)²/(N·Σw²) over the N
    trained tokens, a fraction in (0, 1] (1 = all weights equal; 0 if every weight is 0, NaN
    without tokens); `capped_fraction` — share of tokens whose weight was truncated or masked;
    `ratio_mean`, `ratio_min`, `ratio_max` of the raw ratio; `tokens` — N.
    """
    _check_shapes(("train_logp", train_logp), ("behavior_logp", behavior_logp), ("mask", mask))
    if not cap >= 1.0:
        raise ValueError(f"the importance weight cap must be ≥ 1, got {cap}")
    keep = _bool(mask)
    with torch.no_grad():
        log_ratio = torch.where(keep, train_logp.detach().float() - behavior_logp.float(), 0.0)
        ratio = torch.exp(log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
        if mode == "Truncated":
            capped = ratio > cap
            weights = ratio.clamp(max=cap)
        elif mode == "Masked":
            capped = ratio > cap
            if mask_below:
                capped = capped | (ratio < 1.0 / cap)
            weights = torch.where(capped, 0.0, ratio)
        elif mode == "Disabled":
            capped = torch.zeros_like(keep)
            weights = torch.ones_like(ratio)
        else:
            raise ValueError(
                f"unknown importance correction {mode!r}; expected Truncated, Masked or Disabled"
            )
        weights = torch.where(keep, weights, 0.0)
        capped = capped & keep
        n = keep.sum()
        ess = effective_sample_size(weights[keep])
        masked_ratio = ratio[keep]
        stats = {
            "ess": ess,
            "capped_fraction": capped.sum() / n.clamp(min=1),
            "ratio_mean": masked_mean(ratio, keep),
            "ratio_min": masked_ratio.min() if masked_ratio.numel() else torch.tensor(math.nan),
            "ratio_max": masked_ratio.max() if masked_ratio.numel() else torch.tensor(math.nan),
            "tokens": n,
        }
    return weights, stats


def effective_sample_size(weights: Tensor) -> Scalar:
    """ESS of importance weights [N] as a fraction of N: (Σw)²/(N·Σw²), in (0, 1] (1 = all equal); 0 when
    every weight is 0, NaN without weights."""
    with torch.no_grad():
        w = weights.detach().double().reshape(-1)
        if w.numel() == 0:
            return torch.tensor(math.nan)
        sum_w2 = (w * w).sum()
        return torch.where(sum_w2 > 0, w.sum() ** 2 / (w.numel() * sum_w2).clamp(min=1e-30), 0.0).float()


def policy_loss(
    logp: TokenTensor,
    old_logp: TokenTensor,
    advantages: TokenTensor,
    mask: MaskTensor,
    *,
    algorithm: AlgorithmName,
    clip_low: float,
    clip_high: float,
    is_weights: TokenTensor | None = None,
    aggregation: Aggregation,
    normalizer: float | None = None,
) -> tuple[Scalar, dict[str, Tensor]]:
    """The clipped policy-gradient loss (to minimise) and its stats.

    GRPO and PPO (the same loss; they differ in their advantages): token ratio
    r = exp(logp − sg[old_logp]), token loss −min(r·A, clip(r, 1−clip_low, 1+clip_high)·A).
    GSPO: sequence ratio s = exp(mean over the sequence's trained tokens of (logp − old_logp)),
    applied per token as s_t = sg[s]·exp(logp_t − sg[logp_t]) — its value is s and its gradient
    s·∇logp_t — then clipped the same way with GSPO's small ε. The GSPO paper's objective is
    `aggregation="SequenceMeanTokenMean"`.

    Each token's loss is multiplied by its importance weight (`is_weights`, detached), then
    combined by `aggregate`. Stats (0-dim detached tensors): `clip_fraction` (trained tokens
    whose clipped branch is active, i.e. with zero gradient), `clip_low_fraction`,
    `clip_high_fraction`, `ratio_mean`, `ratio_min`, `ratio_max`, `tokens`.
    """
    _check_shapes(("logp", logp), ("old_logp", old_logp), ("advantages", advantages), ("mask", mask))
    if is_weights is not None:
        _check_shapes(("logp", logp), ("is_weights", is_weights))
    if not (0.0 < clip_low < 1.0 and clip_high > 0.0):
        raise ValueError(f"clip_low must be in (0, 1) and clip_high positive, got {clip_low}, {clip_high}")
    keep = _bool(mask)
    zero = torch.zeros_like(logp)
    # Masked-out positions are zeroed before exp so padding garbage cannot turn into NaN gradients.
    log_ratio = torch.where(keep, logp - old_logp.detach(), zero)
    if algorithm in ("GRPO", "PPO"):
        ratio = torch.exp(log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
    elif algorithm == "GSPO":
        tokens = keep.sum(dim=-1, keepdim=True).clamp(min=1)
        seq_log_ratio = log_ratio.sum(dim=-1, keepdim=True) / tokens
        seq_ratio = torch.exp(seq_log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)).detach()
        safe_logp = torch.where(keep, logp, zero)
        ratio = seq_ratio * torch.exp(safe_logp - safe_logp.detach())
    else:
        raise ValueError(f"unknown algorithm {algorithm!r}; expected GRPO, GSPO or PPO")
    adv = torch.where(keep, advantages.to(ratio.dtype), zero)
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv
    token_loss = -torch.minimum(unclipped, clipped)
    if is_weights is not None:
        token_loss = token_loss * torch.where(keep, is_weights.detach().to(token_loss.dtype), zero)
    loss = aggregate(token_loss, keep, aggregation, normalizer=normalizer)

    with torch.no_grad():
        r = ratio.detach()
        active = (clipped < unclipped) & keep
        low = active & (r < 1.0 - clip_low)
        high = active & (r > 1.0 + clip_high)
        n = keep.sum()
        masked = r[keep]
        stats = {
            "clip_fraction": active.sum() / n.clamp(min=1),
            "clip_low_fraction": low.sum() / n.clamp(min=1),
            "clip_high_fraction": high.sum() / n.clamp(min=1),
            "ratio_mean": masked_mean(r, keep),
            "ratio_min": masked.min() if masked.numel() else torch.tensor(math.nan),
            "ratio_max": masked.max() if masked.numel() else torch.tensor(math.nan),
            "tokens": n,
        }
    return loss, stats


def kl_penalty(logp: TokenTensor, ref_logp: TokenTensor, mask: MaskTensor) -> TokenTensor:
    """Per-token k3 estimate [B, S] of KL(π‖π_ref) on tokens sampled from π; ≥ 0, 0 where masked.

    k3 = r − 1 − log r with r = π_ref/π (Schulman's unbiased, non-negative estimator). The
    log-ratio is bounded to ±20 so that exp stays finite; combine with `aggregate`.
    """
    _check_shapes(("logp", logp), ("ref_logp", ref_logp), ("mask", mask))
    keep = _bool(mask)
    zero = torch.zeros_like(logp)
    log_r = torch.where(keep, ref_logp.detach() - logp, zero).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    k3 = torch.exp(log_r) - 1.0 - log_r
    # exp(x) − 1 − x ≥ 0 mathematically; rounding can dip a hair below it.
    return torch.where(keep, k3.clamp(min=0.0), zero)


@dataclass(frozen=True)
class FidelityStats:
    """How well the trainer reproduces the engine's token probabilities over the trained tokens."""

    pearson: float
    """Pearson correlation of the token probabilities exp(logp), rollout vs training, in float64. When
    either side is constant the correlation is undefined: 1.0 if the two sides are equal (|Δp| ≤ 1e-6
    everywhere), else NaN; NaN with no tokens (a NaN means "no evidence", not "bad")."""
    mean_abs_logprob_delta: float
    """Mean |train − behaviour| log-probability."""
    max_abs_logprob_delta: float
    """Largest |train − behaviour| log-probability."""
    kl: float
    """Mean k3 estimate of KL(µ‖π_train) on the behaviour samples."""
    tokens: int
    """Number of trained tokens."""

    def to_dict(self) -> dict[str, float]:
        """By field name (the figures' JSON and the benchmarks' tables)."""
        return asdict(self)


def fidelity_stats(train_logp: TokenTensor, behavior_logp: TokenTensor, mask: MaskTensor) -> FidelityStats:
    """How well the trainer reproduces the engine's token probabilities (for the fidelity guard), over
    the tokens of `mask`: `FidelityStats`."""
    _check_shapes(("train_logp", train_logp), ("behavior_logp", behavior_logp), ("mask", mask))
    keep = _bool(mask)
    with torch.no_grad():
        t = train_logp.detach()[keep].double()
        b = behavior_logp.detach()[keep].double()
        n = int(t.numel())
        if n == 0:
            nan = math.nan
            return FidelityStats(nan, nan, nan, nan, 0)
        delta = (t - b).abs()
        pt, pb = t.exp(), b.exp()
        ct, cb = pt - pt.mean(), pb - pb.mean()
        var_t, var_b = (ct * ct).sum(), (cb * cb).sum()
        if float(var_t) > 0.0 and float(var_b) > 0.0:
            pearson = float((ct * cb).sum() / torch.sqrt(var_t * var_b))
        else:
            pearson = 1.0 if float((pt - pb).abs().max()) <= 1e-6 else math.nan
        log_r = (t - b).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        kl = float((log_r.exp() - 1.0 - log_r).clamp(min=0.0).mean())
        return FidelityStats(
            pearson=pearson,
            mean_abs_logprob_delta=float(delta.mean()),
            max_abs_logprob_delta=float(delta.max()),
            kl=kl,
            tokens=n,
        )

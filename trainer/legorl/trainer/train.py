"""One policy update: committed trials in, a better policy (and the step's figures) out.

`PolicyTrainer` owns the Megatron model, the optimizer and the routing replayer. `train_step()` filters
the trials (termination reason, staleness, zero-variance groups), computes group advantages, packs the
segments into micro-batches, recomputes the sampled tokens' log-probabilities with the rollout's expert
routing replayed, and takes one optimizer step on the clipped, importance-corrected policy loss. It
measures rollout/training fidelity on the same forward pass it trains on, so the figure describes exactly
the probabilities the gradient used.

Nothing here reads the environment or the run store: the service (`service.py`) feeds it batches and
publishes what it returns.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from legorl.api.store import policy_version
from legorl.api.trajectory import TrialRecord
from legorl.trainer import compat, convert, data, loss, model, replay
from legorl.trainer.settings import TrainerSettings

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class ScoredBatch:
    """Training log-probs of a set of sequences, flattened over their loss tokens."""

    train_logprobs: torch.Tensor
    """[N] float32 log-probs the trainer assigns to the sampled tokens."""
    behavior_logprobs: torch.Tensor
    """[N] float32 log-probs the engine recorded for the same tokens."""
    replayed: torch.Tensor
    """[N] bool: the token's routing was replayed from the rollout."""

    def fidelity(self) -> dict[str, float]:
        """Rollout vs. training agreement over these tokens (`loss.fidelity_stats`) and the replayed share."""
        ones = torch.ones_like(self.train_logprobs)
        stats = loss.fidelity_stats(self.train_logprobs[None], self.behavior_logprobs[None], ones[None])
        return {**stats, "replayed_share": float(self.replayed.float().mean()), "tokens": float(ones.numel())}


def resolve_device(settings: TrainerSettings) -> torch.device:
    """`cuda` when asked for or available (auto), else `cpu`; a clear error when cuda is asked but absent."""
    if settings.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("trainer device cuda was requested but torch sees no CUDA device")
    if settings.device == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


class PolicyTrainer:
    """The policy model, its optimizer and one update step."""

    def __init__(self, settings: TrainerSettings, *, checkpoint_dir: Path | None = None) -> None:
        self.settings = settings
        self.device = resolve_device(settings)
        if self.device.type == "cpu":
            compat.enable_cpu_compat()
        model.init_distributed(
            tensor_model_parallel_size=settings.tensor_parallel,
            pipeline_model_parallel_size=settings.pipeline_parallel,
            expert_model_parallel_size=settings.expert_parallel,
        )
        source = Path(checkpoint_dir or settings.checkpoint_dir)
        self.source_dir = source
        self.arch = model.MoeArchitecture.from_hf(source)
        self.replay_enabled = replay.resolve_routing_replay(settings.routing_replay, self.arch)
        self.dtype = DTYPES[settings.dtype]
        torch.manual_seed(settings.seed)
        self.reference: torch.nn.Module | None = None
        if settings.kl_coef > 0:
            # Built first: build_model() resets megatron's class-level list of replay instances, which
            # must end up holding the policy's routers only.
            self.reference = self._build(source, routing_replay=False)
            self.reference.requires_grad_(False)
            self.reference.eval()
        self.model = self._build(source, routing_replay=self.replay_enabled)
        if self.replay_enabled:
            replay.check_replay_active(self.model, self.arch)
        self.replayer = replay.RouterReplayer(self.model)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        # bf16 parameters cannot hold an RL-sized update (1e-6 relative is far below bf16's resolution: one
        # AdamW step changes ~0.04% of them), so the optimizer keeps fp32 master weights and the model gets
        # each step's result rounded back into its own dtype.
        self.masters: list[torch.nn.Parameter] | None = (
            [torch.nn.Parameter(p.detach().float().clone()) for p in self.params]
            if self.dtype != torch.float32
            else None
        )
        self.optimizer = torch.optim.AdamW(
            self.masters if self.masters is not None else self.params,
            lr=settings.learning_rate,
            betas=(0.9, 0.999),
            eps=1e-8,
            weight_decay=settings.weight_decay,
        )
        self.step = 0
        """Last completed step; the policy it produced is version `step`."""
        self.token_logprobs: dict[tuple[str, int], list[float | None]] = {}
        """The last step's training log-prob of every trained token, by (trial, segment index): the
        probabilities of the weights before the step's first update (the ones its importance ratios and
        fidelity figures compare with the engine's), aligned to the segment's tokens (None where a token
        was not trained on)."""

    def _build(self, source: Path, *, routing_replay: bool) -> torch.nn.Module:
        net = model.build_model(
            self.arch,
            dtype=self.dtype,
            routing_replay=routing_replay,
            recompute=self.settings.recompute,
            device=self.device,
            moe_token_dispatcher=self.settings.moe_token_dispatcher,
        )
        convert.load_hf_weights(net, source, self.arch)
        return net

    # -- scoring ---------------------------------------------------------------------------------------

    def _forward(
        self, micro: data.MicroBatch, *, grad: bool, net: torch.nn.Module | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Log-probs and entropy of the micro-batch's targets, and which tokens had replayed routing."""
        net = net if net is not None else self.model
        use_replay = net is self.model and self.replay_enabled and any(r is not None for r in micro.routing)
        covered = torch.zeros(micro.input_ids.shape, dtype=torch.bool)
        if net is self.model:
            # The reference model has no replaying routers; clearing here before its forward would wipe
            # the policy's queued indices that recomputation pops during backward.
            self.replayer.clear()
        if use_replay:
            indices, covered = replay.engine_to_megatron(micro.routing, micro.input_ids.shape[1], self.arch)
            self.replayer.replay(indices)
        input_ids = micro.input_ids.to(self.device)
        with torch.set_grad_enabled(grad):
            logits = model.forward_logits(net, input_ids, micro.lengths.to(self.device))
            if self.settings.temperature != 1.0:
                # The engine reports log-probs of the distribution it sampled from (logits / T).
                logits = logits / self.settings.temperature
            logp = model.token_logprobs(logits, micro.targets.to(self.device))
            ent = model.entropy(logits) if grad else torch.zeros_like(logp)
        return logp, ent, covered

    @torch.no_grad()
    def score(self, micro_batches: Sequence[data.MicroBatch]) -> ScoredBatch:
        """Training log-probs (with replay when enabled) of the micro-batches' loss tokens; no update."""
        train, behavior, replayed = [], [], []
        for micro in micro_batches:
            logp, _, covered = self._forward(micro, grad=False)
            self.replayer.clear()
            mask = micro.loss_mask.bool()
            train.append(logp.float().cpu()[mask])
            behavior.append(micro.behavior_logprobs[mask])
            replayed.append(covered[mask])
        return ScoredBatch(torch.cat(train), torch.cat(behavior), torch.cat(replayed))

    def score_trials(self, trials: Sequence[TrialRecord]) -> ScoredBatch:
        """`score()` of every segment of `trials`, packed as a training step would pack them."""
        sequences = data.sequences_from_trials(trials, {t.trial: 0.0 for t in trials})
        return self.score(self._pack(sequences))

    # -- the update ------------------------------------------------------------------------------------

    def learning_rate(self, step: int) -> float:
        """Linear warm-up over `warmup_steps`, then constant."""
        warmup = self.settings.warmup_steps
        scale = min(1.0, step / warmup) if warmup > 0 else 1.0
        return self.settings.learning_rate * scale

    def train_step(self, trials: Sequence[TrialRecord], *, step: int | None = None) -> dict[str, Any]:
        """One optimizer step on `trials` (the batch of step `step`, sampled with policy `step - 1`).

        Returns the step's figures (loss, reward, fidelity, importance weights, clipping, grad norm,
        entropy, throughput, filter counts). A batch with nothing left to train on after filtering skips
        the optimizer step and says so in `skipped`.
        """
        s = self.settings
        step = self.step + 1 if step is None else step
        started = time.perf_counter()
        self.token_logprobs = {}
        filtered = data.filter_trials(
            trials,
            drop_reasons=set(s.drop_reasons),
            current_version=step - 1,
            max_staleness=s.max_staleness,
            drop_zero_variance_groups=s.drop_zero_variance_groups,
        )
        kept = filtered.kept
        rewards_all = [t.reward for t in trials if t.reward is not None]
        figures: dict[str, Any] = {
            "step": step,
            "trials_total": len(trials),
            "trials_kept": len(kept),
            "trials_dropped": len(trials) - len(kept),
            "zero_variance_groups": filtered.zero_variance_groups,
            "dropped_by_reason": {reason.value: n for reason, n in filtered.dropped_by_reason.items()},
            "dropped_stale": filtered.dropped_stale,
            "dropped_no_reward": filtered.dropped_no_reward,
            "dropped_unknown_version": filtered.dropped_unknown_version,
            "max_staleness_seen": filtered.max_staleness_seen,
            "learning_rate": self.learning_rate(step),
            "reward_mean_all": float(np.mean(rewards_all)) if rewards_all else math.nan,
        }
        mini_sequences = self._sequences(kept, figures, step) if kept else []
        minis = [self._pack(seqs) for seqs in mini_sequences]
        # Fidelity compares the engine's and the trainer's probabilities of one policy: only segments
        # sampled entirely by the version being trained (v<step-1>) count. Stale ones (async mode)
        # differ by the updates in between, which is staleness, not infidelity.
        current = policy_version(step - 1)
        on_policy = [[q.policy_versions == (current,) for q in seqs] for seqs in mini_sequences]
        micro_batches = [m for mini in minis for m in mini]
        if not any(m.num_loss_tokens for m in micro_batches):
            figures["skipped"] = "no trials left after filtering" if not kept else "no sampled tokens"
            figures["step_seconds"] = time.perf_counter() - started
            self.step = step
            return figures

        for group in self.optimizer.param_groups:
            group["lr"] = figures["learning_rate"]
        # With one mini-batch the "old" policy is the one being trained (ratio 1, its gradient is the
        # policy gradient). With several, later mini-batches are off-policy: their ratio is taken against
        # the log-probs every micro-batch had before the first update.
        olds = None if len(minis) == 1 else [self._forward(m, grad=False)[0].detach() for m in micro_batches]
        acc = _Accumulator(loss_tokens=sum(m.num_loss_tokens for m in micro_batches), minis=len(minis))
        norms, start = [], 0
        for index, mini in enumerate(minis):
            old = olds[start : start + len(mini)] if olds is not None else None
            start += len(mini)
            captured = len(acc.old)
            self._accumulate_gradients(mini, acc, old, on_policy[index])
            self.token_logprobs.update(_per_token(mini, acc.old[captured:], mini_sequences[index]))
            grad_norm = self._optimizer_step()
            norms.append(grad_norm)
            if not math.isfinite(grad_norm):
                figures["skipped"] = f"non-finite gradient norm ({grad_norm})"
        elapsed = time.perf_counter() - started
        figures.update(acc.figures())
        figures.update(
            grad_norm=float(np.mean(norms)),
            kl_ref=figures.get("kl_ref") if self.reference is not None else None,
            mini_batches=len(minis),
            micro_batches=len(micro_batches),
            tokens_per_second=acc.tokens_through / elapsed if elapsed > 0 else None,
            step_seconds=elapsed,
        )
        self.step = step
        return figures

    def _sequences(
        self, kept: Sequence[TrialRecord], figures: dict[str, Any], step: int
    ) -> list[list[data.TrainSequence]]:
        """The kept trials' segments with their group advantages, as mini-batches (contiguous slices of
        the batch, one optimizer step each); the reward and advantage figures go into `figures`."""
        s = self.settings
        rewards = torch.tensor([float(t.reward or 0.0) for t in kept])
        advantages = loss.group_advantages(rewards, [t.group_id for t in kept], mode=s.advantage)
        figures["reward_mean"] = float(rewards.mean())
        figures["advantage_abs_mean"] = float(advantages.abs().mean())
        by_trial = {t.trial: float(a) for t, a in zip(kept, advantages, strict=True)}
        sequences = data.sequences_from_trials(kept, by_trial)
        if s.routing_replay == "Enabled":
            # Enabled means every trained token is routed as the engine routed it: segments the
            # engine returned no routing for leave the loss (counted) instead of training unreplayed.
            unrouted = [q for q in sequences if q.routed_experts is None]
            if unrouted:
                log.error(
                    "routingReplay Enabled, but %d of %d segments carry no routed experts (is the "
                    "fleet's routedExpertsCapture on?): left out of the loss (step %d)",
                    len(unrouted),
                    len(sequences),
                    step,
                )
                sequences = [q for q in sequences if q.routed_experts is not None]
            figures["dropped_unrouted_segments"] = len(unrouted)
        size = math.ceil(len(sequences) / s.mini_batches) if sequences else 1
        return [sequences[i : i + size] for i in range(0, len(sequences), size)]

    def _optimizer_step(self) -> float:
        """Clip, step (through the fp32 masters when the model is not fp32), clear; the grad norm.

        A non-finite norm skips the update: one NaN would destroy the policy.
        """
        clip = self.settings.grad_clip if self.settings.grad_clip > 0 else math.inf
        if self.masters is not None:
            for param, master in zip(self.params, self.masters, strict=True):
                master.grad = None if param.grad is None else param.grad.detach().float()
            trained = [m for m in self.masters if m.grad is not None]
        else:
            trained = [p for p in self.params if p.grad is not None]
        norm = float(torch.nn.utils.clip_grad_norm_(trained, clip)) if trained else 0.0
        if math.isfinite(norm):
            self.optimizer.step()
            if self.masters is not None:
                with torch.no_grad():
                    for param, master in zip(self.params, self.masters, strict=True):
                        param.copy_(master)
        self.optimizer.zero_grad(set_to_none=True)
        for param in self.params:
            param.grad = None
        return norm

    def _accumulate_gradients(
        self,
        micro_batches: Sequence[data.MicroBatch],
        acc: _Accumulator,
        olds: Sequence[torch.Tensor] | None = None,
        on_policy: Sequence[bool] | None = None,
    ) -> None:
        """Forward and backward every micro-batch of one mini-batch; gradients add up to its whole loss.

        `olds`: each micro-batch's log-probs before this step's first update (several mini-batches);
        None when the mini-batch is the whole batch and the policy being trained is the old one.
        `on_policy`: per sequence of the mini-batch (`MicroBatch.seq_index`), whether the version being
        trained sampled it; only those tokens enter the fidelity figures (all when None).
        """
        s = self.settings
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        total_tokens = sum(m.num_loss_tokens for m in micro_batches)
        total_seqs = sum(int(m.input_ids.shape[0]) for m in micro_batches)
        normalizer = float(total_tokens if s.loss_aggregation == "TokenMean" else total_seqs)
        for index, micro in enumerate(micro_batches):
            logp, ent, covered = self._forward(micro, grad=True)
            mask = micro.loss_mask.to(self.device)
            old_logp = logp.detach() if olds is None else olds[index]
            weights, is_stats = loss.importance_weights(
                old_logp,
                micro.behavior_logprobs.to(self.device),
                mask,
                mode=s.importance_mode,
                cap=s.importance_cap,
            )
            total, stats = loss.policy_loss(
                logp,
                old_logp,
                micro.advantages.to(self.device),
                mask,
                algorithm=s.algorithm,
                clip_low=s.clip_low,
                clip_high=s.clip_high,
                is_weights=None if s.importance_mode == "Disabled" else weights,
                aggregation=s.loss_aggregation,
                normalizer=normalizer,
            )
            entropy = loss.aggregate(ent, mask, s.loss_aggregation, normalizer=normalizer)
            if s.entropy_coef > 0:
                total = total - s.entropy_coef * entropy
            if self.reference is not None:
                with torch.no_grad():
                    ref_logp, _, _ = self._forward(micro, grad=False, net=self.reference)
                kl = loss.aggregate(
                    loss.kl_penalty(logp, ref_logp, mask), mask, s.loss_aggregation, normalizer=normalizer
                )
                total = total + s.kl_coef * kl
                acc.kl_ref += float(kl.detach()) / acc.minis
            if self.replay_enabled:
                self.replayer.before_backward()
            torch.autograd.backward(total)
            self.replayer.clear()
            share = micro.num_loss_tokens / acc.loss_tokens
            acc.loss += float(total.detach()) / acc.minis
            acc.entropy += float(entropy.detach()) / acc.minis
            acc.clip_fraction += float(stats["clip_fraction"]) * share
            acc.capped_share += float(is_stats["capped_fraction"]) * share
            keep = micro.loss_mask.bool()
            same = keep
            if on_policy is not None:
                rows = torch.tensor([on_policy[int(i)] for i in micro.seq_index], dtype=torch.bool)
                same = keep & rows[:, None]
            acc.old.append(old_logp.detach().float().cpu())
            acc.train.append(old_logp.float().cpu()[same])
            acc.behavior.append(micro.behavior_logprobs[same])
            acc.replayed.append(covered[keep])
            acc.weights.append(weights.float().cpu()[keep])
            acc.tokens_through += int(micro.lengths.sum())

    def _pack(self, sequences: Sequence[data.TrainSequence]) -> list[data.MicroBatch]:
        """Micro-batches; with replay on, sequences without recorded routing never share a replayed one.
        Every micro-batch's `seq_index` indexes `sequences` (not the routed or plain share of it)."""
        budget = self.settings.max_tokens_per_micro_batch
        if not self.replay_enabled:
            return data.pack_micro_batches(list(sequences), budget)
        routed = [i for i, q in enumerate(sequences) if q.routed_experts is not None]
        plain = [i for i, q in enumerate(sequences) if q.routed_experts is None]
        out = []
        for share in (routed, plain):
            for micro in data.pack_micro_batches([sequences[i] for i in share], budget):
                index = torch.tensor([share[int(i)] for i in micro.seq_index], dtype=torch.long)
                out.append(dataclasses.replace(micro, seq_index=index))
        return out

    # -- weights and state -----------------------------------------------------------------------------

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The current policy in Hugging Face layout (what the fleet loads)."""
        return convert.export_hf_state_dict(self.model, self.arch)

    def state(self) -> dict[str, Any]:
        """Everything needed to continue exactly where this trainer is: model, optimizer, step, RNG."""
        return {
            "format": 1,
            "step": self.step,
            "model": self.model.state_dict(),
            "masters": [m.detach().clone() for m in self.masters] if self.masters is not None else None,
            "optimizer": self.optimizer.state_dict(),
            "rng": {
                "torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
                "numpy": _numpy_rng_state(),
                "python": random.getstate(),
            },
        }

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore what `state()` returned (same architecture and settings)."""
        if state.get("format") != 1:
            raise ValueError(f"unknown trainer checkpoint format {state.get('format')!r}")
        self.model.load_state_dict(state["model"])
        if self.masters is not None:
            if state.get("masters") is None:
                raise ValueError("checkpoint has no fp32 master weights but this trainer is not fp32")
            with torch.no_grad():
                for master, saved in zip(self.masters, state["masters"], strict=True):
                    master.copy_(saved)
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = int(state["step"])
        rng = state["rng"]
        torch.set_rng_state(rng["torch"])
        if rng["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
        kind, keys, pos, has_gauss, cached = rng["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
        random.setstate(rng["python"])


def _numpy_rng_state() -> tuple[str, torch.Tensor, int, int, float]:
    """numpy's global RNG state in types `torch.load(weights_only=True)` accepts."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return (
        str(kind),
        torch.from_numpy(np.asarray(keys).astype(np.int64)),
        int(pos),
        int(has_gauss),
        float(cached),
    )


@dataclass
class _Accumulator:
    """Running sums over a step's micro-batches and the per-token tensors the fidelity figures need."""

    loss_tokens: int
    minis: int = 1
    """Mini-batches (optimizer steps) the figures average over."""
    loss: float = 0.0
    entropy: float = 0.0
    kl_ref: float = 0.0
    clip_fraction: float = 0.0
    capped_share: float = 0.0
    tokens_through: int = 0
    train: list[torch.Tensor] = field(default_factory=list)
    behavior: list[torch.Tensor] = field(default_factory=list)
    replayed: list[torch.Tensor] = field(default_factory=list)
    weights: list[torch.Tensor] = field(default_factory=list)
    old: list[torch.Tensor] = field(default_factory=list)
    """Per micro-batch [B, S]: the log-probs before the step's first update (padding included)."""

    def figures(self) -> dict[str, Any]:
        train, behavior = torch.cat(self.train), torch.cat(self.behavior)
        fid = loss.fidelity_stats(train[None], behavior[None], torch.ones_like(train)[None])
        replayed = torch.cat(self.replayed)
        return {
            "loss": self.loss,
            "entropy": self.entropy,
            "kl_ref": self.kl_ref,
            "clip_fraction": self.clip_fraction,
            "is_capped_share": self.capped_share,
            "is_ess": float(loss.effective_sample_size(torch.cat(self.weights))),
            "fidelity_pearson": fid["pearson"],
            "fidelity_mean_abs_logprob_delta": fid["mean_abs_logprob_delta"],
            "fidelity_max_abs_logprob_delta": fid["max_abs_logprob_delta"],
            "fidelity_kl": fid["kl"],
            "fidelity_tokens": int(fid["tokens"]),
            "replayed_token_share": float(replayed.float().mean()) if replayed.numel() else 0.0,
            "loss_tokens": self.loss_tokens,
        }


def _per_token(
    micro_batches: Sequence[data.MicroBatch],
    logps: Sequence[torch.Tensor],
    sequences: Sequence[data.TrainSequence],
) -> dict[tuple[str, int], list[float | None]]:
    """Per-micro-batch [B, S] log-probs back onto their sequences' tokens: row r, position p predicted
    token p+1 of sequence `seq_index[r]`; only trained tokens get a value."""
    out: dict[tuple[str, int], list[float | None]] = {}
    for micro, logp in zip(micro_batches, logps, strict=True):
        for row, index in enumerate(micro.seq_index.tolist()):
            seq = sequences[int(index)]
            n = int(micro.lengths[row])
            values = logp[row, :n].tolist()
            mask = micro.loss_mask[row, :n].tolist()
            tokens: list[float | None] = [None]  # token 0 is never predicted
            tokens += [float(v) if m else None for v, m in zip(values, mask, strict=True)]
            out[(seq.trial_id, seq.segment_index)] = tokens
    return out

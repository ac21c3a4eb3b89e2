"""One policy update: committed trials in, a better policy (and the step's figures) out — on any layout.

`PolicyTrainer` owns this rank's share of the Megatron model, its optimizer and the routing replayer.
`train_step()` filters the trials (termination reason, staleness, zero-variance groups), computes group
advantages, plans micro-batches for every data-parallel rank at once (`data.plan_rounds`), recomputes the
sampled tokens' log-probabilities with the rollout's expert routing replayed — through the pipeline stages
(`pipeline.py`), with the vocabulary split over the tensor ranks (`parallel.vocab_parallel_logprobs`) — and
takes one optimizer step on the clipped, importance-corrected policy loss. It measures rollout/training
fidelity on the same forward pass it trains on, so the figure describes exactly the probabilities the
gradient used.

Every rank runs the same code on the same committed batch: the filter, advantages and plan are the same
everywhere, each data-parallel rank computes only its own rows, and the loss is normalised over the whole
batch, so gradients sum. The step's figures are the batch's, whatever the layout: sums are all-reduced and
per-token figures (fidelity, ESS) are computed by the writer (global rank 0) from every rank's tokens in one
canonical order, then shared with every rank.

Nothing here reads the environment or the run store: the service (`service.py`) feeds it batches and
publishes what it returns.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from legorl.api.figures import StepFigures
from legorl.api.store import policy_version
from legorl.api.trajectory import TrialRecord
from legorl.trainer import data, loss, parallel, pipeline, replay
from legorl.trainer.models import compat, convert, model
from legorl.trainer.settings import SettingsError, TrainerSettings

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


@dataclass
class ScoredBatch:
    """Training log-probs of a set of sequences, flattened over their loss tokens."""

    train_logprobs: torch.Tensor
    """[N] float32 log-probs the trainer assigns to the sampled tokens."""
    behavior_logprobs: torch.Tensor
    """[N] float32 log-probs the engine recorded for the same tokens."""
    replayed: torch.Tensor
    """[N] bool: the token's routing was replayed from the rollout."""
    routing_agreeing: int = 0
    """Recorded (position, MoE layer) pairs where the experts used under replay are those the trainer's
    router chooses itself (`replay.RoutingAgreement`), over every position of the scored sequences."""
    routing_compared: int = 0
    """Recorded (position, MoE layer) pairs compared (0: no routing was replayed)."""

    def fidelity(self) -> dict[str, float]:
        """Rollout vs. training agreement over these tokens (`loss.fidelity_stats`), the replayed share and
        routing parity (`routing_agreement`: NaN when no routing was compared)."""
        ones = torch.ones_like(self.train_logprobs)
        stats = loss.fidelity_stats(self.train_logprobs[None], self.behavior_logprobs[None], ones[None])
        agreement = self.routing_agreeing / self.routing_compared if self.routing_compared else math.nan
        return {
            **stats.to_dict(),
            "replayed_share": float(self.replayed.float().mean()),
            "tokens": float(ones.numel()),
            "routing_agreement": agreement,
            "routing_compared": float(self.routing_compared),
        }


def resolve_device(settings: TrainerSettings) -> torch.device:
    """`cuda` when asked for or available (auto), else `cpu`; a clear error when cuda is asked but absent."""
    if settings.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("trainer device cuda was requested but torch sees no CUDA device")
    if settings.device == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


@dataclass(frozen=True)
class _Micro:
    """One micro-batch of this rank, ready for the forward."""

    batch: data.MicroBatch
    replay: list[torch.Tensor] | None
    """This rank's replay indices (its stage's MoE layers, its slice of the sequence); None: no replay."""
    covered: torch.Tensor
    """Bool [B, S]: the position's routing was recorded (and replayed)."""
    on_policy: torch.Tensor
    """Bool [B]: the row was sampled entirely by the version being trained (padding rows: False)."""

    @property
    def rows(self) -> int:
        return int(self.batch.input_ids.shape[0])

    @property
    def width(self) -> int:
        return int(self.batch.input_ids.shape[1])


@dataclass
class _TokenRecord:
    """What one trained sequence contributes to the per-token figures (numpy, gathered to the writer)."""

    key: tuple[str, int]
    """(trial, segment index)."""
    logp: np.ndarray
    """Float32 [n−1]: the trainer's log-prob of tokens 1..n−1 before the step's first update."""
    behavior: np.ndarray
    mask: np.ndarray
    """Bool [n−1]: trained on."""
    weights: np.ndarray
    covered: np.ndarray
    on_policy: bool
    probe: bool = False
    """Measured for the fidelity figures only (a zero-variance group's trial): not in the loss."""


class PolicyTrainer:
    """This rank's share of the policy model, its optimizer and one update step."""

    def __init__(self, settings: TrainerSettings, *, checkpoint_dir: Path | None = None) -> None:
        self.settings = settings
        self.device = resolve_device(settings)
        if self.device.type == "cpu":
            compat.enable_cpu_compat()
        layout = settings.layout
        model.init_distributed(
            tensor_model_parallel_size=settings.tensor_parallel,
            pipeline_model_parallel_size=settings.pipeline_parallel,
            expert_model_parallel_size=settings.expert_parallel,
        )
        self.ranks = parallel.Ranks.current()
        source = Path(checkpoint_dir or settings.checkpoint_dir)
        self.source_dir = source
        self.arch = model.MoeArchitecture.from_hf(source)
        settings.check_supported(world_size=self.ranks.world, model=self.arch.shape())
        if self.ranks.world != layout.world_size:  # check_supported said so; keep mypy and readers sure
            raise SettingsError(f"{self.ranks.world} ranks for a layout of {layout.world_size}")
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
        self._agreement: replay.RoutingAgreement | None = None
        """Set while `score()` measures routing parity; `_stage_forward` gives it each micro-batch's mask."""
        self.columns = replay.stage_columns(self.model, self.arch) if self.arch.is_moe else []
        self.named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in self.named]
        # bf16 parameters cannot hold an RL-sized update (1e-6 relative is far below bf16's resolution: one
        # AdamW step changes ~0.04% of them), so the optimizer keeps fp32 master weights and the model gets
        # each step's result rounded back into its own dtype.
        self.masters: list[torch.nn.Parameter] | None = (
            [torch.nn.Parameter(p.detach().float().clone()) for p in self.params]
            if self.dtype in (torch.bfloat16, torch.float16)
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
        """On the writer: the last step's training log-prob of every trained token, by (trial, segment
        index): the probabilities of the weights before the step's first update (the ones its importance
        ratios and fidelity figures compare with the engine's), aligned to the segment's tokens (None where
        a token was not trained on). Empty on the other ranks."""

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

    # -- micro-batches and passes ----------------------------------------------------------------------

    def _micro_batches(
        self,
        sequences: Sequence[data.TrainSequence],
        on_policy: Sequence[bool] | None = None,
        *,
        plan_for: tuple[int, int, int] | None = None,
    ) -> list[_Micro]:
        """This rank's micro-batches of `sequences` (every rank plans all of them the same way).

        With replay on, sequences without recorded routing never share a replayed micro-batch. Each
        micro-batch's `seq_index` indexes `sequences`. `plan_for` = (data-parallel size, data rank, tensor
        size) plans as another layout would (tests compare layouts on the same micro-batch shapes).
        """
        vocab = self.arch.vocab_size
        for q in sequences:
            if q.length and (int(q.token_ids.min()) < 0 or int(q.token_ids.max()) >= vocab):
                # Every rank refuses the same batch: a bad id found by the first pipeline stage alone would
                # leave the others waiting for its activations.
                raise data.DataError(
                    f"trial {q.trial_id} segment {q.segment_index}: token ids outside the model's vocabulary "
                    f"[0, {vocab}) (was it sampled by another model?)"
                )
        data_size, data_rank, multiple = plan_for or (
            self.ranks.data_size,
            self.ranks.data_rank,
            self.ranks.tensor_size,
        )
        shares = [list(range(len(sequences)))]
        if self.replay_enabled:
            shares = [
                [i for i, q in enumerate(sequences) if q.routed_experts is not None],
                [i for i, q in enumerate(sequences) if q.routed_experts is None],
            ]
        out = []
        for share in shares:
            rounds = data.plan_rounds(
                [sequences[i].length for i in share],
                max_tokens=self.settings.max_tokens_per_micro_batch,
                data_parallel=data_size,
                multiple_of=multiple,
            )
            for r in rounds:
                members = [share[j] for j in r.members[data_rank]]
                batch = data.collate(sequences, members, rows=r.rows, width=r.width)
                out.append(self._prepare(batch, on_policy))
        return out

    def _prepare(self, batch: data.MicroBatch, on_policy: Sequence[bool] | None) -> _Micro:
        rows, width = batch.shape
        flags = torch.tensor(
            [i >= 0 and (on_policy is None or on_policy[i]) for i in batch.seq_index.tolist()],
            dtype=torch.bool,
        )
        covered = torch.zeros(rows, width, dtype=torch.bool)
        indices = None
        if self.replay_enabled and any(r is not None for r in batch.routing):
            per_layer, covered = replay.engine_to_megatron(batch.routing, width, self.arch)
            indices = replay.stage_indices(
                per_layer,
                self.columns,
                batch=rows,
                tensor_rank=self.ranks.tensor_rank,
                tensor_size=self.ranks.tensor_size,
            )
        return _Micro(batch=batch, replay=indices, covered=covered, on_policy=flags)

    def _stage_forward(self, net: torch.nn.Module, micro: _Micro) -> torch.Tensor:
        """This stage's forward of `micro`: vocabulary-split logits [B, S, V/TP] on the last stage, the
        activations to hand on elsewhere."""
        if self._agreement is not None:
            self._agreement.mask = replay.local_token_mask(
                micro.covered, tensor_rank=self.ranks.tensor_rank, tensor_size=self.ranks.tensor_size
            )
        if net is self.model and self.replay_enabled:
            if micro.replay is not None:
                self.replayer.replay(micro.replay)
            else:
                self.replayer.route_normally()
        batch = micro.batch
        rows, width = batch.shape
        ids = batch.input_ids.to(self.device)
        positions = torch.arange(width, device=self.device).unsqueeze(0).expand(rows, width)
        mask, _ = model.attention_masks(rows, width, batch.lengths, self.device)
        # No padding mask: megatron's MoE layers use it only for auxiliary losses, which legorl turns off.
        output: torch.Tensor = net(ids, positions, mask, runtime_gather_output=False)
        return output

    def _pass(
        self,
        micros: Sequence[_Micro],
        loss_fn: Callable[[int, torch.Tensor], torch.Tensor | None],
        *,
        train: bool,
        net: torch.nn.Module | None = None,
    ) -> None:
        """Every micro-batch through this stage (the pipeline schedule), forward and backward with `train`."""
        net = net if net is not None else self.model
        hidden = self.arch.hidden_size
        split = self.ranks.tensor_size

        def shape_of(i: int) -> tuple[int, ...]:
            return (micros[i].width // split, micros[i].rows, hidden)

        replaying = net is self.model and self.replay_enabled
        if replaying:
            self.replayer.clear()
        try:
            pipeline.run(
                net,
                len(micros),
                shape_of=shape_of,
                forward=lambda i: self._stage_forward(net, micros[i]),
                loss=loss_fn,
                train=train,
                before_backward=(lambda i: self.replayer.backward_of(micros[i].replay is not None))
                if replaying
                else None,
                dtype=self.dtype,
                device=self.device,
            )
        finally:
            if replaying:
                self.replayer.clear()

    def _logprobs(self, logits: torch.Tensor, micro: _Micro) -> tuple[torch.Tensor, torch.Tensor]:
        return parallel.vocab_parallel_logprobs(
            logits, micro.batch.targets.to(self.device), temperature=self.settings.temperature
        )

    def _forward_logprobs(
        self, micros: Sequence[_Micro], net: torch.nn.Module | None = None
    ) -> list[torch.Tensor]:
        """Each micro-batch's log-probs [B, S] without a gradient (on the last stage; empty elsewhere)."""
        got: dict[int, torch.Tensor] = {}

        def keep(i: int, logits: torch.Tensor) -> None:
            got[i] = self._logprobs(logits, micros[i])[0].detach()

        self._pass(micros, keep, train=False, net=net)
        return [got[i] for i in range(len(micros))] if self.ranks.last_stage else []

    # -- scoring ---------------------------------------------------------------------------------------

    @torch.no_grad()
    def score(self, micros: Sequence[_Micro], sequences: Sequence[data.TrainSequence]) -> ScoredBatch:
        """Training log-probs (with replay when enabled) of the micro-batches' loss tokens; no update. The
        same ScoredBatch on every rank (tokens in (trial, segment) order). With replay on, it also measures
        routing parity (`replay.RoutingAgreement`, summed over every rank)."""
        counts = torch.zeros(2, dtype=torch.int64)
        if self.replay_enabled:
            with replay.RoutingAgreement(self.model) as agreement:
                self._agreement = agreement
                try:
                    logps = self._forward_logprobs(micros)
                finally:
                    self._agreement = None
            counts = parallel.all_reduce_cpu(torch.tensor([agreement.agreeing, agreement.counted]))
        else:
            logps = self._forward_logprobs(micros)
        records = self._token_records(micros, logps, sequences)
        gathered = parallel.gather_objects(records)
        scored = None
        if gathered is not None:
            ordered = sorted((r for part in gathered for r in part), key=lambda r: r.key)
            scored = ScoredBatch(
                torch.from_numpy(
                    np.concatenate([r.logp[r.mask] for r in ordered] or [np.zeros(0, np.float32)])
                ),
                torch.from_numpy(
                    np.concatenate([r.behavior[r.mask] for r in ordered] or [np.zeros(0, np.float32)])
                ),
                torch.from_numpy(np.concatenate([r.covered[r.mask] for r in ordered] or [np.zeros(0, bool)])),
                routing_agreeing=int(counts[0]),
                routing_compared=int(counts[1]),
            )
        shared: ScoredBatch = parallel.broadcast(scored)
        return shared

    def score_sequences(self, sequences: Sequence[data.TrainSequence]) -> ScoredBatch:
        """`score()` of `sequences`, planned as a training step would plan them."""
        return self.score(self._micro_batches(sequences), sequences)

    def score_trials(self, trials: Sequence[TrialRecord]) -> ScoredBatch:
        """`score()` of every segment of `trials`."""
        return self.score_sequences(data.sequences_from_trials(trials, {t.trial: 0.0 for t in trials}))

    def _token_records(
        self,
        micros: Sequence[_Micro],
        logps: Sequence[torch.Tensor],
        sequences: Sequence[data.TrainSequence],
        weights: Sequence[torch.Tensor] | None = None,
    ) -> list[_TokenRecord]:
        """This rank's per-token contributions (only one rank per data-parallel replica reports)."""
        if not self.ranks.reports_tokens:
            return []
        out = []
        for index, (micro, logp) in enumerate(zip(micros, logps, strict=True)):
            batch = micro.batch
            cpu = logp.float().cpu().numpy()
            w = weights[index].float().cpu().numpy() if weights is not None else np.ones_like(cpu)
            for row, i in enumerate(batch.seq_index.tolist()):
                if i < 0:
                    continue
                n = int(batch.lengths[row])
                seq = sequences[i]
                out.append(
                    _TokenRecord(
                        key=(seq.trial_id, seq.segment_index),
                        logp=cpu[row, :n].copy(),
                        behavior=batch.behavior_logprobs[row, :n].numpy().copy(),
                        mask=batch.loss_mask[row, :n].numpy() > 0,
                        weights=w[row, :n].copy(),
                        covered=micro.covered[row, :n].numpy().copy(),
                        on_policy=bool(micro.on_policy[row]),
                    )
                )
        return out

    # -- the update ------------------------------------------------------------------------------------

    def learning_rate(self, step: int) -> float:
        """Linear warm-up over `warmup_steps`, then constant."""
        warmup = self.settings.warmup_steps
        scale = min(1.0, step / warmup) if warmup > 0 else 1.0
        return self.settings.learning_rate * scale

    def train_step(self, trials: Sequence[TrialRecord], *, step: int | None = None) -> StepFigures:
        """One optimizer step on `trials` (the batch of step `step`, sampled with policy `step - 1`).

        Every rank calls it with the same trials. Returns the step's figures (loss, reward, fidelity,
        importance weights, clipping, grad norm, entropy, throughput, filter counts), the same on every
        rank. A batch with nothing left to train on after filtering skips the optimizer step and says so in
        `skipped`.
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
        figures = StepFigures(
            step=step,
            trials_total=len(trials),
            trials_kept=len(kept),
            trials_dropped=len(trials) - len(kept),
            zero_variance_groups=filtered.zero_variance_groups,
            dropped_by_reason={reason.value: n for reason, n in filtered.dropped_by_reason.items()},
            dropped_stale=filtered.dropped_stale,
            dropped_no_reward=filtered.dropped_no_reward,
            dropped_unknown_version=filtered.dropped_unknown_version,
            max_staleness_seen=filtered.max_staleness_seen,
            learning_rate=self.learning_rate(step),
            reward_mean_all=float(np.mean(rewards_all)) if rewards_all else math.nan,
        )
        mini_sequences = self._sequences(kept, figures, step) if kept else []
        # Fidelity compares the engine's and the trainer's probabilities of one policy: only segments
        # sampled entirely by the version being trained (v<step-1>) count. Stale ones (async mode)
        # differ by the updates in between, which is staleness, not infidelity.
        current = policy_version(step - 1)
        minis = [
            self._micro_batches(seqs, [q.policy_versions == (current,) for q in seqs])
            for seqs in mini_sequences
        ]
        loss_tokens = [sum(q.num_loss_tokens for q in seqs) for seqs in mini_sequences]
        # The fidelity guard must not go blind when no trained token was sampled by that version (its fresh
        # groups all had one reward, the rest was stale): then the fresh trials of zero-variance groups are
        # measured instead, with one forward before the update and no gradient.
        fresh = any(
            q.policy_versions == (current,) and q.num_loss_tokens for seqs in mini_sequences for q in seqs
        )
        probe = [] if fresh else self._probe_sequences(filtered.zero_variance, current)
        probe_records = self._probe_records(probe)
        if not sum(loss_tokens):
            figures.skipped = "no trials left after filtering" if not kept else "no sampled tokens"
            if probe:
                figures = self._probe_figures(figures, probe_records)
            figures.step_seconds = time.perf_counter() - started
            self.step = step
            return figures

        for group in self.optimizer.param_groups:
            group["lr"] = figures.learning_rate
        # With one mini-batch the "old" policy is the one being trained (ratio 1, its gradient is the
        # policy gradient). With several, later mini-batches are off-policy: their ratio is taken against
        # the log-probs every micro-batch had before the first update.
        olds = None if len(minis) == 1 else [self._forward_logprobs(m) for m in minis]
        refs = (
            [self._forward_logprobs(m, net=self.reference) for m in minis]
            if self.reference is not None
            else None
        )
        acc = _Accumulator(minis=len(minis), records=probe_records)
        norms = []
        for index, micros in enumerate(minis):
            seqs = mini_sequences[index]
            normalizer = float(loss_tokens[index] if s.loss_aggregation == "TokenMean" else len(seqs))
            captured = self._accumulate_gradients(
                micros,
                acc,
                normalizer=normalizer,
                olds=olds[index] if olds is not None else None,
                refs=refs[index] if refs is not None else None,
            )
            acc.records += self._token_records(micros, captured.old, seqs, captured.weights)
            grad_norm = self._optimizer_step()
            norms.append(grad_norm)
            if not math.isfinite(grad_norm):
                figures.skipped = f"non-finite gradient norm ({grad_norm})"
        elapsed = time.perf_counter() - started
        figures, tokens_through = self._figures(figures, acc, loss_tokens=sum(loss_tokens))
        figures.grad_norm = float(np.mean(norms))
        figures.kl_ref = figures.kl_ref if self.reference is not None else None
        figures.mini_batches = len(minis)
        figures.micro_batches = sum(len(m) for m in minis)
        figures.step_seconds = elapsed
        figures.tokens_per_second = tokens_through / elapsed if elapsed > 0 else None
        self.step = step
        return figures

    def _sequences(
        self, kept: Sequence[TrialRecord], figures: StepFigures, step: int
    ) -> list[list[data.TrainSequence]]:
        """The kept trials' segments with their group advantages, as mini-batches (contiguous slices of
        the batch, one optimizer step each); the reward and advantage figures go into `figures`."""
        s = self.settings
        rewards = torch.tensor([float(t.reward or 0.0) for t in kept])
        advantages = loss.group_advantages(rewards, [t.group_id for t in kept], mode=s.advantage)
        figures.reward_mean = float(rewards.mean())
        figures.advantage_abs_mean = float(advantages.abs().mean())
        by_trial = {t.trial: float(a) for t, a in zip(kept, advantages, strict=True)}
        sequences = data.sequences_from_trials(kept, by_trial)
        if s.routing_replay == "Enabled":
            # Enabled means every trained token is routed as the engine routed it: segments the
            # engine returned no routing for leave the loss (counted) instead of training unreplayed.
            unrouted = [q for q in sequences if q.routed_experts is None]
            if unrouted and self.ranks.writer:
                log.error(
                    "routingReplay Enabled, but %d of %d segments carry no routed experts (is the "
                    "fleet's routedExpertsCapture on?): left out of the loss (step %d)",
                    len(unrouted),
                    len(sequences),
                    step,
                )
            sequences = [q for q in sequences if q.routed_experts is not None]
            figures.dropped_unrouted_segments = len(unrouted)
        size = math.ceil(len(sequences) / s.mini_batches) if sequences else 1
        return [sequences[i : i + size] for i in range(0, len(sequences), size)]

    def _accumulate_gradients(
        self,
        micros: Sequence[_Micro],
        acc: _Accumulator,
        *,
        normalizer: float,
        olds: Sequence[torch.Tensor] | None,
        refs: Sequence[torch.Tensor] | None,
    ) -> _Captured:
        """Forward and backward every micro-batch of one mini-batch; gradients add up to its whole loss
        (normalised by `normalizer`: the mini-batch's trained tokens, or its sequences, over every rank).

        `olds`: each micro-batch's log-probs before this step's first update (several mini-batches); None
        when the mini-batch is the whole batch and the policy being trained is the old one. `refs`: the
        frozen reference's log-probs (KL penalty). Both exist on the last stage only.
        """
        s = self.settings
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        captured = _Captured([torch.empty(0)] * len(micros), [torch.empty(0)] * len(micros))
        reporting = self.ranks.reports_tokens

        def loss_fn(i: int, logits: torch.Tensor) -> torch.Tensor:
            micro = micros[i]
            batch = micro.batch
            logp, ent = self._logprobs(logits, micro)
            mask = batch.loss_mask.to(self.device)
            old_logp = logp.detach() if olds is None else olds[i]
            weights, is_stats = loss.importance_weights(
                old_logp,
                batch.behavior_logprobs.to(self.device),
                mask,
                mode=s.importance_mode,
                cap=s.importance_cap,
            )
            total, stats = loss.policy_loss(
                logp,
                old_logp,
                batch.advantages.to(self.device),
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
            if refs is not None:
                kl = loss.aggregate(
                    loss.kl_penalty(logp, refs[i], mask), mask, s.loss_aggregation, normalizer=normalizer
                )
                total = total + s.kl_coef * kl
                if reporting:
                    acc.kl_ref += float(kl.detach()) / acc.minis
            if reporting:
                tokens = float(batch.num_loss_tokens)
                acc.loss += float(total.detach()) / acc.minis
                acc.entropy += float(entropy.detach()) / acc.minis
                # Counts, exactly (the stats are float32 fractions of this micro-batch's tokens).
                acc.clipped += round(float(stats["clip_fraction"]) * tokens)
                acc.capped += round(float(is_stats["capped_fraction"]) * tokens)
                acc.tokens_through += int(batch.lengths.sum())
            captured.old[i] = old_logp.detach()
            captured.weights[i] = weights.detach()
            return total

        self._pass(micros, loss_fn, train=True)
        if not self.ranks.last_stage:
            return _Captured([], [])
        return captured

    def _optimizer_step(self) -> float:
        """Reduce the gradients over the layout, clip by the global norm, step (through the fp32 masters
        when the model is not fp32), clear; the global grad norm.

        Every trainable parameter takes part, with a zero gradient when no token reached it (an expert no
        token was routed to), so every layout steps the same parameters the same way. A non-finite norm
        skips the update: one NaN would destroy the policy.
        """
        for param in self.params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        parallel.reduce_gradients(self.model)
        if self.masters is not None:
            for param, master in zip(self.params, self.masters, strict=True):
                grad = param.grad
                assert grad is not None  # every parameter was given one above
                master.grad = grad.detach().float()
            grads = [m.grad for m in self.masters]
        else:
            grads = [p.grad for p in self.params]
        norm = parallel.global_grad_norm(self.named, grads)
        clip = self.settings.grad_clip if self.settings.grad_clip > 0 else math.inf
        if math.isfinite(norm):
            # torch's clip_grad_norm_ rule, with the norm of the whole model.
            coefficient = clip / (norm + 1e-6)
            if coefficient < 1.0:
                for grad in grads:
                    if grad is not None:
                        grad.mul_(coefficient)
            self.optimizer.step()
            if self.masters is not None:
                with torch.no_grad():
                    for param, master in zip(self.params, self.masters, strict=True):
                        param.copy_(master)
        self.optimizer.zero_grad(set_to_none=True)
        for param in self.params:
            param.grad = None
        return norm

    def _figures(
        self, figures: StepFigures, acc: _Accumulator, *, loss_tokens: int
    ) -> tuple[StepFigures, float]:
        """`figures` with the step's loss figures over every rank: sums all-reduced, per-token figures from
        every rank's tokens (in (trial, segment) order, so the same at every layout) computed on the writer
        and shared; and the tokens through forward and backward over every rank."""
        sums = parallel.all_reduce_cpu(
            torch.tensor(
                [acc.loss, acc.entropy, acc.kl_ref, acc.clipped, acc.capped, float(acc.tokens_through)],
                dtype=torch.float64,
            )
        ).tolist()
        gathered = parallel.gather_objects(acc.records)
        computed: tuple[StepFigures, float] | None = None
        if gathered is not None:
            ordered = sorted((r for part in gathered for r in part), key=lambda r: r.key)
            trained = [r for r in ordered if not r.probe]
            weights = _cat([r.weights[r.mask] for r in trained], np.float32)
            covered = _cat([r.covered[r.mask] for r in trained], np.bool_)
            merged = figures.model_copy(deep=True)
            _set_fidelity(merged, ordered)
            merged.loss = sums[0]
            merged.entropy = sums[1]
            merged.kl_ref = sums[2]
            merged.clip_fraction = sums[3] / loss_tokens
            merged.is_capped_share = sums[4] / loss_tokens
            merged.is_ess = float(loss.effective_sample_size(torch.from_numpy(weights)))
            merged.replayed_token_share = float(covered.mean()) if covered.size else 0.0
            merged.loss_tokens = loss_tokens
            computed = (merged, sums[5])
            self.token_logprobs = {r.key: _aligned(r) for r in ordered}
        shared: tuple[StepFigures, float] = parallel.broadcast(computed)
        return shared

    def _probe_sequences(self, trials: Sequence[TrialRecord], current: str) -> list[data.TrainSequence]:
        """The segments of `trials` (zero-variance groups) sampled entirely by `current`, for the fidelity
        figures only; with routingReplay Enabled, those with routed experts (as the loss would take)."""
        sequences = data.sequences_from_trials(trials, {t.trial: 0.0 for t in trials})
        return [
            q
            for q in sequences
            if q.policy_versions == (current,)
            and q.num_loss_tokens
            and (self.settings.routing_replay != "Enabled" or q.routed_experts is not None)
        ]

    def _probe_records(self, sequences: Sequence[data.TrainSequence]) -> list[_TokenRecord]:
        """This rank's token records of `sequences` by the policy being trained (a collective: one forward
        without gradient, before the update), marked as probes."""
        if not sequences:
            return []
        micros = self._micro_batches(sequences)
        records = self._token_records(micros, self._forward_logprobs(micros), sequences)
        for r in records:
            r.on_policy, r.probe = True, True
        return records

    def _probe_figures(self, figures: StepFigures, records: list[_TokenRecord]) -> StepFigures:
        """`figures` of a skipped step with the fidelity of the probed trials (a collective)."""
        gathered = parallel.gather_objects(records)
        computed = None
        if gathered is not None:
            ordered = sorted((r for part in gathered for r in part), key=lambda r: r.key)
            computed = figures.model_copy(deep=True)
            _set_fidelity(computed, ordered)
            self.token_logprobs = {r.key: _aligned(r) for r in ordered}
        shared: StepFigures = parallel.broadcast(computed)
        return shared

    # -- weights and state -----------------------------------------------------------------------------

    def hf_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The current policy in Hugging Face layout (what the fleet loads), on the writer; None elsewhere.
        A collective: every rank calls it."""
        return convert.gather_hf_state_dict(self.model, self.arch)

    def _rng_state(self) -> dict[str, Any]:
        return {
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "numpy": _numpy_rng_state(),
            "python": random.getstate(),
        }

    def _set_rng_state(self, rng: dict[str, Any]) -> None:
        torch.set_rng_state(rng["torch"])
        if rng["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
        kind, keys, pos, has_gauss, cached = rng["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
        random.setstate(rng["python"])

    def checkpoint_keys(self) -> set[str]:
        """The layout-independent names of the tensors this rank holds shards of."""
        return {shard.key for shard in convert.parameter_shards(self.model, self.arch).values()}

    def state(self) -> dict[str, Any]:
        """This rank's part of a checkpoint (format 2): the shards of the parameters it saves — every
        tensor-parallel shard, each replicated tensor once, one data-parallel replica — with their fp32
        masters and AdamW moments, the step and this rank's RNG. Tensors are CPU copies."""
        shards = convert.parameter_shards(self.model, self.arch)
        saved = {id(p) for p in parallel.counted_once(self.named)}
        optimizer = self.optimizer.state_dict()["state"]
        params: dict[str, Any] = {}
        for index, (name, param) in enumerate(self.named):
            if id(param) not in saved:
                continue
            shard = shards[name]
            moments = optimizer.get(index, {})
            params[shard.key] = {
                "split": shard.split,
                "parts": shard.parts,
                "index": shard.index,
                "value": param.detach().cpu().clone(),
                "master": self.masters[index].detach().cpu().clone() if self.masters is not None else None,
                "exp_avg": moments["exp_avg"].cpu() if "exp_avg" in moments else None,
                "exp_avg_sq": moments["exp_avg_sq"].cpu() if "exp_avg_sq" in moments else None,
                "adam_step": moments["step"].cpu() if "step" in moments else None,
            }
        return {
            "format": 2,
            "step": self.step,
            "rank": self.ranks.rank,
            "params": params,
            "rng": self._rng_state(),
        }

    def load_sharded(
        self, step: int, pieces: dict[str, list[dict[str, Any]]], *, rng: dict[str, Any] | None
    ) -> None:
        """Restore a format-2 checkpoint from `pieces` (by tensor key, every saved shard of it, from any
        layout): each whole tensor assembled, this rank's shard of it taken. `rng`: this rank's own RNG
        state when the checkpoint was saved at the same number of ranks (else the RNG stays as it is)."""
        shards = convert.parameter_shards(self.model, self.arch)
        moments: dict[int, dict[str, torch.Tensor]] = {}

        def whole(saved: list[dict[str, Any]], field_name: str) -> torch.Tensor | None:
            if saved[0][field_name] is None:
                return None
            ordered = sorted(saved, key=lambda piece: int(piece["index"]))
            if [int(piece["index"]) for piece in ordered] != list(range(int(ordered[0]["parts"]))):
                raise ValueError(f"the checkpoint holds shards {[p['index'] for p in ordered]} of a tensor")
            full: torch.Tensor = convert.assemble(
                [piece[field_name] for piece in ordered], ordered[0]["split"]
            )
            return full

        with torch.no_grad():
            for index, (name, param) in enumerate(self.named):
                shard = shards[name]
                saved = pieces[shard.key]

                def mine(field_name: str, shard: convert.ParamShard = shard, saved: Any = saved) -> Any:
                    full = whole(saved, field_name)
                    return (
                        None
                        if full is None
                        else convert.take_shard(full, shard.split, shard.parts, shard.index)
                    )

                value = mine("value")
                if tuple(value.shape) != tuple(param.shape):
                    raise ValueError(
                        f"{name}: the checkpoint's shard is {tuple(value.shape)}, "
                        f"the model's {tuple(param.shape)}"
                    )
                param.copy_(value)
                if self.masters is not None:
                    master = mine("master")
                    self.masters[index].copy_(master if master is not None else value.float())
                if saved[0]["exp_avg"] is not None:
                    moments[index] = {
                        "step": saved[0]["adam_step"].clone(),
                        "exp_avg": mine("exp_avg").clone(),
                        "exp_avg_sq": mine("exp_avg_sq").clone(),
                    }
        state = self.optimizer.state_dict()
        self.optimizer.load_state_dict({"state": moments, "param_groups": state["param_groups"]})
        self.step = step
        if rng is not None:
            self._set_rng_state(rng)

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore a format-1 checkpoint (one `trainer.pt` of an earlier one-rank trainer)."""
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
        self._set_rng_state(state["rng"])


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
class _Captured:
    """Per micro-batch of one mini-batch, on the last stage: the pre-update log-probs and the IS weights."""

    old: list[torch.Tensor]
    weights: list[torch.Tensor]


@dataclass
class _Accumulator:
    """This rank's running sums over a step's micro-batches and its per-token records."""

    minis: int = 1
    """Mini-batches (optimizer steps) the figures average over."""
    loss: float = 0.0
    entropy: float = 0.0
    kl_ref: float = 0.0
    clipped: float = 0.0
    """Trained tokens whose clipped branch was active."""
    capped: float = 0.0
    """Trained tokens whose importance weight was truncated or masked."""
    tokens_through: int = 0
    records: list[_TokenRecord] = field(default_factory=list)


def _cat(parts: list[np.ndarray], dtype: Any) -> np.ndarray:
    return np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype=dtype)


def _set_fidelity(figures: StepFigures, ordered: Sequence[_TokenRecord]) -> None:
    """The fidelity figures of `ordered`'s tokens sampled by the version being trained (trained or probed)."""
    on_policy = [r for r in ordered if r.on_policy]
    train = _cat([r.logp[r.mask] for r in on_policy], np.float32)
    behavior = _cat([r.behavior[r.mask] for r in on_policy], np.float32)
    fid = loss.fidelity_stats(
        torch.from_numpy(train)[None], torch.from_numpy(behavior)[None], torch.ones(1, len(train))
    )
    figures.fidelity_pearson = fid.pearson
    figures.fidelity_mean_abs_logprob_delta = fid.mean_abs_logprob_delta
    figures.fidelity_max_abs_logprob_delta = fid.max_abs_logprob_delta
    figures.fidelity_kl = fid.kl
    figures.fidelity_tokens = fid.tokens
    probed = {r.key[0] for r in ordered if r.probe}
    if probed:
        figures.fidelity_probe_trials = len(probed)


def _aligned(record: _TokenRecord) -> list[float | None]:
    """A record's log-probs aligned to its segment's tokens (token 0 is never predicted; untrained: None)."""
    return [None] + [
        float(v) if m else None for v, m in zip(record.logp.tolist(), record.mask.tolist(), strict=True)
    ]

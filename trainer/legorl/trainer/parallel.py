"""The trainer's ranks: who does what, vocab-parallel log-probs, gradient reduction and the global grad norm.

One process per rank (torchrun, or the indexed trainer Job), megatron's parallel state holding the groups.
What this module adds on top of megatron, because megatron's own versions need CUDA or its DDP wrapper:

- `Ranks`: this process's coordinates and roles. Global rank 0 is the *writer*: it alone publishes weights,
  writes metrics, state and checkpoints' manifests, and syncs the fleet; the others follow its decisions
  (`broadcast`).
- `vocab_parallel_logprobs`: log-probs of the targets and the entropy from logits split over the vocabulary
  (tensor parallelism), without ever gathering the full vocabulary: three all-reduces of [B, S] tensors per
  micro-batch, and a backward that is local to each rank (every rank of a tensor-parallel group computes the
  same loss, so a collective in backward would count its gradient TP times).
- `reduce_gradients`: what megatron's DDP and `finalize_model_grads` do — sum over the tensor-parallel group
  the gradients of parameters each rank saw only part of the data for (norms and the router under sequence
  parallelism, q/k norms whose heads are split), then sum over data parallelism: dense parameters over the
  data-parallel group, expert parameters over the expert-data-parallel group. Sums, not means: the loss is
  normalised over the whole batch before backward.
- `global_grad_norm`: the L2 norm over every parameter of the model once — sharded parameters counted on
  each shard, replicated ones on one replica — whatever the layout.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from legorl.trainer.models import compat

with compat.silence_import_warnings():
    from megatron.core import parallel_state as ps

__all__ = [
    "Ranks",
    "broadcast",
    "global_grad_norm",
    "reduce_gradients",
    "vocab_parallel_logprobs",
]

T = TypeVar("T")


@dataclass(frozen=True)
class Ranks:
    """This process's place in the layout (read from megatron's parallel state)."""

    rank: int
    world: int
    tensor_rank: int
    tensor_size: int
    pipeline_rank: int
    pipeline_size: int
    data_rank: int
    data_size: int
    expert_rank: int
    expert_size: int
    expert_data_rank: int
    expert_data_size: int

    @classmethod
    def current(cls) -> Ranks:
        return cls(
            rank=dist.get_rank(),
            world=dist.get_world_size(),
            tensor_rank=ps.get_tensor_model_parallel_rank(),
            tensor_size=ps.get_tensor_model_parallel_world_size(),
            pipeline_rank=ps.get_pipeline_model_parallel_rank(),
            pipeline_size=ps.get_pipeline_model_parallel_world_size(),
            data_rank=ps.get_data_parallel_rank(with_context_parallel=True),
            data_size=ps.get_data_parallel_world_size(with_context_parallel=True),
            expert_rank=ps.get_expert_model_parallel_rank(),
            expert_size=ps.get_expert_model_parallel_world_size(),
            expert_data_rank=ps.get_expert_data_parallel_rank(),
            expert_data_size=ps.get_expert_data_parallel_world_size(),
        )

    @property
    def writer(self) -> bool:
        """Global rank 0: publishes weights, writes metrics, state and checkpoint manifests, syncs fleets."""
        return self.rank == 0

    @property
    def first_stage(self) -> bool:
        return self.pipeline_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pipeline_rank == self.pipeline_size - 1

    @property
    def reports_tokens(self) -> bool:
        """One rank per data-parallel replica reports per-token figures: tensor rank 0 of the last stage
        (the other tensor ranks computed the same values)."""
        return self.last_stage and self.tensor_rank == 0


_CONTROL: Any = None


def control_group() -> Any:
    """A gloo group over every rank, for Python objects and small CPU tensors (figures, decisions), so they
    need no GPU buffers whatever the main backend is."""
    global _CONTROL  # noqa: PLW0603 -- one group per process, made on first use
    if _CONTROL is None:
        _CONTROL = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else dist.group.WORLD
    return _CONTROL


def broadcast(value: object, src: int = 0) -> Any:
    """`value` as rank `src` has it, on every rank (a picklable object; the others pass anything)."""
    if dist.get_world_size() == 1:
        return value
    box: list[Any] = [value]
    dist.broadcast_object_list(box, src=src, group=control_group())
    return box[0]


def gather_objects(value: T) -> list[T] | None:
    """Every rank's `value` on the writer (rank 0), in rank order; None elsewhere."""
    if dist.get_world_size() == 1:
        return [value]
    out: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(value, out, dst=0, group=control_group())
    return out


def shutdown() -> None:
    """Tear megatron's groups and the process group down (every rank, at the end). Left to the interpreter's
    exit, gloo's threads can outlive it: a rank then dies with "terminate called without an active
    exception" (SIGABRT), and torchrun fails the whole run after its work was done."""
    global _CONTROL  # noqa: PLW0603 -- the process's one control group goes with it
    if not dist.is_initialized():
        return
    if dist.get_world_size() > 1:
        dist.barrier(group=control_group())
    _CONTROL = None
    ps.destroy_model_parallel()
    dist.destroy_process_group()


def all_reduce_cpu(values: torch.Tensor, op: Any = None) -> torch.Tensor:
    """Sum (or `op`) of a small CPU tensor over every rank, through the control group."""
    if dist.get_world_size() == 1:
        return values
    out = values.detach().clone()
    dist.all_reduce(out, op=op if op is not None else dist.ReduceOp.SUM, group=control_group())
    return out


# --- vocab-parallel log-probs and entropy ------------------------------------------------------------------


class _VocabParallelLogprobs(torch.autograd.Function):
    """(log p(target), entropy) per position from logits whose vocabulary is split over the TP group.

    Forward: the global max, Σ exp, Σ p·logit and the target's logit each need one all-reduce (a sum, or a
    max) of a [B, S] tensor. Backward is local: with lse the global log-sum-exp and p = exp(l − lse),
    ∂ log p_t / ∂ l_j = 1[j = t] − p_j and ∂H/∂l_j = −p_j (log p_j + H).
    """

    @staticmethod
    def forward(
        ctx: Any, logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, group: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # float32 at least (float64 stays float64).
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        local_max = logits.max(dim=-1).values
        global_max = local_max.clone()
        if group is not None:
            dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - global_max.unsqueeze(-1)
        exp = shifted.exp()
        sums = torch.stack([exp.sum(-1), (exp * shifted).sum(-1)])
        vocab = logits.shape[-1]
        local_targets = targets - vocab_start
        owned = (local_targets >= 0) & (local_targets < vocab)
        picked = shifted.gather(-1, local_targets.clamp(0, vocab - 1).unsqueeze(-1)).squeeze(-1)
        picked = torch.where(owned, picked, torch.zeros_like(picked))
        if group is not None:
            stacked = torch.cat([sums, picked.unsqueeze(0)])
            dist.all_reduce(stacked, group=group)
            sums, picked = stacked[:2], stacked[2]
        sum_exp, sum_exp_shifted = sums[0], sums[1]
        log_z = sum_exp.log()  # lse − max
        logp = picked - log_z
        entropy = log_z - sum_exp_shifted / sum_exp
        # One [B, S, V/TP] tensor kept for backward (p = exp(log p)), as megatron's cross entropy keeps one.
        ctx.save_for_backward(shifted - log_z.unsqueeze(-1), entropy, local_targets, owned)
        ctx.vocab = vocab
        return logp, entropy

    @staticmethod
    def backward(
        ctx: Any, grad_logp: torch.Tensor, grad_entropy: torch.Tensor
    ) -> tuple[torch.Tensor | None, None, None, None]:
        log_probs, entropy, local_targets, owned = ctx.saved_tensors
        probs = log_probs.exp()
        grad = -probs * grad_logp.unsqueeze(-1)
        onehot = torch.zeros_like(probs)
        onehot.scatter_(-1, local_targets.clamp(0, ctx.vocab - 1).unsqueeze(-1), 1.0)
        grad = grad + onehot * (grad_logp * owned).unsqueeze(-1)
        grad = grad - probs * (log_probs + entropy.unsqueeze(-1)) * grad_entropy.unsqueeze(-1)
        return grad, None, None, None


def vocab_parallel_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(target), entropy) [B, S], float32 or wider, from this rank's vocabulary slice of the logits
    [B, S, V/TP].

    `temperature` divides the logits first (the engine reports log-probs of logits / T). With one
    tensor-parallel rank this is log_softmax and the softmax entropy over the whole vocabulary.
    """
    size = ps.get_tensor_model_parallel_world_size()
    group = ps.get_tensor_model_parallel_group() if size > 1 else None
    start = ps.get_tensor_model_parallel_rank() * logits.shape[-1]
    if temperature != 1.0:
        logits = logits / temperature
    logp, ent = _VocabParallelLogprobs.apply(logits, targets.long(), start, group)  # type: ignore[no-untyped-call]  # Function.apply is untyped
    return logp, ent


# --- gradients ---------------------------------------------------------------------------------------------


def _partial_over_tensor_group(name: str, param: torch.nn.Parameter) -> bool:
    """The parameter is replicated over TP but each TP rank's gradient covers only part of the data."""
    return bool(getattr(param, "sequence_parallel", False)) or "q_layernorm" in name or "k_layernorm" in name


def _is_expert(param: torch.nn.Parameter) -> bool:
    """megatron marks expert-parallel parameters `allreduce=False` (reduced over expert data parallelism)."""
    return not getattr(param, "allreduce", True)


def _coalesced_all_reduce(grads: Sequence[torch.Tensor], group: Any) -> None:
    if not grads:
        return
    flat = torch._utils._flatten_dense_tensors(list(grads))  # type: ignore[no-untyped-call]  # torch: unannotated
    dist.all_reduce(flat, group=group)
    synced_all = torch._utils._unflatten_dense_tensors(flat, list(grads))  # type: ignore[no-untyped-call]  # same
    for grad, synced in zip(grads, synced_all, strict=True):
        grad.copy_(synced)


def reduce_gradients(model: torch.nn.Module) -> None:
    """Make every rank's `.grad` the gradient of the whole batch's loss for the parameters it holds."""
    named = [(n, p, p.grad) for n, p in model.named_parameters() if p.requires_grad and p.grad is not None]
    if ps.get_tensor_model_parallel_world_size() > 1:
        _coalesced_all_reduce(
            [g for n, p, g in named if _partial_over_tensor_group(n, p)], ps.get_tensor_model_parallel_group()
        )
    if ps.get_data_parallel_world_size(with_context_parallel=True) > 1:
        _coalesced_all_reduce(
            [g for _, p, g in named if not _is_expert(p)],
            ps.get_data_parallel_group(with_context_parallel=True),
        )
    if ps.get_expert_data_parallel_world_size() > 1:
        _coalesced_all_reduce([g for _, p, g in named if _is_expert(p)], ps.get_expert_data_parallel_group())


def counted_once(params: Iterable[tuple[str, torch.nn.Parameter]]) -> list[torch.nn.Parameter]:
    """The parameters this rank counts in a model-wide sum (e.g. the grad norm): every shard once, every
    replicated parameter on exactly one of its replicas."""
    tp_rank = ps.get_tensor_model_parallel_rank()
    dp_rank = ps.get_data_parallel_rank(with_context_parallel=True)
    edp_rank = ps.get_expert_data_parallel_rank()
    out = []
    for _, param in params:
        sharded = bool(getattr(param, "tensor_model_parallel", False))
        if not sharded and tp_rank != 0:
            continue
        if (edp_rank if _is_expert(param) else dp_rank) != 0:
            continue
        out.append(param)
    return out


def global_grad_norm(
    named: Sequence[tuple[str, torch.nn.Parameter]], grads: Sequence[torch.Tensor | None]
) -> float:
    """L2 norm of the whole model's gradient. `grads[i]` is `named[i]`'s gradient (or its fp32 master's)."""
    counted = {id(p) for p in counted_once(named)}
    squares = [
        grad.detach().double().pow(2).sum()
        for (_, param), grad in zip(named, grads, strict=True)
        if grad is not None and id(param) in counted
    ]
    # One device-to-host copy, not one per parameter.
    local = torch.stack(squares).sum().cpu() if squares else torch.zeros((), dtype=torch.float64)
    total = all_reduce_cpu(local.reshape(1))
    return math.sqrt(float(total[0]))

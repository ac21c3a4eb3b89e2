"""Routing replay (R3): feed the experts the engine chose into Megatron's routers, and guard against no-ops.

The engine records, for every token it ran, the top-k experts of every MoE layer: per sequence an array
of shape (rows, layers, top_k), row i = token i (rows = len(tokens) - 1, the last sampled token never
went through the model). The training forward feeds tokens[:-1] of a right-padded micro-batch, so input
position i of sequence b is row i. Megatron's `RouterReplay` takes, per MoE layer, an int64 tensor
[S*B, top_k] in its token order, which is sequence-major: token index = s*B + b.

megatron-core 0.16 replays only when the config has `moe_enable_routing_replay` and the router is not
fused (`moe_router_fusion` skips replay silently); each MoE layer's router owns one `RouterReplay`,
kept in a class-level list. `check_replay_active` verifies all of that before training relies on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import torch

from legorl.trainer.models import compat
from legorl.trainer.models.model import MoeArchitecture, unwrap

with compat.silence_import_warnings():
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.moe.router_replay import (
        RouterReplay,
        RouterReplayAction,
    )

__all__ = [
    "ReplayError",
    "RouterReplayer",
    "check_replay_active",
    "engine_to_megatron",
    "megatron_to_engine",
    "model_router_replays",
    "resolve_routing_replay",
    "stage_columns",
    "stage_indices",
    "stage_moe_layers",
]

RoutingReplayMode = Literal["Auto", "Enabled", "Disabled"]


class ReplayError(ValueError):
    """Routing replay cannot do what was asked: wrong shapes, ids, mode, or a model that would ignore it."""


def resolve_routing_replay(mode: RoutingReplayMode, arch: MoeArchitecture) -> bool:
    """Whether to replay routing: Auto = on for mixture-of-experts models, off for dense ones."""
    if mode == "Auto":
        return arch.is_moe
    if mode == "Enabled":
        if not arch.is_moe:
            raise ReplayError(
                "routing replay is Enabled but the model is dense (no mixture-of-experts layers); "
                "set it to Auto or Disabled"
            )
        return True
    if mode == "Disabled":
        return False
    raise ReplayError(f"routing replay mode {mode!r}: use 'Auto', 'Enabled' or 'Disabled'")


def model_router_replays(model: torch.nn.Module) -> list[Any]:
    """The `RouterReplay` of each MoE router of `model`, in layer order (routers without one skipped)."""
    return [
        module.router_replay
        for module in unwrap(model).modules()
        if isinstance(module, TopKRouter) and module.router_replay is not None
    ]


def stage_moe_layers(model: torch.nn.Module, arch: MoeArchitecture) -> list[int]:
    """Global indices of the MoE layers this rank's model holds (its pipeline stage's share), in order."""
    held = [int(block.layer_number) - 1 for block in unwrap(model).decoder.layers]
    return [layer for layer in held if layer in arch.moe_layers]


def stage_columns(model: torch.nn.Module, arch: MoeArchitecture) -> list[int]:
    """Which of the engine's routing columns (one per MoE layer of the whole model) this stage replays."""
    return [arch.moe_layers.index(layer) for layer in stage_moe_layers(model, arch)]


def check_replay_active(model: torch.nn.Module, arch: MoeArchitecture) -> None:
    """Raise ReplayError unless replaying routing on `model` will really change what its routers do."""
    config = unwrap(model).config
    if getattr(config, "moe_router_fusion", False):
        raise ReplayError(
            "the model's config has moe_router_fusion=True: megatron's fused router skips routing replay "
            "without a word; build it with legorl.trainer.models.model.build_model (router fusion off)"
        )
    if not getattr(config, "moe_enable_routing_replay", False):
        raise ReplayError(
            "the model was built without routing replay (moe_enable_routing_replay=False); "
            "build it with build_model(..., routing_replay=True)"
        )
    instances = model_router_replays(model)
    expected = len(stage_moe_layers(model, arch))
    if len(instances) != expected:
        raise ReplayError(
            f"the model has {len(instances)} routers with replay, but its layers include {expected} of the "
            f"architecture's {arch.num_moe_layers} MoE layers; every MoE layer must replay"
        )
    registered = RouterReplay.global_router_replay_instances
    if len(registered) != len(instances) or any(
        a is not b for a, b in zip(registered, instances, strict=False)
    ):
        raise ReplayError(
            "megatron's global list of replay instances is not this model's routers (another model with "
            "routing replay was built after it, or the list was cleared); build the replaying model last"
        )


def stage_indices(
    per_layer: Sequence[torch.Tensor],
    columns: Sequence[int],
    *,
    batch: int,
    tensor_rank: int,
    tensor_size: int,
) -> list[torch.Tensor]:
    """This rank's share of `engine_to_megatron`'s per-layer indices: its stage's MoE layers (`columns`) and,
    under sequence parallelism, its slice of the sequence (rows are sequence-major: s·B + b)."""
    out = [per_layer[c] for c in columns]
    if tensor_size == 1:
        return out
    tokens = out[0].shape[0] if out else 0
    if tokens % (batch * tensor_size):
        raise ReplayError(f"{tokens // max(batch, 1)} positions do not split over {tensor_size} tensor ranks")
    share = tokens // tensor_size
    return [layer[tensor_rank * share : (tensor_rank + 1) * share] for layer in out]


def _as_array(entry: np.ndarray | torch.Tensor) -> np.ndarray:
    if isinstance(entry, torch.Tensor):
        return entry.detach().cpu().numpy()
    return np.asarray(entry)


def engine_to_megatron(
    routing: Sequence[np.ndarray | torch.Tensor | None],
    seq_len: int,
    arch: MoeArchitecture,
    *,
    fallback: Sequence[torch.Tensor] | None = None,
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Engine routing of a right-padded micro-batch -> (per-MoE-layer int64 [seq_len*B, top_k], coverage).

    `routing[b]` is sequence b's (rows, layers, top_k) array or None (no routing recorded). Tokens without
    a recorded row (padding, rows beyond the array, sequences without routing) get `fallback`'s experts
    when given (per-layer tensors in the output layout, e.g. recorded from a forward of the same batch),
    else the fixed set 0..top_k-1. `coverage` is a bool [B, seq_len]: True where the row was recorded.
    """
    batch = len(routing)
    layers, top_k, experts = arch.num_moe_layers, arch.top_k, arch.num_experts
    if not arch.is_moe:
        raise ReplayError("routing replay needs a mixture-of-experts model; this one is dense")
    if seq_len < 0:
        raise ReplayError(f"seq_len={seq_len} must be >= 0")
    out = np.empty((seq_len, batch, layers, top_k), dtype=np.int64)
    out[...] = np.arange(top_k, dtype=np.int64)
    covered = np.zeros((batch, seq_len), dtype=bool)
    for b, entry in enumerate(routing):
        if entry is None:
            continue
        arr = _as_array(entry)
        where = f"routing of sequence {b}"
        if arr.ndim != 3:
            raise ReplayError(f"{where}: shape {arr.shape} is not (rows, layers, top_k)")
        rows = arr.shape[0]
        if arr.shape[1] != layers:
            raise ReplayError(
                f"{where}: {arr.shape[1]} layers recorded, the model has {layers} MoE layers "
                f"(layers {list(arch.moe_layers)}); was it recorded on another model?"
            )
        if arr.shape[2] != top_k:
            raise ReplayError(
                f"{where}: top_k is {arr.shape[2]}, the model routes to {top_k} experts per token"
            )
        if rows > seq_len:
            raise ReplayError(
                f"{where}: {rows} rows but the micro-batch has only {seq_len} positions; the training "
                "forward feeds tokens[:-1], so rows must be <= seq_len"
            )
        if rows == 0:
            continue
        if not np.issubdtype(arr.dtype, np.integer):
            raise ReplayError(f"{where}: expert ids must be integers, got {arr.dtype}")
        low, high = int(arr.min()), int(arr.max())
        if low < 0 or high >= experts:
            bad = low if low < 0 else high
            raise ReplayError(f"{where}: expert id {bad} is out of range [0, {experts})")
        ordered = np.sort(arr, axis=-1)
        if top_k > 1 and bool((ordered[..., 1:] == ordered[..., :-1]).any()):
            raise ReplayError(f"{where}: a token lists the same expert twice in its top-{top_k}")
        out[:rows, b] = arr
        covered[b, :rows] = True
    per_layer = [
        torch.from_numpy(np.ascontiguousarray(out[:, :, i, :]).reshape(seq_len * batch, top_k))
        for i in range(layers)
    ]
    if fallback is not None:
        if len(fallback) != layers:
            raise ReplayError(f"fallback has {len(fallback)} layers, the model has {layers} MoE layers")
        keep = torch.from_numpy(covered.T.reshape(-1).copy())[:, None]
        merged = []
        for i, (recorded, fill) in enumerate(zip(per_layer, fallback, strict=True)):
            if tuple(fill.shape) != (seq_len * batch, top_k):
                raise ReplayError(
                    f"fallback layer {i} has shape {tuple(fill.shape)}, expected {(seq_len * batch, top_k)}"
                )
            merged.append(torch.where(keep, recorded, fill.detach().to("cpu", torch.int64)))
        per_layer = merged
    return per_layer, torch.from_numpy(covered)


def megatron_to_engine(
    per_layer: Sequence[torch.Tensor], batch: int, lengths: Sequence[int] | torch.Tensor
) -> list[np.ndarray]:
    """Inverse of `engine_to_megatron`: per-layer [S*B, k] -> per sequence (lengths[b], layers, k) int64."""
    if not per_layer:
        raise ReplayError("no MoE layers given")
    stacked = torch.stack([t.detach().to("cpu", torch.int64) for t in per_layer])  # [L, S*B, k]
    layers, tokens, top_k = stacked.shape
    if batch < 1 or tokens % batch:
        raise ReplayError(f"{tokens} tokens per layer do not split into a batch of {batch}")
    seq_len = tokens // batch
    rows = [int(n) for n in (lengths.tolist() if isinstance(lengths, torch.Tensor) else lengths)]
    if len(rows) != batch:
        raise ReplayError(f"{len(rows)} lengths for a batch of {batch}")
    if any(not 0 <= n <= seq_len for n in rows):
        raise ReplayError(f"lengths {rows} must lie in [0, {seq_len}]")
    grid = stacked.view(layers, seq_len, batch, top_k).permute(2, 1, 0, 3).numpy()  # [B, S, L, k]
    return [np.ascontiguousarray(grid[b, : rows[b]]) for b in range(batch)]


class RouterReplayer:
    """Drives the routers' replay state for one step: record, replay, switch for recomputation, clear.

    With a model, it drives that model's routers; without one, megatron's global list (the routers of the
    last model built with replay). Call `clear()` after every step: megatron keeps the replayed indices
    (and a per-forward queue for recomputation) until cleared.
    """

    def __init__(self, model: torch.nn.Module | None = None) -> None:
        self._model = model

    def _instances(self) -> list[Any]:
        if self._model is not None:
            return model_router_replays(self._model)
        return list(RouterReplay.global_router_replay_instances)

    def record(self) -> None:
        """The next forwards route normally and keep each layer's chosen experts (see `recorded()`)."""
        for instance in self._instances():
            instance.set_router_replay_action(RouterReplayAction.RECORD)

    def replay(self, indices: Sequence[torch.Tensor]) -> None:
        """The next forward routes every token to `indices` (one [S*B, top_k] int64 tensor per MoE layer).

        Each call also queues the indices for one recomputation in backward (see `before_backward`).
        """
        instances = self._instances()
        if len(indices) != len(instances):
            raise ReplayError(
                f"{len(indices)} layers of routing for {len(instances)} routers with replay; "
                "was the model built with routing_replay=True?"
            )
        for instance, layer in zip(instances, indices, strict=True):
            if layer.dim() != 2 or layer.dtype != torch.int64:
                raise ReplayError(
                    f"replay indices must be int64 [tokens, top_k], got {layer.dtype} {tuple(layer.shape)}"
                )
            instance.set_target_indices(layer)
            instance.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def route_normally(self) -> None:
        """The next forward routes as the router decides, keeping the indices queued for recomputation."""
        for instance in self._instances():
            instance.clear_router_replay_action()

    def backward_of(self, replayed: bool) -> None:
        """The backward about to run is of a forward that was (or was not) replayed: recomputation pops the
        oldest queued indices (megatron's queue is first in, first out, as 1F1B's backwards are in order)."""
        for instance in self._instances():
            if replayed:
                instance.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
            else:
                instance.clear_router_replay_action()

    def before_backward(self) -> None:
        """Recomputation in backward (recompute='full') replays the queued indices, in forward order.

        Only routers that are replaying switch; a backward after a plain forward is left alone.
        """
        for instance in self._instances():
            if instance.router_replay_action == RouterReplayAction.REPLAY_FORWARD:
                instance.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)

    def recorded(self) -> list[torch.Tensor]:
        """Per MoE layer, the experts chosen in the last recorded forward ([S*B, top_k], sequence-major)."""
        out = []
        for i, instance in enumerate(self._instances()):
            indices = instance.get_recorded_indices()
            if indices is None:
                raise ReplayError(f"MoE layer {i} recorded nothing; call record() before the forward")
            out.append(indices)
        return out

    def clear(self) -> None:
        """Forget recorded and replayed indices and return every router to normal routing."""
        for instance in self._instances():
            instance.clear_indices()
            instance.clear_router_replay_action()


class RoutingAgreement:
    """Routing parity, measured: per (token, MoE layer) of the forwards it watches, whether the experts the
    router used (under replay, the engine's) are the experts the router's own logits choose.

    Replay makes the trainer route as the engine did; this checks that what the engine recorded is what
    these weights route to: a row recorded for another token, another layer or another model, or a replay
    that did not reach a router, shows as disagreement (near-ties between a bf16 engine and this trainer do
    too, a little). Each watched forward counts only the positions `mask` says were recorded (bool
    [S*B] in megatron's sequence-major token order, this rank's slice under sequence parallelism).
    Use it around forwards without recomputation (scoring), where each router runs once per forward.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self._routers = [m for m in unwrap(model).modules() if isinstance(m, TopKRouter)]
        self._handles: list[Any] = []
        self.mask: torch.Tensor | None = None
        self.agreeing = 0
        self.counted = 0

    def __enter__(self) -> RoutingAgreement:
        self._handles = [router.register_forward_hook(self._observe) for router in self._routers]
        return self

    def __exit__(self, *_: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _observe(self, router: Any, inputs: tuple[torch.Tensor, ...], output: Any) -> None:
        if self.mask is None:
            return
        _, routing_map = output
        k = router.topk
        with torch.no_grad():
            logits = router.gating(inputs[0]).reshape(routing_map.shape[0], -1)
            own = logits.topk(k, dim=-1).indices.sort(dim=-1).values
            used = routing_map.to(torch.int8).topk(k, dim=-1).indices.sort(dim=-1).values
            agree = (own == used).all(dim=-1) & (routing_map.sum(dim=-1) == k)
            mask = self.mask.to(agree.device)
            if mask.shape != agree.shape:
                raise ReplayError(
                    f"routing agreement: a mask of {tuple(mask.shape)} positions for a router that saw "
                    f"{tuple(agree.shape)} tokens"
                )
            self.agreeing += int((agree & mask).sum())
            self.counted += int(mask.sum())


def local_token_mask(covered: torch.Tensor, *, tensor_rank: int, tensor_size: int) -> torch.Tensor:
    """A micro-batch's [B, S] position mask in megatron's token order (s·B + b), this rank's share of the
    sequence under sequence parallelism: the order the routers see tokens in."""
    rows, width = covered.shape
    order = covered.t().reshape(width * rows)
    share = order.shape[0] // tensor_size
    return order[tensor_rank * share : (tensor_rank + 1) * share]

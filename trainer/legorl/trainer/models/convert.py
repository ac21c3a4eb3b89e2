"""HF safetensors <-> Megatron GPTModel weights for Qwen3(-MoE): load, export, and write a HF checkpoint.

Tensor rules (checked bit-exactly and against transformers' logits in tests/trainer/test_trainer_model.py):
- q/k/v fuse into `linear_qkv` grouped per KV head: for each of the G groups, its r = heads/G query heads,
  then its key head, then its value head (q viewed [G, r·d, H], k and v [G, d, H], joined on dim 1).
- an expert's (or dense MLP's) `linear_fc1` is the gate rows then the up rows; `linear_fc2` is down.
- `mlp.gate` is `mlp.router`; `post_attention_layernorm` is `pre_mlp_layernorm`; q_norm/k_norm are
  `q_layernorm`/`k_layernorm`.
On disk, transformers writes one tensor per expert (`mlp.experts.{e}.gate_proj.weight`, ...) even though a
loaded transformers-5 model fuses them; this module reads and writes the on-disk layout that vLLM and
transformers load. Transformer Engine layer names (norms fused into the following linear) are resolved
too, so a TE-spec model converts with the same rules.

At any parallel layout: tensor parallelism cuts each parameter along one dimension (`Split`), pipeline stages
hold a range of layers (numbered from 0 on each stage; `layer_number` says which), expert-parallel ranks a
range of experts (`local_expert_indices`). `load_hf_weights` gives every rank only its slices, reading just
those from the safetensors files; `gather_hf_state_dict` assembles the whole model on the writer, the same
tensors bit for bit from every layout (tests/trainer/test_trainer_parallel.py).
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from safetensors import safe_open

from legorl.trainer.models import compat
from legorl.trainer.models.model import MoeArchitecture, unwrap
from legorl.trainer.sync.publish import save_readable

with compat.silence_import_warnings():
    from megatron.core import parallel_state

__all__ = [
    "ConversionError",
    "HfExport",
    "ParamShard",
    "assemble",
    "export_hf_state_dict",
    "gather_hf_state_dict",
    "hf_names",
    "hf_tensor_locations",
    "load_hf_weights",
    "parameter_shards",
    "save_hf_checkpoint",
    "take_shard",
    "untrained_tensors",
]

logger = logging.getLogger(__name__)

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
# Files that carry weights: never copied from the source next to freshly written ones.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
_WEIGHT_INDEXES = (SAFETENSORS_INDEX, "pytorch_model.bin.index.json")


class ConversionError(ValueError):
    """Weights that do not fit the model: missing, unexpected, or misshapen tensors; unsupported layouts."""


Split = Literal["none", "rows", "cols", "gate_up"] | tuple[int, ...]
"""How tensor parallelism cuts a Megatron parameter: `none` (replicated), `rows` / `cols` (contiguous chunks
of dim 0 / dim 1: the embedding and output layer by vocabulary, the fused QKV by query group, the projections
into the residual stream by input), `gate_up` (the gate rows and the up rows each chunked, rank r holding
[gate_r; up_r], as megatron's SwiGLU layers do), or a tuple of segment sizes along dim 0, each segment chunked
the same way (rank r holding [seg0_r; seg1_r; ...]: Gated DeltaNet's input projection and convolution)."""


@dataclass(frozen=True)
class _Rule:
    """One Megatron parameter of this rank and the HF tensors it is made of."""

    megatron: str
    """The parameter's name in this rank's model (pipeline stages number their layers from 0)."""
    hf: tuple[str, ...]
    """The HF tensors (global names: layer and expert indices of the whole model)."""
    to_megatron: Callable[[list[torch.Tensor]], torch.Tensor]
    """HF tensors -> the whole (unsharded) Megatron tensor."""
    to_hf: Callable[[torch.Tensor], list[torch.Tensor]]
    """The whole Megatron tensor -> the HF tensors."""
    split: Split = "none"
    expert: bool = False
    """An expert's weight: sharded over the expert tensor-parallel group, held by one expert-parallel rank."""
    qkv: tuple[int, int, int] | None = None
    """(query groups, query heads per group, head dim) of a fused QKV weight."""
    read_whole: bool = False
    """Read the HF tensors whole and cut this rank's shard from the Megatron tensor (layouts whose shards are
    not slices of the HF tensors: gated QKV, Gated DeltaNet)."""


def _same(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0]


def _one(tensor: torch.Tensor) -> list[torch.Tensor]:
    return [tensor]


def _concat(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(parts, dim=0)


def _split_halves(tensor: torch.Tensor) -> list[torch.Tensor]:
    gate, up = tensor.chunk(2, dim=0)
    return [gate, up]


def _fuse_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, groups: int, per_group: int, d: int
) -> torch.Tensor:
    hidden = q.shape[1]
    for name, tensor, rows in (("q", q, groups * per_group * d), ("k", k, groups * d), ("v", v, groups * d)):
        if tuple(tensor.shape) != (rows, hidden):
            raise ConversionError(f"{name}_proj has shape {tuple(tensor.shape)}, expected {(rows, hidden)}")
    fused = torch.cat(
        [
            q.reshape(groups, per_group * d, hidden),
            k.reshape(groups, d, hidden),
            v.reshape(groups, d, hidden),
        ],
        dim=1,
    )
    return fused.reshape(-1, hidden)


def _qkv_rules(
    arch: MoeArchitecture,
) -> tuple[Callable[..., torch.Tensor], Callable[..., list[torch.Tensor]]]:
    groups, d, hidden = arch.num_key_value_heads, arch.head_dim, arch.hidden_size
    per_group = arch.num_attention_heads // groups

    def fuse(parts: list[torch.Tensor]) -> torch.Tensor:
        q, k, v = parts
        if tuple(q.shape) != (groups * per_group * d, hidden):
            raise ConversionError(
                f"q_proj has shape {tuple(q.shape)}, expected {(groups * per_group * d, hidden)}"
            )
        return _fuse_qkv(q, k, v, groups=groups, per_group=per_group, d=d)

    def split(fused: torch.Tensor) -> list[torch.Tensor]:
        grouped = fused.reshape(groups, (per_group + 2) * d, hidden)
        q, k, v = torch.split(grouped, [per_group * d, d, d], dim=1)
        return [q.reshape(-1, hidden), k.reshape(-1, hidden), v.reshape(-1, hidden)]

    return fuse, split


def _gated_qkv_rules(
    arch: MoeArchitecture,
) -> tuple[Callable[..., torch.Tensor], Callable[..., list[torch.Tensor]]]:
    """Full attention with an output gate: HF's q_proj holds [q_h; gate_h] per head; megatron's linear_qkv per
    query group [q heads; their gates; k; v]."""
    groups, d, hidden = arch.num_key_value_heads, arch.head_dim, arch.hidden_size
    per_group = arch.num_attention_heads // groups

    def fuse(parts: list[torch.Tensor]) -> torch.Tensor:
        q, k, v = parts
        for name, tensor, rows in (
            ("q_proj", q, groups * per_group * 2 * d),
            ("k_proj", k, groups * d),
            ("v_proj", v, groups * d),
        ):
            if tuple(tensor.shape) != (rows, hidden):
                raise ConversionError(f"{name} has shape {tuple(tensor.shape)}, expected {(rows, hidden)}")
        heads = q.reshape(groups, per_group, 2, d, hidden)
        fused = torch.cat(
            [
                heads[:, :, 0].reshape(groups, per_group * d, hidden),
                heads[:, :, 1].reshape(groups, per_group * d, hidden),
                k.reshape(groups, d, hidden),
                v.reshape(groups, d, hidden),
            ],
            dim=1,
        )
        return fused.reshape(-1, hidden)

    def split(fused: torch.Tensor) -> list[torch.Tensor]:
        grouped = fused.reshape(groups, (2 * per_group + 2) * d, hidden)
        q, gate, k, v = torch.split(grouped, [per_group * d, per_group * d, d, d], dim=1)
        heads = torch.stack(
            [q.reshape(groups, per_group, d, hidden), gate.reshape(groups, per_group, d, hidden)], dim=2
        )
        return [heads.reshape(-1, hidden), k.reshape(-1, hidden), v.reshape(-1, hidden)]

    return fuse, split


def _gdn_rules(arch: MoeArchitecture, m: str, h: str) -> list[_Rule]:
    """A Gated DeltaNet layer: megatron's in_proj holds [q; k; v; z; b; a] (each over all heads), its conv
    channels [q; k; v]. Qwen3-Next's checkpoint groups in_proj_qkvz and in_proj_ba per key head; Qwen3.5's
    keeps     the four projections apart, already in megatron's order."""
    nk, nv = arch.linear_num_key_heads, arch.linear_num_value_heads
    dk, dv, hidden = arch.linear_key_head_dim, arch.linear_value_head_dim, arch.hidden_size
    r = nv // nk
    qk, v = nk * dk, nv * dv
    attn, src = m + "self_attention.", h + "linear_attn."
    segments = (qk, qk, v, v, nv, nv)
    if arch.model_type == "qwen3_next":
        names: tuple[str, ...] = (src + "in_proj_qkvz.weight", src + "in_proj_ba.weight")
        per_head = 2 * dk + 2 * r * dv

        def fuse(parts: list[torch.Tensor]) -> torch.Tensor:
            qkvz, ba = parts
            for name, tensor, rows in (("in_proj_qkvz", qkvz, nk * per_head), ("in_proj_ba", ba, 2 * nv)):
                if tuple(tensor.shape) != (rows, hidden):
                    raise ConversionError(
                        f"{name} has shape {tuple(tensor.shape)}, expected {(rows, hidden)}"
                    )
            q, k, vv, z = torch.split(qkvz.reshape(nk, per_head, hidden), [dk, dk, r * dv, r * dv], dim=1)
            b, a = torch.split(ba.reshape(nk, 2 * r, hidden), [r, r], dim=1)
            return torch.cat([t.reshape(-1, hidden) for t in (q, k, vv, z, b, a)], dim=0)

        def split(fused: torch.Tensor) -> list[torch.Tensor]:
            q, k, vv, z, b, a = (t.reshape(nk, -1, hidden) for t in torch.split(fused, list(segments), dim=0))
            return [
                torch.cat([q, k, vv, z], dim=1).reshape(-1, hidden),
                torch.cat([b, a], dim=1).reshape(-1, hidden),
            ]
    else:
        names = tuple(src + f"in_proj_{p}.weight" for p in ("qkv", "z", "b", "a"))
        sizes = [2 * qk + v, v, nv, nv]

        def fuse(parts: list[torch.Tensor]) -> torch.Tensor:
            for name, tensor, rows in zip(names, parts, sizes, strict=True):
                if tuple(tensor.shape) != (rows, hidden):
                    raise ConversionError(
                        f"{name} has shape {tuple(tensor.shape)}, expected {(rows, hidden)}"
                    )
            return torch.cat(parts, dim=0)

        def split(fused: torch.Tensor) -> list[torch.Tensor]:
            return list(torch.split(fused, sizes, dim=0))

    return [
        _Rule(attn + "in_proj.weight", names, fuse, split, split=segments, read_whole=True),
        _Rule(
            attn + "conv1d.weight", (src + "conv1d.weight",), _same, _one, split=(qk, qk, v), read_whole=True
        ),
        _Rule(attn + "dt_bias", (src + "dt_bias",), _same, _one, split="rows"),
        _Rule(attn + "A_log", (src + "A_log",), _same, _one, split="rows"),
        _Rule(attn + "out_norm.weight", (src + "norm.weight",), _same, _one),
        _Rule(attn + "out_proj.weight", (src + "out_proj.weight",), _same, _one, split="cols"),
    ]


def _pick(candidates: Iterable[str], names: Mapping[str, Any]) -> str:
    options = list(candidates)
    for name in options:
        if name in names:
            return name
    raise ConversionError(
        f"the Megatron model has none of {options}; it was not built by "
        "legorl.trainer.models.model.build_model for this architecture"
    )


def _layer_rules(
    arch: MoeArchitecture,
    params: Mapping[str, torch.Tensor],
    local: int,
    layer: int,
    experts: Sequence[int],
) -> list[_Rule]:
    """The rules of decoder layer `layer` (global index), held as `decoder.layers.{local}` on this stage."""
    m, h = f"decoder.layers.{local}.", f"{arch.hf_prefix}layers.{layer}."
    attn = m + "self_attention."
    per_group = arch.num_attention_heads // arch.num_key_value_heads
    rules = [
        _Rule(
            _pick([m + "input_layernorm.weight", attn + "linear_qkv.layer_norm_weight"], params),
            (h + "input_layernorm.weight",),
            _same,
            _one,
        ),
    ]
    if layer in arch.linear_layers:
        rules += _gdn_rules(arch, m, h)
    else:
        qkv_names = tuple(h + f"self_attn.{p}_proj.weight" for p in "qkv")
        if arch.attention_output_gate:
            fuse_gated, split_gated = _gated_qkv_rules(arch)
            rules.append(
                _Rule(
                    attn + "linear_qkv.weight",
                    qkv_names,
                    fuse_gated,
                    split_gated,
                    split="rows",
                    read_whole=True,
                )
            )
        else:
            fuse_qkv, split_qkv = _qkv_rules(arch)
            rules.append(
                _Rule(
                    attn + "linear_qkv.weight",
                    qkv_names,
                    fuse_qkv,
                    split_qkv,
                    split="rows",
                    qkv=(arch.num_key_value_heads, per_group, arch.head_dim),
                )
            )
        rules += [
            _Rule(attn + "q_layernorm.weight", (h + "self_attn.q_norm.weight",), _same, _one),
            _Rule(attn + "k_layernorm.weight", (h + "self_attn.k_norm.weight",), _same, _one),
            _Rule(attn + "linear_proj.weight", (h + "self_attn.o_proj.weight",), _same, _one, split="cols"),
        ]
    rules += [
        _Rule(
            _pick([m + "pre_mlp_layernorm.weight", m + "mlp.linear_fc1.layer_norm_weight"], params),
            (h + "post_attention_layernorm.weight",),
            _same,
            _one,
        ),
    ]
    if layer in arch.moe_layers:
        rules.append(_Rule(m + "mlp.router.weight", (h + "mlp.gate.weight",), _same, _one))
        for e_local, e in enumerate(experts):
            expert = h + f"mlp.experts.{e}."
            fc1 = [
                m + f"mlp.experts.local_experts.{e_local}.linear_fc1.weight",
                m + f"mlp.experts.linear_fc1.weight{e_local}",
            ]
            fc2 = [
                m + f"mlp.experts.local_experts.{e_local}.linear_fc2.weight",
                m + f"mlp.experts.linear_fc2.weight{e_local}",
            ]
            rules += [
                _Rule(
                    _pick(fc1, params),
                    (expert + "gate_proj.weight", expert + "up_proj.weight"),
                    _concat,
                    _split_halves,
                    split="gate_up",
                    expert=True,
                ),
                _Rule(
                    _pick(fc2, params), (expert + "down_proj.weight",), _same, _one, split="cols", expert=True
                ),
            ]
        if arch.shared_expert_ffn_hidden_size:
            rules += _swiglu_rules(m + "mlp.shared_experts.", h + "mlp.shared_expert.")
            rules.append(
                _Rule(
                    m + "mlp.shared_experts.gate_weight", (h + "mlp.shared_expert_gate.weight",), _same, _one
                )
            )
    else:
        rules += _swiglu_rules(m + "mlp.", h + "mlp.")
    return rules


def _swiglu_rules(m: str, h: str) -> list[_Rule]:
    """A dense SwiGLU MLP (a dense layer's, or the shared expert): megatron `{m}linear_fc1` is HF's
    `{h}gate_proj` rows then `{h}up_proj` rows, `{m}linear_fc2` is `{h}down_proj`."""
    return [
        _Rule(
            m + "linear_fc1.weight",
            (h + "gate_proj.weight", h + "up_proj.weight"),
            _concat,
            _split_halves,
            split="gate_up",
        ),
        _Rule(m + "linear_fc2.weight", (h + "down_proj.weight",), _same, _one, split="cols"),
    ]


def _rules(arch: MoeArchitecture, model: torch.nn.Module) -> list[_Rule]:
    """The rules of every parameter of this rank's model, in HF order (embedding, layers, norm, head)."""
    inner = unwrap(model)
    params = dict(inner.named_parameters())
    rules: list[_Rule] = []
    if inner.pre_process:
        rules.append(
            _Rule(
                "embedding.word_embeddings.weight",
                (arch.hf_prefix + "embed_tokens.weight",),
                _same,
                _one,
                split="rows",
            )
        )
    for local, block in enumerate(inner.decoder.layers):
        experts = list(getattr(block.mlp, "local_expert_indices", []))
        rules += _layer_rules(arch, params, local, int(block.layer_number) - 1, experts)
    if inner.post_process:
        rules.append(_Rule("decoder.final_layernorm.weight", (arch.hf_prefix + "norm.weight",), _same, _one))
        if not arch.tie_word_embeddings:
            rules.append(_Rule("output_layer.weight", ("lm_head.weight",), _same, _one, split="rows"))
    return rules


def hf_names(arch: MoeArchitecture) -> list[str]:
    """Every HF tensor of the whole model, in checkpoint order (the tied `lm_head.weight` left out)."""
    prefix = arch.hf_prefix
    names = [prefix + "embed_tokens.weight"]
    for i in range(arch.num_layers):
        h = f"{prefix}layers.{i}."
        names.append(h + "input_layernorm.weight")
        if i in arch.linear_layers:
            a = h + "linear_attn."
            projections = ("qkvz", "ba") if arch.model_type == "qwen3_next" else ("qkv", "z", "b", "a")
            names += [a + f"in_proj_{p}.weight" for p in projections]
            names += [
                a + "conv1d.weight",
                a + "dt_bias",
                a + "A_log",
                a + "norm.weight",
                a + "out_proj.weight",
            ]
        else:
            names += [h + f"self_attn.{p}_proj.weight" for p in "qkv"]
            names += [
                h + "self_attn.q_norm.weight",
                h + "self_attn.k_norm.weight",
                h + "self_attn.o_proj.weight",
            ]
        names.append(h + "post_attention_layernorm.weight")
        if i in arch.moe_layers:
            names.append(h + "mlp.gate.weight")
            for e in range(arch.num_experts):
                names += [h + f"mlp.experts.{e}.{p}_proj.weight" for p in ("gate", "up", "down")]
            if arch.shared_expert_ffn_hidden_size:
                names += [h + f"mlp.shared_expert.{p}_proj.weight" for p in ("gate", "up", "down")]
                names.append(h + "mlp.shared_expert_gate.weight")
        else:
            names += [h + f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    names.append(prefix + "norm.weight")
    if not arch.tie_word_embeddings:
        names.append("lm_head.weight")
    return names


def _tp(rule: _Rule) -> tuple[int, int, Any]:
    """(size, rank, group) of the tensor-parallel group that shards `rule`'s parameter."""
    if not parallel_state.model_parallel_is_initialized():
        return 1, 0, None
    if rule.expert:
        return (
            parallel_state.get_expert_tensor_parallel_world_size(),
            parallel_state.get_expert_tensor_parallel_rank(),
            parallel_state.get_expert_tensor_parallel_group(),
        )
    return (
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_group(),
    )


def _full_shape(rule: _Rule, local: torch.Size) -> tuple[int, ...]:
    """The whole Megatron tensor's shape, from this rank's shard of it."""
    size = _tp(rule)[0]
    shape = list(local)
    if isinstance(rule.split, tuple) or rule.split in ("rows", "gate_up"):
        shape[0] *= size
    elif rule.split == "cols":
        shape[1] *= size
    return tuple(shape)


def _read_local(
    rule: _Rule, read: Callable[[str, slice, slice], torch.Tensor], shapes: Mapping[str, tuple[int, ...]]
) -> torch.Tensor:
    """This rank's shard of `rule`'s parameter, reading only the slices of the HF tensors it is made of
    (`shapes`: each HF tensor's whole shape)."""
    size, rank, _ = _tp(rule)
    everything = slice(None)

    def chunk(n: int) -> slice:
        if n % size:
            raise ConversionError(f"{rule.megatron}: {n} rows/columns do not split over {size} tensor ranks")
        step = n // size
        return slice(rank * step, (rank + 1) * step)

    if size == 1 or rule.split == "none":
        return rule.to_megatron([read(name, everything, everything) for name in rule.hf])
    if rule.read_whole:
        full = rule.to_megatron([read(name, everything, everything) for name in rule.hf])
        for n in rule.split if isinstance(rule.split, tuple) else (full.shape[0],):
            if n % size:
                raise ConversionError(f"{rule.megatron}: {n} rows do not split over {size} tensor ranks")
        return take_shard(full, rule.split, size, rank).clone()
    if rule.qkv is not None:
        groups, per_group, d = rule.qkv
        g = chunk(groups)
        q, k, v = rule.hf
        return _fuse_qkv(
            read(q, slice(g.start * per_group * d, g.stop * per_group * d), everything),
            read(k, slice(g.start * d, g.stop * d), everything),
            read(v, slice(g.start * d, g.stop * d), everything),
            groups=g.stop - g.start,
            per_group=per_group,
            d=d,
        )
    if rule.split == "rows":
        (name,) = rule.hf
        return read(name, chunk(shapes[name][0]), everything)
    if rule.split == "cols":
        (name,) = rule.hf
        return read(name, everything, chunk(shapes[name][1]))
    gate, up = rule.hf
    rows = chunk(shapes[gate][0])
    return torch.cat([read(gate, rows, everything), read(up, rows, everything)], dim=0)


def assemble(pieces: Sequence[torch.Tensor], split: Split) -> torch.Tensor:
    """The whole tensor from every tensor-parallel rank's shard of it, in rank order."""
    if split == "none" or len(pieces) == 1:
        return pieces[0]
    if isinstance(split, tuple):
        parts = len(pieces)
        cut = [torch.split(p, [n // parts for n in split], dim=0) for p in pieces]
        return torch.cat([cut[r][i] for i in range(len(split)) for r in range(parts)], dim=0)
    if split == "rows":
        return torch.cat(list(pieces), dim=0)
    if split == "cols":
        return torch.cat(list(pieces), dim=1)
    halves = [p.chunk(2, dim=0) for p in pieces]
    return torch.cat([torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])])


def take_shard(full: torch.Tensor, split: Split, parts: int, index: int) -> torch.Tensor:
    """Shard `index` of `parts` of a whole tensor (the inverse of `assemble`)."""
    if split == "none" or parts == 1:
        return full
    if isinstance(split, tuple):
        return torch.cat([segment.chunk(parts, dim=0)[index] for segment in torch.split(full, list(split))])
    if split == "rows":
        return full.chunk(parts, dim=0)[index]
    if split == "cols":
        return full.chunk(parts, dim=1)[index]
    gate, up = full.chunk(2, dim=0)
    return torch.cat([gate.chunk(parts, dim=0)[index], up.chunk(parts, dim=0)[index]])


@dataclass(frozen=True)
class ParamShard:
    """Which whole tensor a parameter of this rank is a shard of, and which shard."""

    key: str
    """The whole tensor's identity, the same at every layout (its HF tensor names)."""
    split: Split
    parts: int
    index: int
    expert: bool


def parameter_shards(model: torch.nn.Module, arch: MoeArchitecture) -> dict[str, ParamShard]:
    """Every parameter of this rank's model (by its name here) as a shard of a layout-independent tensor."""
    out = {}
    for rule in _rules(arch, model):
        size, rank, _ = _tp(rule)
        split: Split = rule.split if size > 1 else "none"
        out[rule.megatron] = ParamShard(
            "|".join(rule.hf),
            split,
            size if split != "none" else 1,
            rank if split != "none" else 0,
            rule.expert,
        )
    return out


def _gather_full(rule: _Rule, shard: torch.Tensor) -> torch.Tensor:
    """The whole Megatron tensor from every tensor-parallel rank's shard (a collective over that group)."""
    size, _, group = _tp(rule)
    if size == 1 or rule.split == "none":
        return shard
    parts = [torch.empty_like(shard) for _ in range(size)]
    dist.all_gather(parts, shard.contiguous(), group=group)
    return assemble(parts, rule.split)


def _parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    inner = unwrap(model)
    return dict(inner.named_parameters())


def hf_tensor_locations(checkpoint_dir: str | os.PathLike[str]) -> dict[str, Path]:
    """Which safetensors file holds each tensor: `model.safetensors`, or the shards its index names."""
    root = Path(checkpoint_dir)
    index = root / SAFETENSORS_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ConversionError(f"{index}: not a safetensors index (needs a 'weight_map' object)") from exc
        return {name: root / shard for name, shard in weight_map.items()}
    single = root / SAFETENSORS_FILE
    if single.is_file():
        with safe_open(str(single), framework="pt") as f:
            return dict.fromkeys(f.keys(), single)
    raise ConversionError(
        f"{root}: no {SAFETENSORS_FILE} or {SAFETENSORS_INDEX}; only safetensors checkpoints are supported"
    )


def untrained_tensors(arch: MoeArchitecture, names: Iterable[str]) -> list[str]:
    """The checkpoint tensors this trainer does not build (`arch.untrained_prefixes`: multi-token prediction,
    a vision tower), sorted."""
    return (
        sorted(n for n in names if n.startswith(arch.untrained_prefixes)) if arch.untrained_prefixes else []
    )


def load_hf_weights(
    model: torch.nn.Module, checkpoint_dir: str | os.PathLike[str], arch: MoeArchitecture
) -> list[str]:
    """Copy a HF safetensors checkpoint into this rank's share of the Megatron model.

    Every rank reads only the slices of the tensors its parameters are made of (safetensors reads a slice
    without loading the rest), cast to each parameter's dtype and device. The checkpoint must hold exactly
    the model's tensors (a tied checkpoint's `lm_head.weight` excepted) with the shapes the config implies,
    and every parameter of this rank must be covered; nothing is copied unless all checks pass. Tensors of
    parts the trainer does not build (`untrained_tensors`: MTP layers, a vision tower) are left out, logged,
    and returned by name; `save_hf_checkpoint` carries them over unchanged.
    """
    params = _parameters(model)
    rules = _rules(arch, model)
    locations = hf_tensor_locations(checkpoint_dir)
    where = Path(checkpoint_dir)

    wanted = set(hf_names(arch))
    missing = sorted(wanted - locations.keys())
    ignorable = {"lm_head.weight"} if arch.tie_word_embeddings else set()
    skipped = untrained_tensors(arch, locations.keys() - wanted)
    unexpected = sorted(locations.keys() - wanted - ignorable - set(skipped))
    uncovered = sorted(params.keys() - {rule.megatron for rule in rules})
    problems = []
    if missing:
        problems.append(f"missing from the checkpoint: {_some(missing)}")
    if unexpected:
        problems.append(f"in the checkpoint but not in the model: {_some(unexpected)}")
    if uncovered:
        problems.append(f"Megatron parameters no rule fills: {_some(uncovered)}")
    if problems:
        raise ConversionError(
            f"{where}: does not match {arch.model_type} {_describe(arch)}: " + "; ".join(problems)
        )

    handles: dict[Path, Any] = {}

    def handle(name: str) -> Any:
        path = locations[name]
        if path not in handles:
            if not path.is_file():
                raise ConversionError(f"{path}: a shard named by the index does not exist")
            handles[path] = safe_open(str(path), framework="pt")
        return handles[path]

    shapes = {name: tuple(handle(name).get_slice(name).get_shape()) for rule in rules for name in rule.hf}
    # First the shapes alone (meta tensors through the same rules), so a bad checkpoint is refused before
    # any parameter changes and without holding a second copy of the weights in memory.
    for rule in rules:
        try:
            value = rule.to_megatron([torch.empty(shapes[name], device="meta") for name in rule.hf])
        except ConversionError as exc:
            raise ConversionError(
                f"{where}: {rule.megatron}: {exc} (the config says {_describe(arch)})"
            ) from None
        expected = _full_shape(rule, params[rule.megatron].shape)
        if tuple(value.shape) != expected:
            raise ConversionError(
                f"{where}: {' + '.join(rule.hf)} gives shape {tuple(value.shape)} for {rule.megatron}, "
                f"which has {expected}; the config does not describe these weights"
            )

    def read(name: str, rows: slice, cols: slice) -> torch.Tensor:
        piece = handle(name).get_slice(name)
        if len(shapes[name]) == 1:
            tensor: torch.Tensor = piece[rows]
        else:
            tensor = piece[rows, cols]
        return tensor

    with torch.no_grad():
        for rule in rules:
            target = params[rule.megatron]
            target.copy_(_read_local(rule, read, shapes).to(target.dtype))
    handles.clear()
    if skipped:
        logger.info(
            "%s: %d tensors of parts the trainer does not build are not trained (carried over into "
            "checkpoints "
            "it writes): %s",
            where,
            len(skipped),
            _some(skipped),
        )
    return skipped


def _sources() -> dict[tuple[int, int | None], int]:
    """Which global rank sends each part of the model to the writer: per (pipeline stage, expert-parallel rank
    or None for the dense parameters), the rank with tensor rank 0 and data (or expert-data) rank 0."""
    coords = [
        (
            parallel_state.get_pipeline_model_parallel_rank(),
            parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_data_parallel_rank(with_context_parallel=True),
            parallel_state.get_expert_model_parallel_rank(),
            parallel_state.get_expert_tensor_parallel_rank(),
            parallel_state.get_expert_data_parallel_rank(),
        )
    ]
    if dist.get_world_size() > 1:
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, coords[0])
        coords = everyone
    out: dict[tuple[int, int | None], int] = {}
    for rank, (stage, tp, dp, ep, etp, edp) in enumerate(coords):
        if tp == 0 and dp == 0:
            out.setdefault((stage, None), rank)
        if etp == 0 and edp == 0:
            out.setdefault((stage, ep), rank)
    return out


@dataclass(frozen=True)
class _Unit:
    """One Megatron tensor as the export sees it: its HF tensors, who holds it, what it gives."""

    names: tuple[str, ...]
    owner: tuple[int, int | None]
    """(pipeline stage, expert-parallel rank or None for a dense tensor)."""
    shapes: tuple[tuple[int, ...], ...]
    dtype: str


class HfExport:
    """The whole model under HF names, in checkpoint order, streamed to the writer (global rank 0).

    Making one is a collective (every rank learns every rank's part list); so is iterating it, which every
    rank must do to the end. Each part is assembled from its tensor-parallel shards by the ranks that hold it
    and sent to the writer by one of them (tensor rank 0 of data-parallel replica 0; per expert-parallel rank
    for experts), one tensor at a time: the writer holds one part, not the model, at any moment. On the
    writer the iteration yields (name, tensor) on the model's device; elsewhere it yields nothing. The
    tensors are the same, bit for bit, at every layout.
    """

    def __init__(
        self, model: torch.nn.Module, arch: MoeArchitecture, values: Mapping[str, torch.Tensor] | None = None
    ) -> None:
        params = _parameters(model)
        if values is not None:
            params = {name: values[name] for name in params}
        self._params = params
        self._rules = _rules(arch, model)
        uncovered = sorted(params.keys() - {rule.megatron for rule in self._rules})
        if uncovered:
            raise ConversionError(f"Megatron parameters with no HF name: {_some(uncovered)}")
        self.distributed = dist.is_initialized() and dist.get_world_size() > 1
        stage = parallel_state.get_pipeline_model_parallel_rank() if self.distributed else 0
        ep = parallel_state.get_expert_model_parallel_rank() if self.distributed else 0
        mine = []
        for rule in self._rules:
            shard = params[rule.megatron]
            whole = _full_shape(rule, shard.shape)
            shapes = tuple(tuple(t.shape) for t in rule.to_hf(torch.empty(whole, device="meta")))
            dtype = str(shard.dtype).removeprefix("torch.")
            mine.append(_Unit(rule.hf, (stage, ep if rule.expert else None), shapes, dtype))
        everyone: list[Any] = [mine]
        if self.distributed:
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, mine)
        units: dict[tuple[str, ...], _Unit] = {}
        for part in everyone:
            for unit in part:
                units.setdefault(unit.names, unit)
        order = {name: i for i, name in enumerate(hf_names(arch))}
        self.units = sorted(units.values(), key=lambda u: order[u.names[0]])
        self._sources = _sources() if self.distributed else {}

    @property
    def meta(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """(name, shape, dtype) of every tensor the iteration yields, in order (known on every rank)."""
        return [
            (name, shape, getattr(torch, unit.dtype))
            for unit in self.units
            for name, shape in zip(unit.names, unit.shapes, strict=True)
        ]

    @property
    def nbytes(self) -> int:
        return sum(math.prod(shape) * dtype.itemsize for _, shape, dtype in self.meta)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        by_key = {rule.hf: rule for rule in self._rules}
        if not self.distributed:
            with torch.no_grad():
                for unit in self.units:
                    rule = by_key[unit.names]
                    yield from zip(rule.hf, rule.to_hf(self._params[rule.megatron].detach()), strict=True)
            return
        rank = dist.get_rank()
        dense_source_group = parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0
        expert_source_group = parallel_state.get_expert_data_parallel_rank() == 0
        device = next(iter(self._params.values())).device
        with torch.no_grad():
            for unit in self.units:
                source = self._sources[unit.owner]
                held = by_key.get(unit.names)
                tensors: list[torch.Tensor] | None = None
                if held is not None and (expert_source_group if held.expert else dense_source_group):
                    full = _gather_full(held, self._params[held.megatron].detach())
                    tensors = [t.contiguous() for t in held.to_hf(full)]
                if rank == source and rank != 0:
                    assert tensors is not None
                    for tensor in tensors:
                        dist.send(tensor, dst=0)
                if rank != 0:
                    continue
                if source != 0:
                    tensors = []
                    for shape in unit.shapes:
                        buffer = torch.empty(shape, dtype=getattr(torch, unit.dtype), device=device)
                        dist.recv(buffer, src=source)
                        tensors.append(buffer)
                assert tensors is not None
                yield from zip(unit.names, tensors, strict=True)


def gather_hf_state_dict(
    model: torch.nn.Module, arch: MoeArchitecture, values: Mapping[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor] | None:
    """The whole model's weights under HF names in the on-disk layout (`HfExport`), as contiguous CPU copies
    in the model's dtype, on the writer (global rank 0); None on every other rank. A collective: every rank
    of the trainer calls it. `values`: tensors shaped like the parameters to convert instead of the
    parameters themselves (by Megatron name; e.g. their gradients).
    """
    export = HfExport(model, arch, values)
    out = {name: tensor.to("cpu").contiguous().clone() for name, tensor in export}
    return out if not export.distributed or dist.get_rank() == 0 else None


def export_hf_state_dict(model: torch.nn.Module, arch: MoeArchitecture) -> dict[str, torch.Tensor]:
    """`gather_hf_state_dict` in a one-rank process (tests, SFT): the weights under HF names."""
    out = gather_hf_state_dict(model, arch)
    if out is None:
        raise ConversionError("export_hf_state_dict is for one rank; with several, use gather_hf_state_dict")
    return out


def save_hf_checkpoint(
    model: torch.nn.Module,
    arch: MoeArchitecture,
    out_dir: str | os.PathLike[str],
    *,
    source_dir: str | os.PathLike[str],
    dtype: torch.dtype | None = None,
) -> Path:
    """Write a loadable HF checkpoint: model.safetensors plus every non-weight file of `source_dir`.

    The directory is assembled next to `out_dir` (same filesystem) and renamed into place, so a reader
    never sees a partial checkpoint; an existing `out_dir` is replaced. With `dtype`, tensors are cast
    and config.json's dtype says so. Returns `out_dir`.
    """
    out = Path(out_dir)
    source = Path(source_dir)
    if not (source / "config.json").is_file():
        raise ConversionError(f"{source}: no config.json to copy; source_dir must be the HF checkpoint")
    tensors = export_hf_state_dict(model, arch)
    if arch.untrained_prefixes:
        locations = hf_tensor_locations(source)
        for name in untrained_tensors(arch, locations):
            with safe_open(str(locations[name]), framework="pt") as f:
                tensors[name] = f.get_tensor(name)
    if dtype is not None:
        tensors = {name: t.to(dtype) for name, t in tensors.items()}
    saved_dtype = next(iter(tensors.values())).dtype
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        for item in source.iterdir():
            if (
                item.is_file()
                and not item.name.endswith(_WEIGHT_SUFFIXES)
                and item.name not in _WEIGHT_INDEXES
            ):
                shutil.copy2(item, tmp / item.name)
        config = json.loads((source / "config.json").read_text())
        dtype_name = str(saved_dtype).removeprefix("torch.")
        for key in ("dtype", "torch_dtype"):
            if key in config:
                config[key] = dtype_name
        if "dtype" not in config and "torch_dtype" not in config:
            config["dtype"] = dtype_name
        # transformers writes config.json the same way (sorted keys, indent 2).
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        save_readable(tensors, tmp / SAFETENSORS_FILE)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if not out.exists():
        tmp.rename(out)
        return out
    # A directory cannot be renamed over a non-empty one: move the old one aside first (readers may find
    # no directory for that instant, never a partial one), and put it back if the swap fails.
    old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
    out.rename(old)
    try:
        tmp.rename(out)
    except BaseException:
        old.rename(out)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(old)
    return out


def _describe(arch: MoeArchitecture) -> str:
    experts = f", {arch.num_experts} experts in layers {list(arch.moe_layers)}" if arch.is_moe else ""
    return f"({arch.num_layers} layers, hidden {arch.hidden_size}{experts})"


def _some(names: list[str], limit: int = 6) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")

"""HF safetensors <-> Megatron GPTModel weights for Qwen3(-MoE): load, export, and write a HF checkpoint.

Tensor rules (checked bit-exactly and against transformers' logits in tests/test_trainer_model.py):
- q/k/v fuse into `linear_qkv` grouped per KV head: for each of the G groups, its r = heads/G query heads,
  then its key head, then its value head (q viewed [G, r·d, H], k and v [G, d, H], joined on dim 1).
- an expert's (or dense MLP's) `linear_fc1` is the gate rows then the up rows; `linear_fc2` is down.
- `mlp.gate` is `mlp.router`; `post_attention_layernorm` is `pre_mlp_layernorm`; q_norm/k_norm are
  `q_layernorm`/`k_layernorm`.
On disk, transformers writes one tensor per expert (`mlp.experts.{e}.gate_proj.weight`, ...) even though a
loaded transformers-5 model fuses them; this module reads and writes the on-disk layout that vLLM and
transformers load. Transformer Engine layer names (norms fused into the following linear) are resolved
too, so a TE-spec model converts with the same rules.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from legorl.trainer import compat
from legorl.trainer.model import MoeArchitecture, unwrap

with compat.silence_import_warnings():
    from megatron.core import parallel_state

__all__ = [
    "ConversionError",
    "export_hf_state_dict",
    "hf_tensor_locations",
    "load_hf_weights",
    "save_hf_checkpoint",
]

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
# Files that carry weights: never copied from the source next to freshly written ones.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
_WEIGHT_INDEXES = (SAFETENSORS_INDEX, "pytorch_model.bin.index.json")


class ConversionError(ValueError):
    """Weights that do not fit the model: missing, unexpected, or misshapen tensors; unsupported layouts."""


@dataclass(frozen=True)
class _Rule:
    """One Megatron parameter and the HF tensors it is made of."""

    megatron: str
    hf: tuple[str, ...]
    to_megatron: Callable[[list[torch.Tensor]], torch.Tensor]
    to_hf: Callable[[torch.Tensor], list[torch.Tensor]]


def _same(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0]


def _one(tensor: torch.Tensor) -> list[torch.Tensor]:
    return [tensor]


def _concat(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(parts, dim=0)


def _split_halves(tensor: torch.Tensor) -> list[torch.Tensor]:
    gate, up = tensor.chunk(2, dim=0)
    return [gate, up]


def _qkv_rules(
    arch: MoeArchitecture,
) -> tuple[Callable[..., torch.Tensor], Callable[..., list[torch.Tensor]]]:
    groups, d, hidden = arch.num_key_value_heads, arch.head_dim, arch.hidden_size
    per_group = arch.num_attention_heads // groups

    def fuse(parts: list[torch.Tensor]) -> torch.Tensor:
        q, k, v = parts
        for name, tensor, rows in (
            ("q", q, groups * per_group * d),
            ("k", k, groups * d),
            ("v", v, groups * d),
        ):
            if tuple(tensor.shape) != (rows, hidden):
                raise ConversionError(
                    f"{name}_proj has shape {tuple(tensor.shape)}, expected {(rows, hidden)}"
                )
        fused = torch.cat(
            [
                q.reshape(groups, per_group * d, hidden),
                k.reshape(groups, d, hidden),
                v.reshape(groups, d, hidden),
            ],
            dim=1,
        )
        return fused.reshape(-1, hidden)

    def split(fused: torch.Tensor) -> list[torch.Tensor]:
        grouped = fused.reshape(groups, (per_group + 2) * d, hidden)
        q, k, v = torch.split(grouped, [per_group * d, d, d], dim=1)
        return [q.reshape(-1, hidden), k.reshape(-1, hidden), v.reshape(-1, hidden)]

    return fuse, split


def _pick(candidates: Iterable[str], names: Mapping[str, Any]) -> str:
    options = list(candidates)
    for name in options:
        if name in names:
            return name
    raise ConversionError(
        f"the Megatron model has none of {options}; it was not built by legorl.trainer.model.build_model "
        "for this architecture"
    )


def _rules(arch: MoeArchitecture, params: Mapping[str, torch.Tensor]) -> list[_Rule]:
    fuse_qkv, split_qkv = _qkv_rules(arch)
    rules = [_Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), _same, _one)]
    for i in range(arch.num_layers):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        attn = m + "self_attention."
        rules += [
            _Rule(
                _pick([m + "input_layernorm.weight", attn + "linear_qkv.layer_norm_weight"], params),
                (h + "input_layernorm.weight",),
                _same,
                _one,
            ),
            _Rule(
                attn + "linear_qkv.weight",
                tuple(h + f"self_attn.{p}_proj.weight" for p in "qkv"),
                fuse_qkv,
                split_qkv,
            ),
            _Rule(attn + "q_layernorm.weight", (h + "self_attn.q_norm.weight",), _same, _one),
            _Rule(attn + "k_layernorm.weight", (h + "self_attn.k_norm.weight",), _same, _one),
            _Rule(attn + "linear_proj.weight", (h + "self_attn.o_proj.weight",), _same, _one),
            _Rule(
                _pick([m + "pre_mlp_layernorm.weight", m + "mlp.linear_fc1.layer_norm_weight"], params),
                (h + "post_attention_layernorm.weight",),
                _same,
                _one,
            ),
        ]
        if i in arch.moe_layers:
            rules.append(_Rule(m + "mlp.router.weight", (h + "mlp.gate.weight",), _same, _one))
            for e in range(arch.num_experts):
                expert = h + f"mlp.experts.{e}."
                fc1 = [
                    m + f"mlp.experts.local_experts.{e}.linear_fc1.weight",
                    m + f"mlp.experts.linear_fc1.weight{e}",
                ]
                fc2 = [
                    m + f"mlp.experts.local_experts.{e}.linear_fc2.weight",
                    m + f"mlp.experts.linear_fc2.weight{e}",
                ]
                rules += [
                    _Rule(
                        _pick(fc1, params),
                        (expert + "gate_proj.weight", expert + "up_proj.weight"),
                        _concat,
                        _split_halves,
                    ),
                    _Rule(_pick(fc2, params), (expert + "down_proj.weight",), _same, _one),
                ]
        else:
            rules += [
                _Rule(
                    m + "mlp.linear_fc1.weight",
                    (h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"),
                    _concat,
                    _split_halves,
                ),
                _Rule(m + "mlp.linear_fc2.weight", (h + "mlp.down_proj.weight",), _same, _one),
            ]
    rules.append(_Rule("decoder.final_layernorm.weight", ("model.norm.weight",), _same, _one))
    if not arch.tie_word_embeddings:
        rules.append(_Rule("output_layer.weight", ("lm_head.weight",), _same, _one))
    return rules


def _check_single_shard() -> None:
    if not parallel_state.model_parallel_is_initialized():
        return
    sizes = {
        "tensor": parallel_state.get_tensor_model_parallel_world_size(),
        "pipeline": parallel_state.get_pipeline_model_parallel_world_size(),
        "expert": parallel_state.get_expert_model_parallel_world_size(),
    }
    split = {k: v for k, v in sizes.items() if v > 1}
    if split:
        raise ConversionError(
            f"HF conversion handles unsharded models only; this process has model-parallel sizes {split}. "
            "Use tensor/pipeline/expert parallelism 1 (data parallelism is fine)"
        )


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


def load_hf_weights(
    model: torch.nn.Module, checkpoint_dir: str | os.PathLike[str], arch: MoeArchitecture
) -> None:
    """Copy a HF safetensors checkpoint into the Megatron model (cast to each parameter's dtype/device).

    Every Megatron parameter must be covered and every checkpoint tensor used (a tied checkpoint's
    `lm_head.weight` excepted); shapes must match exactly. Nothing is copied unless all checks pass.
    """
    _check_single_shard()
    params = _parameters(model)
    rules = _rules(arch, params)
    locations = hf_tensor_locations(checkpoint_dir)
    where = Path(checkpoint_dir)

    wanted = {name for rule in rules for name in rule.hf}
    missing = sorted(wanted - locations.keys())
    ignorable = {"lm_head.weight"} if arch.tie_word_embeddings else set()
    unexpected = sorted(locations.keys() - wanted - ignorable)
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

    def tensor(name: str, *, meta: bool) -> torch.Tensor:
        path = locations[name]
        if path not in handles:
            if not path.is_file():
                raise ConversionError(f"{path}: a shard named by the index does not exist")
            handles[path] = safe_open(str(path), framework="pt")
        if meta:
            return torch.empty(handles[path].get_slice(name).get_shape(), device="meta")
        loaded: torch.Tensor = handles[path].get_tensor(name)
        return loaded

    # First the shapes alone (meta tensors through the same rules), so a bad checkpoint is refused before
    # any parameter changes and without holding a second copy of the weights in memory.
    for rule in rules:
        try:
            value = rule.to_megatron([tensor(name, meta=True) for name in rule.hf])
        except ConversionError as exc:
            raise ConversionError(
                f"{where}: {rule.megatron}: {exc} (the config says {_describe(arch)})"
            ) from None
        target = params[rule.megatron]
        if value.shape != target.shape:
            raise ConversionError(
                f"{where}: {' + '.join(rule.hf)} gives shape {tuple(value.shape)} for {rule.megatron}, "
                f"which has {tuple(target.shape)}; the config does not describe these weights"
            )
    with torch.no_grad():
        for rule in rules:
            target = params[rule.megatron]
            target.copy_(rule.to_megatron([tensor(name, meta=False) for name in rule.hf]).to(target.dtype))
    handles.clear()


def export_hf_state_dict(model: torch.nn.Module, arch: MoeArchitecture) -> dict[str, torch.Tensor]:
    """The model's weights under HF names in the on-disk layout: contiguous CPU tensors, dtype preserved."""
    _check_single_shard()
    params = _parameters(model)
    rules = _rules(arch, params)
    uncovered = sorted(params.keys() - {rule.megatron for rule in rules})
    if uncovered:
        raise ConversionError(f"Megatron parameters with no HF name: {_some(uncovered)}")
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for rule in rules:
            parts = rule.to_hf(params[rule.megatron].detach())
            for name, tensor in zip(rule.hf, parts, strict=True):
                # clone: a view of a parameter shares memory with it (and safetensors refuses shared storage).
                out[name] = tensor.to("cpu").contiguous().clone()
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
        save_file(tensors, str(tmp / SAFETENSORS_FILE), metadata={"format": "pt"})
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

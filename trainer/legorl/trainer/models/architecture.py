"""A checkpoint's architecture as its Hugging Face config.json describes it; light (no torch), so launchers
check a model against a parallel layout before anything heavy is imported.

Qwen3-MoE (`qwen3_moe`), dense Qwen3 (`qwen3`) and the hybrid-attention family: Qwen3-Next (`qwen3_next`) and
the text part of Qwen3.5-MoE (`qwen3_5_moe`, `qwen3_5_moe_text`): Gated DeltaNet layers between gated
full-attention layers, zero-centred RMSNorm, partial RoPE, shared experts with a sigmoid gate. Everything this
trainer cannot build faithfully is refused naming the field (`legorl.trainer.models.model` explains how each
field maps onto megatron).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from legorl.api.layout import ModelShape

__all__ = ["HYBRID_MODEL_TYPES", "SUPPORTED_MODEL_TYPES", "ModelConfigError", "MoeArchitecture"]

HYBRID_MODEL_TYPES = ("qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text")
SUPPORTED_MODEL_TYPES = ("qwen3_moe", "qwen3", *HYBRID_MODEL_TYPES)


class ModelConfigError(ValueError):
    """The checkpoint's config.json describes something this trainer cannot build faithfully."""


def _require(config: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if key not in config or config[key] is None:
        raise ModelConfigError(
            f"{where}: config.json has no {key!r}; a {SUPPORTED_MODEL_TYPES} config needs it"
        )
    value = config[key]
    # bool is an int in Python; a size given as true/false is a broken config, not 1/0.
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise ModelConfigError(f"{where}: {key}={value!r} must be a number")
    if not isinstance(value, kind):
        raise ModelConfigError(f"{where}: {key}={value!r} has the wrong type (expected {kind})")
    return value


def _rope_theta(config: Mapping[str, Any], where: str, *, partial: bool = False) -> tuple[float, float]:
    """(RoPE base, rotary fraction of each head) from transformers 5's `rope_parameters` or the older
    top-level `rope_theta` / `partial_rotary_factor`. Only the hybrid family (`partial`) rotates part of a
    head (its default is a quarter); Qwen3.5's multimodal RoPE sections are accepted because on text, where
    the three position rows are equal, multimodal RoPE is plain RoPE (transformers computes the same
    numbers)."""
    params = config.get("rope_parameters")
    scaling = config.get("rope_scaling")
    if params is not None and not isinstance(params, Mapping):
        raise ModelConfigError(f"{where}: rope_parameters must be an object, got {params!r}")
    for name, block in (("rope_parameters", params), ("rope_scaling", scaling)):
        if block is None:
            continue
        if not isinstance(block, Mapping):
            raise ModelConfigError(f"{where}: {name} must be an object or null, got {block!r}")
        rope_type = block.get("rope_type", block.get("type", "default"))
        if rope_type != "default":
            raise ModelConfigError(
                f"{where}: {name}.rope_type={rope_type!r} is not supported; only plain RoPE "
                "(rope_type 'default', no scaling) is implemented"
            )
        factor = block.get("partial_rotary_factor", 1.0)
        if factor != 1.0 and not partial:
            raise ModelConfigError(
                f"{where}: {name}.partial_rotary_factor={factor} is not supported (only 1.0)"
            )
    theta = (params or {}).get("rope_theta", config.get("rope_theta"))
    if theta is None:
        raise ModelConfigError(
            f"{where}: config.json has no RoPE base: expected rope_parameters.rope_theta (transformers 5) "
            "or rope_theta"
        )
    if isinstance(theta, bool) or not isinstance(theta, int | float) or theta <= 0:
        raise ModelConfigError(f"{where}: rope_theta={theta!r} must be a positive number")
    fraction = 1.0
    if partial:
        fraction = (params or {}).get("partial_rotary_factor", config.get("partial_rotary_factor", 0.25))
        if isinstance(fraction, bool) or not isinstance(fraction, int | float) or not 0 < fraction <= 1:
            raise ModelConfigError(f"{where}: partial_rotary_factor={fraction!r} must be in (0, 1]")
    return float(theta), float(fraction)


@dataclass(frozen=True)
class MoeArchitecture:
    """The shape of a Qwen3(-MoE) model as read from its HF config.json (a dense model has no experts)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    ffn_hidden_size: int
    """Width of the dense MLP (`intermediate_size`), used by dense models and `mlp_only_layers`."""
    moe_ffn_hidden_size: int
    """Width of one expert (`moe_intermediate_size`); 0 for a dense model."""
    num_experts: int
    top_k: int
    norm_topk_prob: bool
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    moe_layers: tuple[int, ...]
    """Indices (0-based) of the decoder layers whose MLP is a mixture of experts, in order."""
    model_type: str = "qwen3_moe"
    # The hybrid-attention family (Qwen3-Next, Qwen3.5); the defaults are Qwen3's.
    layer_types: tuple[str, ...] = ()
    """Per decoder layer, "linear_attention" (Gated DeltaNet) or "full_attention"; empty: all full."""
    linear_conv_kernel_dim: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    shared_expert_ffn_hidden_size: int = 0
    """Width of the shared expert every MoE layer adds, gated by sigmoid(x · w); 0: none."""
    attention_output_gate: bool = False
    """Full attention's output is multiplied by sigmoid(gate), the gate coming from q_proj (twice as wide)."""
    zero_centered_norm: bool = False
    """RMSNorms scale by (1 + weight) (weights stored centred on 0); the GDN output norm excepted."""
    rotary_percent: float = 1.0
    """The share of each head's channels RoPE rotates (the first ones)."""
    hf_prefix: str = "model."
    """Where the decoder's tensors live in the checkpoint (`model.language_model.` in a Qwen3.5 VL one)."""
    untrained_prefixes: tuple[str, ...] = ()
    """Checkpoint tensors this trainer does not build (multi-token prediction, vision): left out of training,
    carried over unchanged into checkpoints it writes."""

    @property
    def linear_layers(self) -> tuple[int, ...]:
        """Indices of the Gated DeltaNet (linear attention) layers."""
        return tuple(i for i, kind in enumerate(self.layer_types) if kind == "linear_attention")

    @property
    def is_hybrid(self) -> bool:
        return bool(self.linear_layers)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0 and len(self.moe_layers) > 0

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layers)

    def shape(self) -> ModelShape:
        """What a parallel layout needs to know of this model (`ParallelLayout.problems`)."""
        return ModelShape(
            num_layers=self.num_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            num_experts=self.num_experts if self.is_moe else 0,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            ffn_hidden_size=self.ffn_hidden_size,
            moe_ffn_hidden_size=self.moe_ffn_hidden_size,
            shared_expert_ffn_hidden_size=self.shared_expert_ffn_hidden_size,
            linear_num_key_heads=self.linear_num_key_heads if self.is_hybrid else 0,
            linear_num_value_heads=self.linear_num_value_heads if self.is_hybrid else 0,
            attention_output_gate=self.attention_output_gate,
        )

    @classmethod
    def from_hf(cls, source: str | os.PathLike[str] | Mapping[str, Any]) -> MoeArchitecture:
        """Parse `<dir>/config.json`, a config.json path, or an already-loaded config dict."""
        if isinstance(source, Mapping):
            config: Mapping[str, Any] = source
            where = "config"
        else:
            path = Path(source)
            if path.is_dir():
                path = path / "config.json"
            where = str(path)
            try:
                config = json.loads(path.read_text())
            except FileNotFoundError as exc:
                raise ModelConfigError(f"{where}: not found; point at a HF checkpoint directory") from exc
            except json.JSONDecodeError as exc:
                raise ModelConfigError(f"{where}: not valid JSON: {exc}") from exc
            if not isinstance(config, Mapping):
                raise ModelConfigError(f"{where}: must hold a JSON object")
        return cls._parse(config, where)

    @classmethod
    def _parse(cls, config: Mapping[str, Any], where: str) -> MoeArchitecture:
        model_type = config.get("model_type")
        if model_type in HYBRID_MODEL_TYPES:
            return _parse_hybrid(config, where)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelConfigError(
                f"{where}: model_type={model_type!r} is not supported; supported: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)} (Qwen3-MoE and dense Qwen3)"
            )
        for key in ("shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts"):
            if config.get(key):
                raise ModelConfigError(
                    f"{where}: {key}={config[key]!r}: shared experts are not supported "
                    "(Qwen3-MoE has none; set it to 0 or null)"
                )
        if config.get("use_sliding_window"):
            raise ModelConfigError(f"{where}: use_sliding_window=true is not supported (full attention only)")
        if config.get("attention_bias"):
            raise ModelConfigError(f"{where}: attention_bias=true is not supported (Qwen3 has no biases)")
        act = config.get("hidden_act", "silu")
        if act != "silu":
            raise ModelConfigError(f"{where}: hidden_act={act!r} is not supported (only 'silu')")

        hidden = _require(config, "hidden_size", int, where)
        heads = _require(config, "num_attention_heads", int, where)
        kv_heads = _require(config, "num_key_value_heads", int, where)
        num_layers = _require(config, "num_hidden_layers", int, where)
        # transformers' own default when a Qwen3 config leaves head_dim out.
        head_dim = config.get("head_dim") or hidden // heads
        if heads % kv_heads:
            raise ModelConfigError(
                f"{where}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
            )

        if model_type == "qwen3_moe":
            experts_key = "num_experts" if "num_experts" in config else "num_local_experts"
            num_experts = _require(config, experts_key, int, where)
            top_k = _require(config, "num_experts_per_tok", int, where)
            moe_ffn = _require(config, "moe_intermediate_size", int, where)
            norm_topk = _require(config, "norm_topk_prob", bool, where)
            # (num_experts < 1 is refused just below, whatever the layers.)
            moe_layers = _sparse_layers(config, num_layers, where)
            if num_experts < 1 or not 1 <= top_k <= num_experts:
                raise ModelConfigError(
                    f"{where}: num_experts_per_tok={top_k} must be between 1 and the number of experts "
                    f"({num_experts})"
                )
        else:
            num_experts, top_k, moe_ffn, norm_topk, moe_layers = 0, 0, 0, False, ()

        return cls(
            vocab_size=_require(config, "vocab_size", int, where),
            hidden_size=hidden,
            num_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=int(head_dim),
            ffn_hidden_size=_require(config, "intermediate_size", int, where),
            moe_ffn_hidden_size=moe_ffn,
            num_experts=num_experts,
            top_k=top_k,
            norm_topk_prob=norm_topk,
            rms_norm_eps=float(_require(config, "rms_norm_eps", (int, float), where)),
            rope_theta=_rope_theta(config, where)[0],
            max_position_embeddings=_require(config, "max_position_embeddings", int, where),
            # Qwen3's configs default to untied embeddings (transformers' Qwen3(Moe)Config does too).
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            moe_layers=moe_layers,
            model_type=str(model_type),
        )


def _sparse_layers(config: Mapping[str, Any], num_layers: int, where: str) -> tuple[int, ...]:
    """The MoE layers by transformers' Qwen3-MoE / Qwen3-Next decoder-layer rule: every
    `decoder_sparse_step`-th layer that `mlp_only_layers` does not keep dense."""
    mlp_only = config.get("mlp_only_layers") or []
    step = config.get("decoder_sparse_step", 1)
    if not isinstance(step, int) or isinstance(step, bool) or step < 1:
        raise ModelConfigError(f"{where}: decoder_sparse_step={step!r} must be an integer >= 1")
    if not isinstance(mlp_only, list) or not all(
        isinstance(i, int) and 0 <= i < num_layers for i in mlp_only
    ):
        raise ModelConfigError(
            f"{where}: mlp_only_layers={mlp_only!r} must list layer indices in [0, {num_layers})"
        )
    return tuple(i for i in range(num_layers) if i not in mlp_only and (i + 1) % step == 0)


def _positive(config: Mapping[str, Any], key: str, where: str) -> int:
    value = _require(config, key, int, where)
    if value < 1:
        raise ModelConfigError(f"{where}: {key}={value} must be at least 1")
    return int(value)


def _layer_types(config: Mapping[str, Any], num_layers: int, where: str) -> list[str]:
    """`layer_types`, or transformers' rule from `full_attention_interval` (every interval-th layer full)."""
    layer_types = config.get("layer_types")
    if layer_types is None:
        interval = config.get("full_attention_interval", 4)
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ModelConfigError(f"{where}: full_attention_interval={interval!r} must be an integer >= 1")
        # transformers' rule: every interval-th layer is full attention.
        layer_types = [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)
        ]
    if (
        not isinstance(layer_types, list | tuple)
        or len(layer_types) != num_layers
        or any(kind not in ("linear_attention", "full_attention") for kind in layer_types)
    ):
        raise ModelConfigError(
            f"{where}: layer_types must list 'linear_attention' or 'full_attention' for each of the "
            f"{num_layers} layers, got {layer_types!r}"
        )
    return list(layer_types)


def _refuse_unsupported_hybrid_fields(config: Mapping[str, Any], where: str) -> None:
    for key, why in (
        ("use_sliding_window", "full attention only"),
        ("attention_bias", "the family has no biases"),
    ):
        if config.get(key):
            raise ModelConfigError(f"{where}: {key}=true is not supported ({why})")
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise ModelConfigError(f"{where}: hidden_act={act!r} is not supported (only 'silu')")
    if config.get("attn_output_gate") is False:
        raise ModelConfigError(
            f"{where}: attn_output_gate=false is not supported (the family's full attention is always gated)"
        )


def _parse_hybrid(outer: Mapping[str, Any], where: str) -> MoeArchitecture:
    """Qwen3-Next and Qwen3.5-MoE's text model (transformers' `Qwen3NextConfig`, `Qwen3_5MoeTextConfig`)."""
    model_type = str(outer["model_type"])
    config: Mapping[str, Any] = outer
    prefix = "model."
    untrained = ["mtp."]
    if model_type == "qwen3_5_moe":
        # The vision-language checkpoint: the text model's config is nested, its tensors under
        # model.language_model.; the vision tower is carried over untouched.
        text = outer.get("text_config")
        if not isinstance(text, Mapping):
            raise ModelConfigError(f"{where}: model_type 'qwen3_5_moe' needs a text_config object")
        config = text
        prefix = "model.language_model."
        untrained.append("model.visual.")
        where = f"{where}: text_config"
    _refuse_unsupported_hybrid_fields(config, where)
    hidden = _positive(config, "hidden_size", where)
    heads = _positive(config, "num_attention_heads", where)
    kv_heads = _positive(config, "num_key_value_heads", where)
    num_layers = _positive(config, "num_hidden_layers", where)
    head_dim = config.get("head_dim") or hidden // heads
    if heads % kv_heads:
        raise ModelConfigError(
            f"{where}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
        )
    layer_types = _layer_types(config, num_layers, where)
    nk = _positive(config, "linear_num_key_heads", where)
    nv = _positive(config, "linear_num_value_heads", where)
    if nv % nk:
        raise ModelConfigError(
            f"{where}: linear_num_value_heads={nv} is not a multiple of linear_num_key_heads={nk}"
        )
    num_experts = _positive(config, "num_experts", where)
    top_k = _require(config, "num_experts_per_tok", int, where)
    if not 1 <= top_k <= num_experts:
        raise ModelConfigError(
            f"{where}: num_experts_per_tok={top_k} must be between 1 and the number of experts "
            f"({num_experts})"
        )
    shared = config.get("shared_expert_intermediate_size") or 0
    if isinstance(shared, bool) or not isinstance(shared, int) or shared < 0:
        raise ModelConfigError(f"{where}: shared_expert_intermediate_size={shared!r} must be an integer >= 0")
    if model_type == "qwen3_next":
        moe_layers = _sparse_layers(config, num_layers, where)
        norm_topk = _require(config, "norm_topk_prob", bool, where)
        ffn = _require(config, "intermediate_size", int, where)
    else:
        # Qwen3.5-MoE: every layer sparse, top-k always renormalised, no dense MLP.
        moe_layers = tuple(range(num_layers))
        norm_topk = True
        ffn = int(config.get("intermediate_size") or 0)
    theta, fraction = _rope_theta(config, where, partial=True)
    return MoeArchitecture(
        vocab_size=_positive(config, "vocab_size", where),
        hidden_size=hidden,
        num_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=int(head_dim),
        ffn_hidden_size=ffn,
        moe_ffn_hidden_size=_positive(config, "moe_intermediate_size", where),
        num_experts=num_experts,
        top_k=top_k,
        norm_topk_prob=norm_topk,
        rms_norm_eps=float(_require(config, "rms_norm_eps", (int, float), where)),
        rope_theta=theta,
        max_position_embeddings=_positive(config, "max_position_embeddings", where),
        tie_word_embeddings=bool(outer.get("tie_word_embeddings", config.get("tie_word_embeddings", False))),
        moe_layers=moe_layers,
        model_type=model_type,
        layer_types=tuple(layer_types),
        linear_conv_kernel_dim=_positive(config, "linear_conv_kernel_dim", where),
        linear_key_head_dim=_positive(config, "linear_key_head_dim", where),
        linear_value_head_dim=_positive(config, "linear_value_head_dim", where),
        linear_num_key_heads=nk,
        linear_num_value_heads=nv,
        shared_expert_ffn_hidden_size=shared,
        attention_output_gate=True,
        zero_centered_norm=True,
        rotary_percent=fraction,
        hf_prefix=prefix,
        untrained_prefixes=tuple(untrained),
    )

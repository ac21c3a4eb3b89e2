"""The policy as a Megatron-core GPTModel: architecture from a HF config, distributed setup, build, forward.

Qwen3-MoE (`qwen3_moe`) and dense Qwen3 (`qwen3`) map onto Megatron's local (non-Transformer-Engine)
layer spec. The mapping that makes Megatron compute what transformers and vLLM compute (measured against
transformers in tests/trainer/test_trainer_model.py; every item shifts logits by 1–40 when wrong):
grouped-query attention with `num_query_groups = num_key_value_heads`; `kv_channels = head_dim` (Qwen3's
head_dim is not hidden/heads in general); per-head RMSNorm on q and k (`qk_layernorm`); RMSNorm with the
checkpoint's eps; SwiGLU (`gated_linear_unit` + SiLU) without biases; RoPE with the checkpoint's theta,
not interleaved; an untied output layer unless the config ties it; router softmax with
`moe_router_pre_softmax = not norm_topk_prob` (normalised top-k is a softmax over the top-k logits), no
top-k scaling, no load-balancing loss.

The hybrid-attention family (Qwen3-Next, Qwen3.5; `legorl.trainer.models.hybrid` builds its linear-attention
layers) adds: Gated DeltaNet at the layers `layer_types` names (megatron's `linear_*` config fields); full
attention with megatron's `attention_output_gate` (sigmoid of a gate projected with the query); zero-centred
RMSNorm (`(1 + w)`, megatron's `layernorm_zero_centered_gamma`) for the layer, q/k and final norms; RoPE over
the first `rotary_percent` of each head; a shared expert with megatron's sigmoid `moe_shared_expert_gate`.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F

from legorl.trainer.models import compat, hybrid
from legorl.trainer.models.architecture import ModelConfigError, MoeArchitecture

with compat.silence_import_warnings():
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
    )
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.moe.router_replay import RouterReplay
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

__all__ = [
    "GPTModel",
    "ModelConfigError",
    "MoeArchitecture",
    "build_model",
    "entropy",
    "forward_logits",
    "init_distributed",
    "token_logprobs",
    "unwrap",
]

Recompute = Literal["none", "selective", "full"]
Dispatcher = Literal["allgather", "alltoall"]


def init_distributed(
    backend: str | None = None,
    *,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    seed: int = 1234,
) -> None:
    """Start torch.distributed and megatron's parallel state; idempotent.

    Under a launcher (WORLD_SIZE/RANK/MASTER_ADDR/MASTER_PORT set, e.g. torchrun) it joins that group.
    Otherwise it starts a one-process group on an in-memory store (no port to pick or collide on). The
    backend defaults to nccl with CUDA and gloo without. On CUDA it also seeds megatron's CUDA RNG tracker,
    which its GPU weight initialisation requires.
    """
    cuda = torch.cuda.is_available()
    if not cuda:
        compat.enable_cpu_compat()
    if not dist.is_initialized():
        chosen = backend or ("nccl" if cuda else "gloo")
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
            dist.init_process_group(backend=chosen)
        else:
            store = dist.HashStore()  # type: ignore[attr-defined]  # real, but not in torch.distributed's __all__
            dist.init_process_group(backend=chosen, store=store, rank=0, world_size=1)
    wanted = (tensor_model_parallel_size, pipeline_model_parallel_size, expert_model_parallel_size)
    if parallel_state.model_parallel_is_initialized():
        have = (
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_expert_model_parallel_world_size(),
        )
        if have != wanted:
            raise RuntimeError(
                f"megatron's parallel state is already initialised with (tensor, pipeline, expert) sizes "
                f"{have}, not {wanted}; one process holds one layout"
            )
        return
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        expert_model_parallel_size=expert_model_parallel_size,
    )
    if cuda:
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def _resolve_device(device: torch.device | str | None) -> torch.device:
    cuda = torch.cuda.is_available()
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda":
        if not cuda:
            raise ModelConfigError(f"device={resolved}: CUDA is not available on this machine; use cpu")
        if resolved.index is not None:
            torch.cuda.set_device(resolved)
        return torch.device("cuda", torch.cuda.current_device())
    if resolved.type != "cpu":
        raise ModelConfigError(f"device={resolved}: only cpu and cuda are supported")
    if cuda:
        # Megatron puts forward-time buffers on torch.cuda.current_device(); a CPU model would mix devices.
        raise ModelConfigError("device=cpu on a machine with CUDA is not supported; build on cuda")
    return resolved


def transformer_config(
    arch: MoeArchitecture,
    *,
    dtype: torch.dtype = torch.float32,
    routing_replay: bool = False,
    recompute: Recompute = "none",
    moe_token_dispatcher: Dispatcher = "allgather",  # noqa: S107 -- a MoE token dispatcher, not a secret
    cpu_initialization: bool = True,
) -> Any:
    """The megatron TransformerConfig that reproduces `arch` (see the module docstring for why each flag)."""
    if dtype not in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
        raise ModelConfigError(
            f"dtype={dtype}: use torch.float32, torch.bfloat16 or torch.float16 (or float64)"
        )
    if routing_replay and not arch.is_moe:
        raise ModelConfigError("routing_replay=True needs a mixture-of-experts model; this one is dense")
    if recompute not in ("none", "selective", "full"):
        raise ModelConfigError(f"recompute={recompute!r}: use 'none', 'selective' or 'full'")
    if moe_token_dispatcher not in ("allgather", "alltoall"):
        raise ModelConfigError(
            f"moe_token_dispatcher={moe_token_dispatcher!r}: use 'allgather' or 'alltoall'"
        )
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    recompute_kwargs: dict[str, Any] = {}
    if recompute == "selective":
        # Recompute the attention core (scores and softmax), the largest activation of the local,
        # unfused attention; the router is not in it, so replay has nothing to survive here.
        recompute_kwargs = {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]}
    elif recompute == "full":
        # One layer per checkpointed unit: every layer's router runs again during backward, which is
        # what routing replay under recomputation has to survive.
        recompute_kwargs = {
            "recompute_granularity": "full",
            "recompute_method": "uniform",
            "recompute_num_layers": 1,
        }
    moe_kwargs: dict[str, Any] = {}
    if arch.is_moe:
        moe_kwargs = {
            "num_moe_experts": arch.num_experts,
            "moe_ffn_hidden_size": arch.moe_ffn_hidden_size,
            "moe_router_topk": arch.top_k,
            "moe_layer_freq": [1 if i in arch.moe_layers else 0 for i in range(arch.num_layers)],
            "moe_router_score_function": "softmax",
            # norm_topk_prob: softmax over the top-k logits == softmax, top-k, renormalise.
            "moe_router_pre_softmax": not arch.norm_topk_prob,
            "moe_router_load_balancing_type": "none",
            "moe_aux_loss_coeff": 0.0,
            "moe_token_dispatcher_type": moe_token_dispatcher,
            "moe_grouped_gemm": False,
            # The fused router (Transformer Engine) skips routing replay without a word.
            "moe_router_fusion": False,
            "moe_permute_fusion": False,
            "moe_enable_routing_replay": routing_replay,
        }
        if arch.shared_expert_ffn_hidden_size:
            moe_kwargs |= {
                "moe_shared_expert_intermediate_size": arch.shared_expert_ffn_hidden_size,
                "moe_shared_expert_gate": True,
                # Overlapping the shared expert with dispatch needs CUDA streams and the alltoall dispatcher.
                "moe_shared_expert_overlap": False,
            }
    hybrid_kwargs: dict[str, Any] = {}
    if arch.is_hybrid:
        hybrid_kwargs = {
            "linear_conv_kernel_dim": arch.linear_conv_kernel_dim,
            "linear_key_head_dim": arch.linear_key_head_dim,
            "linear_value_head_dim": arch.linear_value_head_dim,
            "linear_num_key_heads": arch.linear_num_key_heads,
            "linear_num_value_heads": arch.linear_num_value_heads,
        }
    return _without_te_recompute_advice(
        TransformerConfig,
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_key_value_heads,
        kv_channels=arch.head_dim,
        ffn_hidden_size=arch.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        qk_layernorm=True,
        layernorm_zero_centered_gamma=arch.zero_centered_norm,
        attention_output_gate=arch.attention_output_gate,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        rotary_interleaved=False,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        # In float32 at least; a float64 model (exactness tests) keeps float64 throughout.
        attention_softmax_in_fp32=dtype != torch.float64,
        apply_query_key_layer_scaling=False,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
        # megatron refuses MoE layers with TP > 1 unless activations are split over the sequence too
        # (and SP halves activation memory besides); the norms that then see a slice of the sequence are
        # built to allow it (`SequenceParallelNorm`).
        sequence_parallel=tp > 1,
        # Pipeline stages exchange activations of this dtype (legorl's own schedule, `pipeline.py`, knows
        # every micro-batch's shape from the plan: megatron's `variable_seq_lengths` stays off, which its
        # allgather dispatcher requires).
        pipeline_dtype=dtype,
        # batch_isend_irecv needs NCCL; gloo (CPU) takes the plain isend/irecv path.
        batch_p2p_comm=torch.cuda.is_available(),
        # The trainer's loss is already normalised over the whole batch (all micro-batches, all data-parallel
        # ranks): megatron's pipeline schedule must not divide it again.
        calculate_per_token_loss=True,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=cpu_initialization,
        # Fused kernels come from Apex / Transformer Engine / custom CUDA code; the plain torch paths
        # run everywhere and compute the same thing.
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        cross_entropy_loss_fusion=False,
        # Its default ("full") is a deprecated spelling of [] that warns on every config.
        cuda_graph_scope=[],
        **recompute_kwargs,
        **moe_kwargs,
        **hybrid_kwargs,
    )


def _without_te_recompute_advice(factory: Any, **kwargs: Any) -> Any:
    """`factory(**kwargs)` without megatron's advice that TE's fused attention needs no core_attn recompute:
    the local spec's attention is unfused, where recomputing it is the point."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="If you are using transformer_engine", category=UserWarning)
        return factory(**kwargs)


def build_model(
    arch: MoeArchitecture,
    *,
    dtype: torch.dtype = torch.float32,
    routing_replay: bool = False,
    recompute: Recompute = "none",
    device: torch.device | str | None = None,
    moe_token_dispatcher: Dispatcher = "allgather",  # noqa: S107 -- a MoE token dispatcher, not a secret
    use_transformer_engine: bool = False,
) -> torch.nn.Module:
    """A randomly initialised megatron GPTModel for `arch` (load weights with `convert.load_hf_weights`).

    Initialises a one-process parallel state first if nothing did. `device` defaults to the current CUDA
    device, else CPU (where the compatibility layer is switched on). megatron keeps the routers' replay
    state in a class-level list that every model built with `routing_replay=True` appends to; it is
    cleared here, so the most recently built replaying model is the one `RouterReplay`'s global calls
    drive (build a reference model without replay first).
    """
    resolved = _resolve_device(device)
    if resolved.type == "cpu":
        compat.enable_cpu_compat()
    compat.patch_missing_transformer_engine()
    if not parallel_state.model_parallel_is_initialized():
        init_distributed()
    if resolved.type == "cuda" and not tensor_parallel.get_cuda_rng_tracker().is_initialized():
        # GPU weight initialisation forks the tracker's model-parallel state; someone else set up the
        # parallel state without seeding it.
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
    RouterReplay.clear_global_router_replay_instances()
    config = transformer_config(
        arch,
        dtype=dtype,
        routing_replay=routing_replay,
        recompute=recompute,
        moe_token_dispatcher=moe_token_dispatcher,
        cpu_initialization=resolved.type == "cpu",
    )
    first, last = parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage()
    if arch.tie_word_embeddings and not (first and last):
        raise ModelConfigError(
            "tie_word_embeddings=true with pipeline parallelism: the first and last stages would each hold "
            "a copy of the embedding to keep in step; this trainer does not do that; use pipeline 1"
        )
    spec = get_gpt_decoder_block_spec(
        config, use_transformer_engine=use_transformer_engine, normalization="RMSNorm"
    )
    if not use_transformer_engine:
        _swap_torch_norms(spec)
    if arch.is_hybrid:
        if use_transformer_engine:
            raise ModelConfigError(
                "the hybrid family is built on megatron's local spec here (its own builder needs Transformer "
                "Engine for every layer); build with use_transformer_engine=False"
            )
        hybrid.enable_torch_gated_delta_rule()
        first_layer = get_transformer_layer_offset(config)
        for offset, layer in enumerate(spec.layer_specs):
            if first_layer + offset in arch.linear_layers:
                # Layers of one kind share one spec object: replace, never mutate.
                spec.layer_specs[offset] = dataclasses.replace(
                    layer,
                    submodules=dataclasses.replace(
                        layer.submodules, self_attention=hybrid.gated_delta_net_spec()
                    ),
                )
    for layer in spec.layer_specs:
        mlp = layer.submodules.mlp
        if isinstance(mlp.module, type) and issubclass(mlp.module, MLP):
            # megatron's own specs leave a dense MLP's width out, and MLP warns (deprecation) when it
            # falls back to config.ffn_hidden_size; say it explicitly.
            layer.submodules.mlp = dataclasses.replace(
                mlp, params={**mlp.params, "ffn_hidden_size": config.ffn_hidden_size}
            )
    with warnings.catch_warnings():
        # megatron's SharedExpertMLP sets its width on a copy of the config and then builds its MLP without
        # passing it, which warns (a deprecation) on every shared expert; a caller cannot pass the width.
        warnings.filterwarnings("ignore", message="MLP requires ffn_hidden_size", category=DeprecationWarning)
        net = _gpt_model(arch, config, spec, first=first, last=last)
    # megatron's torch RMSNorm modules are created in float32 whatever params_dtype says; one dtype
    # throughout is what a HF checkpoint of that dtype holds (outputs are the same: the norm returns the
    # input's dtype either way).
    built: torch.nn.Module = net.to(device=resolved, dtype=dtype)
    return built


def _gpt_model(arch: MoeArchitecture, config: Any, spec: Any, *, first: bool, last: bool) -> Any:
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=arch.vocab_size,
        max_sequence_length=arch.max_position_embeddings,
        # A pipeline stage holds its share of the decoder layers; the first also the embedding, the last
        # the final norm and the output layer.
        pre_process=first,
        post_process=last,
        parallel_output=True,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_percent=arch.rotary_percent,
        rotary_base=arch.rope_theta,
    )


class SequenceParallelNorm:
    """megatron's torch norm (`WrappedTorchNorm`, the local spec's) that accepts sequence parallelism.

    Under sequence parallelism each tensor-parallel rank normalises its own slice of the sequence, so the
    norm weight's gradient on each rank covers only that slice: the weight is marked `sequence_parallel` and
    the trainer sums its gradient over the tensor-parallel group, as Transformer Engine's norms and
    megatron's `finalize_model_grads` do. Without sequence parallelism it is exactly `WrappedTorchNorm`.
    """

    def __new__(  # type: ignore[misc]  # a factory, like the class it replaces
        cls,
        config: Any,
        hidden_size: int,
        eps: float = 1e-5,
        *,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "RMSNorm",
    ) -> torch.nn.Module:
        if config.normalization != "RMSNorm":
            raise ModelConfigError(f"normalization {config.normalization!r}: only RMSNorm is built")
        norm: torch.nn.Module
        if zero_centered_gamma or config.layernorm_zero_centered_gamma:
            norm = ZeroCenteredRMSNorm(hidden_size, eps=eps)
        else:
            norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        norm.weight.sequence_parallel = bool(config.sequence_parallel)  # type: ignore[attr-defined]  # megatron's flag
        return norm


class ZeroCenteredRMSNorm(torch.nn.Module):
    """RMSNorm scaled by (1 + weight), in float32 whatever the input's dtype: transformers' `Qwen3NextRMSNorm`
    (the weight starts at zero)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)


def _swap_torch_norms(spec: Any) -> None:
    """Replace megatron's `WrappedTorchNorm` by `SequenceParallelNorm` everywhere in a layer/block spec."""
    if isinstance(spec, ModuleSpec):
        if spec.module is WrappedTorchNorm:
            spec.module = SequenceParallelNorm
        if spec.submodules is not None:
            _swap_torch_norms(spec.submodules)
        return
    if isinstance(spec, (list, tuple)):
        for item in spec:
            _swap_torch_norms(item)
        return
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        for f in dataclasses.fields(spec):
            value = getattr(spec, f.name)
            if value is WrappedTorchNorm:
                setattr(spec, f.name, SequenceParallelNorm)
            else:
                _swap_torch_norms(value)


def unwrap(model: torch.nn.Module) -> Any:
    """The GPTModel inside wrappers that keep it as `.module` (DDP, megatron's Float16Module)."""
    inner: Any = model
    while not isinstance(inner, GPTModel) and isinstance(getattr(inner, "module", None), torch.nn.Module):
        inner = inner.module
    return inner


def attention_masks(
    batch: int, seq_len: int, lengths: torch.Tensor | None, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(attention mask [B|1, 1, S, S], MoE padding mask [B, S] or None); True means masked / padding."""
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).triu(1)[None, None]
    if lengths is None:
        return causal, None
    positions = torch.arange(seq_len, device=device)
    padding = positions[None, :] >= lengths.to(device)[:, None]
    # Right padding: a real query never reaches a padding key through the causal mask alone; masking
    # padding keys as well keeps padding queries from attending to padding (they still see position 0).
    return causal | padding[:, None, None, :], padding


def forward_logits(
    model: torch.nn.Module, input_ids: torch.Tensor, lengths: torch.Tensor | None = None
) -> torch.Tensor:
    """Float32 logits [B, S, V] of a right-padded batch; positions >= lengths[b] are padding.

    Position ids are 0..S-1 per row. The causal (+ padding) mask is passed explicitly so nothing depends
    on megatron building its default mask on a CUDA device.
    """
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
    batch, seq_len = input_ids.shape
    if lengths is not None and lengths.shape != (batch,):
        raise ValueError(f"lengths must be [batch]={batch}, got shape {tuple(lengths.shape)}")
    device = input_ids.device
    position_ids = torch.arange(seq_len, device=device).unsqueeze(0).expand(batch, seq_len)
    mask, padding = attention_masks(batch, seq_len, lengths, device)
    logits: torch.Tensor = model(
        input_ids, position_ids, mask, padding_mask=padding, runtime_gather_output=True
    )
    return logits.float()


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[target] per position, float32: logits [B, S, V], targets [B, S] -> [B, S]."""
    logits = logits.float()
    picked = logits.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) per position, float32: [B, S, V] -> [B, S]."""
    logits = logits.float()
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(-1)

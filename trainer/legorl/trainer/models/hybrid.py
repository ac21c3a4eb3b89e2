"""The hybrid-attention family's layers on megatron's local spec: Gated DeltaNet and its output norm.

megatron-core 0.16's Qwen3-Next spec builder (`experimental_attention_variant_module_specs.py`) asserts
Transformer Engine, so the layers are assembled here from megatron's own modules: `GatedDeltaNet` with a
`ColumnParallelLinear` input projection, a plain RMSNorm over each value head (the family's gated output norm
is *not* zero-centred) and a `RowParallelLinear` output projection; the decoder layer keeps its own input
norm.

`GatedDeltaNet` imports two kernels from flash-linear-attention (Triton, GPU only) and refuses to build
without it. On a machine without the package, `enable_torch_gated_delta_rule()` gives it torch versions:
the chunked gated delta rule megatron itself ships (`torch_chunk_gated_delta_rule`, what its
`deterministic_mode` runs; the same algorithm as transformers' fallback, measured ≤ 6e-8 apart in fp32) and
an L2 norm that is transformers' (`x · rsqrt(Σx² + 1e-6)` in fp32); the gated output norm and the attention
output gate run uncompiled.
With the package installed (GPUs), its kernels and megatron's compiled norm are used unchanged.
"""

from __future__ import annotations

from typing import Any

import torch

from legorl.trainer.models import compat

with compat.silence_import_warnings():
    from megatron.core.ssm import gated_delta_net as gdn
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.attention import Attention
    from megatron.core.transformer.spec_utils import ModuleSpec

__all__ = ["GdnOutputNorm", "enable_torch_gated_delta_rule", "gated_delta_net_spec", "l2norm"]


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """transformers' `l2norm` (Qwen3-Next's torch path): x / sqrt(Σx² + eps), computed in float32."""
    xf = x.float()
    return (xf * torch.rsqrt((xf * xf).sum(dim=dim, keepdim=True) + eps)).to(x.dtype)


def enable_torch_gated_delta_rule() -> bool:
    """Let megatron's `GatedDeltaNet` run without flash-linear-attention (torch kernels); idempotent.

    Returns True when the torch kernels are in use, False when flash-linear-attention is installed.
    """
    if (
        gdn.HAVE_FLA
        and gdn.chunk_gated_delta_rule is not None
        and gdn.chunk_gated_delta_rule is not _torch_rule
    ):
        return False
    gdn.HAVE_FLA = True
    gdn.l2norm = l2norm
    gdn.chunk_gated_delta_rule = _torch_rule
    # The gated output norm and full attention's output gate are wrapped in torch.compile (megatron's
    # `jit_fuser`): on these machines that is a compilation per shape for a few elementwise operations (and
    # dynamo turns a warning inside into an error); run them as written.
    for owner, name in ((gdn.GatedDeltaNet, "_apply_gated_norm"), (Attention, "_apply_output_gate")):
        compiled = getattr(owner, name)
        setattr(owner, name, getattr(compiled, "_torchdynamo_orig_callable", compiled))
    return True


def _torch_rule(*args: Any, **kwargs: Any) -> Any:
    return gdn.torch_chunk_gated_delta_rule(*args, **kwargs)


class GdnOutputNorm:
    """The Gated DeltaNet output norm: RMSNorm over one value head's channels, scaled by its weight (plain,
    not zero-centred: transformers' `Qwen3NextRMSNormGated` starts at ones); megatron multiplies the gate in.

    Its weight is shared by every value head, and under tensor parallelism each rank holds some of the heads:
    its gradient is marked to be summed over the tensor-parallel group (`parallel.reduce_gradients`).
    """

    def __new__(  # type: ignore[misc]  # a factory, like megatron's norm classes
        cls, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any
    ) -> torch.nn.Module:
        norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        norm.weight.sequence_parallel = config.tensor_model_parallel_size > 1  # type: ignore[attr-defined]  # megatron
        return norm


def gated_delta_net_spec() -> ModuleSpec:
    """The `self_attention` of a linear-attention decoder layer."""
    return ModuleSpec(
        module=gdn.GatedDeltaNet,
        submodules=gdn.GatedDeltaNetSubmodules(
            in_proj=ColumnParallelLinear, out_norm=GdnOutputNorm, out_proj=RowParallelLinear
        ),
    )

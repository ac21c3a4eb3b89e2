"""Makes megatron-core 0.16 run on a CPU-only torch: a few documented patches, installed only without CUDA.

Megatron assumes a GPU in a handful of places that a tiny model on CPU still reaches. Each patch below
replaces a call that would otherwise raise on a CPU-only torch, so none of them can change what a working
program does; on a machine with CUDA `enable_cpu_compat()` installs nothing.

- `torch.cuda.current_device()` returns the CPU device. Megatron uses it as the device of buffers it
  builds during the forward pass (RoPE's `inv_freq` is moved there on the first call, the router weight,
  gather buffers); a CPU-only torch raises "Torch not compiled with CUDA enabled" instead.
- megatron's no-op RNG tracker (the one it uses for inference) replaces its CUDA RNG tracker: the real one
  seeds and forks `torch.cuda` generators around dropout and weight initialisation, which do not exist
  here. CPU randomness still comes from torch's default generator.
- `tensor_parallel.random._get_cuda_rng_state` / `_set_cuda_rng_state` become no-ops: activation
  recomputation saves and restores the CUDA RNG state around each checkpointed block.

`silence_import_warnings()` and `patch_missing_transformer_engine()` are not CPU-specific: the first hides
the warnings megatron emits at import when Transformer Engine and Apex are absent, the second fills a name
megatron 0.16 leaves undefined without Transformer Engine (it applies on a GPU without TE too).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["enable_cpu_compat", "patch_missing_transformer_engine", "silence_import_warnings"]

_enabled = False

# The warnings megatron-core 0.16 emits while importing on a machine without Transformer Engine / Apex
# (fallbacks it announces, deprecations inside its own package). Matched by message, narrowly, so a new
# warning still shows.
_IMPORT_WARNINGS: tuple[tuple[str, type[Warning]], ...] = (
    (r"Transformer Engine and Apex are not installed", UserWarning),
    (r"Apex is not installed", UserWarning),
    (r"The following imports from `dynamic_context.py` will be removed", DeprecationWarning),
    (r"(?s).*megatron\.core\.transformer\.custom_layers\.transformer_engine.*deprecated", DeprecationWarning),
    (r"`torch\.jit\.script_method` is deprecated", DeprecationWarning),
)


@contextlib.contextmanager
def silence_import_warnings() -> Iterator[None]:
    """Hide the known warnings megatron-core emits at import (missing TE/Apex fallbacks, its deprecations)."""
    with warnings.catch_warnings():
        for message, category in _IMPORT_WARNINGS:
            warnings.filterwarnings("ignore", message=message, category=category)
        yield


def patch_missing_transformer_engine() -> None:
    """Define `moe_utils.te_general_gemm = None` when Transformer Engine is absent; idempotent.

    megatron-core 0.16 imports `te_general_gemm` inside a `try` and only sets `HAVE_TE = False` when the
    import fails, but the router's gating linear tests `te_general_gemm is not None`: without TE every MoE
    forward dies with NameError. None is the value the code expects for "no TE" (it then uses torch.mm).
    """
    with silence_import_warnings():
        from megatron.core.transformer.moe import moe_utils  # noqa: PLC0415

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _cpu_device() -> torch.device:
    return torch.device("cpu")


def _no_cuda_rng_state(*_args: Any, **_kwargs: Any) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8)


def _ignore_cuda_rng_state(*_args: Any, **_kwargs: Any) -> None:
    return None


def enable_cpu_compat() -> bool:
    """Install the CPU patches (see the module docstring) when CUDA is absent; idempotent.

    Returns True when the patches are active, False on a machine with CUDA (where nothing is installed).
    Call it before building a model or initialising megatron's parallel state.
    """
    global _enabled  # noqa: PLW0603 -- patches are process-wide by nature; the flag makes them idempotent
    if torch.cuda.is_available():
        return False
    if _enabled:
        return True
    patch_missing_transformer_engine()
    with silence_import_warnings():
        from megatron.core.tensor_parallel import random as mrandom  # noqa: PLC0415

    torch.cuda.current_device = _cpu_device  # type: ignore[assignment]  # patching torch on a CPU-only machine
    mrandom._get_cuda_rng_state = _no_cuda_rng_state
    mrandom._set_cuda_rng_state = _ignore_cuda_rng_state
    # The inference tracker's add/set_states/fork are no-ops; force_reset drops a CUDA tracker someone
    # may have created before (it could not have been seeded on this machine).
    mrandom.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    _enabled = True
    return True

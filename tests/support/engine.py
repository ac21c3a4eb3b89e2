"""A real inference engine for tests: a tiny random Qwen3-MoE checkpoint and a vLLM (CPU) server around it.

Plain helpers, no pytest fixtures, so any test module (or a benchmark script) can use them:

- ``make_tiny_model(directory)`` (from ``legorl.trainer.models.tiny``, the product's ``builtin://tiny-moe``)
  writes a ~1.5M-parameter ``Qwen3MoeForCausalLM`` with random weights, a byte-level BPE tokenizer trained on
  text generated here, and a ChatML chat template with hermes-style tool calls (the Qwen layout). No network,
  no hub; deterministic for a seed; takes seconds.
- ``VllmServer(model_dir)`` (from ``legorl.embedded.engine``, what ``legorl run`` serves with) runs
  ``python -m vllm.entrypoints.openai.api_server`` on it in a subprocess (the test process never imports
  vLLM) and stops the whole process group on exit.

torch, transformers and tokenizers are imported inside ``make_tiny_model`` only, so importing this module is
cheap and has no side effects.
"""

from __future__ import annotations

# The tiny model and the engine process live in the product (`builtin://tiny-moe`, `legorl run`); re-exported
# here for the engine tests.
from legorl.embedded.engine import SERVED_MODEL_NAME, VllmServer, free_port
from legorl.trainer.models.tiny import IM_END, make_tiny_model

__all__ = ["IM_END", "SERVED_MODEL_NAME", "VllmServer", "free_port", "make_tiny_model"]

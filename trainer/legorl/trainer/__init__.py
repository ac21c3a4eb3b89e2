"""The Megatron MoE trainer with routing replay and weight sync (see issue: Trainer).

Installed with the `trainer` extra (torch, megatron-core, safetensors).
"""

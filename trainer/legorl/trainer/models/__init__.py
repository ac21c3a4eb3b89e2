"""The model: Hugging Face architectures as Megatron-core modules, their conversion, the tiny test models."""

"""Model helpers: a tiny offline Qwen2 model for tests and toy tasks.

Also models from the hub (`hub`) and LoRA (`lora`: PEFT's adapters, merged or served). May import: `algo`,
`faults`, `config`, `types`."""

from grpo_dist.models.tiny import CHARACTERS, HEAD_DIM, build_tiny_model, build_tiny_tokenizer

__all__ = ["CHARACTERS", "HEAD_DIM", "build_tiny_model", "build_tiny_tokenizer"]

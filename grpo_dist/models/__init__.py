"""Model helpers: a tiny offline Qwen2 model for tests and toy tasks."""

from grpo_dist.models.tiny import CHARACTERS, HEAD_DIM, build_tiny_model, build_tiny_tokenizer

__all__ = ["CHARACTERS", "HEAD_DIM", "build_tiny_model", "build_tiny_tokenizer"]

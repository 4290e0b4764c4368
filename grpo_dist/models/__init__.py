"""Model helpers: a tiny offline Qwen2 model for tests and toy tasks.

Also models from the hub (`hub`) and LoRA (`lora`: PEFT's adapters, merged or served). May import: `algo`,
`faults`, `config`, `types`. The tiny model's names are imported on first use: importing one of this folder's
modules (the driver's `vision`, say) costs no transformers model classes."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from grpo_dist.models.tiny import CHARACTERS, HEAD_DIM, build_tiny_model, build_tiny_tokenizer

__all__ = ["CHARACTERS", "HEAD_DIM", "build_tiny_model", "build_tiny_tokenizer"]


def __getattr__(name: str):
    if name in __all__:
        return getattr(importlib.import_module("grpo_dist.models.tiny"), name)
    if name in ("hub", "lora", "tiny", "tiny_vision", "vision"):  # `from grpo_dist.models import lora`
        return importlib.import_module(f"grpo_dist.models.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

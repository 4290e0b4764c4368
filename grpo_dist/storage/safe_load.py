"""Loading what a checkpoint holds without running code from it: every `torch.load` is `weights_only`, with only the
classes its caller names allowed (the run state's own dataclasses, `checkpoints.RUN_STATE_CLASSES`; the few
DeepSpeed keeps in its optimizer state). A
file that holds anything else is refused, naming the file and what it holds."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch


class UnsafeCheckpoint(RuntimeError):
    """A checkpoint file holds objects other than tensors, plain data and the classes allowed."""


def deepspeed_classes() -> list[type]:
    """What DeepSpeed's checkpoint files hold besides tensors and plain data (its optimizer's state)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [fragment_address, LossScaler, DynamicLossScaler, ZeroStageEnum]


def load(path: str | Path, allowed: list[type | tuple[type, str]], map_location: Any = None) -> Any:
    """`torch.load(path, weights_only=True)` with `allowed` classes (each a class, or a class and the dotted name a
    file may hold it by: where it was defined once); refuses anything else, naming it."""
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        held = torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
        names = {
            entry[1] if isinstance(entry, tuple) else f"{entry.__module__}.{entry.__qualname__}" for entry in allowed
        }
        extra = sorted(set(held) - names)
        raise UnsafeCheckpoint(
            f"{path}: holds {', '.join(extra) or 'objects'} besides tensors and plain data; grpo-dist loads "
            "checkpoints without running code from them, so it does not load this file"
        ) from err

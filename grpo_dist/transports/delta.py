"""Delta sync's arithmetic: which elements of a tensor changed since the engines' copy, the patch that carries them,
and the checksum both ends compare. Plain torch on byte buffers, shared by the sender and the receiving workers.

Elements are compared bit for bit, through an integer view of the wire dtype: in bf16 or fp16 most weights round to
the same value after a small optimizer step, and those are not sent. A slot's patch is its changed elements' flat
indices (int32, or int64 past 2**31 elements) and their values; where that would take more bytes than the slot
itself, the slot travels whole (count `WHOLE` in the bucket's header).
"""

from __future__ import annotations

import numpy as np
import torch

ALIGN = 64  # bytes: every part of a bucket or patch starts at a multiple of this, so any dtype can be viewed in place
WHOLE = -1  # a header count meaning: the slot's every element follows, not a patch
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def bits(region: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A uint8 region holding `dtype` elements, viewed as integers of the same width: compared bit for bit."""
    return region.view(_BITS[dtype.itemsize])


def index_dtype(numel: int) -> torch.dtype:
    return torch.int32 if numel < 2**31 else torch.int64


def differs(new: torch.Tensor, old: torch.Tensor) -> np.ndarray:
    """Where two integer views differ, element by element (in numpy, whose compare of 16-bit integers on a CPU is
    the faster).  # new, old: [numel] -> [numel] bool"""
    return new.numpy() != old.numpy()


def positions(mask: np.ndarray) -> torch.Tensor:
    """Flat indices of the set elements of `mask`.  # [numel] -> [changed] int64"""
    return torch.from_numpy(np.flatnonzero(mask))


def patch_nbytes(count: int, numel: int, dtype: torch.dtype) -> int:
    """Bytes a slot's part of the payload takes: its patch of `count` changed elements, or the whole slot."""
    if count == WHOLE:
        return aligned(numel * dtype.itemsize)
    if count == 0:
        return 0
    return aligned(count * index_dtype(numel).itemsize) + aligned(count * dtype.itemsize)


def worth_a_patch(count: int, numel: int, dtype: torch.dtype) -> bool:
    """Whether `count` changed elements are cheaper as a patch than the whole slot."""
    return patch_nbytes(count, numel, dtype) < patch_nbytes(WHOLE, numel, dtype)


def write_patch(payload: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, numel: int) -> int:
    """Write a patch (flat indices, integer-viewed values) at the start of `payload`; returns the bytes written."""
    count = indices.numel()
    index_bytes = count * index_dtype(numel).itemsize
    payload[:index_bytes].view(index_dtype(numel)).copy_(indices)
    start = aligned(index_bytes)
    value_bytes = values.numel() * values.element_size()
    payload[start : start + value_bytes].view(values.dtype).copy_(values)
    return start + aligned(value_bytes)


def read_patch(payload: torch.Tensor, count: int, numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices, integer-viewed values) of a patch written by `write_patch`, as views into `payload`."""
    index_bytes = count * index_dtype(numel).itemsize
    indices = payload[:index_bytes].view(index_dtype(numel))
    start = aligned(index_bytes)
    values = payload[start : start + count * dtype.itemsize].view(_BITS[dtype.itemsize])
    return indices, values


def checksum(buffers: list[torch.Tensor]) -> int:
    """Sum of the buffers' bytes read as int64 (wrapping): equal copies give equal sums on any machine, and any
    changed element changes it unless another change cancels it exactly."""
    total = 0
    for buffer in buffers:
        total = (total + int(buffer.view(torch.int64).sum())) % 2**64
    return total

"""The gloo wire of the broadcast transport (`grpo_dist.transports.gloo` tells the protocol): what a sync declares
(`GlooWeightTransferUpdateInfo`) and each side's rendezvous, the bucket plan both sides cut the parameters into, a
bucket packed and unpacked, the two reused buffers, and the gloo group and broadcast."""

from __future__ import annotations

import datetime
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch.distributed import PrefixStore, TCPStore
from torch.distributed.distributed_c10d import BroadcastOptions, ProcessGroupGloo

from grpo_dist.transports.delta import aligned

BACKEND = "gloo"


@dataclass(frozen=True)
class ParamMeta:
    """One parameter as a sync declares it: its name, the dtype it travels in, its full shape. The learner's side
    of the wire is vLLM's own protocol written without vLLM's types, so that the learner never imports vLLM (5 of a
    learner's 9 CPU-seconds of start-up were that import); vLLM's worker side reads the same fields."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


def layer_groups(names: list[str]) -> list[list[str]]:
    """The parameter names grouped by decoder layer, in the order a sync sends them: the names before the first
    indexed one (the embeddings), then each indexed stack's layers in ascending index (stacks in the order their
    prefix first appears: `model.layers.3.`, `transformer.h.3.`, `visual.blocks.3.`), then every other un-indexed
    name (the final norm, the head), whatever order they came in."""
    before: list[str] = []
    after: list[str] = []
    stacks: dict[tuple[str, int], list[str]] = {}
    for name in names:
        key = _stack(name)
        if key is None:
            (after if stacks else before).append(name)
        else:
            stacks.setdefault(key, []).append(name)
    prefixes = list(dict.fromkeys(prefix for prefix, _ in stacks))
    ordered = sorted(stacks, key=lambda key: (prefixes.index(key[0]), key[1]))
    return [group for group in [before, *(stacks[key] for key in ordered), after] if group]


def _stack(name: str) -> tuple[str, int] | None:
    """(the path up to a name's first numeric part, that number), or None for a name without one."""
    parts = name.split(".")
    for index, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:index]), int(part)
    return None


@dataclass
class GlooWeightTransferInitInfo:
    """What a worker needs to join the group (its rank is `rank_offset` + its rank inside its engine)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    bucket_bytes: int
    timeout_s: float


@dataclass
class GlooTrainerInitInfo:
    """Trainer side: the rendezvous (rank 0 hosts it), group size, bucket size, the bound on every wait, and delta
    sync (`delta`, a full sync every `full_every` syncs). Rank 0 sends."""

    backend: ClassVar[str] = BACKEND

    master_address: str
    master_port: int
    world_size: int
    bucket_bytes: int
    timeout_s: float
    delta: bool = False
    full_every: int = 1
    rank: int = field(kw_only=True)

    @property
    def is_sender(self) -> bool:
        return self.rank == 0


@dataclass
class GlooWeightTransferUpdateInfo:
    """One sync: every parameter in the order it is sent (at the dtype it travels in), and how it travels."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    mode: str = "full"  # "full": every byte; "delta": patches against the workers' copies
    keep: bool = False  # delta sync is on: workers keep what they receive as their copy, and report its checksum
    version: int = 0  # the weights' version after this sync
    base_version: int | None = None  # a delta's: the version the workers' copies must hold


@dataclass(frozen=True)
class Slot:
    """Where one parameter sits inside its bucket."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # bytes from the bucket's start
    nbytes: int
    layer: int  # index of its decoder layer (its group in `layer_groups`)

    @property
    def numel(self) -> int:
        return self.nbytes // self.dtype.itemsize

    def region(self, buffer: torch.Tensor) -> torch.Tensor:
        return buffer[self.offset : self.offset + self.nbytes]


@dataclass(frozen=True)
class Bucket:
    slots: list[Slot]
    nbytes: int  # a multiple of ALIGN: the bytes after the last slot are zero


def plan_buckets(params: list[ParamMeta], bucket_bytes: int) -> list[Bucket]:
    """Consecutive decoder layers grouped into buckets of at most `bucket_bytes` (a larger layer makes a bucket of
    its own). Both sides compute it from the same metadata."""
    by_name = {param.name: param for param in params}
    buckets: list[Bucket] = []
    slots: list[Slot] = []
    size = 0
    for layer, names in enumerate(layer_groups([param.name for param in params])):
        layer_bytes = sum(aligned(_nbytes(by_name[name])) for name in names)
        if slots and size + layer_bytes > bucket_bytes:
            buckets.append(Bucket(slots, size))
            slots, size = [], 0
        for name in names:
            param = by_name[name]
            slots.append(Slot(name, param.dtype, tuple(param.shape), size, _nbytes(param), layer))
            size += aligned(_nbytes(param))
    if slots:
        buckets.append(Bucket(slots, size))
    return buckets


def _nbytes(param: ParamMeta) -> int:
    return math.prod(param.shape) * param.dtype.itemsize


def open_group(address: str, port: int, rank: int, world_size: int, timeout_s: float) -> ProcessGroupGloo:
    """A gloo group of its own (no global torch.distributed state), rank 0 hosting the TCP store. Blocks until
    every rank has joined, at most `timeout_s`."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = TCPStore(address, port, world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=False)
    return ProcessGroupGloo(PrefixStore("grpo-dist/weights", store), rank, world_size, timeout)


def broadcast(group: ProcessGroupGloo, tensor: torch.Tensor):
    """Start broadcasting `tensor` from rank 0; returns the work to wait on."""
    options = BroadcastOptions()
    options.rootRank, options.rootTensor = 0, 0
    return group.broadcast([tensor], options)


def unpack(buffer: torch.Tensor, slots: list[Slot]) -> list[tuple[str, torch.Tensor]]:
    """The parameters of a received bucket, as views into it."""
    return [(slot.name, slot.region(buffer).view(slot.dtype).view(slot.shape)) for slot in slots]


class Buffers:
    """Two byte buffers used in turn, grown when a bucket needs more, kept from sync to sync (allocating and
    faulting in a bucket's memory each time costs as much as copying it)."""

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor | None] = [None, None]

    def take(self, index: int, nbytes: int) -> torch.Tensor:
        side = index % 2
        if self.buffers[side] is None or self.buffers[side].numel() < nbytes:
            self.buffers[side] = torch.zeros(nbytes, dtype=torch.uint8)
        return self.buffers[side][:nbytes]


def layout(update_info: GlooWeightTransferUpdateInfo) -> tuple:
    return (tuple(update_info.names), tuple(update_info.dtype_names), tuple(map(tuple, update_info.shapes)))


def pack(buffer: torch.Tensor, slots: list[Slot], tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Copy the source's next tensors (or partitions) into their slots of `buffer`, cast to the wire dtype."""
    for slot in slots:
        name, tensor = next(tensors)
        if name != slot.name or tuple(tensor.shape) != slot.shape:
            raise ValueError(
                f"weight source yielded {name} {tuple(tensor.shape)} where its metadata declared {slot.name} "
                f"{slot.shape}"
            )
        if isinstance(tensor, torch.Tensor):
            slot.region(buffer).view(slot.dtype).view(slot.shape).copy_(tensor)
        else:  # a weight's ZeRO-3 partitions, gathered to this rank (`grpo_dist.transports.broadcast.Partitions`)
            tensor.copy_to(slot.region(buffer).view(slot.dtype))

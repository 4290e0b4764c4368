"""vLLM weight-transfer engines over gloo: the broadcast transport's wire on machines without GPUs.

vLLM ships trainer/worker engine pairs (`vllm.distributed.weight_transfer`) and an NCCL pair for GPUs; this module
registers a "gloo" pair under the same factories, so CPU runs (and CI) take the protocol a GPU cluster takes:
the trainer's rank 0 and every vLLM worker join one process group (the trainer is rank 0, worker w of generator g
is rank 1 + g * tensor_parallel_size + w), the trainer declares the parameters (names, dtypes, shapes), and both
sides cut them into the same buckets of about `bucket_bytes`. Each bucket travels as one flat byte tensor.

The sender packs bucket i+1 while bucket i is on the wire and reuses two buffers, so beside its model it never
holds more than two buckets. A receiving worker loads each bucket through vLLM's layerwise reload (started and
finished around the update by the worker), which may keep a layer's tensors until the layer is complete, so it
receives every bucket into a fresh buffer.

Importing the module registers the engines: the generator's worker extension (`grpo_dist.actors.weight_sync`)
imports it inside every vLLM worker, the learner imports it before it opens the sender.
"""

from __future__ import annotations

import datetime
import logging
import math
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import ClassVar, Self

import torch
from torch.distributed import PrefixStore, TCPStore
from torch.distributed.distributed_c10d import BroadcastOptions, ProcessGroupGloo
from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

BACKEND = "gloo"
ALIGN = 64  # bytes: every tensor starts at a multiple of this inside a bucket, so any dtype can be viewed in place


@dataclass
class GlooWeightTransferInitInfo(WeightTransferInitInfo):
    """What a worker needs to join the group (its rank is `rank_offset` + its rank inside its engine)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    bucket_bytes: int
    timeout_s: float


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    """Trainer side: the rendezvous (rank 0 hosts it), group size, bucket size and the bound on every wait."""

    backend: ClassVar[str] = BACKEND

    master_address: str
    master_port: int
    world_size: int
    bucket_bytes: int
    timeout_s: float


@dataclass
class GlooWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    """One sync: every parameter, in the order it will be sent."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]


@dataclass(frozen=True)
class Slot:
    """Where one parameter sits inside its bucket."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # bytes from the bucket's start
    nbytes: int


def plan_buckets(params: list[ParamMeta], bucket_bytes: int) -> list[tuple[list[Slot], int]]:
    """Consecutive parameters grouped into buckets of at most `bucket_bytes` (one larger parameter makes a bucket
    of its own), each as (slots, bucket size in bytes). Both sides compute it from the same metadata."""
    buckets: list[tuple[list[Slot], int]] = []
    slots: list[Slot] = []
    size = 0
    for param in params:
        nbytes = math.prod(param.shape) * param.dtype.itemsize
        offset = -(-size // ALIGN) * ALIGN
        if slots and offset + nbytes > bucket_bytes:
            buckets.append((slots, size))
            slots, offset = [], 0
        slots.append(Slot(param.name, param.dtype, tuple(param.shape), offset, nbytes))
        size = offset + nbytes
    if slots:
        buckets.append((slots, size))
    return buckets


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
    return [
        (slot.name, buffer[slot.offset : slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape)) for slot in slots
    ]


class GlooWeightTransferEngine(WeightTransferEngine[GlooWeightTransferInitInfo, GlooWeightTransferUpdateInfo]):
    """Worker side, created by vLLM inside each engine worker when the engine is built with backend "gloo"."""

    init_info_cls = GlooWeightTransferInitInfo
    update_info_cls = GlooWeightTransferUpdateInfo

    group: ProcessGroupGloo | None = None

    def init_transfer_engine(self, init_info: GlooWeightTransferInitInfo) -> None:
        rank = init_info.rank_offset + self.parallel_config.rank
        self.bucket_bytes = init_info.bucket_bytes
        self.group = open_group(
            init_info.master_address, init_info.master_port, rank, init_info.world_size, init_info.timeout_s
        )

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def receive_weights(self, update_info: GlooWeightTransferUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("gloo weight transfer: update_weights before init_weight_transfer_engine")
        params = [
            ParamMeta(name, getattr(torch, dtype), tuple(shape))
            for name, dtype, shape in zip(update_info.names, update_info.dtype_names, update_info.shapes, strict=True)
        ]
        buckets = plan_buckets(params, self.bucket_bytes)
        # Receive bucket i+1 while bucket i loads into the model.
        pending = None
        for slots, size in buckets:
            buffer = torch.empty(size, dtype=torch.uint8)
            work = broadcast(self.group, buffer)
            if pending is not None:
                self._load(*pending)
            work.wait()
            pending = (buffer, slots)
        if pending is not None:
            self._load(*pending)

    def _load(self, buffer: torch.Tensor, slots: list[Slot]) -> None:
        self.model.load_weights([(name, tensor.to(self.device)) for name, tensor in unpack(buffer, slots)])

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        # vLLM warns on each reload that the rotary embedding "failed to load": its cos/sin cache is derived from
        # the config, not from weights, and is kept. Every real parameter is loaded (tests compare logprobs).
        layerwise = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
        level = layerwise.level
        layerwise.setLevel(logging.ERROR)
        try:
            finalize_layerwise_reload(self.model, self.model_config)
        finally:
            layerwise.setLevel(level)

    def shutdown(self) -> None:
        self.group = None


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    """Trainer side. Every learner rank iterates the source (under ZeRO-3 each parameter's gather is a collective);
    rank 0 also drives the workers through the client and sends."""

    init_info_cls = GlooTrainerInitInfo

    group: ProcessGroupGloo | None = None

    @classmethod
    def trainer_init(
        cls, init_info: GlooTrainerInitInfo, *, client: VLLMWeightSyncClient, source: WeightSource | None = None
    ) -> Self:
        if source is None:
            raise ValueError("gloo weight transfer needs a WeightSource")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        engine.bucket_bytes = init_info.bucket_bytes
        engine.buffers = [None, None]  # kept between syncs: allocating (and faulting in) buckets each time is slow
        if not engine.is_sender:
            return engine
        worker_info = GlooWeightTransferInitInfo(
            master_address=init_info.master_address,
            master_port=init_info.master_port,
            rank_offset=1,  # the client moves it to each generator's first rank
            world_size=init_info.world_size,
            bucket_bytes=init_info.bucket_bytes,
            timeout_s=init_info.timeout_s,
        )
        # The workers block in the rendezvous until rank 0 joins: start them, then join.
        with ThreadPoolExecutor(max_workers=1) as pool:
            joined = pool.submit(client.init_weight_transfer_engine, asdict(worker_info))
            engine.group = open_group(
                init_info.master_address, init_info.master_port, 0, init_info.world_size, init_info.timeout_s
            )
            joined.result()
        return engine

    def send_weights(self) -> None:
        assert self.source is not None
        meta = self.source.metadata()
        if not self.is_sender:
            for _ in self.source:  # take part in each parameter's gather
                pass
            return
        update = GlooWeightTransferUpdateInfo(
            names=[m.name for m in meta],
            dtype_names=[str(m.dtype).removeprefix("torch.") for m in meta],
            shapes=[list(m.shape) for m in meta],
        )
        self.client.start_weight_update()
        pool = ThreadPoolExecutor(max_workers=1)
        try:
            received = pool.submit(self.client.update_weights, asdict(update))
            self._send(plan_buckets(meta, self.bucket_bytes), iter(self.source))
            received.result()
        finally:
            pool.shutdown(wait=False)  # after a failed send the workers never return; do not wait for them
        self.client.finish_weight_update()

    def _send(self, buckets: list[tuple[list[Slot], int]], tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Pack each bucket into one of two buffers while the previous bucket is on the wire."""
        buffers: list[torch.Tensor | None] = self.buffers
        works: list = [None, None]
        for index, (slots, size) in enumerate(buckets):
            side = index % 2
            if works[side] is not None:
                works[side].wait()  # the bucket sent from this buffer two steps ago has left
            if buffers[side] is None or buffers[side].numel() < size:
                buffers[side] = torch.empty(size, dtype=torch.uint8)
            buffer = buffers[side][:size]
            for slot in slots:
                name, tensor = next(tensors)
                if name != slot.name or tuple(tensor.shape) != slot.shape or tensor.dtype != slot.dtype:
                    raise ValueError(
                        f"weight source yielded {name} {tensor.dtype} {tuple(tensor.shape)} where its metadata "
                        f"declared {slot.name} {slot.dtype} {slot.shape}"
                    )
                buffer[slot.offset : slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape).copy_(tensor)
            works[side] = broadcast(self.group, buffer)
        if (extra := next(tensors, None)) is not None:  # also runs the source to its end (closing its last gather)
            raise ValueError(f"weight source yielded {extra[0]} beyond the parameters its metadata declared")
        for work in works:
            if work is not None:
                work.wait()

    def shutdown(self) -> None:
        self.group = None


WeightTransferEngineFactory.register_engine(BACKEND, GlooWeightTransferEngine)
WeightTransferTrainerFactory.register_engine(BACKEND, GlooTrainerWeightTransferEngine)

"""vLLM weight-transfer engines over gloo: the broadcast transport's wire on machines without GPUs, and delta sync's
wire everywhere.

vLLM ships trainer/worker engine pairs (`vllm.distributed.weight_transfer`) and an NCCL pair for GPUs; this module
registers a "gloo" pair under the same factories, so CPU runs (and CI) take the protocol a GPU cluster takes:
the trainer's rank 0 and every vLLM worker join one process group (the trainer is rank 0, worker w of generator g
is rank 1 + g * tensor_parallel_size + w), the trainer declares the parameters (names, wire dtypes, shapes), and
both sides cut them into the same buckets: whole decoder layers, about `bucket_bytes` each (a larger layer is a
bucket of its own). Each bucket travels as one flat byte tensor.

A sync is pipelined bucket by bucket: while bucket k is on the wire the sender gathers and packs bucket k+1 (two
buffers, reused from sync to sync) and each worker loads bucket k-1 into its engine. A worker receives each bucket
into a buffer of its own, kept from sync to sync: vLLM's layerwise reload processes a layer once all its weights
are in, and holds the tensors of one it cannot count as complete until the update finishes, so a received bucket
is never written over within a sync.
The bucket plan and the buffers are made once per connection; the control plane is one call per generator and sync
(`apply_weight_update`: pause, start, receive, finish, resume).

Delta sync (`delta`): the sender keeps the engines' copy of the weights (in the wire dtype, laid out in buckets)
and each worker has its own, the buffers a full sync arrived in. A delta sync sends, per bucket, a header of
changed-element counts and a payload of patches (`grpo_dist.transports.delta`); a worker patches its copy and
reloads the layers that changed. Every sync in delta mode ends with each worker's checksum of its copy and of the
version it is based on: any that differs from the sender's has the sync done again in full. Every `full_every`-th
sync is full anyway.

Importing the module registers the engines: the generator's worker extension (`grpo_dist.actors.weight_sync`)
imports it inside every vLLM worker, the learner imports it before it opens the sender.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import math
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
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
    layerwise_groups,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

from grpo_dist.transports import delta
from grpo_dist.transports.delta import WHOLE, aligned

BACKEND = "gloo"


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
    """Trainer side: the rendezvous (rank 0 hosts it), group size, bucket size, the bound on every wait, and delta
    sync (`delta`, a full sync every `full_every` syncs)."""

    backend: ClassVar[str] = BACKEND

    master_address: str
    master_port: int
    world_size: int
    bucket_bytes: int
    timeout_s: float
    delta: bool = False
    full_every: int = 1


@dataclass
class GlooWeightTransferUpdateInfo(WeightTransferUpdateInfo):
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
    layer: int  # index of its decoder layer (its group in `layerwise_groups`)

    @property
    def numel(self) -> int:
        return self.nbytes // self.dtype.itemsize

    def region(self, buffer: torch.Tensor) -> torch.Tensor:
        return buffer[self.offset : self.offset + self.nbytes]


@dataclass(frozen=True)
class Bucket:
    slots: list[Slot]
    nbytes: int  # a multiple of ALIGN: the bytes after the last slot are zero


@dataclass
class SyncReport:
    """What one sync sent (rank 0's; the other ranks only gathered)."""

    mode: str  # "full" or "delta"
    elements: int  # elements of every parameter
    changed: int  # elements sent as changed (every element in a full sync)
    sent_bytes: int
    resync: str | None = None  # why the sync must be done again in full (a worker's copy differed), if it must

    def metrics(self) -> dict[str, float]:
        return {
            "sync/delta": float(self.mode == "delta" and self.resync is None),
            "sync/changed_fraction": self.changed / max(self.elements, 1),
            "sync/sent_mb": self.sent_bytes / 2**20,
        }


def plan_buckets(params: list[ParamMeta], bucket_bytes: int) -> list[Bucket]:
    """Consecutive decoder layers grouped into buckets of at most `bucket_bytes` (a larger layer makes a bucket of
    its own). Both sides compute it from the same metadata."""
    by_name = {param.name: param for param in params}
    buckets: list[Bucket] = []
    slots: list[Slot] = []
    size = 0
    for layer, names in enumerate(layerwise_groups([param.name for param in params])):
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


@contextlib.contextmanager
def reload_warnings_quiet():
    """vLLM warns on each reload that the rotary embedding "failed to load": its cos/sin cache is derived from the
    config, not from weights, and is kept. After a delta sync it says so of every layer that did not change, which
    also keeps its weights. Every real parameter is loaded (tests compare logprobs), so these warnings are hidden."""
    layerwise = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    level = layerwise.level
    layerwise.setLevel(logging.ERROR)
    try:
        yield
    finally:
        layerwise.setLevel(level)


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


def _layout(update_info: GlooWeightTransferUpdateInfo) -> tuple:
    return (tuple(update_info.names), tuple(update_info.dtype_names), tuple(map(tuple, update_info.shapes)))


class GlooWeightTransferEngine(WeightTransferEngine[GlooWeightTransferInitInfo, GlooWeightTransferUpdateInfo]):
    """Worker side, created by vLLM inside each engine worker when the engine is built with backend "gloo"."""

    init_info_cls = GlooWeightTransferInitInfo
    update_info_cls = GlooWeightTransferUpdateInfo

    group: ProcessGroupGloo | None = None

    def init_transfer_engine(self, init_info: GlooWeightTransferInitInfo) -> None:
        rank = init_info.rank_offset + self.parallel_config.rank
        self.bucket_bytes = init_info.bucket_bytes
        self.layout: tuple | None = None  # the parameters the plan below was made for
        self.plan: list[Bucket] = []
        self.buffers = Buffers()  # delta sync: the payloads
        self.copy: list[torch.Tensor] | None = None  # the weights this engine holds, bucket by bucket, as received
        self.copy_version: int | None = None  # delta sync: the version `copy` holds
        self.report: dict = {}
        self.group = open_group(
            init_info.master_address, init_info.master_port, rank, init_info.world_size, init_info.timeout_s
        )

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def receive_weights(self, update_info: GlooWeightTransferUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("gloo weight transfer: update_weights before init_weight_transfer_engine")
        if _layout(update_info) != self.layout:
            params = [
                ParamMeta(name, getattr(torch, dtype), tuple(shape))
                for name, dtype, shape in zip(
                    update_info.names, update_info.dtype_names, update_info.shapes, strict=True
                )
            ]
            self.layout, self.plan, self.copy = _layout(update_info), plan_buckets(params, self.bucket_bytes), None
        valid = update_info.mode == "full" or (self.copy is not None and self.copy_version == update_info.base_version)
        try:
            if update_info.mode == "full":
                self._receive_full()
            else:
                self._receive_delta(apply=valid)
        except BaseException:
            self.copy, self.copy_version = None, None  # partly received: the next delta finds no copy to patch
            raise
        if update_info.keep and valid:
            self.copy_version = update_info.version
            self.report = {"checksum": delta.checksum(self.copy)}
        else:
            self.copy_version = None
            self.report = {"checksum": None}

    def _receive_full(self) -> None:
        """Receive bucket k+1 while bucket k loads into the model, each into a buffer of its own kept from sync to
        sync (with delta sync, the copy): vLLM may hold a layer's tensors until the update finishes."""
        if self.copy is None:
            self.copy = [torch.zeros(bucket.nbytes, dtype=torch.uint8) for bucket in self.plan]
        pending = None
        for index, bucket in enumerate(self.plan):
            buffer = self.copy[index]
            work = broadcast(self.group, buffer)
            if pending is not None:
                self._load(*pending)
            work.wait()
            pending = (buffer, bucket.slots)
        if pending is not None:
            self._load(*pending)

    def _receive_delta(self, apply: bool) -> None:
        """Per bucket: the header of counts (on its way while the bucket before is patched into the copy and its
        changed layers reloaded), then the payload of patches. Without a copy at the right version the bytes are
        received and dropped: the sender then syncs in full."""
        pending = None
        for index, bucket in enumerate(self.plan):
            counts = torch.empty(len(bucket.slots), dtype=torch.int64)
            header = broadcast(self.group, counts)
            if pending is not None and apply:
                self._patch(*pending)
            header.wait()
            nbytes = sum(
                delta.patch_nbytes(int(count), slot.numel, slot.dtype)
                for count, slot in zip(counts, bucket.slots, strict=True)
            )
            payload = self.buffers.take(index, nbytes)
            if nbytes:
                broadcast(self.group, payload).wait()
            pending = (index, counts.tolist(), payload)
        if pending is not None and apply:
            self._patch(*pending)

    def _patch(self, index: int, counts: list[int], payload: torch.Tensor) -> None:
        """Apply a bucket's patches to the copy and reload every layer that changed (a layer loads whole)."""
        bucket, copy = self.plan[index], self.copy[index]
        offset, changed_layers = 0, set()
        for count, slot in zip(counts, bucket.slots, strict=True):
            part = payload[offset:]
            if count == WHOLE:
                slot.region(copy).copy_(part[: slot.nbytes])
            elif count:
                indices, values = delta.read_patch(part, count, slot.numel, slot.dtype)
                delta.bits(slot.region(copy), slot.dtype)[indices.long()] = values
            if count:
                changed_layers.add(slot.layer)
            offset += delta.patch_nbytes(count, slot.numel, slot.dtype)
        if changed_layers:
            self._load(copy, [slot for slot in bucket.slots if slot.layer in changed_layers])

    def _load(self, buffer: torch.Tensor, slots: list[Slot]) -> None:
        self.model.load_weights([(name, tensor.to(self.device)) for name, tensor in unpack(buffer, slots)])

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        with reload_warnings_quiet():
            finalize_layerwise_reload(self.model, self.model_config)

    def shutdown(self) -> None:
        self.group = None


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    """Trainer side. Every learner rank iterates the source (under ZeRO-3 each layer's gather is a collective);
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
        engine.state = SenderState(init_info.bucket_bytes, init_info.delta, init_info.full_every)
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

    def send_weights(self, version: int = 0, full: bool = False) -> SyncReport | None:
        """One sync to `version`, in full or (delta sync on, the workers' copies known) as a delta. Returns rank
        0's report; the other ranks take part in the gathers and return None."""
        assert self.source is not None
        if not self.is_sender:
            for _ in self.source:  # take part in each layer's gather
                pass
            return None
        state = self.state
        update = state.update_info(self.source.metadata(), version, full)
        pool = ThreadPoolExecutor(max_workers=1)
        try:
            received = pool.submit(self.client.apply_weight_update, asdict(update))
            tensors = iter(self.source)
            if update.mode == "delta":
                report = state.send_delta(self.group, tensors)
            else:
                report = state.send_full(self.group, tensors, update.keep)
            if (extra := next(tensors, None)) is not None:  # also runs the source to its end (its last gather)
                raise ValueError(f"weight source yielded {extra[0]} beyond the parameters its metadata declared")
            workers = received.result()
        except BaseException:
            state.forget()
            raise
        finally:
            pool.shutdown(wait=False)  # after a failed send the workers never return; do not wait for them
        return state.settle(report, update, workers)


@dataclass
class SenderState:
    """Rank 0's side of a connection: the bucket plan, the buffers and, with delta sync, the engines' copy."""

    bucket_bytes: int
    delta: bool
    full_every: int
    layout: tuple | None = None
    plan: list[Bucket] = field(default_factory=list)
    buffers: Buffers = field(default_factory=Buffers)  # the two in flight
    staging: Buffers = field(default_factory=Buffers)  # delta: the bucket being compared
    copy: list[torch.Tensor] | None = None  # delta: what every engine holds, bucket by bucket, in the wire dtype
    copy_version: int | None = None  # the version `copy` holds, once every worker confirmed it
    deltas_since_full: int = 0
    checksum: int | None = None

    def update_info(self, meta: list[ParamMeta], version: int, full: bool) -> GlooWeightTransferUpdateInfo:
        update = GlooWeightTransferUpdateInfo(
            names=[m.name for m in meta],
            dtype_names=[str(m.dtype).removeprefix("torch.") for m in meta],
            shapes=[list(m.shape) for m in meta],
            keep=self.delta,
            version=version,
        )
        if _layout(update) != self.layout:
            self.layout, self.plan = _layout(update), plan_buckets(meta, self.bucket_bytes)
            self.copy, self.copy_version = None, None
        due = self.deltas_since_full + 1 >= self.full_every
        if self.delta and not full and not due and self.copy_version is not None:
            update.mode, update.base_version = "delta", self.copy_version
        return update

    def send_full(self, group: ProcessGroupGloo, tensors: Iterator, keep: bool) -> SyncReport:
        """Pack bucket k+1 while bucket k is on the wire; with `keep` into the buckets of the engines' copy."""
        if keep and self.copy is None:
            self.copy = [torch.zeros(bucket.nbytes, dtype=torch.uint8) for bucket in self.plan]
        works: list = [None, None]
        for index, bucket in enumerate(self.plan):
            if works[index % 2] is not None:
                works[index % 2].wait()  # the bucket sent from this buffer two steps ago has left
            buffer = self.copy[index] if keep else self.buffers.take(index, bucket.nbytes)
            pack(buffer, bucket.slots, tensors)
            works[index % 2] = broadcast(group, buffer)
        for work in works:
            if work is not None:
                work.wait()
        self.checksum = delta.checksum(self.copy) if keep else None
        elements = sum(slot.numel for bucket in self.plan for slot in bucket.slots)
        return SyncReport("full", elements, elements, sum(bucket.nbytes for bucket in self.plan))

    def send_delta(self, group: ProcessGroupGloo, tensors: Iterator) -> SyncReport:
        """Per bucket: pack it, compare it with the engines' copy, send the header of counts and the payload of
        patches (while the next bucket is packed and compared), and bring the copy up to date."""
        works: list[list] = [[], []]
        elements = changed = sent = 0
        for index, bucket in enumerate(self.plan):
            for work, _ in works[index % 2]:
                work.wait()
            staging = self.staging.take(0, bucket.nbytes)
            pack(staging, bucket.slots, tensors)
            payload = self.buffers.take(index, bucket.nbytes)
            counts, nbytes = [], 0
            for slot in bucket.slots:
                count, written = _diff(slot, staging, self.copy[index], payload[nbytes:])
                counts.append(count)
                nbytes += written
                elements += slot.numel
                changed += slot.numel if count == WHOLE else count
            header = torch.tensor(counts, dtype=torch.int64)
            works[index % 2] = [(broadcast(group, header), header)]
            if nbytes:
                works[index % 2].append((broadcast(group, payload[:nbytes]), payload))
            sent += header.numel() * 8 + nbytes
        for work, _ in works[0] + works[1]:
            work.wait()
        self.checksum = delta.checksum(self.copy)
        return SyncReport("delta", elements, changed, sent)

    def settle(self, report: SyncReport, update: GlooWeightTransferUpdateInfo, workers: list[dict]) -> SyncReport:
        """After the workers answered: with delta sync, check every worker's copy against ours."""
        if not update.keep:
            return report
        differ = [index for index, worker in enumerate(workers) if worker.get("checksum") != self.checksum]
        if not differ:
            self.copy_version = update.version
            self.deltas_since_full = self.deltas_since_full + 1 if update.mode == "delta" else 0
            return report
        self.forget()
        which = f"{len(differ)} of {len(workers)} engine workers (first: worker {differ[0]})"
        if update.mode == "full":
            raise RuntimeError(f"gloo weight transfer: after a full sync the copies of {which} differ from rank 0's")
        report.resync = f"the copies of {which} did not match the sender's checksum"
        return report

    def forget(self) -> None:
        """After a sync that failed or did not match: the engines' copies are unknown until a full sync."""
        self.copy_version, self.deltas_since_full = None, 0


def _diff(slot: Slot, staging: torch.Tensor, copy: torch.Tensor, payload: torch.Tensor) -> tuple[int, int]:
    """Compare a slot's new bytes with the copy's, write its patch (or the whole slot) to `payload` and update the
    copy; returns (header count, payload bytes written)."""
    new, old = delta.bits(slot.region(staging), slot.dtype), delta.bits(slot.region(copy), slot.dtype)
    differs = delta.differs(new, old)  # [numel]
    count = int(differs.sum())
    if count == 0:
        return 0, 0
    if delta.worth_a_patch(count, slot.numel, slot.dtype):
        indices = delta.positions(differs)  # [count]
        values = new[indices]
        old[indices] = values
        return count, delta.write_patch(payload, indices, values, slot.numel)
    old.copy_(new)
    payload[: slot.nbytes].copy_(slot.region(staging))
    return WHOLE, aligned(slot.nbytes)


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


WeightTransferEngineFactory.register_engine(BACKEND, GlooWeightTransferEngine)
WeightTransferTrainerFactory.register_engine(BACKEND, GlooTrainerWeightTransferEngine)

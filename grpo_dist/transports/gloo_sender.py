"""The trainer side of the gloo weight transfer (`grpo_dist.transports.gloo` tells the protocol): learner rank 0
opens the group with the workers, then sends each sync pipelined bucket by bucket, in full or, with delta sync, as
patches against the engines' copy it keeps (`SenderState`)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Protocol, Self

import torch
from torch.distributed.distributed_c10d import ProcessGroupGloo

from grpo_dist.transports import delta
from grpo_dist.transports.base import SyncReport
from grpo_dist.transports.delta import WHOLE, aligned
from grpo_dist.transports.gloo_wire import (
    Bucket,
    Buffers,
    GlooTrainerInitInfo,
    GlooWeightTransferInitInfo,
    GlooWeightTransferUpdateInfo,
    ParamMeta,
    Slot,
    broadcast,
    layout,
    open_group,
    pack,
    plan_buckets,
)


class WeightSource(Protocol):
    """The learner's weights as a sync reads them: `metadata()` declares every parameter (the whole model, on every
    rank) without gathering; iterating yields `(name, tensor)` in that order (a layer's gather is a collective:
    every rank iterates). vLLM's trainer engines take the same two calls."""

    def metadata(self) -> list[ParamMeta]: ...

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]: ...


class SyncClient(Protocol):
    """The generators' side of a sync as the sender drives it (`grpo_dist.transports.broadcast.GeneratorClient`)."""

    def init_weight_transfer_engine(self, init_info: dict) -> None: ...

    def apply_weight_update(self, update_info: dict) -> list[dict]: ...


class GlooTrainerWeightTransferEngine:
    """Trainer side, vLLM's trainer-engine protocol (`trainer_init`, `send_weights`) without importing vLLM. Every
    learner rank iterates the source (under ZeRO-3 each layer's gather is a collective); rank 0 also drives the
    workers through the client and sends."""

    group: ProcessGroupGloo | None = None

    def __init__(self, client: SyncClient, source: WeightSource, is_sender: bool) -> None:
        self.client, self.source, self.is_sender = client, source, is_sender

    @classmethod
    def trainer_init(cls, init_info: GlooTrainerInitInfo, *, client: SyncClient, source: WeightSource | None) -> Self:
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
        if layout(update) != self.layout:
            self.layout, self.plan = layout(update), plan_buckets(meta, self.bucket_bytes)
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

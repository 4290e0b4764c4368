"""The worker side of the gloo weight transfer (`grpo_dist.transports.gloo` tells the protocol): created by vLLM in
each engine worker, it joins the group, receives each sync's buckets (whole, or as patches against its copy) and
loads them layer by layer."""

from __future__ import annotations

import contextlib
import logging

import torch
from torch.distributed.distributed_c10d import ProcessGroupGloo
from vllm.distributed.weight_transfer.base import WeightTransferEngine

from grpo_dist.transports import delta
from grpo_dist.transports.delta import WHOLE
from grpo_dist.transports.gloo_wire import (
    Bucket,
    Buffers,
    GlooWeightTransferInitInfo,
    GlooWeightTransferUpdateInfo,
    ParamMeta,
    Slot,
    broadcast,
    layout,
    open_group,
    plan_buckets,
    unpack,
)


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
        if layout(update_info) != self.layout:
            params = [
                ParamMeta(name, getattr(torch, dtype), tuple(shape))
                for name, dtype, shape in zip(
                    update_info.names, update_info.dtype_names, update_info.shapes, strict=True
                )
            ]
            self.layout, self.plan, self.copy = layout(update_info), plan_buckets(params, self.bucket_bytes), None
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

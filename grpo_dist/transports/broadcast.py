"""Broadcast transport: learner rank 0 streams the weights to every vLLM worker over one process group.

Built on vLLM's weight-transfer engines: the generators' engines are created with a weight-transfer backend
(`grpo_dist.transports.wire_backend`), and each learner rank opens a trainer engine from vLLM's factory over a
`ModelSource`. On GPUs the backend is vLLM's NCCL engine (packed, two buffers of `sync.bucket_mb`); elsewhere, and
for delta sync everywhere, it is gloo (`grpo_dist.transports.gloo`), the same protocol, pipelined bucket by bucket.
Rank 0 drives the generators through `GeneratorClient` while it sends; under ZeRO-3 every rank takes part in
gathering each decoder layer in turn (over gloo: sends its partitions to rank 0), and only rank 0 sends it. Weights
travel in Hugging Face names, at the engines' dtype over gloo, and load through vLLM's layerwise reload, which fuses
qkv and gate/up itself.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import ray
import torch

from grpo_dist.config import Config
from grpo_dist.faults import Bound, Bounds
from grpo_dist.models import lora
from grpo_dist.transports.base import wait_all, wire_backend

log = logging.getLogger("grpo_dist")


@dataclass(frozen=True)
class SenderSpec:
    """What every learner rank needs to open its side of the transport."""

    backend: str  # vLLM weight-transfer backend: "gloo" or "nccl"
    master_address: str  # learner rank 0's node: it hosts the rendezvous
    master_port: int
    world_size: int  # 1 (learner rank 0) + every engine worker of every generator
    tensor_parallel_size: int  # engine workers per generator
    bucket_bytes: int
    bound: Bound  # every call of the sync, and the process group's rendezvous
    delta: bool = False  # delta sync (gloo only): send the elements that changed since the engines' copy
    full_every: int = 1  # with delta sync: every this many syncs one is full
    wire_dtype: str | None = None  # the engines' dtype, weights are cast to it before they travel (gloo only)


class BroadcastTransport:
    name = "broadcast"

    def __init__(self, cfg: Config, learner, generators: list[ray.actor.ActorHandle]) -> None:
        self.cfg, self.learner, self.generators = cfg, learner, generators

    def connect(self) -> None:
        """Every learner rank opens its trainer engine; rank 0 and the generators' workers rendezvous."""
        (_, address), *_ = self.learner.call("node")
        port, *_ = self.learner.call("free_port")
        tp = self.cfg.rollout.tensor_parallel_size
        spec = SenderSpec(
            backend=wire_backend(self.cfg),
            master_address=address,
            master_port=port,
            world_size=1 + len(self.generators) * tp,
            tensor_parallel_size=tp,
            bucket_bytes=int(self.cfg.sync.bucket_mb * 2**20),
            bound=Bounds.of(self.cfg).sync,
            delta=self.cfg.sync.delta,
            full_every=self.cfg.sync.full_every,
            wire_dtype=None if self.cfg.rollout.dtype == "auto" else self.cfg.rollout.dtype,
        )
        self.learner.call("connect_weights", spec, self.generators)

    def sync(self, weight_version: int, full: bool = False):
        """Load the learner's weights into every generator; returns rank 0's `SyncReport` (None over NCCL). With
        delta sync, a delta that a worker's copy did not match is done again in full at once (its report says
        `resync`)."""
        report, *_ = self.learner.call("send_weights", weight_version, full)
        if report is not None and report.resync is not None:
            log.warning("weight sync %d: %s; syncing in full", weight_version, report.resync)
            reason = report.resync
            report, *_ = self.learner.call("send_weights", weight_version, True)
            report.resync = reason
        return report

    def close(self) -> None:
        pass  # the process group goes with the actors


class GeneratorClient:
    """vLLM's weight-sync control plane (`VLLMWeightSyncClient`) over our generator actors, every call bounded.
    Each generator's workers get their own ranks in the group: generator g starts at 1 + g * tensor_parallel_size."""

    def __init__(self, generators: list[ray.actor.ActorHandle], tensor_parallel_size: int, bound: Bound) -> None:
        self.generators, self.tp, self.bound = generators, tensor_parallel_size, bound
        self.weight_version = 0  # set before each sync; the generators tag their completions with it

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self._all(
            "init_weight_transfer_engine",
            [{**init_info, "rank_offset": 1 + index * self.tp} for index in range(len(self.generators))],
        )

    def start_weight_update(self) -> None:
        self._all("start_weight_update")

    def apply_weight_update(self, update_info: dict) -> list[dict]:
        """A whole update in one call per generator (the gloo engine's): pause, receive, load, resume. Returns
        each engine worker's report, generator by generator."""
        version = self.weight_version
        calls = [generator.apply_weight_update.remote(update_info, version) for generator in self.generators]
        return [report for reports in self._wait(calls, "apply_weight_update") for report in reports]

    def update_weights(self, update_info: dict) -> None:
        self._all("update_weights", [update_info] * len(self.generators))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._all("finish_weight_update", [self.weight_version] * len(self.generators))

    def _all(self, method: str, args: list | None = None) -> None:
        calls = [
            getattr(generator, method).remote(*([] if args is None else [args[index]]))
            for index, generator in enumerate(self.generators)
        ]
        self._wait(calls, method)

    def _wait(self, calls: list, method: str) -> list:
        """In learner rank 0's process: a hung generator leaves this rank hung too, and the driver's wait on the
        rank (`LearnerGroup`) writes the stacks."""
        return wait_all(calls, self.generators, method, self.bound, "broadcast")


class WeightSender:
    """One learner rank's side of the transport: the trainer engine, its source and the client."""

    def __init__(self, spec: SenderSpec, rank: int, module, zero3: bool, generators: list) -> None:
        self.spec, self.rank = spec, rank
        self.client = GeneratorClient(generators, spec.tensor_parallel_size, spec.bound)
        wire_dtype = getattr(torch, spec.wire_dtype) if spec.wire_dtype and spec.backend == "gloo" else None
        source = model_source(module, zero3, wire_dtype, to_rank0=spec.backend == "gloo")
        if spec.backend == "gloo":  # the learner's side of gloo is written without vLLM: the learner never imports it
            from grpo_dist.transports.gloo_sender import GlooTrainerWeightTransferEngine

            self.engine = GlooTrainerWeightTransferEngine.trainer_init(
                _init_info(spec, rank), client=self.client, source=source
            )
            return
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        self.engine = WeightTransferTrainerFactory.trainer_init(
            _init_info(spec, rank), client=self.client, source=vllm_source(source)
        )

    def send(self, weight_version: int, full: bool = False):
        """One sync (collective over the learner ranks); returns rank 0's `SyncReport` (None over NCCL and on the
        other ranks)."""
        self.client.weight_version = weight_version
        if self.spec.backend != "gloo":
            self.engine.send_weights()
            return None
        return self.engine.send_weights(weight_version, full)


def _init_info(spec: SenderSpec, rank: int):
    if spec.backend == "nccl":
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        return NCCLTrainerInitInfo(
            master_address=spec.master_address,
            master_port=spec.master_port,
            world_size=spec.world_size,
            packed=True,
            packed_buffer_size_bytes=spec.bucket_bytes,
            packed_num_buffers=2,
            rank=rank,
        )
    from grpo_dist.transports.gloo_wire import GlooTrainerInitInfo

    return GlooTrainerInitInfo(
        master_address=spec.master_address,
        master_port=spec.master_port,
        world_size=spec.world_size,
        bucket_bytes=spec.bucket_bytes,
        timeout_s=spec.bound.seconds,
        rank=rank,
        delta=spec.delta,
        full_every=spec.full_every,
    )


def vllm_source(source):
    """`source` (`model_source`'s) as vLLM's `WeightSource`, for vLLM's own trainer engines (NCCL)."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class Source(WeightSource):
        def metadata(self) -> list[ParamMeta]:
            return [ParamMeta(meta.name, meta.dtype, meta.shape) for meta in source.metadata()]

        def __iter__(self):
            return iter(source)

    return Source()


def model_source(module, zero3: bool, wire_dtype=None, to_rank0: bool = False):
    """A `WeightSource` (`grpo_dist.transports.gloo_sender`'s) over a Hugging Face module trained by DeepSpeed: full
    shapes from metadata without gathering; under ZeRO-3 iteration gathers one decoder layer at a time (a collective on
    every rank) and frees it once the next is asked for. With `to_rank0` (the gloo sender's way) and several ranks, a
    layer's partitions go to rank 0 alone, with the next layer's under way, and rank 0 gets each weight as its
    partitions (`Partitions`) to copy straight into a bucket; the other ranks get None. With `wire_dtype` the metadata
    declares floating-point weights at that dtype (the sender casts them as it packs). Tied weights are sent under each
    of their names (as in the module's state dict): vLLM's layerwise reload waits for `lm_head.weight` even when it is
    the embedding. A LoRA policy (`grpo_dist.models.lora`) is sent merged, under the base model's names, each layer
    gathered on every rank."""
    import deepspeed

    from grpo_dist.transports.gloo_wire import ParamMeta, layer_groups

    adapted = lora.adapted_layers(module) if lora.is_adapted(module) else {}
    named = dict(module.named_parameters(remove_duplicate=False))
    if adapted:  # the base model's names; the adapter's own weights are merged into those they adapt
        named = {base: param for name, param in named.items() if (base := lora.merged_name(name))}
    to_rank0 = to_rank0 and not adapted  # a merge needs the whole weight and adapter on one rank

    def _travels_as(dtype):
        return wire_dtype if wire_dtype is not None and dtype.is_floating_point else dtype

    groups = layer_groups(list(named))  # decoder layers in order; metadata and iteration both follow it
    params = {name: named[name] for group in groups for name in group}

    class ModelSource:
        def metadata(self) -> list[ParamMeta]:
            return [
                ParamMeta(name, _travels_as(param.dtype), tuple(param.ds_shape if zero3 else param.shape))
                for name, param in params.items()
            ]

        def __iter__(self):
            if zero3 and to_rank0 and torch.distributed.get_world_size() > 1:
                yield from gathered_to_rank0(groups, params)
                return
            for names in groups:
                adapters = [param for name in names if name in adapted for param in adapted[name].parameters()]
                layer = list({id(param): param for param in [params[name] for name in names] + adapters}.values())
                with deepspeed.zero.GatheredParameters(layer, enabled=zero3):
                    for name in names:
                        yield name, lora.merged_weight(adapted[name]) if name in adapted else params[name].data

    return ModelSource()


@dataclass(frozen=True)
class Partitions:
    """A ZeRO-3 weight as its ranks' partitions: flattened, they follow one another (the last padded)."""

    parts: list[torch.Tensor]  # [partition size] each, in rank order
    shape: tuple[int, ...]

    def copy_to(self, flat: torch.Tensor) -> None:
        """Write the weight into `flat` ([numel], any dtype: cast on the copy)."""
        start = 0
        for part in self.parts:
            count = min(part.numel(), flat.numel() - start)
            if count <= 0:
                break
            flat[start : start + count].copy_(part[:count])
            start += count


def gathered_to_rank0(groups: list[list[str]], params: dict):
    """Each layer's weights on rank 0 as `Partitions` (None on the other ranks): every other rank sends its
    partitions of the layer's weights, packed in one tensor, straight to rank 0 (point to point: rank 0 alone needs
    them, where DeepSpeed's gather sends every layer to every rank); the next layer's transfer runs meanwhile. Two
    sets of buffers, reused."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    buffers: list[list[torch.Tensor]] = [[], []]  # per side: this rank's partitions, then (rank 0) each other rank's

    def take(side: int, index: int, like: torch.Tensor, numel: int) -> torch.Tensor:
        held = buffers[side]
        if len(held) <= index:
            held.append(torch.empty(0, dtype=like.dtype, device=device))
        if held[index].numel() < numel or held[index].dtype != like.dtype:
            held[index] = torch.empty(numel, dtype=like.dtype, device=device)
        return held[index][:numel]

    def start(side: int, names: list[str]):
        layer = list({id(params[name]): params[name] for name in names}.values())
        numel = sum(param.ds_tensor.numel() for param in layer)
        local = take(side, 0, layer[0].ds_tensor, numel)
        torch.cat([param.ds_tensor.reshape(-1).to(device) for param in layer], out=local)
        if rank != 0:
            return layer, None, [dist.isend(local, dst=0)]
        received = [local] + [take(side, source, local, numel) for source in range(1, world)]
        return layer, received, [dist.irecv(received[source], src=source) for source in range(1, world)]

    pending = start(0, groups[0]) if groups else None
    for index, names in enumerate(groups):
        layer, received, works = pending
        for work in works:
            work.wait()
        pending = start((index + 1) % 2, groups[index + 1]) if index + 1 < len(groups) else None
        weights, offset = {}, 0
        for param in layer:
            size = param.ds_tensor.numel()
            if received is not None:
                weights[id(param)] = Partitions([part[offset : offset + size] for part in received], param.ds_shape)
            offset += size
        for name in names:
            yield name, weights.get(id(params[name]))

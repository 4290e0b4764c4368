"""Broadcast transport: learner rank 0 streams the weights to every vLLM worker over one process group.

Built on vLLM's weight-transfer engines: the generators' engines are created with a weight-transfer backend
(`grpo_dist.transports.wire_backend`), and each learner rank opens a trainer engine from vLLM's factory over a
`ModelSource`. On GPUs the backend is vLLM's NCCL engine (packed, two buffers of `sync.bucket_mb`); elsewhere it
is gloo (`grpo_dist.transports.gloo`), the same protocol. Rank 0 drives the generators through `GeneratorClient`
(start, stream, finish) while it sends; under ZeRO-3 every rank gathers each parameter in turn, and only rank 0
sends it. Weights travel in Hugging Face names and load through vLLM's layerwise reload, which fuses qkv and
gate/up itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import ray

from grpo_dist.config import Config
from grpo_dist.faults import Bound, Bounds
from grpo_dist.transports import wait_all, wire_backend


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
        )
        self.learner.call("connect_weights", spec, self.generators)

    def sync(self, weight_version: int) -> None:
        self.learner.call("send_weights", weight_version)

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

    def update_weights(self, update_info: dict) -> None:
        self._all("update_weights", [update_info] * len(self.generators))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._all("finish_weight_update", [self.weight_version] * len(self.generators))

    def _all(self, method: str, args: list | None = None) -> None:
        calls = [
            getattr(generator, method).remote(*([] if args is None else [args[index]]))
            for index, generator in enumerate(self.generators)
        ]
        names = [f"generator {index}" for index in range(len(self.generators))]
        wait_all(calls, names, method, self.bound, "broadcast")


class WeightSender:
    """One learner rank's side of the transport: the trainer engine, its source and the client."""

    def __init__(self, spec: SenderSpec, rank: int, module, zero3: bool, generators: list) -> None:
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        self.client = GeneratorClient(generators, spec.tensor_parallel_size, spec.bound)
        self.engine = WeightTransferTrainerFactory.trainer_init(
            _init_info(spec, rank), client=self.client, source=model_source(module, zero3)
        )

    def send(self, weight_version: int) -> None:
        self.client.weight_version = weight_version
        self.engine.send_weights()


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
    from grpo_dist.transports.gloo import GlooTrainerInitInfo

    return GlooTrainerInitInfo(
        master_address=spec.master_address,
        master_port=spec.master_port,
        world_size=spec.world_size,
        bucket_bytes=spec.bucket_bytes,
        timeout_s=spec.bound.seconds,
        rank=rank,
    )


def model_source(module, zero3: bool):
    """A vLLM `WeightSource` over a Hugging Face module trained by DeepSpeed: full shapes from metadata without
    gathering; under ZeRO-3 iteration gathers one decoder layer at a time (a collective on every rank) and frees it
    once the next is asked for. Tied weights are sent under each of their names (as in the module's state dict):
    vLLM's layerwise reload waits for `lm_head.weight` even when it is the embedding."""
    import deepspeed
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource, layerwise_groups

    named = dict(module.named_parameters(remove_duplicate=False))
    groups = layerwise_groups(list(named))  # decoder layers in order; metadata and iteration both follow it
    params = {name: named[name] for group in groups for name in group}

    class ModelSource(WeightSource):
        def metadata(self) -> list[ParamMeta]:
            return [
                ParamMeta(name, param.dtype, tuple(param.ds_shape if zero3 else param.shape))
                for name, param in params.items()
            ]

        def __iter__(self):
            for names in groups:
                layer = list({id(params[name]): params[name] for name in names}.values())
                with deepspeed.zero.GatheredParameters(layer, enabled=zero3):
                    for name in names:
                        yield name, params[name].data

    return ModelSource()

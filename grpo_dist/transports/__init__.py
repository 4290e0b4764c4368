"""Weight transports: how a new policy gets from the learner group to the generators, behind one interface.

`connect()` once after the actors start, `sync(weight_version)` after each training step, `close()` at the end.
`sync.transport` picks the module, here and nowhere else:

- `broadcast` (`grpo_dist.transports.broadcast`): learner rank 0 and every vLLM worker form one process group
  through vLLM's weight-transfer engines; weights stream in buckets in Hugging Face names (NCCL on GPUs, gloo on
  CPUs: the same protocol either way).
- `object_store` (`grpo_dist.transports.object_store`): rank 0 puts the full state dict in Ray's object store and
  every generator loads it; the fallback where vLLM has no weight transfer.

With `learner.lora.serve: adapter` the adapter alone goes through Ray's object store, whatever `sync.transport` says
(`grpo_dist.transports.adapter`): a few megabytes, which every engine serves as a LoRA adapter.

Also the check of what the engines serve after a sync (`weight_check`) and the extension vLLM's workers load to
receive weights (`weight_sync`). May import: `models`, `sandbox`, `storage`, `faults`, `config`, `types`.
"""

from __future__ import annotations

import ray

from grpo_dist.config import Config
from grpo_dist.transports.adapter import AdapterTransport
from grpo_dist.transports.base import (
    WeightSyncError,
    WeightTransport,
    adapter_slots,
    serves_adapters,
    transport_name,
    wait_all,
    wire_backend,
)
from grpo_dist.transports.broadcast import BroadcastTransport
from grpo_dist.transports.object_store import ObjectStoreTransport

__all__ = [
    "WeightSyncError",
    "WeightTransport",
    "adapter_slots",
    "make_transport",
    "serves_adapters",
    "transport_name",
    "wait_all",
    "wire_backend",
]


def make_transport(cfg: Config, learner, generators: list[ray.actor.ActorHandle]) -> WeightTransport:
    """The transport `sync.transport` names (the adapter's own where the engines serve adapters), between a
    `LearnerGroup` and the generator actors."""
    if serves_adapters(cfg):
        return AdapterTransport(cfg, learner, generators)
    if transport_name(cfg) == "broadcast":
        return BroadcastTransport(cfg, learner, generators)
    return ObjectStoreTransport(cfg, learner, generators)

"""Adapter transport (`learner.lora.serve: adapter`): learner rank 0 returns the LoRA adapter's weights alone (every
rank gathers them under ZeRO-3), Ray keeps one copy per node, and each generator loads it as a new LoRA adapter of
its engine (`Generator.load_adapter`), keeping the newest versions for the requests still under way.

A sync moves `rank x (in + out)` parameters per adapted layer instead of the whole model: megabytes, so the object
store carries it whatever `sync.transport` says, and there is nothing to patch or pipeline.
"""

from __future__ import annotations

import ray

from grpo_dist.config import Config
from grpo_dist.faults import Bounds
from grpo_dist.transports.base import SyncReport, wait_all


class AdapterTransport:
    name = "adapter"

    def __init__(self, cfg: Config, learner, generators: list[ray.actor.ActorHandle]) -> None:
        self.learner, self.generators = learner, generators
        bounds = Bounds.of(cfg)
        self.bound, self.stacks_dir = bounds.sync, bounds.stacks_dir

    def connect(self) -> None:
        pass

    def sync(self, weight_version: int, full: bool = False) -> SyncReport:
        adapter = self.learner.adapter()  # a reference: (weights by PEFT name, adapter_config.json's fields)
        calls = [generator.load_adapter.remote(adapter, weight_version) for generator in self.generators]
        sizes = wait_all(calls, self.generators, "load_adapter", self.bound, self.name, self.stacks_dir)
        elements, sent = sizes[0] if sizes else (0, 0)
        return SyncReport("full", elements, elements, sent * len(sizes))

    def close(self) -> None:
        pass

"""Object-store transport: learner rank 0 returns the full state dict (every rank gathers it under ZeRO-3), Ray keeps
one copy per node, and each generator loads it through vLLM's in-place reload (`grpo_dist.transports.weight_sync`).

Simple and always available, but the whole model crosses host memory on every sync and rank 0 holds all of it.
"""

from __future__ import annotations

import ray

from grpo_dist.config import Config
from grpo_dist.faults import Bounds
from grpo_dist.transports.base import wait_all


class ObjectStoreTransport:
    name = "object_store"

    def __init__(self, cfg: Config, learner, generators: list[ray.actor.ActorHandle]) -> None:
        self.learner, self.generators = learner, generators
        bounds = Bounds.of(cfg)
        self.bound, self.stacks_dir = bounds.sync, bounds.stacks_dir

    def connect(self) -> None:
        pass

    def sync(self, weight_version: int, full: bool = False) -> None:
        weights = self.learner.state_dict()
        calls = [generator.load_weights.remote(weights, weight_version) for generator in self.generators]
        wait_all(calls, self.generators, "load_weights", self.bound, self.name, self.stacks_dir)

    def close(self) -> None:
        pass

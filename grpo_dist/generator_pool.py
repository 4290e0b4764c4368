"""The generator pool: the run's vLLM engines, a step's prompts split across them, and a lost engine replaced.

A generator that dies or does not finish its share within `faults.generate_timeout_s` (a deadlocked engine) is
killed and a new one started in its placement group; `rejoin`, given by the cluster, brings the new engine into
the weight transport and loads the current weights, and the share is generated again. Sampling is seeded per
prompt, so the regenerated completions are the ones the lost engine would have returned.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import ray

from grpo_dist.actors.generator import Generator
from grpo_dist.config import Config
from grpo_dist.data import PromptRecord
from grpo_dist.faults import ActorPool, FaultLog, split
from grpo_dist.placement import Placement, generator_resources
from grpo_dist.transports import wire_backend
from grpo_dist.types import Completion

PROBE_TIMEOUT_S = 30.0  # an idle engine answers a probe at once


class GeneratorPool:
    def __init__(self, cfg: Config, model_path: str, placement: Placement, faults: FaultLog) -> None:
        self.cfg, self.model_path, self.placement, self.faults = cfg, model_path, placement, faults
        self.rejoin: Callable[[], None] = lambda: None  # set by the cluster once the weight transport exists
        self.completions: Counter[int] = Counter()  # per slot, since `step_metrics` last read them
        self.pool = ActorPool(
            "generator", "generator_restarts", self._start, cfg.rollout.num_generators, faults,
            cfg.faults.max_generator_restarts, cfg.faults.start_timeout_s,
        )  # fmt: skip

    def _start(self, slot: int) -> ray.actor.ActorHandle:
        cfg = self.cfg
        return (
            ray.remote(Generator)
            .options(**generator_resources(cfg), scheduling_strategy=self.placement.generator_strategy(slot))
            .remote(self.model_path, cfg.rollout, cfg.run.seed + slot, wire_backend(cfg))
        )

    @property
    def actors(self) -> list[ray.actor.ActorHandle]:
        """The current generator actors (a list the weight transport shares: replacements appear in it)."""
        return self.pool.actors

    def generate(
        self, prompts: list[PromptRecord], group_size: int, greedy: bool = False, seeds: list[int] | None = None
    ) -> list[Completion]:
        """Split the prompts across generators; completions come back grouped, in prompt order. `seeds`: one
        sampling seed per prompt. A lost generator's share is generated again by its replacement."""
        shards, done = split(len(prompts), len(self.actors)), {}
        while shards:
            args = {
                slot: ([p.token_ids for p in prompts[start:end]], group_size, greedy, start, seeds and seeds[start:end])
                for slot, (start, end) in shards.items()
            }
            outcomes = self.pool.call("generate", args, self.cfg.faults.generate_timeout_s)
            finished = {slot: outcome.value for slot, outcome in outcomes.items() if outcome.fault is None}
            done.update(finished)
            if not greedy:  # training samples, not a held-out evaluation
                self.completions.update({slot: len(completions) for slot, completions in finished.items()})
            lost = {slot: outcome.fault for slot, outcome in outcomes.items() if outcome.fault is not None}
            for slot, fault in lost.items():
                start, end = shards[slot]
                self.pool.replace(slot, f"{fault} while generating {end - start} prompts", "generating them again")
                self.faults.count("regenerated", end - start)
            if lost:
                self.rejoin()
            shards = {slot: shards[slot] for slot in lost}
        return [completion for slot in sorted(done) for completion in done[slot]]

    def resize(self, count: int) -> None:
        """Add generators (each in a new placement group, started and up before it returns) or stop the last ones
        (between steps none is generating); the caller reconnects the weight transport."""
        while len(self.actors) < count:
            slot = len(self.actors)
            self.placement.add_generator(self.cfg, slot, self.cfg.ray.placement_timeout_s)
            try:
                self.pool.add()
            except BaseException:
                self.placement.remove_generator(slot)
                raise
        while len(self.actors) > count:
            self.pool.remove_last()
            self.placement.remove_generator(len(self.actors))

    def step_metrics(self) -> dict[str, float]:
        """`generators/count` and each generator's completions since the last call."""
        metrics = {f"generators/{slot}/completions": float(self.completions[slot]) for slot in range(len(self.actors))}
        self.completions.clear()
        return {"generators/count": float(len(self.actors)), **metrics}

    def replace_unresponsive(self) -> bool:
        """Probe every generator; replace those that are dead or do not answer. Returns whether any was."""
        outcomes = self.pool.call("current_weight_version", {slot: () for slot in range(len(self.actors))},
                                  PROBE_TIMEOUT_S)  # fmt: skip
        lost = {slot: outcome.fault for slot, outcome in outcomes.items() if outcome.fault is not None}
        for slot, fault in lost.items():
            self.pool.replace(slot, fault)
        return bool(lost)

    def shutdown(self) -> None:
        self.pool.shutdown()

"""The generator pool: the run's vLLM engines, a step's prompts streamed to them in chunks, a lost engine replaced.

`generate` cuts the prompts into chunks (`CHUNKS_PER_GENERATOR` per engine) and hands the next chunk to whichever
engine has none, so a slow engine takes fewer and no engine sets the pace; each finished chunk goes to `on_chunk` at
once (the reward pool scores it while the rest generate). A generator that dies or does not finish a chunk within
`faults.generate_timeout_s` (a deadlocked engine) is killed and a new one started in its placement group; `rejoin`,
given by the cluster, brings the new engine into the weight transport and loads the current weights, and the chunk
is generated again. Sampling is seeded per prompt, so the completions are the same whichever engine draws them.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass

import ray

from grpo_dist.actors.generator import Generator
from grpo_dist.config import Config
from grpo_dist.data import PromptRecord
from grpo_dist.faults import ActorPool, FaultLog, first_line, split
from grpo_dist.placement import Placement, generator_resources
from grpo_dist.transports import wire_backend
from grpo_dist.types import Completion

CHUNKS_PER_GENERATOR = 4  # enough that a fast engine takes more of a batch; few enough that each batches well


@dataclass
class Job:
    """A chunk of prompts being generated: by which slot's actor (the one it was sent to), since when."""

    slot: int
    chunk: tuple[int, int]  # [start, end) of the batch's prompts
    started: float
    actor: ray.actor.ActorHandle


PROBE_TIMEOUT_S = 30.0  # an idle engine answers a probe at once


class GeneratorPool:
    def __init__(self, cfg: Config, model_path: str, placement: Placement, faults: FaultLog) -> None:
        self.cfg, self.model_path, self.placement, self.faults = cfg, model_path, placement, faults
        self.rejoin: Callable[[], None] = lambda: None  # set by the cluster once the weight transport exists
        self.completions: Counter[int] = Counter()  # per slot, since `step_metrics` last read them
        self.tokens: Counter[int] = Counter()  # generated tokens per slot, likewise
        self.busy_s: Counter[int] = Counter()  # seconds from handing a slot a chunk to collecting it, likewise
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
        self,
        prompts: list[PromptRecord],
        group_size: int,
        greedy: bool = False,
        seeds: list[int] | None = None,
        on_chunk: Callable[[list[Completion]], None] | None = None,
    ) -> list[Completion]:
        """All prompts' completions, grouped, in prompt order. `seeds`: one sampling seed per prompt. `on_chunk`
        gets each chunk's completions as soon as it is generated. A lost generator's chunk is generated again by
        its replacement."""
        bound = self.cfg.faults.generate_timeout_s
        chunks = deque(split(len(prompts), min(len(prompts), CHUNKS_PER_GENERATOR * len(self.actors))).values())
        running: dict[ray.ObjectRef, Job] = {}
        done: dict[int, list[Completion]] = {}  # first prompt of a chunk -> its completions
        while chunks or running:
            busy = {job.slot for job in running.values()}
            for slot in (slot for slot in range(len(self.actors)) if slot not in busy and chunks):
                start, end = chunk = chunks.popleft()
                actor = self.actors[slot]
                call = actor.generate.remote(
                    [p.token_ids for p in prompts[start:end]], group_size, greedy, start, seeds and seeds[start:end]
                )
                running[call] = Job(slot, chunk, time.monotonic(), actor)
            deadline = min(job.started for job in running.values()) + bound
            ray.wait(list(running), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            finished, _ = ray.wait(list(running), num_returns=len(running), timeout=0)  # all done by now, not one
            lost: list[tuple[Job, str]] = []
            for call in finished:
                job = running.pop(call)
                try:
                    done[job.chunk[0]] = completions = ray.get(call)
                except ray.exceptions.RayActorError as err:
                    lost.append((job, f"died ({first_line(err)})"))
                    continue
                if not greedy:  # training samples, not a held-out evaluation
                    self.completions[job.slot] += len(completions)
                    self.tokens[job.slot] += sum(len(c.token_ids) for c in completions)
                    self.busy_s[job.slot] += time.monotonic() - job.started
                if on_chunk is not None:
                    on_chunk(completions)
            hung = [job for job in running.values() if time.monotonic() - job.started > bound]
            lost += [(job, f"gave no answer within {bound:g} s") for job in hung]
            running = {call: job for call, job in running.items() if all(job is not gone for gone, _ in lost)}
            if self._replace_lost(lost, chunks):
                self.rejoin()
        return [completion for start in sorted(done) for completion in done[start]]

    def _replace_lost(self, lost: list[tuple[Job, str]], chunks: deque) -> bool:
        """Put lost chunks back in the queue and replace their generators, unless one was replaced already (by a
        reconnect after an earlier loss); returns whether any was replaced now."""
        replaced = False
        for job, why in lost:
            start, end = job.chunk
            chunks.appendleft(job.chunk)
            self.faults.count("regenerated", end - start)
            if self.actors[job.slot] is job.actor:
                self.pool.replace(job.slot, f"{why} while generating {end - start} prompts", "generating them again")
                replaced = True
        return replaced

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
        """`generators/count`, and each generator's completions and tokens per second of its chunks since the last
        call."""
        metrics = {"generators/count": float(len(self.actors))}
        for slot in range(len(self.actors)):
            metrics[f"generators/{slot}/completions"] = float(self.completions[slot])
            metrics[f"generators/{slot}/tokens_per_s"] = (
                self.tokens[slot] / self.busy_s[slot] if self.busy_s[slot] else 0.0
            )
        self.completions, self.tokens, self.busy_s = Counter(), Counter(), Counter()
        return metrics

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

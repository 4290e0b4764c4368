"""The Ray side of a run: start or join a cluster, place the actors, and the few remote calls the driver makes.

Resources (CPUs, GPUs, environment) are given here with `.options(...)`; constructor arguments are the actors' own.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import ray
import torch

from grpo_dist.actors.generator import Generator
from grpo_dist.actors.reward_worker import RewardWorker
from grpo_dist.batch import TrainBatch
from grpo_dist.config import Config
from grpo_dist.data import PromptRecord
from grpo_dist.learner_group import LearnerGroup
from grpo_dist.placement import Placement, generator_resources, place
from grpo_dist.transports import WeightTransport, make_transport, wire_backend
from grpo_dist.types import Completion, Score, ScoreRequest


def actor_cpus(cfg: Config) -> float:
    """Logical CPUs the actors of a run ask for."""
    return (
        cfg.learner.num_ranks * cfg.learner.num_cpus
        + cfg.rollout.num_generators * cfg.rollout.num_cpus
        + cfg.reward.num_workers * cfg.reward.num_cpus
    )


def start_ray(cfg: Config) -> None:
    """Join `ray.address`, or start a local cluster of this run's own big enough for its actors (even where another
    Ray cluster runs on the machine: that one is joined only when named in `ray.address`)."""
    quiet = {"TOKENIZERS_PARALLELISM": "false"}
    if cfg.ray.address:
        if problem := unreachable(cfg.ray.address):
            raise ConnectionError(f"ray.address: cannot reach the Ray cluster at {cfg.ray.address}: {problem}")
        os.environ.setdefault("RAY_gcs_server_port_wait_time_s", "30")  # Ray's own retries would take minutes
        ray.init(address=cfg.ray.address, runtime_env={"env_vars": quiet}, log_to_driver=True)
        return
    num_cpus = cfg.ray.num_cpus or max(os.cpu_count() or 1, int(actor_cpus(cfg) + 0.999))
    ray.init(
        address="local", num_cpus=num_cpus, include_dashboard=False, runtime_env={"env_vars": quiet}, log_to_driver=True
    )


CONNECT_TIMEOUT_S = 10.0  # how long a cluster's address may take to accept a connection


def unreachable(address: str) -> str | None:
    """Why nothing answers at `address` within CONNECT_TIMEOUT_S, or None (also for `auto`, which Ray resolves)."""
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if address == "auto" or not sep or not port.isdigit():
        return None
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as err:
        return f"nothing answers at {host}:{port} within {CONNECT_TIMEOUT_S:g} s ({err})"
    return None


@dataclass
class Cluster:
    """Handles to every actor of a run, their placement groups and the weight transport between them."""

    learner: LearnerGroup
    generators: list[ray.actor.ActorHandle]
    reward_workers: list[ray.actor.ActorHandle]
    transport: WeightTransport
    placement: Placement

    @classmethod
    def start(cls, cfg: Config, model_path: str) -> Cluster:
        """Reserve the placement groups, create the actors in them, wait until every engine is up and connect the
        weight transport (errors surface here, with the actor named). On any failure nothing is left running."""
        placement = place(cfg)
        started: list[ray.actor.ActorHandle] = []
        try:
            learner = LearnerGroup.start(cfg, model_path, placement.learner_strategies(), timeout_s=cfg.sync.timeout_s)
            started += learner.ranks
            generator_actor = ray.remote(Generator)
            generators = [
                generator_actor.options(
                    **generator_resources(cfg), scheduling_strategy=placement.generator_strategy(index)
                ).remote(model_path, cfg.rollout, cfg.run.seed + index, wire_backend(cfg))
                for index in range(cfg.rollout.num_generators)
            ]
            started += generators
            reward_actor = ray.remote(RewardWorker)
            workers = [
                reward_actor.options(
                    num_cpus=cfg.reward.num_cpus, scheduling_strategy=placement.reward_strategy(index)
                ).remote(cfg.reward.functions, cfg.reward.timeout_s)
                for index in range(cfg.reward.num_workers)
            ]
            started += workers
            names = [f"generator {i}" for i in range(len(generators))]
            names += [f"reward worker {i}" for i in range(len(workers))]
            _wait_ready([*generators, *workers], names, cfg.sync.timeout_s)
            transport = make_transport(cfg, learner, generators)
            transport.connect()
        except BaseException:
            for actor in started:
                ray.kill(actor)
            placement.remove()
            raise
        return cls(learner, generators, workers, transport, placement)

    def generate(
        self, prompts: list[PromptRecord], group_size: int, greedy: bool = False, seeds: list[int] | None = None
    ) -> list[Completion]:
        """Split the prompts across generators; completions come back grouped, in prompt order. `seeds`: one
        sampling seed per prompt."""
        shards = _shards(len(prompts), len(self.generators))
        calls = [
            generator.generate.remote(
                [p.token_ids for p in prompts[start:end]], group_size, greedy, start, seeds and seeds[start:end]
            )
            for generator, (start, end) in zip(self.generators, shards, strict=True)
            if end > start
        ]
        return [completion for shard in ray.get(calls) for completion in shard]

    def score(self, requests: list[ScoreRequest]) -> list[Score]:
        """Score in parallel across the reward workers, order kept."""
        shards = _shards(len(requests), len(self.reward_workers))
        calls = [
            worker.score.remote(requests[start:end])
            for worker, (start, end) in zip(self.reward_workers, shards, strict=True)
            if end > start
        ]
        return [score for shard in ray.get(calls) for score in shard]

    def train(self, batch: TrainBatch) -> dict[str, float]:
        return self.learner.train(batch)

    def sync_weights(self, weight_version: int) -> None:
        """Load the learner's current weights into every generator, by the configured transport."""
        self.transport.sync(weight_version)

    def save(self, out_dir: str) -> str:
        return self.learner.save(out_dir)

    def shutdown(self) -> None:
        """Stop every actor of the run (the Ray cluster itself stays up)."""
        self.learner.shutdown()
        for actor in [*self.generators, *self.reward_workers]:
            ray.kill(actor)
        self.placement.remove()


def _wait_ready(actors: list[ray.actor.ActorHandle], names: list[str], timeout_s: float) -> None:
    """Wait for the actors' constructors (engines loading their models); fail naming the first that failed or hung."""
    refs = [actor.__ray_ready__.remote() for actor in actors]
    _, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    for ref, name in zip(refs, names, strict=True):
        if ref not in pending:
            try:
                ray.get(ref)
            except ray.exceptions.RayError as err:
                raise RuntimeError(f"{name} failed to start: {err}") from err
    if pending:
        hung = [name for ref, name in zip(refs, names, strict=True) if ref in pending]
        raise RuntimeError(f"{', '.join(hung)} did not start within {timeout_s:.0f} s (sync.timeout_s)")


def _shards(total: int, parts: int) -> list[tuple[int, int]]:
    """[start, end) ranges cutting `total` items into `parts` near-equal contiguous shards."""
    bounds = torch.linspace(0, total, parts + 1).round().long().tolist()
    return list(zip(bounds[:-1], bounds[1:], strict=True))

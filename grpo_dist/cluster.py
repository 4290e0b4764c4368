"""The Ray side of a run: start or join a cluster, place the actors by role, and the few calls the driver makes.

Each role is its own module (`grpo_dist.learner_group`, `grpo_dist.generator_pool`, `grpo_dist.reward_pool`); the
cluster joins them with the weight transport, and brings a replaced generator or learner group back into it.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import ray

from grpo_dist.batch import TrainBatch
from grpo_dist.config import Config
from grpo_dist.faults import FaultLog
from grpo_dist.generator_pool import GeneratorPool, Joining
from grpo_dist.learner_group import LearnerGroup, LearnerGroupError, LearnerHung, LearnerLost
from grpo_dist.placement import Placement, place
from grpo_dist.reward_pool import RewardPool
from grpo_dist.transports import WeightSyncError, WeightTransport, make_transport
from grpo_dist.types import Score, ScoreRequest


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


RECONNECT_ATTEMPTS = 3  # a node going down takes its generators one after another


@dataclass
class Cluster:
    """The run's actors, by role (the learner group, the generator pool, the reward pool), their placement groups,
    the weight transport between them, and the log of the faults they survived."""

    cfg: Config
    model_path: str
    learner: LearnerGroup
    generators: GeneratorPool
    rewards: RewardPool
    transport: WeightTransport
    placement: Placement
    faults: FaultLog
    weight_version: int = 0  # the weights the generators hold (0: the initial model)
    learner_version: int = 0  # the learner's: updates in its weights (the step they finished)
    training: list | None = None  # a training step under way (`start_train`)
    trained: dict | None = None  # its metrics, when a reconnect had to wait for it

    @classmethod
    def start(cls, cfg: Config, model_path: str) -> Cluster:
        """Reserve the placement groups, create the actors in them, wait until every engine is up and connect the
        weight transport (errors surface here, with the actor named). On any failure nothing is left running."""
        placement, faults = place(cfg), FaultLog()
        started: list = []
        try:
            learner = LearnerGroup.start(cfg, model_path, placement.learner_strategies(), timeout_s=cfg.sync.timeout_s)
            started.append(learner)
            generators = GeneratorPool(cfg, model_path, placement, faults)
            started.append(generators)
            rewards = RewardPool(cfg, placement, faults)
            started.append(rewards)
            generators.pool.wait_ready()
            rewards.pool.wait_ready()
            transport = make_transport(cfg, learner, generators.actors)
            transport.connect()
        except BaseException:
            for role in started:
                role.shutdown()
            placement.remove()
            raise
        cluster = cls(cfg, model_path, learner, generators, rewards, transport, placement, faults)
        generators.rejoin = cluster.reconnect
        return cluster

    def score(self, requests: list[ScoreRequest]) -> list[Score]:
        return self.rewards.score(requests)

    def train(self, batch: TrainBatch) -> dict[str, float]:
        self.start_train(batch)
        return self.finish_train()

    def start_train(self, batch: TrainBatch) -> None:
        """Start a training step; the driver generates the next batch meanwhile."""
        self.training = self.learner.submit_train(batch)

    def finish_train(self) -> dict[str, float]:
        """Wait for the training step `start_train` began; its metrics."""
        self._await_training()
        metrics, self.trained = self.trained, None
        return metrics

    def poll_training(self) -> bool:
        """Whether no training step is under way any more (one that has just ended is taken in, its metrics kept
        for `finish_train`), without waiting."""
        if self.training is not None:
            _, pending = ray.wait(self.training, num_returns=len(self.training), timeout=0)
            if not pending:
                self._await_training()
        return self.training is None

    def _await_training(self) -> None:
        if self.training is not None:
            calls, self.training = self.training, None
            self.trained = self.learner.wait_train(calls)
            self.learner_version += 1

    def sync_weights(self) -> None:
        """Load the learner's current weights (`learner_version`) into every generator, by the configured
        transport. A sync that fails because a generator is gone or hung is done again once it is replaced;
        otherwise the error is raised (a lost learner rank: `LearnerLost`)."""
        try:
            self.transport.sync(self.learner_version)
        except (WeightSyncError, LearnerGroupError) as err:
            # A rank that is alive but stuck may be waiting on a generator that hung mid-sync: check them first.
            rank_died = isinstance(err, LearnerLost) and not isinstance(err, LearnerHung)
            if rank_died or not self.generators.replace_unresponsive():
                raise
            self.reconnect()
        self.weight_version = self.learner_version

    def reconnect(self) -> None:
        """Connect the weight transport afresh (after a generator or the learner group was replaced, or the pool
        resized) and load the learner's weights into every generator (after the training step under way, if any);
        a generator lost meanwhile is replaced and the connection made again."""
        self._await_training()
        for attempt in range(1, RECONNECT_ATTEMPTS + 1):
            try:
                self.transport = make_transport(self.cfg, self.learner, self.generators.actors)
                self.transport.connect()
                if self.learner_version:
                    self.transport.sync(self.learner_version)
                self.weight_version = self.learner_version
                return
            except LearnerLost:
                raise
            except (WeightSyncError, LearnerGroupError):
                if attempt == RECONNECT_ATTEMPTS or not self.generators.replace_unresponsive():
                    raise

    def restart_learner(self) -> None:
        """Replace every learner rank with a fresh one in the same placement (weights: the initial model's; the
        caller loads a checkpoint), then reconnect the transport."""
        self.learner.shutdown()
        self.generators.replace_unresponsive()  # one lost with the learner (the same node) must not stall the sync
        strategies = self.placement.learner_strategies()
        self.learner = LearnerGroup.start(self.cfg, self.model_path, strategies, timeout_s=self.cfg.sync.timeout_s)
        self.weight_version = self.learner_version = 0
        self.training = self.trained = None
        self.transport = make_transport(self.cfg, self.learner, self.generators.actors)
        self.transport.connect()

    def scale_generators(self, count: int) -> None:
        """Ask for `count` generators, between steps: removed ones stop now; new ones join when placed and started
        (`admit_generators`), the run going on meanwhile."""
        running = len(self.generators.actors)
        self.generators.request(count)
        if len(self.generators.actors) != running:
            self.reconnect()

    def admit_generators(self) -> tuple[list[Joining], list[tuple[Joining, str]]]:
        """Take in the generators that have started since the last call (each connected to the weight transport
        and loaded with the learner's weights before it takes work); those that joined, and those given up."""
        joined, failed = self.generators.admit()
        if joined:
            self.reconnect()
        return joined, failed

    def save(self, out_dir: str) -> str:
        return self.learner.save(out_dir)

    def shutdown(self) -> None:
        """Stop every actor of the run (the Ray cluster itself stays up)."""
        self.learner.shutdown()
        self.generators.shutdown()
        self.rewards.shutdown()
        self.placement.remove()

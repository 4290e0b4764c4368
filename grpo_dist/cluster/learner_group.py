"""The learner group: N learner ranks (Ray actors) forming one torch.distributed group and one DeepSpeed engine.

The driver talks to the group only: `start_train(batch)` splits the batch across the ranks by token count and
returns at once, `finish_train()` sums their metrics; `save`, `state_dict` and `sequence_logprobs` are collectives
whose answer comes from rank 0. The group owns the training state: `version`, the updates in its weights (the step
they finished; set by `load_checkpoint`), and the training step under way. Rank 0's node and a free port on it are
the rendezvous; every rank gets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and LOCAL_RANK (its index among the
ranks on its node). Every wait is bounded: a start by `faults.start_timeout_s`, a training step by its progress (no
micro-batch finished within `faults.train_timeout_s`), checkpoints by `faults.checkpoint_timeout_s` and every other
call (the weight sync's) by `sync.timeout_s`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ray

from grpo_dist.algo.batch import TrainBatch, shard_batch
from grpo_dist.cluster.actors.learner import Learner
from grpo_dist.cluster.ray_cluster import cpu_share
from grpo_dist.config import Config, RolloutConfig
from grpo_dist.faults import POLL, Bound, Bounds, gather, gather_progressing, stacks
from grpo_dist.storage import Store

# Global values every rank knows, and rank 0's own training time; the other metrics are summed over the ranks.
FROM_RANK_0 = ("grad_norm", "lr", "time/learner_busy", "learner/peak_flops", "learner/skipped")
MAX_OVER_RANKS = ("memory/learner_gb",)


class LearnerGroupError(RuntimeError):
    """A learner rank's call failed; the message names the rank and the call."""


class LearnerLost(LearnerGroupError):
    """A learner rank died, did not answer within the bound, or its device failed or ran out of memory (`kind`, as
    `faults.ActorFault` names it) while the group was at `version`: the group must be restarted."""

    def __init__(self, message: str, kind: str | None = None, version: int = 0) -> None:
        super().__init__(message)
        self.kind, self.version = kind, version


class LearnerHung(LearnerLost):
    """A learner rank did not answer within the bound (it may be waiting on a peer that hung: a generator in a
    weight sync)."""


class LearnerGroup:
    """Handles to the ranks of one DeepSpeed engine, the training state they hold, and the few collective calls the
    driver makes."""

    def __init__(self, ranks: list[ray.actor.ActorHandle], cfg: Config) -> None:
        self.ranks = ranks
        self.cfg = cfg
        self.bounds = Bounds.of(cfg)
        self.threads: list[int] = []
        self.version = 0  # updates in the ranks' weights: the step they finished (0: the initial model)
        self.training: list[ray.ObjectRef] | None = None  # the training step under way (`start_train`)
        self.trained: dict[str, float] | None = None  # its metrics, once taken in before `finish_train`
        self.node_ids: list[str] = []  # each rank's Ray node

    @classmethod
    def start(cls, cfg: Config, model_path: str, strategies: Sequence[Any] | None = None) -> LearnerGroup:
        """Create `learner.num_ranks` ranks (on the given scheduling strategies, one per rank, when placed), join
        them into one process group and build their engines."""
        learner = cfg.learner
        strategies = strategies or [None] * learner.num_ranks
        actor = ray.remote(concurrency_groups={"heartbeat": 1})(Learner)  # `progress` answers while a step runs
        ranks = [
            actor.options(num_cpus=learner.num_cpus, num_gpus=learner.num_gpus, scheduling_strategy=strategy).remote(
                model_path, learner, cfg.algorithm, budgeted(cfg), cfg.run.seed, cfg.faults.inject
            )
            for strategy in strategies
        ]
        group = cls(ranks, cfg)
        try:
            group._setup()
        except BaseException:
            group.shutdown()
            raise
        return group

    def _setup(self) -> None:
        start = self.bounds.start  # placement and engine build, not a training call
        nodes = self._wait([rank.node.remote() for rank in self.ranks], "node", bound=start)
        master = (nodes[0][1], self._wait([self.ranks[0].free_port.remote()], "free_port")[0])
        node_ids = self.node_ids = [node_id for node_id, _ in nodes]
        if self.cfg.object_store:  # each node's shards are staged on its own disk: its directory made safely first
            self.on_each_node("make_staging_dir", self.cfg.run.staging_dir, self.cfg.run.name)
        collective_s = collective_timeout_s(self.cfg)
        calls = [
            rank.setup.remote(
                index,
                len(self.ranks),
                node_ids[:index].count(node_ids[index]),  # LOCAL_RANK: earlier ranks on the same node
                node_ids.count(node_ids[index]),
                master,
                collective_s,
                cpu_share(),
            )
            for index, rank in enumerate(self.ranks)
        ]
        self.threads = self._wait(calls, "setup", bound=start)

    def begin_run(self, cfg: Config) -> None:
        """A new run's config on these ranks, built as it would build them (its bounds; its staging directory on each
        node for an object-store run)."""
        self.cfg, self.bounds = cfg, Bounds.of(cfg)
        if cfg.object_store:
            self.on_each_node("make_staging_dir", cfg.run.staging_dir, cfg.run.name)

    def inject_faults(self, cfg: Config) -> None:
        """The faults a new run handed to these ranks injects (`faults.inject`), none met yet. Not on a `reset`
        within a run (a rollback to the initial model): a fault injected `once` stays met."""
        self._call("inject_faults", cfg.faults.inject, bound=self.bounds.probe)

    def reset(self, cfg: Config) -> None:
        """Begin a new run on these ranks (the same number and process settings): `cfg`'s settings, the initial
        model's weights (version 0), a fresh optimizer."""
        self.begin_run(cfg)
        self._call("reset", cfg.learner, cfg.algorithm, budgeted(cfg), cfg.run.seed, bound=self.bounds.start)
        self.version, self.training, self.trained = 0, None, None

    def train(self, batch: TrainBatch) -> dict[str, float]:
        """One training step on a rollout batch, split across the ranks; metrics of the whole batch."""
        self.start_train(batch)
        return self.finish_train()

    def start_train(self, batch: TrainBatch) -> None:
        """Start a training step and return at once (the driver works on the next batch meanwhile)."""
        learner = self.cfg.learner
        shards = shard_batch(
            batch,
            len(self.ranks),
            self.cfg.algorithm.mini_batches,
            learner.micro_batch_size,
            self.cfg.algorithm.aggregation,
            learner.max_tokens_per_micro_batch,
        )
        self.training = [rank.train.remote(shard) for rank, shard in zip(self.ranks, shards, strict=True)]

    def finish_train(self) -> dict[str, float]:
        """The metrics of the training step `start_train` began, once every rank has finished it."""
        self.wait_idle()
        metrics, self.trained = self.trained, None
        return metrics

    def poll(self) -> bool:
        """Whether no training step is under way any more, without waiting (one that has just ended is taken in:
        `version` moves on, its metrics are kept for `finish_train`)."""
        if self.training is not None and not any(outcome.pending for outcome in gather(self.training, POLL)):
            self.wait_idle()
        return self.training is None

    def wait_idle(self) -> None:
        """Wait for the training step under way, if any, and take it in (its metrics kept for `finish_train`)."""
        if self.training is None:
            return
        calls, self.training = self.training, None
        results = self._wait(calls, "train", bound=self.bounds.train, progressing=True)
        self.version += 1
        summed = [key for key in results[0] if key not in FROM_RANK_0 + MAX_OVER_RANKS]
        metrics = {key: sum(result[key] for result in results) for key in summed}
        metrics.update({key: results[0][key] for key in FROM_RANK_0 if key in results[0]})
        metrics.update({key: max(result[key] for result in results) for key in MAX_OVER_RANKS if key in results[0]})
        self.trained = metrics

    @property
    def busy(self) -> bool:
        """Whether a training step is under way (started, not yet taken in)."""
        return self.training is not None

    def state_dict(self) -> ray.ObjectRef:
        """A reference to the full weights (rank 0 returns them; the others only take part in gathering)."""
        refs = [rank.state_dict.remote() for rank in self.ranks]
        self._wait(refs[1:], "state_dict", ranks=range(1, len(refs)))
        return self._wait(refs[:1], "state_dict", fetch=False)[0]

    def adapter(self) -> ray.ObjectRef:
        """A reference to the LoRA adapter's weights and config (rank 0 returns them; the others only gather)."""
        refs = [rank.adapter.remote() for rank in self.ranks]
        self._wait(refs[1:], "adapter", ranks=range(1, len(refs)))
        return self._wait(refs[:1], "adapter", fetch=False)[0]

    def save(self, out_dir: str, store: Store | None = None, key: str = "") -> str:
        """The policy in Hugging Face format, written by rank 0 to `out_dir` on its node; with a `store`, published
        from there to `key` (`Store.publish`). Returns where it is."""
        self._call("save", out_dir, bound=self.bounds.checkpoint)
        if store is None:
            return out_dir
        self._wait([self.ranks[0].publish.remote(out_dir, store, key)], "publish", bound=self.bounds.checkpoint)
        return store.name(key)

    def save_checkpoint(self, path: str) -> None:
        self._call("save_checkpoint", path, bound=self.bounds.checkpoint)

    def on_each_node(self, method: str, *args: Any) -> list[Any]:
        """Run a method on the first rank of each node, at once: the calls that move a node's own files (`publish`,
        `fetch`, `discard`, `make_staging_dir`). Returns each node's answer."""
        firsts = [self.node_ids.index(node) for node in dict.fromkeys(self.node_ids)]
        calls = [getattr(self.ranks[index], method).remote(*args) for index in firsts]
        return self._wait(calls, method, ranks=firsts, bound=self.bounds.checkpoint)

    def load_checkpoint(self, path: str, version: int) -> None:
        """Load a checkpoint written after step `version` into every rank."""
        self._call("load_checkpoint", path, bound=self.bounds.checkpoint)
        self.version, self.training, self.trained = version, None, None

    def sequence_logprobs(self, token_ids: list[int]) -> list[float]:
        return self._call("sequence_logprobs", token_ids)[0]

    def call(self, method: str, *args: Any) -> list[Any]:
        """Run a method on every rank at once (a collective) and return each rank's answer."""
        return self._call(method, *args)

    def shutdown(self) -> None:
        for rank in self.ranks:
            ray.kill(rank, no_restart=True)

    def _call(self, method: str, *args: Any, bound: Bound | None = None) -> list[Any]:
        return self._wait([getattr(rank, method).remote(*args) for rank in self.ranks], method, bound=bound)

    def _wait(
        self,
        refs: list[ray.ObjectRef],
        method: str,
        ranks: Sequence[int] | None = None,
        bound: Bound | None = None,
        fetch=True,
        progressing: bool = False,
    ) -> list[Any]:
        """Results of one call per rank (of `ranks`, all by default), in that order, within `bound` (by default the
        sync bound; a training step's is on its progress); fails naming the first rank that failed or hung."""
        bound = bound or self.bounds.sync
        ranks = list(ranks if ranks is not None else range(len(refs)))
        if progressing:
            outcomes = gather_progressing(refs, [self.ranks[rank] for rank in ranks], bound, fail_fast=True)
        else:  # the other ranks would wait on a failed one in the collective: stop at the first failure
            outcomes = gather(refs, bound, fetch=fetch, fail_fast=True)
        for rank, outcome in zip(ranks, outcomes, strict=True):
            if outcome.fault and not outcome.pending:
                message = f"learner rank {rank} {outcome.fault} during {method}"
                raise LearnerLost(message, outcome.kind, self.version) from outcome.error
            if outcome.raised:
                raise LearnerGroupError(f"learner rank {rank}: {method} failed: {outcome.error}") from outcome.error
        hung = [rank for rank, outcome in zip(ranks, outcomes, strict=True) if outcome.pending]
        if hung:
            why = outcomes[ranks.index(hung[0])].fault
            where = stacks.dump(
                self.bounds.stacks_dir,
                f"learner {method} {why}",
                {f"learner rank {rank}": self.ranks[rank] for rank in hung},
            )
            raise LearnerHung(f"learner rank(s) {hung}: {method} {why}{where}", None, self.version)
        return [outcome.value for outcome in outcomes]


def collective_timeout_s(cfg: Config) -> float:
    """How long a rank's collective waits on a peer: no collective outlasts the longest call it belongs to (a
    step's, a sync's or a checkpoint's)."""
    bounds = Bounds.of(cfg)
    return max(bound.seconds for bound in (bounds.train, bounds.sync, bounds.checkpoint))


def budgeted(cfg: Config) -> RolloutConfig:
    """The rollout settings a learner rank reads (the temperature, and the generation budget that Dr. GRPO's
    normaliser divides by: a trajectory's whole budget with an environment)."""
    return cfg.rollout.model_copy(update={"max_new_tokens": cfg.generation_budget})

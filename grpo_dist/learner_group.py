"""The learner group: N learner ranks (Ray actors) forming one torch.distributed group and one DeepSpeed engine.

The driver talks to the group only: `train(batch)` splits the batch across the ranks by token count and sums their
metrics; `save`, `state_dict` and `sequence_logprobs` are collectives whose answer comes from rank 0. Rank 0's node
and a free port on it are the rendezvous; every rank gets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and LOCAL_RANK
(its index among the ranks on its node). Every wait is bounded by `timeout_s`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ray

from grpo_dist.actors.learner import Learner
from grpo_dist.batch import TrainBatch, shard_batch
from grpo_dist.config import Config
from grpo_dist.faults import first_line

# Global values every rank knows, and rank 0's own training time; the other metrics are summed over the ranks.
FROM_RANK_0 = ("grad_norm", "lr", "time/learner_busy")


class LearnerGroupError(RuntimeError):
    """A learner rank's call failed; the message names the rank and the call."""


class LearnerLost(LearnerGroupError):
    """A learner rank died or did not answer within the bound: the group must be restarted."""


class LearnerHung(LearnerLost):
    """A learner rank did not answer within the bound (it may be waiting on a peer that hung: a generator in a
    weight sync)."""


class LearnerGroup:
    """Handles to the ranks of one DeepSpeed engine, and the few collective calls the driver makes."""

    def __init__(self, ranks: list[ray.actor.ActorHandle], cfg: Config, timeout_s: float) -> None:
        self.ranks = ranks
        self.cfg = cfg
        self.timeout_s = timeout_s
        self.threads: list[int] = []
        self.updates = 0  # training steps the ranks have completed

    @classmethod
    def start(
        cls, cfg: Config, model_path: str, strategies: Sequence[Any] | None = None, timeout_s: float = 600.0
    ) -> LearnerGroup:
        """Create `learner.num_ranks` ranks (on the given scheduling strategies, one per rank, when placed), join
        them into one process group and build their engines."""
        learner = cfg.learner
        strategies = strategies or [None] * learner.num_ranks
        actor = ray.remote(Learner)
        ranks = [
            actor.options(num_cpus=learner.num_cpus, num_gpus=learner.num_gpus, scheduling_strategy=strategy).remote(
                model_path, learner, cfg.algorithm, cfg.rollout, cfg.run.seed
            )
            for strategy in strategies
        ]
        group = cls(ranks, cfg, timeout_s)
        group._setup()
        return group

    def _setup(self) -> None:
        start_timeout_s = self.cfg.faults.start_timeout_s  # placement and engine build, not a training call
        nodes = self._wait([rank.node.remote() for rank in self.ranks], "node", timeout_s=start_timeout_s)
        master = (nodes[0][1], self._wait([self.ranks[0].free_port.remote()], "free_port")[0])
        node_ids = [node_id for node_id, _ in nodes]
        calls = [
            rank.setup.remote(
                index,
                len(self.ranks),
                node_ids[:index].count(node_ids[index]),  # LOCAL_RANK: earlier ranks on the same node
                node_ids.count(node_ids[index]),
                master,
            )
            for index, rank in enumerate(self.ranks)
        ]
        self.threads = self._wait(calls, "setup", timeout_s=start_timeout_s)

    def train(self, batch: TrainBatch) -> dict[str, float]:
        """One training step on a rollout batch, split across the ranks; metrics of the whole batch."""
        return self.wait_train(self.submit_train(batch))

    def submit_train(self, batch: TrainBatch) -> list[ray.ObjectRef]:
        """Start a training step and return at once (the driver works on the next batch meanwhile)."""
        learner = self.cfg.learner
        shards = shard_batch(
            batch, len(self.ranks), self.cfg.algorithm.mini_batches, learner.micro_batch_size,
            self.cfg.algorithm.aggregation,
        )  # fmt: skip
        return [rank.train.remote(shard) for rank, shard in zip(self.ranks, shards, strict=True)]

    def wait_train(self, calls: list[ray.ObjectRef]) -> dict[str, float]:
        """The metrics of a training step `submit_train` started, once every rank has finished it."""
        results = self._wait(calls, "train")
        self.updates += 1
        metrics = {key: sum(result[key] for result in results) for key in results[0] if key not in FROM_RANK_0}
        metrics.update({key: results[0][key] for key in FROM_RANK_0 if key in results[0]})
        return metrics

    def state_dict(self) -> ray.ObjectRef:
        """A reference to the full weights (rank 0 returns them; the others only take part in gathering)."""
        refs = [rank.state_dict.remote() for rank in self.ranks]
        self._wait(refs[1:], "state_dict", first_rank=1)
        ray.wait(refs[:1], timeout=self.timeout_s, fetch_local=False)
        return refs[0]

    def save(self, out_dir: str) -> str:
        return self._call("save", out_dir)[0]

    def save_checkpoint(self, path: str) -> None:
        self._call("save_checkpoint", path)

    def load_checkpoint(self, path: str) -> None:
        self._call("load_checkpoint", path)

    def sequence_logprobs(self, token_ids: list[int]) -> list[float]:
        return self._call("sequence_logprobs", token_ids)[0]

    def call(self, method: str, *args: Any) -> list[Any]:
        """Run a method on every rank at once (a collective) and return each rank's answer."""
        return self._call(method, *args)

    def shutdown(self) -> None:
        for rank in self.ranks:
            ray.kill(rank, no_restart=True)

    def _call(self, method: str, *args: Any) -> list[Any]:
        return self._wait([getattr(rank, method).remote(*args) for rank in self.ranks], method)

    def _wait(
        self, refs: list[ray.ObjectRef], method: str, first_rank: int = 0, timeout_s: float | None = None
    ) -> list[Any]:
        """Results of one call per rank, in rank order; fails naming the first rank that failed or hung."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        done, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        for ref in refs:
            if ref in pending:
                continue
            rank = first_rank + refs.index(ref)
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as err:
                raise LearnerLost(f"learner rank {rank} died during {method} ({first_line(err)})") from err
            except ray.exceptions.RayError as err:
                raise LearnerGroupError(f"learner rank {rank}: {method} failed: {err}") from err
        if pending:
            hung = [first_rank + index for index, ref in enumerate(refs) if ref in pending]
            raise LearnerHung(f"learner rank(s) {hung}: {method} did not return within {timeout_s:.0f} s")
        return ray.get(refs)

"""Reward worker actor: scores completions with the configured functions (or judges them with an eval reward), never
failing on user code, which runs in its sandbox process (`grpo_dist.sandbox`) unless `reward.sandbox` is off."""

from __future__ import annotations

import math

import ray

from grpo_dist.config import RewardConfig
from grpo_dist.rewards import counters
from grpo_dist.rewards.registry import WEIGHTED_SUM, weighted_sum, with_floors
from grpo_dist.sandbox.privileges import die_with_parent
from grpo_dist.types import Failure, Score, ScoreRequest


class RewardWorker:
    """Holds the reward functions, ready in a `RewardRunner`: the training ones, then the eval judges."""

    def __init__(self, reward: RewardConfig, judges: list[str]) -> None:
        from grpo_dist.rewards.runner import RewardRunner

        die_with_parent()
        self.functions = reward.functions
        self.on_failure = reward.on_failure
        self.runner = RewardRunner([spec.name for spec in reward.functions] + judges, reward, reap=True)
        self.judges = judges
        self.done = 0  # completions scored: the heartbeat of a share

    @ray.method(concurrency_group="heartbeat")
    def progress(self) -> int:
        """How many completions it has scored (answered by a thread of its own while it scores): the pool's bound
        on a share is on this count not moving (`faults.gather_progressing`)."""
        return self.done

    def score(
        self, requests: list[ScoreRequest], judge: str | None = None
    ) -> tuple[list[Score], bool, dict[str, float]]:
        """Score each request (`judge`: by that eval reward alone, weight 1, no floor). A call the completion made
        fail scores its function's floor under `reward.on_failure: floor`; any other failure leaves that completion
        unscored (NaN); either way `Score.failures` says why. Also returns whether so many calls are stuck past their
        time limit that the worker should be replaced, and what the built-ins counted meanwhile (`rewards.counters`)."""
        floors = [math.nan]  # an eval judge's failure counts as a wrong answer there, never as a score
        if judge is not None:
            functions = [len(self.functions) + self.judges.index(judge)]
            names, weights, kwargs = [judge], [1.0], [{}]
        else:
            names = [spec.name for spec in self.functions]
            functions = list(range(len(self.functions)))
            weights = [spec.weight for spec in self.functions]
            kwargs = [dict(spec.kwargs) for spec in self.functions]
            floors = [spec.floor if self.on_failure == "floor" else math.nan for spec in self.functions]
        scores = []
        completions = [(request.prompt, request.completion, request.fields) for request in requests]
        for _, values, errors in self.runner.score_each(functions, weights, kwargs, completions):
            per_function = with_floors(values, errors, floors)
            total, why = weighted_sum(per_function, weights)
            failures = {name: error for name, error in zip(names, errors, strict=True) if error is not None}
            if not failures and why is not None:  # every function scored, but their weighted sum is out of range
                failures[WEIGHTED_SUM] = Failure(WEIGHTED_SUM, why)
            scores.append(Score(total=total, per_function=per_function, failures=failures))
            self.done += 1
        return scores, self.runner.exhausted, counters.take()

    def close(self) -> None:
        """End its sandbox and jails and wait until they are gone (the pool calls it before killing the worker)."""
        self.runner.close()

    def __del__(self) -> None:
        if hasattr(self, "runner"):
            self.runner.close()

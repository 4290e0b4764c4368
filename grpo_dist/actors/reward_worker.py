"""Reward worker actor: scores completions with the configured functions, never failing on user code."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from grpo_dist.actors import die_with_parent
from grpo_dist.config import RewardFunctionConfig
from grpo_dist.rewards import resolve_reward, score_one
from grpo_dist.types import Score, ScoreRequest


class RewardWorker:
    """Holds the resolved reward functions and a thread pool to run them under a time limit."""

    def __init__(self, functions: list[RewardFunctionConfig], timeout_s: float) -> None:
        die_with_parent()
        self.names = [spec.name for spec in functions]
        self.functions = [resolve_reward(spec.name) for spec in functions]
        self.weights = [spec.weight for spec in functions]
        self.kwargs = [dict(spec.kwargs) for spec in functions]
        self.timeout_s = timeout_s
        # Threads stuck in timed-out calls stay busy; spare ones keep the pool scoring until half are stuck, when
        # `score` reports the worker exhausted and the reward pool replaces it.
        self.threads = 4 * len(self.functions)
        self.executor = _TrackingExecutor(max_workers=self.threads, thread_name_prefix="reward")

    def score(self, requests: list[ScoreRequest]) -> tuple[list[Score], bool]:
        """Score each request; a function that fails leaves that completion unscored (NaN). Also returns whether
        so many calls are stuck past their time limit that the worker should be replaced."""
        scores = []
        for request in requests:
            total, per_function, errors = score_one(
                self.functions,
                self.weights,
                self.kwargs,
                request.prompt,
                request.completion,
                request.fields,
                self.timeout_s,
                self.executor,
            )
            failures = {name: error for name, error in zip(self.names, errors, strict=True) if error is not None}
            scores.append(Score(total=total, per_function=per_function, failures=failures))
        return scores, 2 * len(self.executor.unfinished) >= self.threads


class _TrackingExecutor(ThreadPoolExecutor):
    """A thread pool that knows its unfinished calls: after `score`, those are calls stuck past their limit."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.unfinished: set[Future] = set()

    def submit(self, *args: Any, **kwargs: Any) -> Future:
        future = super().submit(*args, **kwargs)
        self.unfinished.add(future)
        future.add_done_callback(self.unfinished.discard)
        return future

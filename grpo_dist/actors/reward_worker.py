"""Reward worker actor: scores completions with the configured functions (or judges them with `eval.reward`), never
failing on user code."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import ray

from grpo_dist.actors import die_with_parent
from grpo_dist.config import RewardFunctionConfig
from grpo_dist.rewards import resolve_reward, score_one
from grpo_dist.types import Score, ScoreRequest


class RewardWorker:
    """Holds the resolved reward functions and a thread pool to run them under a time limit."""

    def __init__(self, functions: list[RewardFunctionConfig], timeout_s: float, judge: str | None = None) -> None:
        """`judge`: the held-out judge (`eval.reward`), used by `score(..., judge=True)`."""
        die_with_parent()
        self.names = [spec.name for spec in functions]
        self.functions = [resolve_reward(spec.name) for spec in functions]
        self.weights = [spec.weight for spec in functions]
        self.kwargs = [dict(spec.kwargs) for spec in functions]
        self.judge = (judge, resolve_reward(judge)) if judge else None
        self.timeout_s = timeout_s
        self.done = 0  # completions scored: the heartbeat of a share
        # Threads stuck in timed-out calls stay busy; spare ones keep the pool scoring until half are stuck, when
        # `score` reports the worker exhausted and the reward pool replaces it.
        self.threads = 4 * len(self.functions)
        self.executor = _TrackingExecutor(max_workers=self.threads, thread_name_prefix="reward")

    @ray.method(concurrency_group="heartbeat")
    def progress(self) -> int:
        """How many completions it has scored (answered by a thread of its own while it scores): the pool's bound
        on a share is on this count not moving (`faults.gather_progressing`)."""
        return self.done

    def score(self, requests: list[ScoreRequest], judge: bool = False) -> tuple[list[Score], bool]:
        """Score each request (`judge`: by the held-out judge alone, weight 1); a function that fails leaves that
        completion unscored (NaN). Also returns whether so many calls are stuck past their time limit that the
        worker should be replaced."""
        names, functions, weights, kwargs = self.names, self.functions, self.weights, self.kwargs
        if judge:
            names, functions, weights, kwargs = [self.judge[0]], [self.judge[1]], [1.0], [{}]
        scores = []
        for request in requests:
            total, per_function, errors = score_one(
                functions, weights, kwargs, request.prompt, request.completion, request.fields, self.timeout_s,
                self.executor,
            )  # fmt: skip
            failures = {name: error for name, error in zip(names, errors, strict=True) if error is not None}
            scores.append(Score(total=total, per_function=per_function, failures=failures))
            self.done += 1
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

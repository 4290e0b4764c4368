"""Reward worker actor: scores completions with the configured functions, never failing on user code."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from grpo_dist.config import RewardFunctionConfig
from grpo_dist.rewards import resolve_reward, score_one
from grpo_dist.types import Score, ScoreRequest


class RewardWorker:
    """Holds the resolved reward functions and a thread pool to run them under a time limit."""

    def __init__(self, functions: list[RewardFunctionConfig], timeout_s: float) -> None:
        self.functions = [resolve_reward(spec.name) for spec in functions]
        self.weights = [spec.weight for spec in functions]
        self.kwargs = [dict(spec.kwargs) for spec in functions]
        self.timeout_s = timeout_s
        # Threads stuck in timed-out calls stay busy; spare ones keep the pool scoring.
        self.executor = ThreadPoolExecutor(max_workers=4 * len(self.functions), thread_name_prefix="reward")

    def score(self, requests: list[ScoreRequest]) -> list[Score]:
        """Score each request; a function that raises or times out leaves that completion unscored (NaN)."""
        scores = []
        for request in requests:
            total, per_function, error = score_one(
                self.functions,
                self.weights,
                self.kwargs,
                request.prompt,
                request.completion,
                request.fields,
                self.timeout_s,
                self.executor,
            )
            scores.append(Score(total=total, per_function=per_function, error=error))
        return scores

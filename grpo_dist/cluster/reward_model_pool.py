"""The reward-model pool: a sequence classifier (`reward.model`) run by actors of its own, its score the reward
function `reward_model`.

The actors (`grpo_dist.cluster.actors.classifier.Classifier`) are started, bounded and replaced by the same
`ActorPool` as the judge's engines and the reward workers: their start bounded by `faults.start_timeout_s`, each dead
one replaced up to `reward.model.max_restarts` (counted in `faults/reward_model_restarts`), a share whose actor is
lost or gives no scores within `faults.score_timeout_s` scored again once on a new actor, then left unscored. The
model is frozen: never synced. Each completion is read through the reward model's tokenizer and chat template, not
the policy's (`Classifier.tokens`)."""

from __future__ import annotations

import math
import time

import ray

from grpo_dist.cluster.actors.classifier import Classifier
from grpo_dist.config import Config, RewardModelConfig
from grpo_dist.faults import ActorPool, Bounds, FaultLog
from grpo_dist.types import ScoreRequest


class RewardModelPool:
    def __init__(self, cfg: Config, faults: FaultLog) -> None:
        self.settings: RewardModelConfig = cfg.reward.model
        self.bounds = Bounds.of(cfg)
        self.model = reward_model_path(self.settings)
        self.seconds = 0.0  # spent scoring since `step_metrics` last read it
        self.truncated = 0
        self.pool = ActorPool(
            "reward model",
            "reward_model_restarts",
            self._start,
            self.settings.num_workers,
            faults,
            self.settings.max_restarts,
            self.bounds.start,
        )

    def _start(self, slot: int) -> ray.actor.ActorHandle:
        options = {"num_cpus": self.settings.num_cpus, "num_gpus": self.settings.num_gpus}
        return ray.remote(Classifier).options(**options).remote(self.model, self.settings)

    def score(self, requests: list[ScoreRequest]) -> list[tuple[float, str | None]]:
        """Each completion's score (score, None), or (NaN, why unscored), in order. The completions go out in rounds
        of one batch per actor (`reward.model.batch_size`), so that `faults.score_timeout_s` bounds one forward pass
        of an actor, never a share however large."""
        started = time.monotonic()
        items = [(request.turns, request.prompt, request.completion) for request in requests]
        size = self.settings.batch_size * len(self.pool.actors)
        found = []
        for start in range(0, len(items), size):
            chunk = items[start : start + size]
            found += self.pool.call_split("score", chunk, (), self.bounds.score, "scoring with the reward model")
        self.seconds += time.monotonic() - started
        self.truncated += sum(1 for answer in found if answer is not None and answer[1])
        return [_checked(answer[0] if answer is not None else None) for answer in found]

    def step_metrics(self) -> dict[str, float]:
        """`reward_model/seconds`: the time spent scoring since the last call; `reward_model/truncated`: the inputs
        cut to `reward.model.max_length` since then."""
        metrics = {"reward_model/seconds": self.seconds, "reward_model/truncated": float(self.truncated)}
        self.seconds, self.truncated = 0.0, 0
        return metrics

    def shutdown(self) -> None:
        self.pool.shutdown()


def _checked(score: float | None) -> tuple[float, str | None]:
    if score is None:
        return math.nan, "the reward model's actor was lost"
    if not math.isfinite(score):
        return math.nan, f"the reward model gave a non-finite score ({score})"
    return score, None


def reward_model_path(settings: RewardModelConfig, files: list[str] | None = None) -> str:
    """The reward model's directory: a local one, or a hub id's snapshot at `revision` (only `files` when given)."""
    from grpo_dist.models.hub import model_directory

    return model_directory(settings.path, settings.revision, "reward.model.path", files)

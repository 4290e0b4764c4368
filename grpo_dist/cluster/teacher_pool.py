"""The teacher pool of on-policy distillation: a frozen teacher served by vLLM engines of its own, scoring every
token the student sampled.

The teacher engines are generator actors (`grpo_dist.cluster.actors.generator.Generator`) of the teacher model, each in
a placement group of its own (`placement.plan`: one bundle, or one GPU bundle per engine worker), started, bounded and
replaced by the same `ActorPool` as the generators (their start bounded by `faults.start_timeout_s`, each dead one
replaced up to `algorithm.distill.max_restarts`, counted in `faults/teacher_restarts`). They are never synced. A batch
of completions is split between the engines; each reads every completion's prompt and completion token ids as one prompt
(no text round trip) and returns the log-probability of each completion token after the tokens before it (vLLM's prompt
log-probs, at temperature 1). A batch whose engine is lost or gives no answer within `faults.score_timeout_s` is scored
again once on a new engine; its completions are then left without the teacher's judgement (no distillation advantage),
counted in `distill/unscored`.
"""

from __future__ import annotations

import math
import time

import ray

from grpo_dist.cluster.actors.generator import Generator
from grpo_dist.cluster.placement import Placement, engine_resources
from grpo_dist.config import Config, DistillConfig, engine_rollout
from grpo_dist.faults import ActorPool, Bounds, FaultLog
from grpo_dist.models.hub import max_positions, model_directory
from grpo_dist.types import Completion


class TeacherPool:
    def __init__(self, cfg: Config, placement: Placement, faults: FaultLog) -> None:
        self.distill: DistillConfig = cfg.algorithm.distill
        self.bounds = Bounds.of(cfg)
        self.model = teacher_model(self.distill)
        # vLLM takes a prompt of at most its engine's length less one (a token must fit after it): one more than the
        # generators' length holds their longest sequence whole, where the teacher's positions allow it
        positions = max_positions(self.model)
        self.max_model_len = min(cfg.rollout.max_model_len + 1, positions or cfg.rollout.max_model_len + 1)
        self.seed = cfg.run.seed
        self.placement = placement
        self.seconds = 0.0  # spent scoring since `step_metrics` last read it
        self.unscored = 0  # completions left without the teacher's judgement since `step_metrics`
        self.pool = ActorPool(
            "teacher engine",
            "teacher_restarts",
            self._start,
            self.distill.num_engines,
            faults,
            self.distill.max_restarts,
            self.bounds.start,
            ready_call="start",
            close_call="close",
        )

    def _start(self, slot: int) -> ray.actor.ActorHandle:
        distill = self.distill
        engine = engine_rollout(distill, 1, self.max_model_len, distill.tensor_parallel_size)
        options = engine_resources(distill.num_cpus, distill.num_gpus, distill.tensor_parallel_size)
        strategy = self.placement.teacher_strategy(slot)
        return (
            ray.remote(Generator)
            .options(**options, scheduling_strategy=strategy)
            .remote(self.model, engine, self.seed + 2000 + slot)
        )

    def annotate(self, completions: list[Completion]) -> None:
        """Set each completion's `teacher_logprobs` (left None where its batch's engine was lost twice; NaN for a
        token past the teacher's positions, which only a sequence filling all of them has: its last)."""
        if not completions:
            return
        started = time.monotonic()
        fits = self.max_model_len - 1  # a sequence longer than that is scored up to there, its last token(s) NaN
        sequences = [((c.prompt_token_ids + c.token_ids)[:fits], len(c.prompt_token_ids)) for c in completions]
        doing = "scoring the student's tokens"
        found = self.pool.call_split("token_logprobs", sequences, (), self.bounds.score, doing)
        for completion, logprobs in zip(completions, found, strict=True):
            cut = len(completion.token_ids) - len(logprobs) if logprobs is not None else 0
            completion.teacher_logprobs = None if logprobs is None else logprobs + [math.nan] * cut
            self.unscored += logprobs is None
        self.seconds += time.monotonic() - started

    def step_metrics(self) -> dict[str, float]:
        """`distill/teacher_seconds`: the time spent scoring since the last call; `distill/unscored`: completions
        left without the teacher's judgement since then."""
        metrics = {"distill/teacher_seconds": self.seconds, "distill/unscored": float(self.unscored)}
        self.seconds, self.unscored = 0.0, 0
        return metrics

    def shutdown(self) -> None:
        self.pool.shutdown()


def teacher_model(distill: DistillConfig, files: list[str] | None = None) -> str:
    """The teacher's directory: a local one, or a hub id's snapshot at `algorithm.distill.revision` (only `files`
    when given, as `grpo_dist.models.hub.snapshot` takes them)."""
    return model_directory(distill.teacher, distill.revision, "algorithm.distill.teacher", files)

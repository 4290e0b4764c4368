"""The judge pool: an LLM judge served by vLLM engines of its own, its verdict the reward function `judge`.

The judge engines are generator actors (`grpo_dist.cluster.actors.generator.Generator`) of the judge model, started,
bounded and replaced by the same `ActorPool` as the generators (their start bounded by `faults.start_timeout_s`, each
dead one replaced up to `reward.judge.max_restarts`, counted in `faults/judge_restarts`). They are never synced: the
judge is frozen. A batch is split between the engines, each handed token ids (`grpo_dist.rewards.judge_prompt`: the
`reward.judge.prompt` template through the judge's chat template, the completion, the prompt and the row's fields
tokenized as text, never as special tokens), and decodes greedily. The first match of `reward.judge.verdict` in a reply,
divided by `scale` and clamped to [`min_score`, `max_score`] (counted in `judge/clamped`), is the score; a reply without
one is unscored, with the reply's start as the reason. A batch whose engine is lost or gives no verdict within
`faults.score_timeout_s` is judged again once on a new engine, then left unscored.
"""

from __future__ import annotations

import math
import time

import ray

from grpo_dist.cluster.actors.generator import Generator
from grpo_dist.config import Config, JudgeConfig, engine_rollout
from grpo_dist.faults import ActorPool, Bounds, FaultLog
from grpo_dist.rewards.judge_prompt import JudgePrompt, VerdictReader
from grpo_dist.types import ScoreRequest


class JudgePool:
    def __init__(self, cfg: Config, faults: FaultLog) -> None:
        self.judge: JudgeConfig = cfg.reward.judge
        self.bounds = Bounds.of(cfg)
        self.model = judge_model(self.judge)
        self.seed = cfg.run.seed
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.model)
        self.prompt = JudgePrompt(self.tokenizer, self.judge)
        self.verdicts = VerdictReader(self.judge)
        self.seconds = 0.0  # spent judging since `step_metrics` last read it
        self.pool = ActorPool(
            "judge engine",
            "judge_restarts",
            self._start,
            self.judge.num_engines,
            faults,
            self.judge.max_restarts,
            self.bounds.start,
            ready_call="start",
        )

    def _start(self, slot: int) -> ray.actor.ActorHandle:
        judge = self.judge
        engine = engine_rollout(judge, judge.max_tokens, judge.max_model_len)
        options = {"num_cpus": judge.num_cpus, "num_gpus": judge.num_gpus}
        return ray.remote(Generator).options(**options).remote(self.model, engine, self.seed + 1000 + slot)

    def prompt_tokens(self, request: ScoreRequest) -> list[int]:
        """[P] what the judge reads of one completion (`JudgePrompt.tokens`)."""
        return self.prompt.tokens(request)

    def verdict(self, reply: str) -> tuple[float, str | None]:
        """(score, None) from a reply, clamped to its range, or (NaN, why) when it holds no verdict."""
        return self.verdicts.read(reply)

    def score(self, requests: list[ScoreRequest]) -> list[tuple[float, str | None]]:
        """Each completion's verdict (score, why unscored), in order."""
        started = time.monotonic()
        prompts = [self.prompt_tokens(request) for request in requests]
        found = self.pool.call_split("judge", prompts, (self.judge.max_tokens,), self.bounds.score, "judging")
        self.seconds += time.monotonic() - started
        lost = (math.nan, "the judge engine was lost")
        return [self.verdict(reply) if reply is not None else lost for reply in found]

    def step_metrics(self) -> dict[str, float]:
        """`judge/seconds`: the time spent judging since the last call; `judge/clamped`: the verdicts clamped into
        [min_score, max_score] since then."""
        metrics = {"judge/seconds": self.seconds, "judge/clamped": float(self.verdicts.take_clamped())}
        self.seconds = 0.0
        return metrics

    def shutdown(self) -> None:
        self.pool.shutdown()


def judge_model(judge: JudgeConfig) -> str:
    """The judge model's directory: a local one, or a hub id's snapshot."""
    from grpo_dist.models.hub import model_directory

    return model_directory(judge.model, None, "reward.judge.model")

"""The judge pool: an LLM judge served by vLLM engines of its own, its verdict the reward function `judge`.

The judge engines are generator actors (`grpo_dist.actors.generator.Generator`) of the judge model, started,
bounded and replaced by the same `ActorPool` as the generators (their start bounded by `faults.start_timeout_s`,
each dead one replaced up to `reward.judge.max_restarts`, counted in `faults/judge_restarts`). They are never
synced: the judge is frozen. A batch is split between the engines; each renders its completions into the
`reward.judge.prompt` template, through the judge's chat template, and decodes greedily. The first match of
`reward.judge.verdict` in a reply, divided by `scale`, is the score; a reply without one is unscored, with the
reply's start as the reason. A batch whose engine is lost or gives no verdict within `faults.score_timeout_s` is
judged again once on a new engine, then left unscored.
"""

from __future__ import annotations

import math
import re
import time
from pathlib import Path

import ray

from grpo_dist.actors.generator import Generator
from grpo_dist.config import Config, JudgeConfig, engine_rollout
from grpo_dist.faults import ActorPool, Bounds, FaultLog
from grpo_dist.types import ScoreRequest


class JudgePool:
    def __init__(self, cfg: Config, faults: FaultLog) -> None:
        self.judge: JudgeConfig = cfg.reward.judge
        self.bounds = Bounds.of(cfg)
        self.model = judge_model(self.judge)
        self.seed = cfg.run.seed
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.model)
        self.pattern = re.compile(self.judge.verdict)
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
        """[P] what the judge reads of one completion, within its context: a completion too long for it is cut
        (its start kept), so the template's end and the generation prompt stay."""
        budget, completion = self.judge.max_model_len - self.judge.max_tokens, request.completion
        tokens = self._render(request, completion)
        while len(tokens) > budget and completion:
            completion = completion[: max(0, len(completion) * budget // len(tokens) - 1)]
            tokens = self._render(request, completion)
        return tokens[:budget]

    def _render(self, request: ScoreRequest, completion: str) -> list[int]:
        fields = {key: value for key, value in request.fields.items() if isinstance(value, str | int | float)}
        fields.update(prompt=request.prompt, completion=completion)
        text = self.judge.prompt.format_map(_Blank(fields))
        if getattr(self.tokenizer, "chat_template", None):
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
            )
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def verdict(self, reply: str) -> tuple[float, str | None]:
        """(score, None) from a reply, or (NaN, why) when it holds no verdict."""
        found = self.pattern.search(reply)
        if found is None:
            return math.nan, f"the judge's reply has no verdict matching reward.judge.verdict: {reply[:120]!r}"
        return float(found.group(1)) / self.judge.scale, None

    def score(self, requests: list[ScoreRequest]) -> list[tuple[float, str | None]]:
        """Each completion's verdict (score, why unscored), in order."""
        started = time.monotonic()
        prompts = [self.prompt_tokens(request) for request in requests]
        found = self.pool.call_split("judge", prompts, (self.judge.max_tokens,), self.bounds.score, "judging")
        self.seconds += time.monotonic() - started
        lost = (math.nan, "the judge engine was lost")
        return [self.verdict(reply) if reply is not None else lost for reply in found]

    def step_metrics(self) -> dict[str, float]:
        """`judge/seconds`: the time spent judging since the last call."""
        metrics, self.seconds = {"judge/seconds": self.seconds}, 0.0
        return metrics

    def shutdown(self) -> None:
        self.pool.shutdown()


class _Blank(dict):
    """Template fields the row lacks are left as written."""

    def __missing__(self, key: str) -> str:
        return "{" + key + "}"


def judge_model(judge: JudgeConfig) -> str:
    """The judge model's directory: a local one, or a hub id's snapshot."""
    from grpo_dist.hub import HUB_ID, snapshot

    if Path(judge.model).is_dir():
        return str(Path(judge.model).resolve())
    if HUB_ID.fullmatch(judge.model):
        return snapshot(judge.model, None, "reward.judge.model")
    raise ValueError(f"reward.judge.model: {judge.model} is neither a model directory nor a hub id")

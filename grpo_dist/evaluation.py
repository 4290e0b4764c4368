"""Held-out accuracy: greedy completions of the held-out prompts, judged by `eval.reward` (1.0 = correct), before
and after training. The generator pool samples them and the reward pool judges them, each under its own bounds;
`grpo-dist sft`, which has no cluster, judges its warm-up the same way in its own process."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from grpo_dist.cluster import Cluster
from grpo_dist.config import Config
from grpo_dist.data import PromptRecord
from grpo_dist.rewards import resolve_reward, score_one
from grpo_dist.rollouts import generate, score_requests
from grpo_dist.types import ScoreRequest


def report_accuracy(cfg: Config, cluster: Cluster, held_out: list[PromptRecord], when: str) -> float | None:
    """Greedy accuracy on the held-out prompts (at most `eval.max_prompts`) on the generators; printed and
    returned."""
    if not held_out:
        return None
    prompts = held_out[: cfg.eval.max_prompts]
    completions = generate(cluster, prompts, group_size=1, greedy=True)
    scores = [score.total for score in cluster.rewards.score(score_requests(prompts, completions), judge=True)]
    return show_accuracy(cfg, scores, when)


def judge_accuracy(cfg: Config, requests: list[ScoreRequest], when: str) -> float:
    """The fraction of completions `eval.reward` scores 1.0 (correct), judged in this process (`grpo-dist sft`);
    printed with `when` and returned."""
    judge = [resolve_reward(cfg.eval.reward)]
    with ThreadPoolExecutor(max_workers=4) as pool:
        scores = [
            score_one(judge, [1.0], [{}], r.prompt, r.completion, r.fields, cfg.reward.timeout_s, pool)[0]
            for r in requests
        ]
    return show_accuracy(cfg, scores, when)


def show_accuracy(cfg: Config, scores: list[float], when: str) -> float:
    """The fraction of scores that are 1.0 (correct), printed with `when`; a completion the judge failed on counts
    as wrong."""
    accuracy = sum(score == 1.0 for score in scores) / len(scores)
    print(f"held-out accuracy {when}: {accuracy:.3f} ({len(scores)} prompts, judged by {cfg.eval.reward})")
    return accuracy

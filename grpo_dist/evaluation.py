"""Held-out accuracy: greedy completions of the held-out prompts, judged by `eval.reward` (1.0 = correct), before
and after training. The generator pool samples them and the reward pool judges them, each under its own bounds;
`grpo-dist sft`, which has no cluster, judges its warm-up the same way in its own process."""

from __future__ import annotations

from grpo_dist.cluster import Cluster
from grpo_dist.config import Config
from grpo_dist.data import PromptRecord
from grpo_dist.rewards.runner import RewardRunner
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
    """The fraction of completions `eval.reward` scores 1.0 (correct), judged without a cluster (`grpo-dist sft`),
    in a sandbox as the reward workers judge; printed with `when` and returned."""
    judge = RewardRunner([cfg.eval.reward], cfg.reward)
    try:
        scores = [judge.score([0], [1.0], [{}], r.prompt, r.completion, r.fields)[0] for r in requests]
    finally:
        judge.close()
    return show_accuracy(cfg, scores, when)


def show_accuracy(cfg: Config, scores: list[float], when: str) -> float:
    """The fraction of scores that are 1.0 (correct), printed with `when`; a completion the judge failed on counts
    as wrong."""
    accuracy = sum(score == 1.0 for score in scores) / len(scores)
    print(f"held-out accuracy {when}: {accuracy:.3f} ({len(scores)} prompts, judged by {cfg.eval.reward})")
    return accuracy

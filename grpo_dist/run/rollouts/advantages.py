"""A batch's shaped rewards and group-relative advantages: the configured reward functions weighted, DAPO's soft
overlong penalty (arXiv 2503.14476) added as one more function, then the estimator of `algorithm.estimator`
(`grpo_dist.algo`); with `algorithm.distill`, each token's distillation advantage from the teacher's log-probs of the
student's samples. Torch and the config only: no actor is involved."""

from __future__ import annotations

import torch

from grpo_dist.algo import (
    distill_advantages,
    group_baseline,
    multi_reward_advantages,
    overlong_penalty,
    reverse_kl,
)
from grpo_dist.algo.batch import TrainBatch
from grpo_dist.config import Config
from grpo_dist.run.rollouts.rollout import Rollout
from grpo_dist.types import Completion


def compute_advantages(cfg: Config, rollout: Rollout) -> tuple[torch.Tensor, torch.Tensor]:
    """Shaped rewards and advantages [B*G]: the weighted reward functions plus DAPO's soft overlong penalty. Pure
    distillation (`algorithm.distill` without `with_rewards`) trains on the teacher alone: its advantages are 0."""
    rewards, advantages = reward_advantages(cfg, rollout)
    if cfg.algorithm.distill is not None and not cfg.algorithm.distill.with_rewards:
        advantages = torch.zeros_like(advantages)
    return rewards, advantages


def add_distillation(cfg: Config, batch: TrainBatch, completions: list[Completion]) -> tuple[TrainBatch, dict]:
    """With `algorithm.distill`: the batch with each sampled token's distillation advantage, coef x (teacher -
    student log-prob), the student's being its sampling log-prob (less its group's leave-one-out mean at that
    position with `baseline: group`); and `distill/reverse_kl`, the mean of student - teacher over the trained tokens
    the teacher scored. Without it, the batch as it is."""
    if cfg.algorithm.distill is None:
        return batch, {}
    teacher, scored = torch.zeros_like(batch.sampling_logprobs), torch.zeros_like(batch.completion_mask)  # [B, T]
    for row, completion in enumerate(completions):
        if completion.teacher_logprobs is not None:
            start = len(completion.prompt_token_ids)
            end = start + len(completion.token_ids)
            found = torch.tensor(completion.teacher_logprobs, dtype=teacher.dtype)  # NaN: a token the teacher left
            teacher[row, start:end] = found.nan_to_num(0.0)
            scored[row, start:end] = (~found.isnan()).to(scored.dtype)
    counted = batch.completion_mask * scored  # [B, T]
    token_advantages = distill_advantages(batch.sampling_logprobs, teacher, counted, cfg.algorithm.distill.coef)
    if cfg.algorithm.distill.baseline == "group":
        groups = torch.tensor([c.prompt_index for c in completions])
        starts = torch.tensor([len(c.prompt_token_ids) for c in completions])
        token_advantages = group_baseline(token_advantages, counted, groups, starts)
    return batch.with_token_advantages(token_advantages), {
        "distill/reverse_kl": reverse_kl(batch.sampling_logprobs, teacher, counted)
    }


def reward_advantages(cfg: Config, rollout: Rollout) -> tuple[torch.Tensor, torch.Tensor]:
    """Shaped rewards and their group-relative advantages [B*G]."""
    algo = cfg.algorithm
    per_function = rollout.per_function()  # [B*G, F]
    weights = [spec.weight for spec in cfg.reward.functions]
    if algo.overlong == "soft_penalty":
        penalty = overlong_penalty(
            rollout.lengths(), cfg.rollout.max_new_tokens, algo.overlong_buffer, algo.overlong_penalty
        )  # [B*G]
        per_function, weights = torch.cat([per_function, penalty[:, None]], dim=1), [*weights, 1.0]
    return multi_reward_advantages(
        per_function,
        weights,
        cfg.rollout.group_size,
        combine=cfg.reward.combine,
        estimator=algo.estimator,
        std=algo.std,
        eps=algo.eps,
    )

"""A batch's shaped rewards and group-relative advantages: the configured reward functions weighted, DAPO's soft
overlong penalty (arXiv 2503.14476) added as one more function, then the estimator of `algorithm.estimator`
(`grpo_dist.algo`). Torch and the config only: no actor is involved."""

from __future__ import annotations

import torch

from grpo_dist.algo import multi_reward_advantages, overlong_penalty
from grpo_dist.config import Config
from grpo_dist.rollouts.rollout import Rollout


def compute_advantages(cfg: Config, rollout: Rollout) -> tuple[torch.Tensor, torch.Tensor]:
    """Shaped rewards and advantages [B*G]: the weighted reward functions plus DAPO's soft overlong penalty."""
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

"""Group-relative advantages: one number per completion from the rewards of its prompt's group.

Rewards arrive flat, ``group_size`` completions per prompt laid out contiguously (``[g0s0, g0s1, ..., g1s0, ...]``),
and every estimator returns one advantage per completion, in the same order. Estimators (``ESTIMATORS``):

- ``grpo``: (r - group mean) / (group std + eps), DeepSeekMath's outcome supervision, arXiv 2402.03300.
- ``dr_grpo``: r - group mean, no std division (Dr. GRPO, arXiv 2503.20783).
- ``rloo``: r - mean of the other G-1 rewards of the group (RLOO, arXiv 2402.14740); equals G/(G-1) * dr_grpo.
- ``batch_std``: (r - group mean) / (std of all valid rewards in the batch + eps) (Lite PPO, arXiv 2508.08221).
- ``reinforce_pp``: r - group mean, then whitened over the batch (REINFORCE++-baseline, arXiv 2501.03262).

Where this departs from the papers:

- A NaN reward marks an unscorable completion: it is left out of every statistic (group and batch mean and std,
  the leave-one-out mean) and its advantage is exactly 0.
- A group with fewer than 2 valid rewards has no baseline (no std, no "other" sample): all its advantages are 0.
- A group whose valid rewards are all equal gets exactly 0. The papers give 0 / (0 + eps) = 0 in exact arithmetic,
  but a rounded mean (0.1 * 3 / 3 != 0.1) leaves noise of the size of eps that dividing by (std + eps) would blow
  up to order 0.01.
- ``std="sample"`` (default) is the unbiased std, as DeepSeekMath and TRL (``torch.std``); ``"population"`` divides
  by G. eps is added to the std, outside the square root, as in TRL. ``batch_std`` uses the same ``std`` choice.
- ``reinforce_pp`` whitens over the completions that have a group baseline (valid, in a group with at least 2
  valid rewards); the others stay 0. Since every group-centred value sums to 0 per group, the batch mean is 0 up to
  rounding and whitening mostly rescales.
- Statistics are computed in float64 and cast back to the rewards' dtype, so float32 rewards near float32's largest
  value (3.4e38) do not overflow the sums and squares of the mean and std. An advantage itself must fit the rewards'
  dtype: ``grpo`` and the whitened estimators are of order 1, ``dr_grpo`` and ``rloo`` up to 4x the largest reward
  (``grpo_dist.rewards.REWARD_LIMIT`` bounds the rewards a run computes advantages of).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

ESTIMATORS: tuple[str, ...] = ("grpo", "dr_grpo", "rloo", "batch_std", "reinforce_pp")
"""Valid values of ``group_advantages(estimator=...)``."""

STD_MODES: tuple[str, ...] = ("sample", "population")
"""Valid values of ``group_advantages(std=...)``: unbiased (divide by n - 1) or population (divide by n)."""


def group_advantages(
    rewards: Tensor,
    group_size: int,
    estimator: str = "grpo",
    *,
    std: str = "sample",
    eps: float = 1e-6,
) -> Tensor:
    """Advantages of ``rewards`` [num_groups * group_size], groups contiguous; returns the same shape.

    NaN rewards get advantage 0 and do not enter any statistic; the output never holds NaN or inf.
    Raises ValueError for a bad shape, a group_size that does not divide the batch, an unknown estimator or std,
    a negative eps, or an infinite reward.
    """
    _check_arguments(rewards, group_size, estimator, std, eps)
    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.get_default_dtype()
    grouped = rewards.to(torch.float64).reshape(-1, group_size)  # [N, G]
    valid = ~grouped.isnan()  # [N, G]
    centered = torch.where(valid, grouped - _masked_mean(grouped, valid), 0.0)  # [N, G]
    ddof = 1 if std == "sample" else 0
    advantages = _ESTIMATOR_FNS[estimator](grouped, valid, centered, ddof, eps)  # [N, G]
    informative = spread_mask(grouped, valid)  # [N, G]
    return torch.where(informative, advantages, 0.0).reshape(-1).to(out_dtype)  # [N*G]


def _check_arguments(rewards: Tensor, group_size: int, estimator: str, std: str, eps: float) -> None:
    if estimator not in ESTIMATORS:
        raise ValueError(
            f"group_advantages: unknown estimator {estimator!r}; valid estimators: {', '.join(ESTIMATORS)}"
        )
    if std not in STD_MODES:
        raise ValueError(f"group_advantages: unknown std {std!r}; valid values: {', '.join(STD_MODES)}")
    check_grouping("group_advantages", rewards, group_size)
    if eps < 0:
        raise ValueError(f"group_advantages: eps must be >= 0, got {eps}")
    if torch.isinf(rewards).any():
        positions = torch.isinf(rewards).nonzero().flatten().tolist()[:8]
        raise ValueError(
            f"group_advantages: rewards are infinite at positions {positions}; a reward function must return a "
            "finite value, or NaN for a completion it cannot score"
        )


def check_grouping(caller: str, rewards: Tensor, group_size: int) -> None:
    """Rewards must be 1-D and cut into whole groups of `group_size`; the error names `caller`."""
    if rewards.dim() != 1:
        raise ValueError(
            f"{caller}: rewards must be 1-D [num_groups * group_size], got shape {tuple(rewards.shape)}; "
            "flatten the groups contiguously first"
        )
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"{caller}: group_size must be an int >= 1, got {group_size!r}")
    if rewards.numel() % group_size != 0:
        raise ValueError(
            f"{caller}: {rewards.numel()} rewards is not a multiple of group_size={group_size}; every prompt "
            "must contribute exactly group_size completions (give an unscorable one a NaN reward, do not drop it)"
        )


def _masked_mean(values: Tensor, valid: Tensor) -> Tensor:
    """Mean over the last dim of the entries where ``valid``; 0 where none is. [..., K] -> [..., 1]"""
    total = torch.where(valid, values, 0.0).sum(-1, keepdim=True)  # [..., 1]
    return total / valid.sum(-1, keepdim=True).clamp(min=1)


def _masked_std(values: Tensor, valid: Tensor, ddof: int) -> Tensor:
    """Std over the last dim of the entries where ``valid``, dividing by count - ddof. [..., K] -> [..., 1]"""
    deviation = torch.where(valid, values - _masked_mean(values, valid), 0.0)  # [..., K]
    dof = (valid.sum(-1, keepdim=True) - ddof).clamp(min=1)  # [..., 1]
    return (deviation.square().sum(-1, keepdim=True) / dof).sqrt()


def spread_mask(grouped: Tensor, valid: Tensor) -> Tensor:
    """True for valid rewards of groups whose valid rewards are not all equal (so at least 2 valid). [N, G]"""
    highest = torch.where(valid, grouped, -torch.inf).amax(-1, keepdim=True)  # [N, 1]
    lowest = torch.where(valid, grouped, torch.inf).amin(-1, keepdim=True)  # [N, 1]
    return valid & (highest > lowest)


def _grpo(grouped: Tensor, valid: Tensor, centered: Tensor, ddof: int, eps: float) -> Tensor:
    return centered / (_masked_std(grouped, valid, ddof) + eps)  # [N, G] / [N, 1]


def _dr_grpo(grouped: Tensor, valid: Tensor, centered: Tensor, ddof: int, eps: float) -> Tensor:
    return centered


def _rloo(grouped: Tensor, valid: Tensor, centered: Tensor, ddof: int, eps: float) -> Tensor:
    # r - (S - r) / (n - 1) = n / (n - 1) * (r - S / n), with n the valid count of the group.
    count = valid.sum(-1, keepdim=True)  # [N, 1]
    return centered * count / (count - 1).clamp(min=1)


def _batch_std(grouped: Tensor, valid: Tensor, centered: Tensor, ddof: int, eps: float) -> Tensor:
    batch_std = _masked_std(grouped.reshape(1, -1), valid.reshape(1, -1), ddof)  # [1, 1]
    return centered / (batch_std + eps)


def _reinforce_pp(grouped: Tensor, valid: Tensor, centered: Tensor, ddof: int, eps: float) -> Tensor:
    has_baseline = (valid & (valid.sum(-1, keepdim=True) >= 2)).reshape(1, -1)  # [1, N*G]
    flat = centered.reshape(1, -1)  # [1, N*G]
    whitened = (flat - _masked_mean(flat, has_baseline)) / (_masked_std(flat, has_baseline, ddof) + eps)
    return whitened.reshape(centered.shape)  # [N, G]


_ESTIMATOR_FNS: dict[str, Callable[[Tensor, Tensor, Tensor, int, float], Tensor]] = {
    "grpo": _grpo,
    "dr_grpo": _dr_grpo,
    "rloo": _rloo,
    "batch_std": _batch_std,
    "reinforce_pp": _reinforce_pp,
}

"""Reward shaping around group advantages: overlong punishment, group filtering, and several reward functions.

- ``overlong_penalty``: DAPO's soft overlong punishment (arXiv 2503.14476, section 3.4), a length term added to
  the reward. It ramps linearly from 0 to -factor over the last ``buffer`` tokens before ``max_length``.
- ``informative_groups``: DAPO's dynamic sampling filter (same paper, section 3.2): keep only the groups whose
  rewards are not all equal, since GRPO gives every member of such a group advantage 0.
- ``multi_reward_advantages``: one advantage from F reward functions. ``sum_then_normalize`` weights and sums the
  rewards, then normalizes the sum within the group (TRL, veRL). ``normalize_then_sum`` normalizes each reward
  within the group first and sums the weighted advantages, so one reward's scale cannot drown another's (GDPO,
  arXiv 2601.05242).

Where this departs from the papers and the libraries:

- DAPO writes the penalty with factor 1; ``factor`` scales it (factor = 0 turns it off).
- DAPO resamples until the batch is full of informative groups; ``informative_groups`` only returns the mask and
  leaves resampling to the caller. A NaN reward (unscorable) is left out, as in ``group_advantages``: a group with
  fewer than 2 valid rewards is not informative.
- A row of ``per_function`` with a NaN in any column is unscorable as a whole: its summed reward is NaN (TRL's
  ``nansum`` would count the failed function as 0), its advantage is 0, and under ``normalize_then_sum`` it is left
  out of the statistics of every function, not only the one that failed, as ``sum_then_normalize`` leaves it out.
- GDPO whitens the summed advantages over the batch after the sum; ``normalize_then_sum`` does not, its scale grows
  with the weights. Whitening is the learner's business (or pick ``estimator="reinforce_pp"`` per function).
- The weighted sum and the advantages are computed in float64 (large float32 rewards do not overflow their sum) and
  returned in ``per_function``'s dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from grpo_dist.algo.advantages import check_grouping, group_advantages, spread_mask

COMBINES: tuple[str, ...] = ("sum_then_normalize", "normalize_then_sum")
"""Valid values of ``multi_reward_advantages(combine=...)``."""


def overlong_penalty(lengths: Tensor, max_length: int, buffer: int, factor: float = 1.0) -> Tensor:
    """Soft overlong punishment for completions of ``lengths`` [B] tokens; returns a float penalty [B] in [-factor, 0].

    0 up to ``max_length - buffer`` tokens, then linear down to -factor at exactly ``max_length``, -factor beyond.
    Raises ValueError unless lengths is 1-D, finite and >= 0, 0 < buffer <= max_length and factor >= 0.
    """
    _check_overlong_arguments(lengths, max_length, buffer, factor)
    dtype = lengths.dtype if lengths.is_floating_point() else torch.get_default_dtype()
    start = max_length - buffer  # last length with no penalty
    ramp = (start - lengths.to(dtype)) / buffer  # [B]: >= 0 before the buffer, -1 at max_length
    return ramp.clamp(min=-1.0, max=0.0) * factor  # [B]


def _check_overlong_arguments(lengths: Tensor, max_length: int, buffer: int, factor: float) -> None:
    if not 0 < buffer <= max_length:
        raise ValueError(
            f"overlong_penalty: need 0 < buffer <= max_length, got buffer={buffer}, max_length={max_length}; "
            "buffer is the number of tokens before max_length over which the penalty ramps up"
        )
    if not factor >= 0:
        raise ValueError(f"overlong_penalty: factor must be >= 0 (the penalty's size), got {factor}")
    if lengths.dim() != 1:
        raise ValueError(f"overlong_penalty: lengths must be 1-D [B], got shape {tuple(lengths.shape)}")
    if lengths.is_floating_point() and not torch.isfinite(lengths).all():
        raise ValueError("overlong_penalty: lengths hold NaN or inf; pass the token count of every completion")
    if (lengths < 0).any():
        raise ValueError(f"overlong_penalty: lengths must be >= 0, got minimum {lengths.min().item()}")


def informative_groups(rewards: Tensor, group_size: int) -> Tensor:
    """Which groups of ``rewards`` [N * group_size] teach anything: bool [N], True where valid rewards differ.

    NaN rewards are left out; a group with fewer than 2 valid rewards is False. These are exactly the groups where
    ``group_advantages`` is not all zeros. Raises ValueError for a bad shape or group_size.
    """
    check_grouping("informative_groups", rewards, group_size)
    grouped = rewards.reshape(-1, group_size)  # [N, G]
    return spread_mask(grouped, ~grouped.isnan()).any(-1)  # [N]


def multi_reward_advantages(
    per_function: Tensor,
    weights: Sequence[float] | Tensor,
    group_size: int,
    combine: str = "sum_then_normalize",
    estimator: str = "grpo",
    **options: Any,
) -> tuple[Tensor, Tensor]:
    """Weighted rewards [N] and advantages [N] from ``per_function`` [N, F], one column per reward function.

    ``weights`` holds one weight per column. A NaN marks a failed function; a row with any NaN gets reward NaN and
    advantage 0. ``options`` go to ``group_advantages`` (``std``, ``eps``). Raises ValueError for an unknown
    combine, mismatched shapes, or anything ``group_advantages`` rejects.
    """
    weight_vector = _check_multi_reward_arguments(per_function, weights, combine)  # [F], float64
    dtype = per_function.dtype if per_function.is_floating_point() else torch.get_default_dtype()
    scores = per_function.to(torch.float64)  # [N, F]
    rewards = (scores * weight_vector).sum(-1)  # [N]; NaN propagates from any failed column
    if combine == "sum_then_normalize":
        return rewards.to(dtype), group_advantages(rewards, group_size, estimator, **options).to(dtype)
    scorable = ~rewards.isnan()  # [N]
    masked = torch.where(scorable.unsqueeze(-1), scores, torch.nan)  # [N, F]: a failed row is NaN in every column
    per_column = [group_advantages(column, group_size, estimator, **options) for column in masked.unbind(-1)]
    advantages = (torch.stack(per_column, dim=-1) * weight_vector).sum(-1)  # [N, F] -> [N]
    return rewards.to(dtype), advantages.to(dtype)


def _check_multi_reward_arguments(per_function: Tensor, weights: Sequence[float] | Tensor, combine: str) -> Tensor:
    """Validates the arguments and returns the weights as a float64 tensor [F] on per_function's device."""
    if combine not in COMBINES:
        raise ValueError(f"multi_reward_advantages: unknown combine {combine!r}; valid values: {', '.join(COMBINES)}")
    if per_function.dim() != 2 or per_function.shape[1] == 0:
        raise ValueError(
            f"multi_reward_advantages: per_function must be 2-D [N, F] with F >= 1 reward functions, got shape "
            f"{tuple(per_function.shape)}; for a single function pass rewards.unsqueeze(-1)"
        )
    if torch.isinf(per_function).any():
        positions = torch.isinf(per_function).nonzero().tolist()[:8]
        raise ValueError(
            f"multi_reward_advantages: per_function is infinite at [row, column] {positions}; a "
            "reward function must return a finite value, or NaN for a completion it cannot score"
        )
    weight_vector = torch.as_tensor(weights, dtype=torch.float64, device=per_function.device)
    if weight_vector.shape != (per_function.shape[1],):
        raise ValueError(
            f"multi_reward_advantages: weights have shape {tuple(weight_vector.shape)} but per_function has shape "
            f"{tuple(per_function.shape)}; give one weight per column (reward function)"
        )
    if not torch.isfinite(weight_vector).all():
        raise ValueError(f"multi_reward_advantages: weights must be finite, got {weight_vector.tolist()}")
    return weight_vector

"""Off-policy corrections between the policy that sampled a batch and the learner's: a per-token weight on the policy
loss from the importance ratio k = pi_old / pi_sampler (the learner's log-probs before the step against the
engine's sampling log-probs), truncated or masked per token or per sequence.

- ``tis``: truncated importance sampling, w = min(k, cap) (Yao et al. 2025, "Your Efficient RL Framework Secretly
  Brings You Off-Policy RL Training"; TRL's ``token_truncate``).
- ``mis``: masked importance sampling, w = k where k <= cap (and k >= floor when one is given), else 0: a token
  too far off is left out rather than down-weighted (Liu et al. 2025, "When Speed Kills Stability: Demystifying RL
  Collapse from the Training-Inference Mismatch"; TRL's ``token_mask``).
- ``icepop``: w = k where floor <= k <= cap, else 0, with the two-sided band [0.5, 5] of its source by default
  (Ling team 2025, "Small Leak Can Sink a Great Ship: Boost RL Training on MoE with IcePop").
- ``seq_tis`` / ``seq_mis``: one ratio per sequence, the geometric mean K = exp(mean_t log k_t) over its tokens,
  truncated (w = min(K, cap)) or masked (w = K within the bounds, else 0) for the whole sequence (TRL's
  ``sequence_truncate`` / ``sequence_mask``; the geometric mean as in GSPO, arXiv 2507.18071, so a sequence's
  length does not set its weight).
- ``cispo`` is not a weight here but a surrogate (``grpo_dist.algo.loss``): each token's gradient A * grad log pi
  weighted by its detached ratio to the sampling policy, clipped above (MiniMax-M1, arXiv 2506.13585).

Departures: a masked token's weight is 0 but it still counts in the loss's normaliser (as in IcePop and TRL), so
masking does not raise the weight of the tokens kept. Weights are detached; positions outside the mask weigh 1.
"""

from __future__ import annotations

import torch
from torch import Tensor

OFF_POLICY: tuple[str, ...] = ("tis", "mis", "icepop", "seq_tis", "seq_mis", "cispo")
"""Valid values of `algorithm.off_policy`."""

WEIGHTS: tuple[str, ...] = ("tis", "mis", "icepop", "seq_tis", "seq_mis")
"""The corrections that weight the policy loss by `importance_weight` (the others change its surrogate)."""

MASKING: tuple[str, ...] = ("mis", "icepop", "seq_mis")
"""The corrections that mask (weight 0) tokens outside their bounds; the others truncate."""


def importance_weight(
    old_logprobs: Tensor,
    sampling_logprobs: Tensor,
    mask: Tensor,
    method: str = "tis",
    cap: float = 2.0,
    floor: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The detached weight [B, T] of each token's policy loss under correction `method` (`WEIGHTS`), and its
    statistics as token means over `mask`: `is_weight/mean` (the weight applied), `is_weight/capped` (the fraction
    truncated at `cap`: tis, seq_tis) or `is_weight/masked` (the fraction given 0: mis, icepop, seq_mis).

    old_logprobs, sampling_logprobs, mask: [B, T]. `floor` is a lower bound of the masking corrections only."""
    if method not in WEIGHTS:
        raise ValueError(f"importance_weight: unknown method {method!r}; valid values: {', '.join(WEIGHTS)}")
    if not cap > 0 or (floor is not None and not 0 <= floor < cap):
        raise ValueError(f"importance_weight: need cap > 0 and 0 <= floor < cap, got cap={cap} floor={floor}")
    if floor is not None and method not in MASKING:
        raise ValueError(f"importance_weight: {method} truncates at its cap and takes no floor (got {floor})")
    mask = mask != 0
    log_ratio = torch.where(mask, old_logprobs.detach() - sampling_logprobs.detach(), 0.0)  # [B, T]
    if method.startswith("seq_"):
        tokens = mask.sum(-1, keepdim=True).clamp(min=1)  # [B, 1]
        log_ratio = (log_ratio.sum(-1, keepdim=True) / tokens).expand_as(log_ratio)  # [B, T]: the geometric mean
    ratio = log_ratio.exp()  # [B, T]
    if method in MASKING:
        outside = ratio > cap  # [B, T]
        if floor is not None:
            outside = outside | (ratio < floor)
        weight = torch.where(outside, 0.0, ratio)
        stats = {"is_weight/masked": _token_mean(outside, mask)}
    else:
        weight = ratio.clamp(max=cap)
        stats = {"is_weight/capped": _token_mean(ratio > cap, mask)}
    weight = torch.where(mask, weight, 1.0)  # [B, T]
    return weight, {"is_weight/mean": _token_mean(weight, mask), **stats}


def _token_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of `values` [B, T] over the masked tokens (0 when there are none)."""
    return torch.where(mask, values.float(), 0.0).sum() / mask.sum().clamp(min=1)

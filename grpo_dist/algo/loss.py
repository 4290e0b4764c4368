"""The clipped policy-gradient loss of GRPO-family training (PPO surrogate, arXiv 1707.06347).

``policy_loss`` turns per-token log-probabilities of sampled completions and one advantage per completion into a
scalar loss to minimize, plus metrics as Python floats. Options:

- clip-higher: separate ``clip_low`` and ``clip_high`` (DAPO, arXiv 2503.14476).
- dual clip ``c > 1``: the loss of a negative-advantage token is capped at ``-A * c`` (Ye et al., arXiv 1912.09729).
- ``ratio_level="sequence"``: one ratio per sequence, exp of the masked mean token log-ratio, clipped per sequence
  (GSPO, arXiv 2507.18071).
- ``aggregation`` (``AGGREGATIONS``): ``seq-mean-token-mean`` (GRPO, arXiv 2402.03300; default), ``token-mean``
  (DAPO), ``seq-mean-token-sum-norm`` (sum / (B * max_length); Dr. GRPO, arXiv 2503.20783).
- KL penalty to a reference policy with Schulman's k1 / k2 / k3 estimators ("Approximating KL Divergence", 2020;
  k3 as in DeepSeekMath), added to the loss as ``kl_coef * kl``.
- off-policy corrections between the rollout engine and the learner (``off_policy``, ``grpo_dist.algo.off_policy``):
  each token's loss weighted by its ratio ``pi_old / pi_sampler`` truncated (TIS, the default: ``min(k, is_cap)``,
  Yao et al. 2025) or masked outside ``[is_floor, is_cap]`` (MIS, IcePop), per token or per sequence.
- CISPO (``off_policy="cispo"``, MiniMax-M1, arXiv 2506.13585) in place of the clipped surrogate: each token's loss
  is ``-sg(min(r, 1 + clip_high)) * A * log pi``, so every token keeps its gradient and only the weight is clipped
  (no lower bound, as in its source); ``r`` is the ratio to ``old_logprobs``, the sampling policy's in an
  off-policy run.
- entropy bonus: ``loss -= entropy_coef * entropy``.
- per-token advantages (``token_advantages``, [B, T]; on-policy distillation's, ``grpo_dist.algo.distill``) added to
  each sequence's advantage at each of its tokens.

Conventions and departures:

- ``seq-mean-token-mean`` divides by B, counting sequences with no masked token as 0 (as TRL does), so the
  denominator does not depend on the mask and an empty sequence never yields NaN.
- Masked-out positions are replaced by 0 before any exp, so padding garbage (huge, inf or NaN log-probs) never
  reaches the loss or its gradient. A mask entry counts when it is nonzero (float or bool masks both work).
- GSPO's ratio carries gradient to every token of its sequence (the plain sequence-level variant), except with
  ``token_advantages``: then it is GSPO-token's, the sequence's ratio in value with each token's own gradient, so
  a token's own advantage moves that token (with one advantage per sequence the two give the same gradient).
- Dual clip is applied before the off-policy weight; the weight multiplies the policy term only, not KL or entropy.
- CISPO's ``is_weight/mean`` and ``is_weight/capped`` are those of its clipped ratio; ``clip_fraction`` counts its
  capped tokens whatever the advantage's sign (each is down-weighted, none loses its gradient).
- ``advantages``, ``old_logprobs``, ``ref_logprobs`` and ``sampling_logprobs`` are constants (detached).
- Clip fractions, ratio statistics, ``is_weight/mean`` and ``is_weight/capped`` / ``is_weight/masked`` (the
  fraction of tokens whose weight was truncated at ``is_cap`` / set to 0) are token means over masked tokens
  whatever the aggregation; ``kl`` and ``entropy`` use ``aggregation``, the same number that enters the loss.
- Math runs in at least float32.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import Tensor

from grpo_dist.algo.off_policy import OFF_POLICY, importance_weight

AGGREGATIONS: tuple[str, ...] = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm")
"""Valid values of ``policy_loss(aggregation=...)``."""

KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")
"""Valid values of ``policy_loss(kl_estimator=...)``."""

RATIO_LEVELS: tuple[str, ...] = ("token", "sequence")
"""Valid values of ``policy_loss(ratio_level=...)``."""


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    ratio_level: str = "token",
    aggregation: str = "seq-mean-token-mean",
    max_length: int | None = None,
    ref_logprobs: Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    sampling_logprobs: Tensor | None = None,
    off_policy: str = "tis",
    is_cap: float = 2.0,
    is_floor: float | None = None,
    entropy: Tensor | None = None,
    entropy_coef: float = 0.0,
    token_advantages: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Scalar loss to minimize and float metrics for one batch of B sequences of T tokens.

    logprobs, old_logprobs, mask, ref_logprobs, sampling_logprobs, entropy, token_advantages: [B, T]; advantages:
    [B].
    Metrics: loss/policy, clip_fraction/low, clip_fraction/high, clip_fraction, ratio/mean, ratio/max,
    ratio/sequence_spread, and when their inputs are given dual_clip_fraction, is_weight/mean, is_weight/capped or
    is_weight/masked, kl, entropy.
    """
    _check_options(clip_low, clip_high, dual_clip, ratio_level, aggregation, max_length, kl_estimator, is_cap)
    _check_off_policy(off_policy, sampling_logprobs, dual_clip, ratio_level)
    _check_coefficients(kl_coef, ref_logprobs, entropy_coef, entropy)
    _check_shapes(
        logprobs,
        advantages,
        old_logprobs=old_logprobs,
        mask=mask,
        ref_logprobs=ref_logprobs,
        sampling_logprobs=sampling_logprobs,
        entropy=entropy,
        token_advantages=token_advantages,
    )
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    logprobs = logprobs.to(dtype)  # [B, T]
    old_logprobs = old_logprobs.detach().to(dtype)  # [B, T]
    mask = mask != 0  # [B, T] bool
    advantages = advantages.detach().to(dtype)[:, None]  # [B, 1]
    if token_advantages is not None:
        advantages = advantages + token_advantages.detach().to(dtype)  # [B, T]
    aggregate = partial(_aggregate, mask=mask, aggregation=aggregation, max_length=max_length or logprobs.shape[1])

    ratio = _ratio(logprobs, old_logprobs, mask, ratio_level, per_token=token_advantages is not None)  # [B, T]
    if off_policy == "cispo":
        per_token, stats = _cispo(ratio, logprobs, advantages, mask, 1 + clip_high)  # [B, T]
    else:
        per_token = _clipped_surrogate(ratio, advantages, clip_low, clip_high)  # [B, T]
        stats = _ratio_stats(ratio, advantages, mask, clip_low, clip_high)
    if dual_clip is not None:
        per_token, stats["dual_clip_fraction"] = _dual_clip(per_token, advantages, mask, dual_clip)
    if sampling_logprobs is not None:
        sampling = sampling_logprobs.to(dtype)
        weight, weight_stats = importance_weight(old_logprobs, sampling, mask, off_policy, is_cap, is_floor)
        per_token = per_token * weight  # [B, T]
        stats.update(weight_stats)
    loss = aggregate(per_token)
    stats["loss/policy"] = loss.detach()
    if ref_logprobs is not None:
        kl = aggregate(_kl_per_token(logprobs, ref_logprobs.detach().to(dtype), mask, kl_estimator))
        stats["kl"] = kl.detach()
        if kl_coef > 0:
            loss = loss + kl_coef * kl
    if entropy is not None:
        mean_entropy = aggregate(entropy.to(dtype))
        stats["entropy"] = mean_entropy.detach()
        if entropy_coef > 0:
            loss = loss - entropy_coef * mean_entropy
    return loss, _to_floats(stats)


def _check_choice(name: str, value: str, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise ValueError(f"policy_loss: unknown {name} {value!r}; valid values: {', '.join(valid)}")


def _check_options(
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
    ratio_level: str,
    aggregation: str,
    max_length: int | None,
    kl_estimator: str,
    is_cap: float,
) -> None:
    _check_choice("ratio_level", ratio_level, RATIO_LEVELS)
    _check_choice("aggregation", aggregation, AGGREGATIONS)
    _check_choice("kl_estimator", kl_estimator, KL_ESTIMATORS)
    if clip_low < 0 or clip_high < 0:
        raise ValueError(f"policy_loss: clip_low and clip_high must be >= 0, got {clip_low} and {clip_high}")
    if dual_clip is not None and not dual_clip > 1:
        raise ValueError(f"policy_loss: dual_clip must be > 1 (typically 3), got {dual_clip}; pass None to disable")
    if max_length is not None and max_length < 1:
        raise ValueError(f"policy_loss: max_length must be >= 1 (the max completion length), got {max_length}")
    if not is_cap > 0:
        raise ValueError(f"policy_loss: is_cap must be > 0, got {is_cap}; to disable TIS pass no sampling_logprobs")


def _check_off_policy(
    off_policy: str, sampling_logprobs: Tensor | None, dual_clip: float | None, ratio_level: str
) -> None:
    _check_choice("off_policy", off_policy, OFF_POLICY)
    if off_policy != "cispo":
        return
    if sampling_logprobs is not None:
        raise ValueError(
            "policy_loss: cispo weights each token by its ratio to old_logprobs itself; pass the sampling policy's "
            "log-probs as old_logprobs, not sampling_logprobs"
        )
    if dual_clip is not None or ratio_level != "token":
        raise ValueError("policy_loss: cispo clips a per-token weight: it takes no dual_clip and ratio_level token")


def _check_coefficients(
    kl_coef: float, ref_logprobs: Tensor | None, entropy_coef: float, entropy: Tensor | None
) -> None:
    if kl_coef < 0 or entropy_coef < 0:
        raise ValueError(f"policy_loss: kl_coef and entropy_coef must be >= 0, got {kl_coef} and {entropy_coef}")
    if kl_coef > 0 and ref_logprobs is None:
        raise ValueError(f"policy_loss: kl_coef={kl_coef} needs ref_logprobs; pass them or set kl_coef=0")
    if entropy_coef > 0 and entropy is None:
        raise ValueError(f"policy_loss: entropy_coef={entropy_coef} needs the entropy tensor; pass it or set 0")


def _check_shapes(logprobs: Tensor, advantages: Tensor, **per_token: Tensor | None) -> None:
    if logprobs.dim() != 2 or logprobs.shape[0] == 0:
        raise ValueError(f"policy_loss: logprobs must be [B, T] with B >= 1, got shape {tuple(logprobs.shape)}")
    if advantages.shape != logprobs.shape[:1]:
        raise ValueError(
            f"policy_loss: advantages has shape {tuple(advantages.shape)} but logprobs has shape "
            f"{tuple(logprobs.shape)}; pass one advantage per sequence, shape [B] = ({logprobs.shape[0]},)"
        )
    for name, tensor in per_token.items():
        if tensor is not None and tensor.shape != logprobs.shape:
            raise ValueError(
                f"policy_loss: {name} has shape {tuple(tensor.shape)} but logprobs has shape "
                f"{tuple(logprobs.shape)}; every per-token input must be [B, T] like logprobs"
            )


def _ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor, ratio_level: str, per_token: bool) -> Tensor:
    """pi / pi_old per token, or GSPO's exp(masked mean log-ratio) repeated over the sequence; with `per_token`
    GSPO-token's: that value, with each token's gradient its own log-prob's. [B, T]"""
    log_ratio = torch.where(mask, logprobs - old_logprobs, 0.0)  # [B, T]
    if ratio_level == "sequence":
        sequence_log_ratio = log_ratio.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)  # [B, 1]
        if per_token:
            return (sequence_log_ratio.detach() + log_ratio - log_ratio.detach()).exp()
        log_ratio = sequence_log_ratio.expand_as(log_ratio)  # [B, T]
    return log_ratio.exp()


def _clipped_surrogate(ratio: Tensor, advantages: Tensor, clip_low: float, clip_high: float) -> Tensor:
    """max(-A * r, -A * clip(r, 1 - clip_low, 1 + clip_high)) per token. [B, T]"""
    unclipped = -advantages * ratio  # [B, T]
    clipped = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)  # [B, T]
    return torch.maximum(unclipped, clipped)


def _cispo(
    ratio: Tensor, logprobs: Tensor, advantages: Tensor, mask: Tensor, cap: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO's -sg(min(r, cap)) * A * log pi per token, and its statistics: the ratio's, with the capped tokens as
    its clip fraction. [B, T]"""
    weight = ratio.detach().clamp(max=cap)  # [B, T]
    capped = ratio.detach() > cap  # [B, T]
    per_token = -weight * advantages * torch.where(mask, logprobs, 0.0)  # [B, T]
    stats = _ratio_stats(ratio, advantages, mask, cap - 1, cap - 1)
    stats.update({
        "clip_fraction/low": torch.zeros((), device=ratio.device),
        "clip_fraction/high": _token_mean(capped, mask),
        "clip_fraction": _token_mean(capped, mask),
        "is_weight/mean": _token_mean(weight, mask),
        "is_weight/capped": _token_mean(capped, mask),
    })  # fmt: skip
    return per_token, stats


def _dual_clip(per_token: Tensor, advantages: Tensor, mask: Tensor, dual_clip: float) -> tuple[Tensor, Tensor]:
    """Cap negative-advantage losses at -A * c (no gradient where capped); also the capped fraction."""
    cap = -advantages * dual_clip  # [B, 1] or [B, T]
    capped = (advantages < 0) & (per_token > cap)  # [B, T]
    return torch.where(capped, cap, per_token), _token_mean(capped, mask)


def _kl_per_token(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor, estimator: str) -> Tensor:
    """Schulman's estimator of KL(pi || pi_ref) per token, with d = log pi_ref - log pi. [B, T]"""
    log_ref_ratio = torch.where(mask, ref_logprobs - logprobs, 0.0)  # [B, T]
    if estimator == "k1":
        return -log_ref_ratio
    if estimator == "k2":
        return 0.5 * log_ref_ratio.square()
    return log_ref_ratio.exp() - log_ref_ratio - 1


def _aggregate(per_token: Tensor, *, mask: Tensor, aggregation: str, max_length: int) -> Tensor:
    """One scalar from per-token values [B, T], counting only masked tokens."""
    masked = torch.where(mask, per_token, 0.0)  # [B, T]
    if aggregation == "seq-mean-token-mean":
        per_sequence = masked.sum(-1) / mask.sum(-1).clamp(min=1)  # [B]
        return per_sequence.mean()
    if aggregation == "token-mean":
        return masked.sum() / mask.sum().clamp(min=1)
    return masked.sum() / (mask.shape[0] * max_length)  # seq-mean-token-sum-norm


def _token_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``values`` [B, T] over the masked tokens of the whole batch (0 when there are none), detached."""
    values = values.detach() if values.is_floating_point() else values.float()
    return torch.where(mask, values, 0.0).sum() / mask.sum().clamp(min=1)


@torch.no_grad()
def _ratio_stats(
    ratio: Tensor, advantages: Tensor, mask: Tensor, clip_low: float, clip_high: float
) -> dict[str, Tensor]:
    """Clip fractions (where the clipped branch is active), ratio mean / max over masked tokens, and the largest
    spread (max - min) of the ratio within one sequence: 0 exactly when the ratio is per sequence."""
    clipped_low = (ratio < 1 - clip_low) & (advantages < 0)  # [B, T]
    clipped_high = (ratio > 1 + clip_high) & (advantages > 0)  # [B, T]
    highest = torch.where(mask, ratio, -torch.inf).amax(-1)  # [B]
    lowest = torch.where(mask, ratio, torch.inf).amin(-1)  # [B]
    spread = torch.where(mask.any(-1), highest - lowest, 0.0)  # [B]; 0 for a sequence with no masked token
    return {
        "clip_fraction/low": _token_mean(clipped_low, mask),
        "clip_fraction/high": _token_mean(clipped_high, mask),
        "clip_fraction": _token_mean(clipped_low | clipped_high, mask),
        "ratio/mean": _token_mean(ratio, mask),
        "ratio/max": torch.where(mask, ratio, 0.0).max(),
        "ratio/sequence_spread": spread.max(),
    }


def _to_floats(stats: dict[str, Tensor]) -> dict[str, float]:
    """Scalar tensors to Python floats with one device sync."""
    values = torch.stack([value.detach().to(torch.float64) for value in stats.values()]).tolist()
    return dict(zip(stats.keys(), values, strict=True))

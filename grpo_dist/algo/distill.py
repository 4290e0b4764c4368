"""On-policy distillation's per-token advantage (the reverse KL to a teacher on the student's own samples, as in
GKD, arXiv 2306.13649, and MiniLLM, arXiv 2306.08543, taken one sampled token at a time).

At each token y_t the student sampled, log pi_student(y_t) - log pi_teacher(y_t) is a one-sample estimate of the
reverse KL(pi_student || pi_teacher) at that position. Its negative, times a coefficient, is the token's advantage:
the policy gradient then lowers the student's probability of the tokens the teacher finds less likely than it does,
and raises it where the teacher finds them likelier.

`group_baseline` lowers the estimate's variance without moving its expectation: from each token's advantage it
subtracts the mean advantage of the other completions of its group (the same prompt) at the same position of their
completions (leave-one-out, as RLOO does for rewards, arXiv 2402.14740). A student far from its teacher samples
mostly tokens the teacher rejects, each with a large negative advantage; measured against its group's, a token is
judged by how much better or worse it is than the group's other choices there. Torch only."""

from __future__ import annotations

import torch
from torch import Tensor


def distill_advantages(student_logprobs: Tensor, teacher_logprobs: Tensor, mask: Tensor, coef: float) -> Tensor:
    """[B, T] coef x (teacher - student log-prob) on the tokens where `mask` is nonzero, 0 elsewhere (padding,
    prompt, observation tokens, completions the teacher did not score). All inputs [B, T]; detached."""
    if not student_logprobs.shape == teacher_logprobs.shape == mask.shape:
        raise ValueError(
            f"distill_advantages: student {tuple(student_logprobs.shape)}, teacher {tuple(teacher_logprobs.shape)} "
            f"and mask {tuple(mask.shape)} must all be [B, T]"
        )
    gap = torch.where(mask != 0, teacher_logprobs.detach() - student_logprobs.detach(), 0.0)
    return coef * gap


def reverse_kl(student_logprobs: Tensor, teacher_logprobs: Tensor, mask: Tensor) -> float:
    """The mean over the tokens where `mask` is nonzero of student - teacher log-prob: the reverse KL per token the
    samples estimate (NaN when no token counts)."""
    counted = mask != 0
    if not counted.any():
        return float("nan")
    return float(torch.where(counted, student_logprobs - teacher_logprobs, 0.0).sum() / counted.sum())


def group_baseline(advantages: Tensor, mask: Tensor, groups: Tensor, starts: Tensor) -> Tensor:
    """[B, T] `advantages` less, at each counted token, the mean of the other rows' of the same group at the same
    completion position (the token's position less its row's `starts`); a token no other row of its group has a
    counted token beside keeps its advantage. `mask`: [B, T] the counted tokens; `groups`, `starts`: [B] each row's
    group (its prompt) and where its completion starts."""
    rows, length = advantages.shape
    counted = mask != 0
    position = torch.arange(length)[None, :] - starts[:, None]  # [B, T] position in the completion
    key = (groups[:, None] * length + position.clamp(min=0))[counted]  # [N] one slot per (group, position)
    slots = int(groups.max()) * length + length if rows else 0
    sums = torch.zeros(slots, dtype=advantages.dtype).index_add_(0, key, advantages[counted])
    counts = torch.zeros(slots, dtype=advantages.dtype).index_add_(0, key, torch.ones_like(advantages[counted]))
    others = counts[key] - 1
    baseline = torch.where(others > 0, (sums[key] - advantages[counted]) / others.clamp(min=1), 0.0)
    found = torch.zeros_like(advantages)
    found[counted] = advantages[counted] - baseline
    return found

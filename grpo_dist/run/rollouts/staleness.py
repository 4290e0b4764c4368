"""Bounded staleness: every trained sample was drawn by weights at most k = `rollout.max_staleness` updates older
than the learner's when it trains on it.

`sync_due` says when the generators must take the learner's weights for the next batch to keep the bound;
`bound_staleness` enforces it per sample (a group holding an older completion is dropped whole and counted) and
reports it. A completion whose tokens span versions (an in-flight update came while it was generated) counts as
old as its oldest token. The learner corrects for the older sampling policy (`algorithm.old_logprobs`,
`algorithm.is_cap`).
"""

from __future__ import annotations

import torch

from grpo_dist.run.rollouts.rollout import Rollout


def sync_due(max_staleness: int, generator_version: int, learner_version: int) -> bool:
    """Whether the generators (holding `generator_version`) need the learner's weights now, so that the next batch
    they generate is at most `max_staleness` updates older than the learner when it trains on it (one update later
    when it is drawn ahead, as it is for k >= 1)."""
    lead = 1 if max_staleness >= 1 else 0
    return generator_version < learner_version + lead - max_staleness


def bound_staleness(rollout: Rollout, learner_version: int, k: int) -> tuple[Rollout, dict[str, float]]:
    """Drop every group holding a completion sampled more than k versions before `learner_version`; the kept
    completions' staleness (mean, max) and how many were dropped."""
    too_old = {c.prompt_index for c in rollout.completions if learner_version - c.weight_version > k}
    kept = rollout.select_groups([index not in too_old for index in range(len(rollout.prompts))])
    kept_staleness = torch.tensor([learner_version - c.weight_version for c in kept.completions], dtype=torch.float)
    metrics = {
        "staleness/dropped": float(len(rollout.completions) - len(kept.completions)),
        "staleness/spanning": float(sum(c.newest_weight_version is not None for c in kept.completions)),
    }
    if kept.completions:
        metrics.update({"staleness/mean": kept_staleness.mean().item(), "staleness/max": kept_staleness.max().item()})
    return kept, metrics

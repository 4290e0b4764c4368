"""Rollouts built by hand for the tests of `grpo_dist.run.rollouts`."""

from __future__ import annotations

from grpo_dist.data import PromptRecord
from grpo_dist.run.rollouts import Rollout
from grpo_dist.types import Completion, Score


def rollout_of(versions: list[list[int | tuple[int, int]]]) -> Rollout:
    """One group per inner list, one completion per entry in it: a version, or (oldest, newest) for a completion
    whose tokens were sampled by several (an in-flight update came while it was generated)."""
    completions = [
        Completion(index, [1], [2], "2", [-0.5], "stop", *(version if isinstance(version, tuple) else (version,)))
        for index, group in enumerate(versions)
        for version in group
    ]
    prompts = [PromptRecord(f"p{index}", [1], {}) for index in range(len(versions))]
    return Rollout(prompts, completions, [Score(1.0, [1.0]) for _ in completions])

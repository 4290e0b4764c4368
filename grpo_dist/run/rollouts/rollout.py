"""A rollout batch: prompts, their groups of completions, and the completions' scores."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from grpo_dist.data import PromptRecord
from grpo_dist.types import Completion, Score


@dataclass
class Rollout:
    """P prompts with G completions each; completion i belongs to prompt `completions[i].prompt_index`."""

    prompts: list[PromptRecord] = field(default_factory=list)
    """[P] the prompts, in group order."""
    completions: list[Completion] = field(default_factory=list)
    """[P*G] completions, G consecutive ones per prompt."""
    scores: list[Score] = field(default_factory=list)
    """[P*G] the score of each completion."""

    def per_function(self) -> torch.Tensor:
        """[P*G, F] each reward function's value (NaN where it failed); a whole row NaN where the completion is
        unscored, whatever its values (a sum out of range, a failed trajectory), so none enters an advantage."""
        rows = [
            score.per_function if math.isfinite(score.total) else [math.nan] * len(score.per_function)
            for score in self.scores
        ]
        return torch.tensor(rows, dtype=torch.float)

    def lengths(self) -> torch.Tensor:
        """[P*G] completion lengths: the tokens the model sampled (of a trajectory, not its observations)."""
        return torch.tensor([c.sampled_tokens for c in self.completions], dtype=torch.float)

    def images(self) -> list[tuple[bytes, ...]] | None:
        """[P*G] each completion's prompt's images (what the learner's forward reads with it); None when no prompt
        has any."""
        if not any(prompt.images for prompt in self.prompts):
            return None
        return [self.prompts[completion.prompt_index].images for completion in self.completions]

    def select_groups(self, keep: list[bool]) -> Rollout:
        """The rollout restricted to the groups whose flag is set, prompts renumbered."""
        new_index = {}
        for old, flag in enumerate(keep):
            if flag:
                new_index[old] = len(new_index)
        pairs = [(c, s) for c, s in zip(self.completions, self.scores, strict=True) if c.prompt_index in new_index]
        return Rollout(
            prompts=[p for p, flag in zip(self.prompts, keep, strict=True) if flag],
            completions=[replace(c, prompt_index=new_index[c.prompt_index]) for c, _ in pairs],
            scores=[s for _, s in pairs],
        )

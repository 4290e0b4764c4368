"""Batch assembly: padding and masks for the learner, and a rollout's group bookkeeping. No actors."""

from __future__ import annotations

import pytest
import torch

from grpo_dist.algo.batch import collate
from grpo_dist.data import PromptRecord
from grpo_dist.run.rollouts import Rollout
from grpo_dist.types import Completion, Score


def completion(prompt_index: int, tokens: list[int], finish_reason: str = "stop", version: int = 0) -> Completion:
    return Completion(prompt_index, [1, 2], tokens, "", [-0.5] * len(tokens), finish_reason, version)


def test_collate_pads_right_and_marks_completion_tokens():
    batch = collate([completion(0, [7]), completion(0, [8, 9, 10])], torch.tensor([1.0, -1.0]), pad_token_id=0)
    # Rows are prompt [1, 2] + completion, right-padded to the longest (2 + 3 = 5 tokens).
    assert batch.input_ids.tolist() == [[1, 2, 7, 0, 0], [1, 2, 8, 9, 10]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    assert batch.completion_mask.tolist() == [[0, 0, 1, 0, 0], [0, 0, 1, 1, 1]]
    assert batch.sampling_logprobs.tolist() == [[0, 0, -0.5, 0, 0], [0, 0, -0.5, -0.5, -0.5]]


@pytest.mark.parametrize("mask_truncated, expected", [(False, 3.0), (True, 1.0)], ids=["kept", "masked"])
def test_truncated_completions_can_be_masked_out(mask_truncated, expected):
    completions = [completion(0, [7]), completion(0, [8, 9], finish_reason="length")]
    batch = collate(completions, torch.zeros(2), pad_token_id=0, mask_truncated=mask_truncated)
    assert batch.completion_mask.sum().item() == expected


def test_collate_rejects_mismatched_advantages():
    with pytest.raises(ValueError, match="2 completions but 3 advantages"):
        collate([completion(0, [7]), completion(0, [8])], torch.zeros(3), pad_token_id=0)


def rollout_of(groups: int, group_size: int = 2) -> Rollout:
    prompts = [PromptRecord(text=f"p{g}", token_ids=[g], fields={}, index=g) for g in range(groups)]
    completions = [completion(g, [g, s]) for g in range(groups) for s in range(group_size)]
    scores = [Score(float(g), [float(g)]) for g in range(groups) for _ in range(group_size)]
    return Rollout(prompts, completions, scores)


def test_selecting_groups_renumbers_prompts():
    selected = rollout_of(3).select_groups([True, False, True])
    assert [p.text for p in selected.prompts] == ["p0", "p2"]
    assert [c.prompt_index for c in selected.completions] == [0, 0, 1, 1]
    assert [c.token_ids[0] for c in selected.completions] == [0, 0, 2, 2]

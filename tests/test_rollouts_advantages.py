"""A batch's shaped rewards and advantages (`grpo_dist.run.rollouts.advantages`), by hand. No actors."""

from __future__ import annotations

import math

import torch
from conftest import small_config

from grpo_dist.config import validate_config
from grpo_dist.data import PromptRecord
from grpo_dist.run.rollouts import Rollout, compute_advantages
from grpo_dist.types import Completion, Score


def completion(prompt_index: int, tokens: list[int], finish_reason: str = "stop") -> Completion:
    return Completion(prompt_index, [1, 2], tokens, "", [-0.5] * len(tokens), finish_reason, 0)


def test_soft_overlong_penalty_is_added_before_advantages(tmp_path):
    overlong = {"overlong": "soft_penalty", "overlong_buffer": 2, "overlong_penalty": 1.0}
    raw = small_config(tmp_path, rollout={"group_size": 2, "max_new_tokens": 4}, algorithm=overlong)
    raw["reward"]["functions"] = [{"name": "math_answer", "weight": 1.0}]
    cfg = validate_config(raw)
    completions = [completion(0, [5, 2]), completion(0, [5, 6, 7, 8], finish_reason="length")]
    rollout = Rollout([PromptRecord("p", [1], {}, 0)], completions, [Score(1.0, [1.0]), Score(1.0, [1.0])])
    rewards, advantages = compute_advantages(cfg, rollout)
    # Lengths 2 and 4 with max 4, buffer 2: penalties 0 and ((4 - 2) - 4) / 2 * 1 = -1, so rewards 1 and 0.
    assert rewards.tolist() == [1.0, 0.0]
    # grpo: mean 0.5, sample std 0.7071 -> advantages +0.7071, -0.7071.
    torch.testing.assert_close(advantages, torch.tensor([0.7071, -0.7071]), atol=1e-4, rtol=0)


def test_reward_functions_are_weighted_before_the_group_baseline(tmp_path):
    raw = small_config(tmp_path, rollout={"group_size": 2})
    raw["reward"]["functions"] = [{"name": "math_answer", "weight": 1.0}, {"name": "math_answer", "weight": 0.5}]
    cfg = validate_config(raw)
    prompts = [PromptRecord(f"p{g}", [1], {}, g) for g in range(2)]
    completions = [completion(g, [5]) for g in range(2) for _ in range(2)]
    values = [[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [1.0, 1.0]]  # per completion, per function
    rollout = Rollout(prompts, completions, [Score(sum(v), v) for v in values])
    rewards, advantages = compute_advantages(cfg, rollout)
    # Shaped: 1*1 + 0.5*0 = 1, 1*0 + 0.5*1 = 0.5, then 1.5 and 1.5.
    assert rewards.tolist() == [1.0, 0.5, 1.5, 1.5]
    # Group 0: mean 0.75, sample std 0.3536 -> +/-0.7071; group 1: equal rewards -> 0 (not NaN).
    torch.testing.assert_close(advantages, torch.tensor([0.7071, -0.7071, 0.0, 0.0]), atol=1e-4, rtol=0)


def test_unscored_completions_of_any_value_are_left_out_of_their_groups(tmp_path):
    """What the reward worker returns for completions out of range: a total of NaN, with per-function values that
    are finite in float64 but not in a float32 tensor (1e308, 3.5e38), or infinite. None may reach the advantages:
    each such row is NaN whole, its advantage 0, and the rest of its group keeps its own baseline."""
    raw = small_config(tmp_path, rollout={"group_size": 4})
    raw["reward"]["functions"] = [{"name": "math_answer", "weight": 1.0}, {"name": "math_answer", "weight": 1.0}]
    cfg = validate_config(raw)
    prompts = [PromptRecord(f"p{g}", [1], {}, g) for g in range(3)]
    completions = [completion(g, [5]) for g in range(3) for _ in range(4)]
    nan, inf = math.nan, math.inf
    scores = [
        Score(nan, [1e308, 1e308]), Score(nan, [3.5e38, 0.0]), Score(1.0, [1.0, 0.0]), Score(0.0, [0.0, 0.0]),
        Score(nan, [inf, 1.0]), Score(nan, [-inf, 1.0]), Score(nan, [nan, 1.0]), Score(2.0, [1.0, 1.0]),
        Score(1e30, [1e30, 0.0]), Score(-1e30, [0.0, -1e30]), Score(nan, [1e31, -1e31]), Score(0.0, [0.0, 0.0]),
    ]  # fmt: skip
    rewards, advantages = compute_advantages(cfg, Rollout(prompts, completions, scores))
    # Group 0: valid [1, 0], mean 0.5, sample std 0.7071 -> +0.7071, -0.7071; the two unscored 0.
    # Group 1: one valid reward (2): no baseline, all 0.
    # Group 2: valid [1e30, -1e30, 0], mean 0, squares 2e60 (beyond float32, not float64), sample std
    # sqrt(2e60 / 2) = 1e30 -> [1, -1, 0] for the valid ones, 0 for the unscored one.
    unscored = [True, True, False, False, True, True, True, False, False, False, True, False]
    assert torch.isnan(rewards).tolist() == unscored
    expected = [0.0, 0.0, 0.7071, -0.7071, 0.0, 0.0, 0.0, 0.0, 1.0, -1.0, 0.0, 0.0]
    torch.testing.assert_close(advantages, torch.tensor(expected), atol=1e-4, rtol=0)

"""Reward functions: built-ins, lookup by name or dotted path, and fault-tolerant scoring of one completion.

Also the code and math verdicts (`code`, `verdicts`) and the judge's prompt (`judge_prompt`). May import:
`transports`, `data`, `models`, `sandbox`, `storage` and below (never `agents` or `cluster`)."""

from grpo_dist.rewards.builtin import boxed_format, exact_answer, math_answer, number_format, regex_format
from grpo_dist.rewards.registry import (
    BUILTIN_REWARDS,
    REWARD_LIMIT,
    RewardFn,
    RewardSpec,
    combine,
    resolve_reward,
    score_one,
    weighted_sum,
)
from grpo_dist.types import Unscorable

__all__ = [
    "BUILTIN_REWARDS",
    "REWARD_LIMIT",
    "RewardFn",
    "RewardSpec",
    "Unscorable",
    "boxed_format",
    "combine",
    "exact_answer",
    "math_answer",
    "number_format",
    "regex_format",
    "resolve_reward",
    "score_one",
    "weighted_sum",
]

"""Hypothesis strategies shared by the algorithm tests: rewards laid out in contiguous groups."""

from __future__ import annotations

import math

import torch
from hypothesis import strategies as st

NAN = math.nan

# Rewards on a grid of 0.5 in [-5, 5]: a group of G <= 8 that is not constant has sample std >= 0.5 / sqrt(8) = 0.18
# (one member off by 0.5: variance 0.25 / G), so eps = 1e-6 stays negligible next to it even after scaling by 0.1.
grid_reward = st.integers(-10, 10).map(lambda step: step * 0.5)


def tensor(values: list[float] | list[list[float]]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def reward_element(allow_nan: bool) -> st.SearchStrategy[float]:
    """One reward from the grid, or NaN (an unscored completion) when allowed."""
    return st.one_of(grid_reward, st.just(NAN)) if allow_nan else grid_reward


@st.composite
def grouped_rewards(draw: st.DrawFn, allow_nan: bool, min_group_size: int = 2) -> tuple[torch.Tensor, int]:
    """(rewards [num_groups * group_size], group_size) with 1 to 6 groups of min_group_size to 8."""
    group_size = draw(st.integers(min_group_size, 8))
    num_groups = draw(st.integers(1, 6))
    size = group_size * num_groups
    return tensor(draw(st.lists(reward_element(allow_nan), min_size=size, max_size=size))), group_size

"""overlong_penalty, informative_groups and multi_reward_advantages against hand-computed values, and properties."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import NAN, grouped_rewards, reward_element, tensor

from grpo_dist.algo import (
    COMBINES,
    ESTIMATORS,
    STD_MODES,
    group_advantages,
    informative_groups,
    multi_reward_advantages,
    overlong_penalty,
)

SQRT2 = 2**0.5
SQRT3 = 3**0.5


# ---------------------------------------------------------------------------------------------------------------------
# overlong_penalty


# max_length = 10, buffer = 4, factor = 2: no penalty up to 10 - 4 = 6 tokens, then (6 - L) / 4 * 2, -2 past 10.
@pytest.mark.parametrize(
    ("length", "expected"),
    [
        pytest.param(0, 0.0, id="empty"),
        pytest.param(5, 0.0, id="before_buffer"),
        pytest.param(6, 0.0, id="exactly_max_minus_buffer"),
        pytest.param(7, -0.5, id="first_buffer_token"),  # (6 - 7) / 4 * 2 = -0.5
        pytest.param(9, -1.5, id="inside_buffer"),  # (6 - 9) / 4 * 2 = -1.5
        pytest.param(10, -2.0, id="exactly_max_length"),  # (6 - 10) / 4 * 2 = -2
        pytest.param(11, -2.0, id="one_past_max_length"),
        pytest.param(1000, -2.0, id="far_past_max_length"),
    ],
)
def test_overlong_penalty_boundaries(length: int, expected: float) -> None:
    penalty = overlong_penalty(torch.tensor([length]), max_length=10, buffer=4, factor=2.0)
    torch.testing.assert_close(penalty, torch.tensor([expected]))


def test_overlong_penalty_batch_and_default_factor() -> None:
    # max_length = 8, buffer = 8: the ramp starts at 0 tokens; (0 - L) / 8 = [0, -0.25, -0.5, -1, -1]
    penalty = overlong_penalty(torch.tensor([0, 2, 4, 8, 9]), max_length=8, buffer=8)
    torch.testing.assert_close(penalty, torch.tensor([0.0, -0.25, -0.5, -1.0, -1.0]))


@pytest.mark.parametrize(
    ("lengths", "dtype"),
    [
        pytest.param(torch.tensor([3, 12]), torch.get_default_dtype(), id="int_lengths_default_float"),
        pytest.param(torch.tensor([3.0, 12.0], dtype=torch.float64), torch.float64, id="float64_kept"),
    ],
)
def test_overlong_penalty_dtype(lengths: torch.Tensor, dtype: torch.dtype) -> None:
    assert overlong_penalty(lengths, max_length=10, buffer=4).dtype == dtype


@pytest.mark.parametrize(
    ("lengths", "max_length", "buffer", "factor", "fragment"),
    [
        pytest.param(torch.tensor([1]), 10, 0, 1.0, "need 0 < buffer <= max_length, got buffer=0", id="buffer_zero"),
        pytest.param(torch.tensor([1]), 10, 11, 1.0, "got buffer=11, max_length=10", id="buffer_past_max"),
        pytest.param(torch.tensor([1]), 10, 4, -1.0, "factor must be >= 0", id="negative_factor"),
        pytest.param(torch.tensor([1]), 10, 4, NAN, "factor must be >= 0", id="nan_factor"),
        pytest.param(torch.zeros(2, 2), 10, 4, 1.0, "must be 1-D [B], got shape (2, 2)", id="two_dims"),
        pytest.param(torch.tensor([-1, 3]), 10, 4, 1.0, "lengths must be >= 0, got minimum -1", id="negative_length"),
        pytest.param(torch.tensor([NAN]), 10, 4, 1.0, "lengths hold NaN or inf", id="nan_length"),
    ],
)
def test_overlong_penalty_bad_arguments(
    lengths: torch.Tensor, max_length: int, buffer: int, factor: float, fragment: str
) -> None:
    with pytest.raises(ValueError, match="overlong_penalty") as error:
        overlong_penalty(lengths, max_length, buffer, factor)
    assert fragment in str(error.value)


@st.composite
def _overlong_case(draw: st.DrawFn) -> tuple[torch.Tensor, int, int, float]:
    max_length = draw(st.integers(1, 64))
    buffer = draw(st.integers(1, max_length))
    factor = draw(st.floats(0.0, 5.0))
    lengths = draw(st.lists(st.integers(0, 100), min_size=1, max_size=20))
    return torch.tensor(sorted(lengths)), max_length, buffer, factor


@settings(max_examples=60, deadline=None)
@given(_overlong_case())
def test_property_overlong_penalty_bounded_and_non_increasing(case: tuple[torch.Tensor, int, int, float]) -> None:
    lengths, max_length, buffer, factor = case
    penalty = overlong_penalty(lengths, max_length, buffer, factor)  # lengths sorted ascending
    assert (penalty <= 0).all() and (penalty >= -factor).all()
    assert (penalty.diff() <= 0).all()
    before_buffer = lengths <= max_length - buffer
    assert torch.equal(penalty[before_buffer], torch.zeros(int(before_buffer.sum())))
    torch.testing.assert_close(penalty[lengths >= max_length], torch.full_like(penalty[lengths >= max_length], -factor))


# ---------------------------------------------------------------------------------------------------------------------
# informative_groups


@pytest.mark.parametrize(
    ("rewards", "group_size", "expected"),
    [
        pytest.param([1.0, 1.0, 1.0, 0.0, 1.0, 0.0], 3, [False, True], id="equal_then_mixed"),
        pytest.param([0.1, 0.1, 0.1, 0.2, 0.1, 0.1], 3, [False, True], id="inexact_floats"),
        pytest.param([NAN, 2.0, NAN, NAN, 2.0, 3.0], 3, [False, True], id="one_valid_vs_two_valid_differing"),
        pytest.param([NAN, 2.0, 2.0], 3, [False], id="valid_equal_with_nan"),
        pytest.param([NAN, NAN, NAN, NAN], 2, [False, False], id="all_nan"),
        pytest.param([1.0, 5.0], 1, [False, False], id="group_size_one"),
    ],
)
def test_informative_groups(rewards: list[float], group_size: int, expected: list[bool]) -> None:
    assert informative_groups(tensor(rewards), group_size).tolist() == expected


@pytest.mark.parametrize(
    ("rewards", "group_size", "fragment"),
    [
        pytest.param(torch.zeros(5), 2, "5 rewards is not a multiple of group_size=2", id="not_divisible"),
        pytest.param(torch.zeros(4), 0, "group_size must be an int >= 1, got 0", id="group_size_zero"),
        pytest.param(torch.zeros(4), True, "group_size must be an int >= 1, got True", id="group_size_bool"),
        pytest.param(torch.zeros(2, 2), 2, "must be 1-D [num_groups * group_size], got shape (2, 2)", id="two_dims"),
    ],
)
def test_informative_groups_bad_arguments(rewards: torch.Tensor, group_size: int, fragment: str) -> None:
    with pytest.raises(ValueError, match="informative_groups") as error:
        informative_groups(rewards, group_size)
    assert fragment in str(error.value)


@settings(max_examples=60, deadline=None)
@given(st.one_of(grouped_rewards(allow_nan=False, min_group_size=1), grouped_rewards(allow_nan=True, min_group_size=1)))
def test_property_informative_exactly_where_grpo_not_all_zero(data: tuple[torch.Tensor, int]) -> None:
    rewards, group_size = data
    all_zero = group_advantages(rewards, group_size, "grpo").reshape(-1, group_size).eq(0).all(-1)  # [N]
    assert torch.equal(informative_groups(rewards, group_size), ~all_zero)


# ---------------------------------------------------------------------------------------------------------------------
# multi_reward_advantages

# One group of 4, two functions: correctness c = [1, 0, 1, 0] and format f = [0, 10, 10, 0].
# sum_then_normalize, weights [1, 1]: r = [1, 10, 11, 0], mean 5.5, deviations [-4.5, 4.5, 5.5, -5.5],
#   squares 20.25 + 20.25 + 30.25 + 30.25 = 101, sample std sqrt(101 / 3) = 5.802298
#   -> advantages [-0.775555, 0.775555, 0.947900, -0.947900]: format's scale decides the sign of row 1 and row 0.
# normalize_then_sum: c has mean 0.5, deviations +-0.5, sample std sqrt(4 * 0.25 / 3) = 1 / sqrt(3)
#   -> c_adv = sqrt(3) / 2 * [1, -1, 1, -1]; f has mean 5, deviations +-5, std sqrt(100 / 3) = 10 / sqrt(3)
#   -> f_adv = sqrt(3) / 2 * [-1, 1, 1, -1]; sum with weights [1, 1] = [0, 0, sqrt(3), -sqrt(3)];
#   with weights [2, 0.5]: sqrt(3) / 2 * [2 - 0.5, -2 + 0.5, 2 + 0.5, -2 - 0.5] = sqrt(3) / 2 * [1.5, -1.5, 2.5, -2.5].
CORRECT_AND_FORMAT = [[1.0, 0.0], [0.0, 10.0], [1.0, 10.0], [0.0, 0.0]]


@pytest.mark.parametrize(
    ("combine", "weights", "expected_rewards", "expected_advantages"),
    [
        pytest.param(
            "sum_then_normalize",
            [1.0, 1.0],
            [1.0, 10.0, 11.0, 0.0],
            [x / (101 / 3) ** 0.5 for x in [-4.5, 4.5, 5.5, -5.5]],
            id="sum_then_normalize",
        ),
        pytest.param(
            "normalize_then_sum", [1.0, 1.0], [1.0, 10.0, 11.0, 0.0], [0.0, 0.0, SQRT3, -SQRT3], id="normalize_then_sum"
        ),
        pytest.param(
            "normalize_then_sum",
            torch.tensor([2.0, 0.5]),
            [2.0, 5.0, 7.0, 0.0],  # 2 * c + 0.5 * f
            [SQRT3 / 2 * x for x in [1.5, -1.5, 2.5, -2.5]],
            id="normalize_then_sum_weighted",
        ),
    ],
)
def test_multi_reward_matches_hand_values(
    combine: str,
    weights: list[float] | torch.Tensor,
    expected_rewards: list[float],
    expected_advantages: list[float],
) -> None:
    rewards, advantages = multi_reward_advantages(tensor(CORRECT_AND_FORMAT), weights, 4, combine, eps=0.0)
    torch.testing.assert_close(rewards, tensor(expected_rewards))
    torch.testing.assert_close(advantages, tensor(expected_advantages))


# Two groups of 3, weights [1, 1]; row 1 has a failed second function, group 2 sums to [4, 4, NaN].
# Group 1 rewards [1, NaN, 7]: valid mean 4, deviations +-3, sample std sqrt(18 / 1) = 3 * sqrt(2) -> +-1 / sqrt(2).
# normalize_then_sum leaves row 1 out of both columns: c [1, -, 3] -> +-1 / sqrt(2); f [0, -, 4] -> +-1 / sqrt(2);
#   sum [-sqrt(2), 0, sqrt(2)]. (Keeping row 1 in the first column would give c [1, 0, 3], a different baseline.)
# Group 2: the two valid rewards are equal in every column -> all 0.
WITH_FAILURES = [[1.0, 0.0], [0.0, NAN], [3.0, 4.0], [2.0, 2.0], [2.0, 2.0], [NAN, NAN]]


@pytest.mark.parametrize(
    ("combine", "expected_advantages"),
    [
        pytest.param("sum_then_normalize", [-1 / SQRT2, 0.0, 1 / SQRT2, 0.0, 0.0, 0.0], id="sum_then_normalize"),
        pytest.param("normalize_then_sum", [-SQRT2, 0.0, SQRT2, 0.0, 0.0, 0.0], id="normalize_then_sum"),
    ],
)
def test_multi_reward_nan_row_is_unscorable(combine: str, expected_advantages: list[float]) -> None:
    rewards, advantages = multi_reward_advantages(tensor(WITH_FAILURES), [1.0, 1.0], 3, combine, eps=0.0)
    torch.testing.assert_close(rewards, tensor([1.0, NAN, 7.0, 4.0, 4.0, NAN]), equal_nan=True)
    torch.testing.assert_close(advantages, tensor(expected_advantages))


def test_multi_reward_integer_scores_give_default_float() -> None:
    # [1, 0] * 2 + [0, 1] * 1 = [2, 1]; mean 1.5, sample std sqrt(0.5) -> +-0.5 / sqrt(0.5) = +-0.707107
    rewards, advantages = multi_reward_advantages(torch.tensor([[1, 0], [0, 1]]), [2.0, 1.0], 2, eps=0.0)
    assert rewards.dtype == advantages.dtype == torch.get_default_dtype()
    torch.testing.assert_close(advantages, torch.tensor([1 / SQRT2, -1 / SQRT2]))


@pytest.mark.parametrize(
    ("per_function", "weights", "kwargs", "fragment"),
    [
        pytest.param(
            torch.zeros(4, 2), [1.0, 1.0], {"combine": "mean"}, "valid values: " + ", ".join(COMBINES), id="combine"
        ),
        pytest.param(
            torch.zeros(4, 2), [1.0, 1.0, 1.0], {}, "weights have shape (3,) but per_function has shape (4, 2)", id="w3"
        ),
        pytest.param(torch.zeros(4, 2), [[1.0, 1.0]], {}, "weights have shape (1, 2)", id="weights_2d"),
        pytest.param(torch.zeros(4, 2), [1.0, NAN], {}, "weights must be finite, got [1.0, nan]", id="nan_weight"),
        pytest.param(torch.zeros(4), [1.0], {}, "must be 2-D [N, F] with F >= 1 reward functions", id="one_dim"),
        pytest.param(torch.zeros(4, 0), [], {}, "got shape (4, 0)", id="no_functions"),
        pytest.param(
            tensor([[0.0, math.inf], [0.0, 0.0]]), [1.0, 0.0], {}, "infinite at [row, column] [[0, 1]]", id="inf"
        ),
    ],
)
def test_multi_reward_bad_arguments(
    per_function: torch.Tensor, weights: list[float], kwargs: dict, fragment: str
) -> None:
    with pytest.raises(ValueError, match="multi_reward_advantages") as error:
        multi_reward_advantages(per_function, weights, 2, **kwargs)
    assert fragment in str(error.value)


@pytest.mark.parametrize("combine", COMBINES)
def test_multi_reward_passes_group_errors_through(combine: str) -> None:
    with pytest.raises(ValueError, match="not a multiple of group_size=2"):
        multi_reward_advantages(torch.zeros(3, 2), [1.0, 1.0], 2, combine)
    with pytest.raises(ValueError, match="valid estimators"):
        multi_reward_advantages(torch.zeros(4, 2), [1.0, 1.0], 2, combine, estimator="ppo")


@st.composite
def _per_function_scores(draw: st.DrawFn, allow_nan: bool) -> tuple[torch.Tensor, int]:
    rewards, group_size = draw(grouped_rewards(allow_nan, min_group_size=1))
    num_functions = draw(st.integers(1, 3))
    column = st.lists(reward_element(allow_nan), min_size=rewards.numel(), max_size=rewards.numel())
    columns = [rewards] + [tensor(draw(column)) for _ in range(num_functions - 1)]
    return torch.stack(columns, dim=-1), group_size  # [N, F]


@settings(max_examples=60, deadline=None)
@given(grouped_rewards(min_group_size=1, allow_nan=True), st.sampled_from(ESTIMATORS), st.sampled_from(STD_MODES))
def test_property_normalize_then_sum_one_function_is_group_advantages(
    data: tuple[torch.Tensor, int], estimator: str, std: str
) -> None:
    rewards, group_size = data
    _, advantages = multi_reward_advantages(
        rewards.unsqueeze(-1), [1.0], group_size, "normalize_then_sum", estimator, std=std
    )
    torch.testing.assert_close(advantages, group_advantages(rewards, group_size, estimator, std=std))


@settings(max_examples=60, deadline=None)
@given(
    _per_function_scores(allow_nan=True),
    st.lists(st.integers(1, 4).map(lambda step: step * 0.5), min_size=3, max_size=3),
    st.floats(0.1, 10.0),
)
def test_property_sum_then_normalize_grpo_invariant_to_weight_scale(
    data: tuple[torch.Tensor, int], weights: list[float], scale: float
) -> None:
    per_function, group_size = data
    weights = weights[: per_function.shape[1]]
    _, base = multi_reward_advantages(per_function, weights, group_size)
    _, scaled = multi_reward_advantages(per_function, [w * scale for w in weights], group_size)
    torch.testing.assert_close(scaled, base, atol=1e-3, rtol=1e-3)


@settings(max_examples=60, deadline=None)
@given(_per_function_scores(allow_nan=True), st.floats(0.1, 10.0), st.sampled_from(STD_MODES))
def test_property_normalize_then_sum_grpo_ignores_one_functions_scale(
    data: tuple[torch.Tensor, int], scale: float, std: str
) -> None:
    # The point of normalize_then_sum: rescaling one reward function does not change its weight in the advantage.
    per_function, group_size = data
    weights = [1.0] * per_function.shape[1]
    rescaled = per_function.clone()
    rescaled[:, 0] *= scale
    _, base = multi_reward_advantages(per_function, weights, group_size, "normalize_then_sum", std=std)
    _, moved = multi_reward_advantages(rescaled, weights, group_size, "normalize_then_sum", std=std)
    torch.testing.assert_close(moved, base, atol=1e-3, rtol=1e-3)

"""group_advantages against hand-computed values, NaN handling, errors, and hypothesis properties."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from strategies import NAN, grouped_rewards, tensor

from grpo_dist.algo import ESTIMATORS, STD_MODES, group_advantages


def test_worked_example_grpo_sample_std() -> None:
    # mean = (0.8 + 0.3 + 0.6 + 0.2 + 0.7) / 5 = 2.6 / 5 = 0.52
    # deviations = [0.28, -0.22, 0.08, -0.32, 0.18]; squares sum to 0.0784 + 0.0484 + 0.0064 + 0.1024 + 0.0324 = 0.268
    # sample std = sqrt(0.268 / 4) = sqrt(0.067) = 0.258844
    # advantages = deviations / 0.258844 = [1.0817, -0.8499, 0.3091, -1.2363, 0.6954]
    advantages = group_advantages(torch.tensor([0.8, 0.3, 0.6, 0.2, 0.7]), group_size=5)
    expected = torch.tensor([1.0817, -0.8499, 0.3091, -1.2363, 0.6954])
    torch.testing.assert_close(advantages, expected, atol=1e-4, rtol=0)


# Two groups of 3: [1, 2, 3] and [4, 4, 10].
# group means 2 and 6; centred x = [-1, 0, 1, -2, -2, 4]
# group sample std: sqrt((1 + 0 + 1) / 2) = 1;  sqrt((4 + 4 + 16) / 2) = sqrt(12) = 3.464102
# group population std: sqrt(2 / 3) = 0.816497;  sqrt(24 / 3) = sqrt(8) = 2.828427
# rloo: 1 - (2+3)/2 = -1.5, 2 - (1+3)/2 = 0, 3 - (1+2)/2 = 1.5;  4 - (4+10)/2 = -3, -3, 10 - (4+4)/2 = 6
# batch: rewards mean 24/6 = 4, squared deviations 9+4+1+0+0+36 = 50, sample std sqrt(50/5) = sqrt(10) = 3.162278
# reinforce_pp: x has mean 0, squares 1+0+1+4+4+16 = 26, sample std sqrt(26/5) = sqrt(5.2) = 2.280351
TWO_GROUPS = [1.0, 2.0, 3.0, 4.0, 4.0, 10.0]


@pytest.mark.parametrize(
    ("estimator", "std", "expected"),
    [
        pytest.param("grpo", "sample", [-1.0, 0.0, 1.0, -2 / 12**0.5, -2 / 12**0.5, 4 / 12**0.5], id="grpo_sample"),
        pytest.param(
            "grpo",
            "population",
            [-1 / (2 / 3) ** 0.5, 0.0, 1 / (2 / 3) ** 0.5, -2 / 8**0.5, -2 / 8**0.5, 4 / 8**0.5],
            id="grpo_population",
        ),
        pytest.param("dr_grpo", "sample", [-1.0, 0.0, 1.0, -2.0, -2.0, 4.0], id="dr_grpo"),
        pytest.param("rloo", "sample", [-1.5, 0.0, 1.5, -3.0, -3.0, 6.0], id="rloo"),
        pytest.param("batch_std", "sample", [x / 10**0.5 for x in [-1, 0, 1, -2, -2, 4]], id="batch_std_sample"),
        # population batch std: sqrt(50 / 6) = 2.886751
        pytest.param(
            "batch_std", "population", [x / (50 / 6) ** 0.5 for x in [-1, 0, 1, -2, -2, 4]], id="batch_std_pop"
        ),
        pytest.param("reinforce_pp", "sample", [x / 5.2**0.5 for x in [-1, 0, 1, -2, -2, 4]], id="reinforce_pp"),
    ],
)
def test_estimator_matches_hand_values(estimator: str, std: str, expected: list[float]) -> None:
    advantages = group_advantages(tensor(TWO_GROUPS), 3, estimator, std=std, eps=0.0)
    torch.testing.assert_close(advantages, tensor(expected))


def test_grpo_adds_eps_to_std() -> None:
    # [0, 2]: mean 1, sample std sqrt((1 + 1) / 1) = 1.414214; with eps = 1: +-1 / 2.414214 = +-0.414214
    advantages = group_advantages(tensor([0.0, 2.0]), 2, eps=1.0)
    torch.testing.assert_close(advantages, tensor([-1 / (2**0.5 + 1), 1 / (2**0.5 + 1)]))


def test_keeps_float32_dtype() -> None:
    advantages = group_advantages(torch.tensor([0.0, 1.0]), 2)
    assert advantages.dtype == torch.float32


@pytest.mark.parametrize(
    ("rewards", "group_size", "estimator", "expected"),
    [
        # mean 0, deviations +-3e38; squares 9e76 (inf in float32: the std would be inf and the advantages 0)
        # sample std sqrt((9e76 + 9e76) / 1) = 4.242641e38 -> +-3e38 / 4.242641e38 = +-0.707107
        pytest.param([3e38, -3e38], 2, "grpo", [0.5**0.5, -(0.5**0.5)], id="grpo_squares_beyond_float32"),
        # sum 6e38 (inf in float32), mean 2e38; deviations [1e38, 1e38, -2e38], squares sum 6e76, sample std
        # sqrt(3e76) = 1.732051e38 -> [0.577350, 0.577350, -1.154701]
        pytest.param([3e38, 3e38, 0.0], 3, "grpo", [1 / 3**0.5, 1 / 3**0.5, -2 / 3**0.5], id="grpo_sum_beyond"),
        # r - mean: 3e38 - 0 and -3e38 - 0 fit float32 once the mean is taken in float64
        pytest.param([3e38, -3e38], 2, "dr_grpo", [3e38, -3e38], id="dr_grpo_near_float32_max"),
        # the largest total a run scores (REWARD_LIMIT = 1e30): squares 1e60, beyond float32 too
        pytest.param([1e30, -1e30], 2, "grpo", [0.5**0.5, -(0.5**0.5)], id="grpo_at_reward_limit"),
    ],
)
def test_float32_rewards_near_its_limit_do_not_overflow_the_statistics(
    rewards: list[float], group_size: int, estimator: str, expected: list[float]
) -> None:
    advantages = group_advantages(torch.tensor(rewards, dtype=torch.float32), group_size, estimator, eps=0.0)
    assert advantages.dtype == torch.float32
    torch.testing.assert_close(advantages, torch.tensor(expected, dtype=torch.float32))


@pytest.mark.parametrize(
    ("rewards", "group_size", "estimator", "expected"),
    [
        # valid [1, 3]: mean 2, sample std sqrt(2) = 1.414214; NaN member gets 0
        pytest.param([1.0, NAN, 3.0], 3, "grpo", [-(0.5**0.5), 0.0, 0.5**0.5], id="grpo_skips_nan"),
        # valid [1, 3, 5]: 1 - (3+5)/2 = -3, 3 - (1+5)/2 = 0, 5 - (1+3)/2 = 3
        pytest.param([1.0, NAN, 3.0, 5.0], 4, "rloo", [-3.0, 0.0, 0.0, 3.0], id="rloo_counts_valid_others"),
        # group 0 = [NaN, 1] has one valid reward -> zeros; group 1 = [2, 3]: +-0.5 / sqrt(0.5) = +-0.707107
        pytest.param([NAN, 1.0, 2.0, 3.0], 2, "grpo", [0.0, 0.0, -(0.5**0.5), 0.5**0.5], id="one_valid_group_zero"),
        pytest.param([NAN, NAN, 2.0, 3.0], 2, "rloo", [0.0, 0.0, -1.0, 1.0], id="all_nan_group_zero"),
        # group 0 = [1, NaN] -> zeros; group 1 = [3, 5] centred [-1, 1]
        # batch std over all valid [1, 3, 5]: mean 3, sample std sqrt((4 + 0 + 4) / 2) = 2 -> [-0.5, 0.5]
        pytest.param([1.0, NAN, 3.0, 5.0], 2, "batch_std", [0.0, 0.0, -0.5, 0.5], id="batch_std_skips_nan"),
        # groups [0, 2], [1, NaN], [5, 9]: centred [-1, 1], none, [-2, 2]
        # whitened over the 4 with a baseline: mean 0, sample std sqrt((1 + 1 + 4 + 4) / 3) = sqrt(10/3) = 1.825742
        pytest.param(
            [0.0, 2.0, 1.0, NAN, 5.0, 9.0],
            2,
            "reinforce_pp",
            [-1 / (10 / 3) ** 0.5, 1 / (10 / 3) ** 0.5, 0.0, 0.0, -2 / (10 / 3) ** 0.5, 2 / (10 / 3) ** 0.5],
            id="reinforce_pp_skips_unbaselined",
        ),
    ],
)
def test_nan_rewards_are_left_out(rewards: list[float], group_size: int, estimator: str, expected: list[float]) -> None:
    advantages = group_advantages(tensor(rewards), group_size, estimator, eps=0.0)
    torch.testing.assert_close(advantages, tensor(expected))


@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize("std", STD_MODES)
def test_equal_reward_group_is_exactly_zero(estimator: str, std: str) -> None:
    # 0.1 * 3 / 3 rounds to 0.10000000000000002 != 0.1: the zero must not depend on the mean being exact.
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.0, 1.0, 2.0, 0.7, 0.7, NAN])
    advantages = group_advantages(rewards, 3, estimator, std=std)
    assert torch.equal(advantages[[0, 1, 2, 6, 7, 8]], torch.zeros(6))
    assert torch.isfinite(advantages).all()


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_all_equal_or_all_nan_batch_is_zero_even_with_eps_zero(estimator: str) -> None:
    rewards = torch.tensor([0.3, 0.3, NAN, NAN, 0.3, NAN])
    assert torch.equal(group_advantages(rewards, 2, estimator, eps=0.0), torch.zeros(6))


def test_group_size_one_gives_zeros() -> None:
    assert torch.equal(group_advantages(torch.tensor([1.0, 5.0]), 1), torch.zeros(2))


@pytest.mark.parametrize(
    ("rewards", "group_size", "kwargs", "fragment"),
    [
        pytest.param(torch.zeros(5), 2, {}, "not a multiple of group_size=2", id="not_divisible"),
        pytest.param(torch.zeros(4), 0, {}, "group_size must be an int >= 1", id="group_size_zero"),
        pytest.param(torch.zeros(4), 2, {"estimator": "ppo"}, "valid estimators: grpo, dr_grpo, rloo", id="estimator"),
        pytest.param(torch.zeros(4), 2, {"std": "biased"}, "valid values: sample, population", id="std"),
        pytest.param(torch.zeros(2, 2), 2, {}, "must be 1-D", id="two_dims"),
        pytest.param(torch.zeros(4), 2, {"eps": -1.0}, "eps must be >= 0", id="negative_eps"),
        pytest.param(torch.tensor([0.0, math.inf]), 2, {}, "infinite at positions [1]", id="inf_reward"),
    ],
)
def test_bad_arguments_raise(rewards: torch.Tensor, group_size: int, kwargs: dict, fragment: str) -> None:
    with pytest.raises(ValueError, match="group_advantages") as error:
        group_advantages(rewards, group_size, **kwargs)
    assert fragment in str(error.value)


@settings(max_examples=60, deadline=None)
@given(grouped_rewards(allow_nan=True), st.sampled_from(ESTIMATORS), st.sampled_from(STD_MODES))
def test_property_finite_and_nan_gets_zero(data: tuple[torch.Tensor, int], estimator: str, std: str) -> None:
    rewards, group_size = data
    advantages = group_advantages(rewards, group_size, estimator, std=std)
    assert advantages.shape == rewards.shape
    assert torch.isfinite(advantages).all()
    assert torch.equal(advantages[rewards.isnan()], torch.zeros(int(rewards.isnan().sum()), dtype=torch.float64))


@settings(max_examples=60, deadline=None)
@given(grouped_rewards(allow_nan=True), st.sampled_from(["grpo", "dr_grpo", "rloo"]), st.sampled_from(STD_MODES))
def test_property_group_mean_is_zero(data: tuple[torch.Tensor, int], estimator: str, std: str) -> None:
    rewards, group_size = data
    advantages = group_advantages(rewards, group_size, estimator, std=std).reshape(-1, group_size)
    # NaN members already hold 0, so the plain group sum is the sum over valid members.
    torch.testing.assert_close(advantages.sum(-1), torch.zeros(advantages.shape[0], dtype=torch.float64))


@settings(max_examples=60, deadline=None)
@given(
    grouped_rewards(allow_nan=True),
    st.floats(-100, 100),
    st.floats(0.1, 10),
    st.sampled_from(STD_MODES),
)
def test_property_grpo_invariant_to_shift_and_positive_scale(
    data: tuple[torch.Tensor, int], shift: float, scale: float, std: str
) -> None:
    rewards, group_size = data
    base = group_advantages(rewards, group_size, std=std)
    moved = group_advantages(rewards * scale + shift, group_size, std=std)
    torch.testing.assert_close(moved, base, atol=1e-3, rtol=1e-3)


@settings(max_examples=60, deadline=None)
@given(grouped_rewards(allow_nan=False))
def test_property_rloo_is_rescaled_dr_grpo(data: tuple[torch.Tensor, int]) -> None:
    rewards, group_size = data
    rloo = group_advantages(rewards, group_size, "rloo")
    dr_grpo = group_advantages(rewards, group_size, "dr_grpo")
    torch.testing.assert_close(rloo, group_size / (group_size - 1) * dr_grpo)


@settings(max_examples=40, deadline=None)
@given(grouped_rewards(allow_nan=False))
def test_property_reinforce_pp_is_whitened(data: tuple[torch.Tensor, int]) -> None:
    rewards, group_size = data
    advantages = group_advantages(rewards, group_size, "reinforce_pp", eps=0.0)
    assume(bool(advantages.ne(0).any()))
    # All groups have a baseline here, so the whole batch is whitened: mean 0, sample std 1.
    torch.testing.assert_close(advantages.mean(), torch.tensor(0.0, dtype=torch.float64))
    torch.testing.assert_close(advantages.std(), torch.tensor(1.0, dtype=torch.float64))

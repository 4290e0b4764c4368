"""policy_loss against hand-computed values, gradient checks through each branch, metrics and errors."""

from __future__ import annotations

import math

import pytest
import torch

from grpo_dist.algo import AGGREGATIONS, policy_loss

LN = math.log


def _logprobs(log_ratios: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Leaf logprobs [B, T] and old_logprobs set so that logprobs - old_logprobs = log_ratios."""
    old = torch.full((len(log_ratios), len(log_ratios[0])), -1.0, dtype=torch.float64)
    logprobs = (old + torch.tensor(log_ratios, dtype=torch.float64)).requires_grad_(True)
    return logprobs, old


def _full_mask(logprobs: torch.Tensor) -> torch.Tensor:
    return torch.ones_like(logprobs, dtype=torch.bool)


def _advantages(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def test_on_policy_ratio_is_exactly_one() -> None:
    # ratio = exp(0) = 1 on every token, so each token's loss is -A: sequences give -1 and +2, mean (-1 + 2) / 2 = 0.5
    logprobs = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    loss, metrics = policy_loss(logprobs, logprobs.detach(), _advantages([1.0, -2.0]), _full_mask(logprobs))
    assert loss.item() == pytest.approx(0.5)
    assert metrics["ratio/mean"] == 1.0
    assert metrics["ratio/max"] == 1.0
    assert metrics["clip_fraction"] == 0.0
    assert metrics["loss/policy"] == pytest.approx(0.5)


@pytest.mark.parametrize(
    ("advantage", "ratio", "clip_high", "expected_loss", "expected_grad", "high", "low"),
    [
        # inside [0.8, 1.2]: loss -A * r = -1.1; d/dlogp (-A * exp(logp - old)) = -A * r = -1.1
        pytest.param(1.0, 1.1, 0.2, -1.1, -1.1, 0.0, 0.0, id="pos_adv_unclipped"),
        # max(-1.5, -1.2) = -1.2 is the constant clipped branch: no gradient
        pytest.param(1.0, 1.5, 0.2, -1.2, 0.0, 1.0, 0.0, id="pos_adv_clipped_high"),
        # max(-0.5, -0.8) = -0.5: pessimistic unclipped branch, gradient -0.5, not a clip
        pytest.param(1.0, 0.5, 0.2, -0.5, -0.5, 0.0, 0.0, id="pos_adv_low_ratio_unclipped"),
        # A = -1: max(0.5, 0.8) = 0.8 is the clipped branch: no gradient
        pytest.param(-1.0, 0.5, 0.2, 0.8, 0.0, 0.0, 1.0, id="neg_adv_clipped_low"),
        # A = -1: max(1.5, 1.2) = 1.5 unclipped, gradient -A * r = 1.5
        pytest.param(-1.0, 1.5, 0.2, 1.5, 1.5, 0.0, 0.0, id="neg_adv_high_ratio_unclipped"),
        # clip-higher: 1.25 < 1 + 0.28, so still unclipped: loss -1.25, gradient -1.25
        pytest.param(1.0, 1.25, 0.28, -1.25, -1.25, 0.0, 0.0, id="clip_higher_unclipped"),
        # A = 2, r = 1.3 > 1.28: loss -2 * 1.28 = -2.56, no gradient
        pytest.param(2.0, 1.3, 0.28, -2.56, 0.0, 1.0, 0.0, id="clip_higher_clipped"),
    ],
)
def test_clipped_surrogate_single_token(
    advantage: float,
    ratio: float,
    clip_high: float,
    expected_loss: float,
    expected_grad: float,
    high: float,
    low: float,
) -> None:
    logprobs, old = _logprobs([[LN(ratio)]])
    loss, metrics = policy_loss(logprobs, old, _advantages([advantage]), _full_mask(logprobs), clip_high=clip_high)
    loss.backward()
    assert loss.item() == pytest.approx(expected_loss)
    assert logprobs.grad.item() == pytest.approx(expected_grad)
    assert (logprobs.grad.item() == 0.0) == (expected_grad == 0.0)  # a clipped branch gives exactly 0
    assert (metrics["clip_fraction/high"], metrics["clip_fraction/low"]) == (high, low)


def test_gradient_per_token_seq_mean_token_mean() -> None:
    # ratios [1.5, 1.1, 1.0, e^5 (masked)], A = 1, n = 3 counted tokens
    # per-token losses: max(-1.5, -1.2) = -1.2 (clipped), -1.1, -1.0; loss = -3.3 / 3 = -1.1
    # gradients: 0 (clipped), -A * r / n = -1.1 / 3, -1.0 / 3, 0 (masked)
    logprobs, old = _logprobs([[LN(1.5), LN(1.1), 0.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    loss, metrics = policy_loss(logprobs, old, _advantages([1.0]), mask)
    loss.backward()
    assert loss.item() == pytest.approx(-1.1)
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, -1.1 / 3, -1.0 / 3, 0.0]], dtype=torch.float64))
    assert logprobs.grad[0, 0].item() == 0.0
    # masked token (ratio e^5) is excluded: ratio/max = 1.5, ratio/mean = (1.5 + 1.1 + 1.0) / 3 = 1.2
    assert metrics["ratio/max"] == pytest.approx(1.5)
    assert metrics["ratio/mean"] == pytest.approx(1.2)
    assert metrics["clip_fraction/high"] == pytest.approx(1 / 3)


@pytest.mark.parametrize(
    ("advantage", "ratio", "expected_loss", "expected_grad", "capped"),
    [
        # A = -1, r = 5: standard max(5, 1.2) = 5, capped at -A * c = 3; the cap is constant: no gradient
        pytest.param(-1.0, 5.0, 3.0, 0.0, 1.0, id="neg_adv_capped"),
        # A = -1, r = 2: max(2, 1.2) = 2 < 3 stays, gradient -A * r = 2
        pytest.param(-1.0, 2.0, 2.0, 2.0, 0.0, id="neg_adv_below_cap"),
        # A = +1, r = 5: dual clip does not apply; max(-5, -1.2) = -1.2 (clipped high), no gradient
        pytest.param(1.0, 5.0, -1.2, 0.0, 0.0, id="pos_adv_untouched"),
    ],
)
def test_dual_clip(advantage: float, ratio: float, expected_loss: float, expected_grad: float, capped: float) -> None:
    logprobs, old = _logprobs([[LN(ratio)]])
    loss, metrics = policy_loss(logprobs, old, _advantages([advantage]), _full_mask(logprobs), dual_clip=3.0)
    loss.backward()
    assert loss.item() == pytest.approx(expected_loss)
    assert logprobs.grad.item() == pytest.approx(expected_grad)
    assert (logprobs.grad.item() == 0.0) == (expected_grad == 0.0)  # a clipped branch gives exactly 0
    assert metrics["dual_clip_fraction"] == capped


def test_no_dual_clip_metric_without_dual_clip() -> None:
    logprobs, old = _logprobs([[0.0]])
    _, metrics = policy_loss(logprobs, old, _advantages([1.0]), _full_mask(logprobs))
    assert "dual_clip_fraction" not in metrics
    assert "kl" not in metrics
    assert "is_weight/mean" not in metrics
    assert "entropy" not in metrics


def test_sequence_ratio_differs_from_token_ratio() -> None:
    # token log-ratios [0.2, 0.0], A = 1.
    # token level: e^0.2 = 1.2214 > 1.2 is clipped: losses [-1.2, -1.0], mean -1.1
    # sequence level (GSPO): ratio = exp((0.2 + 0) / 2) = e^0.1 = 1.105171 inside the range: loss -1.105171
    # and d/dlogp_t of -exp(mean log-ratio) = -e^0.1 / 2 = -0.552585 for both tokens
    logprobs, old = _logprobs([[0.2, 0.0]])
    token_loss, token_metrics = policy_loss(logprobs, old, _advantages([1.0]), _full_mask(logprobs))
    sequence_loss, metrics = policy_loss(
        logprobs, old, _advantages([1.0]), _full_mask(logprobs), ratio_level="sequence"
    )
    sequence_loss.backward()
    assert token_loss.item() == pytest.approx(-1.1)
    assert sequence_loss.item() == pytest.approx(-math.exp(0.1))
    torch.testing.assert_close(logprobs.grad, torch.full((1, 2), -math.exp(0.1) / 2, dtype=torch.float64))
    assert metrics["ratio/mean"] == pytest.approx(math.exp(0.1))
    # ratio/sequence_spread: the ratio's max - min within a sequence, e^0.2 - e^0 = 0.2214 per token, 0 per sequence
    assert token_metrics["ratio/sequence_spread"] == pytest.approx(math.exp(0.2) - 1.0)
    assert metrics["ratio/sequence_spread"] == 0.0


def test_sequence_ratio_clips_whole_sequence_and_ignores_masked_tokens() -> None:
    # counted log-ratios [0.4, 0.2] -> mean 0.3, ratio e^0.3 = 1.349859 > 1.2; the masked 5.0 is ignored
    # A = 1: max(-1.3499, -1.2) = -1.2 on every token, no gradient anywhere
    logprobs, old = _logprobs([[0.4, 0.2, 5.0]])
    mask = torch.tensor([[True, True, False]])
    loss, metrics = policy_loss(logprobs, old, _advantages([1.0]), mask, ratio_level="sequence")
    loss.backward()
    assert loss.item() == pytest.approx(-1.2)
    assert torch.equal(logprobs.grad, torch.zeros(1, 3, dtype=torch.float64))
    assert metrics["clip_fraction/high"] == 1.0


# Ratio 1 everywhere, A = [1, -2]: per-token losses -1 (sequence 0) and +2 (sequence 1).
# mask: sequence 0 counts 3 tokens, sequence 1 counts 1 token.
@pytest.mark.parametrize(
    ("aggregation", "max_length", "expected"),
    [
        # sequence means -1 and 2 -> (-1 + 2) / 2 = 0.5
        pytest.param("seq-mean-token-mean", None, 0.5, id="seq_mean_token_mean"),
        # (-1 * 3 + 2 * 1) / 4 tokens = -0.25
        pytest.param("token-mean", None, -0.25, id="token_mean"),
        # (-3 + 2) / (B * T) = -1 / (2 * 3)
        pytest.param("seq-mean-token-sum-norm", None, -1 / 6, id="token_sum_norm_default_T"),
        # (-3 + 2) / (2 * 4) = -0.125
        pytest.param("seq-mean-token-sum-norm", 4, -0.125, id="token_sum_norm_max_length"),
    ],
)
def test_aggregation(aggregation: str, max_length: int | None, expected: float) -> None:
    logprobs, old = _logprobs([[0.0] * 3, [0.0] * 3])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    loss, _ = policy_loss(logprobs, old, _advantages([1.0, -2.0]), mask, aggregation=aggregation, max_length=max_length)
    assert loss.item() == pytest.approx(expected)


@pytest.mark.parametrize(
    ("aggregation", "expected"),
    [
        # sequence 1 is empty and counts 0 in the mean over B = 2: (-1 + 0) / 2
        pytest.param("seq-mean-token-mean", -0.5, id="seq_mean_token_mean"),
        # -3 / 3 tokens
        pytest.param("token-mean", -1.0, id="token_mean"),
        # -3 / (2 * 3)
        pytest.param("seq-mean-token-sum-norm", -0.5, id="token_sum_norm"),
    ],
)
def test_empty_sequence_gives_no_nan(aggregation: str, expected: float) -> None:
    logprobs, old = _logprobs([[0.0] * 3, [0.0] * 3])
    mask = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    loss, _ = policy_loss(logprobs, old, _advantages([1.0, -2.0]), mask, aggregation=aggregation)
    loss.backward()
    assert loss.item() == pytest.approx(expected)
    assert torch.isfinite(logprobs.grad).all()


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_all_masked_batch_is_zero_and_finite(aggregation: str) -> None:
    logprobs, old = _logprobs([[0.3, -0.2]])
    loss, metrics = policy_loss(logprobs, old, _advantages([1.0]), torch.zeros(1, 2), aggregation=aggregation)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(logprobs.grad, torch.zeros(1, 2, dtype=torch.float64))
    assert all(math.isfinite(value) for value in metrics.values())


def test_padding_garbage_never_reaches_loss_or_gradient() -> None:
    # float32 pad logprobs +50 vs old -50: exp(100) overflows to inf, and inf * 0 would be NaN without masking first
    logprobs = torch.tensor([[-1.0, 50.0]], requires_grad=True)
    old = torch.tensor([[-1.0, -50.0]])
    ref = torch.tensor([[-1.0, -math.inf]])
    mask = torch.tensor([[1.0, 0.0]])
    loss, metrics = policy_loss(
        logprobs, old, torch.tensor([1.0]), mask, ref_logprobs=ref, kl_coef=0.1, sampling_logprobs=ref
    )
    loss.backward()
    assert loss.item() == pytest.approx(-1.0)
    assert torch.isfinite(logprobs.grad).all()
    assert logprobs.grad[0, 1].item() == 0.0
    assert all(math.isfinite(value) for value in metrics.values())


def test_bool_and_float_masks_agree() -> None:
    logprobs, old = _logprobs([[0.1, -0.3, 0.25]])
    bool_loss, _ = policy_loss(logprobs, old, _advantages([-0.7]), torch.tensor([[True, False, True]]))
    float_loss, _ = policy_loss(logprobs, old, _advantages([-0.7]), torch.tensor([[1.0, 0.0, 1.0]]))
    assert bool_loss.item() == float_loss.item()


# d = ref - logprobs = ln 2 = 0.693147 on the single token:
# k1 = -d = -0.693147; k2 = d^2 / 2 = 0.240227; k3 = e^d - d - 1 = 2 - 0.693147 - 1 = 0.306853
# d/dlogp of kl_coef * k: k1 -> 0.1 * 1 = 0.1; k2 -> 0.1 * (-d) = -0.0693147; k3 -> 0.1 * (1 - e^d) = -0.1
@pytest.mark.parametrize(
    ("estimator", "expected_kl", "expected_grad"),
    [
        pytest.param("k1", -LN(2), 0.1, id="k1"),
        pytest.param("k2", 0.5 * LN(2) ** 2, -0.1 * LN(2), id="k2"),
        pytest.param("k3", 1 - LN(2), -0.1, id="k3"),
    ],
)
def test_kl_estimators(estimator: str, expected_kl: float, expected_grad: float) -> None:
    # A = 0 makes the policy term 0 with gradient 0, leaving loss = 0.1 * kl
    logprobs, old = _logprobs([[0.0]])
    ref = logprobs.detach() + LN(2)
    loss, metrics = policy_loss(
        logprobs, old, _advantages([0.0]), _full_mask(logprobs), ref_logprobs=ref, kl_coef=0.1, kl_estimator=estimator
    )
    loss.backward()
    assert metrics["kl"] == pytest.approx(expected_kl)
    assert loss.item() == pytest.approx(0.1 * expected_kl)
    assert logprobs.grad.item() == pytest.approx(expected_grad)


def test_kl_reported_but_not_added_when_coef_zero() -> None:
    # k3 with d = ln 2 is 0.306853; the loss stays the policy term -A = -1
    logprobs, old = _logprobs([[0.0]])
    loss, metrics = policy_loss(logprobs, old, _advantages([1.0]), _full_mask(logprobs), ref_logprobs=old + LN(2))
    assert loss.item() == pytest.approx(-1.0)
    assert metrics["kl"] == pytest.approx(1 - LN(2))


def test_truncated_importance_sampling_weight() -> None:
    # old - sampling = [ln 3, ln 0.5] -> weights [min(3, 2), 0.5] = [2, 0.5]; ratio 1, A = 1
    # loss = -(2 + 0.5) / 2 = -1.25; gradients -A * r * w / n = [-2 / 2, -0.5 / 2] = [-1, -0.25]
    logprobs, old = _logprobs([[0.0, 0.0]])
    sampling = (old - torch.tensor([[LN(3), LN(0.5)]], dtype=torch.float64)).requires_grad_(True)
    loss, metrics = policy_loss(
        logprobs, old, _advantages([1.0]), _full_mask(logprobs), sampling_logprobs=sampling, is_cap=2.0
    )
    loss.backward()
    assert loss.item() == pytest.approx(-1.25)
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-1.0, -0.25]], dtype=torch.float64))
    assert sampling.grad is None  # the weight is detached: nothing flows back to the sampler's logprobs
    assert metrics["is_weight/mean"] == pytest.approx(1.25)
    assert metrics["is_weight/capped"] == pytest.approx(0.5)  # the first token's 3 hit the cap
    assert metrics["loss/policy"] == pytest.approx(-1.25)


def test_entropy_bonus() -> None:
    # entropy [1, 3] -> aggregated 2; loss = policy (-A = -1) - 0.01 * 2 = -1.02; d/d entropy_t = -0.01 / 2
    logprobs, old = _logprobs([[0.0, 0.0]])
    entropy = torch.tensor([[1.0, 3.0]], dtype=torch.float64, requires_grad=True)
    loss, metrics = policy_loss(
        logprobs, old, _advantages([1.0]), _full_mask(logprobs), entropy=entropy, entropy_coef=0.01
    )
    loss.backward()
    assert loss.item() == pytest.approx(-1.02)
    assert metrics["entropy"] == pytest.approx(2.0)
    assert metrics["loss/policy"] == pytest.approx(-1.0)
    torch.testing.assert_close(entropy.grad, torch.full((1, 2), -0.005, dtype=torch.float64))


def test_clip_fraction_metrics_over_batch() -> None:
    # tokens (A, r): (1, 1.5) high clip, (1, 0.5) none | (-1, 0.5) low clip, (-1, 1.5) none
    # high 1/4, low 1/4, total 1/2; ratio mean (1.5 + 0.5 + 0.5 + 1.5) / 4 = 1, max 1.5
    logprobs, old = _logprobs([[LN(1.5), LN(0.5)], [LN(0.5), LN(1.5)]])
    _, metrics = policy_loss(logprobs, old, _advantages([1.0, -1.0]), _full_mask(logprobs))
    assert metrics["clip_fraction/high"] == 0.25
    assert metrics["clip_fraction/low"] == 0.25
    assert metrics["clip_fraction"] == 0.5
    assert metrics["ratio/mean"] == pytest.approx(1.0)
    assert metrics["ratio/max"] == pytest.approx(1.5)
    assert all(type(value) is float for value in metrics.values())


def test_bfloat16_inputs_compute_in_float32() -> None:
    logprobs = torch.zeros(1, 2, dtype=torch.bfloat16, requires_grad=True)
    loss, _ = policy_loss(logprobs, logprobs.detach(), torch.tensor([1.0]), torch.ones(1, 2))
    loss.backward()
    assert loss.dtype == torch.float32
    assert logprobs.grad.dtype == torch.bfloat16


_B2T3 = torch.zeros(2, 3)


@pytest.mark.parametrize(
    ("overrides", "fragments"),
    [
        pytest.param({"old_logprobs": torch.zeros(2, 4)}, ["old_logprobs", "(2, 4)", "(2, 3)"], id="old_shape"),
        pytest.param({"mask": torch.ones(3)}, ["mask", "(3,)", "(2, 3)"], id="mask_shape"),
        pytest.param({"ref_logprobs": torch.zeros(2, 2)}, ["ref_logprobs", "(2, 2)"], id="ref_shape"),
        pytest.param({"sampling_logprobs": torch.zeros(1, 3)}, ["sampling_logprobs", "(1, 3)"], id="sampling_shape"),
        pytest.param({"entropy": torch.zeros(2, 3, 1)}, ["entropy", "(2, 3, 1)"], id="entropy_shape"),
        pytest.param({"advantages": torch.zeros(2, 1)}, ["advantages", "(2, 1)", "[B] = (2,)"], id="advantages_shape"),
        pytest.param({"logprobs": torch.zeros(3)}, ["logprobs must be [B, T]", "(3,)"], id="logprobs_1d"),
        pytest.param({"aggregation": "mean"}, ["aggregation 'mean'", "seq-mean-token-mean, token-mean"], id="agg"),
        pytest.param({"kl_estimator": "k4"}, ["kl_estimator 'k4'", "k1, k2, k3"], id="kl_estimator"),
        pytest.param({"ratio_level": "seq"}, ["ratio_level 'seq'", "token, sequence"], id="ratio_level"),
        pytest.param({"clip_low": -0.1}, ["clip_low and clip_high must be >= 0"], id="negative_clip"),
        pytest.param({"dual_clip": 1.0}, ["dual_clip must be > 1"], id="dual_clip_one"),
        pytest.param({"is_cap": 0.0}, ["is_cap must be > 0"], id="is_cap_zero"),
        pytest.param({"max_length": 0}, ["max_length must be >= 1"], id="max_length_zero"),
        pytest.param({"kl_coef": 0.1}, ["kl_coef=0.1 needs ref_logprobs"], id="kl_without_ref"),
        pytest.param({"entropy_coef": 0.1}, ["entropy_coef=0.1 needs the entropy"], id="entropy_without_tensor"),
        pytest.param({"kl_coef": -0.1, "ref_logprobs": _B2T3}, ["must be >= 0"], id="negative_kl_coef"),
    ],
)
def test_bad_arguments_raise(overrides: dict, fragments: list[str]) -> None:
    arguments = {"logprobs": _B2T3, "old_logprobs": _B2T3, "advantages": torch.zeros(2), "mask": torch.ones(2, 3)}
    arguments.update(overrides)
    with pytest.raises(ValueError, match="policy_loss") as error:
        policy_loss(**arguments)
    for fragment in fragments:
        assert fragment in str(error.value)

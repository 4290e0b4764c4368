"""The off-policy corrections (`algorithm.off_policy`) against hand-computed weights, losses and gradients: masked
and two-sided (IcePop) importance sampling per token, truncated and masked per sequence by the geometric mean, and
CISPO's surrogate, which keeps the gradient the clipped surrogate drops."""

from __future__ import annotations

import math
import re

import pytest
import torch
from conftest import small_config

from grpo_dist.algo import policy_loss
from grpo_dist.algo.off_policy import importance_weight
from grpo_dist.config import ConfigError, validate_config

LN = math.log
F64 = torch.float64


def _batch(weights: list[list[float]], ratios: list[list[float]] | None = None):
    """Leaf logprobs [B, T], old_logprobs (-1) and sampling logprobs with old - sampling = log `weights` (the
    sampler-learner ratio k of each token) and logprobs - old = log `ratios` (1 when not given)."""
    old = torch.full((len(weights), len(weights[0])), -1.0, dtype=F64)
    sampling = old - torch.tensor(weights, dtype=F64).log()
    log_ratios = torch.zeros_like(old) if ratios is None else torch.tensor(ratios, dtype=F64).log()
    return (old + log_ratios).requires_grad_(True), old, sampling


def _loss(weights, advantages, method, ratios=None, mask=None, **options):
    logprobs, old, sampling = _batch(weights, ratios)
    mask = torch.ones_like(old) if mask is None else torch.tensor(mask, dtype=F64)
    sampling_logprobs = None if method == "cispo" else sampling
    loss, metrics = policy_loss(
        logprobs, old, torch.tensor(advantages, dtype=F64), mask, sampling_logprobs=sampling_logprobs,
        off_policy=method, **options,
    )  # fmt: skip
    loss.backward()
    return loss.item(), logprobs.grad, metrics


def test_masked_importance_sampling_leaves_out_the_tokens_past_its_cap() -> None:
    # k = [3, 1.5, 0.5], cap 2: weights [0, 1.5, 0.5]; A = 1, r = 1: loss -(0 + 1.5 + 0.5) / 3; gradient -w / 3
    loss, grad, metrics = _loss([[3.0, 1.5, 0.5]], [1.0], "mis", is_cap=2.0)
    assert loss == pytest.approx(-2 / 3)
    torch.testing.assert_close(grad, torch.tensor([[0.0, -0.5, -1 / 6]], dtype=F64))
    assert metrics["is_weight/masked"] == pytest.approx(1 / 3)
    assert metrics["is_weight/mean"] == pytest.approx(2 / 3)
    assert "is_weight/capped" not in metrics
    # TIS on the same tokens truncates the first instead: weights [2, 1.5, 0.5]
    loss, grad, metrics = _loss([[3.0, 1.5, 0.5]], [1.0], "tis", is_cap=2.0)
    assert loss == pytest.approx(-4 / 3)
    torch.testing.assert_close(grad, torch.tensor([[-2 / 3, -0.5, -1 / 6]], dtype=F64))
    assert metrics["is_weight/capped"] == pytest.approx(1 / 3)


def test_masking_with_a_floor_and_icepops_band() -> None:
    # mis with floor 0.6: k = 0.5 falls below it too: weights [0, 1.5, 0]
    loss, grad, metrics = _loss([[3.0, 1.5, 0.5]], [1.0], "mis", is_cap=2.0, is_floor=0.6)
    assert loss == pytest.approx(-0.5)
    torch.testing.assert_close(grad, torch.tensor([[0.0, -0.5, 0.0]], dtype=F64))
    assert metrics["is_weight/masked"] == pytest.approx(2 / 3)
    # icepop's band [0.5, 5]: k = [6, 0.4, 2] -> [0, 0, 2]; A = -1 flips the sign
    loss, grad, metrics = _loss([[6.0, 0.4, 2.0]], [-1.0], "icepop", is_cap=5.0, is_floor=0.5)
    assert loss == pytest.approx(2 / 3)
    torch.testing.assert_close(grad, torch.tensor([[0.0, 0.0, 2 / 3]], dtype=F64))
    assert metrics["is_weight/masked"] == pytest.approx(2 / 3)


def test_sequence_level_weights_are_the_geometric_mean_truncated_or_masked() -> None:
    # sequence 1: k = [4, 1], geometric mean 2 > cap 1.5; sequence 2: k = [2, 0.5], geometric mean 1
    weights, advantages = [[4.0, 1.0], [2.0, 0.5]], [1.0, 1.0]
    # seq_tis: weights 1.5 and 1 for every token of each: loss mean(-1.5, -1); gradient -w / 2 / 2
    loss, grad, metrics = _loss(weights, advantages, "seq_tis", is_cap=1.5)
    assert loss == pytest.approx(-1.25)
    torch.testing.assert_close(grad, torch.tensor([[-0.375, -0.375], [-0.25, -0.25]], dtype=F64))
    assert metrics["is_weight/capped"] == pytest.approx(0.5)
    assert metrics["is_weight/mean"] == pytest.approx(1.25)
    # seq_mis: sequence 1 left out whole, sequence 2 weighs 1
    loss, grad, metrics = _loss(weights, advantages, "seq_mis", is_cap=1.5)
    assert loss == pytest.approx(-0.5)
    torch.testing.assert_close(grad, torch.tensor([[0.0, 0.0], [-0.25, -0.25]], dtype=F64))
    assert metrics["is_weight/masked"] == pytest.approx(0.5)
    # token-level TIS would weigh sequence 2's tokens 2 and 0.5 apart
    _, grad, _ = _loss(weights, advantages, "tis", is_cap=1.5)
    torch.testing.assert_close(grad[1], torch.tensor([-0.375, -0.125], dtype=F64))


def test_a_sequences_length_does_not_set_its_weight_and_padding_does_not_count() -> None:
    # k = 2 on every token: 2 tokens or 4, the geometric mean is 2 (the product would be 4 or 16); the padded
    # position's garbage log-prob (inf) never reaches the weight
    old = torch.full((2, 4), -1.0, dtype=F64)
    sampling = old - LN(2.0)
    sampling[0, 2:] = -math.inf
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]], dtype=F64)
    for method in ("seq_tis", "seq_mis"):
        weight, _ = importance_weight(old, sampling, mask, method, cap=3.0)
        torch.testing.assert_close(weight, torch.tensor([[2.0, 2.0, 1.0, 1.0], [2.0] * 4], dtype=F64))


def test_cispo_keeps_the_gradient_of_tokens_the_clipped_surrogate_drops() -> None:
    # r = [1.5, 0.5] to the sampling policy, clip_high 0.2: CISPO weights sg(min(r, 1.2)) = [1.2, 0.5], loss
    # -w * A * log pi; gradient -w * A / 2 on each token, whichever side of the clip it is
    ratios = [[1.5, 0.5]]
    logp = [-1 + LN(1.5), -1 + LN(0.5)]
    loss, grad, metrics = _loss([[1.0, 1.0]], [1.0], "cispo", ratios=ratios, clip_high=0.2)
    assert loss == pytest.approx(-(1.2 * logp[0] + 0.5 * logp[1]) / 2)
    torch.testing.assert_close(grad, torch.tensor([[-0.6, -0.25]], dtype=F64))
    assert metrics["is_weight/capped"] == pytest.approx(0.5)
    assert metrics["clip_fraction"] == pytest.approx(0.5)
    assert metrics["is_weight/mean"] == pytest.approx(0.85)
    # the clipped surrogate gives the first token (A > 0, r > 1.2) no gradient
    _, grad, _ = _loss([[1.0, 1.0]], [1.0], "tis", ratios=ratios, clip_high=0.2, is_cap=2.0)
    torch.testing.assert_close(grad, torch.tensor([[0.0, -0.25]], dtype=F64))
    # A < 0: the clipped surrogate drops the second (r < 0.8); CISPO keeps both, signs flipped
    _, grad, _ = _loss([[1.0, 1.0]], [-1.0], "cispo", ratios=ratios, clip_high=0.2)
    torch.testing.assert_close(grad, torch.tensor([[0.6, 0.25]], dtype=F64))
    _, grad, _ = _loss([[1.0, 1.0]], [-1.0], "tis", ratios=ratios, clip_high=0.2, is_cap=2.0)
    torch.testing.assert_close(grad, torch.tensor([[0.75, 0.0]], dtype=F64))


def test_cispo_on_policy_has_the_policy_gradient_of_the_clipped_surrogate() -> None:
    torch.manual_seed(0)
    logprobs = torch.randn(3, 5, dtype=F64)
    advantages, mask = torch.randn(3, dtype=F64), (torch.rand(3, 5) > 0.2).to(F64)
    grads = {}
    for method in ("tis", "cispo"):
        leaf = logprobs.clone().requires_grad_(True)
        loss, _ = policy_loss(leaf, logprobs, advantages, mask, off_policy=method, aggregation="token-mean")
        loss.backward()
        grads[method] = leaf.grad
    assert grads["tis"].abs().sum() > 0
    torch.testing.assert_close(grads["cispo"], grads["tis"])


_B1T2 = torch.zeros(1, 2)


@pytest.mark.parametrize(
    ("overrides", "fragments"),
    [
        pytest.param({"off_policy": "is"}, ["off_policy 'is'", "tis, mis, icepop"], id="unknown"),
        pytest.param({"sampling_logprobs": _B1T2, "is_floor": 0.5}, ["tis truncates", "no floor"], id="tis_floor"),
        pytest.param(
            {"sampling_logprobs": _B1T2, "off_policy": "mis", "is_floor": 3.0}, ["0 <= floor < cap"], id="floor_cap"
        ),
        pytest.param({"off_policy": "cispo", "sampling_logprobs": _B1T2}, ["as old_logprobs"], id="cispo_sampling"),
        pytest.param({"off_policy": "cispo", "dual_clip": 3.0}, ["no dual_clip"], id="cispo_dual"),
        pytest.param({"off_policy": "cispo", "ratio_level": "sequence"}, ["ratio_level token"], id="cispo_gspo"),
    ],
)
def test_bad_corrections_raise(overrides: dict, fragments: list[str]) -> None:
    arguments = {"logprobs": _B1T2, "old_logprobs": _B1T2, "advantages": torch.zeros(1), "mask": torch.ones(1, 2)}
    with pytest.raises(ValueError) as error:
        policy_loss(**arguments, **overrides)
    for fragment in fragments:
        assert fragment in str(error.value)


def test_each_correction_resolves_its_policy_and_bounds(tmp_path) -> None:
    def resolved(rollout: dict | None = None, **settings):
        algorithm = validate_config(small_config(tmp_path, rollout=rollout or {}, algorithm=settings)).algorithm
        return algorithm.old_logprobs, algorithm.is_floor, algorithm.is_cap

    stale = {"max_staleness": 1}
    assert resolved() == ("learner", None, None)  # tis on-policy: nothing to correct (as before off_policy)
    assert resolved(stale) == ("sampler", None, None)  # tis with stale samples: the ratio to the sampler
    assert resolved(off_policy="mis") == ("learner", None, 2.0)  # the engine-learner gap, even on-policy
    assert resolved(stale, off_policy="icepop") == ("learner", 0.5, 5.0)
    assert resolved(stale, off_policy="seq_mis", is_floor=0.9) == ("learner", 0.9, 2.0)
    assert resolved(stale, off_policy="seq_tis", is_cap=1.5) == ("learner", None, 1.5)
    assert resolved(off_policy="cispo") == ("sampler", None, None)  # CISPO's ratio is to the sampling policy
    assert resolved({"top_p": 0.9}, off_policy="cispo") == ("learner", None, None)  # a truncated sampler's is not
    refused = [
        ({"off_policy": "tis", "is_floor": 0.5}, "only the masking corrections"),
        ({"off_policy": "mis", "old_logprobs": "sampler"}, "needs algorithm.old_logprobs=learner"),
        ({"off_policy": "cispo", "is_cap": 2.0}, "clipped at 1 + algorithm.clip_high"),
        ({"off_policy": "cispo", "dual_clip": 3.0}, "no dual_clip"),
        ({"off_policy": "icepop", "is_cap": 0.4}, "needs an is_cap above it"),
        ({"off_policy": "mis", "is_cap": None, "is_floor": 0.5}, "needs an is_cap above it"),
        ({"off_policy": "ice"}, "off_policy"),
    ]
    for settings, message in refused:
        with pytest.raises((ConfigError, ValueError), match=re.escape(message)):
            validate_config(small_config(tmp_path, rollout=stale, algorithm=settings))

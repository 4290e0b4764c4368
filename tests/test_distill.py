"""On-policy distillation's parts, by hand, without actors: the per-token advantage and reverse KL, the loss they
enter, the batch the driver builds from the teacher's log-probs, the config's refusals, the pre-flight's tokenizer
check, the teacher's placement groups and memory plan. The real run is `test_distill_run.py`."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import small_config

from grpo_dist.algo import AGGREGATIONS, distill_advantages, group_baseline, policy_loss, reverse_kl
from grpo_dist.algo.batch import collate
from grpo_dist.cluster.placement import plan as placement_plan
from grpo_dist.config import ConfigError, validate_config
from grpo_dist.config.plan import Shape, plan
from grpo_dist.data import PromptRecord
from grpo_dist.models.tiny import build_tiny_model
from grpo_dist.run.inputs import check_teacher, load_tokenizer, tokenizer_difference
from grpo_dist.run.rollouts import Rollout, add_distillation, compute_advantages
from grpo_dist.types import Completion, Score


def test_the_distillation_advantage_is_coef_times_teacher_minus_student_on_counted_tokens():
    student = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -3.0, 0.0]])
    teacher = torch.tensor([[-0.5, -4.0, -0.5], [-2.1, -1.0, -9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    found = distill_advantages(student, teacher, mask, coef=0.5)
    # By hand: 0.5 * (t - s) where counted: row 0: 0.25, -1.0, (masked) 0; row 1: -1.0, 1.0, -4.5.
    torch.testing.assert_close(found, torch.tensor([[0.25, -1.0, 0.0], [-1.0, 1.0, -4.5]]))
    # Reverse KL per counted token: mean of s - t over 5 tokens: (-0.5 + 2.0 + 2.0 - 2.0 + 9.0) / 5 = 2.1.
    assert reverse_kl(student, teacher, mask) == pytest.approx(2.1)
    assert math.isnan(reverse_kl(student, teacher, torch.zeros_like(mask)))
    with pytest.raises(ValueError, match=r"must all be \[B, T\]"):
        distill_advantages(student, teacher[:, :2], mask, coef=1.0)


def test_token_advantages_add_to_each_sequence_advantage_in_the_loss():
    """At ratio 1 the clipped surrogate is -A per token; with per-token advantages A_seq + A_tok, aggregated."""
    logprobs = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, -0.5]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    sequence = torch.tensor([1.0, -2.0])
    tokens = torch.tensor([[0.5, -1.5, 7.0], [0.0, 3.0, 1.0]])  # the masked 7.0 never counts
    loss, _ = policy_loss(logprobs, logprobs.detach(), sequence, mask, token_advantages=tokens)
    # seq-mean-token-mean: row 0: -(1.5 + -0.5) / 2 = -0.5; row 1: -(-2 + 1 - 2) / 3... each token -(A + a):
    # row 1 tokens: -(-2 + 0), -(-2 + 3), -(-2 + 1) = 2, -1, 1 -> mean 2/3; loss = (-0.5 + 2/3) / 2 = 1/12.
    assert loss.item() == pytest.approx(1 / 12)
    loss.backward()
    # d loss / d logprob = -(A + a) * ratio / (tokens of the row) / B at ratio 1.
    expected = torch.tensor([[-1.5 / 4, 0.5 / 4, 0.0], [2 / 6, -1 / 6, 1 / 6]])
    torch.testing.assert_close(logprobs.grad, expected)
    alone, _ = policy_loss(logprobs, logprobs.detach(), torch.zeros(2), mask, token_advantages=tokens)
    without, _ = policy_loss(logprobs, logprobs.detach(), sequence, mask)
    assert alone.item() + without.item() == pytest.approx(loss.item())  # the two advantages add
    with pytest.raises(ValueError, match="token_advantages has shape"):
        policy_loss(logprobs, logprobs.detach(), sequence, mask, token_advantages=tokens[:, :2])


@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_a_tokens_own_advantage_moves_that_token_alone_under_every_aggregation(aggregation, ratio_level):
    """Sequence advantages 0, one token's advantage positive and another's negative: at ratio 1 the gradient raises
    the first token's log-prob, lowers the second's and leaves every other token (the masked one too) alone, under
    each loss aggregation and ratio level (GSPO's becomes GSPO-token's); the two kinds of advantage add in the loss,
    and a sequence's advantage spread over its tokens trains as it does given per sequence."""
    logprobs = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, -0.5]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    tokens = torch.tensor([[0.0, 2.0, 5.0], [0.0, 0.0, -1.0]])  # 5.0 is on a masked token
    options = {"aggregation": aggregation, "ratio_level": ratio_level, "max_length": 3}
    loss, _ = policy_loss(logprobs, logprobs.detach(), torch.zeros(2), mask, token_advantages=tokens, **options)
    loss.backward()
    grad = logprobs.grad
    assert grad[0, 1] < 0 < grad[1, 2]  # minimising the loss raises token (0, 1) and lowers token (1, 2)
    assert grad[0, 0] == grad[0, 2] == grad[1, 0] == grad[1, 1] == 0
    sequence = torch.tensor([1.0, -2.0])
    both, _ = policy_loss(logprobs, logprobs.detach(), sequence, mask, token_advantages=tokens, **options)
    without, _ = policy_loss(logprobs, logprobs.detach(), sequence, mask, **options)
    assert both.item() == pytest.approx(loss.item() + without.item())
    # One advantage per sequence given as token advantages trains as the sequence's own does, off ratio 1 too.
    old = logprobs.detach() + torch.tensor([[0.05, -0.1, 0.0], [0.1, 0.0, -0.05]])  # ratios inside the clip range
    as_sequence = logprobs.detach().clone().requires_grad_(True)
    as_tokens = logprobs.detach().clone().requires_grad_(True)
    policy_loss(as_sequence, old, sequence, mask, **options)[0].backward()
    spread = sequence[:, None] * mask  # [B, T]
    policy_loss(as_tokens, old, torch.zeros(2), mask, token_advantages=spread, **options)[0].backward()
    torch.testing.assert_close(as_tokens.grad, as_sequence.grad)


def completion(index: int, tokens: list[int], logprobs: list[float], teacher: list[float] | None, mask=None):
    return Completion(index, [1, 2], tokens, "", logprobs, "stop", 0, mask=mask, teacher_logprobs=teacher)


def distill_config(tmp_path, **distill):
    raw = small_config(tmp_path, rollout={"group_size": 2})
    raw["reward"]["functions"] = [{"name": "math_answer", "weight": 1.0}]
    raw["algorithm"]["distill"] = {"teacher": str(tmp_path / "teacher"), **distill}
    return validate_config(raw)


def test_the_batch_gets_each_sampled_tokens_distillation_advantage_from_the_teachers_log_probs(tmp_path):
    completions = [
        completion(0, [5, 6], [-1.0, -2.0], [-0.5, -2.5]),
        completion(0, [5, 6, 7], [-1.0, 0.0, -3.0], [-2.0, -9.0, -1.0], mask=[1, 0, 1]),  # 6: an observation token
        completion(1, [8], [-0.25], None),  # its teacher engine was lost twice
        completion(1, [9, 4], [-0.75, -1.0], [-0.75, math.nan]),  # 4: past the teacher's positions, not scored
    ]
    rollout = Rollout(
        [PromptRecord("p0", [1, 2], {}, 0), PromptRecord("p1", [1, 2], {}, 1)],
        completions,
        [Score(1.0, [1.0]), Score(0.0, [0.0]), Score(1.0, [1.0]), Score(1.0, [1.0])],
    )
    pure = distill_config(tmp_path, coef=2.0, baseline="none")
    with_rewards = distill_config(tmp_path, coef=2.0, with_rewards=True)
    rewards, advantages = compute_advantages(pure, rollout)
    assert rewards.tolist() == [1.0, 0.0, 1.0, 1.0] and advantages.tolist() == [0.0] * 4  # the teacher alone
    _, grpo = compute_advantages(with_rewards, rollout)
    assert grpo[0] > 0 > grpo[1]  # the rewards' advantages kept

    batch, metrics = add_distillation(pure, collate(completions, advantages, pad_token_id=0), completions)
    # Completion tokens start at position 2 (after the prompt [1, 2]); 2 x (teacher - student) where counted.
    expected = torch.zeros(4, 5)
    expected[0, 2:4] = torch.tensor([1.0, -1.0])
    expected[1, 2:5] = torch.tensor([-2.0, 0.0, 4.0])  # the observation token gets none
    torch.testing.assert_close(batch.token_advantages, expected)
    # Reverse KL over the 5 counted tokens (row 3's NaN is none): (-0.5 + 0.5 + 1.0 - 2.0 + 0.0) / 5.
    assert metrics["distill/reverse_kl"] == pytest.approx(-0.2)
    assert batch.select(torch.tensor([1])).token_advantages.tolist() == [expected[1].tolist()]
    assert add_distillation(validate_config(small_config(tmp_path)), batch, completions) == (batch, {})

    # The group baseline (the default): group 0 has rows 0 and 1, counted at completion positions 0 (1.0 and
    # -2.0) and 2 (row 1 alone: 4.0, kept); row 0's position 1 (-1.0) has no counted token of row 1 beside it (an
    # observation), so it is kept too. Group 1: row 2 unscored, row 3 alone (0.0).
    baselined, _ = add_distillation(with_rewards, collate(completions, grpo, pad_token_id=0), completions)
    expected[0, 2], expected[1, 2] = 1.0 - -2.0, -2.0 - 1.0
    torch.testing.assert_close(baselined.token_advantages, expected)


def test_the_group_baseline_subtracts_the_other_rows_mean_at_the_same_completion_position():
    advantages = torch.tensor(
        [
            [9.0, 1.0, 2.0, 0.0],  # group 0, completion from position 1
            [9.0, 9.0, 4.0, 6.0],  # group 0, completion from position 2
            [9.0, 3.0, 8.0, 0.0],  # group 0, completion from position 1
            [9.0, 5.0, 0.0, 0.0],  # group 1, completion from position 1
        ]
    )
    mask = torch.tensor([[0, 1, 1, 0], [0, 0, 1, 1], [0, 1, 1, 0], [0, 1, 0, 0]])
    groups, starts = torch.tensor([0, 0, 0, 1]), torch.tensor([1, 2, 1, 1])
    found = group_baseline(advantages, mask, groups, starts)
    # Group 0, completion position 0: rows 0, 1, 2 hold 1, 4, 3; position 1: rows 0, 1, 2 hold 2, 6, 8.
    # Leave-one-out: 1 - 3.5, 4 - 2, 3 - 2.5; 2 - 7, 6 - 5, 8 - 4. Row 3 is alone in group 1: kept.
    expected = torch.tensor([[0.0, -2.5, -5.0, 0.0], [0.0, 0.0, 2.0, 1.0], [0.0, 0.5, 4.0, 0.0], [0.0, 5.0, 0.0, 0.0]])
    torch.testing.assert_close(found, expected)


def test_the_config_refuses_pure_distillation_with_dynamic_sampling_and_tensor_parallelism_without_gpus(tmp_path):
    raw = small_config(tmp_path, algorithm={"dynamic_sampling": True, "distill": {"teacher": "t"}})
    with pytest.raises(ConfigError, match="pure distillation"):
        validate_config(raw)
    raw["algorithm"]["distill"]["with_rewards"] = True
    validate_config(raw)
    raw["algorithm"]["distill"]["tensor_parallel_size"] = 2
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=2 needs algorithm.distill.num_gpus=1"):
        validate_config(raw)


def test_a_teacher_with_another_tokenizer_is_refused_naming_a_token_that_differs(tmp_path):
    student = build_tiny_model(tmp_path / "student", characters="0123456789 :")
    same = build_tiny_model(tmp_path / "same", characters="0123456789 :", seed=1, num_layers=3)
    other = build_tiny_model(tmp_path / "other", characters="0123456789 :+")
    cfg = distill_config(tmp_path)
    tokenizer = load_tokenizer(str(student))
    assert tokenizer_difference(tokenizer, load_tokenizer(str(same))) is None
    check_teacher(cfg, tokenizer, str(student), str(same))  # another model, the same tokens: taken
    with pytest.raises(ConfigError, match=r"has another tokenizer than the student .*'\+' is missing in the student"):
        check_teacher(cfg, tokenizer, str(student), str(other))


def test_each_teacher_engine_gets_a_placement_group_and_a_line_in_the_memory_plan(tmp_path):
    raw = small_config(tmp_path, learner={"num_gpus": 1}, rollout={"num_gpus": 1})
    raw["algorithm"]["distill"] = {"teacher": "t", "num_engines": 2, "num_gpus": 1, "tensor_parallel_size": 1}
    cfg = validate_config(raw)
    roles = {request.role: request for request in placement_plan(cfg)}
    assert roles["teacher 0"].bundles == [{"CPU": 1.0, "GPU": 1.0}] and "teacher 1" in roles
    raw["algorithm"]["distill"]["tensor_parallel_size"] = 2
    wide = {request.role: request for request in placement_plan(validate_config(raw))}["teacher 1"]
    assert (wide.bundles, wide.strategy) == ([{"CPU": 1.0, "GPU": 1.0}] * 2, "STRICT_PACK")

    student = Shape.of(build_tiny_model(tmp_path / "student"))
    teacher = Shape.of(build_tiny_model(tmp_path / "teacher", hidden_size=256, num_heads=4, num_layers=4))
    planned = plan(cfg, student, teacher)
    assert planned.teacher["weights"] == pytest.approx(2 * teacher.params / 1e9)  # bfloat16 on a GPU
    assert planned.teacher["log-probs of one sequence"] == pytest.approx(32 * teacher.vocab * 8 / 1e9)
    assert any(line.startswith("  teacher engine:") for line in planned.lines())
    assert plan(cfg, student).teacher is None  # no teacher shape: not planned


def test_a_distillation_run_reserves_cpus_for_its_teacher_engines_and_its_eval_starts_none(tmp_path):
    from grpo_dist.cluster.ray_cluster import actor_cpus
    from grpo_dist.run.evaluation import eval_config

    raw = small_config(tmp_path)
    plain = validate_config(raw)
    raw["algorithm"]["distill"] = {"teacher": "t", "num_engines": 2, "num_cpus": 1.5}
    cfg = validate_config(raw)
    assert actor_cpus(cfg) == actor_cpus(plain) + 3.0
    assert eval_config(cfg, str(tmp_path), None).algorithm.distill is None  # `grpo-dist eval` judges the policy

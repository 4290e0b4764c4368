"""The learner group alone (DeepSpeed on gloo, no vLLM): ZeRO stages, accumulation, epochs and mini-batches, and
2 ranks training exactly as 1."""

from __future__ import annotations

import math
import os

import pytest
import torch
from conftest import small_config

from grpo_dist.algo import group_advantages
from grpo_dist.algo.batch import collate
from grpo_dist.config import validate_config
from grpo_dist.types import Completion

pytestmark = pytest.mark.slow


def fake_rollout(group_size: int = 4, groups: int = 2) -> list[Completion]:
    """Completions with distinct tokens and lengths, as a generator would return them."""
    completions = []
    for index in range(groups * group_size):
        tokens = [4 + (index * 3 + k) % 20 for k in range(1 + index % 3)] + [2]
        completions.append(Completion(index // group_size, [10, 11, 12], tokens, "", [-1.0] * len(tokens), "stop", 0))
    return completions


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from grpo_dist.models import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("model")))


def start_group(ray_cluster, tmp_path, model_dir, learner: dict, algorithm: dict, **sections):
    """A learner group on the tiny model (no vLLM, no generators)."""
    from grpo_dist.cluster.learner_group import LearnerGroup

    cfg = validate_config(small_config(tmp_path, learner=learner, algorithm=algorithm, **sections))
    return LearnerGroup.start(cfg, model_dir)


def sample_batch():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0, 0.0, 1.0, 1.0, 0.2])
    return collate(fake_rollout(), group_advantages(rewards, 4), pad_token_id=0)


@pytest.mark.parametrize("zero_stage", [0, 3], ids=["zero0", "zero3"])
def test_one_update_changes_weights_and_exports_full_tensors(ray_cluster, tmp_path, model_dir, zero_stage):
    from safetensors.torch import load_file

    group = start_group(ray_cluster, tmp_path, model_dir, {"zero_stage": zero_stage, "micro_batch_size": 3}, {})
    metrics = group.train(sample_batch())
    weights = ray_cluster.get(group.state_dict())
    initial = load_file(f"{model_dir}/model.safetensors")
    assert {name: tuple(t.shape) for name, t in weights.items() if name in initial} == {
        name: tuple(t.shape) for name, t in initial.items()
    }
    assert any(not torch.equal(weights[name], initial[name]) for name in initial)
    assert metrics["ratio/mean"] == 1.0  # one epoch, one mini-batch: old logprobs are the current ones
    assert metrics["grad_norm"] > 0
    assert "kl" in metrics  # kl_coef is 0.04: the reference model is loaded
    group.shutdown()


@pytest.mark.parametrize("zero_stage", [0, 3], ids=["zero0-bare-adamw", "zero3-deepspeed"])
def test_a_batch_with_poisoned_rewards_leaves_the_weights_as_they_were_and_the_next_one_trains(
    ray_cluster, tmp_path, model_dir, zero_stage
):
    """NaN rewards make NaN advantages, a NaN loss and gradient: the update is dropped (by the learner itself with a
    bare optimizer, by DeepSpeed's under ZeRO), and a healthy batch after it trains as usual."""
    from safetensors.torch import load_file

    group = start_group(ray_cluster, tmp_path, model_dir, {"zero_stage": zero_stage, "micro_batch_size": 3}, {})
    initial = load_file(f"{model_dir}/model.safetensors")
    poisoned = collate(fake_rollout(), torch.full((8,), math.nan), pad_token_id=0)
    metrics = group.train(poisoned)
    assert metrics["learner/skipped"] == 1.0 and not math.isfinite(metrics["grad_norm"])
    weights = ray_cluster.get(group.state_dict())
    assert all(torch.equal(weights[name], initial[name]) for name in initial)
    assert group.train(sample_batch())["learner/skipped"] == 0.0
    weights = ray_cluster.get(group.state_dict())
    assert all(torch.isfinite(tensor).all() for tensor in weights.values())
    assert any(not torch.equal(weights[name], initial[name]) for name in initial)
    group.shutdown()


def test_epochs_and_mini_batches_move_the_ratio_off_one(ray_cluster, tmp_path, model_dir):
    algorithm = {"ppo_epochs": 2, "mini_batches": 2, "kl_coef": 0.0, "is_cap": 2.0}
    group = start_group(ray_cluster, tmp_path, model_dir, {"micro_batch_size": 2}, algorithm)
    metrics = group.train(sample_batch())
    # Four updates; all but the first see weights that moved since the old logprobs were taken.
    assert metrics["ratio/max"] > 1.0
    # With kl_coef 0 the reference model is never loaded.
    assert group.call("__ray_call__", lambda self: self.reference is None) == [True]
    assert "kl" not in metrics
    # is_cap set: the generator's sampling logprobs enter the loss as truncated importance weights.
    assert 0 < metrics["is_weight/mean"] <= 2.0
    group.shutdown()


def test_old_logprobs_sampler_takes_the_ratio_against_the_sampling_policy(ray_cluster, tmp_path, model_dir):
    """Sampling logprobs set to the learner's own minus ln 2 (a sampler half as likely to pick each token): every
    ratio is then 2, so exactly the positive-advantage tokens are clipped, though the learner's weights have not
    moved (with `learner` the ratio would be 1)."""
    group = start_group(ray_cluster, tmp_path, model_dir, {"micro_batch_size": 8}, {"old_logprobs": "sampler"})
    completions = fake_rollout()
    for completion in completions:
        (own,) = group.call("sequence_logprobs", completion.prompt_token_ids + completion.token_ids)
        completion.logprobs = [logprob - math.log(2) for logprob in own[-len(completion.token_ids) :]]
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0, 0.0, 1.0, 1.0, 0.2])
    batch = collate(completions, group_advantages(rewards, 4), pad_token_id=0)
    metrics = group.train(batch)
    positive = (batch.completion_mask * (batch.advantages > 0)[:, None]).sum() / batch.completion_mask.sum()
    assert metrics["ratio/mean"] == pytest.approx(2.0, rel=1e-4)
    assert metrics["clip_fraction/high"] == pytest.approx(positive.item(), rel=1e-6)
    assert metrics["clip_fraction/low"] == 0.0
    assert "is_weight/mean" not in metrics  # the ratio is the importance weight: no second one
    group.shutdown()


@pytest.mark.parametrize(
    "zero_stage, offload, budget",
    [
        pytest.param(2, "none", None, id="zero2"),
        pytest.param(3, "none", None, id="zero3"),
        pytest.param(3, "optimizer_and_params", None, id="zero3-offload"),
        pytest.param(2, "none", 8, id="zero2-token-budget"),
    ],
)
def test_two_ranks_train_exactly_as_one(ray_cluster, tmp_path, model_dir, zero_stage, offload, budget, monkeypatch):
    """The same batch on 1 rank and on 2 ranks (split by tokens, losses weighted by share): the same loss, grad
    norm and updated weights. token-mean weighs rows by their tokens, the hardest case; two mini-batches run the
    old-logprob pass and two optimizer steps; kl_coef > 0 puts the reference on the ranks (sharded under ZeRO-3).
    With offload the 2 ranks step DeepSpeed's CPU Adam on offloaded state and still match 1 rank's torch AdamW.
    With a token budget the 2 ranks pack micro-batches of at most 8 tokens (one 5-7 token row each) and the 1 rank
    pads (`learner.packing: false`) micro-batches of 2 rows: packing changes no number. The 1 rank runs as one of 2
    runs sharing the machine (`GRPO_DIST_CPU_SHARE`), the 2 ranks as the machine's only run: each rank's torch threads
    are the cores divided among the node's ranks and runs."""
    algorithm = {"aggregation": "token-mean", "mini_batches": 2, "kl_coef": 0.04}
    sections = {} if budget is None else {"data": {"max_prompt_tokens": 4}}  # sequences of at most 4 + 4 tokens
    results = []
    for ranks in (1, 2):
        learner = {"num_ranks": ranks, "zero_stage": zero_stage, "micro_batch_size": 2}
        if ranks == 2:
            learner.update(offload=offload, max_tokens_per_micro_batch=budget)
        elif budget is not None:
            learner["packing"] = False
        sharing = 3 - ranks
        monkeypatch.setenv("GRPO_DIST_CPU_SHARE", str(sharing))
        group = start_group(ray_cluster, tmp_path, model_dir, learner, algorithm, **sections)
        assert group.threads == [max(1, len(os.sched_getaffinity(0)) // (ranks * sharing))] * ranks
        metrics = group.train(sample_batch())
        results.append((metrics, ray_cluster.get(group.state_dict())))
        group.shutdown()
    (one, weights_one), (two, weights_two) = results
    for key in ("loss", "loss/policy", "kl", "grad_norm"):
        assert two[key] == pytest.approx(one[key], rel=1e-5, abs=1e-7), key
    assert weights_one.keys() == weights_two.keys()
    # Adam's first steps move each weight by about lr = 1e-2 whatever its gradient's size, so float noise in a
    # near-zero gradient (packed rows summed in another order) shows as up to ~1e-4 here; a wrong gradient would
    # show as ~1e-2.
    for name in weights_one:
        torch.testing.assert_close(weights_two[name], weights_one[name], atol=1e-3, rtol=1e-4)


def test_a_lora_policy_trains_its_adapter_alone_against_the_base_and_saves_it_merged_and_as_an_adapter(
    ray_cluster, tmp_path, model_dir
):
    """`learner.lora` on 2 ranks under ZeRO-3 (every weight sharded): only the adapter's weights take gradients;
    step 1 starts at the base (B is zero) so its KL to the reference is exactly 0, and step 2's is not: the
    reference is the base with the adapter off, not the policy. What leaves the learner is the policy merged under
    the base's names: the adapted weights moved, every other weight is the initial model's bit for bit. A step
    after loading a checkpoint equals the step after saving it. `final/`'s adapter, loaded by PEFT onto the
    initial model and merged, gives the same weights."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    learner = {"num_ranks": 2, "zero_stage": 3, "micro_batch_size": 3, "lr": 5e-2, "lora": {"rank": 4, "alpha": 8}}
    group = start_group(ray_cluster, tmp_path, model_dir, learner, {"kl_coef": 0.04})
    (trained, _) = group.call("__ray_call__", trainable_names)
    assert trained and all(".lora_A." in name or ".lora_B." in name for name in trained), trained
    first, second = group.train(sample_batch()), group.train(sample_batch())
    assert first["kl"] == 0.0 and second["kl"] > 0
    merged = ray_cluster.get(group.state_dict())
    # The checkpoint (the adapter and its optimizer state): step 3 from it is step 3 without it, to the bit.
    group.save_checkpoint(str(tmp_path / "checkpoint"))
    third = group.train(sample_batch())
    group.load_checkpoint(str(tmp_path / "checkpoint"), 2)
    loaded = ray_cluster.get(group.state_dict())
    assert loaded.keys() == merged.keys() and all(torch.equal(loaded[name], merged[name]) for name in merged)
    again = group.train(sample_batch())
    assert (again["loss"], again["kl"], again["grad_norm"]) == (third["loss"], third["kl"], third["grad_norm"])
    merged = ray_cluster.get(group.state_dict())
    out = group.save(str(tmp_path / "final"))
    group.shutdown()

    initial = load_file(f"{model_dir}/model.safetensors")
    assert merged.keys() >= initial.keys()  # and the output embedding, tied to the input's
    moved = {name for name in initial if not torch.equal(merged[name], initial[name])}
    adapted = {name for name in initial if name.endswith("_proj.weight")}
    assert moved == adapted, (sorted(moved), sorted(adapted))
    saved = load_file(f"{out}/model.safetensors")
    assert all(torch.equal(saved[name], merged[name]) for name in initial)

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    by_peft = PeftModel.from_pretrained(base, f"{out}/adapter").merge_and_unload().state_dict()
    for name in initial:
        torch.testing.assert_close(by_peft[name], merged[name], rtol=1e-6, atol=1e-6)


def trainable_names(learner) -> list[str]:
    """The names of a learner rank's parameters that take gradients."""
    return [name for name, param in learner.engine.module.named_parameters() if param.requires_grad]


def test_per_token_advantages_alone_move_each_tokens_log_prob_their_way_under_lora_and_packing(
    ray_cluster, tmp_path, model_dir
):
    """On-policy distillation's update, on the learner alone: every sequence advantage 0, each completion token's
    own advantage +1 in the first group and -1 in the second (as a teacher that likes one group's tokens and not
    the other's would give), a LoRA adapter trained on packed micro-batches. The merged policy gives the first
    group's tokens a higher log-probability than the initial model did, the second's a lower one."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    completions = fake_rollout()
    batch = collate(completions, torch.zeros(len(completions)), pad_token_id=0)
    sign = torch.tensor([1.0] * 4 + [-1.0] * 4)[:, None]  # [B, 1]: group 0 liked, group 1 not
    batch = batch.with_token_advantages(sign * batch.completion_mask)
    learner = {"micro_batch_size": 3, "lr": 5e-2, "packing": True, "lora": {"rank": 4, "alpha": 8}}
    group = start_group(ray_cluster, tmp_path, model_dir, learner, {"kl_coef": 0.0, "aggregation": "token-mean"})
    metrics = group.train(batch)
    merged = ray_cluster.get(group.state_dict())
    group.shutdown()
    assert metrics["grad_norm"] > 0

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

    def completion_logprob() -> torch.Tensor:
        """[B] each row's mean log-prob of its completion tokens under `model`."""
        with torch.no_grad():
            logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
        taken = logits.log_softmax(-1).gather(-1, batch.input_ids[:, 1:, None])[..., 0]  # [B, T-1]
        mask = batch.completion_mask[:, 1:]
        return (taken * mask).sum(-1) / mask.sum(-1)

    before = completion_logprob()
    initial = load_file(f"{model_dir}/model.safetensors")
    model.load_state_dict({name: merged[name] for name in initial}, strict=False)
    moved = completion_logprob() - before
    assert (moved[:4] > 0).all() and (moved[4:] < 0).all(), moved

"""The learner actor alone (DeepSpeed on gloo, no vLLM): ZeRO stages, accumulation, epochs and mini-batches."""

from __future__ import annotations

import pytest
import torch

from grpo_dist.batch import collate
from grpo_dist.config import AlgorithmConfig, LearnerConfig, RolloutConfig
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


def start_learner(ray_cluster, model_dir, learner: LearnerConfig, algorithm: AlgorithmConfig):
    from grpo_dist.actors.learner import Learner

    return (
        ray_cluster.remote(Learner)
        .options(num_cpus=1)
        .remote(model_dir, learner, algorithm, RolloutConfig(max_new_tokens=8), 0)
    )


@pytest.mark.parametrize("zero_stage", [0, 3], ids=["zero0", "zero3"])
def test_one_update_changes_weights_and_exports_full_tensors(ray_cluster, model_dir, zero_stage):
    from safetensors.torch import load_file

    learner = start_learner(
        ray_cluster, model_dir, LearnerConfig(lr=1e-2, zero_stage=zero_stage, micro_batch_size=3), AlgorithmConfig()
    )
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0, 0.0, 1.0, 1.0, 0.2])
    from grpo_dist.algo import group_advantages

    batch = collate(fake_rollout(), group_advantages(rewards, 4), pad_token_id=0)
    metrics = ray_cluster.get(learner.train.remote(batch))
    weights = ray_cluster.get(learner.state_dict.remote())
    initial = load_file(f"{model_dir}/model.safetensors")
    assert {name: tuple(t.shape) for name, t in weights.items() if name in initial} == {
        name: tuple(t.shape) for name, t in initial.items()
    }
    assert any(not torch.equal(weights[name], initial[name]) for name in initial)
    assert metrics["ratio/mean"] == 1.0  # one epoch, one mini-batch: old logprobs are the current ones
    assert metrics["grad_norm"] > 0
    assert "kl" in metrics  # kl_coef defaults to 0.04: the reference model is loaded
    ray_cluster.kill(learner)


def test_epochs_and_mini_batches_move_the_ratio_off_one(ray_cluster, model_dir):
    learner = start_learner(
        ray_cluster,
        model_dir,
        LearnerConfig(lr=1e-2, micro_batch_size=2),
        AlgorithmConfig(ppo_epochs=2, mini_batches=2, kl_coef=0.0, is_cap=2.0),
    )
    from grpo_dist.algo import group_advantages

    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0, 0.0, 1.0, 1.0, 0.2])
    batch = collate(fake_rollout(), group_advantages(rewards, 4), pad_token_id=0)
    metrics = ray_cluster.get(learner.train.remote(batch))
    # Four updates; all but the first see weights that moved since the old logprobs were taken.
    assert metrics["ratio/max"] > 1.0
    # With kl_coef 0 the reference model is never loaded.
    assert ray_cluster.get(learner.__ray_call__.remote(lambda self: self.reference is None))
    assert "kl" not in metrics
    # is_cap set: the generator's sampling logprobs enter the loss as truncated importance weights.
    assert 0 < metrics["is_weight/mean"] <= 2.0
    ray_cluster.kill(learner)

"""Each ready config in configs/ runs a few steps of the real loop, shrunk to a tiny model on a CPU."""

from __future__ import annotations

import json
import math

import pytest
from conftest import REPO

pytestmark = pytest.mark.slow

SHRINK = [
    "run.steps=2",
    "data.eval_path=null",
    "data.max_prompt_tokens=16",
    "data.prompts_per_step=4",
    "rollout.num_generators=1",
    "rollout.num_gpus=0",
    "rollout.group_size=4",
    "rollout.max_new_tokens=4",
    "rollout.max_model_len=32",
    "rollout.dtype=float32",
    "rollout.cpu_kv_cache_gib=0.05",
    "reward.num_workers=1",
    "reward.functions=[{name: reward_fixtures.first_char_reward}]",
    "learner.num_gpus=0",
    "learner.micro_batch_size=8",
    "learner.lr=1e-3",
    "wandb.enabled=false",
]

# What each recipe must show in its metrics: the setting that makes it that recipe took effect.
SIGNATURES = {
    "grpo": lambda row: row["kl"] >= 0 and row["ratio/mean"] == 1.0,
    "dapo": lambda row: "dynamic_sampling/dropped_fraction" in row and "reward/shaped_mean" in row,
    "dr_grpo": lambda row: "kl" not in row,
    "gspo": lambda row: row["clip_fraction"] >= 0 and "kl" not in row,
}


@pytest.fixture(scope="module")
def tiny_inputs(tmp_path_factory):
    from grpo_dist.data import split_task
    from grpo_dist.models import build_tiny_model

    root = tmp_path_factory.mktemp("recipes")
    train_path, _ = split_task("last_digit", root / "data", num_train=32, num_eval=4, seed=0)
    return str(build_tiny_model(root / "model")), str(train_path)


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_recipe_runs(ray_cluster, tiny_inputs, tmp_path, name):
    from grpo_dist.cluster import Cluster
    from grpo_dist.config import load_config
    from grpo_dist.driver import train

    model_path, train_path = tiny_inputs
    overrides = [*SHRINK, f"model.path={model_path}", f"data.train_path={train_path}", f"run.output_dir={tmp_path}"]
    if name == "dapo":
        overrides += ["algorithm.overlong_buffer=2", "algorithm.max_sampling_rounds=2"]
    cfg = load_config(REPO / "configs" / f"{name}.yaml", overrides)
    cluster = Cluster.start(cfg, model_path)
    try:
        run_dir = train(cfg, cluster)
    finally:
        cluster.shutdown()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]
    assert all(math.isfinite(row["loss"]) and SIGNATURES[name](row) for row in rows)

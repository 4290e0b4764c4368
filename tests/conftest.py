"""Shared fixtures: a local Ray cluster for the integration tests and a small config for the real loop."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).parent
REPO = TESTS_DIR.parent


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster for every integration test; its workers can import tests/reward_fixtures.py."""
    import ray

    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS_DIR), os.environ.get("PYTHONPATH")]))
    os.environ.setdefault("WANDB_MODE", "offline")
    ray.init(num_cpus=8, include_dashboard=False, runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}})
    yield ray
    ray.shutdown()


def small_config(tmp_path: Path, **sections) -> dict:
    """A raw config for a few fast steps of the real loop on a tiny model (sections override whole keys)."""
    raw = {
        "run": {"name": "test", "output_dir": str(tmp_path / "outputs"), "steps": 3, "seed": 0},
        "model": {"path": str(tmp_path / "model"), "tiny": {}},
        "data": {
            "task": {"name": "last_digit", "num_train": 64, "num_eval": 8},
            "max_prompt_tokens": 16,
            "prompts_per_step": 4,
        },
        "rollout": {"group_size": 4, "max_new_tokens": 4, "max_model_len": 32, "cpu_kv_cache_gib": 0.05},
        "reward": {
            "num_workers": 2,
            "timeout_s": 5,
            "functions": [
                {"name": "reward_fixtures.first_char_reward", "weight": 1.0},
                {"name": "math_answer", "weight": 0.5},
            ],
        },
        "algorithm": {"kl_coef": 0.04},
        "learner": {"lr": 1e-2, "micro_batch_size": 6, "zero_stage": 2},
        "eval": {"max_prompts": 8},
        "wandb": {"enabled": False},
    }
    for section, values in sections.items():
        raw[section] = {**raw.get(section, {}), **values}
    return raw


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` are skipped where no CUDA GPU is present."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

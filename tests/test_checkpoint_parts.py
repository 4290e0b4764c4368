"""A checkpoint is whole only when its manifest lists every learner rank's part and every file verifies: one
without a manifest (half deleted by an interrupted prune) or missing a rank's shard (a learner node that wrote or
uploaded nothing) is never resumed from, on a path (here) or in an object store (`test_object_store.py`)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from conftest import small_config

from grpo_dist.config import ConfigError, validate_config
from grpo_dist.run import checkpoints
from grpo_dist.storage import manifest
from grpo_dist.storage.run_dir import open_run

SHARDS = ("mp_rank_00_model_states.pt", "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
          "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt")  # fmt: skip


def fake_checkpoint(directory: Path, num_ranks: int, zero_stage: int, shards=SHARDS) -> Path:
    """The files a checkpoint of `num_ranks` learner ranks holds (their contents aside), with its manifest."""
    raw = small_config(directory, learner={"num_ranks": num_ranks, "zero_stage": zero_stage})
    (directory / "learner" / "state").mkdir(parents=True)
    for shard in shards:
        (directory / "learner" / "state" / shard).write_bytes(b"shard")
    (directory / "run_state.pt").write_bytes(b"state")
    (directory / "config.yaml").write_text(yaml.safe_dump(validate_config(raw).model_dump(mode="json")))
    manifest.write(directory)
    return directory


def a_run(tmp_path: Path):
    return open_run(validate_config(small_config(tmp_path)))[1]


def test_a_checkpoint_with_every_ranks_part_is_taken(tmp_path):
    checkpoint = fake_checkpoint(tmp_path / "step-000001", num_ranks=2, zero_stage=2)
    assert checkpoints.find(a_run(tmp_path), str(checkpoint)).path == checkpoint


@pytest.mark.parametrize(
    "zero_stage, shards, said",
    [(2, SHARDS[:2], "no optimizer shard of learner rank(s) 1"), (3, SHARDS[1:], "no learner model states")],
    ids=["a-rank-wrote-nothing", "no-model-states"],
)
def test_a_checkpoint_missing_a_ranks_part_is_refused_naming_it(tmp_path, zero_stage, shards, said):
    checkpoint = fake_checkpoint(tmp_path / "step-000001", 2, zero_stage, shards)
    with pytest.raises(ConfigError, match=f"is not a complete checkpoint: {re.escape(said)}"):
        checkpoints.find(a_run(tmp_path), str(checkpoint))


def test_a_checkpoint_without_its_manifest_is_never_resumed_from(tmp_path):
    checkpoint = fake_checkpoint(tmp_path / "step-000001", num_ranks=2, zero_stage=2)
    (checkpoint / manifest.MANIFEST).unlink()
    with pytest.raises(ConfigError, match=r"is not a complete checkpoint: no manifest.json \(an interrupted write"):
        checkpoints.find(a_run(tmp_path), str(checkpoint))

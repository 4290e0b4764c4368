"""The object store a run's files can live in (`grpo_dist.storage`), against an S3 server on this machine (moto):
trees up and down, a missing key, and what a run checks before it starts (the store answers; an earlier run there
is never overwritten; checkpoint.dir stays a path; the staging directory is never a planted link)."""

from __future__ import annotations

import stat

import pytest
from conftest import small_config

from grpo_dist.config import ConfigError, validate_config
from grpo_dist.storage import StorageError, Store, StoreError
from grpo_dist.storage.run_dir import PROBE, open_run, start_run_dir


def test_a_tree_goes_up_and_comes_back_whole(s3, tmp_path):
    tree = tmp_path / "up"
    (tree / "learner" / "state").mkdir(parents=True)
    (tree / "learner" / "state" / "shard.pt").write_bytes(b"\x00\x01" * 1000)
    (tree / "run_state.pt").write_text("state")
    store = Store(s3)
    store.upload(tree, "run/checkpoints/step-000001")
    assert store.children("run/checkpoints/step-000001") == ["learner", "run_state.pt"]
    down = tmp_path / "down"
    (down / "stale.txt").parent.mkdir()
    (down / "stale.txt").write_text("from before")
    store.download("run/checkpoints/step-000001", down)
    assert (down / "learner" / "state" / "shard.pt").read_bytes() == b"\x00\x01" * 1000
    assert sorted(path.name for path in down.iterdir()) == ["learner", "run_state.pt"]  # replaced, not merged
    store.write_text("run/checkpoints/latest", "step-000001\n")
    assert store.read_text("run/checkpoints/latest") == "step-000001\n"
    assert store.read_text("run/nothing") is None and store.children("run/nothing") == []
    with pytest.raises(StoreError, match="s3://bucket/runs/run/nothing: not there"):
        store.download("run/nothing", tmp_path / "x")
    store.delete("run/checkpoints/step-000001")
    assert store.children("run/checkpoints") == ["latest"]


def test_a_key_keeps_the_query_of_the_uri_it_is_under():
    store = Store("s3://bucket/runs?endpoint_override=127.0.0.1:1&scheme=http")
    assert store.name("grpo/final") == "s3://bucket/runs/grpo/final?endpoint_override=127.0.0.1:1&scheme=http"


def test_a_run_in_an_object_store_stages_locally_and_never_overwrites_an_earlier_run(s3, tmp_path):
    cfg = validate_config(small_config(tmp_path, run={"output_dir": s3, "staging_dir": str(tmp_path / "staging")}))
    cfg, run = open_run(cfg)
    assert cfg.object_store == s3 and cfg.run_dir == run.work == tmp_path / "staging" / "test" and run.staging
    assert cfg.shown("final") == f"{s3}/test/final" and cfg.checkpoints_shown == f"{s3}/test/checkpoints"
    assert run.checkpoints.name(run.checkpoints_key) == f"{s3}/test/checkpoints"
    Store(s3).write_text(f"test/{PROBE}", "a start that failed")
    start_run_dir(cfg, run)  # a probe alone is no earlier run
    Store(s3).write_text("test/metrics.jsonl", "{}\n")
    with pytest.raises(ConfigError, match=f"{s3}/test holds an earlier run: continue it with --resume"):
        start_run_dir(cfg, run)
    assert Store(s3).read_text("test/metrics.jsonl") == "{}\n"


def test_a_staging_directory_planted_as_a_link_stops_the_run_before_anything_is_written(s3, tmp_path):
    """The default staging directory is under /tmp, where anyone can plant `grpo-dist-staging` as a link to a
    directory they read: the run refuses it rather than stage its checkpoints there."""
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (tmp_path / "staging").symlink_to(theirs)
    cfg = validate_config(small_config(tmp_path, run={"output_dir": s3, "staging_dir": str(tmp_path / "staging")}))
    with pytest.raises(StorageError, match=r"run.staging_dir: .*/staging is a symbolic link .*remove it, or set"):
        open_run(cfg)
    assert list(theirs.iterdir()) == []
    (tmp_path / "staging").unlink()
    open_run(cfg)  # made here instead: this user's alone
    assert stat.S_IMODE((tmp_path / "staging").stat().st_mode) == 0o700 and (tmp_path / "staging" / "test").is_dir()


def test_a_store_that_does_not_answer_stops_the_run_before_it_starts(tmp_path):
    unknown = validate_config(small_config(tmp_path, run={"output_dir": "nosuch://bucket/runs"}))
    with pytest.raises(StorageError, match="run.output_dir: nosuch://bucket/runs: cannot open it as an object store"):
        open_run(unknown)
    closed = validate_config(
        small_config(tmp_path, run={"output_dir": "s3://bucket/runs?endpoint_override=127.0.0.1:9&scheme=http"})
    )
    with pytest.raises(StorageError, match="run.output_dir: s3://bucket/runs.*could not list it"):
        open_run(closed)


def test_checkpoint_dir_stays_a_path_beside_an_object_store(tmp_path):
    with pytest.raises(ConfigError, match="checkpoint.dir must be null with an object-store run.output_dir"):
        validate_config(small_config(tmp_path, run={"output_dir": "s3://b/r"}, checkpoint={"dir": str(tmp_path)}))
    with pytest.raises(ConfigError, match="checkpoint.dir='s3://b/c': an object store is set as run.output_dir"):
        validate_config(small_config(tmp_path, checkpoint={"dir": "s3://b/c"}))


def test_a_checkpoint_in_the_store_must_list_every_ranks_part_and_hold_each_file_at_its_size(s3, tmp_path):
    """What a learner node that uploaded nothing, or an upload cut short, leaves in the store is refused."""
    from test_checkpoint_parts import SHARDS, fake_checkpoint

    from grpo_dist.run import checkpoints
    from grpo_dist.storage import manifest

    run = open_run(validate_config(small_config(tmp_path)))[1]
    store = Store(s3)
    whole = fake_checkpoint(tmp_path / "whole", num_ranks=2, zero_stage=2)
    store.upload(whole, "run/whole")
    assert checkpoints.find(run, f"{s3}/run/whole").key == ""
    partial = fake_checkpoint(tmp_path / "partial", num_ranks=2, zero_stage=2, shards=SHARDS[:2])
    store.upload(partial, "run/partial")
    with pytest.raises(ConfigError, match="run/partial is not a complete checkpoint: no optimizer shard of learner"):
        checkpoints.find(run, f"{s3}/run/partial")
    store.delete(f"run/whole/learner/state/{SHARDS[2]}")  # listed in the manifest, gone from the store
    with pytest.raises(ConfigError, match=f"learner/state/{SHARDS[2]} is missing"):
        checkpoints.find(run, f"{s3}/run/whole")
    store.delete(f"run/whole/{manifest.MANIFEST}")
    with pytest.raises(ConfigError, match="run/whole is not a complete checkpoint: no manifest.json"):
        checkpoints.find(run, f"{s3}/run/whole")

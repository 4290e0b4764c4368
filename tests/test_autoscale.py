"""Generators that follow the bottleneck (`rollout.autoscale`): the decisions on hand-made step timings (no Ray),
and a real run on a local multi-node Ray cluster whose generation is slowed (`faults.inject.slow_generation_file`):
it asks for a second generator and Ray's autoscaler for its room, takes it in once a node joins, and gives it back
once generation is fast again, every step logged once."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import TESTS_DIR, headed_cluster, injected, small_config, warm_nodes
from test_overlap import UNTIL_STOPPED, stop, wait_for_row
from test_resume import training

from grpo_dist.config import AutoscaleConfig, ConfigError, validate_config
from grpo_dist.run.autoscale import Autoscaler


def timing(learner_idle: float, generator_idle: float, count: int = 1, joining: int = 0) -> dict[str, float]:
    return {"time/step": 10.0, "time/learner_idle": learner_idle, "time/generator_idle": generator_idle,
            "generators/count": float(count), "generators/joining": float(joining)}  # fmt: skip


def test_a_generator_is_added_after_patience_steps_of_the_learner_waiting_and_held_while_it_joins():
    scaler = Autoscaler(AutoscaleConfig(min=1, max=3, band=0.2, patience=2))
    # learner waits 6/10, generators 1/10: lean 0.5 > 0.2
    assert scaler.observe(timing(6.0, 1.0)) is None  # one step: not yet
    change = scaler.observe(timing(6.0, 1.0))
    assert change is not None and change.wanted == 2
    assert "the learner waited 60% of the step on generation, the generators 10% on the learner" in change.why
    assert scaler.observe(timing(6.0, 1.0, joining=1)) is None  # joining: held
    assert scaler.observe(timing(6.0, 1.0, count=2)) is None  # the streak starts again once it joined
    assert scaler.observe(timing(6.0, 1.0, count=2)).wanted == 3
    assert scaler.observe(timing(6.0, 1.0, count=3)) is None
    assert scaler.observe(timing(6.0, 1.0, count=3)) is None  # at max: nothing more to ask


def test_one_is_removed_when_the_generators_wait_and_nothing_moves_inside_the_band_or_on_a_broken_streak():
    scaler = Autoscaler(AutoscaleConfig(min=1, max=3, band=0.2, patience=2))
    # inside the band: lean 0.15
    assert [scaler.observe(timing(3.0, 1.5, count=2)) for _ in range(3)] == [None, None, None]
    # generators wait 7/10, learner 1/10: lean -0.6; a step the other way breaks the streak
    assert scaler.observe(timing(1.0, 7.0, count=2)) is None
    assert scaler.observe(timing(7.0, 1.0, count=2)) is None
    assert scaler.observe(timing(1.0, 7.0, count=2)) is None
    change = scaler.observe(timing(1.0, 7.0, count=2))
    assert change is not None and change.wanted == 1
    assert scaler.observe(timing(1.0, 7.0, count=1)) is None
    assert scaler.observe(timing(1.0, 7.0, count=1)) is None  # at min


def test_autoscale_bounds_are_checked_against_each_other_and_the_starting_count(tmp_path):
    with pytest.raises(ConfigError, match=r"rollout.autoscale.min \(3\) is above rollout.autoscale.max \(2\)"):
        validate_config(small_config(tmp_path, rollout={"autoscale": {"min": 3, "max": 2}}))
    with pytest.raises(ConfigError, match=r"rollout.num_generators \(4\) is outside rollout.autoscale's \[1, 2\]"):
        validate_config(small_config(tmp_path, rollout={"num_generators": 4, "autoscale": {"max": 2}}))
    assert Autoscaler(None).observe(timing(9.0, 0.0)) is None  # off: never a change


READ_DEMAND = """
import json, sys, ray
from ray.autoscaler._private.constants import AUTOSCALER_RESOURCE_REQUEST_CHANNEL
from ray.experimental.internal_kv import _internal_kv_get
ray.init(address=sys.argv[1], logging_level="ERROR")
print(json.dumps(json.loads(_internal_kv_get(AUTOSCALER_RESOURCE_REQUEST_CHANNEL) or b"[]")))
"""


def autoscaler_demand(address: str) -> list[dict]:
    """What the run asked Ray's autoscaler for, read where the autoscaler reads it."""
    done = subprocess.run([sys.executable, "-c", READ_DEMAND, address], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_slowed_generation_adds_a_generator_where_a_node_joins_and_restored_speed_removes_it(tmp_path, monkeypatch):
    """The head node has no CPUs, a worker node room for the run as it starts (learner rank, one generator, two
    reward workers). Each generator holds each group back 1 s: a step waits 8 s on generation against a second or
    two of training (more on a loaded machine: the margin is wide), so the run asks for a second generator and Ray's
    autoscaler for its room. The test plays the autoscaler: it reads the demand and adds a node, where the new
    generator starts and joins. Then generation is fast again, the generators wait on the learner, and the second
    generator is removed."""
    slow = tmp_path / "slow_s"
    slow.write_text("1.0")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(TESTS_DIR), os.environ.get("PYTHONPATH")])))
    with warm_nodes():
        cluster = headed_cluster()
        cluster.add_node(num_cpus=4)
    raw = small_config(
        tmp_path,
        run={"steps": UNTIL_STOPPED},
        ray={"address": cluster.address},
        data={"prompts_per_step": 8},  # 32 completions trained one at a time: training outlasts fast generation
        learner={"micro_batch_size": 1},
        rollout={"autoscale": {"min": 1, "max": 2, "patience": 2}},
        reward={"num_cpus": 1},  # a CPU each, so that the node is full: a second generator fits only on a new one
    )
    raw = injected(raw, slow_generation_file=str(slow))
    run_dir = tmp_path / "outputs" / "test"
    try:
        with training(tmp_path, raw) as run:
            wait_for_row(run_dir, run, lambda row: row["generators/joining"] == 1)
            asked = autoscaler_demand(cluster.address)
            with warm_nodes():
                cluster.add_node(num_cpus=1)  # as an autoscaler would, for the demand it read
            up = wait_for_row(run_dir, run, lambda row: row["generators/count"] == 2)
            slow.write_text("0")
            down = wait_for_row(run_dir, run, lambda row: row["step"] > up["step"] and row["generators/count"] == 1)
            after = autoscaler_demand(cluster.address)
            wait_for_row(run_dir, run, lambda row: row["step"] >= down["step"] + 1)
            stop(run, tmp_path)
    finally:
        cluster.shutdown()
    # The demand: every bundle of the run, the second generator's included, then without it.
    print(f"asked Ray's autoscaler for {asked}, then {after}")
    assert len(asked) == len(after) + 1 and asked.count({"CPU": 1.0}) == after.count({"CPU": 1.0}) + 1
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, len(rows) + 1))
    counts = [(int(row["generators/count"]), int(row["generators/joining"])) for row in rows]
    assert [c for i, c in enumerate(counts) if i == 0 or c != counts[i - 1]] == [(1, 0), (1, 1), (2, 0), (1, 0)]
    output = (tmp_path / "run.log").read_text()
    changes = [line for line in output.splitlines() if line.startswith("autoscale: ")]
    print("\n".join(changes))
    assert len(changes) == 2, changes
    assert changes[0].startswith("autoscale: 1 -> 2 generators: the learner waited")
    assert changes[1].startswith("autoscale: 2 -> 1 generators: the learner waited")
    up_share, down_share = (int(line.split("the generators ")[1].split("%")[0]) for line in changes)
    assert down_share > up_share  # the generators waited on the learner far longer once generation was fast

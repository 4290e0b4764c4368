"""Placement: what each role asks for, the simulated fit on a cluster's nodes, and real placement groups on a
two-node Ray cluster. The two-node cluster runs in a subprocess, so the session's Ray cluster is never touched."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from conftest import REPO, TESTS_DIR, cli_here, small_config

from grpo_dist.cluster.placement import describe, fits, generator_resources, plan
from grpo_dist.config import Config, validate_config

TWO_CPU_NODES = [{"ip": "10.0.0.1", "CPU": 2, "GPU": 0}, {"ip": "10.0.0.2", "CPU": 2, "GPU": 0}]


def make_config(tmp_path: Path, **sections) -> Config:
    return validate_config(small_config(tmp_path, **sections))


def roles(cfg: Config) -> dict[str, tuple[list[dict[str, float]], str]]:
    return {request.role: (request.bundles, request.strategy) for request in plan(cfg)}


# --- plan(): pure ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("placement", "strategy"), [pytest.param("pack", "PACK", id="pack"), pytest.param("spread", "SPREAD", id="spread")]
)
def test_learner_has_one_bundle_per_rank(tmp_path, placement, strategy):
    cfg = make_config(tmp_path, learner={"num_ranks": 3, "num_cpus": 2, "placement": placement})
    assert roles(cfg)["learner"] == ([{"CPU": 2.0}] * 3, strategy)  # no GPU key when learner.num_gpus is 0


def test_learner_bundles_carry_gpus(tmp_path):
    cfg = make_config(tmp_path, learner={"num_ranks": 2, "num_cpus": 4, "num_gpus": 1})
    assert roles(cfg)["learner"] == ([{"CPU": 4.0, "GPU": 1.0}] * 2, "PACK")


def test_each_generator_has_its_own_group(tmp_path):
    cfg = make_config(tmp_path, rollout={"num_generators": 2, "num_cpus": 1.5})
    assert [request.role for request in plan(cfg)] == ["learner", "generator 0", "generator 1", "reward"]
    assert roles(cfg)["generator 1"] == ([{"CPU": 1.5}], "PACK")
    assert generator_resources(cfg) == {"num_cpus": 1.5, "num_gpus": 0.0}


def test_tensor_parallel_generator_is_one_strict_pack_group_of_one_gpu_bundles(tmp_path):
    cfg = make_config(tmp_path, rollout={"num_gpus": 1, "tensor_parallel_size": 2})
    assert roles(cfg)["generator 0"] == ([{"CPU": 1.0, "GPU": 1.0}] * 2, "STRICT_PACK")
    # the actor itself takes no GPU: vLLM's two engine workers take one each, bundle 0's included
    assert generator_resources(cfg) == {"num_cpus": 1.0, "num_gpus": 0.0}


def test_single_gpu_generator_takes_its_gpu(tmp_path):
    cfg = make_config(tmp_path, rollout={"num_gpus": 1})
    assert roles(cfg)["generator 0"] == ([{"CPU": 1.0, "GPU": 1.0}], "PACK")
    assert generator_resources(cfg) == {"num_cpus": 1.0, "num_gpus": 1.0}


def test_reward_workers_share_one_pack_group(tmp_path):
    cfg = make_config(tmp_path, reward={"num_workers": 3, "num_cpus": 0.5})
    assert roles(cfg)["reward"] == ([{"CPU": 0.5}] * 3, "PACK")


# --- describe(): pure -----------------------------------------------------------------------------------------------


def test_spread_puts_ranks_on_different_nodes(tmp_path):
    cfg = make_config(tmp_path, learner={"num_ranks": 2, "placement": "spread"})
    text = describe(cfg, TWO_CPU_NODES)
    # 2 ranks x 1 CPU + 1 generator x 1 CPU + 2 reward workers x 0.25 CPU = 3.5 of 4 CPUs
    assert "node 0: bundle 0; node 1: bundle 1" in text.splitlines()[4]
    assert "asked in all: 3.5 CPUs, 0 GPUs; the cluster has 4 CPUs, 0 GPUs" in text
    assert text.splitlines()[-1] == "fits"
    assert fits(cfg, TWO_CPU_NODES)


def test_pack_keeps_ranks_on_one_node(tmp_path):
    cfg = make_config(tmp_path, learner={"num_ranks": 2, "placement": "pack"})
    learner_line = describe(cfg, TWO_CPU_NODES).splitlines()[4]
    assert learner_line.startswith("  learner") and learner_line.endswith("-> node 0")


def test_too_many_cpus_does_not_fit_and_says_which_keys(tmp_path):
    cfg = make_config(tmp_path, learner={"num_ranks": 8})
    last = describe(cfg, TWO_CPU_NODES).splitlines()[-1]
    # 8 ranks x 1 + 1 generator x 1 + 2 x 0.25 = 9.5 CPUs against 2 + 2
    assert last.startswith(
        "does not fit: the run asks 9.5 CPUs in all (learner 8, generator 1, reward 0.5) and the cluster has 4; "
    )
    assert "learner.num_ranks" in last and "reward.num_workers" in last
    assert not fits(cfg, TWO_CPU_NODES)


def test_engine_that_no_single_node_holds_does_not_fit(tmp_path):
    cfg = make_config(tmp_path, rollout={"num_gpus": 1, "tensor_parallel_size": 4})
    nodes = [{"ip": "10.0.0.1", "CPU": 8, "GPU": 3}, {"ip": "10.0.0.2", "CPU": 8, "GPU": 3}]
    last = describe(cfg, nodes).splitlines()[-1]  # 4 GPUs of 6 in all, but at most 3 on a node
    assert last.startswith("does not fit: generator 0 needs 4 CPUs, 4 GPUs on one node (STRICT_PACK")
    assert "rollout.tensor_parallel_size" in last
    assert not fits(cfg, nodes)


def test_gpu_groups_are_placed_before_cpu_groups(tmp_path):
    cfg = make_config(tmp_path, learner={"num_ranks": 4}, rollout={"num_gpus": 1, "tensor_parallel_size": 2})
    nodes = [{"ip": "10.0.0.1", "CPU": 4, "GPU": 2}, {"ip": "10.0.0.2", "CPU": 4, "GPU": 0}]
    # learner first would take all 4 CPUs of node 0 and leave the engine (2 GPUs + 2 CPUs on one node) nowhere
    lines = describe(cfg, nodes).splitlines()
    assert lines[4].startswith("  generator 0") and lines[4].endswith("-> node 0")
    assert lines[5].startswith("  learner") and lines[5].endswith("-> node 1")
    assert lines[-1] == "fits"


# --- a real two-node cluster, in a subprocess -----------------------------------------------------------------------

TWO_NODES_SCRIPT = """
import json, subprocess, sys, time

import ray
from ray.cluster_utils import Cluster
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from grpo_dist.config import validate_config
from grpo_dist.cluster.placement import PlacementError, generator_resources, place

configs = json.loads(sys.argv[1])
cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
gpu_node = cluster.add_node(num_cpus=3, num_gpus=2)  # logical GPUs: counted by Ray, never used
ray.init(address=cluster.address, logging_level="warning", log_to_driver=False)
cluster.wait_for_nodes()
results = {"gpu_node": gpu_node.node_id}


def wait_until_idle():
    # group removal frees resources asynchronously: wait until every CPU is free again
    deadline = time.monotonic() + 30
    while ray.available_resources().get("CPU", 0) < 5 and time.monotonic() < deadline:
        time.sleep(0.2)


@ray.remote(num_cpus=0)
def node_id():
    return ray.get_runtime_context().get_node_id()


@ray.remote
class Rank:
    def node(self):
        return ray.get_runtime_context().get_node_id()


@ray.remote
class Engine:
    def workers(self):
        # what vLLM's Ray executor does: find the current group, one worker (1 GPU, 0 CPU) per GPU bundle
        group = ray.util.get_current_placement_group()
        bundles = [index for index, bundle in enumerate(group.bundle_specs) if bundle.get("GPU")]
        strategies = [PlacementGroupSchedulingStrategy(group, index, True) for index in bundles]
        workers = [node_id.options(num_gpus=1, scheduling_strategy=s).remote() for s in strategies]
        return ray.get_runtime_context().get_node_id(), ray.get(workers, timeout=30)


spread = validate_config(configs["spread"])
placement = place(spread)
ranks = [Rank.options(num_cpus=1, scheduling_strategy=s).remote() for s in placement.learner_strategies()]
results["spread_nodes"] = ray.get([rank.node.remote() for rank in ranks], timeout=60)
placement.remove()
wait_until_idle()

tensor_parallel = validate_config(configs["tensor_parallel"])
placement = place(tensor_parallel)
engine = Engine.options(**generator_resources(tensor_parallel), scheduling_strategy=placement.generator_strategy(0))
results["engine_nodes"] = ray.get(engine.remote().workers.remote(), timeout=60)
placement.remove()
wait_until_idle()

try:
    place(validate_config(configs["too_big"]))
except PlacementError as err:
    results["too_big_error"] = str(err)
time.sleep(1)  # removal reaches the GCS asynchronously
results["group_states"] = sorted({group["state"] for group in ray.util.placement_group_table().values()})

check = [sys.executable, "-m", "grpo_dist", "check", sys.argv[2], "--cluster", cluster.address]
cli = subprocess.run(check, capture_output=True, text=True, timeout=60)
results["cli"] = {"returncode": cli.returncode, "stdout": cli.stdout, "stderr": cli.stderr[-2000:]}
print("RESULTS " + json.dumps(results))
ray.shutdown()
cluster.shutdown()
"""


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory) -> dict:
    """Run every two-node scenario in one subprocess (a Ray cluster start is most of the time) and return what
    each observed."""
    tmp_path = tmp_path_factory.mktemp("two_nodes")
    configs = {
        # 2 ranks x 1 CPU + 1 CPU generator + 2 x 0.25 CPU reward: 3.5 of 5 CPUs
        "spread": small_config(tmp_path, learner={"num_ranks": 2, "placement": "spread"}),
        # the engine's 2 x (1 CPU, 1 GPU) on the GPU node, learner and rewards (1.5 CPUs) on the head
        "tensor_parallel": small_config(tmp_path, rollout={"num_gpus": 1, "tensor_parallel_size": 2}),
        "too_big": small_config(tmp_path, learner={"num_ranks": 8, "num_cpus": 1}, ray={"placement_timeout_s": 3}),
    }
    check_config = tmp_path / "too_big.yaml"
    check_config.write_text(yaml.safe_dump(configs["too_big"]))
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    # `grpo-dist check` resolves the reward functions: tests/ holds reward_fixtures
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), str(TESTS_DIR), env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(TWO_NODES_SCRIPT), json.dumps(configs), str(check_config)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=tmp_path,
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULTS ")]
    output = f"{result.stdout[-3000:]}\n{result.stderr[-4000:]}"
    assert result.returncode == 0 and lines, f"two-node script failed (exit {result.returncode}):\n{output}"
    return json.loads(lines[-1].removeprefix("RESULTS "))


@pytest.mark.slow
def test_spread_learner_ranks_run_on_different_nodes(two_nodes):
    first, second = two_nodes["spread_nodes"]
    assert first != second


@pytest.mark.slow
def test_tensor_parallel_workers_land_in_the_generator_group_on_one_node(two_nodes):
    engine_node, worker_nodes = two_nodes["engine_nodes"]
    assert worker_nodes == [two_nodes["gpu_node"]] * 2
    assert engine_node == two_nodes["gpu_node"]


@pytest.mark.slow
def test_a_run_bigger_than_the_cluster_fails_within_the_bound(two_nodes):
    # place() waits at most ray.placement_timeout_s; were it to wait forever, the script's timeout fails the test
    assert "too_big_error" in two_nodes, "placing a run bigger than the cluster did not fail"
    message = two_nodes["too_big_error"]
    assert "ray.placement_timeout_s=3s; still waiting: learner" in message
    assert "learner: 8 x {CPU: 1} PACK" in message
    assert "the cluster has 5 CPUs, 2 GPUs in all" in message
    # 8 ranks x 1 + 1 generator x 1 + 2 x 0.25 = 9.5 CPUs against 2 + 3
    assert (
        "on an idle cluster: the run asks 9.5 CPUs in all (learner 8, generator 1, reward 0.5) and the cluster "
        "has 5" in message
    )
    assert "learner.num_ranks" in message
    assert two_nodes["group_states"] == ["REMOVED"]  # every group of every scenario was released


@pytest.mark.slow
def test_check_against_the_cluster_prints_the_plan(two_nodes):
    cli = two_nodes["cli"]
    assert cli["returncode"] == 1, cli["stderr"]
    assert "cluster: 2 nodes, 5 CPUs, 2 GPUs" in cli["stdout"]
    assert "does not fit: the run asks 9.5 CPUs in all" in cli["stdout"]


def test_check_against_an_unreachable_cluster_says_so(capfd, tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(small_config(tmp_path)))
    result = cli_here(capfd, "check", str(path), "--cluster", "127.0.0.1:1")
    assert result.returncode == 2
    assert "cannot connect to the Ray cluster at 127.0.0.1:1" in result.stderr
    # the bounded TCP probe answered, naming its bound, not Ray's own connection retries
    assert re.search(r"nothing answers at 127\.0\.0\.1:1 within \d+(\.\d+)? s", result.stderr), result.stderr
    assert "RAY_AUTH_MODE=token" in result.stderr


def test_actors_serve_a_run_that_differs_only_in_what_they_are_not_started_with(tmp_path):
    """`differences`: a run's algorithm, learning rate, sampling, staleness, sync mode and rewards need no other
    actors; another model, placement, engine window, seed or weight-transfer backend does, and is named."""
    from grpo_dist.cluster.cluster import differences

    base = validate_config(small_config(tmp_path))
    model = str(tmp_path / "model")

    def other(**sections) -> list[str]:
        return differences(base, model, validate_config(small_config(tmp_path, **sections)), model)

    assert other() == []
    assert other(algorithm={"kl_coef": 0.0, "ratio_level": "sequence"}, learner={"lr": 1e-3, "zero_stage": 3}) == []
    sampling = {"max_staleness": 2, "temperature": 0.7, "max_new_tokens": 8}
    assert other(rollout=sampling, sync={"mode": "in_flight"}) == []
    assert other(reward={"functions": [{"name": "math_answer"}]}) == []
    assert other(rollout={"max_model_len": 64}) == ["rollout.max_model_len"]
    assert other(run={"seed": 1}) == ["run.seed"]
    assert other(rollout={"num_generators": 2}) == [
        "the placement (learner ranks, generators, reward workers and their resources)"
    ]
    assert other(sync={"transport": "object_store"}) == ["the weight-transfer backend (sync.transport, sync.delta)"]
    assert differences(base, model, base, str(tmp_path / "elsewhere")) == ["model.path"]


STARTED_LATE = textwrap.dedent("""
    import os, time
    import psutil, ray
    import ray._private.services as services
    from grpo_dist.cluster.ray_cluster import start_local_ray

    registered, asked, waited = services.get_node, [], [0.0]
    def late(gcs_address, node_id):  # the first node's raylet never registers: Ray gives up on it after 30 s
        asked.append(node_id)
        if node_id == asked[0]:
            waited[0] += 10  # each try seen by Ray's clock as 10 s later (its wait is for 30 s of them)
            raise RuntimeError("not registered yet")
        return registered(gcs_address, node_id)
    services.get_node = late
    class Clock:  # the module `time`, as the node's start-up reads it: its clock moved on by the tries
        def __getattr__(self, name):
            return getattr(time, name)
        def monotonic(self):
            return time.monotonic() + waited[0]
    ray._private.node.time = Clock()
    start_local_ray(num_cpus=1)
    package = os.path.dirname(ray.__file__)
    servers = [p for p in psutil.Process().children(recursive=True) if any(
        "gcs_server" in part and package in part for part in p.cmdline())]
    print(ray.is_initialized(), len(set(asked)), len(servers))
    ray.shutdown()
""")


@pytest.mark.slow
def test_a_local_cluster_whose_first_start_times_out_is_started_again_with_nothing_left_of_the_first():
    """Ray gives a new raylet 30 s to register (a busy machine can exceed it): the second start runs, and the first
    one's GCS (and the rest of its processes) are gone."""
    done = subprocess.run([sys.executable, "-c", STARTED_LATE], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["True", "2", "1"], done.stdout + done.stderr[-3000:]
    assert "did not start (The current node timed out during startup" in done.stderr


AGENT_PORT_TAKEN = textwrap.dedent("""
    import socket, sys
    import ray
    from grpo_dist.cluster.ray_cluster import start_local_ray

    taken = socket.socket()  # another cluster's agent on Ray's fixed port
    taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        taken.bind(("0.0.0.0", 52365))
    except OSError:  # something else on the machine holds it already, as well
        pass
    else:
        taken.listen()
    start_local_ray(num_cpus=1)
    print(ray._private.worker.global_worker.node.dashboard_agent_listen_port)
    ray.shutdown()
""")


@pytest.mark.slow
def test_a_local_cluster_gives_its_dashboard_agent_a_free_port_where_rays_fixed_one_is_taken():
    """With Ray's fixed port (52365) held elsewhere, the agent's bind would fail after 4.4 s of retries and the node
    report -1 for its port; a run's own cluster takes a free one instead, and starts without that wait."""
    done = subprocess.run([sys.executable, "-c", AGENT_PORT_TAKEN], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    port = int(done.stdout.split()[-1])
    assert port > 0 and port != 52365, done.stdout + done.stderr[-3000:]


@pytest.mark.parametrize("value", ["0", "two", "-1", "1.5"])
def test_a_cpu_share_that_is_not_a_count_of_runs_is_refused_naming_the_variable(monkeypatch, value):
    from grpo_dist.cluster.ray_cluster import cpu_share
    from grpo_dist.config import ConfigError

    monkeypatch.setenv("GRPO_DIST_CPU_SHARE", value)
    with pytest.raises(ConfigError, match=f"GRPO_DIST_CPU_SHARE='{re.escape(value)}' in the environment"):
        cpu_share()
    monkeypatch.setenv("GRPO_DIST_CPU_SHARE", " 3 ")
    assert cpu_share() == 3
    monkeypatch.delenv("GRPO_DIST_CPU_SHARE")
    assert cpu_share() == 1

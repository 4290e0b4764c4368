"""`grpo-dist up` / `down`: a local Ray cluster that runs join instead of starting their own, for real."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import pytest
import yaml
from conftest import TESTS_DIR, small_config

from grpo_dist.cluster import ray_settings, warm

pytestmark = pytest.mark.slow


def grpo_dist(env: dict[str, str], *argv: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "grpo_dist", *argv], env=env, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


def processes_naming(mark: str) -> list[str]:
    """The command lines of the processes on this machine that name `mark`."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        line = " ".join(process.info["cmdline"] or [])
        if mark in line:
            found.append(line)
    return found


def actors_of(mark: str) -> list[str]:
    """The run actors' processes among those naming `mark` (Ray titles an actor's process `ray::Class...`)."""
    roles = ("ray::Generator", "ray::Learner", "ray::RewardWorker", "VLLM::EngineCore")
    return [line for line in processes_naming(mark) if line.startswith(roles)]


@pytest.fixture
def machine_temp():
    """A temporary directory of its own for the commands (their `TMPDIR`), so that the cluster they start is not a
    developer's `grpo-dist up` cluster; short, as Ray's socket paths under it must be."""
    with tempfile.TemporaryDirectory(prefix="gd-", dir="/tmp") as temp:
        yield temp


def test_runs_join_the_cluster_up_started_and_down_stops_it(tmp_path, machine_temp):
    path = os.pathsep.join(filter(None, [str(TESTS_DIR), os.environ.get("PYTHONPATH")]))  # the reward fixtures
    env = {**os.environ, "TMPDIR": machine_temp, "PYTHONPATH": path, "WANDB_MODE": "offline"}
    ray_dir = f"{machine_temp}/grpo-dist-up-{os.getuid()}/ray"
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(small_config(tmp_path, run={"steps": 2})))
    try:
        up = grpo_dist(env, "up", "--num-cpus", "8")
        assert up.returncode == 0, up.stderr[-3000:]
        assert "local Ray cluster started at 127.0.0.1:" in up.stdout
        address = up.stdout.split(" at ")[1].split()[0]
        assert f"already up at {address}" in grpo_dist(env, "up").stdout  # a second `up` keeps it
        ray_processes = len(processes_naming(ray_dir))
        assert ray_processes >= 2, processes_naming(ray_dir)  # its GCS and raylet at least
        raylets = [p for p in psutil.process_iter(["cmdline"]) if "raylet" in " ".join(p.info["cmdline"] or [])[:200]
                   and ray_dir in " ".join(p.info["cmdline"] or [])]  # fmt: skip
        assert raylets and all(p.environ().get("RAY_worker_niceness") == "0" for p in raylets)  # actors at nice 0
        agents = [child for raylet in raylets for child in raylet.children() if child.name().startswith("ray::")]
        assert agents, [child.cmdline() for raylet in raylets for child in raylet.children()]  # retitled: ray::...
        if warm.available():  # the warm process the runs' actors are forked from, stopped by `down` with the rest
            assert warm.ready(Path(ray_dir) / "warm.sock", timeout_s=300)

        for run in ("first", "second"):  # each run joins it, and its actors go with it
            done = grpo_dist(env, "train", str(config), f"run.name={run}")
            assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
            assert f"joining the local Ray cluster `grpo-dist up` started ({address})" in done.stdout
            assert (tmp_path / "outputs" / run / "metrics.jsonl").read_text().count('"step": 2') == 1
            assert actors_of(ray_dir) == [], actors_of(ray_dir)
            assert len(processes_naming(ray_dir)) >= ray_processes  # the cluster is still up

        if warm.available():  # each run's driver forked from the warm process too (`warm_driver`), which says so
            forked = [line.split(": ", 1)[1] for line in (Path(ray_dir) / "warm.log").read_text().splitlines()
                      if line.startswith("driver ")]  # fmt: skip
            assert forked == [f"grpo-dist train {config} run.name={run}" for run in ("first", "second")], forked

        # A run whose actors ask for more CPUs than it has is refused, naming both and what to do.
        small = grpo_dist(env, "train", str(config), "run.name=big", "rollout.num_cpus=9")
        assert small.returncode == 2, small.stdout + small.stderr
        assert "has 8 CPUs and this run's actors ask for" in small.stderr
        assert "grpo-dist up --num-cpus" in small.stderr
    finally:
        down = grpo_dist(env, "down")
    assert down.returncode == 0, down.stderr
    assert "local Ray cluster stopped" in down.stdout
    assert processes_naming(ray_dir) == []
    assert [agent.name() for agent in agents if agent.is_running()] == []  # stopped with it, not a minute later
    assert "no local Ray cluster" in grpo_dist(env, "down").stdout
    assert not Path(ray_dir).with_name("cluster.json").exists()


def test_up_cold_starts_no_warm_process(machine_temp):
    env = {**os.environ, "TMPDIR": machine_temp}
    ray_dir = f"{machine_temp}/grpo-dist-up-{os.getuid()}/ray"
    try:
        up = grpo_dist(env, "up", "--num-cpus", "2", "--cold")
        assert up.returncode == 0, up.stderr[-3000:]
        assert any("raylet" in line for line in processes_naming(ray_dir))
        assert [line for line in processes_naming(ray_dir) if "grpo_dist.cluster.warm " in line + " "] == []
        assert not warm.ready(Path(ray_dir) / "warm.sock", timeout_s=1)
    finally:
        grpo_dist(env, "down")
    assert processes_naming(ray_dir) == []


OWN_CLUSTER = """
import os, psutil, ray
from grpo_dist.cluster.ray_cluster import start_local_ray
start_local_ray(num_cpus=1, _system_config={"metrics_report_interval_ms": 200})  # an export would come at once
agent = ray._private.worker.global_worker.node.metrics_agent_port
started = [" ".join(child.cmdline()) for child in psutil.Process().children(recursive=True)]
print("api server:", any("dashboard/dashboard.py" in command for command in started))

def exporting():
    return any(c.raddr and c.raddr.port == agent for c in psutil.Process().net_connections())

@ray.remote
def worker():
    import time
    time.sleep(3)  # 15 report intervals
    return os.nice(0), exporting()

niceness, worker_exports = ray.get(worker.remote())
print(niceness, worker_exports, exporting())
ray.shutdown()
"""


def test_a_runs_own_local_cluster_runs_its_actors_at_the_drivers_priority_exports_no_ray_metrics_and_no_api_server():
    """Ray's default would start them at niceness 15, below every other busy process on the machine; each of its
    processes would export Ray's metrics to the node's agent, from a thread that reads the environment as the
    process writes it (`ray_settings.METRICS_COLLECTION`): with collection on, both connect within the 3 s; and
    `ray.init` would start its dashboard's process for Ray's usage statistics alone (`lean_local_node`)."""
    env = {key: value for key, value in os.environ.items() if key not in ray_settings.cluster_environment()}
    done = subprocess.run([sys.executable, "-c", OWN_CLUSTER], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "api server: False" in done.stdout, done.stdout
    assert done.stdout.split()[-3:] == [str(os.nice(0)), "False", "False"], done.stdout

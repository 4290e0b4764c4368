"""Warm actor processes (`grpo_dist.cluster.warm`): forked from one process that imported the stack, for real."""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

from grpo_dist.cluster import warm, warm_launch

pytestmark = pytest.mark.slow


def test_a_launcher_finds_no_warm_process_at_once(tmp_path):
    """No warm process at the socket (never started, or gone): the launcher starts the worker as Ray does."""
    started = time.monotonic()
    assert warm_launch._connect(str(tmp_path / "none.sock")) is None
    assert time.monotonic() - started < 5
    assert not warm.ready(tmp_path / "none.sock", timeout_s=1)


def _process(*_):
    import sys as modules

    import torch

    return {
        "pid": os.getpid(),
        "parent": os.getppid(),
        "imported": sorted(name for name in ("vllm", "deepspeed", "transformers") if name in modules.modules),
        "torch_threads": torch.get_num_threads(),
        "omp": os.environ.get("OMP_NUM_THREADS"),
        "setting": os.environ.get("WARM_TEST_SETTING"),
        "cwd": os.getcwd(),
        "worker_id": __import__("ray").get_runtime_context().get_worker_id(),
    }


def test_the_session_s_actors_are_forked_warm_and_die_as_ray_kills_them(ray_cluster, tmp_path):
    ray = ray_cluster
    if not warm.available():
        pytest.skip("no warm processes on this machine (not Linux, or a GPU device)")

    @ray.remote
    class Probe:
        def describe(self):
            return _process()

    probes = [Probe.options(num_cpus=cpus).remote() for cpus in (1, 3)]
    found = ray.get([probe.describe.remote() for probe in probes], timeout=120)
    warm_process = psutil.Process(found[0]["parent"])
    assert "grpo_dist.cluster.warm" in " ".join(warm_process.cmdline())
    for seen in found:
        assert seen["parent"] == warm_process.pid  # forked by the warm process, not started by the raylet
        assert seen["imported"] == ["deepspeed", "transformers", "vllm"]  # before this actor imported anything
    # torch was imported before Ray set each actor's OMP_NUM_THREADS; the fork gives torch the actor's count
    assert [(seen["omp"], seen["torch_threads"]) for seen in found] == [("1", 1), ("3", 3)]

    # ray.kill ends the forked process; so does the end of the process the raylet started for it (its launcher)
    ray.kill(probes[0])
    gone, _ = psutil.wait_procs([psutil.Process(found[0]["pid"])], timeout=30)
    assert gone, "ray.kill left the forked worker running"
    worker = psutil.Process(found[1]["pid"])
    (launcher,) = [
        process for process in psutil.process_iter(["cmdline"])
        if "warm_launch.py" in " ".join(process.info["cmdline"] or [])
        and f"--worker-id={found[1]['worker_id']}" in process.info["cmdline"]
    ]  # fmt: skip
    launcher.send_signal(signal.SIGKILL)
    gone, _ = psutil.wait_procs([worker], timeout=30)
    assert gone, "the worker outlived its launcher"


def test_runtime_environments_beyond_variables_start_as_ray_does(ray_cluster, tmp_path):
    ray = ray_cluster
    if not warm.available():
        pytest.skip("no warm processes on this machine (not Linux, or a GPU device)")
    (tmp_path / "marker.txt").write_text("here")

    @ray.remote(num_cpus=1)
    def describe():
        return _process()

    with_variables = ray.get(
        describe.options(runtime_env={"env_vars": {"WARM_TEST_SETTING": "a value"}}).remote(), timeout=120
    )
    assert with_variables["setting"] == "a value"  # the runtime environment's variables reach the forked worker
    assert "grpo_dist.cluster.warm" in " ".join(psutil.Process(with_variables["parent"]).cmdline())

    # A working directory: Ray prefixes the worker's command (`cd DIR &&`), so the worker starts cold, in it.
    in_directory = ray.get(describe.options(runtime_env={"working_dir": str(tmp_path)}).remote(), timeout=300)
    assert "grpo_dist.cluster.warm" not in " ".join(_cmdline(in_directory["parent"]))
    assert in_directory["imported"] == []
    assert os.path.exists(os.path.join(in_directory["cwd"], "marker.txt"))


def _cmdline(pid: int) -> list[str]:
    try:
        return psutil.Process(pid).cmdline()
    except psutil.Error:
        return []

"""Warm actor processes (`grpo_dist.cluster.warm`): forked from one process that imported the stack, for real."""

from __future__ import annotations

import array
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import psutil
import pytest

from grpo_dist.cluster import warm, warm_launch


def test_a_launcher_finds_no_warm_process_at_once(tmp_path):
    """No warm process at the socket (never started, or gone): the launcher starts the worker as Ray does."""
    started = time.monotonic()
    assert warm_launch._connect(str(tmp_path / "none.sock")) is None
    assert time.monotonic() - started < 5
    assert not warm.ready(tmp_path / "none.sock", timeout_s=1)


def _process(*_):
    import gc
    import sys as modules

    import torch

    return {
        "pid": os.getpid(),
        "parent": os.getppid(),
        "imported": sorted(name for name in ("vllm", "deepspeed", "transformers") if name in modules.modules),
        "preloaded": sorted(name for name in ("vllm", "deepspeed", "transformers") if name in warm_launch.PRELOADED),
        "torch_threads": torch.get_num_threads(),
        "omp": os.environ.get("OMP_NUM_THREADS"),
        "setting": os.environ.get("WARM_TEST_SETTING"),
        "cwd": os.getcwd(),
        "worker_id": __import__("ray").get_runtime_context().get_worker_id(),
        "frozen": gc.get_freeze_count(),  # objects the worker's collections leave out
    }


@pytest.mark.slow
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
        assert seen["preloaded"] == seen["imported"]  # and recorded as imported before the fork
        assert seen["frozen"] > 100_000  # the imports' objects, frozen before the fork: no collection walks them
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


@pytest.mark.slow
def test_a_runtime_environment_s_variables_reach_the_forked_worker(ray_cluster):
    ray = ray_cluster
    if not warm.available():
        pytest.skip("no warm processes on this machine (not Linux, or a GPU device)")

    @ray.remote(num_cpus=1)
    def describe():
        return _process()

    with_variables = ray.get(
        describe.options(runtime_env={"env_vars": {"WARM_TEST_SETTING": "a value"}}).remote(), timeout=120
    )
    assert with_variables["setting"] == "a value"  # the runtime environment's variables reach the forked worker
    assert "grpo_dist.cluster.warm" in " ".join(psutil.Process(with_variables["parent"]).cmdline())


SETUP_WORKER = "import json, sys\nprint(json.dumps(sys.argv[1:]))\n"


class FakeWarmProcess:
    """A Unix socket that answers as the warm process does (ready, then a worker's pid), counting who connects."""

    def __init__(self, path):
        self.connections = 0
        self.listener = socket.socket(socket.AF_UNIX)
        self.listener.bind(str(path))
        self.listener.listen(8)
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                connection, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            connection.sendall(b"R")
            _, ancillary, _, _ = connection.recvmsg(1 << 20, socket.CMSG_LEN(3 * 4))
            for _, _, data in ancillary:  # the launcher's standard streams: held, its output would never end
                for descriptor in array.array("i", data[: len(data) - len(data) % 4]):
                    os.close(descriptor)
            connection.sendall(b"12345\n")
            connection.close()  # the "worker" ends at once


@pytest.mark.parametrize(
    "case", ["plain", "no warm process named", "no warm process there", "a command prefix", "another interpreter"]
)
def test_only_a_worker_needing_no_more_than_variables_is_forked_warm(tmp_path, case):
    """The launcher asks the warm process for a worker whose runtime environment is variables only; otherwise it
    becomes Ray's own setup_worker.py (beside default_worker.py, with the same arguments): when no warm process is
    named or answers, or when Ray prefixes the command or changes the interpreter (a working directory, a
    container, a conda environment)."""
    (tmp_path / "setup_worker.py").write_text(SETUP_WORKER)
    context = {
        "a command prefix": {"command_prefix": ["cd", "/tmp", "&&"]},
        "another interpreter": {"py_executable": "/opt/conda/bin/python"},
    }.get(case, {"env_vars": {"A": "1"}})
    arguments = [
        str(tmp_path / "default_worker.py"), "--worker-id=abc",
        f"--serialized-runtime-env-context={json.dumps(context)}", "--language=PYTHON",
    ]  # fmt: skip
    env = {key: value for key, value in os.environ.items() if key != warm_launch.SOCKET_ENV}
    if case != "no warm process named":
        env[warm_launch.SOCKET_ENV] = str(tmp_path / "warm.sock")
    fake = FakeWarmProcess(tmp_path / "warm.sock") if case != "no warm process there" else None
    done = subprocess.run(
        [sys.executable, warm_launch.__file__, *arguments], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    if case == "plain":
        assert fake.connections == 1 and done.stdout == ""  # forked warm: Ray's setup_worker.py never ran
    else:
        assert json.loads(done.stdout) == arguments  # setup_worker.py ran, with every argument
        assert fake is None or fake.connections == 0


@pytest.mark.parametrize("named", ["a warm process serving", "no socket"])
def test_a_run_takes_the_warm_process_its_environment_names_and_leaves_it_running(tmp_path, monkeypatch, capfd, named):
    """`GRPO_DIST_WARM_PROCESS` naming a warm process's socket: the run starts none of its own, and its end leaves that
    one serving. Naming no socket: said, and the run starts its own (here a stand-in process), stopped at its end."""
    if not warm.available():
        pytest.skip("no warm processes on this machine (not Linux, or a GPU device)")
    started = []

    def start(path, log, detached):
        started.append(subprocess.Popen(["sleep", "600"]))
        return started[-1]

    monkeypatch.setattr(warm, "start", start)
    path = tmp_path / "warm.sock"
    serving = socket.socket(socket.AF_UNIX)
    if named == "a warm process serving":
        serving.bind(str(path))
        serving.listen(8)
    monkeypatch.setenv(warm.SHARED_ENV, str(path))
    warm.start_for_this_run()
    try:
        said = capfd.readouterr().err
        if named == "a warm process serving":
            assert started == [] and said == ""
        else:
            assert len(started) == 1 and f"{warm.SHARED_ENV}={path} names no socket" in said, said
    finally:
        warm.stop_for_this_run()
    if named == "a warm process serving":  # its socket left where it was, still taking connections
        probe = socket.socket(socket.AF_UNIX)
        probe.connect(str(path))
        probe.close()
        serving.close()
    else:
        assert started[0].wait(timeout=10) == -signal.SIGKILL


def _cmdline(pid: int) -> list[str]:
    try:
        return psutil.Process(pid).cmdline()
    except psutil.Error:
        return []


def test_eval_on_a_cluster_of_its_own_takes_a_warm_process_as_train_does(tmp_path):
    """`grpo-dist eval` starts a local cluster of its own as `train` does, and its actors start warm too: the command
    asks for the warm process first thing (here one its environment names but that is not there, which it says)."""
    if not warm.available():
        pytest.skip("no warm processes on this machine (not Linux, or a GPU device)")
    import yaml
    from conftest import cli_batch, small_config

    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(small_config(tmp_path)))
    missing = tmp_path / "gone.sock"
    (evaluated,) = cli_batch([["eval", str(config), "--checkpoint", str(tmp_path / "no-checkpoint")]],
                             env={warm.SHARED_ENV: str(missing)})  # fmt: skip
    assert evaluated.returncode == 2, evaluated.stderr  # no such checkpoint: refused after the warm process started
    assert f"{warm.SHARED_ENV}={missing} names no socket: the run starts a warm process of its own" in evaluated.stderr

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
from pathlib import Path

import psutil
import pytest

from grpo_dist.cluster import warm, warm_launch


def test_a_launcher_finds_no_warm_process_at_once(tmp_path):
    """No warm process at the socket (never started, or gone): the launcher starts the worker as Ray does."""
    started = time.monotonic()
    assert warm_launch.connect(str(tmp_path / "none.sock")) is None
    assert time.monotonic() - started < 5
    assert not warm.ready(tmp_path / "none.sock", timeout_s=1)


def test_a_fork_imports_again_what_the_warm_process_imported_of_grpo_dist_where_its_file_changed(tmp_path, monkeypatch):
    """`FIRST_IMPORTS` holds modules of grpo-dist: a fork (a run's actor, its driver) drops them where any of their
    files changed after the warm process imported them, so an edit made while `grpo-dist up` runs is what it runs."""
    source = tmp_path / "edited_module.py"
    source.write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import edited_module

    monkeypatch.setitem(sys.modules, "edited_module", edited_module)
    monkeypatch.setattr(warm, "_OWN_FILES", warm._sources(["edited_module"]))
    warm._forget_edited_modules()
    assert sys.modules["edited_module"] is edited_module  # unchanged: kept
    source.write_text("VALUE = 2\n")
    modified = os.stat(source).st_mtime_ns + 1_000_000_000  # later, whatever the file system's clock resolution
    os.utime(source, ns=(modified, modified))
    warm._forget_edited_modules()
    assert "edited_module" not in sys.modules
    assert __import__("edited_module").VALUE == 2


def _process(*_):
    import gc
    import sys as modules

    import torch

    return {
        "pid": os.getpid(),
        "parent": os.getppid(),
        "imported": sorted(name for name in ("vllm", "deepspeed", "transformers") if name in modules.modules),
        "preloaded": sorted(name for name in ("vllm", "deepspeed", "transformers") if name in warm_launch.PRELOADED),
        "first_imports": sorted(name for name in warm.FIRST_IMPORTS if name in warm_launch.PRELOADED),
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
        assert seen["first_imports"] == sorted(warm.FIRST_IMPORTS)  # what each actor imports first, too
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
def test_vllm_s_engine_modules_come_imported_its_kernels_registered_once_its_compiled_helpers_left_plain(ray_cluster):
    """`warm.ENGINE_IMPORTS` come into each forked worker imported, vLLM's log-prob gather a plain function whatever
    the worker's environment says (what an eager engine's process has), and vLLM's CPU kernels already in place of its
    Triton ones, which an engine's start leaves as they are (`warm._register_engine_kernels`)."""
    ray = ray_cluster
    if not warm.available():
        pytest.skip("no warm processes on this machine (not Linux, or a GPU device)")

    @ray.remote
    class Sampler:
        def gather(self) -> dict:
            os.environ.pop("TORCHDYNAMO_DISABLE", None)  # no effect on what was imported before the fork
            from vllm.platforms import current_platform
            from vllm.triton_utils.dispatcher import KernelOverride
            from vllm.v1.sample.ops import logprobs
            from vllm.v1.worker.block_table import ComputeSlotMappingKernel

            kernel = ComputeSlotMappingKernel.kernel
            current_platform.register_triton_kernel_overrides()  # what each engine's worker calls as it starts
            return {"preloaded": "vllm.v1.sample.ops.logprobs" in warm_launch.PRELOADED,
                    "compiled": hasattr(logprobs.batched_count_greater_than, "_torchdynamo_orig_callable"),
                    "cpu kernel": isinstance(kernel, KernelOverride),
                    "kernel kept": ComputeSlotMappingKernel.kernel is kernel}  # fmt: skip

    found = ray.get(Sampler.remote().gather.remote(), timeout=120)
    assert found == {"preloaded": True, "compiled": False, "cpu kernel": True, "kernel kept": True}


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
    assert (
        f"{warm.SHARED_ENV}={missing} names no socket of this user's: the run starts a warm process of its own"
        in evaluated.stderr
    )


def test_a_shared_warm_socket_is_used_only_where_it_is_this_users(tmp_path, monkeypatch):
    """A run sends the warm process `GRPO_DIST_WARM_PROCESS` names its whole environment and its standard streams:
    a socket there of another user's is used neither for its actors nor for its driver."""
    if not warm.available() or os.geteuid() != 0:
        pytest.skip("needs warm processes and root (to give the socket to another user)")
    from grpo_dist.cluster import warm_driver

    path = tmp_path / "warm.sock"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(path))
    monkeypatch.setenv(warm.SHARED_ENV, str(path))
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # no cluster of `grpo-dist up` recorded there
    try:
        assert warm.shared_socket() == path and warm_driver.socket_path() == path
        os.chown(path, 65534, 65534)  # nobody's
        assert warm.shared_socket() is None and warm_driver.socket_path() is None
    finally:
        listener.close()


def _up_record(temp: Path, socket_path: Path, forks_drivers: bool = True) -> None:
    """The record of a cluster of `grpo-dist up` (`grpo_dist.cluster.standing`) under `temp`, whose warm process is
    the one at `socket_path` (the session's): what a command looks for before it imports anything."""
    home = temp / f"grpo-dist-up-{os.getuid()}"
    home.mkdir(parents=True, exist_ok=True)
    record = {"address": "127.0.0.1:9", "num_cpus": 8, "temp_dir": str(socket_path.parent), "started": 0.0}
    (home / "cluster.json").write_text(json.dumps({**record, **({"forks_drivers": True} if forks_drivers else {})}))


def _drivers_forked(socket_path: Path) -> list[str]:
    """What the warm process at `socket_path` says it forked as drivers, in order."""
    log = socket_path.parent / "warm.log"
    return [line for line in log.read_text().splitlines() if line.startswith("driver ")]


def _warm_driver_setting() -> tuple[Path, dict[str, str]]:
    """The session's warm process, once it answers: its socket, and an environment for a command, this process's with
    the variables read at import (`warm.IMPORT_ENV`) as the warm process has them, as a shell's match the `grpo-dist
    up` it started (this process's may have moved on since: a run in it sets HF_HUB_DISABLE_PROGRESS_BARS)."""
    from conftest import session_warm_process

    socket_path = session_warm_process()
    if socket_path is None:
        pytest.skip("no warm processes on this machine (not Linux, or a GPU device)")
    deadline = time.monotonic() + 300  # its socket comes a moment after it starts, its answer once it has imported
    while not warm.ready(socket_path, timeout_s=10):
        assert time.monotonic() < deadline, f"the session's warm process did not answer at {socket_path}"
        time.sleep(0.2)
    from conftest import session_warm_environ

    env = {key: value for key, value in os.environ.items() if not key.startswith(warm.IMPORT_ENV)}
    env.update((key, value) for key, value in session_warm_environ().items() if key.startswith(warm.IMPORT_ENV))
    return socket_path, env


@pytest.mark.slow  # the session's warm process imports vLLM: not in `make test-fast`
def test_a_run_s_driver_is_forked_where_up_keeps_a_warm_process_and_exits_with_its_code(tmp_path):
    """`grpo-dist train` on a machine whose `grpo-dist up` cluster has a warm process: its driver is forked from that
    process (which says so in its log), with the command's streams and exit code. Another value of a variable read
    at import, or the record of a cluster an older grpo-dist started: the driver starts in the command's own process."""
    socket_path, shell = _warm_driver_setting()
    _up_record(tmp_path / "temp", socket_path)
    env = {**shell, "TMPDIR": str(tmp_path / "temp")}

    def grpo_dist(*argv: str, **changes: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "grpo_dist", *argv], env={**env, **changes}, capture_output=True,
                              text=True, timeout=300)  # fmt: skip

    before = len(_drivers_forked(socket_path))
    helped = grpo_dist("train", "--help")
    assert helped.returncode == 0 and "--resume" in helped.stdout and "starts cold" not in helped.stderr, helped.stderr
    missing = tmp_path / "missing.yaml"
    refused = grpo_dist("train", str(missing))
    assert refused.returncode == 2 and str(missing) in refused.stderr, refused.stderr
    forked = _drivers_forked(socket_path)[before:]
    assert [line.split(": ", 1)[1] for line in forked] == ["grpo-dist train --help", f"grpo-dist train {missing}"]
    assert all(not psutil.pid_exists(int(line.split()[1].rstrip(":"))) for line in forked)  # each gone with its run

    cold = grpo_dist("train", str(missing), HF_HUB_DISABLE_TELEMETRY="another value")
    assert cold.returncode == 2 and str(missing) in cold.stderr, cold.stderr
    assert "grpo-dist: the driver starts cold: HF_HUB_DISABLE_TELEMETRY differ(s)" in cold.stderr
    (tmp_path / "temp" / f"grpo-dist-up-{os.getuid()}" / "cluster.json").unlink()
    _up_record(tmp_path / "temp", socket_path, forks_drivers=False)
    older = grpo_dist("train", str(missing))
    assert older.returncode == 2 and "starts cold" not in older.stderr, older.stderr
    assert len(_drivers_forked(socket_path)) == before + 2  # neither of the last two forked


@pytest.mark.slow  # the session's warm process imports vLLM: not in `make test-fast`
def test_a_run_s_driver_is_forked_from_the_warm_process_its_environment_names(tmp_path):
    """Without `grpo-dist up`, a command whose environment names a warm process that runs share (`warm.SHARED_ENV`)
    has its driver forked from it, with the command's streams and exit code; without the variable, it runs its
    driver itself."""
    socket_path, shell = _warm_driver_setting()
    env = {**shell, "TMPDIR": str(tmp_path / "temp")}  # no record of a cluster of `grpo-dist up` there
    (tmp_path / "temp").mkdir()
    missing = tmp_path / "missing.yaml"

    def grpo_dist(**changes: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "grpo_dist", "train", str(missing)], env={**env, **changes},
                              capture_output=True, text=True, timeout=300)  # fmt: skip

    before = len(_drivers_forked(socket_path))
    refused = grpo_dist(**{warm.SHARED_ENV: str(socket_path)})
    assert refused.returncode == 2 and str(missing) in refused.stderr and "starts cold" not in refused.stderr
    (forked,) = _drivers_forked(socket_path)[before:]
    assert forked.split(": ", 1)[1] == f"grpo-dist train {missing}"
    alone = grpo_dist()
    assert alone.returncode == 2 and str(missing) in alone.stderr, alone.stderr
    assert len(_drivers_forked(socket_path)) == before + 1  # the second ran its driver itself


def _forked_run(tmp_path: Path, address: str, until: str, steps: int = 2) -> tuple[subprocess.Popen, psutil.Process]:
    """`grpo-dist train` of a small run joining the Ray cluster at `address`, its driver forked from the session's
    warm process (as `grpo-dist up`'s would be), read until a line starting with `until`; the command and its driver."""
    import yaml
    from conftest import TESTS_DIR, small_config

    socket_path, shell = _warm_driver_setting()
    _up_record(tmp_path / "temp", socket_path)
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(small_config(tmp_path, run={"steps": steps}, ray={"address": address})))
    path = os.pathsep.join(filter(None, [str(TESTS_DIR), os.environ.get("PYTHONPATH")]))  # the reward fixtures
    env = {**shell, "TMPDIR": str(tmp_path / "temp"), "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}
    before = len(_drivers_forked(socket_path))
    command = subprocess.Popen([sys.executable, "-m", "grpo_dist", "train", str(config)], env=env, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=_umask_and_nice)  # fmt: skip
    said = []
    for line in command.stdout:
        said.append(line)
        if line.startswith(until):
            break
    assert said[-1:] and said[-1].startswith(until), "".join(said) + command.stderr.read()
    (forked,) = _drivers_forked(socket_path)[before:]
    driver = psutil.Process(int(forked.split()[1].rstrip(":")))
    assert psutil.Process(driver.ppid()).cmdline()[-1] == str(socket_path)  # the warm process's child
    assert driver.cmdline()[0] == f"grpo-dist train {config}"  # titled as the command
    assert driver.nice() == os.getpriority(os.PRIO_PROCESS, 0) + 3  # the command's priority (`_umask_and_nice`)
    return command, driver


def _umask_and_nice() -> None:
    os.umask(0o027)
    os.nice(3)


@pytest.mark.slow
def test_ctrl_c_to_the_command_stops_the_run_of_its_warm_driver(ray_cluster, tmp_path):
    """SIGINT to the command (Ctrl-C) reaches the driver it asked the warm process for: the run stops as one in the
    command's own process does, with a checkpoint of its last step, the stop's message and exit code 130."""
    address = ray_cluster.get_runtime_context().gcs_address  # the session's cluster, which the run joins
    command, driver = _forked_run(tmp_path, address, until="step ", steps=500)  # its first step
    try:
        command.send_signal(signal.SIGINT)
        code = command.wait(timeout=120)
        said = command.stderr.read()
    finally:
        command.kill()
    assert code == 130 and "grpo-dist: stopped; the policy is in" in said, said
    assert (tmp_path / "outputs" / "test" / "interrupted" / "model.safetensors").is_file()
    rows = tmp_path / "outputs" / "test" / "metrics.jsonl"  # the driver's own file, with the command's umask
    assert rows.stat().st_mode & 0o777 == 0o640, oct(rows.stat().st_mode)
    driver.wait(timeout=30)  # gone with its run (raises if it is not)


@pytest.mark.slow  # the session's warm process imports vLLM: not in `make test-fast`
def test_killing_the_command_kills_its_warm_driver(tmp_path):
    """The command killed (SIGKILL: nothing passed on) while its driver waits for a Ray cluster that never answers:
    the driver goes too, at once, not when the wait ends."""
    mute = socket.socket()  # takes the connection and never answers
    mute.bind(("127.0.0.1", 0))
    mute.listen(8)
    try:
        command, driver = _forked_run(tmp_path, f"127.0.0.1:{mute.getsockname()[1]}", until="== starting")
        command.kill()
        command.wait(timeout=30)
        driver.wait(timeout=10)  # Ray's own wait for the cluster is 30 s
    finally:
        mute.close()

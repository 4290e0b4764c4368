"""A local Ray cluster kept up between runs: `grpo-dist up` starts it, `grpo-dist down` stops it.

A run on this machine that names no `ray.address` joins it instead of starting a Ray cluster of its own, so that
repeated runs (a laptop's edit-and-run loop) pay for Ray's start once. Each run's actors are still its own: they
start with the run and stop with it; only Ray's own processes (its GCS, raylet and agents) stay up.

The cluster lives under a directory of this user's own in the machine's temporary directory (`home`): Ray's files
(`--temp-dir`, so that no other Ray cluster on the machine is touched, and `down` stops this one alone) and
`cluster.json`, what a run needs to join it (its address and size). A record whose cluster no longer answers (the
machine restarted, its processes were killed) is taken for no cluster and removed.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from grpo_dist.cluster import ray_settings, warm

WARM_SOCKET = "warm.sock"
"""The warm process's socket in the cluster's Ray directory (`Standing.temp_dir`): actors and drivers fork from it."""
START_TIMEOUT_S = 120.0  # `ray start --head` on a busy machine
STOP_GRACE_S = 10.0  # what Ray's processes get to end on SIGTERM before they are killed


@dataclass(frozen=True)
class Standing:
    """A cluster `grpo-dist up` started: where it answers, its logical CPUs, Ray's directory, when it started."""

    address: str
    num_cpus: int
    temp_dir: str
    started: float
    forks_drivers: bool = False
    """Whether its warm process forks runs' drivers too (`warm_driver`; one an older grpo-dist started does not)."""

    def join_environment(self) -> None:
        """Set what this process needs to join the cluster: token authentication (the cluster's token is this
        user's, `~/.ray/auth_token` or `RAY_AUTH_TOKEN`, as for the cluster `ray start` started), taken by this
        process's Ray as its own `ray start` takes it (the mode is read once, when Ray is imported)."""
        from ray._raylet import Config

        os.environ["RAY_AUTH_MODE"] = "token"
        Config.initialize("")


def home() -> Path:
    """This user's directory for the cluster (short: Ray's socket paths under it must stay under 108 bytes)."""
    return Path(tempfile.gettempdir()) / f"grpo-dist-up-{os.getuid()}"


def _record() -> Path:
    return home() / "cluster.json"


def find() -> Standing | None:
    """The cluster `grpo-dist up` started on this machine, when it is up (its address accepts a connection)."""
    try:
        standing = Standing(**json.loads(_record().read_text()))
    except (OSError, ValueError, TypeError):
        return None
    if not _answers(standing.address):
        _record().unlink(missing_ok=True)
        return None
    return standing


def _answers(address: str, timeout_s: float = 2.0) -> bool:
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except (OSError, ValueError):
        return False
    return True


DEFAULT_CPUS = 8
"""The cluster's logical CPUs by default, where the machine has fewer: a run asks for logical CPUs, which need not be
cores (the quick start's actors ask for 2.5), and a run that starts a cluster of its own gets what it asks for."""


def up(num_cpus: int | None = None, warm_workers: bool = True) -> tuple[Standing, bool]:
    """Start the cluster (`num_cpus` logical CPUs; by default the machine's count, at least `DEFAULT_CPUS`; its actors
    at the priority of the processes that start them and without Ray's metrics, as
    `grpo_dist.cluster.ray_settings` says) unless one is up already. Returns it and whether it
    was started now. Raises `StandingError` with Ray's own output when it cannot start."""
    if (standing := find()) is not None:
        return standing, False
    cpus = num_cpus or max(DEFAULT_CPUS, os.cpu_count() or 1)
    temp_dir, port = home() / "ray", _free_port()
    temp_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    command = [
        sys.executable, "-m", "grpo_dist.cluster.warm", "ray-start", "--head", f"--port={port}", f"--num-cpus={cpus}",
        f"--temp-dir={temp_dir}", "--include-dashboard=false", "--disable-usage-stats",
    ]  # fmt: skip
    _ensure_token()
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "RAY_AUTH_MODE": "token"}
    env.update(ray_settings.cluster_environment())
    if warm_workers and warm.available():  # its path names temp_dir: `down` stops it with Ray's processes
        socket_path = temp_dir / WARM_SOCKET
        warm.start(socket_path, temp_dir / "warm.log", detached=True)
        env[warm.SOCKET_ENV] = str(socket_path)
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=START_TIMEOUT_S)
    except subprocess.TimeoutExpired as err:
        _stop_processes(temp_dir)
        raise StandingError(f"`ray start --head` did not finish within {START_TIMEOUT_S:g} s") from err
    if done.returncode != 0:
        _stop_processes(temp_dir)
        raise StandingError(
            f"`ray start --head` failed (exit {done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}"
        )
    standing = Standing(
        f"127.0.0.1:{port}", cpus, str(temp_dir), time.time(), forks_drivers=env.get(warm.SOCKET_ENV) is not None
    )
    record = _record().with_suffix(".tmp")
    record.write_text(json.dumps(asdict(standing)))
    record.replace(_record())
    return standing, True


def _ensure_token() -> None:
    """This user's Ray token, written first where there is none: the cluster answers only who holds it, as Ray's
    own local clusters do (other users of the machine cannot run code on it)."""
    from ray._private.authentication.authentication_token_setup import generate_and_save_token
    from ray._raylet import AuthenticationTokenLoader

    if not AuthenticationTokenLoader.instance().has_token(ignore_auth_mode=True):
        generate_and_save_token()


def down() -> int:
    """Stop the cluster's processes (SIGTERM, then SIGKILL after STOP_GRACE_S) and forget it; how many there were.
    The runs on it stop with it."""
    _record().unlink(missing_ok=True)
    return _stop_processes(home() / "ray")


def _stop_processes(temp_dir: Path) -> int:
    """Stop every process whose command line names `temp_dir` (Ray passes each of its processes its directory), and
    their descendants: the raylet's agents retitle themselves (`ray::DashboardAgent`, `ray::RuntimeEnvAgent`) and,
    left to notice their raylet gone, lived about a minute longer, holding the agent's fixed port."""
    import psutil

    mark = str(temp_dir)
    found = {}
    for process in psutil.process_iter(["cmdline"]):
        try:
            if process.pid != os.getpid() and any(mark in part for part in process.info["cmdline"] or []):
                found[process.pid] = process
                found.update((child.pid, child) for child in process.children(recursive=True))
        except psutil.Error:
            continue
    found = [process for pid, process in found.items() if pid != os.getpid()]
    for process in found:
        try:
            process.send_signal(signal.SIGTERM)
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(found, timeout=STOP_GRACE_S)
    for process in alive:
        try:
            process.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=STOP_GRACE_S)
    return len(found)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class StandingError(RuntimeError):
    """The cluster `grpo-dist up` asked for could not be started."""

"""Ray nodes of a test's own, started with `ray start` (token auth, tests/ importable), and stopped without touching
any other Ray cluster on the machine."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import psutil
from conftest import TESTS_DIR

# The tests' Ray nodes listen on ports drawn as the learner group's are.
from grpo_dist.cluster.actors.learner import free_port as free_port
from grpo_dist.cluster.ray_settings import cluster_environment

RAY = str(Path(sys.executable).parent / "ray")


TOKEN = uuid.uuid4().hex + uuid.uuid4().hex  # the cluster runs with token auth, every node and the driver


def node_env() -> dict[str, str]:
    """The environment of the test's Ray nodes and drivers: token auth, and tests/ importable (reward fixtures)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS_DIR), os.environ.get("PYTHONPATH")]))}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=TOKEN, **cluster_environment())  # as grpo-dist's own clusters
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])  # `python`: this one
    env.pop("RAY_ADDRESS", None)
    return env


def private_mounts_work(path: Path) -> bool:
    """Whether this machine lets a process mount a tmpfs in a mount namespace of its own (root, `unshare`)."""
    probe = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs tmpfs {path}"], capture_output=True)
    return probe.returncode == 0


def ray_start_in_shell(warm_dir: Path) -> str:
    """A shell command, `ray start`'s arguments to follow it, that starts a Ray node whose workers are forked from a
    warm process of the node's own (`grpo_dist.cluster.warm`, serving in `warm_dir`) started beside it in the same
    shell: one that sees what the node sees (a node in a mount namespace of its own, its private disk). Plain `ray
    start` where workers cannot start warm."""
    from grpo_dist.cluster import warm, warm_launch

    if not warm.available():
        return f"exec {RAY} start"
    warm_dir.mkdir(parents=True, exist_ok=True)
    socket, python = warm_dir / "warm.sock", sys.executable
    return (f"{{ {python} -m grpo_dist.cluster.warm {socket} >{warm_dir / 'warm.log'} 2>&1 </dev/null & }} && "
            f"{warm_launch.SOCKET_ENV}={socket} exec {python} -m grpo_dist.cluster.warm ray-start")  # fmt: skip


def node_root(name: str) -> Path:
    """A directory of its own for a test's Ray nodes, under /tmp: Ray puts its Unix sockets under a node's temp dir,
    and a socket's path holds at most 107 bytes, which pytest's directories under pytest-xdist leave no room for."""
    return Path(tempfile.mkdtemp(prefix=f"grpo-{name}-", dir="/tmp"))


def cluster_cpus(address: str) -> float:
    status = subprocess.run([RAY, "status", f"--address={address}"], capture_output=True, text=True, timeout=60,
                            env=node_env())  # fmt: skip
    for line in status.stdout.splitlines():
        if line.strip().endswith(" CPU") and "/" in line:
            return float(line.split("/")[1].split()[0])
    return 0.0


def stop_processes_under(root: Path) -> None:
    """Kill every process of the test's own Ray nodes, never another's: those whose command line names its temp dirs
    or whose environment holds its token, and their children (Ray's agents rename themselves)."""
    found: set[psutil.Process] = set()
    for process in psutil.process_iter(["cmdline", "environ"]):
        command, env = " ".join(process.info["cmdline"] or []), process.info["environ"] or {}
        if str(root) in command or env.get("RAY_AUTH_TOKEN") == TOKEN:
            try:
                found.update([process, *process.children(recursive=True)])
            except psutil.Error:
                found.add(process)
    for process in found:
        try:
            process.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(list(found), timeout=30)


def own_ports() -> list[str]:
    """`ray start` flags giving a node free ports for the services whose defaults are fixed (the dashboard agent's
    52365, the client server's 10001): another Ray cluster on the machine holding those would disable them here."""
    return [f"--dashboard-agent-listen-port={free_port()}", f"--ray-client-server-port={free_port()}"]

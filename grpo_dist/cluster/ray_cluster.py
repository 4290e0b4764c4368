"""The Ray cluster a run's actors live on: the one at `ray.address`, else the local one `grpo-dist up` keeps
(`grpo_dist.cluster.standing`), else one started for the run and stopped with it; and the CPUs its actors ask for."""

from __future__ import annotations

import contextlib
import logging
import os
import socket

import ray

from grpo_dist.cluster import ray_settings, warm
from grpo_dist.cluster import standing as standing_cluster
from grpo_dist.config import Config, ConfigError
from grpo_dist.storage.console import section

log = logging.getLogger("grpo_dist")


def actor_cpus(cfg: Config) -> float:
    """Logical CPUs the actors of a run ask for."""
    engines = [(cfg.rollout.num_generators, cfg.rollout.num_cpus)]
    if (judge := cfg.reward.judge) is not None:
        engines.append((judge.num_engines, judge.num_cpus))
    if (distill := cfg.algorithm.distill) is not None:
        engines.append((distill.num_engines, distill.num_cpus))
    scorer = cfg.reward.model
    return (
        cfg.learner.num_ranks * cfg.learner.num_cpus
        + sum(count * cpus for count, cpus in engines)
        + cfg.reward.num_workers * cfg.reward.num_cpus
        + (scorer.num_workers * scorer.num_cpus if scorer is not None else 0)
    )


CPU_SHARE_ENV = "GRPO_DIST_CPU_SHARE"
"""How many runs share this machine's cores at a time, where several run side by side on one CPU machine (a test
suite's workers, a sweep): each learner rank's torch threads are then the cores divided among its node's ranks and
the other runs (`Learner._threads`). With no other run's share left to it, a rank's OpenMP threads wait for cores
another run holds: two quick starts side by side on 2 cores took 4.03 s a step with 2 threads a rank and 1.93 s with
1 (`benchmarks/contention.py --beside 1`, docs/performance.md)."""


def cpu_share() -> int:
    """`GRPO_DIST_CPU_SHARE` (`CPU_SHARE_ENV`) of this process's environment: 1 when unset."""
    value = os.environ.get(CPU_SHARE_ENV, "").strip()
    if not value:
        return 1
    if not value.isdigit() or int(value) < 1:
        raise ConfigError(
            f"{CPU_SHARE_ENV}={value!r} in the environment: the number of runs sharing this machine's cores, a whole"
            " number of at least 1 (unset: 1)"
        )
    return int(value)


def share_of_cores(sharers: int) -> int:
    """This process's share of the cores it may run on, split among `sharers` (at least 1): a CPU process's torch
    threads where several training processes share the machine (`cpu_share`)."""
    return max(1, len(os.sched_getaffinity(0)) // sharers)


def start_ray(cfg: Config) -> bool:
    """Join `ray.address`; else the local cluster `grpo-dist up` started, when it is up (`grpo_dist.cluster.standing`);
    else start a local cluster of this run's own big enough for its actors (even where another Ray cluster runs on
    the machine: that one is joined only when named in `ray.address`), its actors forked from a warm process
    (`grpo_dist.cluster.warm.start_for_this_run`, which `stop_ray` stops). Returns whether it did: a process already
    connected to Ray (the caller's own `ray.init`) keeps that connection."""
    cpu_share()  # a bad value is refused before any cluster starts
    if cfg.ray.address and (problem := unreachable(cfg.ray.address)):
        raise ConnectionError(f"ray.address: cannot reach the Ray cluster at {cfg.ray.address}: {problem}")
    if ray.is_initialized():
        if cfg.ray.address:
            log.info(
                "this process is already connected to Ray (%s): the run uses that connection, ray.address %s is not"
                " joined again",
                ray.get_runtime_context().gcs_address,
                cfg.ray.address,
            )
        return False
    quiet = {"TOKENIZERS_PARALLELISM": "false"}
    if cfg.ray.address:
        os.environ.setdefault("RAY_gcs_server_port_wait_time_s", "30")  # Ray's own retries would take minutes
        ray.init(address=cfg.ray.address, runtime_env={"env_vars": quiet}, log_to_driver=True)
        return True
    if (standing := standing_cluster.find()) is not None:
        if (wanted := actor_cpus(cfg)) > standing.num_cpus:
            raise ConfigError(
                f"the local Ray cluster `grpo-dist up` started ({standing.address}) has {standing.num_cpus} CPUs and"
                f" this run's actors ask for {wanted:g}: `grpo-dist down`, then `grpo-dist up --num-cpus"
                f" {int(wanted + 0.999)}`"
            )
        section(f"joining the local Ray cluster `grpo-dist up` started ({standing.address}); `grpo-dist down` stops it")
        standing.join_environment()
        ray.init(address=standing.address, runtime_env={"env_vars": quiet}, log_to_driver=True)
        return True
    num_cpus = cfg.ray.num_cpus or max(os.cpu_count() or 1, int(actor_cpus(cfg) + 0.999))
    warm.start_for_this_run()  # the command started it already, first thing; `train()` from Python starts it here
    with warm.used_by_this_run():
        start_local_ray(num_cpus=num_cpus, runtime_env={"env_vars": quiet}, log_to_driver=True)
    return True


def starts_a_cluster_of_its_own(cfg: Config) -> bool:
    """Whether `start_ray` will start a local cluster for this run (no `ray.address`, none `grpo-dist up` keeps, this
    process not connected to Ray yet)."""
    return not cfg.ray.address and not ray.is_initialized() and standing_cluster.find() is None


def stop_ray() -> None:
    """Stop this process's Ray (a local cluster goes with it) and the warm process its workers were forked from."""
    ray.shutdown()
    warm.stop_for_this_run()


LOCAL_START_ATTEMPTS = 2


def start_local_ray(**settings) -> None:
    """`ray.init` of a local cluster of this process's own, started again once where Ray gave up on it: Ray gives a
    new node's raylet a fixed 30 s to register, which a machine busy with another run's start-up can exceed. What the
    failed start left running (its GCS, raylet and agents, children of this process) is stopped first. Its actors
    run at the driver's priority, it collects no Ray metrics (`grpo_dist.cluster.ray_settings`), and it runs none
    of Ray's processes that serve nothing there (`lean_local_node`)."""
    system = {
        "worker_niceness": ray_settings.WORKER_NICENESS,
        "enable_metrics_collection": ray_settings.METRICS_COLLECTION,
        **settings.pop("_system_config", {}),
    }
    for attempt in range(1, LOCAL_START_ATTEMPTS + 1):
        try:
            with lean_local_node():
                ray.init(address="local", include_dashboard=False, _system_config=system, **settings)
            return
        except Exception as err:  # Ray raises a bare Exception for it
            if "timed out during startup" not in str(err) or attempt == LOCAL_START_ATTEMPTS:
                raise
            log.warning("the local Ray cluster did not start (%s); starting it again", err)
            stop_ray_children()


@contextlib.contextmanager
def lean_local_node():
    """Within the block, a local node `ray.init` or `ray.cluster_utils.Cluster` starts in this process runs only what
    a run uses: no API server on a head node, and its dashboard agent's HTTP server on a port the system chooses.

    - The API server: with the dashboard off (`include_dashboard=False`, as grpo-dist always starts its clusters),
      Ray still starts its dashboard's process with one module, Ray's usage statistics (`UsageStatsHead`): no
      dashboard, no job submission, no state API. It imports Ray and its web server before `ray.init` may return,
      which waits for it to publish an address: about 1.3 CPU seconds and 1 to 2 s of every local cluster's start on
      a 2-core machine (`benchmarks/startup.py`, `benchmarks/run_cost.py`; docs/performance.md). A node started
      otherwise (`ray start`, as `grpo-dist up` does once for many runs) is left as Ray starts it.
    - The agent's port: `ray.init` has no setting for it and Ray's default is a fixed port, 52365: where another
      cluster on the machine holds it (a run beside this one, a test suite's own cluster, or the agent of a cluster
      just stopped, which lingers), the new agent retries the bind for 4.4 s before giving up, and the raylet waits
      for it before the node counts as started: the quick start's step 1 came at 16.5 s with the port taken and
      14.0 s with this (`benchmarks/startup.py --up`, docs/performance.md). A local cluster serves no job
      submission, the one thing that port is for."""
    from ray._private import node

    parameters = ray._private.parameter
    fixed, api_server = parameters.RayParams, getattr(node.Node, "start_api_server", None)

    class FreeAgentPort(fixed):
        def __init__(self, *args, dashboard_agent_listen_port: int = 0, **kwargs):
            super().__init__(*args, dashboard_agent_listen_port=dashboard_agent_listen_port, **kwargs)

    def no_api_server(self, *, include_dashboard, raise_on_failure):
        if include_dashboard is not False:  # the dashboard asked for (True, or None: Ray's default, where it can)
            api_server(self, include_dashboard=include_dashboard, raise_on_failure=raise_on_failure)

    parameters.RayParams = FreeAgentPort
    if api_server is not None:
        node.Node.start_api_server = no_api_server
    try:
        yield
    finally:
        parameters.RayParams = fixed
        if api_server is not None:
            node.Node.start_api_server = api_server


def stop_ray_children() -> None:
    """Kill this process's child processes that run Ray's programs, and wait for them (at most 10 s)."""
    import psutil

    package = os.path.dirname(ray.__file__)
    left = []
    for child in psutil.Process().children(recursive=True):
        try:
            if any(package in part or part.startswith("ray::") for part in child.cmdline()):
                child.kill()
                left.append(child)
        except psutil.Error:
            pass
    psutil.wait_procs(left, timeout=10)


CONNECT_TIMEOUT_S = 10.0  # how long a cluster's address may take to accept a connection


def unreachable(address: str) -> str | None:
    """Why nothing answers at `address` within CONNECT_TIMEOUT_S, or None (also for `auto`, which Ray resolves)."""
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if address == "auto" or not sep or not port.isdigit():
        return None
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as err:
        return f"nothing answers at {host}:{port} within {CONNECT_TIMEOUT_S:g} s ({err})"
    return None

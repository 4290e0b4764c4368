"""The engine process a generator runs, as the generator sets it up: its settings (eager, dtype), its environment
(set before vLLM is imported), its engine core forked rather than spawned, the shared memory it is handed files in,
and the statistics its scheduler reports (`EngineStats`)."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile

from grpo_dist.config import RolloutConfig
from grpo_dist.sandbox.privileges import die_with_parent

ENGINE_MARK = "GRPO_DIST_ENGINE"
"""Set in a generator's environment, so the engine processes vLLM starts from it die with it
(`grpo_dist.cluster.actors.engine_plugin`)."""


def eager(rollout: RolloutConfig, on_gpu: bool) -> bool:
    """Whether the engine runs eagerly: `rollout.enforce_eager` when set; else on CPU only (CUDA graphs on a GPU)."""
    return rollout.enforce_eager if rollout.enforce_eager is not None else not on_gpu


def engine_dtype(rollout: RolloutConfig, on_gpu: bool) -> str:
    """`rollout.dtype`, auto meaning float32 on the CPU backend (where vLLM's auto would take a bfloat16 checkpoint
    as it is) and the model's own dtype on a GPU."""
    return "float32" if rollout.dtype == "auto" and not on_gpu else rollout.dtype


def kv_cache_bytes(rollout: RolloutConfig, on_gpu: bool) -> int | None:
    """The engine's KV cache in bytes (vLLM's `kv_cache_memory_bytes`): `rollout.cpu_kv_cache_gib` on the CPU
    backend, `rollout.kv_cache_gb` on a GPU when pinned; None leaves it to vLLM (`gpu_memory_utilization`). A vLLM
    without the setting is refused by name rather than left to size the cache its own way."""
    if not on_gpu:
        return int(rollout.cpu_kv_cache_gib * 2**30)
    if rollout.kv_cache_gb is None:
        return None
    from vllm.engine.arg_utils import AsyncEngineArgs

    if "kv_cache_memory_bytes" not in AsyncEngineArgs.__dataclass_fields__:
        raise ValueError(
            "rollout.kv_cache_gb: the installed vLLM cannot pin the KV cache in bytes (no kv_cache_memory_bytes); "
            "set rollout.kv_cache_gb null to size it by rollout.gpu_memory_utilization"
        )
    return int(rollout.kv_cache_gb * 1e9)


def engine_environment(eager_engine: bool) -> dict[str, str]:
    """Environment for a generator process, set before vLLM is imported: the engine core runs its model in its own
    process (no separate worker process: start-up in seconds), threads are not pinned (several engines may share the
    cores), the engine's processes die with the actor. An engine that runs eagerly (`eager`: the CPU backend's
    default) also runs without torch.compile: vLLM's sampler would still compile its log-prob gather on the first
    request that asks for log-probs, 3 of an engine's 9 seconds of start-up on the quick start's model (0.04 s
    without), and again whenever a batch's shape calls for a recompile."""
    return {
        **({"TORCHDYNAMO_DISABLE": "1"} if eager_engine else {}),
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
        "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
        "TOKENIZERS_PARALLELISM": "false",
        ENGINE_MARK: "1",
    }


def fork_engine_core() -> None:
    """Have vLLM start this process's engine core by forking it, not spawning it (a vLLM release without the hook
    spawns as before). vLLM's CPU backend always spawns, and a spawned engine core imports vLLM and torch again, most
    of its start-up's CPU time on a small model. Forking is safe here: the generator has touched no CUDA, runs no
    OpenMP work before the engine exists, and its engine core uses none of the Ray connection it inherits (only for
    one engine process: the "uni" executor). The child is set up as a spawned one is (`engine_core_child`)."""
    import multiprocessing

    import vllm.v1.engine.utils as launcher

    if hasattr(launcher, "get_mp_context"):
        launcher.get_mp_context = lambda: multiprocessing.get_context("fork")
        os.register_at_fork(after_in_child=engine_core_child)


def shm_dir() -> str | None:
    """Shared memory for files handed to the engine (weights, adapters), where the machine has it."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else None


def adapter_dir() -> str:
    """A new directory in shared memory for this process's adapters (`Generator.load_adapter`)."""
    return own_dir("adapters", shm_dir())


def sockets_dir() -> str:
    """A new directory for the sockets between this process and its engine core (vLLM's `VLLM_RPC_BASE_PATH`): vLLM
    leaves them where it makes them, six files an engine in the machine's temporary directory otherwise, after its
    engine has shut down."""
    return own_dir("engine-sockets")


def own_dir(kind: str, parent: str | None = None) -> str:
    """A new directory named by this process's pid for its `kind` of files, in `parent` (the machine's temporary
    directory by default); those of processes that died without removing theirs (their pid gone) are removed
    first."""
    import glob

    import psutil

    prefix = os.path.join(parent or tempfile.gettempdir(), f"grpo-dist-{kind}-")
    for stale in glob.glob(f"{prefix}*"):
        pid = stale.removeprefix(prefix).split("-")[0]
        if pid.isdigit() and not psutil.pid_exists(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"grpo-dist-{kind}-{os.getpid()}-", dir=parent)


def engine_core_child() -> None:
    """In the forked engine core: die with the generator, and be titled `VLLM::EngineCore` as a spawned one is (by the
    plugin and by vLLM, neither of which can do it in a fork: the plugin is not loaded again, and vLLM's retitling
    fails in a copy of a process Ray has retitled, so it is done with Ray's)."""
    die_with_parent()
    with contextlib.suppress(ImportError, AttributeError):
        from ray._raylet import setproctitle

        setproctitle("VLLM::EngineCore")


class EngineStats:
    """What vLLM's scheduler reports at every engine step, kept as highest values (KV-cache use, running and
    waiting requests) and a count (preemptions) until taken; fed by a stat logger vLLM calls (`logger_factory`)."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self.kv_cache_usage = self.running = self.waiting = 0.0
        self.preemptions = 0.0
        self.steps = 0

    def take(self) -> dict[str, float]:
        found = {
            "kv_cache_usage_max": self.kv_cache_usage,
            "running_max": self.running,
            "waiting_max": self.waiting,
            "preemptions": self.preemptions,
            "engine_steps": float(self.steps),
        }
        self._reset()
        return found

    def record(self, scheduler, iteration) -> None:
        if scheduler is not None:
            self.kv_cache_usage = max(self.kv_cache_usage, float(scheduler.kv_cache_usage))
            self.running = max(self.running, float(scheduler.num_running_reqs))
            self.waiting = max(self.waiting, float(scheduler.num_waiting_reqs))
            self.steps += 1
        if iteration is not None:
            self.preemptions += iteration.num_preempted_reqs

    def logger_factory(self):
        """A factory of vLLM stat loggers (one per engine) that feed this."""
        from vllm.v1.metrics.loggers import StatLoggerBase

        stats = self

        class Feed(StatLoggerBase):
            def __init__(self, vllm_config, engine_index: int = 0) -> None:
                pass

            def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
                stats.record(scheduler_stats, iteration_stats)

            def log_engine_initialized(self) -> None:
                pass

        return Feed

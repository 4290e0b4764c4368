"""Where a stalled run is stuck: when a phase passes its bound, the Python stacks of the actors it waited on, taken
from outside each process by py-spy (it reads a process stuck in native code or holding the interpreter lock as
well as one asleep), into `<run dir>/stalls/`, one file per stall, named in the error or warning that reports it.

Each actor's stack is taken on its own node (a task placed there runs `py-spy dump --pid`), so an actor on another
machine is read as one on this one. Every wait is bounded; an actor whose stack cannot be read (its process gone,
py-spy missing or refused by the node's ptrace settings) is listed with why, and the run goes on as it would have.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

log = logging.getLogger("grpo_dist")

DUMP_TIMEOUT_S = 20.0
"""The longest one actor's stack is read for (py-spy on its node, and the task that runs it)."""
STALLS_DIR = "stalls"
"""The run directory's folder of stack dumps (`grpo-dist status` counts them: `grpo_dist.storage.status`)."""


def dump(directory: Path | None, what: str, actors: dict[str, ray.actor.ActorHandle]) -> str:
    """Write the stacks of `actors` (by the name an error gives each) into a new file under `directory` for the
    stall `what` (a phase and the bound it passed), and return the words that name it in the stall's message
    (" [stacks: PATH]"), or "" with no directory or no file written (the error is logged)."""
    if directory is None or not actors:
        return ""
    started = time.monotonic()
    sections = [f"# {what}", f"# at {time.strftime('%Y-%m-%d %H:%M:%S')}, {len(actors)} actor(s)", ""]
    stacks = _read_all(actors)
    for name, text in stacks.items():
        sections += [f"## {name}", text.rstrip(), ""]
    try:
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{_number(directory)}.txt"
        path.write_text("\n".join(sections))
    except OSError as err:
        log.warning("could not write the stalled actors' stacks into %s: %s", directory, err)
        return ""
    log.info("stacks of %d stalled actor(s) in %s (%.1f s)", len(actors), path, time.monotonic() - started)
    return f" [stacks: {path}]"


def _number(directory: Path) -> int:
    return len(list(directory.glob("*.txt"))) + 1


def _read_all(actors: dict[str, ray.actor.ActorHandle]) -> dict[str, str]:
    """Each actor's stack as py-spy prints it, or why there is none; read on all their nodes at once."""
    found: dict[str, str] = {}
    tasks: dict[str, ray.ObjectRef] = {}
    for name, actor in actors.items():
        try:
            where = _where(actor)
        except Exception as err:  # the actor table is a debugging interface: never let it fail the run's handling
            found[name] = f"(not read: {type(err).__name__}: {err})"
            continue
        if where is None:
            found[name] = "(not read: its process is gone)"
            continue
        pid, node_id = where
        strategy = NodeAffinitySchedulingStrategy(node_id, soft=False)
        tasks[name] = _py_spy_dump.options(scheduling_strategy=strategy).remote(pid)
    if tasks:
        ready, _ = ray.wait(list(tasks.values()), num_returns=len(tasks), timeout=DUMP_TIMEOUT_S + 10)
        for name, task in tasks.items():
            if task not in ready:
                ray.cancel(task, force=True)
                found[name] = f"(not read within {DUMP_TIMEOUT_S + 10:g} s)"
                continue
            try:
                found[name] = ray.get(task)
            except Exception as err:
                found[name] = f"(not read: {type(err).__name__}: {err})"
    return {name: found[name] for name in actors}


def _where(actor: ray.actor.ActorHandle) -> tuple[int, str] | None:
    """(pid, node id) of a live actor's process, from the cluster's actor table; None when it is not alive."""
    info = ray._private.state.actors(actor_id=actor._actor_id.hex())
    if not info or info.get("State") != "ALIVE" or not info.get("Pid"):
        return None
    return int(info["Pid"]), info["Address"]["NodeID"]


@ray.remote(num_cpus=0, max_retries=0)
def _py_spy_dump(pid: int) -> str:
    """py-spy's dump of process `pid` on this node (its threads' Python stacks, innermost call first); of a stopped
    process, read without suspending it."""
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(py_spy).exists():
        return "(not read: py-spy is not installed on this node; `pip install py-spy`)"
    done = None
    for options in ([], ["--nonblocking"]):  # a process stopped (SIGSTOP) cannot be suspended: read it as it is
        try:
            done = subprocess.run(
                [py_spy, "dump", "--subprocesses", *options, "--pid", str(pid)],
                capture_output=True,
                text=True,
                timeout=DUMP_TIMEOUT_S,
            )
        except subprocess.TimeoutExpired:
            return f"(not read: py-spy did not finish within {DUMP_TIMEOUT_S:g} s)"
        if done.returncode == 0:
            return done.stdout
    return f"(not read: py-spy exited {done.returncode}: {done.stderr.strip()[-500:]})"

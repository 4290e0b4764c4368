"""Where a stalled run is stuck: when a phase passes its bound, the Python stacks of the actors it waited on, taken
from outside each process by py-spy (it reads a process stuck in native code or holding the interpreter lock as
well as one asleep), into `<run dir>/stalls/`, one file per stall, named in the error or warning that reports it.

Each actor's stack is taken on its own node (a task placed there runs `py-spy dump --pid`), so an actor on another
machine is read as one on this one. Every wait is bounded; an actor whose stack cannot be read (its process gone,
py-spy missing or refused by the node's ptrace settings) is listed with why, and the run goes on as it would have.
"""

from __future__ import annotations

import itertools
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
_NUMBERS = itertools.count(1)  # this process's stalls, in the order written (thread-safe: `next` holds the GIL)
STALLS_DIR = "stalls"
"""The run directory's folder of stack dumps (`grpo-dist status` counts them: `grpo_dist.storage.status`)."""


def dump(directory: Path | None, what: str, actors: dict[str, ray.actor.ActorHandle]) -> str:
    """Write the stacks of `actors` (by the name an error gives each) into a new file under `directory` for the
    stall `what` (a phase and the bound it passed), and return the words that name it in the stall's message
    (" [stacks: PATH]"), or "" with no directory or no file written. Never raises: whatever goes wrong is logged,
    and the stall is handled as it would have been."""
    if directory is None or not actors:
        return ""
    try:
        return _dump(directory, what, actors)
    except Exception as err:  # reading the stacks is a help to the user, never a new way for the run to fail
        log.warning("could not write the stalled actors' stacks into %s: %s: %s", directory, type(err).__name__, err)
        return ""


def _dump(directory: Path, what: str, actors: dict[str, ray.actor.ActorHandle]) -> str:
    started = time.monotonic()
    sections = [f"# {what}", f"# at {time.strftime('%Y-%m-%d %H:%M:%S')}, {len(actors)} actor(s)", ""]
    for name, text in _read_all(actors).items():
        sections += [f"## {name}", text.rstrip(), ""]
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{next(_NUMBERS)}.txt"
    with path.open("x") as out:  # a new file, never another stall's
        out.write("\n".join(sections))
    log.info("stacks of %d stalled actor(s) in %s (%.1f s)", len(actors), path, time.monotonic() - started)
    return f" [stacks: {path}]"


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
    deadline, failures = time.monotonic() + DUMP_TIMEOUT_S, []
    # With its children first (an engine core, a sandbox's code); a child py-spy cannot read (a process that is not
    # Python, one in a sandbox's own mount namespace) fails the whole dump, so then the actor alone. A process
    # stopped (SIGSTOP) cannot be suspended: it is read as it is.
    for options in (["--subprocesses"], ["--subprocesses", "--nonblocking"], [], ["--nonblocking"]):
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            done = subprocess.run(
                [py_spy, "dump", *options, "--pid", str(pid)], capture_output=True, text=True, timeout=left
            )
        except subprocess.TimeoutExpired:
            failures.append(f"{' '.join(options) or 'alone'}: no answer")
            break
        if done.returncode == 0:
            return done.stdout if options[:1] == ["--subprocesses"] else f"(its children not read)\n{done.stdout}"
        failures.append(f"{' '.join(options) or 'alone'}: {_last_line(done.stderr)}")
    return f"(not read: py-spy {'; '.join(failures)})"


def _last_line(text: str) -> str:
    """py-spy's error, without the backtrace it prints after it."""
    lines = [line.strip() for line in text.split("Stack backtrace:")[0].splitlines() if line.strip()]
    return " ".join(lines)[-300:] or "failed"

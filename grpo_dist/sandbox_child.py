"""The sandbox process itself (`python -m grpo_dist.sandbox_child`, started by `grpo_dist.sandbox.Sandbox`): it
takes its limits, turns the network off, becomes `nobody` where it runs as root, imports the reward functions or
tools it is named, then answers one JSON request at a time (docs/sandbox.md). Nothing imports this module: it is the
top of its own process, the one place that resolves user rewards and tools by name inside a sandbox."""

from __future__ import annotations

import ctypes
import errno
import functools
import json
import math
import os
from typing import Any

from grpo_dist import jail
from grpo_dist.agents.tools import resolve_tool
from grpo_dist.rewards.registry import raised, resolve_reward, to_score
from grpo_dist.sandbox import Limits
from grpo_dist.types import REWARD_LIMIT

CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000  # linux/sched.h


def _failed(error: BaseException, limits: Limits) -> dict[str, str]:
    """The answer to a call that raised `error`: its message, with what a limit of the sandbox had to do with it,
    and its kind (`types.FAILURE_KINDS`), told by the error's type and the limits, never by its message alone."""
    failure = raised(error)
    kind, note = failure.kind, ""
    if isinstance(error, MemoryError):
        note = f" (the sandbox limits its memory to {limits.memory_mb} MB: reward.sandbox_memory_mb)"
    elif not limits.processes and (
        isinstance(error, BlockingIOError)
        or (isinstance(error, RuntimeError) and str(error) == "can't start new thread")
    ):
        kind, note = "processes", " (the sandbox allows no processes or threads: reward.sandbox_processes)"
    elif not limits.network and isinstance(error, OSError) and error.errno in (errno.ENETUNREACH, errno.EADDRNOTAVAIL):
        kind, note = "network", " (the sandbox allows no network: reward.sandbox_network)"
    return {"error": failure.reason + note, "kind": kind}


def _network_off() -> str | None:
    """A network namespace of its own, with no interface up; why not, where the machine refuses."""
    flags = CLONE_NEWNET if os.geteuid() == 0 else CLONE_NEWUSER | CLONE_NEWNET
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(flags) != 0:
        return f"the network stays on in the reward sandbox ({os.strerror(ctypes.get_errno())})"
    return None


def _become_nobody() -> str | None:
    """Run as root, become `nobody` (`jail.become_nobody`); why not, where the machine refuses."""
    if os.geteuid() != 0:
        return None
    try:
        jail.become_nobody()
    except OSError as err:
        return f"the sandbox runs as root here (cannot become nobody: {err.strerror})"
    return None


def answer_to(answers: Any, request: str | None, message: dict) -> None:
    answers.write(json.dumps(message if request is None else {"id": request, **message}).encode() + b"\n")
    answers.flush()


def _serve() -> None:
    import resource

    # The requests and answers keep the pipes; the reward code gets no input and prints to the log.
    requests, answers = os.fdopen(os.dup(0), "rb"), os.fdopen(os.dup(1), "wb")
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(2, 1)

    answer = functools.partial(answer_to, answers, None)

    setup = json.loads(requests.readline())
    limits = Limits(**setup["limits"])
    notes = [note for note in [None if limits.network else _network_off(), _become_nobody()] if note]
    if limits.require and notes:
        answer({"error": f"{'; '.join(notes)}, and reward.isolation=require (docs/sandbox.md)"})
        return
    jail.die_with_parent()  # after the change of user, which clears it
    memory = limits.memory_mb << 20
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resolve = resolve_reward if setup.get("kind", "rewards") == "rewards" else resolve_tool
    functions = []
    for name in setup["functions"]:  # imported as nobody, so a module planted on the path runs as nobody too
        try:
            functions.append(resolve(name))
        except ValueError as err:
            answer({"error": str(err)})
            return
    if not limits.processes:
        resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))  # no process and no thread beyond this one
    answer({"ready": True, "notes": notes})
    for line in requests:
        request = json.loads(line)
        answer = functools.partial(answer_to, answers, request["id"])
        used = sum(resource.getrusage(resource.RUSAGE_SELF)[:2])
        _, hard = resource.getrlimit(resource.RLIMIT_CPU)
        resource.setrlimit(resource.RLIMIT_CPU, (math.ceil(used + limits.cpu_s), hard))
        try:
            if "tool" in request:
                found = functions[request["tool"]](**request["arguments"])
                answer({"result": found if isinstance(found, str) else json.dumps(found, default=str)})
            else:
                function = functions[request["call"]]
                score = to_score(function(request["prompt"], request["completion"], **request["kwargs"]))
                if abs(score) > REWARD_LIMIT:
                    raise ValueError(f"returned {score:g}, beyond ±{REWARD_LIMIT:g} (rewards.REWARD_LIMIT)")
                answer({"value": score})
        except BaseException as error:  # anything the user code raises, even SystemExit, is that call's failure
            answer(_failed(error, limits))


if __name__ == "__main__":
    _serve()

"""The sandbox's server (`python -I -c sandbox.BOOT`, started by `grpo_dist.sandbox.Sandbox`): it takes its setup,
limits its memory, turns the network off and becomes `nobody` where no jail did that before it started, imports the
reward functions or tools it is named, then answers one JSON request at a time, each in a fresh process forked for
that call (docs/sandbox.md): the server never runs a user function's code; the call's process never sees the
request's id or the pipes the answers leave by: it writes its answer to a pipe of its own, which the server relays.
The built-in rewards and tools (`BUILTIN_REWARDS`, `BUILTIN_TOOLS`: this package's, which keep no state and run no
text as code) are called in the server itself, as a fork would cost each call some milliseconds. Nothing imports
this module: it is the top of its own process, the one place that resolves user rewards and tools inside a sandbox."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import json
import math
import os
import select
import signal
import sys
import time
from collections.abc import Callable
from typing import Any, NoReturn

from grpo_dist.agents.tools import BUILTIN_TOOLS, resolve_tool
from grpo_dist.rewards.registry import BUILTIN_REWARDS, raised, resolve_reward, to_score
from grpo_dist.sandbox import ANSWER_LIMIT, Limits, ended_kind, exit_reason, privileges
from grpo_dist.types import REWARD_LIMIT

CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000  # linux/sched.h
MAX_ANSWER_BYTES = ANSWER_LIMIT - (1 << 10)  # what one call may write: room left for the id the server adds
UNREACHABLE = (errno.ENETUNREACH, errno.EADDRNOTAVAIL, errno.ECONNREFUSED)  # in a network namespace of its own
LIMITED = b"+"  # what a call's process writes once it is limited, before the call's code runs
CALL_KINDS = ("raised", "memory", "processes", "network", "unscorable")
"""The kinds of failure a call's process may answer (`_failed`); anything else it says is out of protocol."""


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
    elif not limits.network and isinstance(error, OSError) and error.errno in UNREACHABLE:
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
    """Run as root, become `nobody` (`privileges.become_nobody`); why not, where the machine refuses."""
    if os.geteuid() != 0:
        return None
    try:
        privileges.become_nobody()
    except OSError as err:
        return f"the sandbox runs as root here (cannot become nobody: {err.strerror})"
    return None


def answer_to(answers: Any, request: str | None, message: dict) -> None:
    answers.write(json.dumps(message if request is None else {"id": request, **message}).encode() + b"\n")
    answers.flush()


def serve() -> None:
    """Set up as `Sandbox._start` asks, say it is ready (or why not), then answer every request until its end."""
    import resource

    # The requests and answers keep the pipes; the reward code gets no input and prints to the log.
    requests, answers = os.fdopen(os.dup(0), "rb"), os.fdopen(os.dup(1), "wb")
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(2, 1)
    answer = functools.partial(answer_to, answers, None)

    setup = json.loads(requests.readline())
    limits = Limits(**setup["limits"])
    notes = [] if setup["jailed"] else [n for n in [None if limits.network else _network_off(), _become_nobody()] if n]
    if limits.require and notes:
        answer({"error": f"{'; '.join(notes)}, and reward.isolation=require (docs/sandbox.md)"})
        return
    privileges.die_with_parent()  # after the change of user, which clears it
    memory = limits.memory_mb << 20
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    sys.path += setup["path"]  # only now: what `nobody` may write is imported as `nobody`
    try:
        functions = _imported(setup["functions"], setup.get("kind", "rewards"), setup.get("warm_builtins", True))
    except ValueError as err:
        answer({"error": str(err)})
        return
    privileges.hide_from_own_user()  # no call's process may read or trace this one
    privileges.reap_orphans_here()  # what a call leaves behind is this server's to reap (`_reaped`)
    answer({"ready": True, "notes": notes})
    kind = setup.get("kind", "rewards")
    label = "reward" if kind == "rewards" else "tool"
    own = [name in (BUILTIN_REWARDS if kind == "rewards" else BUILTIN_TOOLS) for name in setup["functions"]]
    keep = (requests.fileno(), answers.fileno())
    for line in requests:
        request = json.loads(line)
        request_id = request.pop("id")
        if own[request.get("call", request.get("tool", 0))]:  # a built-in: here, as it keeps no state
            answer_to(answers, request_id, _call(functions, request, limits))
            continue
        found = in_a_fresh_process(functools.partial(_call, functions, request, limits), limits, keep, label)
        answer_to(answers, request_id, found)
        _empty(setup["scratch"])


def _imported(names: list[str], kind: str, warm_builtins: bool = True) -> list[Callable[..., Any]]:
    """The functions `names`, each warmed up where it says how (its `sandbox_warmup`: a callable taking nothing,
    run once here so that no call's process imports or builds again what it needs, e.g. `math_answer`'s sympy), a
    built-in reward only with `warm_builtins`; `ValueError` naming what does not resolve or warm up."""
    functions = [(resolve_reward if kind == "rewards" else resolve_tool)(name) for name in names]
    for name, function in zip(names, functions, strict=True):
        if not warm_builtins and kind == "rewards" and name in BUILTIN_REWARDS:
            continue  # its first call imports what it needs
        warmup = getattr(function, "sandbox_warmup", None)
        try:
            if callable(warmup):
                warmup()
        except Exception as error:
            raise ValueError(f"{name}'s sandbox_warmup raised {type(error).__name__}: {error}") from error
    return functions


def _call(functions: list[Callable[..., Any]], request: dict, limits: Limits) -> dict:
    """One request's answer, as the call's process gives it: its result or value, or the error it raised."""
    try:
        if "tool" in request:
            found = functions[request["tool"]](**request["arguments"])
            return {"result": found if isinstance(found, str) else json.dumps(found, default=str)}
        function = functions[request["call"]]
        score = to_score(function(request["prompt"], request["completion"], **request["kwargs"]))
        if abs(score) > REWARD_LIMIT:
            raise ValueError(f"returned {score:g}, beyond ±{REWARD_LIMIT:g} (rewards.REWARD_LIMIT)")
        return {"value": score}
    except BaseException as error:  # anything the user code raises, even SystemExit, is that call's failure
        return _failed(error, limits)


def in_a_fresh_process(call: Callable[[], dict], limits: Limits, keep: tuple[int, ...], label: str) -> dict:
    """`call()` in a process forked for it, which limits itself first (`_limited`); its answer as the server relays
    it (`relayed`). The file descriptors `keep` are closed in it. What it started in its process group is killed."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        _limited(call, write_end, keep, limits)
    os.close(write_end)
    output, code, cpu_s = _collected(pid, read_end)
    if code == -signal.SIGKILL and cpu_s >= math.ceil(limits.cpu_s):  # its hard CPU limit: it ignored SIGXCPU
        code = -signal.SIGXCPU
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # it started nothing that is still there
    else:
        _reaped(pid)
    return relayed(output, code, label)


def _reaped(group: int, bound_s: float = 2.0) -> None:
    """Wait, at most `bound_s`, until no process of `group` (killed) is left: this server is their subreaper once the
    call's process is gone, and reaps them, so none is still there when the call is answered."""
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        try:
            os.killpg(group, 0)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.005)


def _limited(call: Callable[[], dict], write_end: int, keep: tuple[int, ...], limits: Limits) -> NoReturn:
    """The call's process: a process group of its own, no capability and no new privilege, its CPU time, no process
    or thread unless allowed; then the call, its answer one JSON line on `write_end`."""
    import resource

    try:
        for descriptor in keep:
            os.close(descriptor)
        os.setpgid(0, 0)
        privileges.die_with_parent()
        privileges.no_privileges()
        _, hard = resource.getrlimit(resource.RLIMIT_CPU)
        seconds = math.ceil(limits.cpu_s)
        bound = seconds + 1 if hard == resource.RLIM_INFINITY else min(seconds + 1, hard)
        resource.setrlimit(resource.RLIMIT_CPU, (min(seconds, bound), bound))
        if not limits.processes:
            resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))  # no process and no thread beyond this one
        os.write(write_end, LIMITED)  # from here on, however it ends is the call's doing (`relayed`)
        data = memoryview(json.dumps(call()).encode() + b"\n")
        while data:
            data = data[os.write(write_end, data) :]
    except BaseException:  # a process that could not limit itself or answer: `relayed` says so
        os._exit(70)
    os._exit(0)


def _collected(pid: int, read_end: int) -> tuple[bytes, int, float]:
    """What the call's process `pid` wrote on `read_end` until it closed it (or, when a process it started still
    holds it, until it ended), at most `MAX_ANSWER_BYTES` (then it is killed); its exit status and CPU seconds."""
    ended = os.pidfd_open(pid)
    data = bytearray()
    try:
        while len(data) <= MAX_ANSWER_BYTES:
            ready = select.select([read_end, ended], [], [])[0]
            if read_end not in ready:  # it ended; take what it left
                os.set_blocking(read_end, False)
                try:
                    while chunk := os.read(read_end, 1 << 16):
                        data += chunk
                except BlockingIOError:
                    pass
                break
            chunk = os.read(read_end, 1 << 16)
            if not chunk:
                break
            data += chunk
        else:
            os.kill(pid, signal.SIGKILL)
    finally:
        os.close(ended)
        os.close(read_end)
    _, status, usage = os.wait4(pid, 0)
    return bytes(data), os.waitstatus_to_exitcode(status), usage.ru_utime + usage.ru_stime


def relayed(output: bytes, code: int, label: str) -> dict:
    """The answer the server relays for a call whose process wrote `output` and exited with `code`: its one JSON
    object, or an error saying how it ended or how it broke the protocol, with its kind (`sandbox.checked_answer`
    checks it all). A process that never said it was limited (`LIMITED`) failed before the call's code ran: the
    machine's doing; once it did, however it ends is the call's (`ended_kind`), out of protocol included."""
    if not output.startswith(LIMITED):
        return {"error": f"the {label} sandbox's call could not limit itself ({exit_reason(code, label)})",
                "kind": "sandbox_died"}  # fmt: skip
    output = output[len(LIMITED) :]
    if len(output) > MAX_ANSWER_BYTES:
        return {"error": f"its answer ran past {ANSWER_LIMIT >> 20} MiB", "kind": "crashed"}
    if code != 0:
        return {"error": exit_reason(code, label), "kind": ended_kind(code)}
    lines = output.split(b"\n")
    why = None
    try:
        found = json.loads(lines[0], parse_constant=lambda name: (_ for _ in ()).throw(ValueError(name)))
    except (ValueError, UnicodeDecodeError) as error:
        why = f"not JSON: {str(error)[:80]}"
    else:
        if not isinstance(found, dict) or "id" in found:
            why = "not one answer"
        elif "error" in found and found.get("kind") not in CALL_KINDS:
            why = f"no failure of kind {str(found.get('kind'))[:40]!r} comes from a call"
    if why is None and (len(lines) != 2 or lines[1]):
        why = "more than one answer to one request"
    if why is not None:
        return {"error": f"the {label} sandbox's call answered out of protocol ({why})", "kind": "crashed"}
    return found


def _empty(directories: list[str]) -> None:
    """Remove what the last call left in `directories` (its home, its /dev/shm), also what it made unreadable;
    anything that stays is said in the log."""
    import shutil

    for directory in directories:
        for root, folders, _ in os.walk(directory):
            for folder in folders:
                with contextlib.suppress(OSError):  # what stays is said below
                    os.chmod(os.path.join(root, folder), 0o700)
        for entry in os.scandir(directory):
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)
        left = os.listdir(directory)
        if left:
            print(f"grpo_dist sandbox: {directory} keeps {left[:5]} after its call", file=sys.stderr, flush=True)

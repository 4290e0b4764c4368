"""A run's driver forked warm: `grpo-dist train`, `eval` and `sft` on a machine where `grpo-dist up` keeps a cluster,
or where the environment names a warm process that runs share (`warm.SHARED_ENV`).

The driver of a run imports torch and transformers before it prints its first line (about 4 of the 5 s to it on 2
cores). The warm process of `grpo-dist up`'s cluster (`grpo_dist.cluster.warm`), or one that runs share, has them
imported already, so the command, before importing anything of its own, asks that process to fork its driver, as
the raylet's launcher asks it for an actor (`warm_launch`): the fork takes this process's arguments, environment,
working directory, umask, priority and standard streams (the terminal itself: colours, bars, Ctrl-C), runs the
command in it, and sends back its exit code, which this process exits with. Meanwhile this process passes on the
signals it gets (SIGINT, SIGTERM, SIGHUP), and where it is killed, the driver kills itself (`warm._watch`).

The command runs as it always does, in this process, where:
- no cluster of `grpo-dist up` is up, or it was started `--cold`, and no shared warm process is named; or the warm
  process does not answer at once;
- the command is not a run, or this interpreter was started with options of its own (`-X`, `-W`, `-O`, ...);
- the warm process imported the stack with another interpreter, another copy of grpo-dist, or another value of an
  environment variable the stack reads when it is imported (`warm.IMPORT_ENV`): it says which, and the command says so.

It imports the standard library and `standing`, `warm` and `warm_launch`, which import no more: it runs before
anything else.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import sys
from pathlib import Path

from grpo_dist.cluster import standing, warm, warm_launch

RUNS = ("train", "eval", "sft")
"""The commands whose driver is forked warm."""
READY_TIMEOUT_S = 2.0  # a warm process still importing (just after `grpo-dist up`): the command imports for itself
PASSED_ON = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
END_TIMEOUT_S = 10.0  # a driver that sent its exit code has only its process's end left


def run(argv: list[str]) -> int | None:
    """Run the command `argv` (without the program's name) in a driver forked from the warm process of `grpo-dist
    up`'s cluster, and return its exit code; None where it is not forked (the module's docstring says when)."""
    if warm.FORKED_DRIVER or argv[:1] == [] or argv[0] not in RUNS or _own_interpreter_options():
        return None
    path = socket_path()
    connection = warm_launch.connect(str(path), READY_TIMEOUT_S) if path is not None and path.is_socket() else None
    if connection is None:
        return None
    import array

    import grpo_dist

    request = {
        "driver": {"executable": sys.executable, "package": os.path.dirname(grpo_dist.__file__)},
        "argv": [sys.argv[0], *argv],
        "env": dict(os.environ),
        "cwd": os.getcwd(),
        "umask": _umask(),
        "niceness": os.getpriority(os.PRIO_PROCESS, 0),
    }
    body = json.dumps(request).encode()
    streams = array.array("i", [0, 1, 2])
    try:
        connection.sendmsg([len(body).to_bytes(8, "big") + body], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, streams)])
        connection.settimeout(None)
        reply = warm_launch.read_line(connection)
    except OSError:
        connection.close()
        return None
    if not reply.isdigit():
        connection.close()
        if reply.startswith("cold: "):
            print(f"grpo-dist: the driver starts cold: {reply.removeprefix('cold: ')}", file=sys.stderr)
        return None
    return _follow(connection, int(reply))


def _own_interpreter_options() -> bool:
    flags = sys.flags
    return bool(sys.warnoptions or sys._xoptions or flags.optimize or flags.dev_mode or flags.isolated
                or flags.ignore_environment or flags.no_site or flags.safe_path)  # fmt: skip


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def socket_path() -> Path | None:
    """The socket of the warm process of `grpo-dist up`'s cluster, where its record names one; else the one the
    environment names for runs that share it (`warm.shared_socket`)."""
    try:
        record = json.loads(standing._record().read_text())
        if record.get("forks_drivers") is True:
            return Path(record["temp_dir"]) / standing.WARM_SOCKET
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    return warm.shared_socket()


def _follow(connection: socket.socket, driver: int) -> int:
    """Pass this process's signals on to the driver until it sends its exit code, and wait for its process to end
    (at most `END_TIMEOUT_S`: the command must not return while its driver still tears down); that code. A driver
    gone without one (killed) ends this process as the signal passed on would have, or with 1."""
    try:
        ended = os.pidfd_open(driver)  # before it can end: a number reused later is not mistaken for it
    except (OSError, AttributeError):  # gone already, or a kernel without pidfds (Linux before 5.3)
        ended = None
    passed: list[int] = []

    def pass_on(number: int, _frame) -> None:
        passed.append(number)
        try:
            os.kill(driver, number)
        except OSError:
            pass

    for number in PASSED_ON:
        signal.signal(number, pass_on)
    while True:
        try:
            said = warm_launch.read_line(connection)
            break
        except InterruptedError:
            continue
        except OSError:
            said = ""
            break
    if ended is not None:
        select.select([ended], [], [], END_TIMEOUT_S)  # readable once the process has ended
        os.close(ended)
    if said.startswith("exit ") and said.removeprefix("exit ").lstrip("-").isdigit():
        return int(said.removeprefix("exit "))
    if passed:
        signal.signal(passed[-1], signal.SIG_DFL)
        os.kill(os.getpid(), passed[-1])
    print(f"grpo-dist: the run's driver (process {driver}, forked warm) ended without an exit code", file=sys.stderr)
    return 1

"""How a Ray node of grpo-dist's own starts each Python worker process: forked warm, else as Ray starts it.

The raylet runs this file (standard library only: it starts in tens of milliseconds) in place of Ray's own
`setup_worker.py`, with the same arguments. Where the node has a warm process (`grpo_dist.cluster.warm`: its socket
named by `GRPO_DIST_WARM_SOCKET`) and the worker needs nothing but environment variables from its runtime
environment, that process forks the worker, and this one stays beside it as the process the raylet started: it
passes on the signals it gets and ends when the worker does. Otherwise, or when the warm process does not answer
within `READY_TIMEOUT_S`, this process becomes Ray's own `setup_worker.py` (exec), as if it had never been here.
"""

import array
import json
import os
import signal
import socket
import sys

SOCKET_ENV = "GRPO_DIST_WARM_SOCKET"
PRELOADED: frozenset[str] = frozenset()
"""In a worker forked warm, the modules the warm process had imported before the fork (`grpo_dist.cluster.warm`)."""
READY_TIMEOUT_S = 30.0  # it answers once it has imported the stack (about 15 s on 2 cores); the raylet gives a
# worker 60 s to register


def main() -> None:
    context, language, worker_args = "{}", "", []
    for arg in sys.argv[1:]:
        if arg.startswith("--serialized-runtime-env-context="):
            context = arg.split("=", 1)[1] or "{}"
        elif arg.startswith("--language="):
            language = arg.split("=", 1)[1]
        else:
            worker_args.append(arg)
    runtime_env = json.loads(context)
    path = os.environ.get(SOCKET_ENV)
    plain = (
        language == "PYTHON"
        and not runtime_env.get("command_prefix")
        and runtime_env.get("py_executable") in (None, sys.executable)
        and not runtime_env.get("override_worker_entrypoint")
    )
    connection = connect(path) if plain and path and worker_args else None
    if connection is None:
        _as_ray_does(worker_args)
    env = dict(os.environ)
    for key, value in (runtime_env.get("env_vars") or {}).items():  # as Ray's update_envs: ${KEY} is the old value
        env[key] = value.replace("${" + key + "}", env.get(key, ""))
    request = json.dumps({"argv": worker_args, "env": env, "cwd": os.getcwd()}).encode()
    stdio = array.array("i", [0, 1, 2])
    connection.sendmsg([len(request).to_bytes(8, "big") + request], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, stdio)])
    connection.settimeout(None)
    reply = read_line(connection)
    if not reply.isdigit():
        sys.exit(f"the warm process did not start the worker: {reply or 'no answer'}")
    worker = int(reply)
    for number in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(number, lambda number, _frame: _signal(worker, number))
    while True:  # the worker holds its end of the connection until it exits
        try:
            if not connection.recv(64):
                break
        except InterruptedError:
            continue
        except OSError:
            break
    sys.exit(0)


def connect(path: str, timeout_s: float = READY_TIMEOUT_S) -> socket.socket | None:
    """A connection to the warm process once it answers ready, or None (no socket there, or no answer within
    `timeout_s`)."""
    connection = socket.socket(socket.AF_UNIX)
    connection.settimeout(timeout_s)
    try:
        connection.connect(path)
        if connection.recv(1) == b"R":
            return connection
    except OSError:
        pass
    connection.close()
    return None


def read_line(connection: socket.socket) -> str:
    data = b""
    while not data.endswith(b"\n"):
        chunk = connection.recv(64)
        if not chunk:
            break
        data += chunk
    return data.decode(errors="replace").strip()


def _signal(worker: int, number: int) -> None:
    try:
        os.kill(worker, number)
    except OSError:
        pass


def _as_ray_does(worker_args: list[str]) -> None:
    """Become Ray's own `setup_worker.py` (beside `default_worker.py`, the worker's first argument)."""
    directory = os.path.dirname(worker_args[0]) if worker_args else ""
    setup = os.path.join(directory, "setup_worker.py")
    os.execv(sys.executable, [sys.executable, setup, *sys.argv[1:]])


if __name__ == "__main__":
    main()

"""Asking a running run to change: `grpo-dist scale RUN_DIR generators=N` (or `scale(run_dir, generators=N)` from
Python) leaves a request in the run directory of a run on this machine; `grpo-dist scale RUN_NAME generators=N
--address URL` reaches a run on a Ray cluster through its job server (a remote or KubeRay run), by a small job that
hands the request to the run's mailbox, a named actor the run keeps while it trains. The run takes either between
two steps (`Running.take`). A run that is not running (finished, stopped, never started) refuses requests: one left
behind would change a later resume."""

from __future__ import annotations

import fcntl
import json
import os
import sys
from pathlib import Path

from tqdm import tqdm

REQUEST = "scale.json"
LOCK = ".lock"  # what a running run holds locked (`Running`)
NAMESPACE = "grpo-dist"  # the Ray namespace of the runs' mailboxes
ASK_TIMEOUT_S = 30.0


class NotRunning(RuntimeError):
    """The run a request names is not running: nothing would take the request."""


def mailbox_name(run_name: str) -> str:
    return f"run:{run_name}"


def scale(run_dir: str | Path, generators: int) -> Path:
    """Ask the run in `run_dir` to run `generators` generators from its next step on; returns the request file."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise FileNotFoundError(f"{run_dir}: not a run directory (it has no config.yaml)")
    if isinstance(generators, bool) or not isinstance(generators, int) or generators < 1:
        raise ValueError(f"generators must be a whole number >= 1, got {generators!r}")
    if not is_running(run_dir):
        raise NotRunning(
            f"{run_dir}: the run is not running (it finished or stopped): a request would only change a later "
            "resume; set rollout.num_generators when you resume it instead"
        )
    request, partial = run_dir / REQUEST, run_dir / f".{REQUEST}.tmp"
    partial.write_text(json.dumps({"generators": generators}) + "\n")
    os.replace(partial, request)  # the run never reads half a request
    return request


def _lock(run_dir: Path) -> int | None:
    """A descriptor holding the lock on `run_dir`, or None when another process holds it. The lock dies with its
    descriptor, however its process ends. It is taken on `LOCK` in the run directory, a file only its owner may open
    (any user who can read a file or directory can lock it, and would keep the run from starting).
    `PermissionError` where this user may not open it: another user's run."""
    path = run_dir / LOCK
    lock = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        if os.fstat(lock).st_uid == os.geteuid():
            os.fchmod(lock, 0o600)  # one left readable by an earlier version, or a umask that ignored the mode
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(lock)
        return None
    return lock


def is_running(run_dir: Path) -> bool:
    """Whether a run holds the lock on `run_dir` (a run of another user's counts as running: it cannot be told)."""
    try:
        lock = _lock(run_dir)
    except PermissionError:
        return True
    if lock is None:
        return True
    os.close(lock)
    return False


class Running:
    """What a run holds while it trains: a lock on its directory (so `scale` knows it runs) and, where Ray is
    connected, its mailbox on the cluster, named by `run.name`. `take` returns the generator count last asked for."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        lock = _lock(run_dir)
        if lock is None:
            raise NotRunning(f"{run_dir}: another process runs this run already; one run directory, one run")
        self.lock = lock
        take_request(run_dir, quiet=True)  # a request left before the run started is not this run's
        self.mailbox, self.run_name = None, ""

    def open_mailbox(self, run_name: str) -> None:
        """Once Ray is connected: the mailbox `scale --address` finds by the run's name."""
        self.run_name = run_name
        self.mailbox = _open_mailbox(run_name)

    def take(self) -> int | None:
        asked = take_request(self.run_dir)
        if self.mailbox is not None:
            import ray

            try:
                asked = ray.get(self.mailbox.take.remote(), timeout=ASK_TIMEOUT_S) or asked
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as err:
                tqdm.write(f"scale: the run's mailbox was lost ({type(err).__name__}); a new one takes requests")
                ray.kill(self.mailbox)
                self.mailbox = _open_mailbox(self.run_name)
        return asked

    def close(self) -> None:
        if self.mailbox is not None:
            import ray

            if ray.is_initialized():  # a run's own Ray ends with its cluster, and the mailbox with it
                ray.kill(self.mailbox)
            self.mailbox = None
        if self.lock >= 0:
            os.close(self.lock)
            self.lock = -1


def _open_mailbox(run_name: str):
    """The run's named actor, or None without Ray (or where another run of the same name holds the name)."""
    import ray

    if not ray.is_initialized():
        return None

    @ray.remote(num_cpus=0)
    class Mailbox:
        def __init__(self) -> None:
            self.generators: int | None = None

        def ask(self, generators: int) -> int:
            self.generators = generators
            return generators

        def take(self) -> int | None:
            asked, self.generators = self.generators, None
            return asked

    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)  # the driver's node
    try:
        return Mailbox.options(name=mailbox_name(run_name), namespace=NAMESPACE, scheduling_strategy=here).remote()
    except ValueError:
        tqdm.write(f"scale: another run named {run_name!r} holds its name on this Ray cluster; scale --address "
                   "reaches that one, and this run only through its directory")  # fmt: skip
        return None


def ask_on_cluster(run_name: str, generators: int) -> int:
    """In a job on the run's cluster (`python -m grpo_dist.storage.control RUN_NAME N`): hand the request to the run's
    mailbox; exit status 0 when it was taken, 3 when no run of that name is running there."""
    import ray

    ray.init(address="auto", namespace=NAMESPACE, log_to_driver=False, logging_level="error")
    try:
        mailbox = ray.get_actor(mailbox_name(run_name), namespace=NAMESPACE)
    except ValueError:
        print(f"no run named {run_name!r} is running on this Ray cluster (a finished or stopped run takes no requests)")
        return 3
    ray.get(mailbox.ask.remote(generators), timeout=ASK_TIMEOUT_S)
    print(f"asked the run {run_name!r} to go to {generators} generators; it does so between two steps and prints it")
    return 0


def take_request(run_dir: Path, quiet: bool = False) -> int | None:
    """The generator count asked for since the last call (the request is consumed), or None."""
    request, taken = run_dir / REQUEST, run_dir / f".{REQUEST}.taken"
    try:
        os.replace(request, taken)  # a request written from now on waits for the next call
    except FileNotFoundError:
        return None
    text = "?"
    try:
        text = taken.read_text()
        generators = json.loads(text)["generators"]
        if isinstance(generators, int) and not isinstance(generators, bool) and generators >= 1:
            return generators
    except (OSError, ValueError, KeyError, TypeError):
        pass
    finally:
        taken.unlink(missing_ok=True)
    if not quiet:
        tqdm.write(f'scale: ignored {request}: expected {{"generators": N}} with N >= 1, got {text.strip()[:200]!r}')
    return None


if __name__ == "__main__":
    sys.exit(ask_on_cluster(sys.argv[1], int(sys.argv[2])))

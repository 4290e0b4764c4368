"""Model-written code runs here: each run in a fresh process of its own, isolated by the kernel's namespaces through
bubblewrap (`bwrap`, a small, widely deployed sandboxing tool), and judged only by what its trusted parent sees.

A jailed process
  - sees a file system of its own: the system's libraries and the Python interpreter read-only, an empty
    writable `/tmp` and working directory (a tmpfs of `TMP_MB`), nothing else: no home directory, no run
    directory, no Ray session, no installed packages (it runs `python -I -S`), no `/proc`; and a kernel keyring of
    its own;
  - has PID, network, IPC and UTS namespaces of its own: it can signal nothing outside, has no network, and what it
    starts dies with it (the namespace's first process ends, and the kernel kills the rest);
  - runs as `nobody` with no capabilities (as root) or as the caller's user in a user namespace, with no new
    privileges, an environment of PATH, LANG, HOME and TMPDIR only, and resource limits set before the code runs
    that it cannot raise: address space, CPU time, written file size, open files, and processes (none unless
    allowed);
  - is killed, with everything in it, when it runs past its bound or its parent dies.

Where bubblewrap is missing or the machine refuses a namespace, `Isolation.REQUIRE` refuses to run anything
(`IsolationRefused`, before any engine starts) and `Isolation.BEST_EFFORT` runs a plain process instead: the same
environment, working directory and limits, as `nobody` under root (with no capabilities once it runs), in a session
of its own that is killed whole. What is in force is `status()`.

`Jailed` is how `code_tests` and the `python` tool run code: the program comes on standard input after the
process is up, so nothing it reads before it runs is anyone's secret; how a verdict leaves it is the caller's
protocol (`grpo_dist.rewards.code`).
"""

from __future__ import annotations

import contextlib
import functools
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from grpo_dist.sandbox.privileges import NOBODY, as_nobody, hide_from_own_user, own_keyring

TMP_MB = 64  # the jail's /tmp, its working directory included (each file at most `Limits.file_mb`)
SYSTEM_FILES = ("/etc/ld.so.cache", "/etc/alternatives", "/etc/localtime")
"""What a jailed process sees of `/etc` (read-only, where present), besides `/usr` and the interpreter."""
MERGED_USR = ("bin", "lib", "lib64", "sbin")  # links into /usr on today's distributions; bound if they are not
PROBE_TIMEOUT_S = 30.0


class Isolation(StrEnum):
    REQUIRE = "require"
    BEST_EFFORT = "best_effort"


class IsolationRefused(RuntimeError):
    """The machine refuses what `Isolation.REQUIRE` needs."""


@dataclass(frozen=True)
class Limits:
    """What one jailed program may use."""

    memory_mb: int  # address space
    cpu_s: float  # CPU time (the wall-clock bound is the caller's)
    processes: bool = False  # may start processes and threads
    file_mb: int = 16  # largest file it may write
    open_files: int = 64


@dataclass(frozen=True)
class Status:
    """The isolation in force on this machine: `namespaces` true where bubblewrap runs, else why not."""

    namespaces: bool
    why_not: str | None = None

    def describe(self) -> str:
        if self.namespaces:
            return "model-written code runs isolated by namespaces (bubblewrap): own PID, mount and network views"
        return f"model-written code runs WITHOUT namespaces ({self.why_not}); {best_effort_user()}"


def bwrap_path() -> str | None:
    return shutil.which("bwrap")


@functools.cache
def status() -> Status:
    """Whether a jailed process starts here (one probe per process: a jailed interpreter that prints)."""
    bwrap = bwrap_path()
    if bwrap is None:
        return Status(False, "bubblewrap (bwrap) is not installed")
    workdir = scratch_dir("jail-probe")
    try:
        argv = wrap([sys_python(), "-I", "-S", "-c", "print('jailed')"], bwrap=bwrap)
        done = subprocess.run(argv, capture_output=True, timeout=PROBE_TIMEOUT_S, cwd=workdir, env=clean_env(workdir))
    except (OSError, subprocess.TimeoutExpired) as error:
        return Status(False, f"bubblewrap did not run: {error}")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        reap_orphans()
    if done.returncode != 0 or done.stdout.strip() != b"jailed":
        said = done.stderr.decode(errors="replace").strip().splitlines()
        return Status(False, f"bubblewrap was refused: {said[-1] if said else f'exit code {done.returncode}'}")
    return Status(True)


def check(isolation: Isolation, what: str) -> Status:
    """The isolation in force; `IsolationRefused` saying what was refused and what to do, where `require` is not met.
    `what`: what runs model-written code (named in the error)."""
    found = status()
    if isolation == Isolation.REQUIRE and not found.namespaces:
        raise IsolationRefused(
            f"{what} runs model-written code, and reward.isolation=require, but {found.why_not}. Install bubblewrap "
            "(`apt-get install bubblewrap`) and let the process create namespaces: in a container, run it with "
            "seccomp and AppArmor unconfined (Kubernetes: securityContext.seccompProfile.type: Unconfined and "
            "appArmorProfile.type: Unconfined; the bundled KubeRay manifests do), or on a host that allows "
            f"unprivileged user namespaces. Or set reward.isolation=best_effort to run it {best_effort_user()} "
            "(docs/sandbox.md)."
        )
    return found


def best_effort_user() -> str:
    """What best effort (no namespaces) gives model-written code on this machine, in words."""
    if os.geteuid() == 0:
        return "as the user nobody, with limits and a clean environment"
    return (
        "as this process's own user, with limits and a clean environment: it can signal that user's processes and "
        "read their environments (the run's tokens), all but those of the process that started it"
    )


def scratch_dir(kind: str) -> str:
    """A new temporary directory for a jail or a sandbox of this process, named with its pid. The first one a
    process makes also removes those left by processes that are gone (killed, like a worker at the end of a run,
    before they could remove their own)."""
    if not _swept:
        _swept.append(True)
        for stale in Path(tempfile.gettempdir()).glob("grpo-*-pid*-*"):
            owner = stale.name.partition("-pid")[2].partition("-")[0]
            if owner.isdigit() and not _alive(int(owner)):
                shutil.rmtree(stale, ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"grpo-{kind}-pid{os.getpid()}-")


_swept: list[bool] = []  # whether this process removed the dead processes' scratch directories yet


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sys_python() -> str:
    """The interpreter, by its real path (a virtual environment's `python` is a link to it)."""
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


def clean_env(home: str) -> dict[str, str]:
    """The whole environment a jailed process gets: never the run's tokens or keys."""
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "HOME": home,
        "TMPDIR": home,
        "PYTHONDONTWRITEBYTECODE": "1",
        "OMP_NUM_THREADS": "1",
    }


def wrap(
    argv: list[str],
    bwrap: str | None = None,
    readonly: Sequence[str] = (),
    writable: Sequence[str] = (),
    network: bool = False,
    env: dict[str, str] | None = None,
    tmp: tuple[int, str] = (TMP_MB, "1777"),
) -> list[str]:
    """`argv` under bubblewrap: the view and namespaces the module docstring lists; as root, `setpriv` then becomes
    `nobody` with no capabilities inside (a user namespace would map nobody to root's files). The reward and tool
    sandboxes (`grpo_dist.sandbox`) add to that view `readonly` and `writable` paths, each at its own path, keep the
    network where `network`, give their own environment `env` (else `clean_env`), and size and mode their `/tmp`
    (`tmp`: MB and mode; its `work` directory, the working directory, is writable by anyone in it)."""
    bwrap = bwrap or bwrap_path()
    view = ["--ro-bind", "/usr", "/usr"]
    for name in MERGED_USR:
        path = f"/{name}"
        if os.path.islink(path):
            view += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            view += ["--ro-bind", path, path]
    for path in SYSTEM_FILES:
        view += ["--ro-bind-try", path, path]
    view += ["--perms", tmp[1], "--size", str(tmp[0] << 20), "--tmpfs", "/tmp", "--perms", "1777", "--dir", "/tmp/work"]
    view += ["--dev", "/dev", "--perms", "1777", "--size", str(1 << 20), "--tmpfs", "/dev/shm"]
    prefix = os.path.realpath(sys.base_prefix)
    bound = [] if prefix.startswith("/usr/") else [(prefix, "--ro-bind")]
    view += own_paths([*bound, *((path, "--ro-bind") for path in readonly), *((path, "--bind") for path in writable)])
    namespaces = ["--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
    namespaces += [] if network else ["--unshare-net"]
    given = clean_env("/tmp/work") if env is None else env
    env = ["--clearenv", *[arg for key, value in given.items() for arg in ("--setenv", key, value)]]
    guard = ["--die-with-parent", "--new-session", "--chdir", "/tmp/work"]
    if os.geteuid() == 0:
        become = [
            "setpriv",
            f"--reuid={NOBODY}",
            f"--regid={NOBODY}",
            "--clear-groups",
            "--inh-caps=-all",
            "--bounding-set=-all",
            "--no-new-privs",
            "--",
        ]
        return [bwrap, *view, *namespaces, *env, *guard, "--", *become, *argv]
    return [
        bwrap,
        *view,
        "--unshare-user",
        "--disable-userns",
        *namespaces,
        *env,
        *guard,
        "--cap-drop",
        "ALL",
        "--",
        *argv,
    ]


def own_paths(paths: Sequence[tuple[str, str]]) -> list[str]:
    """Bubblewrap arguments binding each `(path, how)` (`--ro-bind`, `--bind`) at its own path, once: a path within
    one bound already is left out (its bind would be the same files), and the directories above each are made
    searchable (else `nobody` misses a path under a private directory such as `/root`)."""
    args: list[str] = []
    made: set[str] = set()
    chosen: list[str] = []
    for path, how in sorted({os.path.abspath(path): how for path, how in paths}.items()):
        if any(path == done or path.startswith(done.rstrip("/") + "/") for done in chosen):
            continue
        chosen.append(path)
        for parent in reversed(Path(path).parents[:-1]):
            if str(parent) not in made:
                made.add(str(parent))
                args += ["--perms", "0755", "--dir", str(parent)]
        args += [how, path, path]
    return args


RUNNING: set[int] = set()
"""The bubblewrap processes this process started and reaps itself (`Jailed`, and the reward and tool sandboxes)."""


def reap_orphans() -> None:
    """Reap the namespaces' first processes left to this process. Bubblewrap exits on its command's exit status,
    before that first process has ended; a reward worker is a subreaper (`grpo_dist.sandbox`), so those are
    re-parented here and, unreaped, would pile up as zombies for the life of the worker. Only zombies are reaped,
    never a bubblewrap this process started and waits for itself (`RUNNING`); one still ending is reaped next time."""
    import psutil

    for child in psutil.Process().children():
        with contextlib.suppress(psutil.Error, ChildProcessError):
            if child.pid not in RUNNING and child.name() == "bwrap" and child.status() == psutil.STATUS_ZOMBIE:
                os.waitpid(child.pid, os.WNOHANG)


class Jailed:
    """One program running jailed (or, best effort, in a plain process): `python -I -S -c <runner> <args>`, its
    standard input a pipe from here, its output discarded, `status_fd` (its file descriptor for the caller's
    protocol) the write end of a pipe this side reads. Use as a context manager: on leaving, it is killed with
    everything it started."""

    def __init__(self, runner: str, args: list[str], isolation: Isolation, output: bool = False) -> None:
        """`output`: its standard output and error come back (`read_output`) instead of being discarded."""
        found = check(isolation, "a program")
        if not found.namespaces and os.geteuid() != 0:
            hide_from_own_user()  # the code runs as this user: keep at least this process's tokens from it
        reap_orphans()  # what an earlier jail left still ending when it closed
        self.workdir = scratch_dir("jail")
        self.read_end, write_end = os.pipe()
        argv = [sys_python(), "-I", "-S", "-c", runner, str(write_end), *args]
        jailed = found.namespaces
        try:
            self.process = subprocess.Popen(
                wrap(argv) if jailed else argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE if output else subprocess.DEVNULL,
                stderr=subprocess.STDOUT if output else subprocess.DEVNULL,
                pass_fds=(write_end,),
                cwd=self.workdir,
                env=clean_env(self.workdir),
                start_new_session=True,
                preexec_fn=own_keyring if jailed or os.geteuid() != 0 else as_nobody,
            )
        finally:
            os.close(write_end)
        RUNNING.add(self.process.pid)
        if not jailed and os.geteuid() == 0:
            os.chown(self.workdir, NOBODY, NOBODY)
        self.received = b""
        self.unread = b""  # read from the status pipe past the last line `read_line` returned

    def send(self, data: bytes, deadline: float) -> bool:
        """Write `data` to its standard input by `deadline`; False if it is gone or does not read it in time."""
        stdin = self.process.stdin.fileno()
        os.set_blocking(stdin, False)
        view = memoryview(data)
        while view:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([], [stdin], [], remaining)[1]:
                return False
            try:
                view = view[os.write(stdin, view) :]
            except BlockingIOError:
                continue
            except OSError:  # its end closed
                return False
        return True

    def read_until(self, wanted: bytes, deadline: float) -> bool:
        """Read its status pipe until what it wrote since the last match ends with `wanted` (True), or it wrote
        something else of that length or more, closed the pipe, or `deadline` passed (False)."""
        start = len(self.received)
        while len(self.received) - start < len(wanted):
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([self.read_end], [], [], remaining)[0]:
                return False
            chunk = os.read(self.read_end, len(wanted) - (len(self.received) - start))
            if not chunk:
                return False
            self.received += chunk
        return self.received[start:] == wanted

    def read_line(self, limit: int, deadline: float) -> bytes | None:
        """The next line on its status pipe, without its newline: None where it closed the pipe, wrote `limit` bytes
        without a newline, or `deadline` passed first. What it wrote past the line is kept for the next call, and
        makes `finish` fail if no call reads it."""
        while b"\n" not in self.unread:
            remaining = deadline - time.monotonic()
            if len(self.unread) > limit or remaining <= 0 or not select.select([self.read_end], [], [], remaining)[0]:
                return None
            chunk = os.read(self.read_end, 1 << 16)
            if not chunk:
                return None
            self.unread += chunk
        line, _, self.unread = self.unread.partition(b"\n")
        return line if len(line) <= limit else None

    def read_output(self, limit: int, deadline: float, feed: bytes = b"") -> bytes:
        """What it printed until it closed its output, `limit` bytes were read, or `deadline` passed. `feed` is
        written to its standard input meanwhile, which is then closed: a program that prints before it has read all
        of its input never waits on this side."""
        out, data, view = self.process.stdout.fileno(), b"", memoryview(feed)
        if view:
            os.set_blocking(self.process.stdin.fileno(), False)
        while len(data) < limit:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            writing = [self.process.stdin.fileno()] if view else []
            readable, writable, _ = select.select([out], writing, [], remaining)
            if writable:
                view = self._fed(view)
            if readable:
                chunk = os.read(out, limit - len(data))
                if not chunk:
                    break
                data += chunk
            elif not writable:
                break
        return data

    def _fed(self, view: memoryview) -> memoryview:
        """What is left of `view` once its standard input took what it could; closed once it took it all (or
        closed its end: what it did not read is not its to read)."""
        try:
            view = view[os.write(self.process.stdin.fileno(), view[: 1 << 16]) :]
        except BlockingIOError:
            return view
        except OSError:
            view = view[len(view) :]
        if not view:
            self.process.stdin.close()
        return view

    def finish(self, deadline: float) -> int | None:
        """Its exit status once it ends before `deadline` with nothing more on the status pipe, else None."""
        try:
            code = self.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return None
        if self.unread or (select.select([self.read_end], [], [], 0)[0] and os.read(self.read_end, 1)):
            return None  # wrote more than its protocol allows
        return code

    def _kill(self) -> None:
        """Kill it with everything it started: every process under it (jailed, the namespace then dies whole), then
        its session."""
        import psutil

        try:
            inside = psutil.Process(self.process.pid).children(recursive=True)
        except psutil.Error:
            inside = []
        for process in reversed(inside):
            with contextlib.suppress(psutil.Error):
                process.kill()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)

    def __enter__(self) -> Jailed:
        return self

    def __exit__(self, *_: object) -> None:
        if self.process.poll() is None:
            self._kill()
        self.process.wait()
        RUNNING.discard(self.process.pid)
        reap_orphans()
        for stream in (self.process.stdin, self.process.stdout):
            with contextlib.suppress(OSError, AttributeError):
                stream.close()
        os.close(self.read_end)
        try:
            shutil.rmtree(self.workdir)
        except (OSError, RecursionError):  # best effort: a tree too deep for rmtree, made by the code
            subprocess.run(["rm", "-rf", "--", self.workdir], check=False)

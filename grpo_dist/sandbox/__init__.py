"""The sandbox: user reward code runs in a process of its own, never in the driver or a reward worker; an
environment's tools likewise run in sandboxes of their generator (`kind="tools"`, `grpo_dist.agents.tools`).

Each reward worker (and the driver's pre-flight check) starts one `Sandbox`: a server process
(`grpo_dist.sandbox_child`) that imports the reward functions once and answers one call at a time, asked and answered
as JSON lines on pipes of its own (what the reward code prints goes to the worker's log). Each call runs in a fresh
process forked from that server, which the call's code never ran in: nothing one completion does (a global or a module
patched, a thread, a file in its home) outlives its call. The built-in rewards and tools, which keep no state and run
no text as code, are called in the server itself (a fork costs milliseconds). A reward worker asks the built-ins'
calls of its completions ahead of their answers (`Sandbox.answers`), so that a call waits for no round trip of its
own; a call of a user function is asked alone, so the process forked for it holds no other completion. Where
bubblewrap runs, the server starts under it (`jail.wrap`) and sees the machine the way a jail does:
  - its own mount namespace: `/usr`, the Python install, and the import path read-only, each at its own path (the
    directories on this process's import path, `grpo_dist`'s own and the editable installs', the worker's working
    directory, where the user's reward modules are); the directories `reward.sandbox_paths` names; a private `/tmp`
    (its home and working directory `/tmp/work`, emptied after every call) and `/dev/shm`; nothing else: no Ray
    session (`/tmp/ray`), no other sandbox's home, no home directory, no `/proc`;
  - its own PID, IPC, UTS and network namespaces (the network only with `reward.sandbox_network`), as `nobody` with
    no capabilities (under root) or in a user namespace with none (under another user), from its first instruction;
  - `python -I`: an import path this side sets (`import_path`), never its working directory or the environment's.
Each call's process then limits itself: no capability and no new privilege, CPU time (`reward.timeout_s`), no process
or thread (`reward.sandbox_processes: false`, the default: a process limit of zero, which binds `nobody`); the address
space (`reward.sandbox_memory_mb`) is the server's. Whatever the call started in its process group is killed when it
returns.
Each failure carries its kind (`types.Failure`), told by how the call ended and the error's type, never by a
message the completion may shape. The completion's doing, which the reward worker scores the floor: past its time or
its CPU time (`timeout`), raised (`raised`, `memory`), its process ended by a signal of its own, an exit or an answer
out of protocol (`crashed`). Not the completion's, left unscored: a process, a thread or the network refused by a
setting (`processes`, `network`), `Unscorable` raised (`unscorable`), the call's process or the sandbox killed from
outside (SIGKILL, SIGTERM), gone before the call, or the server itself out of protocol (`sandbox_died`).

Where bubblewrap does not run, `reward.isolation: require` refuses to start a sandbox (`SandboxError`, saying why),
and `best_effort` starts a plain process: as root it imports `grpo_dist` and its dependencies from the directories of
the import path that `nobody` cannot write, then turns the network off (a network namespace of its own), becomes
`nobody` (keeping the capability to read files, so an interpreter installed where only root reads stays importable:
the calls drop it), and only then adds the rest of the import path and imports the user's modules. Its home is a
directory of `nobody`'s under a directory of root's that no one else may list (`private_home`), never on the path.

A call that runs past `reward.timeout_s` is answered NaN and the sandbox killed with everything it started (its
process group, and any process that left it, found by the mark in its environment); so is one whose server died,
and the next call starts a new one. A call whose process died (`os._exit`, a crash, a limit) or that raised scores
NaN, saying why. The sandbox gets an environment of its own (PATH, LANG, HOME and TMPDIR; never the run's tokens:
names listed in `reward.sandbox_env` are passed on), and every answer it gives is checked here: one JSON line per
request, carrying the request's id (drawn at random, never shown to the call's process) and, for a reward, one
finite number within ±1e30; anything else leaves that call unscored and the sandbox replaced.

User code here is the user's: the sandbox keeps it, and the model's text it evaluates, from the run's secrets and
from the machine, but the model's own code never runs here (`grpo_dist.sandbox.jail` runs it).

May import: `algo`, `faults`, `config`, `types` (the jail and the privileges it drops are here: `jail`,
`privileges`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import secrets
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from grpo_dist.sandbox import jail, privileges
from grpo_dist.sandbox.privileges import die_with_parent
from grpo_dist.types import REWARD_LIMIT, Failure

log = logging.getLogger("grpo_dist")
SANDBOX_MARK = "GRPO_DIST_SANDBOX"
"""In a sandbox's environment (inherited by whatever it starts): the pid of the process that owns it."""
START_TIMEOUT_S = 120.0  # importing the reward modules
ANSWER_LIMIT = 64 << 20  # bytes of one answer; past it the call has none and the sandbox is replaced
AHEAD = 32  # calls of the functions the server runs itself asked before their answers come (`Sandbox.answers`)
NOBODY = jail.NOBODY


@dataclass(frozen=True)
class Limits:
    """What a sandbox may use (`reward.sandbox_*`)."""

    memory_mb: int
    cpu_s: float  # CPU time per call
    processes: bool  # may start processes and threads
    network: bool  # keeps the network
    require: bool = False  # refuse to start where the network namespace or the change of user is refused
    env: tuple[str, ...] = ()  # names of variables of the worker's environment passed on (`reward.sandbox_env`)
    paths: tuple[str, ...] = ()  # directories of the machine it sees too, at their own path (`reward.sandbox_paths`)


class SandboxError(RuntimeError):
    """The sandbox could not start: a reward function did not import, or the process did not come up."""


class Sandbox:
    """One sandbox process serving the reward functions `names` (built-in names or dotted paths), in order.
    `reap`: this process (a reward worker, which does nothing else) becomes the one a process that leaves the
    sandbox's group is re-parented to, so that `close` finds and kills it too."""

    def __init__(
        self,
        names: list[str],
        limits: Limits,
        reap: bool = False,
        kind: str = "rewards",
        wait: bool = True,
        warm_builtins: bool = True,
        in_server: Sequence[bool] = (),
    ) -> None:
        """`kind`: `rewards` (reward functions, `call`) or `tools` (an environment's tools, `call_tool`). `wait`:
        until it is ready (its functions imported), raising `SandboxError` if it does not start; without, it starts
        while the caller goes on, and `ready` (or the first call) waits and raises. `warm_builtins`: the built-in
        rewards' warm-ups run as it starts, as every function's does (`sandbox_warmup`); without, a built-in imports
        what it needs at its first call (a sandbox that calls few, where a first call may take long). `in_server`:
        which of `names` the server calls itself (the built-ins, `sandbox_child`): their calls are asked ahead of
        their answers (`answers`); none where it is not given."""
        self.names, self.limits, self.kind, self.warm_builtins = names, limits, kind, warm_builtins
        self.in_server = list(in_server) or [False] * len(names)
        self.label = "reward" if kind == "rewards" else "tool"  # in what it says
        self.process: subprocess.Popen | None = None
        self.buffer = b""
        self.ended = False  # its answers' pipe closed: the process is gone
        self.too_long = False  # its answer ran past `ANSWER_LIMIT`
        self.unsent = bytearray()  # requests asked, not yet taken by its pipe (`_line` writes them as it waits)
        self.queued = 0  # bytes of requests asked of this process so far
        self.written = 0  # of them, bytes its pipe took
        self.answered_to = 0  # of them, bytes of the requests answered
        self.round: object | None = None  # the calls being asked (`answers`), a new one after each `_begin`
        self.home: str | None = None  # the directory its home is made in on this machine (`private_home`)
        self.notes: list[str] = []  # what the machine did not allow (said once by the owner)
        self.starting: jail.Status | None = None  # started, its ready line not read yet: where it runs
        if reap:
            privileges.reap_orphans_here()
        self._start(wait)

    def call(
        self, index: int, prompt: str, completion: str, kwargs: dict[str, Any], timeout_s: float
    ) -> tuple[float, Failure | None]:
        """Function `index` on one completion: (score, None), or (NaN, why it has none)."""
        return next(self.answers([(index, prompt, completion, kwargs)], timeout_s))

    def answers(
        self, calls: Sequence[tuple[int, str, str, dict[str, Any]]], timeout_s: float
    ) -> Iterator[tuple[float, Failure | None]]:
        """`call` of each of `calls` (function index, prompt, completion, kwargs), in order, each as it is answered.
        The server answers one call at a time, in order; calls of the functions it runs itself (`in_server`) are
        asked up to `AHEAD` before their answers come, so that a call waits for no round trip of its own, while a
        call of a user function is asked alone: the process forked for it holds no other request. Each answer is
        bounded by `timeout_s` from when the one before it was read, so the caller takes each as it comes: what it
        does between two answers is time the calls asked ahead run unbounded. A call that runs past its bound, or
        whose sandbox died, is answered as `call` answers it (the sandbox is replaced), and the calls asked after it
        are asked again of the new one. Requests left unanswered (the caller stopped taking answers) are answered
        by no one: the sandbox is replaced before its next call."""
        self.ready()
        answered = 0
        while answered < len(calls):
            self._begin()
            round_ = self.round
            asked: deque[tuple[str, int, bool]] = deque()  # (request id, its end in what is queued, in the server)
            following = answered  # the next call to ask
            while self.process is not None and answered < len(calls):  # killed: the rest asked of a new one
                if self.round is not round_:
                    raise RuntimeError(f"the {self.label} sandbox was called again before these calls were answered")
                while following < len(calls) and len(asked) < AHEAD:
                    index, prompt, completion, kwargs = calls[following]
                    ahead = self.in_server[index]
                    if asked and not (ahead and asked[-1][2]):
                        break  # a user function's call is asked alone
                    request = {"call": index, "prompt": prompt, "completion": completion, "kwargs": kwargs}
                    asked.append((self._ask(request), self.queued, ahead))
                    following += 1
                request, end, _ = asked.popleft()
                answer, failure = self._answer(request, end, timeout_s, last=not asked)
                answered += 1
                yield (math.nan, failure) if failure is not None else (answer["value"], None)

    def call_tool(self, index: int, arguments: dict[str, Any], timeout_s: float) -> tuple[str | None, str | None]:
        """Tool `index` with `arguments`: (its result as text, None), or (None, why it has none)."""
        self.ready()
        self._begin()
        request = self._ask({"tool": index, "arguments": arguments})
        answer, failure = self._answer(request, self.queued, timeout_s, last=True)
        if failure is not None:
            return None, failure.reason
        return answer.get("result"), answer.get("error")

    def close(self) -> None:
        """Kill the sandbox and everything it started, and wait until they are gone."""
        if self.process is None:
            return
        import psutil

        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.kill()
        self.process.wait()
        jail.RUNNING.discard(self.process.pid)
        strays = _marked_children(os.getpid())  # left its group (setsid), re-parented here
        for stray in strays:
            with contextlib.suppress(psutil.Error):
                stray.kill()
        psutil.wait_procs(strays, timeout=10)  # reaped: re-parented here, they are this process's children
        self.process, self.starting = None, None
        self.buffer, self.ended, self.too_long = b"", False, False
        self.unsent, self.queued, self.written, self.answered_to = bytearray(), 0, 0, 0
        if self.home is not None:
            shutil.rmtree(self.home, ignore_errors=True)
            self.home = None

    def _start(self, wait: bool = True) -> None:
        self.close()
        found = jail.status()
        if self.limits.require and not found.namespaces:
            raise SandboxError(
                f"the {self.label} sandbox needs bubblewrap under reward.isolation=require, but {found.why_not} "
                "(docs/sandbox.md)"
            )
        missing = [path for path in self.limits.paths if not os.path.isdir(path)]
        if missing:
            key = "reward.sandbox_paths" if self.kind == "rewards" else "environment.sandbox_paths"
            raise SandboxError(f"{key}: no directory {', '.join(missing)} on this node, which the sandbox would see")
        if not found.namespaces and os.geteuid() != 0:
            privileges.hide_from_own_user()  # it runs as this user: keep at least this process's tokens from it
        self.home, home = private_home(self.kind, jailed=found.namespaces)
        path, later = import_path(jailed=found.namespaces)
        argv = [sys.executable, "-I", "-c", BOOT, *path]
        env = sandbox_env("/tmp/work" if found.namespaces else home, self.limits.env)
        if found.namespaces:
            tmp_mb, writable = self.limits.memory_mb, list(self.limits.paths)
            readonly = [sys.prefix, *path, *installs()]
            argv = jail.wrap(argv, readonly=readonly, writable=writable, network=self.limits.network, env=env,
                             tmp=(tmp_mb, "0555"))  # fmt: skip
        self.process = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            cwd=home,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        jail.RUNNING.add(self.process.pid)
        setup = {"functions": self.names, "kind": self.kind, "limits": asdict(self.limits), "path": later}
        setup["warm_builtins"] = self.warm_builtins
        setup["jailed"], setup["scratch"] = found.namespaces, ["/tmp/work", "/dev/shm"] if found.namespaces else [home]
        self.process.stdin.write(json.dumps(setup).encode() + b"\n")
        self.process.stdin.flush()
        self.starting = found
        if wait:
            self.ready()

    def ready(self) -> None:
        """Wait until a sandbox started without waiting has imported its functions (at most START_TIMEOUT_S);
        raises `SandboxError` saying why it did not start. Nothing to wait for once it has."""
        if self.starting is None:
            return
        found, self.starting = self.starting, None
        line = self._line(START_TIMEOUT_S)
        try:
            ready = json.loads(line) if line is not None else None
        except ValueError:  # not a line its server writes (the functions print to the log, not this pipe)
            self.close()
            raise SandboxError(f"the {self.label} sandbox did not start: it wrote {line[:200]!r} first") from None
        if ready is None:
            why = exit_reason(self.process.poll(), self.label) if self.process.poll() is not None else "no answer"
            self.close()
            raise SandboxError(f"the {self.label} sandbox did not start: {why}")
        if "error" in ready:
            self.close()
            raise SandboxError(ready["error"])
        self.notes = ready["notes"]
        if not found.namespaces:
            self.notes.append(f"the {self.label} sandbox runs without namespaces ({found.why_not})")

    def _lost(self, timeout_s: float, timed_out: bool) -> Failure:
        """Kill a sandbox that ran past its bound or died in a call; why the call has no score."""
        if self.too_long:  # the server's own answer (a call's is bounded before it relays it): not the call's doing
            self.close()
            return Failure("sandbox_died", f"its answer ran past {ANSWER_LIMIT >> 20} MiB (the {self.label} sandbox "
                           "was replaced)")  # fmt: skip
        if timed_out:
            self.close()
            return Failure("timeout", f"timed out after {timeout_s:g}s (the {self.label} sandbox was killed with "
                           "everything it started)")  # fmt: skip
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=5)
        code = self.process.poll()
        self.close()
        return Failure(ended_kind(code), exit_reason(code, self.label))

    def _begin(self) -> None:
        """Before a call, or calls asked together: a sandbox that is running, has every request it was sent
        answered, and wrote nothing past its last answer (else it is replaced: no fault of the next call's)."""
        if self.process is None or self.process.poll() is not None:
            self._start()
        elif self.queued > self.answered_to:
            log.warning(f"the {self.label} sandbox has requests no one waits for: replaced")
            self._start()
        elif self.buffer or select.select([self.process.stdout.fileno()], [], [], 0)[0]:
            log.warning(f"the {self.label} sandbox wrote past its last answer: replaced")
            self._start()
        self.round = object()  # these calls' (`answers`)

    def _ask(self, message: dict) -> str:
        """Queue `message` as a request, its id drawn at random (its answer carries it), and write what the pipe
        takes now; `_line` writes the rest as it waits. Its id."""
        request = secrets.token_hex(8)
        line = json.dumps({**message, "id": request}, default=str).encode() + b"\n"
        self.unsent += line
        self.queued += len(line)
        self._write()
        return request

    def _write(self) -> None:
        """Write what the requests' pipe takes without waiting, a pipe buffer's worth at a time (a write that size
        never waits on a pipe `select` says is writable). A process gone takes nothing more: what is left is dropped,
        and its answers' end tells the rest."""
        into = self.process.stdin.fileno()
        while self.unsent and select.select([], [into], [], 0)[1]:
            try:
                taken = os.write(into, self.unsent[: select.PIPE_BUF])
            except OSError:  # it died: its requests are lost with it
                self.unsent.clear()
                return
            del self.unsent[:taken]
            self.written += taken

    def _answer(self, request: str, end: int, timeout_s: float, last: bool) -> tuple[dict, Failure | None]:
        """The answer to `request` (whose bytes end at `end` of what was queued), checked (`checked_answer`): (it,
        None), or ({}, why it has none). `last`: no other request is waiting, so anything written after it is out of
        protocol. No answer within `timeout_s`, or the process ended: the sandbox is killed (`_lost`); an answer out
        of protocol: it is replaced."""
        line = self._line(timeout_s)
        if line is None and self.written < end and not self.too_long:  # it never had the request: not the call's doing
            if self.ended:
                return {}, Failure("sandbox_died", self._lost(timeout_s, timed_out=False).reason)
            self.close()
            why = f"the {self.label} sandbox did not take the request within {timeout_s:g}s (it was replaced)"
            return {}, Failure("sandbox_died", why)
        if line is None:
            return {}, self._lost(timeout_s, timed_out=not self.ended)
        self.answered_to = end
        out = self.process.stdout.fileno()
        extra = last and (self.buffer or (select.select([out], [], [], 0)[0] and os.read(out, 1)))
        answer, why = checked_answer(line, request, self.kind)
        if why is None and extra:
            why = "more than one answer to one request"
        if why is not None:
            self.close()
            why = f"the {self.label} sandbox answered out of protocol ({why}); it was replaced"
            return {}, Failure("sandbox_died", why)
        if "error" in answer and self.kind == "rewards":
            return {}, Failure(answer["kind"], answer["error"])
        return answer, None

    def _line(self, timeout_s: float) -> bytes | None:
        """The next line it wrote, or None when none came within `timeout_s`, the process ended, or the line runs
        past `ANSWER_LIMIT` bytes (`too_long`); meanwhile the requests not yet written are, as its pipe takes them.
        Each chunk is searched alone: reading is linear in the line."""
        deadline = time.monotonic() + timeout_s
        out, into = self.process.stdout.fileno(), self.process.stdin.fileno()
        chunks, size = [self.buffer], len(self.buffer)
        while b"\n" not in chunks[-1]:
            remaining = deadline - time.monotonic()
            if size > ANSWER_LIMIT:
                self.too_long = True
                return None
            if remaining <= 0:
                self.buffer = b"".join(chunks)
                return None
            readable, writable, _ = select.select([out], [into] if self.unsent else [], [], remaining)
            if writable:
                self._write()
            if not readable:
                if writable:
                    continue
                self.buffer = b"".join(chunks)
                return None
            chunk = os.read(out, 1 << 20)
            if not chunk:
                self.ended = True
                self.buffer = b"".join(chunks)
                return None
            chunks.append(chunk)
            size += len(chunk)
        line, _, self.buffer = b"".join(chunks).partition(b"\n")
        return line


BOOT = "import sys; sys.path[:0] = sys.argv[1:]; from grpo_dist.sandbox_child import serve; serve()"
"""The sandbox's program (`python -I -c BOOT DIRECTORY...`): its import path is the directories it is given, before
the interpreter's own, never its working directory or a variable of its environment."""
RAY_SESSIONS = "/tmp/ray"


def sandbox_env(home: str, passed: tuple[str, ...] = ()) -> dict[str, str]:
    """A sandbox's whole environment: what Python needs, and the variables named in `passed`."""
    env = {
        "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
        "LANG": "C.UTF-8",
        "HOME": home,
        "TMPDIR": home,
        SANDBOX_MARK: str(os.getpid()),
        "TOKENIZERS_PARALLELISM": "false",
        **dict.fromkeys(("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"), "1"),
    }
    env.update({name: os.environ[name] for name in passed if name in os.environ})
    return env


def import_path(jailed: bool) -> tuple[list[str], list[str]]:
    """A sandbox's import path: this process's (where `grpo_dist` and the user's modules are found), then the
    working directory last (so nothing there shadows an installed module), each existing directory once; never `/`,
    the temporary directory or one above it, nor the Ray session directory (but what Ray unpacked there for the job,
    `runtime_resources`). As two parts: what it imports before, and after, it becomes `nobody`: as root without
    namespaces, a directory `nobody` may write comes after (what a plain process imports as root is root's alone)."""
    entries = []
    for entry in [*filter(None, sys.path), os.getcwd()]:
        entry = os.path.abspath(entry)
        covers_tmp = entry == "/" or (tempfile.gettempdir() + "/").startswith(entry.rstrip("/") + "/")
        in_sessions = entry.startswith(RAY_SESSIONS + "/") and "/runtime_resources/" not in entry + "/"
        if os.path.exists(entry) and entry not in entries and not covers_tmp and not in_sessions:
            entries.append(entry)
    if jailed or os.geteuid() != 0:
        return entries, []
    later = [entry for entry in entries if writable_by_nobody(entry)]
    return [entry for entry in entries if entry not in later], later


def installs() -> list[str]:
    """The directories of `grpo_dist` and of every editable install this process imports from (found by a finder
    of their own, never on the import path)."""
    import grpo_dist

    found = [os.path.dirname(grpo_dist.__file__)]
    for name, module in list(sys.modules.items()):
        if name.startswith("__editable__") and isinstance(getattr(module, "MAPPING", None), dict):
            found += [path for path in module.MAPPING.values() if isinstance(path, str) and os.path.exists(path)]
    return found


def writable_by_nobody(path: str) -> bool:
    """Whether `nobody` may change what `path` holds: it or a directory above it is `nobody`'s, `path` is open to
    anyone's writing (or its group's, where that group is `nobody`'s), or a directory above it is, without the
    sticky bit that keeps others' entries in place (`/tmp` has it)."""
    place = Path(os.path.realpath(path))
    for depth, directory in enumerate([place, *place.parents]):
        try:
            found = directory.stat()
        except OSError:
            return True
        open_to_it = found.st_mode & stat.S_IWOTH or (found.st_mode & stat.S_IWGRP and found.st_gid == NOBODY)
        if found.st_uid == NOBODY or (open_to_it and (depth == 0 or not found.st_mode & stat.S_ISVTX)):
            return True
    return False


def private_home(kind: str, jailed: bool) -> tuple[str, str]:
    """A new directory for a sandbox on this machine, its own and root's (mode 0700 from `tempfile.mkdtemp`), and the
    home made in it: in a jail the home is its own `/tmp/work`, and this directory its unused working directory;
    without one, as root, a directory of `nobody`'s with a name drawn at random, under this one opened to be passed
    through but not listed (0711), so no other `nobody` process finds it and none is ever on an import path."""
    made = jail.scratch_dir(f"{kind}-sandbox")
    if jailed:
        return made, made
    home = os.path.join(made, secrets.token_hex(8))
    os.mkdir(home, 0o700)
    if os.geteuid() == 0:
        os.chmod(made, 0o711)
        os.chown(home, NOBODY, NOBODY)
    return made, home


def checked_answer(line: bytes, request: str, kind: str) -> tuple[dict, str | None]:
    """One answer line as the sandbox gave it: (the answer, None), or ({}, why it is out of protocol). An answer is
    a JSON object with the request's `id` and either an `error` (text) and its `kind` (one the sandbox tells, of
    `ANSWERED_KINDS`) or, for a reward, a `value` (a finite number within `REWARD_LIMIT`) or, for a tool, a `result`
    (text)."""
    try:
        answer = json.loads(line, parse_constant=lambda name: (_ for _ in ()).throw(ValueError(name)))
    except (ValueError, UnicodeDecodeError) as error:
        return {}, f"not JSON: {str(error)[:80]}"
    if not isinstance(answer, dict) or answer.get("id") != request:
        return {}, f"not the answer to request {request}"
    if isinstance(answer.get("error"), str) and set(answer) == {"id", "error", "kind"}:
        return (answer, None) if answer["kind"] in ANSWERED_KINDS else ({}, f"no failure of kind {answer['kind']!r}")
    wanted = "value" if kind == "rewards" else "result"
    if set(answer) != {"id", wanted}:
        return {}, f"an answer holds `id` and `{wanted}` or `error`, got {sorted(answer)}"
    value = answer[wanted]
    if kind != "rewards":
        return (answer, None) if isinstance(value, str) else ({}, "a tool's result is text")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not abs(value) <= REWARD_LIMIT:
        return {}, f"a reward is one finite number within ±{REWARD_LIMIT:g}, got {str(value)[:40]}"
    return {"id": request, "value": float(value)}, None


def _signal(code: int) -> str | None:
    """The name of the signal that ended a process with exit status `code`; None when it exited."""
    if code > 128 and code - 128 in signal.Signals._value2member_map_:  # bubblewrap's way of saying a signal
        code = 128 - code
    return signal.Signals(-code).name if code < 0 else None


def exit_reason(code: int | None, label: str = "reward") -> str:
    if code is None:
        return "no answer"
    name = _signal(code)
    if name is not None:
        why = {
            "SIGKILL": "killed (SIGKILL: out of memory, or killed from outside)",
            "SIGXCPU": "out of CPU time",
        }.get(name, f"crashed ({name})")
        return f"the {label} sandbox was {why}"
    return f"the {label} sandbox exited with code {code} (the {label} called os._exit, or the interpreter died)"


def _marked_children(owner: int) -> list:
    """Processes under `owner` that carry the sandbox mark of `owner` (psutil processes)."""
    import psutil

    marked = []
    for child in psutil.Process(owner).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if child.environ().get(SANDBOX_MARK) == str(owner):
                marked.append(child)
    return marked


ANSWERED_KINDS = ("raised", "memory", "processes", "network", "unscorable", "timeout", "crashed", "sandbox_died")
"""The kinds of failure a sandbox may answer: those a call's process tells by the error's type and its limits
(`sandbox_child.CALL_KINDS`), and those the server tells by how the call's process ended (`sandbox_child.relayed`).
A time-out of the whole sandbox, or its end, is seen here."""
OUTSIDE_SIGNALS = ("SIGKILL", "SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
"""Signals that come from outside the sandbox (SIGKILL too from the kernel's out-of-memory killer, which the address
space limit keeps a sandbox from calling on itself): the machine's doing, not the call's."""


def ended_kind(code: int | None) -> str:
    """The kind of failure of a call whose sandbox ended with exit status `code` in it: `timeout` when it ran out of
    CPU time (SIGXCPU), `sandbox_died` when killed from outside (`OUTSIDE_SIGNALS`) or gone without a status, else
    `crashed` (a crash signal of its own, SIGSEGV or SIGABRT, or an exit: the call ended it)."""
    name = None if code is None else _signal(code)
    if code is None or name in OUTSIDE_SIGNALS:
        return "sandbox_died"
    return "timeout" if name == "SIGXCPU" else "crashed"

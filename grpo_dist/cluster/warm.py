"""Actor processes that start warm: forked from one process that imported the stack once, not each importing it.

Each of a run's actors is a Python process of its own, and most of a small run's start-up is those processes
importing torch, transformers, DeepSpeed and vLLM again (about 13 CPU seconds for vLLM alone on a 2-core machine).
On the Ray clusters grpo-dist starts on this machine (`grpo-dist up`'s; a run's own local one, whose warm process
the command starts before its own heavy imports, `start_for_this_run`, or `train()` called from Python as it starts
the cluster, unless the environment names one already serving, `SHARED_ENV`; the tests' own), a warm process
imports them once, and every Python worker the raylet starts is forked from it instead:

- the raylet runs `warm_launch.py` in place of Ray's `setup_worker.py` (`ray_constants.SETUP_WORKER_FILENAME`, read
  when a node starts); it asks the warm process, over a Unix socket, to fork the worker with the launcher's
  arguments, environment, working directory and standard streams, and stays beside it as the process the raylet
  knows (passing signals on, ending with it);
- the forked worker is Ray's own `default_worker.py`, run as `__main__` in the fork: it registers with the raylet,
  runs its actor and is killed as any worker is. It ends itself when its launcher goes (`_watch`), so no worker
  outlives what the raylet started;
- Ray itself is not imported in the warm process: its C++ core reads the job's id and the raylet's pid from the
  environment once per process, so each worker imports Ray after the fork, with its own environment (about 1 s).
  vLLM's one module that imports Ray at import (`vllm.v1.executor.ray_utils`, for its Ray executor) is imported
  again in the worker when used;
- a worker whose runtime environment needs more than environment variables (a working directory, a container, a
  conda environment: Ray prefixes its command) starts as Ray starts it, and so does every worker while the warm
  process is not answering.

What the fork inherits that a fresh process would read from its own environment at import: torch's thread count
(set again from `OMP_NUM_THREADS` where Ray sets it for the actor, `_threads_as_ray_sets`) and the Hugging Face
paths read when `huggingface_hub` is imported (the node's, as the raylet's environment has them). Only for nodes
without GPUs: a GPU's runtime cannot be forked once initialized, and the warm process is not tested there.
"""

from __future__ import annotations

import array
import contextlib
import gc
import importlib.abc
import importlib.machinery
import json
import os
import runpy
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from grpo_dist.cluster import warm_launch
from grpo_dist.cluster.warm_launch import SOCKET_ENV

LAUNCHER = Path(__file__).with_name("warm_launch.py")
STACK = ("torch", "transformers", "deepspeed", "vllm", "vllm.v1.engine.async_llm", "safetensors.torch")
"""What the warm process imports first, Ray kept out; then `FIRST_IMPORTS` and `ENGINE_IMPORTS`."""
FIRST_IMPORTS = ("grpo_dist.config", "grpo_dist.types", "jsonschema")
"""Imported after the stack, without Ray: what each actor and forked driver imports first (the config's models, the
rows' types; jsonschema for Ray's own import). A forked actor's own imports took 0.33 to 0.37 CPU seconds before and
0.15 to 0.20 after (`benchmarks/fork_imports.py`). grpo-dist's modules among them are imported again by a fork where
their files changed since (`_forget_edited_modules`): an edit while `grpo-dist up` runs reaches the next run."""
ENGINE_IMPORTS = ("vllm.v1.worker.cpu_worker", "vllm.v1.worker.cpu_model_runner", "vllm.v1.executor.uniproc_executor",
                  "vllm.v1.engine.core", "vllm.model_executor.models.qwen2", "vllm.v1.core.kv_cache_manager",
                  "vllm.model_executor.layers.quantization.online.base", "vllm.entrypoints.serve.utils.api_utils",
                  "vllm.entrypoints.launchers.cli_args")  # fmt: skip
"""Imported last: what a generator and its engine core import as they start on a CPU (the worker, model runner, sampler,
executor and KV cache manager, the model loader's quantization checks, the engine arguments' logging, and Qwen2, the
architecture of the models grpo-dist builds), 0.48 CPU seconds of each engine's start before and none after
(`benchmarks/fork_imports.py` at e901201, the first five), on the way to a run's first step; then
`_register_engine_kernels`. With torch.compile off (`TORCHDYNAMO_DISABLE`) as they are imported, as an eager engine's
process has it (the CPU backend's default): vLLM's small helpers that torch.compile decorates as their module is
imported (the log-prob gather, the top-k/top-p mask) stay plain functions, where a compiled one would compile at the
first request that needs it (3 s of each start for the log-prob gather; test_loop checks it). An engine that compiles
(`rollout.enforce_eager: false` on a CPU) gets the same plain helpers; the modules cannot be imported again in a fork
(they register torch operators once)."""
REQUEST_TIMEOUT_S = 10.0  # a launcher that answered ready sends its request at once
IMPORT_ENV = ("HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TORCH", "PYTORCH_", "VLLM_", "OMP_", "MKL_", "KMP_", "CUDA_",
              "TOKENIZERS_", "DS_", "DEEPSPEED_", "TRITON_", "XDG_CACHE_HOME", "PYTHONHASHSEED", "PYTHONIOENCODING",
              "LD_PRELOAD", "LD_LIBRARY_PATH")  # fmt: skip
"""Environment variables (by prefix) that torch, transformers, the hub, vLLM or DeepSpeed read once, at import: a
driver forked from a process that imported them with other values would keep that process's."""
FORKED_DRIVER = False
"""True in a run's driver forked here (`grpo_dist.cluster.warm_driver`)."""


def serve(path: str) -> None:
    """Import the stack, then fork a worker for each launcher that connects to `path`, until killed."""
    started = time.monotonic()
    listener = socket.socket(socket.AF_UNIX)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).unlink(missing_ok=True)
    listener.bind(path)
    listener.listen(128)  # launchers that come before the imports end wait for their answer (READY_TIMEOUT_S)
    import_all()
    # What the imports made moves to the permanent generation: no collection in a forked worker walks it again, as
    # vLLM's engine core does three times while it starts (its CPU seconds to the quick start's step 1: 2.3 against
    # 3.4, benchmarks/startup.py), nor writes to its pages, which the forks then share with this process unchanged.
    gc.freeze()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the workers are reaped as they exit
    print(
        f"warm in {time.monotonic() - started:.1f} s: {', '.join(STACK + FIRST_IMPORTS + ENGINE_IMPORTS)}", flush=True
    )
    while True:
        connection, _ = listener.accept()
        try:
            request, streams = _request(connection)
        except (OSError, ValueError) as err:
            print(f"a launcher's request was not read: {err}", flush=True)
            connection.close()
            continue
        if "driver" in request and (refused := _cannot_drive(request)):
            _refuse(connection, streams, refused)
            continue
        if (forked := os.fork()) == 0:
            listener.close()
            if "driver" in request:
                _become_driver(connection, request, streams)  # never returns
            _become_worker(connection, request, streams)  # never returns
        if "driver" in request:
            print(f"driver {forked}: grpo-dist {' '.join(request['argv'][1:])}", flush=True)
        for descriptor in streams:
            os.close(descriptor)
        connection.close()


def import_all(lists: tuple[str, ...] = ("STACK", "FIRST_IMPORTS", "ENGINE_IMPORTS")) -> None:
    """Import, Ray kept out, the named lists of this module in order (`STACK`, `FIRST_IMPORTS`, `ENGINE_IMPORTS`:
    all of them in the warm process; fewer in `benchmarks/fork_imports.py`), each as the warm process must: grpo-dist's
    modules of `FIRST_IMPORTS` recorded with their files (`_OWN_FILES`), `ENGINE_IMPORTS` with torch.compile off."""
    for name in lists:
        before, disabled_before = set(sys.modules), os.environ.get("TORCHDYNAMO_DISABLE")
        if name == "ENGINE_IMPORTS":
            os.environ["TORCHDYNAMO_DISABLE"] = "1"  # read as torch.compile decorates (vLLM's sampler, as imported)
        try:
            _import_without_ray(globals()[name])
        finally:
            if disabled_before is None:
                os.environ.pop("TORCHDYNAMO_DISABLE", None)
            else:
                os.environ["TORCHDYNAMO_DISABLE"] = disabled_before
        if name == "FIRST_IMPORTS":
            _OWN_FILES.update(
                _sources(module for module in set(sys.modules) - before if module.startswith("grpo_dist."))
            )
        if name == "ENGINE_IMPORTS":
            _register_engine_kernels()


def _register_engine_kernels() -> None:
    """Done once here for every engine forked from this process: on a CPU without Triton's CPU backend, each engine's
    worker points vLLM's Triton kernels at C++ implementations as it starts (`register_triton_kernel_overrides`),
    rebinding every reference to each kernel in every module loaded: a scan of about 0.24 CPU seconds in each engine
    with the stack loaded (timed by hand). With it and the last four `ENGINE_IMPORTS`, an engine built in a fork took
    0.55 CPU seconds against 1.06 (`benchmarks/engine_build.py --baseline`, 51d2c7a). A fork inherits the kernels
    rebound, and the platform's registration, left to do nothing, does not scan again (a second scan would also wrap the
    wrappers)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    platform = type(current_platform)
    platform.register_triton_kernel_overrides()
    platform.register_triton_kernel_overrides = classmethod(lambda cls: None)
    _one_thread("vLLM's kernel registration")


def _import_without_ray(modules: tuple[str, ...]) -> None:
    blocker = _NoRay()
    sys.meta_path.insert(0, blocker)
    try:
        for name in modules:
            __import__(name)
    finally:
        sys.meta_path.remove(blocker)
    sys.modules.pop("vllm.v1.executor.ray_utils", None)
    executor = sys.modules.get("vllm.v1.executor")
    if executor is not None:
        executor.__dict__.pop("ray_utils", None)
    _one_thread("the stack's imports")


def _one_thread(what: str) -> None:
    """Refuse to serve where `what` started a thread: a fork keeps only the thread that forks."""
    if threading.active_count() != 1:
        raise RuntimeError(f"{what} started threads: {threading.enumerate()}")


_OWN_FILES: dict[str, tuple[str, int | None]] = {}
"""grpo-dist's modules imported with `FIRST_IMPORTS`: each one's file and its modification time then."""


def _sources(names) -> dict[str, tuple[str, int | None]]:
    found = {}
    for name in names:
        path = getattr(sys.modules.get(name), "__file__", None)
        if path:
            found[name] = (path, _modified(path))
    return found


def _modified(path: str) -> int | None:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return None


def _forget_edited_modules() -> None:
    """In a fork: where a file of grpo-dist's modules imported before the fork (`_OWN_FILES`) changed since, those
    modules are dropped, so that this process imports them afresh, as a new process would."""
    if any(_modified(path) != modified for path, modified in _OWN_FILES.values()):
        for name in _OWN_FILES:
            sys.modules.pop(name, None)
        for name in _OWN_FILES:  # `from package import module` reads a kept package's attribute first
            package, _, attribute = name.rpartition(".")
            if package in sys.modules and package not in _OWN_FILES:
                sys.modules[package].__dict__.pop(attribute, None)


class _NoRay(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds `ray` and its modules, and fails to load them: an optional import of Ray sees it missing."""

    def find_spec(self, name, path=None, target=None):
        return importlib.machinery.ModuleSpec(name, self) if name.split(".")[0] == "ray" else None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        raise ImportError("Ray is imported by each worker after it is forked (grpo_dist.cluster.warm)")


def _request(connection: socket.socket) -> tuple[dict, list[int]]:
    connection.settimeout(REQUEST_TIMEOUT_S)
    connection.sendall(b"R")
    message, ancillary, _, _ = connection.recvmsg(1 << 20, socket.CMSG_LEN(3 * array.array("i").itemsize))
    streams = []
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            descriptors = array.array("i")
            descriptors.frombytes(data[: len(data) - len(data) % descriptors.itemsize])
            streams.extend(descriptors)
    if len(message) < 8 or len(streams) != 3:
        for descriptor in streams:
            os.close(descriptor)
        raise ValueError("no request, or not its three standard streams")
    size, body = int.from_bytes(message[:8], "big"), message[8:]
    while len(body) < size:
        chunk = connection.recv(size - len(body))
        if not chunk:
            raise ValueError("the request ended early")
        body += chunk
    return json.loads(body), streams


def _become_worker(connection: socket.socket, request: dict, streams: list[int]) -> None:
    try:
        os.setsid()  # a process group of its own, as the raylet gives the processes it starts
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for target, descriptor in enumerate(streams):
            os.dup2(descriptor, target)
            os.close(descriptor)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        extra = [entry for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry]
        sys.path[:0] = [entry for entry in extra if entry not in sys.path]
        sys.argv = list(request["argv"])
        _forget_edited_modules()
        connection.settimeout(None)
        connection.sendall(f"{os.getpid()}\n".encode())
        threading.Thread(target=_watch, args=(connection,), name="warm-launcher-watch", daemon=True).start()
        _threads_as_ray_sets()
        warm_launch.PRELOADED = frozenset(sys.modules)
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as done:
        os._exit(done.code if isinstance(done.code, int) else 1)
    except BaseException as err:  # noqa: BLE001 - a forked worker must never return into the warm process's loop
        print(f"the warm worker failed: {err!r}", file=sys.stderr, flush=True)
        os._exit(1)
    os._exit(0)


def _cannot_drive(request: dict) -> str:
    """Why a run's driver cannot be forked here (`warm_driver`), or "": this process imported the stack with another
    interpreter or copy of grpo-dist, or with another value of a variable read at import."""
    import grpo_dist

    asked = request["driver"]
    if os.path.realpath(asked.get("executable", "")) != os.path.realpath(sys.executable):
        return f"the warm process runs {sys.executable}, the command {asked.get('executable')}"
    if os.path.realpath(asked.get("package", "")) != os.path.realpath(os.path.dirname(grpo_dist.__file__)):
        return f"the warm process imported grpo-dist from {os.path.dirname(grpo_dist.__file__)}"
    theirs = {key: value for key, value in request["env"].items() if key.startswith(IMPORT_ENV)}
    ours = {key: value for key, value in _IMPORTED_WITH.items() if key.startswith(IMPORT_ENV)}
    if differ := sorted(key for key in theirs.keys() | ours.keys() if theirs.get(key) != ours.get(key)):
        return (f"{', '.join(differ)} differ(s) from the environment the warm process imported the stack with "
                "(start it again with this one; for `grpo-dist up`'s: `grpo-dist down`, `grpo-dist up`)")  # fmt: skip
    return ""


_IMPORTED_WITH = dict(os.environ)
"""This process's environment when it imported the stack (it never changes it)."""


def _refuse(connection: socket.socket, streams: list[int], why: str) -> None:
    for descriptor in streams:
        os.close(descriptor)
    try:
        connection.sendall(f"cold: {why}\n".encode())
    except OSError:
        pass
    connection.close()


def _become_driver(connection: socket.socket, request: dict, streams: list[int]) -> None:
    """Run the command `request` names (`grpo_dist.cluster.warm_driver`) as a fresh interpreter would run it: its
    streams, environment, directory and signals as the command's, and its exit code sent back at the end."""
    code = 1
    try:
        os.setsid()
        for number in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
            signal.signal(number, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for target, descriptor in enumerate(streams):
            os.dup2(descriptor, target)
            os.close(descriptor)
        _retitle(request["argv"])  # before the environment moves: the title is written where it was
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        os.umask(request["umask"])
        with contextlib.suppress(OSError):  # a command at a higher priority than this process's: kept at this one's
            os.setpriority(os.PRIO_PROCESS, 0, request["niceness"])
        extra = [entry for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry]
        sys.path[:0] = [os.path.abspath(entry) for entry in extra if os.path.abspath(entry) not in sys.path]
        sys.argv = list(request["argv"])
        _forget_edited_modules()
        _fresh_standard_streams()
        import tempfile

        tempfile.tempdir = None  # read again from this environment's TMPDIR
        connection.settimeout(None)
        connection.sendall(f"{os.getpid()}\n".encode())
        threading.Thread(target=_watch, args=(connection,), name="warm-launcher-watch", daemon=True).start()
        import importlib

        importlib.import_module(__spec__.name).FORKED_DRIVER = True  # this module as the command imports it
        code = _run_as_main()
    except BaseException as err:  # noqa: BLE001 - a forked driver must never return into the warm process's loop
        print(f"grpo-dist: the warm driver failed: {err!r}", file=sys.stderr, flush=True)
    finally:
        try:
            connection.sendall(f"exit {code}\n".encode())
        finally:
            os._exit(code)


def _run_as_main() -> int:
    """`python -m grpo_dist`, then the interpreter's own end (other threads joined, exit functions run, streams
    flushed); the exit code. An uncaught KeyboardInterrupt ends the process by SIGINT, as Python's own."""
    import atexit
    import traceback

    interrupted = False
    try:
        runpy.run_module("grpo_dist", run_name="__main__", alter_sys=False)
        code = 0
    except SystemExit as done:
        if done.code is None or isinstance(done.code, int):
            code = done.code or 0
        else:
            print(done.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        traceback.print_exc()
        code, interrupted = 130, True
    except BaseException:  # noqa: BLE001 - as the interpreter: the traceback, then exit 1
        traceback.print_exc()
        code = 1
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code


def _fresh_standard_streams() -> None:
    """Standard streams as a new interpreter opens them on these descriptors: this process's were opened on its log
    file (block-buffered), and a terminal's output must come line by line."""
    import io

    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    encoding = sys.stdout.encoding
    stdin = io.TextIOWrapper(open(0, "rb", closefd=False), encoding=encoding)
    out = open(1, "wb", buffering=0 if unbuffered else -1, closefd=False)
    err = open(2, "wb", buffering=0 if unbuffered else -1, closefd=False)
    stdout = io.TextIOWrapper(out, encoding=encoding, line_buffering=os.isatty(1), write_through=unbuffered)
    stderr = io.TextIOWrapper(err, encoding=encoding, errors="backslashreplace", line_buffering=True)
    sys.stdin, sys.stdout, sys.stderr = sys.__stdin__, sys.__stdout__, sys.__stderr__ = stdin, stdout, stderr


def _retitle(argv: list[str]) -> None:
    """The process's title as `ps` shows it: the command's, not this warm process's (`setproctitle`, which vLLM
    needs)."""
    try:
        import setproctitle
    except ImportError:
        return
    setproctitle.setproctitle(" ".join(["grpo-dist", *argv[1:]]))


def _watch(connection: socket.socket) -> None:
    """End this worker when its launcher (the process the raylet started and kills) is gone."""
    try:
        while connection.recv(64):
            pass
    except OSError:
        pass
    os.kill(os.getpid(), signal.SIGKILL)


def _threads_as_ray_sets() -> None:
    """Ray sets an actor's `OMP_NUM_THREADS` to its CPUs before the actor's code runs, which a fresh process's torch
    reads at import; this process imported torch before, so the count is also given to torch when Ray sets it."""
    import ray._private.utils as ray_utils
    import torch

    original = ray_utils.set_omp_num_threads_if_unset

    def give_torch_the_count() -> None:
        if (threads := os.environ.get("OMP_NUM_THREADS", "")).isdigit() and int(threads) > 0:
            torch.set_num_threads(int(threads))

    def set_threads() -> bool:
        changed = original()
        give_torch_the_count()
        return changed

    ray_utils.set_omp_num_threads_if_unset = set_threads
    give_torch_the_count()


def ready(path: Path, timeout_s: float) -> bool:
    """Whether the warm process at `path` answers within `timeout_s` (it answers once it has imported the stack)."""
    probe = socket.socket(socket.AF_UNIX)
    probe.settimeout(timeout_s)
    try:
        probe.connect(str(path))
        return probe.recv(1) == b"R"
    except OSError:
        return False
    finally:
        probe.close()


def available() -> bool:
    """Whether workers here can start warm: Linux (fork, Unix sockets) and no GPU device on the machine."""
    return sys.platform == "linux" and not any(Path("/dev").glob("nvidia[0-9]*")) and not Path("/dev/kfd").exists()


def start(path: Path, log: Path, detached: bool) -> subprocess.Popen:
    """Start the warm process serving at `path` (its output in `log`). A `detached` one outlives this process (its
    own session: `grpo-dist up`'s, stopped by `down`); otherwise it is killed when this process exits."""
    path.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "grpo_dist.cluster.warm", str(path)]
    with open(log, "ab") as output:
        return subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT, start_new_session=detached,
            preexec_fn=None if detached else _die_with_parent,
        )  # fmt: skip


def _die_with_parent() -> None:
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


@contextlib.contextmanager
def used_for_nodes_started_here(path: Path) -> Iterator[None]:
    """Within the block, the Ray nodes this process starts (`ray.init` of a local cluster) start their workers
    through the launcher, asking the warm process at `path`; nodes started after it start theirs as Ray does."""
    import ray._private.ray_constants as ray_constants

    default, socket_before = ray_constants.SETUP_WORKER_FILENAME, os.environ.get(SOCKET_ENV)
    ray_constants.SETUP_WORKER_FILENAME = str(LAUNCHER)  # joined to Ray's workers directory: an absolute path wins
    os.environ[SOCKET_ENV] = str(path)  # the raylet's environment, passed on to the processes it starts
    try:
        yield
    finally:
        ray_constants.SETUP_WORKER_FILENAME = default
        if socket_before is None:
            os.environ.pop(SOCKET_ENV, None)
        else:
            os.environ[SOCKET_ENV] = socket_before


SHARED_ENV = "GRPO_DIST_WARM_PROCESS"
"""The socket of a warm process already serving on this machine, which a run starting a local cluster of its own
forks its actors from instead of starting one, and `train`, `eval` and `sft` their driver (`warm_driver`): runs one
after another that each need a cluster of their own (a test suite's, a sweep's) pay for the stack's imports once.
Start one with `python -m grpo_dist.cluster.warm SOCKET`; it must have imported the same code as the runs."""

_for_this_run: tuple[Path, subprocess.Popen | None] | None = None


def shared_socket() -> Path | None:
    """The socket `SHARED_ENV` names, where workers here can start warm (`available`) and it is a socket this user
    owns: a run sends it its whole environment (credentials too) and its standard streams."""
    shared = os.environ.get(SHARED_ENV)
    if not shared or not available():
        return None
    try:
        found = Path(shared).stat()
    except OSError:
        return None
    return Path(shared) if stat.S_ISSOCK(found.st_mode) and found.st_uid == os.getuid() else None


def start_for_this_run() -> None:
    """Start a warm process for the local Ray cluster this run will start, early (importing beside the driver's own
    start); `used_by_this_run` gives it to that cluster, `stop_for_this_run` (or this process's exit) stops it. Where
    the environment names a warm process already serving (`SHARED_ENV`), that one is used and left running."""
    global _for_this_run
    if _for_this_run is not None or not available():
        return
    if shared := os.environ.get(SHARED_ENV):
        if (found := shared_socket()) is not None:
            _for_this_run = (found, None)
            return
        print(f"grpo-dist: {SHARED_ENV}={shared} names no socket of this user's: the run starts a warm process of "
              "its own", file=sys.stderr)  # fmt: skip
    import atexit

    _for_this_run = start_in_new_dir("grpo-dist-warm-")
    atexit.register(stop_for_this_run)


def start_in_new_dir(prefix: str) -> tuple[Path, subprocess.Popen]:
    """A warm process killed with this one, serving in a new directory under /tmp named with `prefix` (short: a
    socket path's limit); its socket's path and the process. `stop_and_remove` stops it."""
    import tempfile

    directory = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    path = directory / "warm.sock"
    return path, start(path, directory / "warm.log", detached=False)


def stop_and_remove(path: Path, process: subprocess.Popen) -> None:
    """Kill a warm process `start_in_new_dir` started, and remove its directory."""
    import shutil

    process.kill()
    process.wait(timeout=30)
    shutil.rmtree(path.parent, ignore_errors=True)


def used_by_this_run() -> contextlib.AbstractContextManager:
    """The warm process `start_for_this_run` started, for the nodes started within the block (else nothing)."""
    return used_for_nodes_started_here(_for_this_run[0]) if _for_this_run else contextlib.nullcontext()


def stop_for_this_run() -> None:
    global _for_this_run
    if _for_this_run is None:
        return
    path, process = _for_this_run
    _for_this_run = None
    if process is not None:  # else shared with other runs (`SHARED_ENV`): theirs to stop
        stop_and_remove(path, process)


def ray_start(arguments: list[str]) -> None:
    """`ray start ARGUMENTS` whose node starts its workers through the launcher (`GRPO_DIST_WARM_SOCKET` set)."""
    import ray._private.ray_constants as ray_constants
    from ray.scripts.scripts import main

    ray_constants.SETUP_WORKER_FILENAME = str(LAUNCHER)
    sys.argv = ["ray", "start", *arguments]
    main()


if __name__ == "__main__":
    if sys.argv[1:2] == ["ray-start"]:
        ray_start(sys.argv[2:])
    else:
        serve(sys.argv[1])

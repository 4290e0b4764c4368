"""User-style reward functions that tests load by dotted path (``reward_fixtures.<name>``)."""

from __future__ import annotations

import os
import string
import sys
import time
import zlib
from pathlib import Path
from typing import Any

NOT_CALLABLE = 3


def length_reward(prompt: str, completion: str, scale: float = 1.0, **_: Any) -> float:
    """``scale * len(completion)``: a user reward with its own keyword argument."""
    return scale * len(completion)


def raising_reward(prompt: str, completion: str, **_: Any) -> float:
    raise RuntimeError("reward server unreachable")


def slow_reward(prompt: str, completion: str, delay_s: float = 2.0, **_: Any) -> float:
    time.sleep(delay_s)
    return 1.0


def string_reward(prompt: str, completion: str, **_: Any) -> str:
    return "1.0"


def nan_reward(prompt: str, completion: str, **_: Any) -> float:
    return float("nan")


def inf_reward(prompt: str, completion: str, **_: Any) -> float:
    return float("inf")


def exiting_reward(prompt: str, completion: str, **_: Any) -> float:
    sys.exit(3)


def first_char_reward(prompt: str, completion: str, **_: Any) -> float:
    """(code of the first character mod 10) / 10: varies across a tiny random model's samples, so groups have
    non-zero advantages. Raises for an empty completion or one opening with punctuation: those stay unscored."""
    if not completion or completion[0] in string.punctuation:
        raise ValueError(f"cannot score {completion!r}")
    return (ord(completion[0]) % 10) / 10


def half_informative_reward(prompt: str, completion: str, **_: Any) -> float:
    """For the prompts whose CRC-32 is odd, (code of the first character mod 10) / 10 (0 for an empty completion);
    0 for the others: their groups' rewards are all equal, so dynamic sampling drops about half the groups."""
    if zlib.crc32(prompt.encode()) % 2 == 0 or not completion:
        return 0.0
    return (ord(completion[0]) % 10) / 10


def slow_once_asked(prompt: str, completion: str, signal_dir: str, delay_s: float = 0.5, **_: Any) -> float:
    """0.0 (give it weight 0 and the rewards are unchanged). Returns at once until the file `<signal_dir>/slow`
    exists; from then on it creates `<signal_dir>/scoring` and takes `delay_s` per completion, so that a test can
    act while a step's completions are being scored."""
    folder = Path(signal_dir)
    if (folder / "slow").exists():
        (folder / "scoring").touch()
        time.sleep(delay_s)
    return 0.0


def env_reward(prompt: str, completion: str, name: str, sha256: str, **_: Any) -> float:
    """1.0 when the environment variable `name` holds a value whose SHA-256 is `sha256` (the value itself never
    appears in a config), else 0.0: shows that a variable reached the reward workers."""
    import hashlib
    import os

    value = os.environ.get(name)
    return float(value is not None and hashlib.sha256(value.encode()).hexdigest() == sha256)


# Rewards that misbehave the ways user code does; the sandbox scores each completion as failed, saying why.


def forking_reward(prompt: str, completion: str, **_: Any) -> float:
    """Starts a process that would outlive the call."""
    import subprocess

    subprocess.Popen(["sleep", "600"])
    return 1.0


def threading_reward(prompt: str, completion: str, **_: Any) -> float:
    """Starts a thread that would outlive the call."""
    import threading

    threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
    return 1.0


def sleeping_reward(prompt: str, completion: str, **_: Any) -> float:
    """Never returns."""
    while True:
        time.sleep(1)


def hungry_reward(prompt: str, completion: str, **_: Any) -> float:
    """Asks for far more memory than a reward needs (64 GiB)."""
    return float(len(bytearray(64 << 30)))


def out_of_memory_reward(prompt: str, completion: str, **_: Any) -> float:
    """Raises what an allocation past the memory limit raises, without asking the machine for the memory."""
    raise MemoryError


def crashing_reward(prompt: str, completion: str, **_: Any) -> float:
    """Crashes its process (SIGSEGV), as a C parser overflowing its stack on a completion would."""
    import signal

    os.kill(os.getpid(), signal.SIGSEGV)
    time.sleep(60)
    return 0.0


def unscorable_reward(prompt: str, completion: str, **_: Any) -> float:
    """Cannot judge any completion, and says it is not the completion's fault."""
    from grpo_dist.types import Unscorable

    raise Unscorable("the row has no `answer`")


def networking_reward(prompt: str, completion: str, port: int = 0, **_: Any) -> float:
    """Connects to a local server (`port`, or one given in the environment)."""
    import os
    import socket

    with socket.create_connection(("127.0.0.1", port or int(os.environ["SANDBOX_TEST_PORT"])), timeout=2):
        return 1.0


def quitting_reward(prompt: str, completion: str, **_: Any) -> float:
    """Ends its process at once."""
    import os

    os._exit(3)


MISBEHAVIOURS = (forking_reward, threading_reward, sleeping_reward, hungry_reward, networking_reward, quitting_reward)


def misbehaving_reward(prompt: str, completion: str, state_dir: str, port: int, **fields: Any) -> float:
    """Misbehaves each of the ways above once in a run (the first call to claim a way does it, across every reward
    worker: `state_dir` holds the claims), then scores as `length_reward`."""
    import os

    for index, misbehave in enumerate(MISBEHAVIOURS):
        try:
            os.close(os.open(os.path.join(state_dir, str(index)), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            continue
        return misbehave(prompt, completion, port=port)
    return length_reward(prompt, completion)


# Hostile user rewards: each tries to break the protocol of the sandbox or to reach what it must not.


def big_reward(prompt: str, completion: str, **_: Any) -> float:
    return 6e29  # within rewards.REWARD_LIMIT (1e30); two of them are not


def float32_overflow_reward(prompt: str, completion: str, **_: Any) -> float:
    return 3.5e38  # finite in float64, inf in a float32 tensor


def huge_int_reward(prompt: str, completion: str, **_: Any) -> int:
    return 10**400  # no float holds it


def blaming_reward(prompt: str, completion: str, **_: Any) -> float:
    """Answers, on every file descriptor it has, that its sandbox died (the machine's doing: unscored, where a
    failure of its own scores the floor), then exits at once."""
    import json

    line = json.dumps({"error": "the reward sandbox died", "kind": "sandbox_died"}).encode() + b"\n"
    for fd in range(3, 256):
        try:
            os.write(fd, line)
        except OSError:
            pass
    os._exit(0)


def setup_failing_reward(prompt: str, completion: str, **_: Any) -> float:
    """Exits with the status a call's process uses when it cannot limit itself (the machine's doing)."""
    os._exit(70)


def forging_reward(prompt: str, completion: str, **_: Any) -> float:
    """Writes a forged answer (and a line of garbage) to every file descriptor it has, then fails its own work."""
    import json
    import os

    for fd in range(3, 256):
        for request in range(1, 50):
            try:
                os.write(fd, json.dumps({"id": request, "value": 1.0}).encode() + b"\n")
            except OSError:
                break
    raise RuntimeError("my own checks failed")


def garbage_reward(prompt: str, completion: str, **_: Any) -> float:
    """Writes a line that is not JSON where its answer goes, then returns normally."""
    import os

    for fd in range(3, 256):
        try:
            os.write(fd, b"Infinity garbage\n")
        except OSError:
            pass
    return 1.0


def secret_reward(prompt: str, completion: str, name: str = "WANDB_API_KEY", **_: Any) -> float:
    """1.0 when the variable `name` of the run's environment is in its own."""
    import os

    return 1.0 if name in os.environ else 0.0


def planting_reward(prompt: str, completion: str, module: str, **_: Any) -> float:
    """Plants `module` (and `sitecustomize`, and a package `grpo_dist`) in every directory of its import path, its
    home, its temporary directory and its working directory that it can write: importing any of them records who
    imported it, in a file named by the effective user id in each directory the planted code can write."""
    import tempfile

    code = (
        "import os, tempfile\nIMPORTED_BY = os.geteuid()\n"
        "for place in (os.path.dirname(os.path.abspath(__file__)), tempfile.gettempdir(), '/tmp'):\n"
        "    try:\n        open(os.path.join(place, f'planted-ran-as-{IMPORTED_BY}'), 'w').close()\n"
        "    except OSError:\n        pass\n\n"
        "def probe(prompt, completion, **_):\n    return float(IMPORTED_BY)\n"
    )
    planted = 0.0
    places = [*sys.path, os.environ.get("HOME", ""), tempfile.gettempdir(), os.getcwd()]
    for directory in filter(None, places):
        for name in (f"{module}.py", "sitecustomize.py", os.path.join("grpo_dist", "__init__.py")):
            try:
                os.makedirs(os.path.dirname(os.path.join(directory, name)), exist_ok=True)
                with open(os.path.join(directory, name), "w") as file:
                    file.write(code)
                planted = 1.0
            except OSError:
                continue
    return planted


def patching_reward(prompt: str, completion: str, **_: Any) -> float:
    """Leaves its mark on what the next call would use: a module-level flag, this module's functions (itself and
    `length_reward`), a builtin, and a thread; then scores as `length_reward`. 1000 when it finds the mark of an
    earlier call."""
    import builtins
    import threading

    module = sys.modules[__name__]
    if getattr(module, "PATCHED", False) or getattr(builtins, "patched_by_a_reward", False):
        return 1000.0
    score = length_reward(prompt, completion)
    module.PATCHED = True
    builtins.patched_by_a_reward = True
    module.length_reward = lambda *args, **kwargs: 1000.0
    module.patching_reward = lambda *args, **kwargs: 1000.0
    try:
        threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
    except RuntimeError:
        pass  # no thread without reward.sandbox_processes
    return score


def seeing_reward(prompt: str, completion: str, paths: list[str], **_: Any) -> float:
    """How many of `paths` it can see (a directory listed or a file read), and 100 for each file of `/tmp` named
    like another sandbox's home (`grpo-`)."""
    seen = 0.0
    for path in paths:
        try:
            os.listdir(path) if os.path.isdir(path) else open(path).read()
            seen += 1
        except OSError:
            continue
    try:
        seen += 100 * sum(name.startswith("grpo-") for name in os.listdir("/tmp"))
    except OSError:
        pass
    return seen


def detaching_reward(prompt: str, completion: str, **_: Any) -> float:
    """Starts `sleep 600` in a session of its own (setsid), which tries to outlive the sandbox."""
    import subprocess

    subprocess.Popen(["setsid", "sleep", "600"], start_new_session=True)
    return 1.0


def flag_reward(prompt: str, completion: str, path: str, **_: Any) -> float:
    """1.0 while the file at `path` exists, 0.0 once a test removes it: a reward that collapses when told to."""
    return float(os.path.exists(path))


def fields_seen_reward(prompt: str, completion: str, **fields: Any) -> float:
    """What a reward is passed: 100 when the row's `answer` reached it, plus 1 for each name of the jail's settings
    (`config.RESERVED_FIELDS`) that did."""
    settings = ("isolation", "memory_mb", "budget_s", "timeout_per_test_s", "strict")
    return 100.0 * ("answer" in fields) + sum(name in fields for name in settings)


def sympy_imported(prompt: str, completion: str, **_: Any) -> float:
    """1.0 where the sandbox's server had imported sympy when it forked this call's process, else 0.0."""
    return 1.0 if "sympy" in sys.modules else 0.0


def warm_up_failing_reward(prompt: str, completion: str, **_: Any) -> float:
    return 1.0


def _failing_warm_up() -> None:
    raise RuntimeError("the grader's tables are missing")


warm_up_failing_reward.sandbox_warmup = _failing_warm_up


def sees_other_requests(prompt: str, completion: str, **_: Any) -> float:
    """1.0 where this call's process, forked from the sandbox's server, holds a request the server was sent after its
    own (the server's read-ahead of its requests' pipe, which the fork copied), else 0.0."""
    frame = sys._getframe()
    while frame is not None and frame.f_code.co_name != "serve":
        frame = frame.f_back
    try:
        ahead = frame.f_locals["requests"].peek(1 << 16)  # what the server read and has not handled yet
    except (AttributeError, KeyError, OSError, ValueError):  # its pipe is closed here: nothing was read ahead
        ahead = b""
    return 1.0 if b'"completion"' in ahead else 0.0


def clock_reward(prompt: str, completion: str, **_: Any) -> float:
    """When it ran: `time.monotonic()`, the machine's clock since boot, which the sandbox shares with the test."""
    return time.monotonic()

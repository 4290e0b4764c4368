"""Running the model's code against tests (`code_tests`) and as a tool (`python`), each run jailed
(`grpo_dist.jail`), judged here, in the trusted process that started it.

`code_tests` runs every test in a fresh jailed process of its own: the process comes up and says so; the
completion's code is sent and run; the process says it ran; only then is the test sent, with a nonce drawn for it,
and the test passes when the process writes that nonce back after running the test, then exits with status 0, and
writes nothing else. So
  - the tests are not in the process while the code runs (they come one at a time, after it);
  - code that exits early (`os._exit(0)`, `sys.exit`), writes to every file descriptor, or walks the frames finds
    no verdict to forge: it knows no nonce, and anything out of protocol fails the test;
  - one test's failure (or a crash, a limit, a time-out) fails that test only.
What it cannot stop: once the code ran, it owns its interpreter, and the test runs there too. Code that hooks the
interpreter (a trace function that skips lines, an object equal to everything, or a reimplementation of this
protocol) can still pass tests it does not solve. The tests' own assertions (`type(x) is int`, ...) are the defence
against values that lie; the jail keeps such code from reaching anything else.
"""

from __future__ import annotations

import json
import math
import re
import secrets
import time
from dataclasses import asdict
from typing import Any

from grpo_dist.jail import Isolation, Jailed, Limits

CODE_BLOCK = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)
START_TIMEOUT_S = 30.0  # a jailed interpreter coming up on a loaded machine
MEMORY_MB = 1024  # address space of each run
OUTPUT_LIMIT = 4096  # characters of a `python` tool call's output the model reads

RUNNER = r"""
import ctypes, json, os, resource, sys
ctypes.CDLL(None).prctl(4, 0)  # PR_SET_DUMPABLE 0: no process of its user reads or writes its memory
status, limits = int(sys.argv[1]), json.loads(sys.argv[2])
for kind, value in [(resource.RLIMIT_AS, limits["memory_mb"] << 20), (resource.RLIMIT_CPU, limits["cpu_s"]),
                    (resource.RLIMIT_FSIZE, limits["file_mb"] << 20), (resource.RLIMIT_NOFILE, limits["open_files"]),
                    (resource.RLIMIT_CORE, 0)] + ([] if limits["processes"] else [(resource.RLIMIT_NPROC, 0)]):
    resource.setrlimit(kind, (value, value))
os.write(status, b"up\n")
namespace = {"__name__": "__main__"}
try:
    exec(compile(json.loads(sys.stdin.buffer.readline())["code"], "<completion>", "exec"), namespace)
except BaseException as error:
    if limits["tool"]:
        import traceback
        traceback.print_exception(error, file=sys.stdout)
        sys.stdout.flush()
    os._exit(1)
if limits["tool"]:
    sys.stdout.flush()
    os._exit(0)
os.write(status, b"ran\n")
request = json.loads(sys.stdin.buffer.readline())
sys.settrace(None)
sys.setprofile(None)
try:
    exec(compile(request["test"], "<test>", "exec"), namespace)
except BaseException:
    os._exit(1)
os.write(status, request["nonce"].encode() + b"\n")
os._exit(0)
"""


def program_of(completion: str) -> str:
    """The code of a completion: its last fenced Python block, or the whole completion."""
    blocks = CODE_BLOCK.findall(completion)
    return blocks[-1] if blocks else completion


def limits_json(timeout_s: float, memory_mb: int, tool: bool) -> str:
    limits = Limits(memory_mb=memory_mb, cpu_s=math.ceil(2 * timeout_s) + 1)
    return json.dumps({**asdict(limits), "tool": tool})


def _started(jailed: Jailed) -> bool:
    """Whether the jailed interpreter came up (said so) within `START_TIMEOUT_S`."""
    return jailed.read_until(b"up\n", time.monotonic() + START_TIMEOUT_S)


def passes(
    code: str,
    test: str,
    timeout_s: float,
    isolation: Isolation,
    memory_mb: int = MEMORY_MB,
    deadline: float = math.inf,
) -> bool:
    """Whether `test` passes after `code` ran, in a fresh jailed process (the protocol above): the code and then the
    test each given `timeout_s` of wall-clock time, and neither past `deadline`. Raises `RuntimeError` only where no
    jail comes up, twice (the machine, not the code)."""
    for _ in range(2):  # best effort, a sibling's code may kill a jail before it is up (`kill(-1)` as nobody)
        with Jailed(RUNNER, [limits_json(timeout_s, memory_mb, tool=False)], isolation) as jailed:
            if _started(jailed):
                return _judged(jailed, code, test, timeout_s, deadline)
    raise RuntimeError(f"a jailed interpreter did not come up within {START_TIMEOUT_S:g}s, twice")


def _judged(jailed: Jailed, code: str, test: str, timeout_s: float, deadline: float) -> bool:
    phase = min(time.monotonic() + timeout_s, deadline)
    if not jailed.send(json.dumps({"code": code}).encode() + b"\n", phase):
        return False
    if not jailed.read_until(b"ran\n", phase):
        return False
    nonce = secrets.token_hex(16)
    phase = min(time.monotonic() + timeout_s, deadline)
    if not jailed.send(json.dumps({"test": test, "nonce": nonce}).encode() + b"\n", phase):
        return False
    return jailed.read_until(nonce.encode() + b"\n", phase) and jailed.finish(phase) == 0


def code_tests(
    prompt: str,
    completion: str,
    tests: Any,
    timeout_per_test_s: float = 2.0,
    isolation: str = "require",
    memory_mb: int = MEMORY_MB,
    budget_s: float = math.inf,
    **_: Any,
) -> float:
    """The fraction of ``tests`` (a row field: Python statements, usually ``assert``s, as a list or one per line)
    that pass after the completion's code has run: its last fenced Python block, or the whole completion. Each test
    runs in a jailed process of its own (`grpo_dist.jail`), the code and then the test each given
    ``timeout_per_test_s``; code that fails to run fails every test. All of them get ``budget_s`` (the reward
    worker's `reward.timeout_s`): a test not done by then fails, so slow code scores what it solved, never more."""
    statements = [line for line in tests.splitlines() if line.strip()] if isinstance(tests, str) else list(tests)
    if not statements or not all(isinstance(test, str) for test in statements):
        raise ValueError("code_tests: the row's `tests` field holds no test (a list of Python statements)")
    code = program_of(completion)
    mode, deadline = Isolation(isolation), time.monotonic() + budget_s
    passed = 0
    for test in statements:
        if time.monotonic() < deadline:
            passed += passes(code, test, timeout_per_test_s, mode, memory_mb, deadline)
    return passed / len(statements)


def run_python(code: str, timeout_s: float, isolation: Isolation, memory_mb: int = MEMORY_MB) -> str:
    """What `code` prints (its traceback if it raises), at most `OUTPUT_LIMIT` characters, run jailed within
    `timeout_s`: the `python` tool."""
    with Jailed(RUNNER, [limits_json(timeout_s, memory_mb, tool=True)], isolation, output=True) as jailed:
        if not _started(jailed):
            raise RuntimeError(f"a jailed interpreter did not come up within {START_TIMEOUT_S:g}s")
        deadline = time.monotonic() + timeout_s
        if jailed.send(json.dumps({"code": code}).encode() + b"\n", deadline):
            jailed.process.stdin.close()
        output = jailed.read_output(OUTPUT_LIMIT, deadline)
        if len(output) >= OUTPUT_LIMIT:
            return output + "\n[output cut]"  # leaving the block kills it
        if jailed.finish(deadline) is None:
            return output + f"\n[stopped: ran past {timeout_s:g}s]"
    return output

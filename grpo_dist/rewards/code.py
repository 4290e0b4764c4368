"""Running the model's code against tests (`code_tests`) and as a tool (`python`), each run jailed
(`grpo_dist.sandbox.jail`), judged here, in the trusted process that started it.

`code_tests` runs every test in a fresh jailed process of its own: the process comes up and says so; the
completion's code is sent and run; the process says it ran; only then is the test sent. Once the code ran it owns
that interpreter (it can patch `exec` or `json.loads`, stand in for `sys.stdin`, return an object equal to
everything), so the verdict is reached here, on plain data the process sends back:
  - a Python test split by `grpo_dist.rewards.verdicts` (asserts of `<expression> <compare> <expected>` or
    `<expression>`, also inside a HumanEval-style `def check(candidate)`, the row's `entry_point` the candidate):
    the jail evaluates the holes, the code's own calls (`add(1, 2)`), and writes each value as tagged JSON; this
    side reads it strictly (exact types: a subclass of `int` with its own `__eq__` is not plain) and evaluates the
    expected side and the comparison itself. The expected value never enters the process, so a forged reply is a
    value some function could have returned for that call (why it gains nothing: `verdicts`'s docstring);
  - a stdin/stdout case (`{"input": ..., "output": ...}` in `tests`): the code runs as a program with the input
    on its standard input; what it prints (at most twice the expected output and 1 MiB) is compared here, line by
    line, words separated by any blanks, trailing blank lines ignored; it must exit 0;
  - a test that cannot be split (a loop, a helper, an expected value its setup computes, statements other than
    asserts) runs in the code's process, as the only way to run it: it is sent with a nonce drawn for it and passes
    when the process writes that nonce back after running the test, then exits 0, writing nothing else. Code that
    exits early or writes everywhere finds no verdict to forge, but code that hooks the interpreter can pass it.
    Such tests are counted in `code_tests/in_process` (said once on the console); `strict: true` (a kwarg of the
    reward) refuses them: `ValueError` before anything runs, the completion unscored, the row named for fixing.
One test's failure (or a crash, a limit, a time-out) fails that test only.
"""

from __future__ import annotations

import json
import math
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from grpo_dist.rewards import counters
from grpo_dist.rewards.verdicts import ENCODING, NotPlain, Split, decode, judge, split_test
from grpo_dist.sandbox.jail import Isolation, Jailed, Limits

CODE_BLOCK = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)
START_TIMEOUT_S = 30.0  # a jailed interpreter coming up on a loaded machine
MEMORY_MB = 1024  # address space of each run
OUTPUT_LIMIT = 4096  # characters of a `python` tool call's output the model reads
OUTPUT_BYTES = 1 << 20  # what a stdin/stdout test's program may print beyond twice the expected output
VALUE_LIMIT = 1 << 20  # bytes of one hole's value sent back
IN_PROCESS = "code_tests/in_process"  # the counter of tests judged in the code's own process

RUNNER = (
    r"""
import ctypes, json, os, resource, sys
ctypes.CDLL(None).prctl(4, 0)  # PR_SET_DUMPABLE 0: no process of its user reads or writes its memory
status, limits = int(sys.argv[1]), json.loads(sys.argv[2])
for kind, value in [(resource.RLIMIT_AS, limits["memory_mb"] << 20), (resource.RLIMIT_CPU, limits["cpu_s"]),
                    (resource.RLIMIT_FSIZE, limits["file_mb"] << 20), (resource.RLIMIT_NOFILE, limits["open_files"]),
                    (resource.RLIMIT_CORE, 0)] + ([] if limits["processes"] else [(resource.RLIMIT_NPROC, 0)]):
    resource.setrlimit(kind, (value, value))
def say(data):
    while data:
        data = data[os.write(status, data):]
def take(size):
    data = b""
    while len(data) < size:
        data += os.read(0, size - len(data)) or os._exit(1)
    return data
"""
    + ENCODING
    + r"""
os.write(status, b"up\n")
namespace, mode = {"__name__": "__main__"}, limits["mode"]
if mode == "program":  # its size, then the code, read unbuffered: what follows is the program's standard input
    header = b""
    while not header.endswith(b"\n"):
        header += take(1)
    code = take(int(header)).decode()
    os.dup2(os.open(os.devnull, os.O_WRONLY), 2)  # its standard output alone is judged
else:
    code = json.loads(sys.stdin.buffer.readline())["code"]
try:
    exec(compile(code, "<completion>", "exec"), namespace)
except BaseException as error:
    if mode == "tool":
        import traceback
        traceback.print_exception(error, file=sys.stdout)
        sys.stdout.flush()
    if mode != "program" or type(error) is not SystemExit or error.code not in (None, 0):
        os._exit(1)
if mode != "test":
    sys.stdout.flush()
    os._exit(0)
os.write(status, b"ran\n")
request = json.loads(sys.stdin.buffer.readline())
sys.settrace(None)
sys.setprofile(None)
try:
    if "holes" in request:
        exec(compile(request["setup"], "<setup>", "exec"), namespace)
        for hole in request["holes"]:
            say(json.dumps(plain(eval(compile(hole, "<hole>", "eval"), namespace))).encode() + b"\n")
        os._exit(0)
    exec(compile(request["test"], "<test>", "exec"), namespace)
except BaseException:
    os._exit(1)
os.write(status, request["nonce"].encode() + b"\n")
os._exit(0)
"""
)


def program_of(completion: str) -> str:
    """The code of a completion: its last fenced Python block, or the whole completion."""
    blocks = CODE_BLOCK.findall(completion)
    return blocks[-1] if blocks else completion


def limits_json(timeout_s: float, memory_mb: int, mode: str) -> str:
    """The runner's limits and `mode`: `test` (the code, then a test), `tool` (the `python` tool), `program` (the
    code as a program reading standard input)."""
    limits = Limits(memory_mb=memory_mb, cpu_s=math.ceil(2 * timeout_s) + 1)
    return json.dumps({**asdict(limits), "mode": mode})


def _started(jailed: Jailed) -> bool:
    """Whether the jailed interpreter came up (said so) within `START_TIMEOUT_S`."""
    return jailed.read_until(b"up\n", time.monotonic() + START_TIMEOUT_S)


@dataclass(frozen=True)
class Bounds:
    """How a test's jailed process runs: each phase (the code, then the test) within `timeout_s` of wall-clock
    time, none past `deadline`."""

    timeout_s: float
    isolation: Isolation
    memory_mb: int = MEMORY_MB
    deadline: float = math.inf

    def phase(self) -> float:
        """The end of a phase starting now."""
        return min(time.monotonic() + self.timeout_s, self.deadline)


def _in_jail(judged: Callable[[Jailed], bool], mode: str, bounds: Bounds) -> bool:
    """`judged` of a fresh jailed process in `mode`, once it is up. Raises `RuntimeError` only where no jail comes
    up, twice (the machine, not the code): a sibling's code may kill a jail before it is up (`kill(-1)` as nobody)."""
    limits = limits_json(bounds.timeout_s, bounds.memory_mb, mode)
    for _ in range(2):
        with Jailed(RUNNER, [limits], bounds.isolation, output=mode == "program") as jailed:
            if _started(jailed):
                return judged(jailed)
    raise RuntimeError(f"a jailed interpreter did not come up within {START_TIMEOUT_S:g}s, twice")


def _asked(jailed: Jailed, code: str, request: dict[str, Any], bounds: Bounds) -> float | None:
    """The end of the test's phase, once `code` ran (the process said so) and it took `request`; None where either
    failed within its phase."""
    phase = bounds.phase()
    if not jailed.send(json.dumps({"code": code}).encode() + b"\n", phase) or not jailed.read_until(b"ran\n", phase):
        return None
    phase = bounds.phase()
    return phase if jailed.send(json.dumps(request).encode() + b"\n", phase) else None


def passes(code: str, test: str, bounds: Bounds) -> bool:
    """Whether `test` passes after `code` ran, judged in the code's own process (the nonce protocol of the module
    docstring)."""
    nonce = secrets.token_hex(16)

    def judged(jailed: Jailed) -> bool:
        phase = _asked(jailed, code, {"test": test, "nonce": nonce}, bounds)
        return phase is not None and jailed.read_until(nonce.encode() + b"\n", phase) and jailed.finish(phase) == 0

    return _in_jail(judged, "test", bounds)


def holds(code: str, split: Split, bounds: Bounds) -> bool:
    """Whether `split`'s conditions hold, judged here on the values of its holes the code's process sent back after
    `code` ran (`grpo_dist.rewards.verdicts`)."""

    def judged(jailed: Jailed) -> bool:
        phase = _asked(jailed, code, {"setup": split.setup, "holes": split.holes}, bounds)
        values = _values(jailed, len(split.holes), phase) if phase is not None else None
        if values is None or jailed.finish(phase) != 0:
            return False
        return all(judge(condition, values) for condition in split.conditions)

    return _in_jail(judged, "test", bounds)


def _values(jailed: Jailed, count: int, phase: float) -> list[Any] | None:
    """The `count` values the process sent back, one a line, read strictly (`verdicts.decode`); None at the first
    that is missing, too long or not plain data."""
    values = []
    for _ in range(count):
        line = jailed.read_line(VALUE_LIMIT, phase)
        if line is None:
            return None
        try:
            values.append(decode(line))
        except NotPlain:
            return None
    return values


def prints(code: str, case: Case, bounds: Bounds) -> bool:
    """Whether `code`, run as a program with `case.input` on its standard input, prints `case.output` (compared
    here, `same_output`) and exits 0 within its phase."""

    def judged(jailed: Jailed) -> bool:
        phase, source = bounds.phase(), code.encode()
        limit = OUTPUT_BYTES + 2 * len(case.output.encode())
        printed = jailed.read_output(limit, phase, b"%d\n" % len(source) + source + case.input.encode())
        return len(printed) < limit and jailed.finish(phase) == 0 and same_output(printed, case.output)

    return _in_jail(judged, "program", bounds)


def same_output(printed: bytes, expected: str) -> bool:
    """Whether a program's output is the expected one as competitive-programming judges read it: line by line, each
    line's words separated by any run of blanks, blank lines at the end ignored."""

    def lines(text: str) -> list[list[str]]:
        words = [line.split() for line in text.splitlines()]
        while words and not words[-1]:
            words.pop()
        return words

    return lines(printed.decode(errors="replace")) == lines(expected)


@dataclass(frozen=True)
class Case:
    """A stdin/stdout test: the program reads `input` and must print `output`."""

    input: str
    output: str


def read_tests(tests: Any) -> list[str | Case]:
    """The row's `tests`: Python tests (a list of strings, or one string with a test a line; a test of several lines,
    such as a `def check(candidate)`, is one string of a list) and stdin/stdout cases (dicts of `input` and `output`
    strings), in one list. `ValueError` saying what is wrong where it holds none."""
    listed = [line for line in tests.splitlines() if line.strip()] if isinstance(tests, str) else list(tests)
    read: list[str | Case] = []
    for number, test in enumerate(listed):
        case = isinstance(test, dict) and set(test) == {"input", "output"}
        if case and all(isinstance(value, str) for value in test.values()):
            read.append(Case(test["input"], test["output"]))
        elif isinstance(test, str):
            read.append(test)
        else:
            raise ValueError(
                f"code_tests: test {number} of the row's `tests` field is a {type(test).__name__}: give Python tests "
                'as strings, stdin/stdout cases as {"input": ..., "output": ...} of strings'
            )
    if not read:
        raise ValueError("code_tests: the row's `tests` field holds no test (a list of Python statements)")
    return read


def code_tests(
    prompt: str,
    completion: str,
    tests: Any,
    entry_point: str | None = None,
    strict: bool = False,
    timeout_per_test_s: float = 2.0,
    isolation: str = "require",
    memory_mb: int = MEMORY_MB,
    budget_s: float = math.inf,
    **_: Any,
) -> float:
    """The fraction of ``tests`` (a row field, `read_tests`) the completion's code passes: its last fenced Python
    block, or the whole completion. Each test runs in a jailed process of its own (`grpo_dist.sandbox.jail`), the code
    and then the test each given ``timeout_per_test_s``; code that fails to run fails every test. All of them get
    ``budget_s`` (the reward worker's `reward.timeout_s`): a test not done by then fails, so slow code scores what it
    solved, never more.

    A Python test is judged here where `verdicts.split_test` splits it (``entry_point``, a row field: the function
    a HumanEval-style `check(candidate)` checks); one it cannot split runs in the code's own process, counted in
    `code_tests/in_process`, or with ``strict`` (a config kwarg) is refused: `ValueError`, before anything runs,
    naming the test and why (the completion is unscored, the row needs fixing)."""
    read = read_tests(tests)
    if entry_point is not None and not isinstance(entry_point, str):
        raise ValueError(f"code_tests: the row's `entry_point` is a {type(entry_point).__name__}, not a function name")
    code, mode, deadline = program_of(completion), Isolation(isolation), time.monotonic() + budget_s
    plans = [test if isinstance(test, Case) else split_test(test, entry_point) for test in read]
    unsplit = [(number, plan) for number, plan in enumerate(plans) if isinstance(plan, str)]
    if strict and unsplit:
        number, why = unsplit[0]
        raise ValueError(f"code_tests (strict): test {number} cannot be judged outside the code's process: {why}")
    counters.count(IN_PROCESS, len(unsplit))
    passed = 0
    for test, plan in zip(read, plans, strict=True):
        if time.monotonic() >= deadline:
            break
        bounds = Bounds(timeout_per_test_s, mode, memory_mb, deadline)
        if isinstance(plan, Case):
            passed += prints(code, plan, bounds)
        elif isinstance(plan, Split):
            passed += holds(code, plan, bounds)
        else:
            passed += passes(code, in_process(test, entry_point), bounds)
    return passed / len(read)


def in_process(test: str, entry_point: str | None) -> str:
    """`test` as run in the code's process: a `check(candidate)` is called on the entry point."""
    checks = entry_point and re.search(r"^def check\(", test, re.MULTILINE)
    return f"{test}\ncheck({entry_point})\n" if checks else test


def run_python(code: str, timeout_s: float, isolation: Isolation, memory_mb: int = MEMORY_MB) -> str:
    """What `code` prints (its traceback if it raises), at most `OUTPUT_LIMIT` characters, run jailed within
    `timeout_s`: the `python` tool."""
    with Jailed(RUNNER, [limits_json(timeout_s, memory_mb, "tool")], isolation, output=True) as jailed:
        if not _started(jailed):
            raise RuntimeError(f"a jailed interpreter did not come up within {START_TIMEOUT_S:g}s")
        deadline = time.monotonic() + timeout_s
        feed = json.dumps({"code": code}).encode() + b"\n"
        printed = jailed.read_output(OUTPUT_LIMIT, deadline, feed)
        output = printed.decode(errors="replace")
        if len(printed) >= OUTPUT_LIMIT:
            return output + "\n[output cut]"  # leaving the block kills it
        if jailed.finish(deadline) is None:
            return output + f"\n[stopped: ran past {timeout_s:g}s]"
    return output

"""What isolating the model's code costs: `code_tests` on one completion and its tests, each test in a jail of its own
(bubblewrap namespaces, `reward.isolation: require`), side by side with the same jail refused (`best_effort`: a
plain process per test) in one run, and the ratio. Also the `python` tool's call.

    .venv/bin/python benchmarks/code_tests.py [--tests 5] [--repeats 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from grpo_dist.rewards.code import code_tests, run_python
from grpo_dist.sandbox import jail
from grpo_dist.sandbox.jail import Isolation

SOLVED = "```python\ndef add(a, b):\n    return a + b\n```"


def per_call_s(tests: list[str], isolation: str, repeats: int) -> float:
    """Median seconds of one `code_tests` call over `repeats` calls (one warm-up first)."""
    code_tests("", SOLVED, tests, isolation=isolation)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        assert code_tests("", SOLVED, tests, isolation=isolation) == 1.0
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def tool_call_s(isolation: Isolation, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        assert run_python("print(6 * 7)", 10.0, isolation).strip() == "42"
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def refused() -> None:
    """Make this process see a machine that refuses bubblewrap (a `bwrap` that fails first on PATH)."""
    fake = Path(tempfile.mkdtemp()) / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: refused (benchmark)' >&2\nexit 1\n")
    fake.chmod(0o755)
    os.environ["PATH"] = f"{fake.parent}{os.pathsep}{os.environ['PATH']}"
    jail.status.cache_clear()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tests", type=int, default=5, help="tests per completion")
    parser.add_argument("--repeats", type=int, default=20, help="calls timed per setting (the median is printed)")
    args = parser.parse_args()
    tests = [f"assert add({n}, 1) == {n + 1}" for n in range(args.tests)]
    if not jail.status().namespaces:
        raise SystemExit(f"no namespaces here: {jail.status().why_not}")
    jailed, jailed_tool = per_call_s(tests, "require", args.repeats), tool_call_s(Isolation.REQUIRE, args.repeats)
    refused()
    plain, plain_tool = per_call_s(tests, "best_effort", args.repeats), tool_call_s(Isolation.BEST_EFFORT, args.repeats)
    print(f"code_tests, {args.tests} tests, median of {args.repeats} calls")
    print(f"{'':24}{'per call':>10}{'per test':>10}")
    print(f"{'namespaces (require)':24}{jailed * 1e3:>8.0f}ms{jailed / args.tests * 1e3:>8.0f}ms")
    print(f"{'plain process':24}{plain * 1e3:>8.0f}ms{plain / args.tests * 1e3:>8.0f}ms")
    print(f"namespaces / plain: {jailed / plain:.2f}")
    print(f"python tool call: namespaces {jailed_tool * 1e3:.0f}ms, plain {plain_tool * 1e3:.0f}ms, "
          f"ratio {jailed_tool / plain_tool:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()

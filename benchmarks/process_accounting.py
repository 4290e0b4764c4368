"""Every process's CPU time while a command runs, from the kernel's process accounting, and a test suite's CPU by test.

`benchmarks/suite_time.py --accounting` uses it. The kernel writes one record per process as it ends (`acct(2)`,
root only): its pid, its parent's pid at its end, its start, its wall and CPU time, and its name (the name of its last
thread, 15 characters). Unlike `/proc` readings (`cpu_by_process.py`), no process is missed, however short.

A process's CPU goes to the test its pytest worker was running when it started, found through its parents (each
parent being the process with its parent's pid alive at its start); the workers' pids are the lines
`suite_durations.py` writes. A process that lives through most of the suite (the worker's own Ray cluster, its warm
process) is counted apart, as is one whose parent ended before it and so cannot be traced to a worker.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import struct
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK")
RECORD = 64  # struct acct_v3 (linux/acct.h)
LONG_LIVED_S = 400.0  # a process living this long serves many tests: its CPU is not any one test's


@dataclass(frozen=True)
class Process:
    index: int
    pid: int
    ppid: int
    name: str
    start: float  # seconds since the epoch (the kernel keeps whole seconds)
    end: float
    cpu_s: float


@contextlib.contextmanager
def recording(path: Path) -> Iterator[None]:
    """Within the block, the kernel writes a record for each process that ends to `path`."""
    path.write_bytes(b"")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.acct(str(path).encode()) != 0:
        raise SystemExit(f"process accounting refused ({os.strerror(ctypes.get_errno())}): it needs root")
    try:
        yield
    finally:
        libc.acct(None)


def _comp_t(value: int) -> int:
    """The kernel's 16-bit float: a 13-bit mantissa and a 3-bit base-8 exponent."""
    return (value & 0x1FFF) << (((value >> 13) & 0x7) * 3)


def read(path: Path) -> list[Process]:
    data = path.read_bytes()
    found = []
    for offset in range(0, len(data) - RECORD + 1, RECORD):
        pid, ppid, began = struct.unpack_from("<III", data, offset + 16)
        (elapsed,) = struct.unpack_from("<f", data, offset + 28)
        user, system = struct.unpack_from("<HH", data, offset + 32)
        name = data[offset + 48 : offset + 64].split(b"\0")[0].decode(errors="replace")
        cpu = (_comp_t(user) + _comp_t(system)) / TICKS
        found.append(Process(len(found), pid, ppid, name, began, began + elapsed / TICKS, cpu))
    return found


def by_test(processes: list[Process], phases: list[dict], workers: dict[str, int]) -> dict:
    """Each test's CPU seconds (its processes' names and seconds), from `phases` (`suite_durations.py`'s lines: test,
    worker, seconds, end) and `workers` (worker name, or "serial", to its pid)."""
    running = defaultdict(list)  # worker -> (start, end, test)
    for phase in phases:
        running[phase["worker"] or "serial"].append((phase["ended"] - phase["seconds"], phase["ended"], phase["test"]))
    of_pid = defaultdict(list)
    for process in processes:
        of_pid[process.pid].append(process)
    worker_of = {}  # a worker's own record -> its name
    for name, pid in workers.items():
        records = sorted(of_pid.get(pid, []), key=lambda process: process.start - process.end)
        if records:
            worker_of[records[0].index] = name

    def parent(process: Process) -> Process | None:
        alive = [other for other in of_pid.get(process.ppid, []) if other.start <= process.start + 1 <= other.end + 2]
        return max(alive, key=lambda other: other.start, default=None)

    def test_at(worker: str, second: float) -> str:
        """The test running on `worker` in the whole `second` a process started in (the kernel keeps no fraction)."""
        for slack in (0.0, 0.5):
            for start, end, test in running[worker]:
                if start - slack <= second + 0.5 <= end + slack:
                    return test
        return ""

    traced: dict[int, str | None] = dict(worker_of)  # a process's index -> the worker it descends from (None: none)

    def worker_above(process: Process) -> str | None:
        chain, node = [], process
        while node is not None and node.index not in traced and len(chain) < 64:
            chain.append(node.index)
            node = parent(node)
        found = traced.get(node.index) if node is not None else None
        traced.update(dict.fromkeys(chain, found))  # each ancestor walked once for every process below it
        return found

    tests, names = Counter(), defaultdict(Counter)
    totals = Counter()
    for process in processes:
        worker = worker_above(process)
        if worker is None:
            totals["outside the workers (a parent ended first)"] += process.cpu_s
        elif process.index in worker_of:
            totals["the pytest workers' own processes (the tests, and the runs in their process)"] += process.cpu_s
        elif process.end - process.start > LONG_LIVED_S:
            totals["the workers' long-lived processes (their Ray clusters, warm processes)"] += process.cpu_s
        elif test := test_at(worker, process.start):
            tests[test] += process.cpu_s
            names[test][process.name] += process.cpu_s
        else:
            totals["started between two tests"] += process.cpu_s
    return {"all_s": sum(process.cpu_s for process in processes), "count": len(processes), "tests": tests,
            "names": names, "totals": totals}  # fmt: skip


def print_by_test(found: dict, top: int) -> None:
    tests = found["tests"]
    print(f"  CPU by test (process accounting): {found['all_s']:.0f} s in {found['count']} processes, "
          f"{sum(tests.values()):.0f} s of them started by a test's processes")  # fmt: skip
    for what, seconds in found["totals"].most_common():
        print(f"  {seconds:8.1f} s  {what}")
    modules = Counter()
    for test, seconds in tests.items():
        modules[test.split("::")[0]] += seconds
    print("  by module:")
    for module, seconds in modules.most_common(top):
        print(f"  {seconds:8.1f} s  {module}")
    print("  by test (the names of its costliest processes' last threads):")
    for test, seconds in tests.most_common(top):
        largest = ", ".join(f"{name} {cpu:.0f}" for name, cpu in found["names"][test].most_common(3))
        print(f"  {seconds:8.1f} s  {test}  ({largest})")

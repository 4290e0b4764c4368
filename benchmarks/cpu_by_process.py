"""Where a machine's CPU time goes while a command runs, by kind of process (a run's roles, Ray's daemons, the tests'
own processes), and how much of the machine's time was left idle.

    .venv/bin/python benchmarks/cpu_by_process.py [--every 2] [--top 25] -- COMMAND...

Runs COMMAND (e.g. `make test`) and, beside it, reads every process's CPU time from /proc every `--every` seconds:
each process's time since the last reading goes to the kind its title names then (`kind`: an actor's title says its
role and, while it starts, `.__init__`). A process that starts and ends between two readings is not seen; the
machine's own counters (/proc/stat) give the whole, so the table ends with what no seen process accounts for.
`benchmarks/suite_time.py --cpu` prints the same table for a suite.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK")
KINDS = (  # (what the command line holds, the kind), the first that matches
    ("ray::IDLE", "Ray worker, before it takes a task"),
    ("ray::DashboardAgent", "Ray dashboard agent"),
    ("ray::RuntimeEnvAgent", "Ray runtime-env agent"),
    ("ray-dashboard-", "Ray dashboard"),
    ("ray/dashboard/", "Ray dashboard"),
    ("log_monitor.py", "Ray log monitor"),
    ("autoscaler/_private/monitor.py", "Ray autoscaler monitor"),
    ("gcs_server", "Ray GCS"),
    ("raylet", "Ray raylet"),
    ("multiprocessing.forkserver", "Ray dashboard"),
    ("EngineCore", "vLLM engine core"),
    ("grpo_dist.cluster.warm", "warm process (actors fork from it)"),
    ("warm_launch.py", "Ray worker, before it takes a task"),
    ("bwrap", "sandbox (jails, reward workers' servers)"),
    ("sandbox.BOOT", "sandbox (jails, reward workers' servers)"),
    ("sandbox_child", "sandbox (jails, reward workers' servers)"),
    ("cli_batch.py", "grpo-dist commands (new interpreters)"),
    ("grpo_dist", "grpo-dist commands (new interpreters)"),
    ("grpo-dist", "grpo-dist commands (new interpreters)"),
    ("execnet", "pytest workers (tests, in-process runs' drivers)"),
    ("exec(eval(", "pytest workers (tests, in-process runs' drivers)"),
    ("pytest", "pytest"),
    ("deepspeed", "DeepSpeed"),
    ("wandb", "W&B"),
)


def kind(command: str, name: str) -> str:
    """The kind of a process whose command line (or title) is `command` and whose kernel name is `name`: the first
    of `KINDS` it holds, else the actor its Ray title names (`ray::Role.method`)."""
    for needle, found in KINDS:
        if needle in command or needle in name:
            return found
    if command.startswith("ray::"):
        actor, _, method = command.split()[0].removeprefix("ray::").partition(".")
        return f"actor {actor}" + (", starting" if method == "__init__" else "")
    return f"other: {name}"


def machine_ticks() -> tuple[int, int]:
    """The machine's busy and idle ticks so far, every CPU together (/proc/stat's first line)."""
    fields = [int(value) for value in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return sum(fields[:8]) - idle, idle


class Sampler:
    """Reads every process's CPU time every `every` seconds on a thread of its own, from `start` until `stop`."""

    def __init__(self, every: float) -> None:
        self.every, self.by_kind, self.system = every, Counter(), Counter()
        self._last: dict[tuple[str, str], tuple[int, int]] = {}
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> None:
        self._machine = machine_ticks()
        self._read(first=True)
        self._thread.start()

    def stop(self) -> dict:
        """Stops reading; returns the table: seconds by kind (user and system), the machine's busy and idle seconds."""
        self._done.set()
        self._thread.join()
        self._read(first=False)
        (busy, idle), (busy0, idle0) = machine_ticks(), self._machine
        return {
            "machine_busy_s": round((busy - busy0) / TICKS, 1),
            "machine_idle_s": round((idle - idle0) / TICKS, 1),
            "by_kind": [
                (round(seconds, 1), round(self.system[name], 1), name) for name, seconds in self.by_kind.most_common()
            ],
        }

    def _loop(self) -> None:
        while not self._done.wait(self.every):
            self._read(first=False)

    def _read(self, first: bool) -> None:
        now = {}
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
                command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue  # ended while read
            name, fields = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()
            user, system, started = int(fields[11]), int(fields[12]), fields[19]
            key = (pid, started)  # a pid used again is another process
            now[key] = (user, system)
            if first:
                continue
            was_user, was_system = self._last.get(key, (0, 0))  # new since the last reading: all its time is since
            if (user - was_user) or (system - was_system):
                found = kind(command.strip(), name)
                self.by_kind[found] += (user - was_user + system - was_system) / TICKS
                self.system[found] += (system - was_system) / TICKS
        self._last = now


def print_table(table: dict, top: int) -> None:
    """The table `Sampler.stop` gave, its `top` kinds first, then what no seen process accounts for."""
    busy, idle = table["machine_busy_s"], table["machine_idle_s"]
    seen = sum(seconds for seconds, _, _ in table["by_kind"])
    share = 100 * idle / max(busy + idle, 1e-9)
    print(f"  CPU by process kind: the machine busy {busy:.0f} s, idle {idle:.0f} s ({share:.0f} % idle); "
          "seconds (of them in the kernel), share of busy:")  # fmt: skip
    for seconds, system, name in table["by_kind"][:top]:
        print(f"  {seconds:8.1f} s ({system:6.1f})  {100 * seconds / max(busy, 1e-9):5.1f} %  {name}")
    rest = sum(seconds for seconds, _, _ in table["by_kind"][top:])
    print(f"  {rest:8.1f} s           {100 * rest / max(busy, 1e-9):5.1f} %  the other kinds")
    print(f"  {busy - seen:8.1f} s           {100 * (busy - seen) / max(busy, 1e-9):5.1f} %  "
          "not seen (processes between two readings, the kernel's own threads)")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--every", type=float, default=2.0, help="seconds between two readings of /proc")
    parser.add_argument("--top", type=int, default=25, help="how many kinds to print")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command to run, after --")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    sampler = Sampler(args.every)
    sampler.start()
    started = time.monotonic()
    code = subprocess.run(command).returncode
    table = sampler.stop()
    wall = round(time.monotonic() - started, 1)
    figures = {key: table[key] for key in ("machine_busy_s", "machine_idle_s")}
    print(json.dumps({"command": command, "exit": code, "wall_s": wall, **figures}))
    print_table(table, args.top)
    sys.exit(code)


if __name__ == "__main__":
    main()

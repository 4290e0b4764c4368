"""How long the test suite takes, and how it compares with another checkout side by side.

    .venv/bin/python benchmarks/suite_time.py [--target test|test-fast] [--baseline DIR] [--slowest 25] [--cpu]
        [--accounting]

Runs `make TARGET` (the README's test commands) in this checkout and, with `--baseline DIR` (another checkout, e.g.
`git worktree add /tmp/base <commit>`), in that one first, one after the other on the same machine, both with this
checkout's environment (`VENV`, its install taken as done: `make -o`) and each with its own code first on the path.
Prints, per checkout, the whole command's wall time, each of its two phases' (the serial tests, then those run by
two workers, from pytest's own summary lines), whether it passed, its slowest tests (pytest's `--durations`), and
where the time went by module: the sum of each module's tests' durations, setup and teardown included
(`benchmarks/suite_durations.py`, a pytest plugin; two workers on two cores: the modules' sum is about twice the
workers' phase's wall time); with `--cpu`, where the machine's CPU time went by kind of process and how much was left
idle (`benchmarks/cpu_by_process.py`); with `--accounting` (root), the CPU time of every process of the suite by the
test it was started for (`benchmarks/process_accounting.py`); then the ratios (under 1: faster here). A suite is an
hour of both cores: run it on an otherwise idle machine; CI never runs it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import process_accounting
from cpu_by_process import Sampler, print_table

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
VENV = Path(sys.executable).parent.parent
SUMMARY = re.compile(r"^=+ (?P<counts>.*?) in (?P<seconds>[\d.]+)s")  # pytest's last line: "== 5 passed in 1.2s =="
WORKERS = re.compile(r"^created: \d+/\d+ workers")  # pytest-xdist's line at a phase's start: the workers' phase
DURATION = re.compile(r"^(?P<seconds>[\d.]+)s (?:call|setup|teardown) +(?P<test>\S+)")


def run_suite(repo: Path, target: str, log: Path, cpu: bool = False, accounting: bool = False) -> dict:
    """`make TARGET` in `repo`: its wall time, its phases' times and counts, and its exit code; output to `log`;
    with `cpu`, the machine's CPU time by kind of process while it ran (`cpu_by_process.Sampler`); with
    `accounting`, every process's CPU time by the test it was started for (`process_accounting`)."""
    phase_log = log.with_suffix(".durations.jsonl")  # every test phase's seconds (suite_durations.py)
    phase_log.unlink(missing_ok=True)
    addopts = " ".join(filter(None, [os.environ.get("PYTEST_ADDOPTS"), "-p suite_durations"]))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), str(HERE)]), "PYTEST_ADDOPTS": addopts,
           "GRPO_DIST_SUITE_DURATIONS": str(phase_log)}  # fmt: skip
    command = ["make", "-C", str(repo), "-o", f"{VENV}/.installed", target, f"VENV={VENV}"]
    sampler = Sampler(every=2.0) if cpu else None
    if sampler is not None:
        sampler.start()
    started = time.monotonic()
    records = log.with_suffix(".acct")
    with log.open("w") as out, process_accounting.recording(records) if accounting else contextlib.nullcontext():
        code = subprocess.run(command, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
    wall = time.monotonic() - started
    table = sampler.stop() if sampler is not None else None
    text = log.read_text().splitlines()
    phases, workers = {}, False  # by name, whatever the order the Makefile runs them in
    for line in text:
        workers = workers or bool(WORKERS.match(line))
        if match := SUMMARY.match(line):
            phases["workers" if workers else "serial"] = {"seconds": float(match["seconds"]), "counts": match["counts"]}
            workers = False
    durations = sorted(((float(m["seconds"]), m["test"]) for line in text if (m := DURATION.match(line))), reverse=True)
    lines = [json.loads(line) for line in phase_log.read_text().splitlines()] if phase_log.exists() else []
    tests = [line for line in lines if "test" in line]  # the rest: each pytest process's pid
    return {
        "wall_s": round(wall, 1),
        "phases": phases,
        "exit": code,
        "slowest": durations,
        "modules": by_module(tests),
        "failed": failed(tests),
        "cpu": table,
        "by_test": by_test(records, lines) if accounting else None,
    }


def by_test(records: Path, lines: list[dict]) -> dict:
    """The suite's processes' CPU by test (`process_accounting.by_test`), its workers named by the pid `lines` of
    `suite_durations.py`."""
    workers = {line["worker"]: line["pid"] for line in lines if "pid" in line and line["worker"] != "controller"}
    phases = [line for line in lines if "test" in line]
    return process_accounting.by_test(process_accounting.read(records), phases, workers)


def by_module(phases: list[dict]) -> list[tuple[float, str]]:
    """The sum of each test module's phases' seconds (`suite_durations.py`'s lines), largest first."""
    modules: dict[str, float] = {}
    for phase in phases:
        module = phase["test"].split("::")[0]
        modules[module] = modules.get(module, 0.0) + phase["seconds"]
    return sorted(((round(seconds, 1), module) for module, seconds in modules.items()), reverse=True)


def failed(phases: list[dict]) -> list[str]:
    """The tests with a phase that failed (an error in setup or teardown counts), in the order seen."""
    return list(dict.fromkeys(phase["test"] for phase in phases if phase.get("outcome") == "failed"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", choices=["test", "test-fast"], default="test")
    parser.add_argument("--baseline", type=Path, help="another checkout of the repository, run first")
    parser.add_argument("--slowest", type=int, default=25, help="how many of the slowest tests to print")
    parser.add_argument("--modules", type=int, default=15, help="how many of the costliest modules to print")
    parser.add_argument("--logs", type=Path, default=Path("/tmp"), help="where each run's output is kept")
    parser.add_argument("--cpu", action="store_true", help="where the CPU time went, by kind of process")
    parser.add_argument(
        "--accounting", action="store_true", help="every process's CPU time, by the test it was started for (root)"
    )
    args = parser.parse_args()
    args.logs.mkdir(parents=True, exist_ok=True)
    checkouts = {"baseline": args.baseline.resolve()} if args.baseline else {}
    checkouts["this"] = REPO
    found = {}
    for name, repo in checkouts.items():
        found[name] = run_suite(repo, args.target, args.logs / f"suite-{name}.log", args.cpu, args.accounting)
        figures = {key: value for key, value in found[name].items()
                   if key not in ("slowest", "modules", "cpu", "by_test")}  # fmt: skip
        print(json.dumps({"checkout": name, "repo": str(repo), "target": args.target, **figures}), flush=True)
        for seconds, test in found[name]["slowest"][: args.slowest]:
            print(f"  {seconds:8.1f} s  {test}")
        modules = found[name]["modules"]
        print(f"  by module ({sum(seconds for seconds, _ in modules):.0f} s in all):")
        for seconds, module in modules[: args.modules]:
            print(f"  {seconds:8.1f} s  {module}")
        if found[name]["cpu"] is not None:
            print_table(found[name]["cpu"], args.modules)
        if found[name]["by_test"] is not None:
            process_accounting.print_by_test(found[name]["by_test"], args.slowest)
    if args.baseline:
        base, this = found["baseline"], found["this"]
        ratios = {"wall": round(this["wall_s"] / base["wall_s"], 3)}
        for name in [name for name in ("serial", "workers") if name in base["phases"] and name in this["phases"]]:
            ratios[f"{name} phase"] = round(this["phases"][name]["seconds"] / base["phases"][name]["seconds"], 3)
        print(json.dumps({"row": "ratios", "this_over_baseline": ratios}))


if __name__ == "__main__":
    main()

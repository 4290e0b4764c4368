"""What a small run costs the machine, and which of its processes spends it: where `make test`'s time goes.

    .venv/bin/python benchmarks/run_cost.py [--steps 1 6] [--interval 0.2] [--repeat 1] [--baseline DIR]

Runs `grpo-dist train` on the tests' small config (`tests/conftest.py`'s `small_config`: a tiny model, one learner
rank, one generator, two reward workers, 4 prompts x 4 completions a step, an evaluation before and after) once per
`--steps` value, one after another, each starting its own local Ray cluster. While each runs, every process on the
machine is sampled every `--interval` seconds; a process's CPU seconds (user + system) since the run began are
summed by role (the first a process's command line shows): the driver, the generator actor, its vLLM engine core,
the learner, the reward workers, their sandboxes, Ray's own processes, and compilers the run starts. Processes
that end between two samples lose their last interval; `other` is the rest of the machine in the meantime.

Prints one JSON line per run: wall seconds, CPU seconds machine-wide (from /proc/stat) and by role; then a
`ratios` line: each run's CPU seconds over the first run's. With `--baseline DIR` (another checkout of the repository,
e.g. `git worktree add /tmp/base <commit>`), each repeat runs the baseline's code and then this one's, with the same
interpreter and packages, and a last line gives the medians here over the baseline's, machine-wide and by role (under
1: cheaper here). Run it on an otherwise idle machine; CI never runs it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import psutil
import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from conftest import small_config  # noqa: E402

ROLES = [  # (role, what its command line starts with or holds), first match wins
    ("generator", "ray::Generator"), ("engine core", "VLLM::EngineCore"), ("learner", "ray::Learner"),
    ("reward workers", "ray::RewardWorker"), ("sandboxes", "grpo_dist.sandbox_child"), ("driver", "grpo_dist train"),
    ("driver", "grpo-dist train"),  # one forked warm (grpo_dist.cluster.warm_driver), titled as the command
    ("ray", "ray::"), ("ray", "/ray/"), ("compilers", "cc1plus"), ("compilers", "g++"),
]  # fmt: skip


def role(command: str) -> str:
    return next((name for name, mark in ROLES if command.startswith(mark) or mark in command), "other")


def busy_seconds() -> float:
    """CPU seconds the machine has spent on anything but idling, since boot."""
    fields = [int(value) for value in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / psutil.os.sysconf("SC_CLK_TCK")


def cpu_by_process() -> dict[tuple[int, float], tuple[str, float]]:
    seen = {}
    for process in psutil.process_iter(["pid", "create_time", "cmdline", "cpu_times"]):
        info = process.info
        if info["cpu_times"] is not None:
            command = " ".join(info["cmdline"] or [])
            seen[info["pid"], info["create_time"]] = (command, info["cpu_times"].user + info["cpu_times"].system)
    return seen


def sample(roles_of: dict) -> dict[tuple[int, float], tuple[str, float]]:
    """Every process's command line and CPU seconds now (`cpu_by_process`), each process's role noted in `roles_of`.
    Ray's workers start idle (`ray::IDLE`) and an exiting process's command line reads empty: a process keeps the
    most specific role it showed."""
    now = cpu_by_process()
    for key, (command, _) in now.items():
        if roles_of.get(key, "other") in ("other", "ray") and role(command) != "other":
            roles_of[key] = role(command)
    return now


def measure(config: Path, steps: int, interval: float, repo: Path = REPO) -> dict:
    """One run of `steps` steps with the code of the checkout `repo`, first on the path of it and its actors."""
    before, busy, started = cpu_by_process(), busy_seconds(), time.monotonic()
    command = [sys.executable, "-m", "grpo_dist", "train", str(config), f"run.steps={steps}", f"run.name=s{steps}"]
    env = {**psutil.os.environ, "PYTHONPATH": psutil.os.pathsep.join([str(repo), str(repo / "tests")])}
    run = subprocess.Popen(command, cwd=repo, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    last, roles_of = dict(before), {}
    while run.poll() is None:
        last.update(sample(roles_of))
        time.sleep(interval)
    err = run.stderr.read()
    if run.returncode != 0:
        raise SystemExit(f"the run of {steps} steps failed:\n{err[-3000:]}")
    roles = Counter()
    for key, (_, seconds) in last.items():
        roles[roles_of.get(key, "other")] += seconds - before.get(key, ("", 0.0))[1]
    return {
        "steps": steps, "wall_s": round(time.monotonic() - started, 1),
        "cpu_s": round(busy_seconds() - busy, 1), "by_role": {name: round(s, 1) for name, s in roles.most_common()},
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, nargs="+", default=[1, 6])
    parser.add_argument("--interval", type=float, default=0.2)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--baseline", type=Path, help="another checkout of the repository, run side by side")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="run-cost-"))
    config = work / "run.yaml"
    config.write_text(yaml.safe_dump(small_config(work)))
    checkouts = ([("baseline", args.baseline.resolve())] if args.baseline else []) + [("this", REPO)]
    rows = []
    for repeat in range(args.repeat):
        for name, repo in checkouts:
            for steps in args.steps:
                rows.append({"checkout": name, "repeat": repeat, **measure(config, steps, args.interval, repo)})
                print(json.dumps(rows[-1]), flush=True)
    this = [row for row in rows if row["checkout"] == "this" and row["repeat"] == 0]
    ratios = {f"steps_{row['steps']}": round(row["cpu_s"] / this[0]["cpu_s"], 3) for row in this}
    print(json.dumps({"row": "ratios", "cpu_s_over_first": ratios}))
    if args.baseline:
        print(json.dumps({"row": "this over baseline, medians", **over_baseline(rows, args.steps)}))


def over_baseline(rows: list[dict], steps: list[int]) -> dict:
    """For each step count: this checkout's median wall and CPU seconds (machine-wide and by role) over the
    baseline's."""
    out = {}
    for count in steps:
        medians = {}
        for name in ("baseline", "this"):
            figures = [{"wall_s": row["wall_s"], "cpu_s": row["cpu_s"], **row["by_role"]}
                       for row in rows if row["checkout"] == name and row["steps"] == count]  # fmt: skip
            keys = {key for figure in figures for key in figure}
            medians[name] = {key: statistics.median(figure.get(key, 0.0) for figure in figures) for key in keys}
        base, this = medians["baseline"], medians["this"]
        out[f"steps_{count}"] = {key: round(this.get(key, 0.0) / base[key], 3) for key in sorted(base) if base[key] > 0}
    return out


if __name__ == "__main__":
    main()

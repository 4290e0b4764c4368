"""How long a run takes to start, where the time goes, and how it compares with another checkout side by side.

    .venv/bin/python benchmarks/startup.py [--config CONFIG] [--repeat 3] [--baseline DIR] [--up] [--shared-warm]
        [key=value ...]

Runs `grpo-dist train CONFIG run.steps=2` `--repeat` times, each starting its own local Ray cluster, and reads the
time from the command to each line the run prints on the way: its first `==` line (the driver has imported and
checked the config), `== starting ...` (the inputs are prepared: the data, the tokenizer, the model), `== started in`
(every actor is up and the weight transport connected), `== training` (the evaluation before step 1 done) and the
line of step 1. Meanwhile every process on the machine is sampled every 0.2 s, and the CPU seconds each spends
until step 1's line are summed by role (`benchmarks/run_cost.py`'s roles: the driver, the generator actor, its
vLLM engine core, the learner, the reward workers, Ray's own processes); `busy_from_to_s` says when each role was
first and last seen working (a process that used CPU since the sample before), the start-up's timeline.

With `--baseline DIR` (another checkout of the repository, e.g. `git worktree add /tmp/base <commit>`), each
repeat runs the baseline's code and then this one's, on the same machine, with the same interpreter and packages;
the last line gives each figure's median here over the baseline's (under 1: faster here).

Overrides apply to every run: with `ray.address=auto` after `ray start --head`, the runs join that cluster instead
of starting their own (what a run pays for Ray). With `--up`, each repeat also runs this checkout on a cluster
`grpo-dist up` started before the first run (its own start not counted; stopped at the end): the series `this-up`,
whose ratios are over `this`; with `--baseline` too, the baseline's code also runs on a cluster its own `grpo-dist up`
started (`baseline-up`), and `this-up`'s ratios are over that. With `--shared-warm`, each repeat also runs this
checkout on a cluster of its own with a warm process started before the first run named in
`GRPO_DIST_WARM_PROCESS` (its own start not counted: a script of runs pays for it once): the series
`this-shared-warm`, its driver and its actors forked from that process. Prints one JSON line per run, then a
`median` line per series and a `ratios` line for each series but the first. Run it on an otherwise idle machine; CI
never runs it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

from run_cost import cpu_by_process, sample  # noqa: E402

from grpo_dist.cluster.warm import SHARED_ENV, ready, start_in_new_dir, stop_and_remove  # noqa: E402

MARKS = [  # (figure, what the line starts with), in the order a run prints them
    ("first_line_s", "== "),
    ("inputs_ready_s", "== starting"),
    ("started_s", "== started in"),
    ("eval_done_s", "== training"),
    ("first_step_s", "step 1/"),
]


def run_once(repo: Path, config: str, out_dir: Path, overrides: list[str], interval: float = 0.2,
             temp: str | None = None, extra_env: dict[str, str] | None = None) -> dict:  # fmt: skip
    """One `grpo-dist train` of 2 steps from `repo`'s code (with `temp` its temporary directory, where it finds a
    cluster `grpo-dist up` started; `extra_env` added to its environment): when each mark's line came, and the CPU
    seconds by role until step 1's line."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), str(repo / "tests")]), "PYTHONUNBUFFERED": "1"}
    env.update({"TMPDIR": temp} if temp else {})
    env.update(extra_env or {})
    command = [
        sys.executable, "-m", "grpo_dist", "train", config, "run.steps=2", "run.name=startup",
        f"run.output_dir={out_dir}", "wandb.enabled=false", "checkpoint.every_steps=0", *overrides,
    ]  # fmt: skip
    before, seen, roles_of = cpu_by_process(), {}, {}
    started = time.monotonic()
    run = subprocess.Popen(command, cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    found: dict[str, float] = {}
    output: list[str] = []
    at_first_step = threading.Event()

    def read() -> None:
        for line in run.stdout:
            output.append(line)
            for figure, mark in MARKS:
                if figure not in found and line.lstrip("\r").startswith(mark):
                    found[figure] = round(time.monotonic() - started, 2)
                    if figure == "first_step_s":
                        at_first_step.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    timeline: dict[str, list[float]] = {}  # role -> [first seen, last seen busy], seconds since the command
    while run.poll() is None and not at_first_step.is_set():
        now = round(time.monotonic() - started, 1)
        for key, (line, seconds) in sample(roles_of).items():
            earlier = seen.get(key, before.get(key, ("", None)))[1]
            seen[key] = (line, seconds)
            if earlier is None or seconds - earlier > 0.02 * interval / 0.2:
                span = timeline.setdefault(roles_of.get(key, "other"), [now, now])
                span[1] = now
        time.sleep(interval)
    code = run.wait(timeout=600)
    reader.join(timeout=10)
    if code != 0 or "first_step_s" not in found:
        raise SystemExit(f"the run from {repo} failed (exit {code}):\n{''.join(output)[-3000:]}")
    by_role = Counter()
    for key, (_, seconds) in seen.items():
        by_role[roles_of.get(key, "other")] += seconds - before.get(key, ("", 0.0))[1]
    cpu = {name: round(seconds, 1) for name, seconds in by_role.most_common() if seconds >= 0.05}
    busy = {name: span for name, span in sorted(timeline.items(), key=lambda item: item[1]) if name != "other"}
    return {**found, "cpu_s_to_first_step": round(sum(cpu.values()) - cpu.get("other", 0.0), 1), "cpu_by_role": cpu,
            "busy_from_to_s": busy}  # fmt: skip


def medians(rows: list[dict]) -> dict[str, float]:
    keys = [figure for figure, _ in MARKS] + ["cpu_s_to_first_step"]
    return {key: round(statistics.median(row[key] for row in rows if key in row), 2) for key in keys}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/quickstart.yaml")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--baseline", type=Path, help="another checkout of the repository, run side by side")
    parser.add_argument(
        "--up", action="store_true", help="also run this checkout on a cluster `grpo-dist up` started (series this-up)"
    )
    parser.add_argument(
        "--up-cold",
        action="store_true",
        help="also run this checkout on a cluster `grpo-dist up --cold` started (series this-up-cold: each actor's"
        " process imports the stack itself)",
    )
    parser.add_argument(
        "--shared-warm",
        action="store_true",
        help="also run this checkout on a cluster of its own with a warm process already up, named in "
        "GRPO_DIST_WARM_PROCESS (series this-shared-warm)",
    )
    parser.add_argument("overrides", nargs="*", help="key=value settings for every run")
    args = parser.parse_args()
    series = {"baseline": (args.baseline.resolve(), None)} if args.baseline else {}
    series["this"] = (REPO, None)
    extra_env: dict[str, dict[str, str]] = {}
    with (
        tempfile.TemporaryDirectory(prefix="startup-") as work,
        tempfile.TemporaryDirectory(prefix="su-", dir="/tmp") as up,
        tempfile.TemporaryDirectory(prefix="sc-", dir="/tmp") as up_cold,
        tempfile.TemporaryDirectory(prefix="sb-", dir="/tmp") as up_base,
        shared_warm_process() if args.shared_warm else contextlib.nullcontext() as socket,
    ):
        if socket is not None:
            series["this-shared-warm"] = (REPO, None)
            extra_env["this-shared-warm"] = {SHARED_ENV: str(socket)}
        if args.up and args.baseline:  # the baseline's code on a cluster its own `grpo-dist up` started
            series["baseline-up"] = (args.baseline.resolve(), up_base)
            grpo_dist_up(up_base, "up", repo=args.baseline.resolve())
        if args.up:  # a temporary directory of its own, where only the runs of this-up find the cluster
            series["this-up"] = (REPO, up)
            grpo_dist_up(up, "up")
        if args.up_cold:
            series["this-up-cold"] = (REPO, up_cold)
            grpo_dist_up(up_cold, "up", "--cold")
        rows: dict[str, list[dict]] = {name: [] for name in series}
        try:
            for attempt in range(args.repeat):
                for name, (repo, temp) in series.items():
                    row = run_once(repo, args.config, Path(work) / f"{name}-{attempt}", args.overrides, temp=temp,
                                   extra_env=extra_env.get(name))  # fmt: skip
                    rows[name].append(row)
                    print(json.dumps({"checkout": name, "repeat": attempt, **row}), flush=True)
        finally:
            if args.up:
                grpo_dist_up(up, "down")
            if args.up and args.baseline:
                grpo_dist_up(up_base, "down", repo=args.baseline.resolve())
            if args.up_cold:
                grpo_dist_up(up_cold, "down")
    summary = {name: medians(found) for name, found in rows.items()}
    for name, figures in summary.items():
        print(json.dumps({"row": "median", "checkout": name, **figures}))
    first = "baseline" if args.baseline else "this"
    for name in series:
        if name in (first, "baseline-up"):
            continue
        base_name = "baseline-up" if name == "this-up" and args.baseline else first  # each on a cluster of `up`
        base, this = summary[base_name], summary[name]
        ratios = {key: round(this[key] / base[key], 3) for key in this if base.get(key)}
        print(json.dumps({"row": "ratios", f"{name}_over_{base_name}": ratios}))
    if args.up and args.up_cold:  # what the warm processes take off a run on `grpo-dist up`
        base, this = summary["this-up-cold"], summary["this-up"]
        ratios = {key: round(this[key] / base[key], 3) for key in this if base.get(key)}
        print(json.dumps({"row": "ratios", "this-up_over_this-up-cold": ratios}))


@contextlib.contextmanager
def shared_warm_process() -> Iterator[Path]:
    """A warm process of this checkout's code (`warm.start_in_new_dir`), once it has imported the stack, as one a
    script of runs started first would be: its socket; killed at the end."""
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    socket, process = start_in_new_dir("grpo-dist-startup-")
    try:
        deadline = time.monotonic() + 300
        while not ready(socket, timeout_s=10):
            if process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(
                    f"the warm process at {socket} did not answer:\n{(socket.parent / 'warm.log').read_text()}"
                )
            time.sleep(0.2)
        yield socket
    finally:
        stop_and_remove(socket, process)


def grpo_dist_up(temp: str, command: str, *flags: str, repo: Path = REPO) -> None:
    """`grpo-dist up` or `down` of `repo`'s code with `temp` as the temporary directory (where the cluster's record
    lives); `up` waits for its warm process to have imported the stack, as a cluster kept up between runs has."""
    env = {**os.environ, "TMPDIR": temp, "PYTHONPATH": str(repo)}
    done = subprocess.run([sys.executable, "-m", "grpo_dist", command, *flags], env=env, capture_output=True, text=True,
                          cwd=repo)  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"grpo-dist {command} failed:\n{done.stdout}{done.stderr}")
    warm_socket = Path(temp) / f"grpo-dist-up-{os.getuid()}" / "ray" / "warm.sock"
    if command == "up" and "--cold" not in flags and not ready(warm_socket, timeout_s=300):
        raise SystemExit(f"the warm process of `grpo-dist up` did not answer at {warm_socket} within 300 s")


if __name__ == "__main__":
    main()

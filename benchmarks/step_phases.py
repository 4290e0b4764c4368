"""Where a step's time goes, and how it compares with another checkout side by side.

    .venv/bin/python benchmarks/step_phases.py [--config CONFIG] [--steps 40] [--repeat 2] [--baseline DIR] [--cpu]
        [k=v ...]

Runs `grpo-dist train CONFIG run.steps=STEPS` `--repeat` times (no evaluation between steps, no checkpoint, no W&B)
and reads each step's phases from its metrics: `time/generate` (sampling the step's groups), `time/reward` (the
scoring left when generation ends), `time/train` (the learner's update), `time/sync` (the weights to the engines)
and `time/step` (the whole step, the driver's own work included: `other` is what the four leave). The first 5 steps
(the engines' and the learner's first calls) are left out; each figure is the median over the other steps and the
repeats.

With `--cpu`, what a step costs the machine too: every process is read when the run has logged its warm-up steps and
again when it logs its last, and their CPU seconds in between, over the steps between, are summed by role
(`benchmarks/run_cost.py`'s roles: the driver, the generator, its engine core, the learner, the reward workers, their
sandboxes, Ray's own processes) and machine-wide (`cpu_per_step`: from /proc/stat, the rest of the machine's work
included). A step cannot take less wall time than its CPU seconds over the machine's cores.

With `--baseline DIR` (another checkout of the repository, e.g. `git worktree add /tmp/base <commit>`), each repeat
runs the baseline's code and then this one's, with the same interpreter and packages; the last line gives each
figure here over the baseline's (under 1: faster here). Prints one JSON line per run, a `median` line per checkout
and a `ratios` line. Run it on an otherwise idle machine; CI never runs it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from run_cost import busy_seconds, sample

REPO = Path(__file__).resolve().parent.parent
PHASES = ["generate", "reward", "train", "sync", "step"]
WARM_UP = 5  # steps left out: the first calls of the engines and of the learner


def run_once(repo: Path, config: str, steps: int, out_dir: Path, overrides: list[str], cpu: bool = False) -> dict:
    """One run of `steps` steps from `repo`'s code: each phase's seconds at each step after the warm-up; with `cpu`,
    `cpu_per_step` too (`cpu_per_step`)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), str(repo / "tests")])}
    command = [
        sys.executable, "-m", "grpo_dist", "train", config, f"run.steps={steps}", "run.name=phases",
        f"run.output_dir={out_dir}", "wandb.enabled=false", "checkpoint.every_steps=0", "eval.every=0", *overrides,
    ]  # fmt: skip
    metrics = out_dir / "phases" / "metrics.jsonl"
    code, said, per_step = run_measured(command, repo, env, metrics, steps if cpu else None)
    if code != 0:
        raise SystemExit(f"the run from {repo} failed (exit {code}):\n{said[-3000:]}")
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    found = {phase: [row.get(f"time/{phase}", 0.0) for row in rows[WARM_UP:]] for phase in PHASES}
    return {**found, "cpu_per_step": per_step} if per_step is not None else found


def run_measured(
    command: list[str], cwd: Path, env: dict | None, metrics: Path, steps: int | None
) -> tuple[int, str, dict[str, float] | None]:
    """Run `command` (a `grpo-dist train` of `steps` steps writing `metrics`) to its end: its exit code, its output
    (standard output and error) and, with `steps`, its `cpu_per_step`."""
    with tempfile.TemporaryFile("w+") as output:
        run = subprocess.Popen(command, cwd=cwd, env=env, stdout=output, stderr=subprocess.STDOUT, text=True)
        try:
            per_step = cpu_per_step(run, metrics, steps) if steps is not None else None
            code = run.wait(timeout=3600)
        finally:
            run.kill()
        output.seek(0)
        return code, output.read(), per_step


def cpu_per_step(run: subprocess.Popen, metrics: Path, steps: int, interval: float = 0.5) -> dict[str, float] | None:
    """CPU seconds a step, machine-wide and by role, from the run's logging its `WARM_UP`th step to its logging the
    one before its last (so that no work after training counts): every process read at both ends, and every
    `interval` in between for the roles of processes that start and end meanwhile (this process's reading them
    counts in `other`). None if the run ended before. A metrics file older than the call is an earlier run's."""
    started = time.time()

    def logged() -> int:
        try:
            return len(metrics.read_text().splitlines()) if metrics.stat().st_mtime >= started else 0
        except FileNotFoundError:
            return 0

    roles_of: dict = {}
    while logged() < WARM_UP:
        if run.poll() is not None:
            return None
        time.sleep(0.05)
    before, busy, first = sample(roles_of), busy_seconds(), logged()
    last, due = dict(before), time.monotonic() + interval
    while (now := logged()) < steps - 1:
        if run.poll() is not None:
            return None
        if time.monotonic() >= due:
            last.update(sample(roles_of))
            due += interval
        time.sleep(0.05)
    last.update(sample(roles_of))
    count, roles = now - first, Counter()
    if count <= 0:
        return None
    for key, (_, seconds) in last.items():
        roles[roles_of.get(key, "other")] += seconds - before.get(key, ("", 0.0))[1]
    return {"machine": round((busy_seconds() - busy) / count, 3),
            **{name: round(seconds / count, 3) for name, seconds in roles.most_common() if seconds > 0}}  # fmt: skip


def medians(runs: list[dict]) -> dict[str, float]:
    found = {phase: round(statistics.median(s for run in runs for s in run[phase]), 3) for phase in PHASES}
    found["other"] = round(found["step"] - sum(found[phase] for phase in PHASES if phase != "step"), 3)
    costs = [run["cpu_per_step"] for run in runs if run.get("cpu_per_step")]
    for role in dict.fromkeys(role for cost in costs for role in cost):
        found[f"cpu/{role}"] = round(statistics.median(cost.get(role, 0.0) for cost in costs), 3)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/quickstart.yaml")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--baseline", type=Path, help="another checkout of the repository, run side by side")
    parser.add_argument("--cpu", action="store_true", help="the CPU seconds a step costs, machine-wide and by role")
    parser.add_argument("overrides", nargs="*", help="key=value settings for every run")
    args = parser.parse_args()
    if args.steps <= WARM_UP:
        parser.error(f"--steps must be more than the {WARM_UP} warm-up steps left out")
    if args.cpu and args.steps < WARM_UP + 3:
        parser.error(f"--cpu needs --steps of at least {WARM_UP + 3}: it reads the steps between warm-up and last")
    checkouts = {"baseline": args.baseline.resolve()} if args.baseline else {}
    checkouts["this"] = REPO
    runs: dict[str, list[dict]] = {name: [] for name in checkouts}
    with tempfile.TemporaryDirectory(prefix="phases-") as work:
        for attempt in range(args.repeat):
            for name, repo in checkouts.items():
                out = Path(work) / f"{name}-{attempt}"
                run = run_once(repo, args.config, args.steps, out, args.overrides, args.cpu)
                runs[name].append(run)
                print(json.dumps({"checkout": name, "repeat": attempt, **medians([run])}), flush=True)
    summary = {name: medians(found) for name, found in runs.items()}
    for name, figures in summary.items():
        print(json.dumps({"row": "median", "checkout": name, "seconds": figures}))
    if args.baseline:
        base, this = summary["baseline"], summary["this"]
        ratios = {key: round(this[key] / base[key], 3) for key in this if base.get(key, 0) > 0}
        print(json.dumps({"row": "ratios", "this_over_baseline": ratios}))


if __name__ == "__main__":
    main()

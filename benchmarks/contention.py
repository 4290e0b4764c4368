"""How a run's steps fare when other work shares the machine, and how that compares with another checkout.

    .venv/bin/python benchmarks/contention.py [--busy 1 | --beside 1] [--steps 60] [--repeat 1] [--baseline DIR]
        [key=value ...]

Runs the quick start (`grpo-dist train configs/quickstart.yaml`, no evaluation, no checkpoint, no W&B) for `--steps`
steps with `--busy` processes spinning on the CPU beside it at the ordinary priority (`--busy 0`: alone), as a
laptop's other programs do, or with `--beside` other quick starts of the same checkout training beside it, as a test
suite's other workers do (every run given `GRPO_DIST_CPU_SHARE` = the runs side by side, as the suite gives its
runs; a checkout older than the variable ignores it). Between its 10th and `--steps - 10`th logged step it reads
the wall seconds a step takes, the CPU seconds the machine and each of the run's roles spend a step (every process
sampled every 0.2 s, `benchmarks/run_cost.py`'s roles), and the median of the steps' own `time/step`. With
`--baseline DIR` (another checkout, e.g. `git worktree add /tmp/base <commit>`) each repeat runs the baseline's code
first, then this one's; the last line gives this checkout's figures over the baseline's. Run it on an otherwise
idle machine; CI never runs it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

from run_cost import busy_seconds, sample  # noqa: E402

SPIN = "while True: pass"


def quick_start(repo: Path, steps: int, out_dir: Path, overrides: list[str], share: int, **pipes) -> subprocess.Popen:
    """`grpo-dist train configs/quickstart.yaml` of `repo`'s code for `steps` steps into `out_dir`."""
    env = {key: value for key, value in os.environ.items() if key != "RAY_worker_niceness"}  # each checkout's own
    env.update(PYTHONPATH=str(repo), GRPO_DIST_CPU_SHARE=str(share))
    command = [
        sys.executable, "-m", "grpo_dist", "train", "configs/quickstart.yaml", f"run.steps={steps}", "run.name=busy",
        f"run.output_dir={out_dir}", "wandb.enabled=false", "checkpoint.every_steps=0", "eval.every=0", "eval.sets=[]",
        *overrides,
    ]  # fmt: skip
    return subprocess.Popen(command, cwd=repo, env=env, text=True, **pipes)


def run_once(repo: Path, steps: int, busy: int, beside: int, out_dir: Path, overrides: list[str]) -> dict:
    """One quick start of `steps` steps from `repo`'s code beside `busy` spinning processes and `beside` other quick
    starts (each of which trains for longer, and is stopped when the measured one ends): its figures per step
    between the 10th step and the `steps - 10`th."""
    first, last = 10, steps - 10
    spinners = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(busy)]
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    others = [
        quick_start(
            repo, 3 * steps, out_dir.with_name(f"{out_dir.name}-beside-{index}"), overrides, beside + 1, **quiet
        )
        for index in range(beside)
    ]
    try:
        run = quick_start(
            repo, steps, out_dir, overrides, beside + 1, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        metrics, roles_of, marks = out_dir / "busy" / "metrics.jsonl", {}, {}
        while run.poll() is None:
            logged = len(metrics.read_text().splitlines()) if metrics.exists() else 0
            now = sample(roles_of)
            for mark in (first, last):
                if logged >= mark and mark not in marks:
                    marks[mark] = (time.monotonic(), busy_seconds(), now)
            time.sleep(0.2)
        if run.returncode != 0 or last not in marks:
            raise SystemExit(f"the run from {repo} failed (exit {run.returncode}):\n{run.stderr.read()[-3000:]}")
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
        for other in others:  # stopped as Ctrl-C stops a run: its Ray cluster and actors go with it
            other.send_signal(signal.SIGINT)
        for other in others:
            try:
                other.wait(timeout=120)
            except subprocess.TimeoutExpired:
                other.kill()
                other.wait()
    (start, machine_start, before), (end, machine_end, after) = marks[first], marks[last]
    by_role = Counter()
    for key, (_, seconds) in after.items():
        if roles_of.get(key, "other") != "other":  # the spinners and the rest of the machine are not the run's (with
            # --beside the other quick starts' processes count in the roles and the run's CPU seconds too)
            by_role[roles_of[key]] += seconds - before.get(key, ("", 0.0))[1]
    count = last - first
    rows = [json.loads(line) for line in metrics.read_text().splitlines()][first:last]
    return {
        "wall_s_per_step": round((end - start) / count, 3),
        "machine_cpu_s_per_step": round((machine_end - machine_start) / count, 3),
        "run_cpu_s_per_step": round(sum(by_role.values()) / count, 3),
        "time_step_median_s": round(statistics.median(row["time/step"] for row in rows), 3),
        "cpu_s_per_step_by_role": {name: round(seconds / count, 3) for name, seconds in by_role.most_common()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--busy", type=int, help="spinning processes beside the run (default 1, 0 with --beside)")
    parser.add_argument("--beside", type=int, default=0, help="other quick starts training beside the run")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--baseline", type=Path, help="another checkout of the repository, run side by side")
    parser.add_argument("overrides", nargs="*", help="key=value settings for every run")
    args = parser.parse_args()
    args.busy = (0 if args.beside else 1) if args.busy is None else args.busy
    if args.steps < 30:
        parser.error("--steps must be at least 30 (steps 10 to steps - 10 are measured)")
    checkouts = {"baseline": args.baseline.resolve()} if args.baseline else {}
    checkouts["this"] = REPO
    found: dict[str, list[dict]] = {name: [] for name in checkouts}
    with tempfile.TemporaryDirectory(prefix="contention-") as work:
        for attempt in range(args.repeat):
            for name, repo in checkouts.items():
                row = run_once(
                    repo, args.steps, args.busy, args.beside, Path(work) / f"{name}-{attempt}", args.overrides
                )
                found[name].append(row)
                print(
                    json.dumps({"checkout": name, "repeat": attempt, "busy": args.busy, "beside": args.beside, **row}),
                    flush=True,
                )
    keys = ["wall_s_per_step", "machine_cpu_s_per_step", "run_cpu_s_per_step", "time_step_median_s"]
    summary = {name: {key: statistics.median(row[key] for row in rows) for key in keys} for name, rows in found.items()}
    for name, figures in summary.items():
        print(json.dumps({"row": "median", "checkout": name, "busy": args.busy, "beside": args.beside, **figures}))
    if args.baseline:
        base, this = summary["baseline"], summary["this"]
        print(json.dumps({"row": "ratios", "this_over_baseline": {k: round(this[k] / base[k], 3) for k in keys}}))


if __name__ == "__main__":
    main()

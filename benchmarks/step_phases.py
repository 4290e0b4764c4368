"""Where a step's time goes, and how it compares with another checkout side by side.

    .venv/bin/python benchmarks/step_phases.py [--config CONFIG] [--steps 40] [--repeat 2] [--baseline DIR] [k=v ...]

Runs `grpo-dist train CONFIG run.steps=STEPS` `--repeat` times (no evaluation between steps, no checkpoint, no W&B)
and reads each step's phases from its metrics: `time/generate` (sampling the step's groups), `time/reward` (the
scoring left when generation ends), `time/train` (the learner's update), `time/sync` (the weights to the engines)
and `time/step` (the whole step, the driver's own work included: `other` is what the four leave). The first 5 steps
(the engines' and the learner's first calls) are left out; each figure is the median over the other steps and the
repeats.

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
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PHASES = ["generate", "reward", "train", "sync", "step"]
WARM_UP = 5  # steps left out: the first calls of the engines and of the learner


def run_once(repo: Path, config: str, steps: int, out_dir: Path, overrides: list[str]) -> dict[str, list[float]]:
    """One run of `steps` steps from `repo`'s code: each phase's seconds at each step after the warm-up."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), str(repo / "tests")])}
    command = [
        sys.executable, "-m", "grpo_dist", "train", config, f"run.steps={steps}", "run.name=phases",
        f"run.output_dir={out_dir}", "wandb.enabled=false", "checkpoint.every_steps=0", "eval.every=0", *overrides,
    ]  # fmt: skip
    done = subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"the run from {repo} failed (exit {done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}")
    rows = [json.loads(line) for line in (out_dir / "phases" / "metrics.jsonl").read_text().splitlines()]
    return {phase: [row.get(f"time/{phase}", 0.0) for row in rows[WARM_UP:]] for phase in PHASES}


def medians(runs: list[dict[str, list[float]]]) -> dict[str, float]:
    found = {phase: round(statistics.median(s for run in runs for s in run[phase]), 3) for phase in PHASES}
    found["other"] = round(found["step"] - sum(found[phase] for phase in PHASES if phase != "step"), 3)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/quickstart.yaml")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--baseline", type=Path, help="another checkout of the repository, run side by side")
    parser.add_argument("overrides", nargs="*", help="key=value settings for every run")
    args = parser.parse_args()
    if args.steps <= WARM_UP:
        parser.error(f"--steps must be more than the {WARM_UP} warm-up steps left out")
    checkouts = {"baseline": args.baseline.resolve()} if args.baseline else {}
    checkouts["this"] = REPO
    runs: dict[str, list[dict]] = {name: [] for name in checkouts}
    with tempfile.TemporaryDirectory(prefix="phases-") as work:
        for attempt in range(args.repeat):
            for name, repo in checkouts.items():
                run = run_once(repo, args.config, args.steps, Path(work) / f"{name}-{attempt}", args.overrides)
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

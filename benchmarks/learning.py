"""Does the quick start learn at every seed? Runs `grpo-dist train` on a config at several seeds, one after another.

    .venv/bin/python benchmarks/learning.py [--seeds 5] [--config configs/quickstart.yaml] [key=value ...]
    .venv/bin/python benchmarks/learning.py --config configs/warmstart.yaml   # warm-up, then GRPO, per seed
    .venv/bin/python benchmarks/learning.py --seeds 3 --config configs/agent.yaml --eval-set sampled --rise 0.3
    .venv/bin/python benchmarks/learning.py --seeds 3 --config configs/agent.yaml --eval-set sampled --rise 0.3 \
        environment=null sft.answer_field=answer       # the same model, warm-up and GRPO without the tool

Each seed builds its own tiny model (the model's initialisation follows `run.seed`) and draws its own data. Prints
one JSON line per seed: the mean reward of the first and last 10 steps, their difference, held-out accuracy before
and after training (of `--eval-set`, and of every eval set under `eval_sets`), the tool-use share, turns and tool
errors of the first and last 10 steps of an agentic run, the mean step time and the wall time; then a line with the
mean, the spread (min, max, standard deviation) and how many seeds reached the targets (a gain of at least 0.3 and
a held-out accuracy of at least 0.5; after a warm-up, a rise in held-out accuracy of at least `--rise`, 0.15 by
default). Overrides after the options apply to every seed.
A config with an `sft` section is warmed up (`grpo-dist sft`) at each seed first, and its line also gives the
held-out accuracy after the warm-up (single-turn tasks: the warm-up prints it; with an environment it is the run's
evaluation before training). Run by hand; CI never runs it.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
ACCURACY = r"eval {} (before|after) training: accuracy ([0-9.]+)"  # of the eval set --eval-set
EVAL_LINE = re.compile(r"eval (\S+) (before|after) training: accuracy ([0-9.]+)")
AGENT_KEYS = ("reward/tool_use", "agent/turns", "agent/tool_error_fraction")  # first and last 10 steps, when logged
WARM_UP_ACCURACY = re.compile(r"held-out accuracy after warm-up: ([0-9.]+)")
GAIN_TARGET, ACCURACY_TARGET = 0.3, 0.5
HELD_OUT_GAIN_TARGET = 0.15  # warm start: GRPO's rise in held-out accuracy over the warmed-up model


def run_seed(config: str, seed: int, out_dir: Path, overrides: list[str], eval_set: str = "held_out") -> dict:
    settings = [
        f"run.seed={seed}", f"run.name=seed-{seed}", f"run.output_dir={out_dir}",
        f"model.path={out_dir / f'model-{seed}'}", "wandb.enabled=false", "checkpoint.every_steps=0", *overrides,
    ]  # fmt: skip
    started = time.monotonic()
    warm_up = {}
    if "sft" in yaml.safe_load((REPO / config).read_text()):
        settings += [f"sft.base={out_dir / f'base-{seed}'}"]
        done = grpo_dist("sft", config, settings + ["--overwrite"], seed)
        warm_up = {"held_out_after_warm_up": float(WARM_UP_ACCURACY.search(done.stdout).group(1))
                   if WARM_UP_ACCURACY.search(done.stdout) else math.nan}  # fmt: skip
    done = grpo_dist("train", config, settings, seed)
    rows = [json.loads(line) for line in (out_dir / f"seed-{seed}" / "metrics.jsonl").read_text().splitlines()]
    rewards = [row["reward/mean"] for row in rows]
    accuracy = dict(re.findall(ACCURACY.format(re.escape(eval_set)), done.stdout))
    first, last = statistics.mean(rewards[:10]), statistics.mean(rewards[-10:])
    ends = {key: [round(statistics.mean(row[key] for row in part), 3) for part in (rows[:10], rows[-10:])]
            for key in AGENT_KEYS if key in rows[0]}  # fmt: skip
    return {
        "seed": seed,
        "first10": round(first, 3),
        "last10": round(last, 3),
        "gain": round(last - first, 3),
        **warm_up,
        "held_out_before": float(accuracy.get("before", "nan")),
        "held_out_after": float(accuracy.get("after", "nan")),
        "entropy_last10": round(statistics.mean(row["entropy"] for row in rows[-10:]), 3),
        "eval_sets": {f"{name}_{when}": float(value) for name, when, value in EVAL_LINE.findall(done.stdout)},
        **{f"{key}_first10_last10": values for key, values in ends.items()},
        "step_s": round(statistics.mean(row["time/step"] for row in rows), 2),
        "wall_s": round(time.monotonic() - started, 1),
    }


def grpo_dist(command: str, config: str, settings: list[str], seed: int) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [sys.executable, "-m", "grpo_dist", command, config, *settings], cwd=REPO, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise RuntimeError(f"seed {seed}: grpo-dist {command} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return done


def summary(results: list[dict], rise: float = HELD_OUT_GAIN_TARGET) -> dict:
    gains = [result["gain"] for result in results]
    held_out = [result["held_out_after"] for result in results]
    return {
        "seeds": len(results),
        "gain_mean": round(statistics.mean(gains), 3),
        "gain_min": min(gains),
        "gain_max": max(gains),
        "gain_std": round(statistics.pstdev(gains), 3),
        "held_out_mean": round(statistics.mean(held_out), 3),
        "held_out_min": min(held_out),
        "held_out_max": max(held_out),
        "meeting_targets": sum(meets_target(result, rise) for result in results),
    }


def meets_target(result: dict, rise: float = HELD_OUT_GAIN_TARGET) -> bool:
    if "held_out_after_warm_up" in result:
        return result["held_out_after"] - result["held_out_before"] >= rise
    return result["gain"] >= GAIN_TARGET and result["held_out_after"] >= ACCURACY_TARGET


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5, help="seeds 0 .. N-1")
    parser.add_argument("--config", default="configs/quickstart.yaml")
    parser.add_argument("--out-dir", default="outputs/learning", help="where the runs and their models go")
    parser.add_argument("--eval-set", default="held_out", help="the eval set whose accuracy is compared")
    parser.add_argument("--rise", type=float, default=HELD_OUT_GAIN_TARGET,
                        help="after a warm-up: the rise in held-out accuracy a seed must reach")  # fmt: skip
    parser.add_argument("overrides", nargs="*", help="key=value settings applied to every seed")
    args = parser.parse_args()
    results = []
    for seed in range(args.seeds):
        results.append(run_seed(args.config, seed, Path(args.out_dir).resolve(), args.overrides, args.eval_set))
        print(json.dumps(results[-1]), flush=True)
    print(json.dumps({"summary": summary(results, args.rise), "config": args.config, "overrides": args.overrides}))


if __name__ == "__main__":
    main()

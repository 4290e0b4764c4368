"""On-policy distillation against GRPO alone: a random-init student, the same steps, side by side at each seed.

    .venv/bin/python benchmarks/distill.py [--seeds 0 1 2] [--steps 60] [--teacher-from sft|grpo] \
        [--teacher-steps N] [--eval-every 10] [--teacher DIR] [--out-dir outputs/distill] \
        [--plot docs/distill_curve.png]

The teacher is the quick start's tiny model trained to high accuracy, at seed 0. `--teacher-from sft` (the default):
`grpo-dist sft` of it on the task's solved rows (`--teacher-steps`, default 300, batches of 32): it answers the
digit, then the end-of-sequence token. `--teacher-from grpo`: `grpo-dist train configs/quickstart.yaml` for
`--teacher-steps` (default 200), its final policy, which learned to answer through a token decoding drops (the
beginning-of-sequence token, then the digit): a student distilled from it must learn that too. Then at each seed a
random-init student (the quick start's tiny model, initialised by the seed: the same tokenizer as the teacher's)
trains for `--steps` steps four ways, each a `grpo-dist train` process of its own with the quick start's settings
otherwise: `grpo` (the quick start as it is), `distill` (`algorithm.distill` with the teacher: the per-token
reverse-KL advantages alone, less their group's leave-one-out mean, the default `baseline: group`),
`distill+reward` (`with_rewards: true`: those added to GRPO's) and `distill, no baseline` (`baseline: none`:
coef x (teacher - student) as it is). Every arm runs the divergence guard with its defaults. Held-out accuracy
(the task's 200 held-out prompts, greedy) is evaluated before training and every `--eval-every` steps.

Prints one JSON line per run (its held-out accuracy at each evaluation, the reverse KL to the teacher at the first
and last step, the teacher's seconds per step, the mean step time), then a table for each evaluation: each arm's
held-out accuracy at each seed, its mean, and the ratio of that mean to grpo's. `--teacher` takes a teacher made
before (a model directory) instead of making one. With `--plot`, a PNG of held-out accuracy against step (each
arm's mean over the seeds, with each seed's curve faint). Run by hand; CI never runs it.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
QUICKSTART = REPO / "configs" / "quickstart.yaml"
ARMS = ("grpo", "distill", "distill+reward", "distill, no baseline")


def quickstart(out_dir: Path, name: str, seed: int, steps: int, eval_every: int) -> dict:
    """The quick start's config as a run of its own under `out_dir`: its own model (built from the seed), no W&B,
    no checkpoints, the greedy held-out set only."""
    raw = yaml.safe_load(QUICKSTART.read_text())
    raw["run"].update(name=name, output_dir=str(out_dir), steps=steps, seed=seed)
    raw["model"]["path"] = str(out_dir / f"model-{seed}")  # the tiny model of this seed, built on first use
    raw["eval"] = {"every": eval_every, "sets": [{"name": "held_out"}]}
    raw["wandb"] = {"enabled": False}
    raw["checkpoint"] = {"every_steps": 0}
    return raw


def train(raw: dict, out_dir: Path) -> Path:
    """`grpo-dist train` on `raw` in a process of its own; the run directory."""
    config = out_dir / f"{raw['run']['name']}.yaml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(yaml.safe_dump(raw))
    done = subprocess.run(
        [sys.executable, "-m", "grpo_dist", "train", str(config)], cwd=REPO, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise RuntimeError(f"{raw['run']['name']}: grpo-dist train exited {done.returncode}:\n{done.stdout[-3000:]}")
    return out_dir / raw["run"]["name"]


def make_teacher(out_dir: Path, source: str, steps: int) -> tuple[Path, float]:
    """The quick start's model at seed 0 trained to high accuracy by `source` (`sft` or `grpo`) for `steps`: the
    teacher's model directory and its held-out accuracy."""
    if source == "grpo":
        run_dir = train(quickstart(out_dir, "teacher", 0, steps, eval_every=0), out_dir)
        return run_dir / "final", read_jsonl(run_dir / "eval.jsonl")[-1]["eval/held_out/accuracy"]
    raw = quickstart(out_dir, "teacher-sft", 0, 1, eval_every=0)
    raw["model"]["path"] = str(out_dir / "teacher-sft-model")
    raw["sft"] = {"base": str(out_dir / "teacher-sft-base"), "steps": steps, "batch_size": 32, "lr": 3e-3}
    config = out_dir / "teacher-sft.yaml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(yaml.safe_dump(raw))
    command = [sys.executable, "-m", "grpo_dist", "sft", str(config), "--overwrite"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    said = re.search(r"held-out accuracy after warm-up: ([0-9.]+)", done.stdout)
    if done.returncode != 0 or said is None:
        raise RuntimeError(f"grpo-dist sft exited {done.returncode}:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return out_dir / "teacher-sft-model", float(said.group(1))


def run_arm(arm: str, seed: int, teacher: Path, args: argparse.Namespace) -> dict:
    out_dir = Path(args.out_dir).resolve()
    raw = quickstart(
        out_dir, f"{arm.replace(', ', '-').replace(' ', '-')}-seed-{seed}", seed, args.steps, args.eval_every
    )
    if arm != "grpo":
        raw["algorithm"]["distill"] = {
            "teacher": str(teacher),
            "with_rewards": arm == "distill+reward",
            "baseline": "none" if arm.endswith("no baseline") else "group",
        }
    started = time.monotonic()
    run_dir = train(raw, out_dir)
    rows, evals = read_jsonl(run_dir / "metrics.jsonl"), read_jsonl(run_dir / "eval.jsonl")
    result = {
        "arm": arm,
        "seed": seed,
        "held_out": {row["step"]: row["eval/held_out/accuracy"] for row in evals},
        "step_s": round(statistics.mean(row["time/step"] for row in rows), 2),
        "wall_s": round(time.monotonic() - started, 1),
    }
    if arm != "grpo":
        result["reverse_kl_first_last"] = [
            round(rows[0]["distill/reverse_kl"], 3),
            round(rows[-1]["distill/reverse_kl"], 3),
        ]
        result["teacher_s_per_step"] = round(statistics.mean(row["distill/teacher_seconds"] for row in rows), 3)
    return result


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def table(results: list[dict], steps: int) -> list[str]:
    """Each arm's held-out accuracy after `steps` steps per seed, its mean, and the mean's ratio to grpo's."""
    seeds = sorted({result["seed"] for result in results})
    final = {(r["arm"], r["seed"]): r["held_out"][steps] for r in results}
    means = {arm: statistics.mean(final[arm, seed] for seed in seeds) for arm in ARMS}
    lines = [f"held-out accuracy after {steps} steps (greedy, 200 prompts)"]
    lines.append(f"{'arm':22}" + "".join(f"seed {seed:<5}" for seed in seeds) + "mean    vs grpo")
    for arm in ARMS:
        cells = "".join(f"{final[arm, seed]:<10.3f}" for seed in seeds)
        ratio = f"{means[arm] / means['grpo']:.2f}x" if means["grpo"] > 0 else "-"
        lines.append(f"{arm:22}{cells}{means[arm]:<8.3f}{ratio}")
    return lines


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6.4, 3.6))
    for arm, color in zip(ARMS, ("tab:gray", "tab:blue", "tab:green", "tab:orange"), strict=True):
        runs = [r["held_out"] for r in results if r["arm"] == arm]
        steps = sorted(runs[0])
        for run in runs:
            axes.plot(steps, [run[step] for step in steps], color=color, alpha=0.25, linewidth=1)
        axes.plot(steps, [statistics.mean(run[step] for run in runs) for step in steps], color=color, label=arm)
    axes.set_xlabel("step")
    axes.set_ylabel("held-out accuracy (greedy)")
    axes.set_ylim(0, 1)
    axes.legend(loc="upper left")
    axes.set_title("random-init student: GRPO alone vs on-policy distillation (mean of seeds, each faint)")
    axes.title.set_fontsize(9)
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=60, help="training steps of each student")
    parser.add_argument("--teacher-from", choices=("sft", "grpo"), default="sft", help="how the teacher is trained")
    parser.add_argument("--teacher-steps", type=int, help="its steps (default: sft 300, grpo 200)")
    parser.add_argument("--teacher", type=Path, help="a teacher made before (a model directory): none is trained")
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--out-dir", default="outputs/distill", help="where the runs and their models go")
    parser.add_argument("--plot", type=Path, help="write the curves here (PNG)")
    args = parser.parse_args()
    out_dir = Path(args.out_dir).resolve()
    if args.teacher is None:
        steps = args.teacher_steps or {"sft": 300, "grpo": 200}[args.teacher_from]
        teacher, accuracy = make_teacher(out_dir, args.teacher_from, steps)
        print(json.dumps({"teacher": str(teacher), "from": args.teacher_from, "steps": steps, "held_out": accuracy}))
    else:
        teacher = args.teacher.resolve()
    results = []
    for seed in args.seeds:
        for arm in ARMS:
            results.append(run_arm(arm, seed, teacher, args))
            print(json.dumps(results[-1]), flush=True)
    for steps in sorted(results[0]["held_out"])[1:]:  # each evaluation after the start
        print("\n".join(table(results, steps)))
    if args.plot:
        plot(results, args.plot)
        print(f"curves written to {args.plot}")


if __name__ == "__main__":
    main()

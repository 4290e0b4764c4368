"""Does the divergence guard stay silent on healthy runs and catch every fault it exists for, named by its cause?

    .venv/bin/python benchmarks/guard.py [--only NAME ...] [--out-dir outputs/guard] [--markdown FILE] [key=value ...]

Healthy runs: every shipped CPU recipe as a user runs it, with its defaults (the guard's, the checkpoints'): the
quick start at seeds 0 to 4 (`configs/quickstart.yaml`), the warm start (`configs/warmstart.yaml`, warm-up then
GRPO), the LoRA quick start (`configs/quickstart_lora.yaml`, warm-up then GRPO), the agent demo (`configs/agent.yaml`,
warm-up then GRPO with the calculator) and on-policy distillation (the quick start's student for 60 steps with
`algorithm.distill` from a teacher warmed up by `grpo-dist sft`, as `benchmarks/distill.py` makes it). Each is
expected to print no health line and no fault. And the tests' own tiny config (`tests/conftest.py`'s
`small_config`, 80 steps at seeds 0-2): learning rate 1e-2 on a 4-token answer, it reaches its best reward in 20
steps and its entropy then swings by orders of magnitude from step to step, the reward held; it sits at a KL of 2-3
(warned: over `health.kl.max`) and at seed 1 its reward truly falls from 0.9 to 0.17 for a few steps (warned), but
nothing may roll it back or stop it.

Fault runs: the quick start at seed 0, checkpointed every 5 steps (so that a rollback has somewhere to go), each
with one cause injected at a known step (`faults.inject`, `grpo_dist.faults.inject`):
| name | cause | expected to be caught by |
| nonfinite | step 4's loss NaN | `nonfinite` (the update dropped) |
| lr_spike | step 6 trained once at 300x the learning rate | `entropy` (divergence), the step after |
| lr50 | learning rate 50 from the start | `entropy` (divergence) at step 2, then the same again: stopped |
| engine_weights | the engines keep the initial weights whenever version 4 arrives | the sync probe, then stopped |
| reward_collapse | the reward's grader breaks once step 5 is logged (its flag file removed) | `reward` |
| entropy_collapse | every step from 6 on trained at 100x the learning rate | `entropy` (divergence), then stopped |

A fault counts as caught when a check named for its cause fires within 3 steps of the step the cause first shows
in (the step after an update that wrecks the weights; the step of a broken batch or sync). Prints one JSON line per
run (its health lines and faults, how it ended, its reward gain and held-out accuracy), then a table: for each run
the checks that fired, what they did, and the verdict (`silent`, `caught ...`, or `FALSE ALARM` / `MISSED`).
`--markdown FILE` writes the table there too; `--traces FILE` writes each healthy run's per-step figures the guard
reads (`tests/guard_traces.json`, which `tests/test_health.py` replays through the guard's defaults). Overrides
after the options apply to every run. Took 93 minutes on 2 cores shared with other work; `--only quickstart-0
lr50` runs some. Run by hand; CI runs the quick start's learning test (`tests/test_learning.py`) and the traces'
replay instead.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
from distill import make_teacher  # noqa: E402  (a sibling script: the teacher as the distillation benchmark makes it)

CAUGHT_WITHIN = 3  # steps after the cause first shows
SECTIONS_OF_A_RECIPE = {"sft"}  # a config with these is warmed up first


@dataclass
class Run:
    """One run of the table: a recipe, its overrides, and for a fault, its cause and what must catch it."""

    name: str
    config: str
    overrides: list[str] = field(default_factory=list)
    cause: str = ""  # empty: a healthy run
    shows_at: int = 0  # the step the cause first shows in
    caught_by: tuple[str, ...] = ()  # the checks (or `sync.probe`) named for it
    flag_after: int = 0  # the reward's flag file is removed once this step is logged
    warns: tuple[str, ...] = ()  # checks a healthy run may warn on (figures that are truly past their bounds)


SUSTAINED = ", ".join(f"{{step: {step}, factor: 100}}" for step in range(6, 13))  # each time trained: rollbacks too
FAULT_RUN = ["run.steps=12", "checkpoint.every_steps=5", "eval.every=0", "eval.sets=[{name: held_out}]"]


def runs(out_dir: Path) -> list[Run]:
    healthy = [
        Run("warmstart", "configs/warmstart.yaml"),
        Run("lora", "configs/quickstart_lora.yaml"),
        Run("agent", "configs/agent.yaml"),
        Run("distill", "configs/quickstart.yaml", ["run.steps=60", f"algorithm.distill.teacher={out_dir / 'teacher'}"]),
    ]
    healthy += [Run(f"quickstart-{seed}", "configs/quickstart.yaml", [f"run.seed={seed}"]) for seed in range(5)]
    tiny = tests_config(out_dir)
    healthy += [Run(f"tests-small-{seed}", tiny, [f"run.seed={seed}"], warns=("kl", "reward")) for seed in range(3)]
    flag = out_dir / "reward-on"
    flag_reward = [
        "reward.sandbox=false",  # the flag file is outside what a sandbox sees
        f"reward.functions=[{{name: regex_format, weight: 0.2, kwargs: {{pattern: '[0-9]'}}}}, "
        f"{{name: math_answer, weight: 0.8}}, {{name: reward_fixtures.flag_reward, weight: 1.0, "
        f"kwargs: {{path: '{flag}'}}}}]",
    ]
    faults = [
        Run("nonfinite", "configs/quickstart.yaml", [*FAULT_RUN, "faults.inject.scale_loss=[{step: 4, factor: .nan}]"],
            "step 4's loss NaN", 4, ("nonfinite",)),
        Run("lr_spike", "configs/quickstart.yaml",
            [*FAULT_RUN, "faults.inject.scale_lr=[{step: 6, factor: 300, once: true}]"],
            "step 6 once at 300x the learning rate", 7, ("entropy",)),
        Run("lr50", "configs/quickstart.yaml", [*FAULT_RUN, "learner.lr=50"],
            "learning rate 50 from the start", 2, ("entropy",)),
        Run("engine_weights", "configs/quickstart.yaml", [*FAULT_RUN, "faults.inject.drop_weights=[{version: 4}]"],
            "the engines keep the initial weights at version 4", 4, ("sync.probe",)),
        Run("reward_collapse", "configs/quickstart.yaml", [*FAULT_RUN, *flag_reward],
            "the grader breaks after step 5", 6, ("reward",), flag_after=5),
        Run("entropy_collapse", "configs/quickstart.yaml", [*FAULT_RUN, f"faults.inject.scale_lr=[{SUSTAINED}]"],
            "every step from 6 on at 100x the learning rate", 7, ("entropy",)),
    ]  # fmt: skip
    return healthy + faults


def tests_config(out_dir: Path) -> str:
    """The tests' tiny config (`small_config`) for 80 steps, written as a recipe file under `out_dir`."""
    sys.path.insert(0, str(REPO / "tests"))
    from conftest import small_config

    path = out_dir / "tests-small.yaml"
    out_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(small_config(out_dir, run={"steps": 80})))
    return str(path)


def run_one(run: Run, out_dir: Path, overrides: list[str]) -> dict:
    """`grpo-dist train` (after `grpo-dist sft` for a recipe with a warm-up) on `run`, in processes of their own;
    what its guard and its fault handling did, and what it learned."""
    settings = [
        f"run.name={run.name}", f"run.output_dir={out_dir}", f"model.path={out_dir / 'models' / run.name}",
        "wandb.enabled=false", *run.overrides, *overrides,
    ]  # fmt: skip
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]),
    }
    started = time.monotonic()
    if SECTIONS_OF_A_RECIPE & set(yaml.safe_load((REPO / run.config).read_text())):
        settings.append(f"sft.base={out_dir / 'models' / f'{run.name}-base'}")
        warm = grpo_dist(["sft", run.config, *settings, "--overwrite"], env)
        if warm.returncode != 0:
            raise RuntimeError(f"{run.name}: grpo-dist sft exited {warm.returncode}:\n{warm.stdout[-3000:]}")
    run_dir = out_dir / run.name
    if run.flag_after:
        (out_dir / "reward-on").write_text("")
    with open(out_dir / f"{run.name}.log", "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "grpo_dist", "train", run.config, *settings],
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        while run.flag_after and process.poll() is None and last_step(run_dir) < run.flag_after:
            time.sleep(0.05)
        if run.flag_after:
            (out_dir / "reward-on").unlink()
        code = process.wait()
    return outcome(run, run_dir, code, time.monotonic() - started)


def grpo_dist(args: list[str], env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "grpo_dist", *args], cwd=REPO, env=env, capture_output=True, text=True)


def last_step(run_dir: Path) -> int:
    try:
        return max((row["step"] for row in read_jsonl(run_dir / "metrics.jsonl")), default=0)
    except (OSError, json.JSONDecodeError):
        return 0


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def outcome(run: Run, run_dir: Path, code: int, wall_s: float) -> dict:
    """What the run's files say: every health event and fault (step, text), how it ended, what it learned."""
    events = read_jsonl(run_dir / "events.jsonl")
    fired = [
        {"step": event["step"], "kind": event["kind"], "message": event["message"]}
        for event in events
        if event["kind"] in ("health", "fault")
    ]
    last = next((event for event in reversed(events) if event["kind"] == "end"), None)
    end = last["message"] if last else f"exit code {code}"
    if last and end.startswith("stopped"):  # in the step after the last it finished
        fired.append({"step": last["step"] + 1, "kind": "stop", "message": end})
    rows = read_jsonl(run_dir / "metrics.jsonl")
    evals = [row for row in read_jsonl(run_dir / "eval.jsonl") if "eval/held_out/accuracy" in row]
    result = {"run": run.name, "cause": run.cause, "exit": code, "end": end, "fired": fired}
    if rows:
        rewards = [row["reward/mean"] for row in rows]
        first, last = statistics.mean(rewards[:10]), statistics.mean(rewards[-10:])
        result.update(reward_first10=round(first, 3), reward_last10=round(last, 3), reward_gain=round(last - first, 3))
        result["steps_logged"] = rows[-1]["step"]
    if evals:
        result["held_out_after"] = evals[-1]["eval/held_out/accuracy"]
    result["verdict"] = verdict(run, fired, end)
    if not run.cause and rows:
        result["closest"] = closest(rows)
    result["wall_s"] = round(wall_s, 1)
    return result


def closest(rows: list[dict]) -> dict[str, float]:
    """How near a healthy run came to each check's default bound, its steps replayed through the guard itself: the
    largest gradient norm over its median (of norms above the clip; 1000 fires), the smallest entropy over the
    window's median (0.1 fires) and over the lowest of the last 3 steps' (0.5 fires), the largest fall of the
    entropy from either (either fires only with a fall of 0.5 nats too, and at a step that lost reward), the steps
    whose entropy alone would have fired but whose reward held (`spared`), the smallest mean reward over the
    window's median (0.25 fires), the largest KL and log-prob gap (1 fires)."""
    from grpo_dist.config import HealthConfig
    from grpo_dist.run.health import RECENT, Guard

    guard = Guard(HealthConfig(), clip=1.0)
    ratios: dict[str, list[float]] = {"grad_norm": [], "entropy": [], "entropy_recent": [], "reward": []}
    falls: list[float] = []  # the entropy's fall from either level, in nats per token
    spared = 0
    for row in rows:
        recent = guard.history["entropy"][-RECENT:]
        levels = {"grad_norm": guard.median("grad_norm"), "entropy": guard.median("entropy"),
                  "entropy_recent": min(recent) if recent else None, "reward": guard.median("reward")}  # fmt: skip
        values = {"grad_norm": row["grad_norm"] if row["grad_norm"] > guard.clip else None, "entropy": row["entropy"],
                  "entropy_recent": row["entropy"], "reward": row["reward/mean"]}  # fmt: skip
        for key, level in levels.items():
            if level and values[key] is not None:
                ratios[key].append(values[key] / level)
        falls += [level - row["entropy"] for level in (levels["entropy"], levels["entropy_recent"]) if level]
        events = guard.check(row["step"], row)
        alone = guard.check(row["step"], {key: value for key, value in row.items() if key != "reward/mean"})
        spared += any(event.check == "entropy" for event in alone) and not any(e.check == "entropy" for e in events)
        guard.record(row, events)
    found = {
        "grad_norm_x": max(ratios["grad_norm"], default=0.0),
        **{f"{key}_x": min(ratios[key], default=math.nan) for key in ("entropy", "entropy_recent", "reward")},
        "entropy_fall": max(falls, default=0.0),
        "entropy_spared": spared,
        "kl": max(row.get("kl", 0.0) for row in rows),
        "logprob_gap": max(row["logprob_gap"] for row in rows),
    }
    return {key: float(f"{value:.3g}") for key, value in found.items()}


def verdict(run: Run, fired: list[dict], end: str) -> str:
    """`silent` / `FALSE ALARM` for a healthy run; `caught ...` / `MISSED` for a fault."""
    if not run.cause:
        if end != "finished" or any(event["kind"] != "health" or not warned(event, run.warns) for event in fired):
            return "FALSE ALARM"
        return "silent" if not fired else f"silent (warned: {', '.join(run.warns)})"
    for event in fired:
        names = checks_named(event)
        if names & set(run.caught_by) and run.shows_at <= event["step"] <= run.shows_at + CAUGHT_WITHIN:
            return f"caught at step {event['step']} ({event['step'] - run.shows_at} after it shows)"
    return "MISSED"


def warned(event: dict, checks: tuple[str, ...]) -> bool:
    """Whether a health line only warns, on one of `checks`."""
    return event["message"].endswith(": a warning") and checks_named(event) <= set(checks)


def checks_named(event: dict) -> set[str]:
    """The checks an event names: `health.<check>` in a health line, `sync.probe` in a fault of the sync check."""
    message = event["message"]
    names = {part.split(")")[0] for part in message.split("(health.")[1:]}
    if event["kind"] in ("fault", "stop") and "serves other weights" in message:
        names.add("sync.probe")
    return names


def table(results: list[dict]) -> list[str]:
    lines = [
        "| run | injected cause | what fired (step: check, action) | how it ended | reward gain | held-out | verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    for result in results:
        what = "; ".join(summarise(event) for event in result["fired"]) or "nothing"
        lines.append(
            f"| {result['run']} | {result['cause'] or 'none (healthy)'} | {what} | {short_end(result['end'])} | "
            f"{result.get('reward_gain', '')} | {result.get('held_out_after', '')} | {result['verdict']} |"
        )
    return lines


def closest_table(results: list[dict]) -> list[str]:
    """How near each healthy run came to each check's bound (`closest`)."""
    lines = [
        "| healthy run | gradient norm / median (fires at 1000) | entropy / median (0.1) | entropy / low of last 3 "
        "(0.5) | entropy's largest fall, nats (0.5 as well) | steps the held reward spared | reward / median (0.25) "
        "| largest KL (1) | largest log-prob gap (1) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for result in results:
        if "closest" in result:
            near = result["closest"]
            lines.append(
                f"| {result['run']} | {near['grad_norm_x']} | {near['entropy_x']} | {near['entropy_recent_x']} | "
                f"{near['entropy_fall']} | {int(near.get('entropy_spared', 0))} | {near['reward_x']} | {near['kl']} | "
                f"{near['logprob_gap']} |"
            )
    return lines


def summarise(event: dict) -> str:
    """One event in a few words: its step, what fired and what was done."""
    message = event["message"]
    if event["kind"] == "stop":
        return f"{event['step']}: stopped"
    if event["kind"] == "fault":
        return f"{event['step']}: sync probe, weights sent again" if "serves other weights" in message else message
    if message.startswith("rolled back"):
        return f"{event['step']}: " + message.split(" in ")[0]
    names = ", ".join(sorted(checks_named(event)))
    return f"{event['step']}: {names}, {message.rsplit(': ', 1)[-1]}"


def short_end(end: str) -> str:
    if end == "finished":
        return "finished"
    if "same cause twice" in end:
        return "stopped: the same cause twice"
    if "serves other weights" in end:
        return "stopped: an engine serves other weights"
    return end[:80]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="run only these (names in the table)")
    parser.add_argument("--out-dir", default="outputs/guard", help="where the runs, their models and logs go")
    parser.add_argument("--markdown", help="write the table to this file too")
    parser.add_argument("--traces", help="write every run's per-step guard figures to this JSON file")
    parser.add_argument("--from-files", action="store_true", help="run nothing: the tables from --out-dir's runs")
    parser.add_argument("overrides", nargs="*", help="key=value settings applied to every run")
    args = parser.parse_args()
    out_dir = Path(args.out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    chosen = [run for run in runs(out_dir) if not args.only or run.name in args.only]
    if args.from_files:
        report([outcome(run, out_dir / run.name, -1, 0.0) for run in chosen], chosen, out_dir, args)
        return
    if any(run.name == "distill" for run in chosen) and not (out_dir / "teacher" / "config.json").exists():
        teacher, accuracy = make_teacher(out_dir / "teacher-work", "sft", 300)
        (out_dir / "teacher").unlink(missing_ok=True)
        (out_dir / "teacher").symlink_to(teacher)
        print(json.dumps({"teacher": str(teacher), "held_out": accuracy}), flush=True)
    results = []
    for run in chosen:
        results.append(run_one(run, out_dir, args.overrides))
        print(json.dumps(results[-1]), flush=True)
    report(results, chosen, out_dir, args)


def report(results: list[dict], chosen: list[Run], out_dir: Path, args: argparse.Namespace) -> None:
    """The tables on the console (and in `--markdown`), the counts, the traces (`--traces`)."""
    lines = [*table(results), "", *closest_table(results)]
    print("\n".join(lines))
    healthy = [result for result in results if not result["cause"]]
    faults = [result for result in results if result["cause"]]
    print(
        f"healthy runs silent: {sum(result['verdict'].startswith('silent') for result in healthy)}/{len(healthy)}; "
        f"faults caught: {sum(result['verdict'].startswith('caught') for result in faults)}/{len(faults)}"
    )
    if args.markdown:
        Path(args.markdown).write_text("\n".join(lines) + "\n")
    if args.traces:
        write_traces(Path(args.traces), chosen, out_dir)


TRACED = ("loss", "grad_norm", "entropy", "reward/mean", "kl", "logprob_gap", "learner/skipped")
"""The metrics the guard reads."""


def write_traces(path: Path, chosen: list[Run], out_dir: Path) -> None:
    """Each healthy run's logged steps (every step it judged: nothing fired), the guard's figures only, one row of
    `TRACED` a step (4 significant digits; null where a run logs no such figure), and the checks it may warn on:
    what `tests/test_health.py` replays. Runs not chosen keep the traces the file has. A fault run's metrics lack
    the steps it undid."""
    kept = json.loads(path.read_text()) if path.exists() else {}
    runs, warns = kept.get("runs", {}), kept.get("warns", {})
    for run in chosen:
        rows = read_jsonl(out_dir / run.name / "metrics.jsonl") if not run.cause else []
        if rows:
            runs[run.name] = [[float(f"{row[key]:.4g}") if key in row else None for key in TRACED] for row in rows]
            warns[run.name] = list(run.warns)
    warns = {name: warns.get(name, []) for name in sorted(runs)}
    traces = {"keys": TRACED, "runs": dict(sorted(runs.items())), "warns": warns}
    path.write_text(json.dumps(traces, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    main()

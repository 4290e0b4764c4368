"""What drawing batches ahead (`rollout.max_staleness`) and in-flight updates hide, how the reward pool scales, and
whether k = 1 learns as well as k = 0, and how each off-policy correction learns with stale samples. Five parts,
each measured side by side in one run; one JSON line per measurement, with a `ratio`:

    .venv/bin/python benchmarks/overlap.py [--steps 10] [--parity-seeds 3] [--parts step_time ...] [key=value ...]

1. `step_time`: the same config and seed at k = 0, 1 and 2, one run after another, with a judge that sleeps 200 ms
   per completion (`judges.slow_math_answer`: an I/O-bound reward such as a remote model or a sandbox) and a policy
   big enough (about 85M parameters) that a training step takes seconds. `ratio` is k = 0's mean step time over
   k's (steps after the first two, the last left out); `hidden` is the fraction of k = 0's reward time the overlap
   took off a step: (step(k=0) - step(k)) / reward(k=0) (target at least 0.8; above 1 when generation is hidden
   too, which `hidden_of_generate_and_reward` measures against both). Each k also runs with the judge answering at
   once (`-instant`): what the judge's delay adds to a step is step(judge) - step(instant judge), and
   `judge_latency_hidden` is 1 - that at k over that at k = 0 (the judge's latency alone, apart from what sharing
   the CPU between generation and training costs).
2. `in_flight`: k = 1 with `sync.mode: between_batches` and `in_flight`, on a quick-start-sized model with small
   batches of long completions (up to 96 tokens), where generating the next batch outlasts a training step, so the
   update lands mid-batch. `ratio` is the between-batches step time over the in-flight one (the two runs sample
   different completions once their weights differ, so it also reflects their lengths, printed beside it);
   `synced_in_flight` is the fraction of batches that took an update mid-way, `spanning` the mean completions per
   step whose tokens span two versions, and `staleness_mean` the mean staleness of the trained completions.
3. `reward_pool`: that judge scoring the same 64 completions with 1, 2 and 4 reward workers; `ratio` is the
   throughput over one worker's (target at least 0.9 x workers).
4. `parity`: the quick start (200 steps) at k = 0 and at k = 1 with each off-policy correction (`correction`:
   `sampler`, the default, the ratio taken against the sampling policy; `tis`, truncated importance sampling), at
   seeds 0 .. N-1 (`--parity-seeds`, 3); `difference` is k = 1's last-10-step mean reward minus k = 0's (target
   within 0.05), `ratio` the one over the other; then per correction the mean difference and how many seeds are
   within 0.05.

5. `corrections`: the quick start (200 steps) at k = 2 with `sync.mode: in_flight` under each off-policy correction
   (`algorithm.off_policy`: `tis`, `mis`, `icepop`, `seq_tis`, `seq_mis`, `cispo`; and `sampler`, the default, the
   ratio taken against the sampling policy) at seeds 0 .. N-1 (`--correction-seeds`, 2); per run its reward gain
   (last-10-step mean reward minus the first 10's), held-out accuracy after training and the mean fraction of
   tokens its weight truncated or masked; `ratio` is its gain over `tis`'s at the same seed. docs/algorithms.md
   gives the table.
6. `lengths`: whether staleness picks completions by their length: part 2's long completions at k = 2 with
   in-flight updates (`--length-steps`, 40), every step's completions kept in its table: how many were
   generated and trained, how many dropped for staleness (a dropped group would take its lengths with it), the
   trained ones' mean length and staleness, and how many spanned two versions. docs/async.md ("No length bias
   from staleness") gives the figures.

Overrides after the options apply to the runs of parts 1 and 2; `--parts` picks parts. Run by hand; CI never runs it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BENCHMARKS = REPO / "benchmarks"
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(BENCHMARKS))


def judge(delay_s: float) -> str:
    """The override for a judge that sleeps `delay_s` per completion, then scores it as `math_answer` does."""
    return f"reward.functions=[{{name: judges.slow_math_answer, weight: 1.0, kwargs: {{delay_s: {delay_s}}}}}]"


JUDGE_DELAY_S = 0.2
STEP_TIME_SETTINGS = [
    "model.tiny.hidden_size=768", "model.tiny.num_layers=12", "model.tiny.num_heads=12",
    "model.tiny.intermediate_size=2048", "data.prompts_per_step=16", "rollout.group_size=4",
    "reward.num_workers=4", "learner.micro_batch_size=64", "eval.max_prompts=16",
]  # fmt: skip
IN_FLIGHT_SETTINGS = [  # the quick start's model size with letters too (a random model stops later), small batches
    # of long completions: generating a batch outlasts a training step
    "model.tiny.characters='abcdefghijklmnopqrstuvwxyz0123456789 :'", "data.prompts_per_step=8",
    "rollout.group_size=8", "rollout.max_new_tokens=96", "rollout.max_model_len=128",
]  # fmt: skip
PARTS = ["step_time", "in_flight", "reward_pool", "parity", "corrections", "lengths"]
CORRECTIONS = {  # parity: k = 1's off-policy corrections, each against the same k = 0 run
    "sampler": [],  # the default: the ratio taken against the sampling policy
    "tis": ["algorithm.old_logprobs=learner"],  # truncated importance sampling (is_cap 2)
}
OFF_POLICY = {  # corrections: each at k = 2 with in-flight updates
    "tis": ["algorithm.old_logprobs=learner"],
    **{name: [f"algorithm.off_policy={name}"] for name in ("mis", "icepop", "seq_tis", "seq_mis", "cispo")},
    "sampler": [],
}
WARM_UP_STEPS = 2  # first steps pay one-time costs (allocations, first collectives); the last has nothing to overlap


def environment() -> dict[str, str]:
    """The benchmarks' judges importable by the run's reward workers."""
    paths = [str(BENCHMARKS), str(REPO), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, paths))}


def run(name: str, k: int, steps: int, out_dir: Path, settings: list[str]) -> dict[str, float]:
    """Mean per-step figures of one `grpo-dist train` run of the quick start with `settings`, at staleness bound k."""
    common = [
        f"run.steps={steps}", f"run.name={name}", f"run.output_dir={out_dir}", f"model.path={out_dir / 'model'}",
        f"rollout.max_staleness={k}", "wandb.enabled=false", "checkpoint.every_steps=0", "run.save_final=false",
    ]  # fmt: skip
    command = [sys.executable, "-m", "grpo_dist", "train", "configs/quickstart.yaml", *common, *settings]
    done = subprocess.run(command, cwd=REPO, env=environment(), capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{name}: grpo-dist train exited {done.returncode}:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out_dir / name / "metrics.jsonl").read_text().splitlines()]
    timed = rows[WARM_UP_STEPS:-1]
    keys = ["time/step", "time/reward", "time/train", "time/generate", "sync/in_flight", "staleness/spanning"]
    keys += ["staleness/mean", "response_length/mean"]
    return {key: statistics.mean(row.get(key, 0.0) for row in timed) for key in keys}


def step_times(steps: int, out_dir: Path, overrides: list[str]) -> None:
    times, instant = {}, {}
    for k in (0, 1, 2):
        times[k] = run(f"k{k}", k, steps, out_dir, [*STEP_TIME_SETTINGS, judge(JUDGE_DELAY_S), *overrides])
        instant[k] = run(f"k{k}-instant", k, steps, out_dir, [*STEP_TIME_SETTINGS, judge(0), *overrides])
    base = times[0]
    latency_at_k0 = base["time/step"] - instant[0]["time/step"]  # what the judge's delay adds to a step
    for k in (1, 2):
        saved = base["time/step"] - times[k]["time/step"]
        latency = times[k]["time/step"] - instant[k]["time/step"]
        line = {
            "benchmark": "step_time",
            "k": k,
            "step_s": round(times[k]["time/step"], 3),
            "baseline_step_s": round(base["time/step"], 3),
            "ratio": round(base["time/step"] / times[k]["time/step"], 3),
            "reward_s_at_k0": round(base["time/reward"], 3),
            "hidden": round(saved / base["time/reward"], 3),
            "generate_s_at_k0": round(base["time/generate"], 3),
            "hidden_of_generate_and_reward": round(saved / (base["time/generate"] + base["time/reward"]), 3),
            "train_s_at_k0": round(base["time/train"], 3),
            "instant_judge_step_s": round(instant[k]["time/step"], 3),
            "instant_judge_step_s_at_k0": round(instant[0]["time/step"], 3),
            "judge_latency_in_step_s": round(latency, 3),
            "judge_latency_in_step_s_at_k0": round(latency_at_k0, 3),
            # None where the judge's delay added nothing at k = 0 (an override that made it instant)
            "judge_latency_hidden": round(1 - latency / latency_at_k0, 3) if latency_at_k0 > 0 else None,
        }
        print(json.dumps(line), flush=True)


def in_flight(steps: int, out_dir: Path, overrides: list[str]) -> None:
    runs = {
        mode: run(f"k1-{mode}", 1, steps, out_dir, [*IN_FLIGHT_SETTINGS, f"sync.mode={mode}", *overrides])
        for mode in ("between_batches", "in_flight")
    }
    base, timed = runs["between_batches"], runs["in_flight"]
    line = {
        "benchmark": "in_flight",
        "k": 1,
        "step_s": round(timed["time/step"], 3),
        "baseline_step_s": round(base["time/step"], 3),
        "ratio": round(base["time/step"] / timed["time/step"], 3),
        "generate_s": round(timed["time/generate"], 3),
        "baseline_generate_s": round(base["time/generate"], 3),
        "synced_in_flight": round(timed["sync/in_flight"], 3),
        "spanning": round(timed["staleness/spanning"], 1),
        "staleness_mean": round(timed["staleness/mean"], 3),
        "baseline_staleness_mean": round(base["staleness/mean"], 3),
        "response_length": round(timed["response_length/mean"], 1),
        "baseline_response_length": round(base["response_length/mean"], 1),
    }
    print(json.dumps(line), flush=True)


def reward_pool_scaling(completions: int = 64) -> None:
    import ray

    from grpo_dist.cluster.placement import place
    from grpo_dist.cluster.reward_pool import RewardPool
    from grpo_dist.config import load_config
    from grpo_dist.faults import FaultLog
    from grpo_dist.types import ScoreRequest

    ray.init(num_cpus=8, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": environment()["PYTHONPATH"]}})
    requests = [ScoreRequest(f"{i} 3:", "3", {"answer": "3"}) for i in range(completions)]
    throughput = {}
    try:
        for workers in (1, 2, 4):
            settings = [judge(JUDGE_DELAY_S), f"reward.num_workers={workers}"]
            cfg = load_config(REPO / "configs/quickstart.yaml", settings)
            placement = place(cfg)
            pool = RewardPool(cfg, placement, FaultLog())
            try:
                pool.pool.wait_ready()
                pool.score(requests[:workers])  # warm-up: imports, first call
                started = time.perf_counter()
                scores = pool.score(requests)
                throughput[workers] = completions / (time.perf_counter() - started)
                assert all(score.total == 1.0 for score in scores)
            finally:
                pool.shutdown()
                placement.remove()
            line = {
                "benchmark": "reward_pool",
                "workers": workers,
                "completions_per_s": round(throughput[workers], 2),
                "ratio": round(throughput[workers] / throughput[1], 3),
                "target": 0.9 * workers,
            }
            print(json.dumps(line), flush=True)
    finally:
        ray.shutdown()


def parity(out_dir: Path, seeds: int) -> None:
    from learning import run_seed

    config, differences = "configs/quickstart.yaml", {name: [] for name in CORRECTIONS}
    for seed in range(seeds):
        baseline = run_seed(config, seed, out_dir / "k0", ["rollout.max_staleness=0"])
        for name, overrides in CORRECTIONS.items():
            result = run_seed(config, seed, out_dir / f"k1-{name}", ["rollout.max_staleness=1", *overrides])
            differences[name].append(round(result["last10"] - baseline["last10"], 3))
            line = {
                "benchmark": "parity",
                "k": 1,
                "correction": name,
                "seed": seed,
                "last10": result["last10"],
                "baseline_last10": baseline["last10"],
                "ratio": round(result["last10"] / baseline["last10"], 3),
                "difference": differences[name][-1],
                "held_out": result["held_out_after"],
                "baseline_held_out": baseline["held_out_after"],
                "wall_s": result["wall_s"],
                "baseline_wall_s": baseline["wall_s"],
            }
            print(json.dumps(line), flush=True)
    for name, found in differences.items():
        within = sum(abs(difference) <= 0.05 for difference in found)
        summary = {"mean_difference": round(statistics.mean(found), 3), "within_0.05": within}
        print(json.dumps({"benchmark": "parity", "correction": name, "seeds": seeds, **summary}), flush=True)


def corrections(out_dir: Path, seeds: int) -> None:
    from learning import run_seed

    config, stale = "configs/quickstart.yaml", ["rollout.max_staleness=2", "sync.mode=in_flight"]
    for seed in range(seeds):
        gains = {}
        for name, overrides in OFF_POLICY.items():
            result = run_seed(config, seed, out_dir / name, [*stale, *overrides])
            rows = [json.loads(line) for line in (out_dir / name / f"seed-{seed}" / "metrics.jsonl").open()]
            gains[name] = result["gain"]
            line = {
                "benchmark": "corrections",
                "correction": name,
                "seed": seed,
                "gain": result["gain"],
                "last10": result["last10"],
                "held_out": result["held_out_after"],
                **{
                    key: round(statistics.mean(row.get(key, 0.0) for row in rows), 4)
                    for key in ("is_weight/capped", "is_weight/masked", "staleness/mean")
                },  # fmt: skip
                "ratio": round(result["gain"] / gains["tis"], 3) if gains["tis"] else None,
                "wall_s": result["wall_s"],
            }
            print(json.dumps(line), flush=True)


def lengths(steps: int, out_dir: Path, overrides: list[str]) -> None:
    rows_per_step = 64  # part 2's batch: 8 prompts x 8 completions, all of it in each step's table
    settings = [*IN_FLIGHT_SETTINGS, "sync.mode=in_flight", "wandb.table_every=1", f"wandb.table_rows={rows_per_step}"]
    run("k2-lengths", 2, steps, out_dir, [*settings, *overrides])
    completions = [json.loads(line) for line in (out_dir / "k2-lengths" / "completions.jsonl").open()]
    metrics = [json.loads(line) for line in (out_dir / "k2-lengths" / "metrics.jsonl").open()]
    staleness = [row["staleness"] for row in completions]
    dropped = sum(row["staleness/dropped"] for row in metrics)
    line = {
        "benchmark": "lengths",
        "k": 2,
        "generated": len(completions) + dropped,
        "trained": len(completions),
        "dropped": dropped,
        "trained_mean_length": round(statistics.mean(row["length"] for row in completions), 1),
        "trained_by_staleness": {s: staleness.count(s) for s in sorted(set(staleness))},
        "spanning": sum(row["staleness/spanning"] for row in metrics),
        "synced_in_flight": sum(row["sync/in_flight"] for row in metrics),
    }
    print(json.dumps(line), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="steps per run of part 1")
    parser.add_argument("--parity-seeds", type=int, default=3, help="seeds of part 4 (three 200-step runs each)")
    parser.add_argument("--correction-seeds", type=int, default=2, help="seeds of part 5 (seven 200-step runs each)")
    parser.add_argument("--length-steps", type=int, default=40, help="steps of part 6's run")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=PARTS, help="the parts to run, in this order")
    parser.add_argument("--out-dir", default="outputs/overlap")
    parser.add_argument("overrides", nargs="*", help="key=value settings for the runs of parts 1 and 2")
    args = parser.parse_args()
    out_dir = Path(args.out_dir).resolve()
    parts = {
        "step_time": lambda: step_times(args.steps, out_dir / "step_time", args.overrides),
        "in_flight": lambda: in_flight(args.steps, out_dir / "in_flight", args.overrides),
        "reward_pool": reward_pool_scaling,
        "parity": lambda: parity(out_dir / "parity", args.parity_seeds),
        "corrections": lambda: corrections(out_dir / "corrections", args.correction_seeds),
        "lengths": lambda: lengths(args.length_steps, out_dir / "lengths", args.overrides),
    }
    for name in args.parts:
        parts[name]()


if __name__ == "__main__":
    main()

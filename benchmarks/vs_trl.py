"""grpo-dist and TRL's GRPOTrainer side by side: the same model, data, reward and hyperparameters, several seeds.

    make install && .venv/bin/pip install -e ".[bench]"      # TRL (trl 1.16.0); make test never needs it
    .venv/bin/python benchmarks/vs_trl.py [--seeds 3] [--config configs/quickstart.yaml] [key=value ...]

For each seed, `grpo-dist train` runs the config (it builds the seed's tiny model and draws the seed's data); then
TRL's GRPOTrainer trains the same initial model on the same training rows with the same reward functions and
weights, group size, prompts per step, learning rate and AdamW settings, clip range, beta, loss aggregation,
temperature and completion length (`trl_settings` maps each; a setting it cannot map is refused before anything
runs). Both final policies are judged by one evaluator: greedy decoding with transformers on the held-out rows,
scored by `eval.reward` (1.0 = correct). TRL generates with transformers in the benchmark's own process; grpo-dist
runs its Ray actors and vLLM engine.

Prints one JSON line per trainer and seed (every step's mean reward, the first and last 10 steps' means, held-out
accuracy, median step time, the machine's CPU seconds a step, wall time), a line of ratios per seed (TRL over
grpo-dist for step time, CPU a step and wall time; grpo-dist minus TRL for the last-10 reward and held-out accuracy),
and a summary line of their means. The CPU a step is machine-wide (/proc/stat): for TRL the median over its steps
after the first, for grpo-dist the mean over its steps from the sixth to the last but one
(`benchmarks/step_phases.py --cpu`); a step takes at least its CPU seconds over the machine's cores. Run it on an
otherwise idle machine; CI never runs it.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from run_cost import busy_seconds  # noqa: E402
from step_phases import run_measured  # noqa: E402

from grpo_dist.config import Config, load_config  # noqa: E402
from grpo_dist.data.sources import read_source  # noqa: E402
from grpo_dist.rewards.registry import resolve_reward  # noqa: E402
from grpo_dist.run.inputs import prepare_data  # noqa: E402

OWN_ACCURACY = re.compile(r"eval held_out after training: accuracy ([0-9.]+)")
LOSS_TYPES = {"seq-mean-token-mean": "grpo", "token-mean": "dapo", "seq-mean-token-sum-norm": "dr_grpo"}
REWARD_SCALING = {"grpo": "group", "dr_grpo": "none", "batch_std": "batch"}


def trl_settings(cfg: Config) -> dict:
    """GRPOConfig keyword arguments equal to the config's settings; refuses settings TRL has no equal of."""
    algo, learner, rollout = cfg.algorithm, cfg.learner, cfg.rollout
    unmapped = [
        f"algorithm.{key}={value!r}"
        for key, value, default in [
            ("estimator", algo.estimator if algo.estimator not in REWARD_SCALING else None, None),
            ("std", algo.std, "sample"),  # TRL divides by torch.std: the sample std
            ("kl_estimator", algo.kl_estimator, "k3"),
            ("dual_clip", algo.dual_clip, None),
            ("is_cap", algo.is_cap, None),
            ("entropy_coef", algo.entropy_coef, 0.0),
            ("dynamic_sampling", algo.dynamic_sampling, False),
            ("overlong", algo.overlong, "none"),
            ("ppo_epochs", algo.ppo_epochs, 1),
            ("mini_batches", algo.mini_batches, 1),
        ]
        if value != default
    ]
    if unmapped:
        raise SystemExit(f"vs_trl: no TRL equal for {', '.join(unmapped)}; run the comparison without them")
    return dict(
        max_steps=cfg.run.steps,
        seed=cfg.run.seed,
        num_generations=rollout.group_size,
        per_device_train_batch_size=cfg.data.prompts_per_step * rollout.group_size,  # completions: one update/step
        gradient_accumulation_steps=1,
        max_completion_length=rollout.max_new_tokens,
        temperature=rollout.temperature,
        top_p=rollout.top_p,
        top_k=0,
        learning_rate=learner.lr,
        adam_beta1=learner.betas[0],
        adam_beta2=learner.betas[1],
        weight_decay=learner.weight_decay,
        max_grad_norm=learner.max_grad_norm,
        warmup_steps=learner.warmup_steps,
        lr_scheduler_type="constant_with_warmup",
        beta=algo.kl_coef,
        epsilon=algo.clip_low,
        epsilon_high=algo.clip_high,
        importance_sampling_level=algo.ratio_level,
        loss_type=LOSS_TYPES[algo.aggregation],
        scale_rewards=REWARD_SCALING[algo.estimator],
        multi_objective_aggregation=cfg.reward.combine,
        reward_weights=[spec.weight for spec in cfg.reward.functions],
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        disable_tqdm=True,
    )


def trl_reward(name: str, kwargs: dict, fields: list[str]):
    """A grpo-dist reward function with TRL's signature: lists in, one score per completion out."""
    function = resolve_reward(name)

    def reward(prompts, completions, **columns):
        return [
            float(function(prompt, completion, **{f: columns[f][i] for f in fields}, **kwargs))
            for i, (prompt, completion) in enumerate(zip(prompts, completions, strict=True))
        ]

    reward.__name__ = name
    return reward


def run_grpo_dist(config: str, overrides: list[str], out_dir: Path, seed: int, steps: int) -> dict:
    started = time.monotonic()
    command = [sys.executable, "-m", "grpo_dist", "train", config, *overrides]
    code, said, cost = run_measured(command, REPO, None, out_dir / "metrics.jsonl", steps)
    if code != 0:
        raise RuntimeError(f"seed {seed}: grpo-dist train exited {code}:\n{said[-3000:]}")
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return {
        "rewards": [row["reward/mean"] for row in rows],
        "step_s": [row["time/step"] for row in rows],
        "cpu_s": (cost or {}).get("machine"),
        "final": out_dir / "final",
        "wall_s": time.monotonic() - started,
        "own_held_out": float(OWN_ACCURACY.search(said).group(1)),
    }


def run_trl(cfg: Config, train_rows: list[dict], out_dir: Path) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    class StepClock(TrainerCallback):
        def __init__(self) -> None:
            self.step_s: list[float] = []
            self.cpu_s: list[float] = []  # the machine's, as grpo-dist's is measured

        def on_step_begin(self, args, state, control, **kwargs):
            self.began, self.busy = time.perf_counter(), busy_seconds()

        def on_step_end(self, args, state, control, **kwargs):
            self.step_s.append(time.perf_counter() - self.began)
            self.cpu_s.append(busy_seconds() - self.busy)

    started = time.monotonic()
    fields = [key for key in train_rows[0] if key != "prompt"]
    rewards = [trl_reward(spec.name, spec.kwargs, fields) for spec in cfg.reward.functions]
    dataset = Dataset.from_list([{"prompt": row["prompt"], **{f: row[f] for f in fields}} for row in train_rows])
    clock = StepClock()
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(cfg.model.path),
        processing_class=AutoTokenizer.from_pretrained(cfg.model.path),
        reward_funcs=rewards,
        args=GRPOConfig(output_dir=str(out_dir), **trl_settings(cfg)),
        train_dataset=dataset,
        callbacks=[clock],
    )
    trainer.remove_callback(PrinterCallback)  # its per-step dicts would bury the benchmark's lines
    trainer.train()
    trainer.save_model(str(out_dir / "final"))
    trainer.processing_class.save_pretrained(str(out_dir / "final"))
    logged = [entry for entry in trainer.state.log_history if "reward" in entry]
    return {
        "rewards": [entry["reward"] for entry in logged],
        "step_s": clock.step_s,
        "cpu_s": statistics.median(clock.cpu_s[1:] or clock.cpu_s),
        "final": out_dir / "final",
        "wall_s": time.monotonic() - started,
    }


def held_out_accuracy(model_dir: Path, rows: list[dict], cfg: Config) -> float:
    """Greedy completions by transformers, judged by `eval.reward` (1.0 = correct): the same judge for both."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    prompts = [row["prompt"] for row in rows]
    inputs = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        output = model.generate(
            **inputs, do_sample=False, max_new_tokens=cfg.rollout.max_new_tokens, pad_token_id=tokenizer.pad_token_id
        )
    completions = tokenizer.batch_decode(output[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    judge = resolve_reward(cfg.eval.reward)
    fields = [key for key in rows[0] if key != "prompt"]
    scores = [
        judge(prompt, completion, **{f: row[f] for f in fields})
        for prompt, completion, row in zip(prompts, completions, rows, strict=True)
    ]
    return sum(score == 1.0 for score in scores) / len(scores)


def report(trainer: str, seed: int, result: dict, accuracy: float) -> dict:
    rewards = result["rewards"]
    line = {
        "trainer": trainer,
        "seed": seed,
        "first10": round(statistics.mean(rewards[:10]), 3),
        "last10": round(statistics.mean(rewards[-10:]), 3),
        "held_out": round(accuracy, 3),
        "step_s_median": round(statistics.median(result["step_s"][1:] or result["step_s"]), 4),
        "cpu_s_per_step": round(result["cpu_s"], 4) if result["cpu_s"] is not None else None,
        "wall_s": round(result["wall_s"], 1),
        **({"own_held_out": result["own_held_out"]} if "own_held_out" in result else {}),
        "rewards": [round(reward, 4) for reward in rewards],
    }
    print(json.dumps(line), flush=True)
    return line


def ratios(seed: int, ours: dict, trl: dict) -> dict:
    line = {
        "seed": seed,
        "step_time_ratio": round(trl["step_s_median"] / ours["step_s_median"], 3),  # > 1: grpo-dist steps faster
        "cpu_ratio": round(trl["cpu_s_per_step"] / ours["cpu_s_per_step"], 3) if ours["cpu_s_per_step"] else None,
        "wall_ratio": round(trl["wall_s"] / ours["wall_s"], 3),
        "last10_diff": round(ours["last10"] - trl["last10"], 3),
        "held_out_diff": round(ours["held_out"] - trl["held_out"], 3),
    }
    print(json.dumps(line), flush=True)
    return line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0 .. N-1")
    parser.add_argument("--config", default="configs/quickstart.yaml")
    parser.add_argument("--out-dir", default="outputs/vs_trl", help="where the runs and their models go")
    parser.add_argument("overrides", nargs="*", help="key=value settings applied to both trainers at every seed")
    args = parser.parse_args()
    try:
        import trl  # noqa: F401
    except ImportError:
        raise SystemExit('vs_trl: TRL is not installed; install the bench extra: pip install -e ".[bench]"') from None
    out_dir = Path(args.out_dir).resolve()
    compared = []
    for seed in range(args.seeds):
        overrides = [
            f"run.seed={seed}", f"run.name=grpo-dist-{seed}", f"run.output_dir={out_dir}",
            f"model.path={out_dir / f'model-{seed}'}", "wandb.enabled=false", "checkpoint.every_steps=0",
            *args.overrides,
        ]  # fmt: skip
        cfg = load_config(REPO / args.config, overrides)
        trl_settings(cfg)  # refuse what TRL cannot match before anything runs
        ours = run_grpo_dist(args.config, overrides, cfg.run_dir, seed, cfg.run.steps)
        train_path, eval_path = prepare_data(cfg)  # the files grpo-dist drew for this seed
        data = cfg.data
        held_out = read_source(eval_path, data.eval_split, data.subset, data.fields, "data.eval_path")
        held_out = held_out[: cfg.eval.max_prompts]
        train_rows = read_source(train_path, data.split, data.subset, data.fields, "data.path")
        theirs = run_trl(cfg, train_rows, out_dir / f"trl-{seed}")
        ours_line = report("grpo-dist", seed, ours, held_out_accuracy(ours["final"], held_out, cfg))
        trl_line = report("trl", seed, theirs, held_out_accuracy(theirs["final"], held_out, cfg))
        compared.append(ratios(seed, ours_line, trl_line))
    means = {
        key: round(statistics.mean(line[key] for line in compared), 3)
        for key in compared[0]
        if key != "seed" and all(line[key] is not None for line in compared)
    }
    summary = {"seeds": len(compared), **means}
    print(json.dumps({"summary": summary, "config": args.config, "overrides": args.overrides}))


if __name__ == "__main__":
    main()

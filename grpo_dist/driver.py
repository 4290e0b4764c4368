"""The GRPO loop: prompts -> groups -> rewards -> advantages -> train -> sync -> log.

DeepSeekMath's GRPO (arXiv 2402.03300) with one optimizer update per rollout batch by default (`ppo_epochs` and
`mini_batches` add more), advantages computed here from the group's rewards and sent with the batch to the learner.
Everything that can be wrong with the inputs is checked by `prepare` before any actor starts.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from grpo_dist.algo import group_advantages
from grpo_dist.batch import collate
from grpo_dist.cluster import Cluster, start_ray
from grpo_dist.config import Config, ConfigError
from grpo_dist.data import PromptRecord, PromptSampler, encode_prompts, load_rows, split_task
from grpo_dist.metrics import MetricsSink, StepTimer, rollout_metrics, start_wandb
from grpo_dist.rewards import resolve_reward, score_one
from grpo_dist.types import Completion, ScoreRequest

log = logging.getLogger("grpo_dist")


@dataclass
class Inputs:
    """Everything a run reads, checked and tokenised."""

    model_path: str
    pad_token_id: int
    train: list[PromptRecord]
    held_out: list[PromptRecord]


def train(cfg: Config, cluster: Cluster | None = None) -> Path:
    """Run GRPO as configured; returns the run directory (metrics.jsonl, final/). Starts Ray and the actors
    unless a running `cluster` is given."""
    inputs = prepare(cfg)
    if cluster is None:
        start_ray(cfg)
        cluster = Cluster.start(cfg, inputs.model_path)
    sink = MetricsSink(cfg.run_dir, start_wandb(cfg, cfg.run_dir))
    sampler = PromptSampler(inputs.train, cfg.data.prompts_per_step, cfg.run.seed)
    report_accuracy(cfg, cluster, inputs.held_out, "before training")
    progress = tqdm(range(1, cfg.run.steps + 1), desc="grpo", unit="step", dynamic_ncols=True)
    try:
        for step in progress:
            metrics = train_step(cfg, cluster, next(sampler), inputs.pad_token_id, weight_version=step)
            sink.log(step, {**metrics, "epoch": sampler.epoch})
            progress.set_postfix_str(
                f"reward={metrics['reward/mean']:.3f} kl={metrics.get('kl', 0.0):.4f} "
                f"tok/s={metrics['tokens_per_s']:.0f}"
            )
    except BaseException:
        log.error("training stopped early; saving the current policy to %s", cfg.run_dir / "interrupted")
        cluster.save(str(cfg.run_dir / "interrupted"))
        raise
    finally:
        sink.close()
    report_accuracy(cfg, cluster, inputs.held_out, "after training")
    if cfg.run.save_final:
        print(f"final policy saved to {cluster.save(str(cfg.run_dir / 'final'))}")
    return cfg.run_dir


def train_step(
    cfg: Config, cluster: Cluster, prompts: list[PromptRecord], pad_token_id: int, weight_version: int
) -> dict[str, float]:
    """One GRPO step: sample groups, score them, compute advantages, update the policy, sync the generators."""
    timer, started = StepTimer(), time.perf_counter()
    with timer("generate"):
        completions = cluster.generate(prompts, cfg.rollout.group_size)
    with timer("reward"):
        scores = cluster.score(score_requests(prompts, completions))
    rewards = torch.tensor([score.total for score in scores])  # [B*G], NaN = unscored
    algo = cfg.algorithm
    advantages = group_advantages(rewards, cfg.rollout.group_size, algo.estimator, std=algo.std, eps=algo.eps)
    batch = collate(completions, advantages, pad_token_id)
    with timer("train"):
        train_metrics = cluster.train(batch)
    with timer("sync"):
        cluster.sync_weights(weight_version)
    reward_names = [spec.name for spec in cfg.reward.functions]
    metrics = {**rollout_metrics(completions, scores, advantages, reward_names), **train_metrics, **timer.times}
    metrics["weight_version"] = weight_version
    metrics["tokens_per_s"] = metrics["tokens/generated"] / (time.perf_counter() - started)
    return metrics


def score_requests(prompts: list[PromptRecord], completions: list[Completion]) -> list[ScoreRequest]:
    return [ScoreRequest(prompts[c.prompt_index].text, c.text, prompts[c.prompt_index].fields) for c in completions]


def report_accuracy(cfg: Config, cluster, held_out: list[PromptRecord], when: str) -> float | None:
    """Greedy accuracy on the held-out prompts, judged by `eval.reward` (1.0 = correct); printed and returned."""
    if not held_out:
        return None
    prompts = held_out[: cfg.eval.max_prompts]
    completions = cluster.generate(prompts, group_size=1, greedy=True)
    judge = [resolve_reward(cfg.eval.reward)]
    with ThreadPoolExecutor(max_workers=4) as pool:
        scores = [
            score_one(judge, [1.0], [{}], r.prompt, r.completion, r.fields, cfg.reward.timeout_s, pool)[0]
            for r in score_requests(prompts, completions)
        ]
    accuracy = sum(score == 1.0 for score in scores) / len(scores)
    print(f"held-out accuracy {when}: {accuracy:.3f} ({len(scores)} prompts, judged by {cfg.eval.reward})")
    return accuracy


def prepare(cfg: Config) -> Inputs:
    """Build or check the model, read and tokenise the data, resolve the rewards: fail here, not in an actor."""
    from transformers import AutoTokenizer

    for name in [spec.name for spec in cfg.reward.functions] + [cfg.eval.reward]:
        try:
            resolve_reward(name)
        except ValueError as err:
            raise ConfigError(f"reward {name!r}: {err}") from None
    model_path = prepare_model(cfg)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens > cfg.rollout.max_model_len:
        raise ConfigError(
            f"data.max_prompt_tokens ({cfg.data.max_prompt_tokens}) + rollout.max_new_tokens "
            f"({cfg.rollout.max_new_tokens}) exceeds rollout.max_model_len ({cfg.rollout.max_model_len})"
        )
    train_path, eval_path = prepare_data(cfg)
    train, skipped = encode_prompts(load_rows(train_path, cfg.data.prompt_field), tokenizer, cfg.data.max_prompt_tokens)
    if skipped:
        print(f"skipped {skipped} training prompts longer than data.max_prompt_tokens={cfg.data.max_prompt_tokens}")
    held_out = []
    if eval_path is not None:
        rows = load_rows(eval_path, cfg.data.prompt_field)
        held_out, _ = encode_prompts(rows, tokenizer, cfg.data.max_prompt_tokens)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return Inputs(model_path, pad, train, held_out)


def prepare_model(cfg: Config) -> str:
    path = Path(cfg.model.path)
    if cfg.model.tiny is not None and not path.exists():
        from grpo_dist.models import build_tiny_model

        tiny = cfg.model.tiny
        build_tiny_model(
            path,
            hidden_size=tiny.hidden_size,
            num_layers=tiny.num_layers,
            num_heads=tiny.num_heads,
            intermediate_size=tiny.intermediate_size,
            seed=cfg.run.seed,
        )
        print(f"built a random-init tiny model at {path}")
    if not (path / "config.json").is_file():
        raise ConfigError(f"model.path: {path} is not a Hugging Face model directory (no config.json)")
    return str(path.resolve())


def prepare_data(cfg: Config) -> tuple[Path, Path | None]:
    data = cfg.data
    if data.task is None:
        return Path(data.train_path), Path(data.eval_path) if data.eval_path else None
    task = data.task
    return split_task(task.name, cfg.run_dir / "data", task.num_train, task.num_eval, cfg.run.seed)

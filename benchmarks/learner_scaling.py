"""Learner throughput with 1 and with N ranks on the same rollout batch, measured side by side in one run.

    .venv/bin/python benchmarks/learner_scaling.py [--ranks 2] [--steps 3] [--size 30m|tiny] [--zero-stage 2]

Prints one JSON line per rank count: tokens/s of a training step (forward, backward and optimizer step over the
batch's tokens, prompt and completion), seconds per step, and `ratio` = tokens/s against the 1-rank run. On a CPU
machine the ranks share the cores (each rank's torch threads are the node's cores divided among its ranks), so the
ratio measures the cost of data parallelism there, not a speed-up; on GPUs each rank has its own device. Run by hand;
CI never runs it.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import ray
import torch
from safetensors.torch import load_file

from grpo_dist.algo.batch import TrainBatch, collate
from grpo_dist.cluster.learner_group import LearnerGroup
from grpo_dist.config import validate_config
from grpo_dist.models import build_tiny_model
from grpo_dist.types import Completion

SIZES = {
    "tiny": {"hidden_size": 128, "num_layers": 2, "num_heads": 2, "intermediate_size": 256},
    "30m": {"hidden_size": 512, "num_layers": 8, "num_heads": 8, "intermediate_size": 1536},
}


def synthetic_batch(sequences: int, prompt_tokens: int, completion_tokens: int, seed: int = 0) -> TrainBatch:
    """A rollout batch of random tokens with completion lengths spread from 1/4 to all of `completion_tokens`."""
    generator = torch.Generator().manual_seed(seed)
    completions = []
    for index in range(sequences):
        length = max(1, completion_tokens * (1 + index % 4) // 4)
        prompt = torch.randint(4, 100, (prompt_tokens,), generator=generator).tolist()
        tokens = torch.randint(4, 100, (length,), generator=generator).tolist()
        completions.append(Completion(index, prompt, tokens, "", [-1.0] * length, "stop", 0))
    advantages = torch.randn(sequences, generator=generator)
    return collate(completions, advantages, pad_token_id=0)


def config(model_dir: str, ranks: int, zero_stage: int, micro_batch_size: int) -> dict:
    return {
        "model": {"path": model_dir},
        "data": {"task": {"name": "last_digit"}},
        "reward": {"functions": [{"name": "math_answer"}]},
        "algorithm": {"kl_coef": 0.0},
        "learner": {"num_ranks": ranks, "zero_stage": zero_stage, "micro_batch_size": micro_batch_size},
        "wandb": {"enabled": False},
    }


def measure(model_dir: str, ranks: int, args: argparse.Namespace, batch: TrainBatch) -> dict:
    cfg = validate_config(config(model_dir, ranks, args.zero_stage, args.micro_batch_size))
    group = LearnerGroup.start(cfg, model_dir)
    try:
        group.train(batch)  # warm-up: allocations, first collectives
        started = time.perf_counter()
        for _ in range(args.steps):
            group.train(batch)
        seconds = (time.perf_counter() - started) / args.steps
    finally:
        group.shutdown()
    tokens = int(batch.attention_mask.sum())
    return {"ranks": ranks, "threads": group.threads, "s_per_step": seconds, "tokens_per_s": tokens / seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--size", choices=sorted(SIZES), default="30m")
    parser.add_argument("--zero-stage", type=int, default=2)
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--micro-batch-size", type=int, default=16)
    args = parser.parse_args()
    ray.init(num_cpus=max(4, 2 * args.ranks), include_dashboard=False, log_to_driver=False)
    model_dir = str(build_tiny_model(tempfile.mkdtemp(prefix="learner-scaling-"), **SIZES[args.size]))
    parameters = sum(t.numel() for t in load_file(f"{model_dir}/model.safetensors").values())
    batch = synthetic_batch(args.sequences, prompt_tokens=32, completion_tokens=96)
    baseline = None
    for ranks in (1, args.ranks):
        result = measure(model_dir, ranks, args, batch)
        baseline = baseline or result["tokens_per_s"]
        result.update(parameters=parameters, zero_stage=args.zero_stage, ratio=result["tokens_per_s"] / baseline)
        print(json.dumps(result), flush=True)
    ray.shutdown()


if __name__ == "__main__":
    main()

"""The sizing table of docs/scaling.md ("Sizing"), made by the memory plan (`grpo_dist.config.plan`) from each model's
config.json: model states by DeepSpeed's own estimators, the reference, engines in bfloat16, 80 GB GPUs.

    python benchmarks/sizing.py
    python benchmarks/sizing.py --versus-deepspeed   # the plan's model states against DeepSpeed's estimators fed
                                                     # the module itself (built on the meta device), side by side
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from grpo_dist.config import validate_config
from grpo_dist.config.plan import Shape, plan

SHAPES = {  # the fields of each model's config.json a plan reads, as published
    "0.5B": {"model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
             "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True},
    "1.5B": {"model_type": "qwen2", "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
             "num_attention_heads": 12, "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True},
    "7B": {"model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
           "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064, "tie_word_embeddings": False},
    "32B": {"model_type": "qwen2", "hidden_size": 5120, "intermediate_size": 27648, "num_hidden_layers": 64,
            "num_attention_heads": 40, "num_key_value_heads": 8, "vocab_size": 152064, "tie_word_embeddings": False},
}  # fmt: skip
"""Qwen2.5-0.5B, Qwen2.5-1.5B, Qwen2.5-Math-7B and Qwen2.5-32B."""

ROWS = [  # policy, GPUs, learner ranks, ZeRO stage, offload, gradient checkpointing, engines, TP, kl_coef
    ("0.5B", 8, 1, 0, "none", False, 7, 1, 0.04),
    ("0.5B", 16, 2, 0, "none", False, 14, 1, 0.04),
    ("1.5B", 8, 2, 1, "none", False, 6, 1, 0.04),
    ("1.5B", 16, 4, 1, "none", False, 12, 1, 0.04),
    ("7B", 8, 4, 3, "none", True, 4, 1, 0.04),
    ("7B", 16, 8, 2, "none", True, 8, 1, 0.04),
    ("32B", 8, 4, 3, "optimizer", True, 2, 2, 0.04),
    ("32B", 16, 8, 3, "none", True, 2, 4, 0.0),
    ("32B", 16, 8, 3, "optimizer", True, 2, 4, 0.04),
]
HEADER = [
    "| policy | GPUs | learner ranks | ZeRO | offload | grad. ckpt | engines x TP | learner GPU: model states + "
    "reference | host, all ranks | engine GPU: weights, KV room | fits |",
    "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
]


def shape_of(name: str) -> Shape:
    with tempfile.TemporaryDirectory() as model_dir:
        (Path(model_dir) / "config.json").write_text(json.dumps(SHAPES[name]))
        return Shape.of(model_dir)


def config(ranks: int, stage: int, offload: str, checkpointing: bool, engines: int, tp: int, kl_coef: float):
    return validate_config(
        {
            "model": {"path": "unused"},
            "data": {"task": {"name": "last_digit"}},
            "learner": {"num_ranks": ranks, "num_gpus": 1, "zero_stage": stage, "offload": offload,
                        "gradient_checkpointing": checkpointing},
            "rollout": {"num_generators": engines, "tensor_parallel_size": tp, "num_gpus": 1,
                        "gpu_memory_utilization": 0.9},
            "reward": {"functions": [{"name": "math_answer"}]},
            "algorithm": {"kl_coef": kl_coef},
        }
    )  # fmt: skip


def table() -> list[str]:
    lines = list(HEADER)
    for name, gpus, ranks, stage, offload, checkpointing, engines, tp, kl_coef in ROWS:
        cfg = config(ranks, stage, offload, checkpointing, engines, tp, kl_coef)
        result = plan(cfg, shape_of(name))
        states, reference = result.learner["model states"], result.learner.get("reference", 0.0)
        learner = f"{states:.1f} + {reference:.1f} = {states + reference:.1f} GB" if kl_coef else f"{states:.1f} GB"
        host = result.host["model states"]
        engine = f"{result.engine['weights']:.1f} GB, {result.kv_room_tokens / 1e6:.2f}M tokens"
        row = [name, gpus, ranks, stage, offload, "on" if checkpointing else "off", f"{engines} x {tp}", learner,
               f"{host:.0f} GB", engine, "no" if result.problems() else "yes"]  # fmt: skip
        lines.append("| " + " | ".join(str(cell) for cell in row) + " |")
    return lines


def deepspeed_cases(name: str) -> list[dict]:
    """For the model `name`: per-GPU model states and host memory in GB, the plan's (config.json only) against
    DeepSpeed's estimators given the module's own counts (built on the meta device: shapes, no weights; total
    parameters and the largest module's own, as its `*_all_live` helpers count), for ZeRO-2 and -3 with and without
    offload, on 4 and 8 ranks."""
    import itertools

    import torch
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs, model_to_params
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
    from transformers import AutoConfig, AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as model_dir:
        (Path(model_dir) / "config.json").write_text(json.dumps(SHAPES[name]))
        with torch.device("meta"):
            module = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    total = sum(parameter.numel() for parameter in module.parameters())  # (meta tensors share one data_ptr)
    _, largest = model_to_params(module)
    shape = shape_of(name)
    cases = []
    for ranks, stage, offload in itertools.product([4, 8], [2, 3], ["none", "optimizer", "optimizer_and_params"]):
        if offload == "optimizer_and_params" and stage < 3:
            continue
        result = plan(config(ranks, stage, offload, False, 1, 1, 0.0), shape)
        offloaded = offload != "none"
        if stage == 3:
            host, gpu, _ = estimate_zero3_model_states_mem_needs(
                total, largest, ranks, 1, offloaded, offload == "optimizer_and_params", zero_init=False
            )
        else:
            host, gpu = estimate_zero2_model_states_mem_needs(total, ranks, 1, offloaded)
        cases.append(
            {"case": f"| {name} | {ranks} | {stage} | {offload} |", "gpu": (result.learner["model states"], gpu / 1e9),
             "host": (result.host["model states"], host / 1e9)}
        )  # fmt: skip
    return cases


def versus_deepspeed() -> list[str]:
    lines = [
        "| policy | ranks | ZeRO | offload | GPU: plan | GPU: DeepSpeed | ratio | host: plan | host: DeepSpeed "
        "| ratio |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name in ("0.5B", "7B", "32B"):
        for each in deepspeed_cases(name):
            (ours, theirs), (ours_host, theirs_host) = each["gpu"], each["host"]
            lines.append(
                f"{each['case']} {ours:.2f} GB | {theirs:.2f} GB | {ours / theirs:.3f} "
                f"| {ours_host:.1f} GB | {theirs_host:.1f} GB | {ours_host / theirs_host:.3f} |"
            )
    return lines


if __name__ == "__main__":
    print("\n".join(versus_deepspeed() if "--versus-deepspeed" in sys.argv[1:] else table()))

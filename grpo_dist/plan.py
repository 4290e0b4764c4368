"""The memory plan of a config on GPUs (`grpo-dist plan CONFIG`, and part of `check` and `train`'s pre-flight): per
GPU, what a learner rank holds (weights, gradients and optimizer state by ZeRO stage and offload, the reference,
the activations of one micro-batch) and what an engine holds (its share of the weights, the KV cache of one whole
sequence), against `cluster.gpu_memory_gb`. The arithmetic is the README's ("Sizing"): bf16 mixed-precision Adam,
16 B per trained parameter; the model's shape comes from its config.json alone, so a plan needs no weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from grpo_dist.config import Config, ConfigError

GB = 1e9
LOGITS_BYTES = 10  # per vocabulary entry and token: bf16 logits, their fp32 log-softmax and its gradient
PACKED_LOGITS_BYTES = 4  # packed (`learner.packing`): bf16 logits and their gradient; the log-softmax is chunked
CUDA_RESERVED_GB = 2.0  # CUDA context, NCCL buffers and the allocator's slack on every GPU


class NotPlanned(ValueError):
    """A model the plan's arithmetic does not describe."""


@dataclass(frozen=True)
class Shape:
    """What the plan needs of a model: its parameters and the sizes activations and the KV cache scale with."""

    params: int
    hidden: int
    layers: int
    intermediate: int
    vocab: int
    kv_bytes_per_token: int  # bf16 keys and values of one token over all layers

    @classmethod
    def of(cls, model_dir: str | Path) -> Shape:
        """The shape of the decoder-only transformer whose config.json is in `model_dir` (Llama, Qwen and kin)."""
        from transformers import AutoConfig

        c = AutoConfig.from_pretrained(model_dir)
        experts = [getattr(c, name, None) for name in ("num_experts", "num_local_experts", "n_routed_experts")]
        if any(isinstance(count, int) and count > 1 for count in experts):
            raise NotPlanned(f"{c.model_type} is a mixture of experts")
        heads = c.num_attention_heads
        kv_heads = getattr(c, "num_key_value_heads", None) or heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
        attention = c.hidden_size * head_dim * 2 * (heads + kv_heads)  # q and o, k and v
        if c.model_type == "qwen2" or getattr(c, "attention_bias", False):
            attention += (heads + 2 * kv_heads) * head_dim  # q, k and v biases
        if c.model_type == "qwen3":
            attention += 2 * head_dim  # q and k norms
        layer = attention + 3 * c.hidden_size * c.intermediate_size + 2 * c.hidden_size  # gated MLP, two norms
        embeddings = c.vocab_size * c.hidden_size * (1 if getattr(c, "tie_word_embeddings", False) else 2)
        return cls(
            params=c.num_hidden_layers * layer + embeddings + c.hidden_size,
            hidden=c.hidden_size,
            layers=c.num_hidden_layers,
            intermediate=c.intermediate_size,
            vocab=c.vocab_size,
            kv_bytes_per_token=2 * c.num_hidden_layers * kv_heads * head_dim * 2,
        )


@dataclass(frozen=True)
class Plan:
    """Each part's GB per GPU, for a learner rank and an engine; what goes to host memory; whether each fits."""

    learner: dict[str, float]
    engine: dict[str, float]
    host: dict[str, float]
    gpu_gb: float
    engine_budget_gb: float
    kv_room_tokens: int
    params: int

    @property
    def learner_gb(self) -> float:
        return sum(self.learner.values())

    @property
    def engine_gb(self) -> float:
        return sum(self.engine.values())

    def problems(self) -> list[str]:
        found = []
        if self.learner and self.learner_gb > self.gpu_gb - CUDA_RESERVED_GB:
            found.append(
                f"a learner rank needs {self.learner_gb:.1f} GB per GPU, more than the {self.gpu_gb:g} GB of "
                f"cluster.gpu_memory_gb less {CUDA_RESERVED_GB:g} GB for CUDA: add learner ranks "
                "(learner.num_ranks), raise learner.zero_stage, offload (learner.offload), turn on "
                "learner.gradient_checkpointing or lower learner.micro_batch_size (or "
                "learner.max_tokens_per_micro_batch)"
            )
        if self.engine and self.engine_gb > self.engine_budget_gb:
            found.append(
                f"an engine needs {self.engine_gb:.1f} GB per GPU (weights and one whole sequence's KV cache), more "
                f"than its {self.engine_budget_gb:.1f} GB (rollout.gpu_memory_utilization x cluster.gpu_memory_gb): "
                "raise rollout.tensor_parallel_size or lower rollout.max_model_len"
            )
        return found

    def lines(self) -> list[str]:
        out = [f"memory plan per GPU ({self.params / 1e9:.2f}B parameters, {self.gpu_gb:g} GB GPUs):"]
        if self.learner:
            parts = ", ".join(f"{name} {gb:.1f}" for name, gb in self.learner.items())
            out.append(f"  learner rank: {self.learner_gb:.1f} GB ({parts})")
        else:
            out.append("  learner ranks on CPUs (learner.num_gpus 0): host memory, not planned")
        if self.engine:
            parts = ", ".join(f"{name} {gb:.1f}" for name, gb in self.engine.items())
            out.append(
                f"  engine: {self.engine_gb:.1f} of {self.engine_budget_gb:.1f} GB ({parts}); KV room "
                f"{self.kv_room_tokens:,} tokens"
            )
        else:
            out.append("  engines on CPUs (rollout.num_gpus 0): not planned")
        for name, gb in self.host.items():
            out.append(f"  host memory of the learner's nodes: {name} {gb:.1f} GB")
        out.extend(f"  does not fit: {problem}" for problem in self.problems())
        return out


def plan(cfg: Config, shape: Shape) -> Plan:
    """The per-GPU memory of `cfg`'s learner ranks and engines for a model of `shape`."""
    learner, rollout, p = cfg.learner, cfg.rollout, shape.params
    ranks, stage = learner.num_ranks, learner.zero_stage
    weights, grads, optimizer = 2 * p, 2 * p, 12 * p
    if stage >= 1:
        optimizer /= ranks
    if stage >= 2:
        grads /= ranks
    if stage >= 3:
        weights /= ranks
    host = {}
    if learner.offload != "none":
        host["optimizer state"] = 12 * p / GB
        optimizer = 0
    if learner.offload == "optimizer_and_params":
        host["weights"] = weights * ranks / GB
        weights = 0
    tokens = learner.max_tokens_per_micro_batch or learner.micro_batch_size * cfg.sequence_budget
    full_layer = (6 * shape.hidden + 4 * shape.intermediate) * 2  # bytes per token of one layer's intermediates
    if learner.gradient_checkpointing:
        layers = tokens * (shape.hidden * 2 * shape.layers + full_layer)
    else:
        layers = tokens * full_layer * shape.layers
    parts = {"weights": weights, "gradients": grads, "optimizer": optimizer}
    if cfg.algorithm.kl_coef > 0:
        parts["reference"] = 2 * p / (ranks if stage >= 3 else 1)
    parts["activations"] = layers + tokens * shape.vocab * (PACKED_LOGITS_BYTES if learner.packing else LOGITS_BYTES)
    gpu_gb = cfg.cluster.gpu_memory_gb
    tp = rollout.tensor_parallel_size
    budget = rollout.gpu_memory_utilization * gpu_gb
    engine = {
        "weights": 2 * p / tp / GB,
        "KV of one sequence": rollout.max_model_len * shape.kv_bytes_per_token / tp / GB,
    }
    room = max(0, int((budget - engine["weights"]) * GB * tp / shape.kv_bytes_per_token))
    return Plan(
        learner={name: value / GB for name, value in parts.items()} if learner.num_gpus > 0 else {},
        engine=engine if rollout.num_gpus > 0 else {},
        host=host if learner.num_gpus > 0 else {},
        gpu_gb=gpu_gb,
        engine_budget_gb=budget,
        kv_room_tokens=room,
        params=p,
    )


def check_plan(cfg: Config, model_dir: str) -> Plan | None:
    """Print the plan of `cfg` for the model in `model_dir`; raise `ConfigError` with its numbers if it does not
    fit. A model whose config.json is not a dense decoder's (a mixture of experts, ...) is not planned, and said so."""
    try:
        shape = Shape.of(model_dir)
    except (NotPlanned, AttributeError, TypeError, ZeroDivisionError) as err:
        print(f"memory plan: not made for this model ({err}); only dense decoders are planned")
        return None
    result = plan(cfg, shape)
    for line in result.lines():
        print(line)
    if result.problems():
        raise ConfigError("the config does not fit its GPUs: " + "; ".join(result.problems()))
    return result

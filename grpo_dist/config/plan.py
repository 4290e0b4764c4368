"""The memory plan of a config on GPUs (`grpo-dist plan CONFIG`, and part of `check` and `train`'s pre-flight): per
GPU, what a learner rank holds (its model states by ZeRO stage and offload, as DeepSpeed's own estimators count them,
with `learner.lora` those of the adapter and the frozen base's weights; the reference, which LoRA does without; the
activations of one micro-batch), what an engine holds (its share of the weights and the KV cache of one whole
sequence, at the engine's dtype), and with `algorithm.distill` what a teacher engine holds (the same of the teacher,
and the log-probs of one whole sequence read as a prompt), and with `reward.model` on GPUs what a reward-model actor
holds (its weights and one batch's activations), against `cluster.gpu_memory_gb`. The models' shapes come
from their config.json alone, so a plan needs no weights.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from grpo_dist.config import Config, ConfigError
from grpo_dist.config.sections import LoraConfig

GB = 1e9
LOGITS_BYTES = 10  # per vocabulary entry and token: bf16 logits, their fp32 log-softmax and its gradient
PACKED_LOGITS_BYTES = 4  # packed (`learner.packing`): bf16 logits and their gradient; the log-softmax is chunked
PINNED_KV = "KV cache (pinned)"  # an engine's part when `rollout.kv_cache_gb` fixes its cache
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
    largest_layer: int  # parameters of the largest module (ZeRO-3 gathers one whole): the embedding, mostly
    kv_values_per_token: int  # keys and values of one token over all layers
    linear: dict[str, tuple[int, int]]  # (in, out) features of each linear layer of a block by name, and lm_head's
    positions: int | None = None  # `max_position_embeddings`, where the config gives it
    vision_params: int = 0  # of `params`, a vision-language model's vision tower and its connector to the text model

    def adapter_params(self, lora: LoraConfig) -> int:
        """Parameters of `lora`'s adapter on this model: `rank x (in + out)` for every adapted linear layer. A
        target this arithmetic does not know (the pre-flight has checked that it names a linear layer) is counted
        as the block's widest one: an overestimate."""
        widest = max(self.linear.values(), key=sum)
        per_block = sum(sum(self.linear.get(name, widest)) for name in lora.target_modules if name != "lm_head")
        head = sum(self.linear["lm_head"]) if "lm_head" in lora.target_modules else 0
        return lora.rank * (per_block * self.layers + head)

    @classmethod
    def of(cls, model_dir: str | Path) -> Shape:
        """The shape of the decoder-only transformer whose config.json is in `model_dir` (Llama, Qwen and kin); of
        a vision-language model, its text model's, and its vision tower's parameters counted in (`vision_params`)."""
        from transformers import AutoConfig

        whole = AutoConfig.from_pretrained(model_dir)
        c = whole.get_text_config()
        vision = vision_tower_params(whole) if hasattr(whole, "vision_config") else 0
        experts = [getattr(c, name, None) for name in ("num_experts", "num_local_experts", "n_routed_experts")]
        if any(isinstance(count, int) and count > 1 for count in experts):
            raise NotPlanned(f"{c.model_type} is a mixture of experts")
        heads = c.num_attention_heads
        kv_heads = getattr(c, "num_key_value_heads", None) or heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
        h, q, kv, mlp = c.hidden_size, heads * head_dim, kv_heads * head_dim, c.intermediate_size
        linear = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h)}
        linear |= {"gate_proj": (h, mlp), "up_proj": (h, mlp), "down_proj": (mlp, h), "lm_head": (h, c.vocab_size)}
        layer = sum(inputs * outputs for name, (inputs, outputs) in linear.items() if name != "lm_head") + 2 * h
        if c.model_type == "qwen2" or getattr(c, "attention_bias", False):
            layer += (heads + 2 * kv_heads) * head_dim  # q, k and v biases
        if c.model_type == "qwen3":
            layer += 2 * head_dim  # q and k norms
        embeddings = c.vocab_size * c.hidden_size * (1 if getattr(c, "tie_word_embeddings", False) else 2)
        return cls(
            params=c.num_hidden_layers * layer + embeddings + c.hidden_size + vision,
            vision_params=vision,
            hidden=c.hidden_size,
            layers=c.num_hidden_layers,
            intermediate=c.intermediate_size,
            vocab=c.vocab_size,
            largest_layer=max(c.vocab_size, c.intermediate_size, (heads + kv_heads) * head_dim) * c.hidden_size,
            kv_values_per_token=2 * c.num_hidden_layers * kv_heads * head_dim,
            linear=linear,
            positions=getattr(c, "max_position_embeddings", None),
        )


LANGUAGE_MODULES = ("text_model", "language_model", "lm_head")
"""The names under which a vision-language model's Hugging Face class keeps its text model and output head."""


def vision_tower_params(config) -> int:
    """The parameters of a vision-language model's vision tower and connector: its Hugging Face model built on the
    meta device (no memory, no weights read), counting every parameter outside its text model and head."""
    import torch
    from transformers import AutoModelForImageTextToText

    try:
        with torch.device("meta"):
            model = AutoModelForImageTextToText.from_config(config)
    except (ValueError, KeyError) as err:
        raise NotPlanned(f"{config.model_type}: its vision tower cannot be built to count ({err})") from None
    return sum(
        tensor.numel()
        for name, tensor in model.named_parameters()
        if not any(part in LANGUAGE_MODULES for part in name.split("."))
    )


@dataclass(frozen=True)
class Plan:
    """Each part's GB per GPU, for a learner rank and an engine; what goes to host memory; whether each fits."""

    learner: dict[str, float]
    engine: dict[str, float]
    host: dict[str, float]
    engine_dtype: str
    gpu_gb: float
    engine_budget_gb: float
    kv_room_tokens: int
    params: int
    trained: int  # the parameters the optimizer holds: all of them, or a LoRA adapter's
    teacher: dict[str, float] | None = None  # a teacher engine's parts (`algorithm.distill` on GPUs), else None
    teacher_budget_gb: float = 0.0
    scorer: dict[str, float] | None = None  # a reward-model actor's parts (`reward.model` on GPUs), else None
    scorer_budget_gb: float = 0.0
    kv_sequence_gb: float = 0.0  # the KV cache of one whole sequence, per GPU
    vision_params: int = 0  # of `params`, the vision tower's

    @property
    def learner_gb(self) -> float:
        return sum(self.learner.values())

    @property
    def kv_pinned(self) -> bool:
        """Whether the engines' KV cache is fixed in bytes (`rollout.kv_cache_gb`), not sized by vLLM."""
        return PINNED_KV in self.engine

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
            held = "its pinned KV cache" if self.kv_pinned else "one whole sequence's KV cache"
            found.append(
                f"an engine needs {self.engine_gb:.1f} GB per GPU (weights and {held}), more "
                f"than its {self.engine_budget_gb:.1f} GB (rollout.gpu_memory_utilization x cluster.gpu_memory_gb"
                + (
                    "; with a pinned cache vLLM no longer sizes by it, so leave room in it for its activations"
                    if self.kv_pinned
                    else ""
                )
                + "): "
                "raise rollout.tensor_parallel_size or "
                + ("lower rollout.kv_cache_gb" if self.kv_pinned else "lower rollout.max_model_len")
                + (" (or serve in bfloat16: rollout.dtype auto)" if self.engine_dtype == "float32" else "")
            )
        if self.kv_pinned and self.engine[PINNED_KV] < self.kv_sequence_gb:
            found.append(
                f"the engines' KV cache pinned at {self.engine[PINNED_KV]:g} GB (rollout.kv_cache_gb) holds "
                f"less than one whole sequence ({self.kv_sequence_gb:.2f} GB at rollout.max_model_len): raise it or "
                "lower rollout.max_model_len"
            )
        if self.teacher and sum(self.teacher.values()) > self.teacher_budget_gb:
            found.append(
                f"a teacher engine needs {sum(self.teacher.values()):.1f} GB per GPU (weights, one whole sequence's "
                f"KV cache and its log-probs), more than its {self.teacher_budget_gb:.1f} GB "
                "(algorithm.distill.gpu_memory_utilization x cluster.gpu_memory_gb): raise "
                "algorithm.distill.tensor_parallel_size or lower rollout.max_model_len"
            )
        if self.scorer and sum(self.scorer.values()) > self.scorer_budget_gb - CUDA_RESERVED_GB:
            found.append(
                f"a reward-model actor needs {sum(self.scorer.values()):.1f} GB (weights and one batch's "
                f"activations), more than its {self.scorer_budget_gb:g} GB (reward.model.num_gpus x "
                f"cluster.gpu_memory_gb) less {CUDA_RESERVED_GB:g} GB for CUDA: lower reward.model.batch_size or "
                "reward.model.max_length, or raise reward.model.num_gpus"
            )
        return found

    def lines(self) -> list[str]:
        trained = "" if self.trained == self.params else f", {self.trained / 1e6:.1f}M trained by LoRA"
        tower = f", {self.vision_params / 1e9:.2f}B of them the vision tower" if self.vision_params else ""
        out = [f"memory plan per GPU ({self.params / 1e9:.2f}B parameters{tower}{trained}, {self.gpu_gb:g} GB GPUs):"]
        if self.learner:
            parts = ", ".join(f"{name} {gb:.1f}" for name, gb in self.learner.items())
            out.append(f"  learner rank: {self.learner_gb:.1f} GB ({parts})")
        else:
            out.append("  learner ranks on CPUs (learner.num_gpus 0): host memory, not planned")
        if self.engine:
            parts = ", ".join(f"{name} {gb:.1f}" for name, gb in self.engine.items())
            out.append(
                f"  engine at {self.engine_dtype}: {self.engine_gb:.1f} of {self.engine_budget_gb:.1f} GB ({parts}); "
                f"KV room {self.kv_room_tokens:,} tokens"
            )
            if self.kv_pinned:
                out.append(
                    f"  KV cache: pinned at {self.engine[PINNED_KV]:g} GB per GPU (rollout.kv_cache_gb), "
                    "whatever vLLM's version"
                )
            else:
                out.append(
                    "  KV cache: sized by vLLM at start from the budget less its activations (moves between vLLM "
                    "versions); pin it with rollout.kv_cache_gb"
                )
        else:
            out.append("  engines on CPUs (rollout.num_gpus 0): not planned")
        if self.teacher:
            parts = ", ".join(f"{name} {gb:.1f}" for name, gb in self.teacher.items())
            out.append(
                f"  teacher engine: {sum(self.teacher.values()):.1f} of {self.teacher_budget_gb:.1f} GB ({parts})"
            )
        if self.scorer:
            parts = ", ".join(f"{name} {gb:.1f}" for name, gb in self.scorer.items())
            out.append(f"  reward model: {sum(self.scorer.values()):.1f} of {self.scorer_budget_gb:g} GB ({parts})")
        for name, gb in self.host.items():
            out.append(f"  host memory of the learner's nodes together: {name} {gb:.1f} GB (DeepSpeed's estimate)")
        out.extend(f"  does not fit: {problem}" for problem in self.problems())
        return out


ENGINE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "auto": 2}
"""Bytes per weight and KV value of an engine on a GPU, by `rollout.dtype`: auto is the model's own dtype there (vLLM
serves a float32 checkpoint in bfloat16 on a GPU)."""


def model_states(p: int, largest: int, ranks: int, stage: int, offload: str) -> tuple[float, float]:
    """(bytes per GPU, bytes of host memory over the learner's nodes) of the policy's weights, gradients and Adam
    state under bf16 mixed precision, as DeepSpeed's estimators count them: 2 B bf16 weights, and 18 B of gradients
    (bf16 and fp32), fp32 master weights and Adam's two moments per parameter. ZeRO-2 and -3 are DeepSpeed's own
    functions (ranks on one node: host memory for all of them); ZeRO-0 and -1, for which DeepSpeed has none, follow
    the same count (ZeRO-1 shards the fp32 part, 16 B, ZeRO-0 nothing)."""
    estimate_zero2, estimate_zero3 = _deepspeed_estimators()
    offloaded = offload != "none"
    if stage == 3:
        host, gpu, _ = estimate_zero3(
            p, largest, ranks, 1, offloaded, offload == "optimizer_and_params", zero_init=False
        )
    elif stage == 2 or offloaded:
        host, gpu = estimate_zero2(p, ranks, 1, offloaded)
    else:
        host, _ = estimate_zero2(p, ranks, 1, False)
        gpu = 2 * p + 2 * p + 16 * p / ranks if stage == 1 else 20 * p
    return gpu, host


def _deepspeed_estimators():
    """DeepSpeed's ZeRO-2 and ZeRO-3 model-state estimators, imported without its line about a machine with no GPU
    (which would land in the plan's output)."""
    import torch

    quiet = {} if torch.cuda.is_available() or "DS_ACCELERATOR" in os.environ else {"DS_ACCELERATOR": "cpu"}
    os.environ.update(quiet)
    try:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
    finally:
        for name in quiet:
            del os.environ[name]
    return estimate_zero2_model_states_mem_needs, estimate_zero3_model_states_mem_needs


def plan(cfg: Config, shape: Shape, teacher: Shape | None = None, scorer: Shape | None = None) -> Plan:
    """The per-GPU memory of `cfg`'s learner ranks and engines for a model of `shape` (and of its teacher engines,
    for a teacher of shape `teacher`, and of its reward-model actors, for a reward model of shape `scorer`)."""
    learner, rollout, p = cfg.learner, cfg.rollout, shape.params
    ranks, stage = learner.num_ranks, learner.zero_stage
    trained = shape.adapter_params(learner.lora) if learner.lora else p
    states, host_bytes = model_states(trained, shape.largest_layer, ranks, stage, learner.offload)
    if learner.lora:  # the frozen base: its weights alone, in the training dtype (partitioned under ZeRO-3)
        states += 2 * p / (ranks if stage == 3 else 1)
    tokens = learner.max_tokens_per_micro_batch or learner.micro_batch_size * cfg.sequence_budget
    full_layer = (6 * shape.hidden + 4 * shape.intermediate) * 2  # bytes per token of one layer's intermediates
    if learner.gradient_checkpointing:
        layers = tokens * (shape.hidden * 2 * shape.layers + full_layer)
    else:
        layers = tokens * full_layer * shape.layers
    parts = {"model states": states}
    if cfg.algorithm.kl_coef > 0 and not learner.lora:  # LoRA's reference is the base with the adapter off
        parts["reference"] = 2 * p / (ranks if stage >= 3 else 1)
    parts["activations"] = layers + tokens * shape.vocab * (PACKED_LOGITS_BYTES if learner.packing else LOGITS_BYTES)
    gpu_gb = cfg.cluster.gpu_memory_gb
    tp, width = rollout.tensor_parallel_size, ENGINE_BYTES[rollout.dtype]
    budget = rollout.gpu_memory_utilization * gpu_gb
    kv_bytes_per_token = shape.kv_values_per_token * width
    engine = {
        "weights": width * p / tp / GB,
        "KV of one sequence": rollout.max_model_len * kv_bytes_per_token / tp / GB,
    }
    if learner.lora and learner.lora.serve == "adapter":  # max_staleness + 2 slots of every block's linear layers
        slot = LoraConfig(rank=learner.lora.slot_rank, target_modules=[n for n in shape.linear if n != "lm_head"])
        engine["LoRA slots"] = (rollout.max_staleness + 2) * shape.adapter_params(slot) * width / tp / GB
    held = engine["weights"] + engine.get("LoRA slots", 0.0)
    kv_gb = rollout.kv_cache_gb if rollout.kv_cache_gb is not None else budget - held  # pinned, or what is left
    room = max(0, int(kv_gb * GB * tp / kv_bytes_per_token))
    sequence_gb = engine["KV of one sequence"]
    if rollout.kv_cache_gb is not None:  # the whole cache is held, in place of the one sequence it must hold
        del engine["KV of one sequence"]
        engine[PINNED_KV] = rollout.kv_cache_gb
    return Plan(
        learner={name: value / GB for name, value in parts.items()} if learner.num_gpus > 0 else {},
        engine=engine if rollout.num_gpus > 0 else {},
        host={"model states": host_bytes / GB} if learner.num_gpus > 0 else {},
        engine_dtype="the model's dtype" if rollout.dtype == "auto" else rollout.dtype,
        gpu_gb=gpu_gb,
        engine_budget_gb=budget,
        kv_room_tokens=room,
        kv_sequence_gb=sequence_gb,
        params=p,
        trained=trained,
        vision_params=shape.vision_params,
        **teacher_engine(cfg, teacher),
        **reward_model_actor(cfg, scorer),
    )


def teacher_engine(cfg: Config, shape: Shape | None) -> dict:
    """A teacher engine's parts per GPU and its budget (`Plan.teacher`, `Plan.teacher_budget_gb`): its share of the
    teacher's weights and of one whole sequence's KV cache, and that sequence's log-probs (float32 logits and their
    log-softmax over the vocabulary at every position, which every worker computes whole)."""
    distill = cfg.algorithm.distill
    if distill is None or shape is None or distill.num_gpus == 0:
        return {}
    tp, width, length = distill.tensor_parallel_size, ENGINE_BYTES[distill.dtype], cfg.rollout.max_model_len
    parts = {
        "weights": width * shape.params / tp / GB,
        "KV of one sequence": length * shape.kv_values_per_token * width / tp / GB,
        "log-probs of one sequence": length * shape.vocab * 4 * 2 / GB,
    }
    return {"teacher": parts, "teacher_budget_gb": distill.gpu_memory_utilization * cfg.cluster.gpu_memory_gb}


def reward_model_actor(cfg: Config, shape: Shape | None) -> dict:
    """A reward-model actor's parts (`Plan.scorer`, `Plan.scorer_budget_gb`): the model's weights at its dtype and
    one batch's activations in a forward without gradients (one layer's intermediates at a time, and the hidden
    states it passes on), against its GPUs' memory."""
    model = cfg.reward.model
    if model is None or shape is None or model.num_gpus == 0:
        return {}
    tokens = model.batch_size * model.length(shape.positions)
    width = ENGINE_BYTES[model.dtype]
    parts = {
        "weights": width * shape.params / GB,
        "activations": tokens * ((6 * shape.hidden + 4 * shape.intermediate) + 2 * shape.hidden) * width / GB,
    }
    return {"scorer": parts, "scorer_budget_gb": model.num_gpus * cfg.cluster.gpu_memory_gb}


def _side_shape(model_dir: str | None, what: str) -> Shape | None:
    """The shape of a model beside the policy (a teacher, a reward model), or None, said so where it cannot be
    planned."""
    if model_dir is None:
        return None
    try:
        return Shape.of(model_dir)
    except (NotPlanned, AttributeError, TypeError, ZeroDivisionError) as err:
        print(f"memory plan: {what} not planned ({err}); only dense decoders are planned")
        return None


def check_plan(
    cfg: Config, model_dir: str, teacher_dir: str | None = None, scorer_dir: str | None = None
) -> Plan | None:
    """Print the plan of `cfg` for the model in `model_dir` (and the teacher in `teacher_dir`, the reward model in
    `scorer_dir`); raise `ConfigError` with its numbers if it does not fit. A model whose config.json is not a dense
    decoder's (a mixture of experts, ...) is not planned, and said so."""
    try:
        shape = Shape.of(model_dir)
    except (NotPlanned, AttributeError, TypeError, ZeroDivisionError) as err:
        print(f"memory plan: not made for this model ({err}); only dense decoders are planned")
        return None
    teacher, scorer = _side_shape(teacher_dir, "the teacher's engines"), _side_shape(scorer_dir, "the reward model")
    result = plan(cfg, shape, teacher, scorer)
    for line in result.lines():
        print(line)
    if result.problems():
        raise ConfigError("the config does not fit its GPUs: " + "; ".join(result.problems()))
    return result

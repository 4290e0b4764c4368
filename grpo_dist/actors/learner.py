"""Learner actor: the policy under DeepSpeed, the frozen reference, and one optimizer update per rollout batch.

The learner is algorithm-blind: advantages arrive with the batch; it scores tokens, runs `grpo_dist.algo.policy_loss`
and steps. Old logprobs are the learner's own before the first update; with one epoch and one mini-batch they are
the current logprobs detached (ratio exactly 1) and no extra forward pass is spent.
"""

from __future__ import annotations

import math
import os
import socket
from pathlib import Path

import torch
import torch.nn.functional as F

from grpo_dist.algo import policy_loss
from grpo_dist.batch import TrainBatch
from grpo_dist.config import AlgorithmConfig, LearnerConfig, RolloutConfig


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """[B, T] logprob of each token given the ones before it, aligned with `input_ids` (position 0 gets 0)."""
    log_probs = _shifted_log_softmax(logits, temperature)  # [B, T-1, V]
    picked = log_probs.gather(-1, input_ids[:, 1:, None]).squeeze(-1)  # [B, T-1]
    return F.pad(picked, (1, 0))  # [B, T]


def token_logprobs_and_entropy(
    logits: torch.Tensor, input_ids: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`token_logprobs` and the entropy of each next-token distribution, both [B, T] (position 0 gets 0)."""
    log_probs = _shifted_log_softmax(logits, temperature)  # [B, T-1, V]
    picked = log_probs.gather(-1, input_ids[:, 1:, None]).squeeze(-1)  # [B, T-1]
    entropy = -(log_probs.exp() * log_probs).sum(-1)  # [B, T-1]
    return F.pad(picked, (1, 0)), F.pad(entropy, (1, 0))  # [B, T] each


def _shifted_log_softmax(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Log-softmax of the logits predicting tokens 1..T-1, at the sampling temperature. [B, T, V] -> [B, T-1, V]"""
    return F.log_softmax(logits[:, :-1].float() / temperature, dim=-1)


class Learner:
    """Holds the policy (DeepSpeed engine) and, when kl_coef > 0, the reference. Made a Ray actor in `cluster`."""

    def __init__(
        self, model_path: str, learner: LearnerConfig, algorithm: AlgorithmConfig, rollout: RolloutConfig, seed: int
    ) -> None:
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        self.model_path = model_path
        self.cfg, self.algo = learner, algorithm
        self.temperature = rollout.temperature  # tokens are scored at the temperature they were sampled at
        self.max_new_tokens = rollout.max_new_tokens  # Dr. GRPO's constant normaliser
        self.weight_version = 0
        self._init_distributed()
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        self.engine = self._deepspeed_engine(model)
        self.device = self.engine.device
        self.reference = None
        if algorithm.kl_coef > 0:
            self.reference = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(self.device)
            self.reference.eval().requires_grad_(False)

    def _init_distributed(self) -> None:
        import deepspeed

        for key, value in {"MASTER_ADDR": "127.0.0.1", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}.items():
            os.environ.setdefault(key, value)
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        backend = self.cfg.dist_backend
        if backend == "auto":
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        deepspeed.init_distributed(dist_backend=backend, verbose=False)

    def _deepspeed_engine(self, model):
        import deepspeed

        optimizer = torch.optim.AdamW(
            model.parameters(), lr=self.cfg.lr, betas=self.cfg.betas, weight_decay=self.cfg.weight_decay
        )
        warmup = self.cfg.warmup_steps
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / (warmup + 1)))
        ds_config = {
            "train_micro_batch_size_per_gpu": self.cfg.micro_batch_size,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": self.cfg.max_grad_norm,
            "zero_optimization": {"stage": self.cfg.zero_stage},
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config)
        return engine

    def train(self, batch: TrainBatch) -> dict[str, float]:
        """`ppo_epochs` x `mini_batches` optimizer updates on one rollout batch; bumps the weight version."""
        batch = batch.to(self.device)
        mini_batches = self._split(len(batch), self.algo.mini_batches)
        reuse = self.algo.ppo_epochs > 1 or len(mini_batches) > 1
        old_logprobs = self._logprobs(self.engine.module, batch) if reuse else None  # [B, T]
        ref_logprobs = self._logprobs(self.reference, batch) if self.reference is not None else None  # [B, T]
        history: list[dict[str, float]] = []
        for _ in range(self.algo.ppo_epochs):
            for rows in mini_batches:
                history.append(self._update(batch, rows, old_logprobs, ref_logprobs))
        self.weight_version += 1
        metrics = {key: sum(step[key] for step in history) / len(history) for key in history[0]}
        metrics["lr"] = self.engine.get_lr()[0]
        return metrics

    def _update(self, batch: TrainBatch, rows: torch.Tensor, old_logprobs, ref_logprobs) -> dict[str, float]:
        """One optimizer step over the given rows, accumulated over micro-batches."""
        micro_batches = self._split(len(rows), math.ceil(len(rows) / self.cfg.micro_batch_size))
        self.engine.set_gradient_accumulation_boundary(False)
        totals: dict[str, float] = {}
        tokens_total = batch.completion_mask[rows].sum().clamp(min=1)
        for index, micro in enumerate(micro_batches):
            select = rows[micro]
            share = self._share(batch, select, len(rows), tokens_total)
            self.engine.set_gradient_accumulation_boundary(index == len(micro_batches) - 1)
            loss, metrics = self._micro_loss(batch.select(select), select, old_logprobs, ref_logprobs)
            self.engine.backward(loss * share, scale_wrt_gas=False)
            for key, value in metrics.items():
                totals[key] = totals.get(key, 0.0) + value * share
        unsharded_norm = self._unsharded_grad_norm()
        self.engine.step()
        grad_norm = self.engine.get_global_grad_norm() if unsharded_norm is None else unsharded_norm
        totals["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        return totals

    def _unsharded_grad_norm(self) -> float | None:
        """Pre-clipping gradient norm without ZeRO (DeepSpeed reports it only for ZeRO stages)."""
        if self.cfg.zero_stage != 0:
            return None
        grads = [p.grad for p in self.engine.module.parameters() if p.grad is not None]
        return torch.nn.utils.get_total_norm(grads).item() if grads else 0.0

    def _micro_loss(self, micro: TrainBatch, rows, old_logprobs, ref_logprobs):
        logits = self.engine(input_ids=micro.input_ids, attention_mask=micro.attention_mask).logits  # [b, T, V]
        logprobs, entropy = token_logprobs_and_entropy(logits, micro.input_ids, self.temperature)  # [b, T] each
        old = logprobs.detach() if old_logprobs is None else old_logprobs[rows]
        loss, metrics = policy_loss(
            logprobs,
            old,
            micro.advantages,
            micro.completion_mask,
            clip_low=self.algo.clip_low,
            clip_high=self.algo.clip_high,
            dual_clip=self.algo.dual_clip,
            ratio_level=self.algo.ratio_level,
            aggregation=self.algo.aggregation,
            max_length=self.max_new_tokens,
            ref_logprobs=None if ref_logprobs is None else ref_logprobs[rows],
            kl_coef=self.algo.kl_coef,
            kl_estimator=self.algo.kl_estimator,
            sampling_logprobs=micro.sampling_logprobs if self.algo.is_cap is not None else None,
            is_cap=self.algo.is_cap or 2.0,
            entropy=entropy,
            entropy_coef=self.algo.entropy_coef,
        )
        metrics["loss"] = loss.item()
        return loss, metrics

    def _share(self, batch: TrainBatch, select: torch.Tensor, rows: int, tokens_total: torch.Tensor) -> float:
        """Weight of a micro-batch's loss so the accumulated gradient equals the whole mini-batch's."""
        if self.algo.aggregation == "token-mean":
            return float(batch.completion_mask[select].sum() / tokens_total)
        return len(select) / rows

    @staticmethod
    def _split(size: int, parts: int) -> list[torch.Tensor]:
        """Row indices cut into `parts` near-equal chunks (never empty)."""
        return list(torch.arange(size).tensor_split(min(parts, size)))

    @torch.no_grad()
    def _logprobs(self, model, batch: TrainBatch) -> torch.Tensor:
        """[B, T] logprobs of every token under `model`, computed micro-batch by micro-batch."""
        parts = []
        for rows in self._split(len(batch), math.ceil(len(batch) / self.cfg.micro_batch_size)):
            micro = batch.select(rows)
            logits = model(input_ids=micro.input_ids, attention_mask=micro.attention_mask).logits
            parts.append(token_logprobs(logits, micro.input_ids, self.temperature))
        return torch.cat(parts)

    def sequence_logprobs(self, token_ids: list[int]) -> list[float]:
        """Logprob of each token after the first under the current policy, at temperature 1 (for checks)."""
        input_ids = torch.tensor([token_ids], device=self.device)
        with torch.no_grad():
            logits = self.engine.module(input_ids=input_ids).logits
        return token_logprobs(logits, input_ids, 1.0)[0, 1:].tolist()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Full, unsharded weights on the CPU in Hugging Face names (gathered across ranks under ZeRO-3)."""
        import deepspeed

        module = self.engine.module
        params = list(module.parameters())
        with deepspeed.zero.GatheredParameters(params, enabled=self.cfg.zero_stage == 3):
            return {name: tensor.detach().to("cpu", copy=True) for name, tensor in module.state_dict().items()}

    def save(self, out_dir: str) -> str:
        """Save the policy with the initial model's tokenizer in Hugging Face format (loadable by transformers and
        vLLM)."""
        from transformers import AutoTokenizer

        Path(out_dir).mkdir(parents=True, exist_ok=True)
        self.engine.module.save_pretrained(out_dir, state_dict=self.state_dict(), safe_serialization=True)
        AutoTokenizer.from_pretrained(self.model_path).save_pretrained(out_dir)
        return out_dir

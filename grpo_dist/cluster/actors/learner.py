"""Learner rank: one data-parallel rank of the policy under DeepSpeed, its part of the frozen reference, and one
optimizer update per rollout batch.

The learner is algorithm-blind: advantages arrive with the batch; it scores tokens, runs `grpo_dist.algo.policy_loss`
and steps. Old logprobs are the learner's own before the first update; with one epoch and one mini-batch they are
the current logprobs detached (ratio exactly 1) and no extra forward pass is spent.

Several ranks form one DeepSpeed engine (`grpo_dist.cluster.learner_group` starts them and splits each batch). Each rank
weights its micro-batch losses by their share of the whole mini-batch times the world size, so DeepSpeed's average
of the ranks' gradients is the single-rank gradient of the whole batch. Every rank runs the same number of forward
passes (a rank short of rows runs a placeholder row weighted 0): under ZeRO-3 a forward gathers parameters from all
ranks. The reference model is a full copy on each rank under ZeRO 0-2 and sharded over the ranks under ZeRO-3.
"""

from __future__ import annotations

import gc
import math
import os
import random
import socket
import time
from pathlib import Path

import psutil
import ray
import torch

from grpo_dist.algo import policy_loss
from grpo_dist.algo.batch import TrainBatch, TrainShard
from grpo_dist.algo.scoring import scores, shares_prompts, token_logprobs, use_packed_attention
from grpo_dist.algo.throughput import flop_params, peak_flops, step_flops
from grpo_dist.cluster.actors.learner_weights import LearnerWeights
from grpo_dist.cluster.ray_cluster import share_of_cores
from grpo_dist.config import AlgorithmConfig, InjectConfig, LearnerConfig, RolloutConfig
from grpo_dist.faults.inject import Injector
from grpo_dist.models import lora, vision
from grpo_dist.sandbox.privileges import die_with_parent
from grpo_dist.storage import safe_load

RAY_WORKER_PORTS_END = 19999  # Ray's workers listen on 10002-19999 by default


def free_port() -> int:
    """A port to rendezvous on, free now. Drawn at random between Ray's worker ports and the kernel's ephemeral
    range, where nothing that asks the kernel for any port (gloo's connections, Ray's own servers, outgoing
    sockets) can take it before the group's store listens on it; the kernel's choice where that range is empty."""
    low, _ = (int(part) for part in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    candidates = list(range(RAY_WORKER_PORTS_END + 1, low))
    for port in random.sample(candidates, min(64, len(candidates))):
        with socket.socket() as sock:
            try:
                sock.bind(("", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


class FiniteAdamW(torch.optim.AdamW):
    """AdamW that drops a step whose gradients are not all finite, as DeepSpeed's own optimizers do: it sets
    `overflow`, which the engine reads to count the step skipped and leave the schedule where it was. Without ZeRO
    and in float32 it is the optimizer DeepSpeed steps directly (its gradients already reduced over the ranks, so
    every rank decides alike); a bf16 or fp16 wrapper checks first and never calls it then."""

    overflow = False

    def step(self, closure=None):
        grads = [param.grad for group in self.param_groups for param in group["params"] if param.grad is not None]
        self.overflow = bool(grads) and not all(torch.isfinite(norm) for norm in torch._foreach_norm(grads))
        return None if self.overflow else super().step(closure)


class Learner(LearnerWeights):
    """One learner rank: the policy (DeepSpeed engine) and, when kl_coef > 0, the reference. Made a Ray actor by
    `grpo_dist.cluster.learner_group`; `setup` joins the ranks' process group and builds the engines."""

    def __init__(
        self,
        model_path: str,
        learner: LearnerConfig,
        algorithm: AlgorithmConfig,
        rollout: RolloutConfig,
        seed: int,
        inject: InjectConfig | None = None,
    ) -> None:
        """`inject`: the faults the run injects (`faults.inject`; none by default)."""
        die_with_parent()
        self.model_path, self.seed = model_path, seed
        self.cfg, self.algo = learner, algorithm
        self.temperature = rollout.temperature  # tokens are scored at the temperature they were sampled at
        self.max_new_tokens = rollout.max_new_tokens  # Dr. GRPO's constant normaliser
        self.weight_version = 0
        self.rank = 0
        self.done = 0  # forward passes and optimizer steps finished: the heartbeat of a training step
        self.injected = Injector(inject or InjectConfig())

    def inject_faults(self, inject: InjectConfig) -> None:
        """The faults a new run handed to this rank injects (`faults.inject`), none met yet."""
        self.injected = Injector(inject)

    @ray.method(concurrency_group="heartbeat")
    def progress(self) -> int:
        """How far this rank has got (answered by a thread of its own while a step runs): the driver's bound on a
        training step is on this count not moving (`faults.gather_progressing`)."""
        return self.done

    def node(self) -> tuple[str, str]:
        """(node id, node IP) of this rank's process, for the group's rendezvous and local ranks."""
        import ray

        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

    def free_port(self) -> int:
        return free_port()

    def setup(
        self,
        rank: int,
        world_size: int,
        local_rank: int,
        local_world_size: int,
        master: tuple[str, int],
        collective_timeout_s: float,
        runs_sharing: int,
    ):
        """Join the ranks' process group and build the policy and reference engines (collective: every rank
        calls it at once); a collective that waits past `collective_timeout_s` on a peer fails. `runs_sharing`: the
        runs sharing the machine's cores (`grpo_dist.cluster.ray_cluster.cpu_share`). Returns the torch threads this
        rank uses."""
        self.rank = rank
        torch.set_num_threads(self._threads(local_world_size, runs_sharing))
        self._init_distributed(rank, world_size, local_rank, master, collective_timeout_s)
        self._build()
        return torch.get_num_threads()

    def reset(self, learner: LearnerConfig, algorithm: AlgorithmConfig, rollout: RolloutConfig, seed: int) -> None:
        """Begin a new run in this process, in the same process group: the settings given (the same ZeRO stage,
        offload and backend: the group restarts otherwise) and the initial model's weights, a fresh optimizer and
        reference (collective: every rank calls it at once)."""
        self.cfg, self.algo, self.seed = learner, algorithm, seed
        self.temperature, self.max_new_tokens = rollout.temperature, rollout.max_new_tokens
        self.weight_version = 0
        self._release()
        self._build()

    def _release(self) -> None:
        """Let the policy, optimizer and reference go: DeepSpeed's engines destroyed (their hooks and buffers) and,
        under ZeRO-3, taken off the module stack DeepSpeed keeps for the process, which would hold them forever."""
        from deepspeed.runtime.zero import parameter_offload

        modules = [self.engine.module, self.reference]
        for engine in (self.engine, self.reference_engine):
            if engine is not None:
                engine.destroy()
        stack = parameter_offload.FWD_MODULE_STACK
        stack[:] = [module for module in stack if not any(module is gone for gone in modules)]
        self.engine = self.reference = self.reference_engine = self.weight_sender = None
        gc.collect()

    def _build(self) -> None:
        """The policy's DeepSpeed engine from the initial model (of a vision-language model, with the image processor
        its forward's pixels come from), and the reference when the KL needs one."""
        torch.manual_seed(self.seed)
        model = vision.load_policy(self.model_path, torch.float32)
        self.image_processor, self.row_pixels = None, None
        if vision.is_vision_model(self.model_path):
            from transformers import AutoProcessor

            self.image_processor = AutoProcessor.from_pretrained(self.model_path).image_processor
        if self.cfg.packing:
            use_packed_attention(model)
        if self.cfg.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if self.cfg.lora is not None:
            model = lora.wrap(model, self.cfg.lora)
        self.engine = self._deepspeed_engine(model)
        self.device = self.engine.device
        self.share_prompts = shares_prompts(self.device, model.config.get_text_config())  # packed: a prompt once
        placeholders = vision.placeholder_ids(self.model_path)  # never sampled (`grpo_dist.models.vision`)
        self.banned = torch.tensor(placeholders, device=self.device) if placeholders else None
        self.reference_engine = None  # the reference's DeepSpeed engine, under ZeRO-3
        self.reference = self._reference() if self.algo.kl_coef > 0 else None
        shape = model.config.get_text_config()
        self.shape = (flop_params(self.engine.module), shape.num_hidden_layers, shape.hidden_size)
        device_name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else None
        self.peak_flops = peak_flops(device_name, self.bf16)

    def _threads(self, local_world_size: int, runs_sharing: int) -> int:
        """`learner.threads`, else with a GPU the CPUs reserved, else the node's cores shared by its ranks and by the
        other runs sharing the machine."""
        if self.cfg.threads is not None:
            return self.cfg.threads
        if torch.cuda.is_available():
            return max(1, int(self.cfg.num_cpus))
        return share_of_cores(local_world_size * runs_sharing)

    def _init_distributed(
        self, rank: int, world_size: int, local_rank: int, master: tuple[str, int], timeout_s: float
    ) -> None:
        from datetime import timedelta

        import deepspeed

        from grpo_dist.algo import native_ops

        native_ops.load(native_ops.needed(self.cfg.offload, torch.cuda.is_available()))
        address, port = master
        os.environ.update(
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_RANK=str(local_rank),
            MASTER_ADDR=address,
            MASTER_PORT=str(port),
        )
        if torch.cuda.is_available():
            torch.cuda.set_device(0)  # Ray gives each rank its own GPU as device 0
        deepspeed.init_distributed(dist_backend=self._backend(), verbose=False, timeout=timedelta(seconds=timeout_s))

    def _backend(self) -> str:
        backend = self.cfg.dist_backend
        return ("nccl" if torch.cuda.is_available() else "gloo") if backend == "auto" else backend

    @property
    def bf16(self) -> bool:
        """Train in bf16 (fp32 master weights): `learner.dtype`, auto meaning with a GPU."""
        return self.cfg.dtype == "bfloat16" or (self.cfg.dtype == "auto" and torch.cuda.is_available())

    def _zero_config(self, stage: int) -> dict:
        zero: dict = {"stage": stage}
        pin = torch.cuda.is_available()
        if self.cfg.offload in ("optimizer", "optimizer_and_params") and stage >= 1:
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": pin}
        if self.cfg.offload == "optimizer_and_params" and stage == 3:
            zero["offload_param"] = {"device": "cpu", "pin_memory": pin}
        return zero

    def _ds_config(self, stage: int) -> dict:
        return {
            "train_micro_batch_size_per_gpu": self.cfg.micro_batch_size,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": self.cfg.max_grad_norm,
            "zero_optimization": self._zero_config(stage),
            "bf16": {"enabled": self.bf16, "check_grad_overflow": True},  # a non-finite update dropped
            "zero_force_ds_cpu_optimizer": False,
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }

    def _reference(self):
        """The frozen reference: with LoRA the policy with its adapter off (the same weights), else sharded over the
        ranks by a ZeRO-3 inference engine under ZeRO-3, else a full copy on this rank."""
        import deepspeed

        if self.cfg.lora is not None:
            return lora.AdapterOff(self.engine.module)

        dtype = torch.bfloat16 if self.bf16 else torch.float32
        reference = vision.load_policy(self.model_path, dtype).eval().requires_grad_(False)
        if self.cfg.packing:
            use_packed_attention(reference)
        if self.cfg.zero_stage != 3:
            return reference.to(self.device)
        config = {**self._ds_config(3), "gradient_clipping": 0.0}
        config["zero_optimization"].pop("offload_optimizer", None)
        self.reference_engine, *_ = deepspeed.initialize(model=reference, config=config)
        return self.reference_engine.module

    def _deepspeed_engine(self, model):
        import deepspeed

        options = {"lr": self.cfg.lr, "betas": self.cfg.betas, "weight_decay": self.cfg.weight_decay}
        trained = [param for param in model.parameters() if param.requires_grad]  # with LoRA: the adapter's
        if self.cfg.offload == "none":  # ZeRO's own optimizer checks the norm first (and takes torch's AdamW only)
            optimizer = (FiniteAdamW if self.cfg.zero_stage == 0 else torch.optim.AdamW)(trained, **options)
        else:  # the optimizer step runs on the CPU: DeepSpeed's vectorised Adam
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            optimizer = DeepSpeedCPUAdam(trained, adamw_mode=True, **options)
        warmup = self.cfg.warmup_steps
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / (warmup + 1)))
        engine, *_ = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=self._ds_config(self.cfg.zero_stage)
        )
        allowed = safe_load.deepspeed_classes()
        engine.checkpoint_engine.load = lambda path, map_location=None: safe_load.load(path, allowed, map_location)
        return engine

    def train(self, shard: TrainShard) -> dict[str, float]:
        """`ppo_epochs` x mini-batches optimizer updates on this rank's shard of a rollout batch (collective: every
        rank calls it with its own shard). Metrics are this rank's share of the whole batch's: the group sums
        them over the ranks. Bumps the weight version."""
        started = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        batch, self.host_batch = shard.batch.to(self.device), shard.batch
        self.row_pixels = self._row_pixels(shard.batch)
        reuse = self.algo.ppo_epochs > 1 or len(shard.mini_batches) > 1
        if self.algo.old_logprobs == "sampler":
            old_logprobs = batch.sampling_logprobs  # [b, T]
        else:  # the learner's own: before the first update, or in the update's own forward pass if it is the only one
            old_logprobs = self._logprobs(self.engine.module, batch, shard) if reuse else None  # [b, T]
        ref_logprobs = self._logprobs(self.reference, batch, shard) if self.reference is not None else None  # [b, T]
        history: list[dict[str, float]] = []
        lr_factor = self.injected.lr_factor(self.weight_version + 1)
        if lr_factor != 1:
            self.scale_lr(lr_factor)
        for _ in range(self.algo.ppo_epochs):
            for index in range(len(shard.mini_batches)):
                history.append(self._update(batch, shard, index, old_logprobs, ref_logprobs))
        if lr_factor != 1:
            self.scale_lr(1 / lr_factor)
        self.weight_version += 1
        self.injected.trained(self.weight_version)
        metrics = {key: sum(step[key] for step in history) / len(history) for key in history[0]}
        metrics["logprob_gap"] = history[0]["logprob_gap"]  # before any update of this step: the engines' policy's
        metrics["learner/skipped"] = sum(step["learner/skipped"] for step in history)
        metrics["lr"] = self.engine.get_lr()[0]
        metrics.update(self._work(shard, old_logprobs is not None and self.algo.old_logprobs != "sampler"))
        metrics["time/learner_busy"] = time.perf_counter() - started
        return metrics

    def scale_lr(self, factor: float) -> float:
        """Multiply the learning rate by `factor` from the next update on (the schedule's base too, so that
        checkpoints keep it); returns the new base rate (collective in effect: every rank is asked)."""
        scheduler = self.engine.lr_scheduler
        scheduler.base_lrs = [rate * factor for rate in scheduler.base_lrs]
        for group in scheduler.optimizer.param_groups:
            group["lr"] *= factor
        return scheduler.base_lrs[0]

    def _work(self, shard: TrainShard, old_pass: bool) -> dict[str, float]:
        """The tokens this rank trained on (its rows, not the placeholder of a rank without any), the model FLOPs
        of the passes it made over them (`grpo_dist.algo.throughput`), and the most memory it held: the device's peak
        allocation on a GPU, the process's resident memory on a CPU."""
        rows = sorted({row for rows in shard.mini_batches for row in rows})
        lengths = shard.batch.attention_mask[rows].sum(dim=1).tolist()
        forwards = int(old_pass) + int(self.reference is not None)
        flops = step_flops(lengths, *self.shape, passes=self.algo.ppo_epochs, forwards=forwards)
        if self.device.type == "cuda":
            memory = torch.cuda.max_memory_allocated(self.device)
        else:
            memory = psutil.Process().memory_info().rss
        return {
            "tokens/trained": float(sum(lengths)),
            "learner/flops": flops,
            "learner/peak_flops": self.peak_flops,
            "memory/learner_gb": memory / 1e9,
        }

    def _update(self, batch: TrainBatch, shard: TrainShard, index: int, old_logprobs, ref_logprobs):
        """One optimizer step over mini-batch `index`, accumulated over micro-batches."""
        micro_batches = shard.micro_batches_of(index)  # a placeholder row, weighted 0, keeps the ranks in step
        totals: dict[str, float] = {}
        for position, (select, share) in enumerate(micro_batches):
            self.engine.set_gradient_accumulation_boundary(position == len(micro_batches) - 1)
            loss, metrics = self._micro_loss(batch.select(select), select, old_logprobs, ref_logprobs)
            if self.injected.fails_allocation(self.weight_version + 1):
                torch.empty(1 << 60, dtype=torch.uint8, device=self.device)  # the allocator refuses it
            loss = loss * self.injected.loss_factor(self.weight_version + 1)
            self.engine.backward(loss * (share * shard.world_size), scale_wrt_gas=False)
            time.sleep(self.injected.training_delay_s(self.weight_version + 1))
            self.done += 1
            for key, value in metrics.items():
                totals[key] = totals.get(key, 0.0) + value * share
        unsharded_norm = self._unsharded_grad_norm()
        skipped_before = self.engine.skipped_steps
        self.engine.step()  # an update whose gradient is not finite is dropped (DeepSpeed's optimizers, `FiniteAdamW`)
        self.done += 1
        grad_norm = self.engine.get_global_grad_norm() if unsharded_norm is None else unsharded_norm
        totals["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        dropped = self.engine.skipped_steps > skipped_before or not math.isfinite(totals["grad_norm"])
        totals["learner/skipped"] = float(dropped)
        return totals

    def _unsharded_grad_norm(self) -> float | None:
        """Pre-clipping gradient norm without ZeRO (DeepSpeed reports it only for ZeRO stages); the gradients are
        already averaged over the ranks here."""
        if self.cfg.zero_stage != 0:
            return None
        grads = [p.grad for p in self.engine.module.parameters() if p.grad is not None]
        return torch.nn.utils.get_total_norm(grads).item() if grads else 0.0

    def _row_pixels(self, batch: TrainBatch) -> list[dict] | None:
        """Each row's pixel tensors (`grpo_dist.models.vision.row_pixels`), read once a step for all its passes
        (each distinct set of images once: a group's rows share their prompt's); None without images."""
        if batch.images is None:
            return None
        read: dict[tuple[bytes, ...], dict] = {}
        for images in batch.images:
            if images not in read:
                read[images] = vision.row_pixels(self.image_processor, images)
        return [read[images] for images in batch.images]

    def _scores(self, model, micro: TrainBatch, rows: torch.Tensor, entropy: bool = False):
        """[b, T] log-probs of `micro` (`rows` of the step's batch) under `model` (and with `entropy` the
        entropies), packed or padded as `learner.packing` says; with the rows' pixels where they have images."""
        host = self.host_batch.select(rows)  # lays out the packing without waiting on the device
        pixels = {}
        if self.row_pixels is not None:
            found = vision.batch_pixels([self.row_pixels[row] for row in rows.tolist()])
            pixels = {name: tensor.to(self.device) for name, tensor in found.items()}
        packed = self.cfg.packing
        return scores(
            model, micro, self.temperature, entropy, packed, host, pixels=pixels, banned=self.banned,
            share=self.share_prompts,
        )  # fmt: skip

    def _micro_loss(self, micro: TrainBatch, rows, old_logprobs, ref_logprobs):
        logprobs, entropy = self._scores(self.engine, micro, rows, entropy=True)  # [b, T] each
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
            off_policy=self.algo.off_policy,
            is_cap=self.algo.is_cap or 2.0,
            is_floor=self.algo.is_floor,
            entropy=entropy,
            entropy_coef=self.algo.entropy_coef,
            token_advantages=micro.token_advantages,
        )
        metrics["loss"] = loss.item()
        mask = micro.completion_mask  # [b, T]
        gap = ((logprobs.detach() - micro.sampling_logprobs).abs() * mask).sum() / mask.sum().clamp(min=1)
        metrics["logprob_gap"] = gap.item()
        return loss, metrics

    @torch.no_grad()
    def _logprobs(self, model, batch: TrainBatch, shard: TrainShard) -> torch.Tensor:
        """[b, T] logprobs of every token under `model`, in as many forward passes as every other rank runs."""
        scored = torch.zeros(batch.input_ids.shape, device=self.device)  # [b, T]
        for rows in [rows for parts in shard.micro_batches for rows in parts]:  # the training step's micro-batches
            select = torch.tensor(rows or [0])  # an empty one: a placeholder pass keeps the ranks in step
            logprobs = self._scores(model, batch.select(select), select)[0]
            self.done += 1
            if rows:
                scored[rows] = logprobs
        return scored

    def sequence_logprobs(self, token_ids: list[int]) -> list[float]:
        """Logprob of each token after the first under the current policy, at temperature 1, without dropout (as
        the engines sample): the check of a weight sync (`grpo_dist.transports.weight_check`), and the tests'."""
        input_ids = torch.tensor([token_ids], device=self.device)
        module = self.engine.module
        training = module.training
        module.eval()
        try:
            with torch.no_grad():
                logits = module(input_ids=input_ids).logits
        finally:
            module.train(training)
        return token_logprobs(logits, input_ids, 1.0)[0, 1:].tolist()

"""What a learner rank hands out and takes in, beside its training step (`grpo_dist.cluster.actors.learner`): its
weights (to the engines' transports, to the saved policy) and its checkpoints (written, published to the run's store,
fetched back). Every method is collective where the engine's parameters are sharded (ZeRO-3): every rank calls it."""

from __future__ import annotations

from pathlib import Path

import torch

from grpo_dist.models import lora, vision


class LearnerWeights:
    """The learner rank's weights and checkpoints (a part of `Learner`, which holds `engine`, `cfg`, `rank`,
    `model_path` and `weight_version`)."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Full, unsharded weights on the CPU in Hugging Face names (with LoRA the policy merged:
        `grpo_dist.models.lora`), on rank 0 (empty on the others). Collective: under ZeRO-3 every rank takes part in
        gathering them."""
        return self._on_rank0(self._weights) or {}

    def adapter(self) -> tuple[dict[str, torch.Tensor], dict] | None:
        """The LoRA adapter's weights in PEFT's names (CPU copies) and its config's fields (as
        `adapter_config.json` holds them), on rank 0 (None on the others): what engines serving adapters load.
        Collective under ZeRO-3."""
        return self._on_rank0(
            lambda module: (lora.adapter_state_dict(module), lora.adapter_config(module)), trained_only=True
        )

    def _weights(self, module) -> dict[str, torch.Tensor]:
        if lora.is_adapted(module):
            return lora.merged_state_dict(module)
        return {name: tensor.detach().to("cpu", copy=True) for name, tensor in module.state_dict().items()}

    def _final(self, module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None]:
        """The policy's weights to save, and with LoRA the adapter's own."""
        return self._weights(module), lora.adapter_state_dict(module) if lora.is_adapted(module) else None

    def _on_rank0(self, read, trained_only: bool = False):
        """`read(policy module)` on rank 0 with every parameter whole (or, `trained_only`, those that take gradients:
        the adapter's), gathered under ZeRO-3 (collective); None on the other ranks."""
        import deepspeed

        module = self.engine.module
        params = [param for param in module.parameters() if param.requires_grad or not trained_only]
        with deepspeed.zero.GatheredParameters(params, enabled=self.cfg.zero_stage == 3):
            return read(module) if self.rank == 0 else None

    def save_checkpoint(self, path: str) -> None:
        """Write this rank's DeepSpeed state (model, optimizer, scheduler) under `path` (collective); with LoRA the
        adapter's weights alone (the base is the initial model's)."""
        self.engine.save_checkpoint(
            path,
            tag="state",
            client_state={"weight_version": self.weight_version},
            exclude_frozen_parameters=self.cfg.lora is not None,
        )

    def load_checkpoint(self, path: str) -> None:
        """Restore what `save_checkpoint` wrote, on the same number of ranks (collective)."""
        _, client_state = self.engine.load_checkpoint(path, tag="state", load_module_strict=self.cfg.lora is None)
        if client_state is None:
            raise RuntimeError(f"learner rank {self.rank}: no DeepSpeed checkpoint in {path}")
        self.weight_version = client_state["weight_version"]

    def make_staging_dir(self, root: str, run_name: str) -> None:
        """This node's staging directory `root/run_name`, before DeepSpeed writes shards there: never through a
        symbolic link, this user's, mode 0o700 (`grpo_dist.storage.private_dir`; the first rank of each node)."""
        from grpo_dist.storage import private_dir

        private_dir(root, run_name)

    def publish(self, local: str, store, key: str) -> dict[str, dict]:
        """What this node wrote at `local` (a checkpoint's shards, the final policy) made the store's at `key`
        (`grpo_dist.storage.Store.publish`); returns each file, by its path under `key`, with its size and checksum
        (nothing where this node staged nothing). The first rank of each node does this for its node."""
        return store.publish(Path(local), key)

    def fetch(self, store, key: str, local: str, expected: dict[str, dict]) -> str:
        """A checkpoint's shards at `key` readable on this node, each checked against what its writer recorded
        (`expected`, by path under `key`; `grpo_dist.storage.Store.fetch`); returns where they are."""
        return str(store.fetch(key, Path(local), expected))

    def discard(self, local: str) -> None:
        """Remove a staged copy from this node's disk (`grpo_dist.storage.discard`)."""
        from grpo_dist.storage import discard

        discard(Path(local))

    def connect_weights(self, spec, generators: list) -> None:
        """Open this rank's side of the broadcast weight transport (collective; rank 0 meets the generators)."""
        from grpo_dist.transports.broadcast import WeightSender

        self.weight_sender = WeightSender(spec, self.rank, self.engine.module, self.cfg.zero_stage == 3, generators)

    def send_weights(self, weight_version: int, full: bool = False):
        """Stream the current weights to the generators (collective: every rank gathers, rank 0 sends); returns
        rank 0's `SyncReport` (None elsewhere)."""
        return self.weight_sender.send(weight_version, full)

    def save(self, out_dir: str) -> str:
        """Save the policy with the initial model's tokenizer (and a vision-language model's processor) in Hugging Face
        format (loadable by transformers and vLLM); with LoRA the policy merged, and the adapter alone in PEFT's
        format under `adapter/` (loadable by `PeftModel.from_pretrained` and as a vLLM LoRA adapter). Collective,
        rank 0 writes."""
        from transformers import AutoTokenizer

        written = self._on_rank0(self._final)
        if written is not None:
            state_dict, adapter = written
            Path(out_dir).mkdir(parents=True, exist_ok=True)
            module = self.engine.module
            model = module.get_base_model() if adapter is not None else module
            model.save_pretrained(out_dir, state_dict=state_dict, safe_serialization=True)
            if adapter is not None:
                lora.save_adapter(module, adapter, Path(out_dir) / "adapter")
            AutoTokenizer.from_pretrained(self.model_path).save_pretrained(out_dir)
            if vision.is_vision_model(self.model_path):  # its processor, which turns images into its inputs
                from transformers import AutoProcessor

                AutoProcessor.from_pretrained(self.model_path).save_pretrained(out_dir)
        return out_dir

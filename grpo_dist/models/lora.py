"""LoRA (Hu et al., arXiv:2106.09685) on the learner, through PEFT: the policy is the frozen base plus a low-rank
adapter on the linear layers `learner.lora.target_modules` names, and the optimizer holds the adapter alone.

The reference of the KL is the same module with the adapter switched off (`AdapterOff`), so no second copy of the
base is held. What leaves the learner for the engines, the object store and `final/` is the policy merged
(`W + B A * alpha / rank` for each adapted weight) under the base model's own names (`merged_state_dict`,
`merged_name`): the engines load it as they load a fully trained model. The merge is computed into new tensors;
the base weights the learner trains on are never written, so they stay bit for bit the initial model's.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from grpo_dist.config.sections import LoraConfig

PEFT_PREFIX = "base_model.model."  # what PEFT puts before the base model's own names
ADAPTER = "default"  # PEFT's name for the one adapter a policy carries


def wrap(model: torch.nn.Module, lora: LoraConfig) -> torch.nn.Module:
    """`model` (a Hugging Face causal LM) with an adapter on `lora.target_modules`: every base parameter frozen,
    the adapter's trainable (B starts at zero: the policy starts as the base model)."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    check_targets(model, lora.target_modules)
    config = PeftLoraConfig(
        r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=list(lora.target_modules)
    )
    return get_peft_model(model, config)


def check_targets(model: torch.nn.Module, targets: list[str]) -> None:
    """Raise ValueError naming the `targets` that match no linear layer of `model` (and those that would), or a
    layer whose weight is tied to the input embedding (its merge could not be served: engines and transformers
    read the tied weight once, as the embedding)."""
    linear = linear_names(model)
    missing = [name for name in targets if name not in linear]
    if missing:
        raise ValueError(
            f"learner.lora.target_modules: {missing} name no linear layer of {type(model).__name__} "
            f"(its linear layers: {sorted(linear)})"
        )
    embedding = model.get_input_embeddings().weight
    named = [(name, module) for name, module in model.named_modules() if hasattr(module, "weight")]
    sharing = {name.rsplit(".", 1)[-1] for name, module in named if module.weight is embedding}
    tied = sorted(sharing & set(targets))
    if tied:
        raise ValueError(
            f"learner.lora.target_modules: {tied} is tied to the input embedding (tie_word_embeddings); an adapter "
            "on it could not be served: leave it out"
        )


def linear_names(model: torch.nn.Module) -> set[str]:
    """The last names of `model`'s linear layers (what `target_modules` may list)."""
    return {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}


def is_adapted(module: torch.nn.Module) -> bool:
    """Whether `module` is a policy `wrap` made."""
    return hasattr(module, "peft_config")


def merged_name(name: str) -> str | None:
    """The base model's name of a wrapped policy's parameter (`base_model.model.x.q_proj.base_layer.weight` ->
    `x.q_proj.weight`); None for the adapter's own parameters."""
    if ".lora_" in name:
        return None
    return name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")


def adapted_layers(module: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The adapted linear layers of a wrapped policy, by the base model's name of their weight."""
    from peft.tuners.lora import LoraLayer

    return {
        f"{name.removeprefix(PEFT_PREFIX)}.weight": layer
        for name, layer in module.named_modules()
        if isinstance(layer, LoraLayer)
    }


def merged_weight(layer: torch.nn.Module) -> torch.Tensor:
    """An adapted layer's weight with its adapter merged in, as a new tensor (the base weight is left as it is):
    computed in float32 and rounded once to the weight's dtype. Under ZeRO-3 the layer's parameters must be
    gathered."""
    base = layer.get_base_layer().weight.data  # [out, in]
    a, b = layer.lora_A[ADAPTER].weight.data.float(), layer.lora_B[ADAPTER].weight.data.float()  # [r, in], [out, r]
    delta = (b @ a) * layer.scaling[ADAPTER]  # [out, in]
    return (base.float() + (delta.T if layer.fan_in_fan_out else delta)).to(base.dtype)


def merged_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A wrapped policy's state as the base model's state dict with every adapter merged in (CPU copies). Under
    ZeRO-3 every parameter must be gathered."""
    layers = adapted_layers(module)
    merged = {}
    for name, tensor in module.state_dict().items():
        base_name = merged_name(name)
        if base_name is None:
            continue
        value = merged_weight(layers[base_name]) if base_name in layers else tensor
        merged[base_name] = value.detach().to("cpu", copy=True)
    return merged


def adapter_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's own weights in PEFT's names (as `PeftModel.from_pretrained` reads them; CPU copies)."""
    from peft import get_peft_model_state_dict

    return {name: tensor.detach().to("cpu", copy=True) for name, tensor in get_peft_model_state_dict(module).items()}


def adapter_config(module: torch.nn.Module) -> dict:
    """The fields of a wrapped policy's `adapter_config.json` (JSON types only)."""
    import json

    fields = module.peft_config[ADAPTER].to_dict()
    return json.loads(json.dumps(fields, default=sorted))  # sets (target_modules) as sorted lists


def write_adapter(adapter: dict[str, torch.Tensor], config: dict, out_dir: Path) -> int:
    """Write an adapter (`adapter_state_dict`, `adapter_config`) in PEFT's layout; returns its bytes."""
    import json

    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=1))
    tensors = {name: tensor.contiguous() for name, tensor in adapter.items()}
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    return sum(tensor.numel() * tensor.element_size() for tensor in adapter.values())


def save_adapter(module: torch.nn.Module, adapter: dict[str, torch.Tensor], out_dir: Path) -> None:
    """Write `adapter` (`adapter_state_dict`) with its config in PEFT's layout: `adapter_config.json` and
    `adapter_model.safetensors` (what `PeftModel.from_pretrained` and vLLM's LoRA loader read)."""
    write_adapter(adapter, adapter_config(module), out_dir)


class AdapterOff:
    """The base model inside a wrapped policy, called as a model: the policy's forward with the adapter switched
    off (the reference of the KL, sharing the policy's weights)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def __call__(self, **inputs):
        with self.off():
            return self.module(**inputs)

    @contextmanager
    def off(self) -> Iterator[None]:
        with self.module.disable_adapter():
            yield

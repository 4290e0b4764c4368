"""`grpo-dist export ADAPTER OUT --merge`: a LoRA adapter in PEFT's layout (as a run saves it in `final/adapter/`)
merged into its base model and written as a Hugging Face model that transformers and vLLM load.

Each adapted weight becomes `W + B A * alpha / rank`, computed in float32 and rounded once to the base's dtype, as
the weight sync gives the engines (`grpo_dist.models.lora.merged_state_dict`); every other weight is the base's. The
tokenizer is the base's. The model is written to a temporary directory beside OUT and renamed into place, so OUT
holds a whole model or nothing.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from grpo_dist.config import ConfigError


def base_of(adapter_dir: Path, base: str | None) -> str:
    """The base model directory of the adapter in `adapter_dir`: `base` when given, else the one its config names;
    bad input raises `ConfigError`, naming what to pass."""
    config_file = adapter_dir / "adapter_config.json"
    if not config_file.is_file():
        raise ConfigError(
            f"{adapter_dir}: not a LoRA adapter (no adapter_config.json); a LoRA run saves its adapter in "
            "RUN_DIR/final/adapter"
        )
    named = base or json.loads(config_file.read_text()).get("base_model_name_or_path")
    if not named or not (Path(named) / "config.json").is_file():
        where = "--base" if base else "the adapter's config (base_model_name_or_path)"
        raise ConfigError(
            f"{adapter_dir}: its base model {named!r}, from {where}, is not a model directory on this machine; "
            "name the initial model of the run with --base PATH"
        )
    return named


def merge_adapter(adapter_dir: Path, out_dir: Path, base: str | None = None) -> int:
    """Write the base of `adapter_dir` with the adapter merged in to `out_dir` (new or empty); returns how many
    weights the adapter changed."""
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ConfigError(f"{out_dir}: exists and is not an empty directory; name a new one")
    base_path = base_of(adapter_dir, base)
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo_dist.models.lora import adapted_layers, merged_state_dict

    print(f"merging the adapter in {adapter_dir} into {base_path}")
    policy = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_path, dtype="auto"), str(adapter_dir))
    merged, adapted = merged_state_dict(policy), len(adapted_layers(policy))
    model = policy.unload()  # the base model, its adapter layers taken out
    model.load_state_dict(merged)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        model.save_pretrained(str(staging))
        AutoTokenizer.from_pretrained(base_path).save_pretrained(str(staging))
        if out_dir.exists():
            out_dir.rmdir()
        staging.rename(out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return adapted

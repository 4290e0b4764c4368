"""What a config points at, resolved and checked before any actor starts: the model (built first when `model.tiny`
asks for one), its tokenizer, the training and held-out prompts (read and tokenised), and the reward functions.

`grpo-dist train`, `grpo-dist sft` and `grpo-dist check` all go through here, so a config `check` passes does not
fail later on its inputs. `prepare(cfg, scratch=...)` (what `check` uses) builds what it has to build (a tiny model,
a bundled task's data) under `scratch` instead of the run's own paths, and leaves those untouched.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo_dist.config import Config, ConfigError
from grpo_dist.data import PromptRecord, encode_prompts, load_rows, split_task
from grpo_dist.rewards import resolve_reward


@dataclass
class Inputs:
    """Everything a run reads, checked and tokenised."""

    model_path: str  # absolute path of the Hugging Face model directory every actor loads
    pad_token_id: int
    train: list[PromptRecord]
    held_out: list[PromptRecord]


def prepare(cfg: Config, scratch: Path | None = None) -> Inputs:
    """Build or check the model, read and tokenise the data, resolve the rewards: fail here, not in an actor.
    `scratch`: where to build what the config asks to be built, instead of its own paths (a dry run)."""
    check_rewards(cfg)
    model_path = prepare_model(cfg, scratch)
    tokenizer = load_tokenizer(model_path)
    check_lengths(cfg)
    train_path, eval_path = prepare_data(cfg, scratch)
    train, skipped = read_prompts(cfg, train_path, tokenizer)
    if len(train) < cfg.data.prompts_per_step:
        raise ConfigError(
            f"data.prompts_per_step ({cfg.data.prompts_per_step}) is more than the {len(train)} usable training "
            f"prompts of {train_path}: a step would repeat prompts; lower it or add data"
        )
    if skipped:
        print(f"skipped {skipped} training prompts longer than data.max_prompt_tokens={cfg.data.max_prompt_tokens}")
    held_out = read_prompts(cfg, eval_path, tokenizer)[0] if eval_path is not None else []
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return Inputs(model_path, pad, train, held_out)


def check_rewards(cfg: Config) -> None:
    """Every reward function the config names (training and `eval.reward`) resolves to a callable."""
    for name in [spec.name for spec in cfg.reward.functions] + [cfg.eval.reward]:
        try:
            resolve_reward(name)
        except ValueError as err:
            raise ConfigError(str(err)) from None


def check_lengths(cfg: Config) -> None:
    if cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens > cfg.rollout.max_model_len:
        raise ConfigError(
            f"data.max_prompt_tokens ({cfg.data.max_prompt_tokens}) + rollout.max_new_tokens "
            f"({cfg.rollout.max_new_tokens}) exceeds rollout.max_model_len ({cfg.rollout.max_model_len})"
        )


def load_tokenizer(model_path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def read_prompts(cfg: Config, path: Path, tokenizer: Any) -> tuple[list[PromptRecord], int]:
    """Rows of a dataset file, tokenised; returns the records and how many were over the length limit."""
    field = cfg.data.prompt_field
    return encode_prompts(load_rows(path, field), tokenizer, cfg.data.max_prompt_tokens, prompt_field=field)


def prepare_model(cfg: Config, scratch: Path | None = None) -> str:
    """The policy's model directory (`model.path`), built first when `model.tiny` asks for one, downloaded (or found
    in the Hugging Face cache) when it names a hub model."""
    path = Path(cfg.model.path).expanduser()
    if cfg.sft is not None and not path.exists():
        raise ConfigError(
            f"model.path: {path} does not exist yet: this config starts from a warmed-up model, which "
            "`grpo-dist sft CONFIG` writes there (see its sft section)"
        )
    if not path.exists() and cfg.model.tiny is None and HUB_ID.fullmatch(cfg.model.path):
        return hub_snapshot(cfg.model.path, cfg.model.revision, "model.path")
    if cfg.model.revision is not None:
        raise ConfigError(f"model.revision applies to a hub id; model.path {cfg.model.path} is a directory")
    return model_directory(cfg, path, "model.path", scratch)


HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
"""`org/name`: a model on the Hugging Face hub (a path that exists is always read as a path)."""
NOT_LOADED = ["*.pth", "original/*", "*.gguf", "*.onnx", "*.msgpack", "*.h5", "*.ot", "*.tflite"]
"""Files of a hub model that neither transformers nor vLLM reads here: not downloaded."""


def hub_snapshot(repo_id: str, revision: str | None, key: str) -> str:
    """The local snapshot of hub model `repo_id` at `revision` (a branch, tag or commit; main when None): found in
    the Hugging Face cache (HF_HOME), or downloaded there unless offline (HF_HUB_OFFLINE=1), with HF_TOKEN for
    gated models. Its path names the commit, so every rank and engine that loads it loads the same weights."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    named = f"{repo_id}@{revision or 'main'}"
    try:
        snapshot = snapshot_download(repo_id, revision=revision, ignore_patterns=NOT_LOADED)
    except GatedRepoError:
        raise ConfigError(f"{key}: {named} is gated: accept its terms on the hub and set HF_TOKEN") from None
    except RepositoryNotFoundError:
        raise ConfigError(
            f"{key}: {repo_id} is neither a directory nor a model on the hub (a private one needs HF_TOKEN)"
        ) from None
    except RevisionNotFoundError:
        raise ConfigError(f"{key}: {repo_id} has no revision {revision!r} (model.revision)") from None
    except LocalEntryNotFoundError:
        raise ConfigError(
            f"{key}: {named} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and the hub cannot be "
            "reached (HF_HUB_OFFLINE=1, or no network): download it where the hub can be reached "
            f"(`hf download {repo_id}`) into an HF_HOME every node shares, or name a local directory"
        ) from None
    if not (Path(snapshot) / "config.json").is_file():
        raise ConfigError(f"{key}: {named} ({snapshot}) is not a Hugging Face model (no config.json)")
    print(f"{key}: {named} is {snapshot}")
    return snapshot


def model_directory(cfg: Config, path: Path, key: str, scratch: Path | None = None) -> str:
    """The Hugging Face model at `path` (config key `key`), built there first (under `scratch` when given) when
    `model.tiny` asks for one."""
    if cfg.model.tiny is not None and not path.exists():
        from grpo_dist.models import build_tiny_model

        path = path if scratch is None else scratch / "model"
        build_tiny_model(path, seed=cfg.run.seed, **cfg.model.tiny.model_dump(exclude_none=True))
        print(f"built a random-init tiny model at {path}")
    if not (path / "config.json").is_file():
        raise ConfigError(f"{key}: {path} is not a Hugging Face model directory (no config.json)")
    return str(path.resolve())


def prepare_data(cfg: Config, scratch: Path | None = None) -> tuple[Path, Path | None]:
    """The training and held-out data files: the configured ones, or a bundled task's, written into the run
    directory (under `scratch` when given)."""
    data = cfg.data
    if data.task is None:
        return Path(data.train_path), Path(data.eval_path) if data.eval_path else None
    task = data.task
    return split_task(task.name, (scratch or cfg.run_dir) / "data", task.num_train, task.num_eval, cfg.run.seed)

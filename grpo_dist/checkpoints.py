"""Checkpoints: everything a resumed run needs, written atomically, and the checks before resuming from one.

A checkpoint `step-000050/` holds `learner/` (the DeepSpeed state of every learner rank: model, optimizer,
scheduler, written by the ranks themselves), `run_state.pt` (the step, the prompt sampler, the driver's random
generators, the W&B run id), `config.yaml` (the config it was written under) and, with `checkpoint.save_hf`, `hf/`.
It is written as `.step-000050.tmp/`, renamed when complete, and only then named in `latest`; a directory without
`run_state.pt`, or a `.tmp` one, is never resumed from. The frozen reference is not saved: it is `model.path`.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any

import torch
import yaml

from grpo_dist.config import Config, ConfigError

LATEST = "latest"
STATE = "run_state.pt"

# Keys whose change would alter what a checkpoint means; a resume with any of them changed is refused.
FIXED_KEYS = (
    "model", "data.task", "data.train_path", "data.prompt_field", "data.max_prompt_tokens", "rollout.group_size",
    "rollout.max_new_tokens", "learner.num_ranks", "learner.zero_stage", "run.seed", "algorithm.aggregation",
)  # fmt: skip


def save(cfg: Config, cluster, step: int, run_state: dict[str, Any]) -> Path:
    """Write the checkpoint of `step` (collective on the learner ranks), then point `latest` at it and keep the
    newest `checkpoint.keep`."""
    root = cfg.checkpoint_dir
    final, partial = root / f"step-{step:06d}", root / f".step-{step:06d}.tmp"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    cluster.learner.save_checkpoint(str(partial / "learner"))
    if cfg.checkpoint.save_hf:
        cluster.save(str(partial / "hf"))
    torch.save({**run_state, "step": step}, partial / STATE)
    (partial / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    shutil.rmtree(final, ignore_errors=True)
    partial.rename(final)
    pointer = root / f".{LATEST}.tmp"
    pointer.write_text(final.name + "\n")
    os.replace(pointer, root / LATEST)
    for old in sorted(root.glob("step-*"))[: -cfg.checkpoint.keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def find(cfg: Config, path: str | None) -> Path:
    """The checkpoint to resume from: `path`, or the latest complete one of the run; a clear error otherwise."""
    if path:
        checkpoint = Path(path)
    else:
        pointer = cfg.checkpoint_dir / LATEST
        if not pointer.is_file():
            raise ConfigError(f"--resume: no checkpoint in {cfg.checkpoint_dir} (no `{LATEST}` file)")
        checkpoint = cfg.checkpoint_dir / pointer.read_text().strip()
    if not (checkpoint / STATE).is_file() or not (checkpoint / "learner").is_dir():
        raise ConfigError(f"--resume: {checkpoint} is not a complete checkpoint (no {STATE} or learner/)")
    return checkpoint


def check_config(cfg: Config, checkpoint: Path) -> list[str]:
    """Refuse a resume whose config changes what the checkpoint means; return the other changes, to report."""
    saved = _flat(yaml.safe_load((checkpoint / "config.yaml").read_text()))
    current = _flat(cfg.model_dump(mode="json"))
    changed = sorted(key for key in saved.keys() | current.keys() if saved.get(key) != current.get(key))
    fixed = [key for key in changed if any(key == f or key.startswith(f + ".") for f in FIXED_KEYS)]
    if fixed:
        listed = "; ".join(f"{key}: {saved.get(key)!r} -> {current.get(key)!r}" for key in fixed)
        raise ConfigError(f"--resume from {checkpoint}: these changes would alter what it means: {listed}")
    return [f"{key}: {saved.get(key)!r} -> {current.get(key)!r}" for key in changed]


def load_state(checkpoint: Path) -> dict[str, Any]:
    return torch.load(checkpoint / STATE, weights_only=False)


def random_state() -> dict[str, Any]:
    """The driver's random generators."""
    return {"python": random.getstate(), "torch": torch.get_rng_state()}


def restore_random_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])


def _flat(tree: dict, prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flat(value, name + "."))
        else:
            flat[name] = value
    return flat

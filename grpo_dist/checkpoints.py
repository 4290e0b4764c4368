"""Checkpoints: everything a resumed run needs, written atomically, and the checks before resuming from one.

A checkpoint `step-000050/` holds `learner/` (the DeepSpeed state of every learner rank: model, optimizer,
scheduler, written by the ranks themselves), `run_state.pt` (the step, the prompt sampler, the driver's random
generators, the W&B run id), `config.yaml` (the config it was written under) and, with `checkpoint.save_hf`, `hf/`.
It is written as `.step-000050.tmp/`, renamed when complete, and only then named in `latest`; a directory without
`run_state.pt`, or a `.tmp` one, is never resumed from. The frozen reference is not saved: it is `model.path`.

With an object-store `run.output_dir` (`grpo_dist.storage`) the checkpoint is staged on each node's disk, uploaded
by the nodes that wrote it (the run state last, so a checkpoint without it is incomplete), and only then named in
`latest`; a resume downloads it, the learner's shards to each learner node.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from grpo_dist import manifest, safe_load
from grpo_dist.config import Config, ConfigError
from grpo_dist.console import bar
from grpo_dist.data import PromptRecord
from grpo_dist.rollouts.rollout import Rollout
from grpo_dist.storage import ObjectStore, StoreError, upload_run_files
from grpo_dist.types import Completion, Episode, Score

LATEST = "latest"
STATE = "run_state.pt"

# Keys whose change would alter what a checkpoint means; a resume with any of them changed is refused.
FIXED_KEYS = (
    "model", "data.task", "data.path", "data.split", "data.subset", "data.fields", "data.system_prompt",
    "data.chat_template", "data.max_prompt_tokens", "rollout.group_size",
    "rollout.max_new_tokens", "learner.num_ranks", "learner.zero_stage", "run.seed", "algorithm.aggregation",
)  # fmt: skip


def save(cfg: Config, cluster, step: int, run_state: dict[str, Any]) -> str:
    """Write the checkpoint of `step` (collective on the learner ranks), then point `latest` at it and keep the
    newest `checkpoint.keep`. Returns where it is."""
    root, name = cfg.checkpoint_dir, f"step-{step:06d}"
    final, partial = root / name, root / f".{name}.tmp"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    cluster.learner.save_checkpoint(str(partial / "learner"))
    if cfg.checkpoint.save_hf:
        cluster.save(str(partial / "hf"))
    if cfg.object_store:
        return _upload(cfg, cluster, partial, name, {**run_state, "step": step})
    _write_driver_files(cfg, partial, {**run_state, "step": step})
    files = manifest.entries(partial)  # every file synced, then the sizes and checksums that make it verifiable
    if why := _missing_part(files, _learner_layout(cfg)):
        shutil.rmtree(partial, ignore_errors=True)
        raise StoreError(f"checkpoint {final} is incomplete after it was written: {why}")
    manifest.write_entries(partial, files)
    shutil.rmtree(final, ignore_errors=True)
    partial.rename(final)
    manifest.sync_dir(root)
    pointer = root / f".{LATEST}.tmp"
    pointer.write_text(final.name + "\n")
    with pointer.open("rb") as file:
        os.fsync(file.fileno())
    os.replace(pointer, root / LATEST)
    manifest.sync_dir(root)
    written_order = sorted((path for path in root.glob("step-*") if (path / STATE).is_file()),
                           key=lambda path: (path / STATE).stat().st_mtime_ns)  # fmt: skip
    for old in prunable([path.name for path in written_order], cfg.checkpoint.keep, name, _resumed_from(cfg)):
        shutil.rmtree(root / old, ignore_errors=True)
    for leftover in root.glob(".step-*.tmp"):  # what a write cut short left
        shutil.rmtree(leftover, ignore_errors=True)
    return str(final)


def prunable(written_order: list[str], keep: int, newest: str, resumed_from: str | None) -> list[str]:
    """The checkpoints to delete, of those named oldest-written first: all but the newest `keep` written, never
    the one just written (`newest`) nor the one the run resumed from (whatever their step numbers say)."""
    kept = set(written_order[-keep:]) | {newest, resumed_from}
    return [name for name in written_order if name not in kept]


RESUMED_FROM = "resumed-from"
"""The file (or object) beside `latest` naming the checkpoint the run last resumed from, which pruning keeps."""


def _resumed_from(cfg: Config) -> str | None:
    if cfg.object_store:
        text = ObjectStore(cfg.object_store).read_text(f"{checkpoints_key(cfg)}/{RESUMED_FROM}")
    else:
        path = cfg.checkpoint_dir / RESUMED_FROM
        text = path.read_text() if path.is_file() else None
    return text.strip() if text else None


def record_resume(cfg: Config, checkpoint: Checkpoint) -> None:
    """Note the checkpoint a run resumes from, for pruning to keep; only a checkpoint of the run's own counts."""
    name = Path(checkpoint.key).name if checkpoint.store else checkpoint.path.name
    if cfg.object_store:
        ObjectStore(cfg.object_store).write_text(f"{checkpoints_key(cfg)}/{RESUMED_FROM}", name + "\n")
    elif checkpoint.path.parent == cfg.checkpoint_dir:
        (cfg.checkpoint_dir / RESUMED_FROM).write_text(name + "\n")


def _write_driver_files(cfg: Config, directory: Path, state: dict[str, Any]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    torch.save(state, directory / STATE)


def _upload(cfg: Config, cluster, partial: Path, name: str, state: dict[str, Any]) -> str:
    """Upload a checkpoint staged in `partial` on each node: the learner nodes their own files first, then the
    driver its config and run state; then its manifest, from what each writer says it uploaded, once the store's
    listing holds all of it and every learner rank's part; then `latest`, pruning and the run's files. Whatever
    happens, no node keeps its staged copy."""
    store, prefix = ObjectStore(cfg.object_store), checkpoints_key(cfg)
    key = f"{prefix}/{name}"
    with bar(3, f"uploading {name}", "part") as shown:  # the learner's shards, the driver's files, the manifest
        store.delete(key)  # what an upload cut short left
        written: dict[str, dict] = {}
        try:
            for uploaded in cluster.learner.on_each_node("upload", str(partial), cfg.object_store, key):
                written.update(uploaded)
            shown.update()
            _write_driver_files(cfg, partial, state)
            driver_files = manifest.entries(partial)
            for file in driver_files:
                store.upload(partial / file, f"{key}/{file}")
            written.update(driver_files)
        finally:
            shutil.rmtree(partial, ignore_errors=True)
        shown.update()
        if why := _missing_part(written, _learner_layout(cfg)) or _listed_in_time(store, key, written):
            raise StoreError(f"checkpoint {store.name(key)} is incomplete after its upload: {why}")
        store.write_text(f"{key}/{manifest.MANIFEST}", json.dumps({"files": written}, indent=1, sort_keys=True))
        store.write_text(f"{prefix}/{LATEST}", name + "\n")
        shown.update()
    steps = [child for child in store.children(prefix) if child.startswith("step-")]
    written_order = sorted(steps, key=lambda child: store.mtime(f"{prefix}/{child}/{STATE}"))
    for old in prunable(written_order, cfg.checkpoint.keep, name, _resumed_from(cfg)):
        store.delete(f"{prefix}/{old}")
    upload_run_files(cfg.object_store, cfg.run_dir, cfg.run.name)
    return store.name(key)


OPTIMIZER_SHARD = re.compile(r"zero_pp_rank_(\d+)_mp_rank_\d+_optim_states\.pt$")
"""A learner rank's optimizer shard, as DeepSpeed names it under ZeRO (rank in the data-parallel group)."""


def _missing_part(files: dict[str, dict], learner: dict[str, Any]) -> str | None:
    """Which learner rank's part of a checkpoint is not among `files` (None: every rank's is): the model states, and
    under ZeRO each rank's optimizer shard. `learner`: the checkpoint's own `learner` settings."""
    shards = [name for name in files if name.startswith("learner/")]
    if not any(name.endswith("model_states.pt") for name in shards):
        return "no learner model states"
    if learner.get("zero_stage", 0) >= 1:
        held = {int(found.group(1)) for name in shards if (found := OPTIMIZER_SHARD.search(name))}
        missing = sorted(set(range(learner.get("num_ranks", 1))) - held)
        if missing:
            return f"no optimizer shard of learner rank(s) {', '.join(map(str, missing))}"
    return None


LISTING_WAIT_S = 30.0
"""How long an upload's files may take to appear in the store's listing (a store may list new objects late)."""


def _listed_in_time(store: ObjectStore, key: str, files: dict[str, dict]) -> str | None:
    """None once the store lists every file of `files` at its size; else, after `LISTING_WAIT_S`, what it lacks."""
    deadline = time.monotonic() + LISTING_WAIT_S
    while (why := _listing_problem(files, store.sizes(key))) and time.monotonic() < deadline:
        time.sleep(1.0)
    return why


def _learner_layout(cfg: Config) -> dict[str, int]:
    return {"num_ranks": cfg.learner.num_ranks, "zero_stage": cfg.learner.zero_stage}


def _listing_problem(files: dict[str, dict], listed: dict[str, int]) -> str | None:
    """The first file of `files` that the store's listing lacks or holds at another size (None: none)."""
    for name, expected in sorted(files.items()):
        if listed.get(name) != expected["size"]:
            return f"{name} has {listed.get(name)} bytes, not {expected['size']}"
    return None


def checkpoints_key(cfg: Config) -> str:
    """Where the run's checkpoints are in its object store."""
    return f"{cfg.run.name}/checkpoints"


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint to resume from. `path` holds its run state and config on this machine, and its learner shards
    unless they are in an object store (`store`, at `key`), from where each learner node downloads them."""

    path: Path
    store: str | None = None
    key: str = ""
    files: dict[str, dict] | None = None  # in a store: the files its manifest lists (name -> size, checksum)

    def __str__(self) -> str:
        return ObjectStore(self.store).name(self.key) if self.store else str(self.path)


def has_latest(cfg: Config) -> bool:
    """Whether the run has a checkpoint to resume from."""
    if cfg.object_store:
        return ObjectStore(cfg.object_store).read_text(f"{checkpoints_key(cfg)}/{LATEST}") is not None
    return (cfg.checkpoint_dir / LATEST).is_file()


def written(cfg: Config, step: int) -> bool:
    """Whether the checkpoint of `step` is there already."""
    if cfg.object_store:
        return ObjectStore(cfg.object_store).exists(f"{checkpoints_key(cfg)}/step-{step:06d}/{STATE}")
    return (cfg.checkpoint_dir / f"step-{step:06d}").is_dir()


def find(cfg: Config, path: str | None) -> Checkpoint:
    """The checkpoint to resume from: `path`, verified; or the latest of the run that verifies, falling back (with a
    warning) to the newest earlier one that does when the latest is damaged. A clear error when there is none."""
    if cfg.object_store or (path and "://" in path):
        return _find_in_store(cfg, path)
    if path:
        checkpoint = Path(path)
        if why := _problem(checkpoint):
            raise ConfigError(f"--resume: {checkpoint} is not a complete checkpoint: {why}")
        return Checkpoint(checkpoint)
    root = cfg.checkpoint_dir
    pointer = root / LATEST
    if not pointer.is_file():
        raise ConfigError(f"--resume: no checkpoint in {root} (no `{LATEST}` file)")
    names = [candidate.name for candidate in root.glob("step-*")]
    return Checkpoint(root / _first_whole(pointer.read_text().strip(), names, lambda name: _problem(root / name), root))


NO_MANIFEST = f"no {manifest.MANIFEST} (an interrupted write or prune, or files deleted from it)"


def _problem(checkpoint: Path) -> str | None:
    """What keeps `checkpoint` from being resumed from (None: nothing). A directory without a manifest is never
    taken: the manifest is written last, so one without it may lack any of its files."""
    if not (checkpoint / STATE).is_file() or not (checkpoint / "learner").is_dir():
        return f"no {STATE} or learner/"
    if not (checkpoint / manifest.MANIFEST).is_file():
        return NO_MANIFEST
    if why := manifest.problem(checkpoint):
        return why
    files = json.loads((checkpoint / manifest.MANIFEST).read_text())["files"]
    config = checkpoint / "config.yaml"
    return _missing_part(files, _saved_learner(config.read_text() if config.is_file() else None))


def _saved_learner(config_text: str | None) -> dict[str, Any]:
    """The `learner` settings a checkpoint was written with (its config.yaml), as plain data."""
    return (yaml.safe_load(config_text or "") or {}).get("learner") or {}


def _first_whole(latest: str, names: list[str], problem, where) -> str:
    """The first checkpoint that verifies: `latest`, then the others, highest step first; each one passed over is
    reported. A `ConfigError` listing what is wrong with each when none does."""
    passed_over = []
    for name in dict.fromkeys([latest, *sorted(names, reverse=True)]):
        why = problem(name)
        if why is None:
            for damaged, reason in passed_over:
                print(f"warning: checkpoint {damaged} in {where} is damaged ({reason}); resuming from {name} instead")
            return name
        passed_over.append((name, why))
    listed = "; ".join(f"{name}: {why}" for name, why in passed_over)
    raise ConfigError(f"--resume: no complete checkpoint in {where} ({listed})")


def _find_in_store(cfg: Config, path: str | None) -> Checkpoint:
    """A checkpoint in an object store (`path`, a URI, or the run's latest that verifies, else the newest earlier
    one that does), its run state and config downloaded to this machine; the learner shards stay there for each
    learner node to download."""
    if path and "://" in path:
        store, key = ObjectStore(path), ""
        if why := _store_problem(store, key):
            raise ConfigError(f"--resume: {store.name(key)} is not a complete checkpoint: {why}")
    else:
        store = ObjectStore(cfg.object_store)
        prefix = checkpoints_key(cfg)
        latest = (store.read_text(f"{prefix}/{LATEST}") or "").strip()
        if not latest:
            raise ConfigError(f"--resume: no checkpoint in {store.name(prefix)} (no `{LATEST}` object)")
        names = [child for child in store.children(prefix) if child.startswith("step-")]
        name = _first_whole(latest, names, lambda n: _store_problem(store, f"{prefix}/{n}"), store.name(prefix))
        key = f"{prefix}/{name}"
    local = cfg.checkpoint_dir / (Path(key).name or "resumed")
    for name in ("config.yaml", STATE):
        store.download(f"{key}/{name}", local / name)
    files = _store_manifest(store.read_text(f"{key}/{manifest.MANIFEST}"))
    if why := manifest.mismatch(local, {name: files[name] for name in ("config.yaml", STATE) if name in files}):
        raise ConfigError(f"--resume: {store.name(key)}: downloaded to {local}, {why}")
    return Checkpoint(local, store.uri, key, files)


def _store_problem(store: ObjectStore, key: str) -> str | None:
    """What keeps the checkpoint at `key` from being resumed from (None: nothing): the store must list every file
    its manifest names at its size, and the manifest every learner rank's part."""
    if not store.exists(f"{key}/{STATE}") or not store.exists(f"{key}/learner"):
        return f"no {STATE} or learner/"
    text = store.read_text(f"{key}/{manifest.MANIFEST}")
    if text is None:
        return NO_MANIFEST
    files = _store_manifest(text)
    return _listing_problem(files, store.sizes(key)) or _missing_part(
        files, _saved_learner(store.read_text(f"{key}/config.yaml"))
    )


def _store_manifest(text: str) -> dict[str, dict]:
    """A store checkpoint's manifest entries; one written by an earlier version holds sizes alone."""
    files = json.loads(text)["files"]
    return {name: entry if isinstance(entry, dict) else {"size": entry} for name, entry in files.items()}


def check_config(cfg: Config, checkpoint: Checkpoint) -> list[str]:
    """Refuse a resume whose config changes what the checkpoint means; return the other changes, to report."""
    saved = _flat(yaml.safe_load((checkpoint.path / "config.yaml").read_text()))
    current = _flat(cfg.model_dump(mode="json"))
    changed = sorted(key for key in saved.keys() | current.keys() if saved.get(key) != current.get(key))
    fixed = [key for key in changed if any(key == f or key.startswith(f + ".") for f in FIXED_KEYS)]
    if fixed:
        listed = "; ".join(f"{key}: {saved.get(key)!r} -> {current.get(key)!r}" for key in fixed)
        raise ConfigError(f"--resume from {checkpoint}: these changes would alter what it means: {listed}")
    return [f"{key}: {saved.get(key)!r} -> {current.get(key)!r}" for key in changed]


RUN_STATE_CLASSES = [Rollout, PromptRecord, Completion, Episode, Score]
"""What the driver's run state holds besides plain data: the batch drawn ahead."""


def load_state(checkpoint: Checkpoint) -> dict[str, Any]:
    return safe_load.load(checkpoint.path / STATE, RUN_STATE_CLASSES)


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

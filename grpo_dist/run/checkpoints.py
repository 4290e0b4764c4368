"""Checkpoints: everything a resumed run needs, written atomically, and the checks before resuming from one.

A checkpoint `step-000050/` holds `learner/` (the DeepSpeed state of every learner rank: model, optimizer,
scheduler, written by the ranks themselves), `run_state.pt` (the step, the prompt sampler, the driver's random
generators, the W&B run id), `config.yaml` (the config it was written under), with `checkpoint.save_hf` `hf/`, and
`manifest.json`, written last: the size and checksum of every file, as each writer reported it. One path for every
backend (`grpo_dist.storage`): staged where its writers write (`.step-000050.tmp/` on a path, each node's disk with an
object store), published (renamed, or uploaded), listed in the manifest once every learner rank's part is there, and
only then named in `latest`. A checkpoint without a manifest, or whose files do not match it, is never resumed
from. The frozen reference is not saved: it is `model.path`.
"""

from __future__ import annotations

import json
import random
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from grpo_dist.config import Config, ConfigError
from grpo_dist.data import PromptRecord
from grpo_dist.run.rollouts.rollout import Rollout
from grpo_dist.storage import RunStore, Store, StoreError, discard, manifest, safe_load
from grpo_dist.storage.console import bar
from grpo_dist.types import Completion, Episode, Failure, Score

LATEST = "latest"
STATE = "run_state.pt"

# Keys whose change would alter what a checkpoint means; a resume with any of them changed is refused.
FIXED_KEYS = (
    "model",
    "data.task",
    "data.path",
    "data.split",
    "data.subset",
    "data.fields",
    "data.system_prompt",
    "data.chat_template",
    "data.max_prompt_tokens",
    "rollout.group_size",
    "rollout.max_new_tokens",
    "learner.num_ranks",
    "learner.zero_stage",
    "learner.lora.rank",  # and learner.lora set or not: either way one of these keys changes
    "learner.lora.alpha",
    "learner.lora.target_modules",
    "run.seed",
    "algorithm.aggregation",
)


def save(cfg: Config, run: RunStore, cluster, step: int, run_state: dict[str, Any]) -> str:
    """Write the checkpoint of `step` (collective on the learner ranks), then point `latest` at it and keep the
    newest `checkpoint.keep`. Returns where it is.

    Every writer writes its part where it stages it (`RunStore.staged`: beside the checkpoint under a temporary name
    on a path, on its own disk with an object store) and publishes it: the learner nodes their shards, the driver
    its config and run state. The manifest lists what each reported, and is written only once every learner rank's
    part is among them and the store lists every file at its size; `latest` names the checkpoint after that. Staged
    copies are removed on every node, whether this succeeds or fails."""
    store, prefix = run.checkpoints, run.checkpoints_key
    name = f"step-{step:06d}"
    key = f"{prefix}/{name}"
    staged = run.staged(store, key)
    with bar(3, f"writing {name}", "part") as shown:  # the learner's shards, the driver's files, the manifest
        store.delete(key)  # what a write cut short left
        discard(staged)
        staged.mkdir(parents=True)
        written: dict[str, dict] = {}
        try:
            cluster.learner.save_checkpoint(str(staged / "learner"))
            if cfg.checkpoint.save_hf:
                cluster.save(str(staged / "hf"))
            shown.update()
            (staged / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
            torch.save({**run_state, "step": step}, staged / STATE)
            if run.staging:  # each node its own disk's part; on a path every node sees, one publish takes it all
                for part in cluster.learner.on_each_node("publish", str(staged), store, key):
                    written.update(part)
            written.update(store.publish(staged, key))
        finally:
            discard(staged)
            if run.staging:
                cluster.learner.on_each_node("discard", str(staged))
        shown.update()
        if why := _missing_part(written, _learner_layout(cfg)) or _listed_in_time(store, key, written):
            raise StoreError(f"checkpoint {store.name(key)} is incomplete after it was written: {why}")
        store.write_text(f"{key}/{manifest.MANIFEST}", json.dumps({"files": written}, indent=1, sort_keys=True))
        run.upload_run_files()  # before `latest`: the store's metrics reach at least the step it names
        store.write_text(f"{prefix}/{LATEST}", name + "\n")
        shown.update()
    steps = [child for child in store.children(prefix) if child.startswith("step-")]
    written_order = sorted(steps, key=lambda child: store.mtime(f"{prefix}/{child}/{STATE}"))
    for old in prunable(written_order, cfg.checkpoint.keep, name, _resumed_from(run)):
        store.delete(f"{prefix}/{old}")
    return store.name(key)


def prunable(written_order: list[str], keep: int, newest: str, resumed_from: str | None) -> list[str]:
    """The checkpoints to delete, of those named oldest-written first: all but the newest `keep` written, never
    the one just written (`newest`) nor the one the run resumed from (whatever their step numbers say)."""
    kept = set(written_order[-keep:]) | {newest, resumed_from}
    return [name for name in written_order if name not in kept]


RESUMED_FROM = "resumed-from"
"""The file (or object) beside `latest` naming the checkpoint the run last resumed from, which pruning keeps."""


def _resumed_from(run: RunStore) -> str | None:
    text = run.checkpoints.read_text(f"{run.checkpoints_key}/{RESUMED_FROM}")
    return text.strip() if text else None


def record_resume(run: RunStore, checkpoint: Checkpoint) -> None:
    """Note the checkpoint a run resumes from, for pruning to keep; only a checkpoint of the run's own counts."""
    where = checkpoint.store.name(checkpoint.key)
    name = _base_name(where)
    if run.checkpoints.name(f"{run.checkpoints_key}/{name}") == where:
        run.checkpoints.write_text(f"{run.checkpoints_key}/{RESUMED_FROM}", name + "\n")


def _base_name(where: str) -> str:
    """The last part of a path or a URI (its query aside): a checkpoint's own name."""
    return where.partition("?")[0].rstrip("/").rsplit("/", 1)[-1]


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
"""How long a checkpoint's files may take to appear in the store's listing (an object store may list new objects
late; a path lists them at once)."""


def _listed_in_time(store: Store, key: str, files: dict[str, dict]) -> str | None:
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
        if name not in listed:
            return f"{name} is missing"
        if listed[name] != expected["size"]:
            return f"{name} has {listed[name]} bytes, not {expected['size']}"
    return None


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint to resume from: at `key` in `store`, its files as its manifest lists them (name -> size,
    checksum); `path` holds its run state and config on this machine (the checkpoint itself on a path, a download
    of those two files from an object store), and the learner shards are fetched by each learner node
    (`Store.fetch`)."""

    store: Store
    key: str
    path: Path
    files: dict[str, dict]

    def __str__(self) -> str:
        return self.store.name(self.key)

    @property
    def shards(self) -> dict[str, dict]:
        """The learner shards' manifest entries, by path under `learner/`."""
        return {
            name.removeprefix("learner/"): entry for name, entry in self.files.items() if name.startswith("learner/")
        }


def has_latest(run: RunStore) -> bool:
    """Whether the run has a checkpoint to resume from."""
    return run.checkpoints.read_text(f"{run.checkpoints_key}/{LATEST}") is not None


def written(run: RunStore, step: int) -> bool:
    """Whether the checkpoint of `step` is there already (with its manifest: whole)."""
    return run.checkpoints.exists(f"{run.checkpoints_key}/step-{step:06d}/{manifest.MANIFEST}")


def find(run: RunStore, path: str | None, flag: str = "--resume") -> Checkpoint:
    """The checkpoint to resume from: `path` (a path or a URI), verified; or the latest of the run that verifies,
    falling back (with a warning) to the newest earlier one that does when the latest is damaged. Its config and
    run state are read on this machine, each checked against the manifest. A clear error when there is none,
    naming `flag` (the option that named the checkpoint)."""
    manifests: dict[str, dict[str, dict]] = {}  # each checkpoint's manifest, read once while it is verified

    def problem(store: Store, key: str) -> str | None:
        why, manifests[key] = _verified(store, key)
        return why

    if path:
        store, key = Store(path), ""
        if why := problem(store, key):
            raise ConfigError(f"{flag}: {store.name()} is not a complete checkpoint: {why}")
    else:
        store, prefix = run.checkpoints, run.checkpoints_key
        latest = (store.read_text(f"{prefix}/{LATEST}") or "").strip()
        if not latest:
            raise ConfigError(f"{flag}: no checkpoint in {store.name(prefix)} (no `{LATEST}` file)")
        names = [child for child in store.children(prefix) if child.startswith("step-")]
        name = _first_whole(latest, names, lambda n: problem(store, f"{prefix}/{n}".lstrip("/")), store.name(prefix))
        key = f"{prefix}/{name}".lstrip("/")
    files = manifests[key]
    if store.local:
        return Checkpoint(store, key, store.path(key), files)
    local = run.work / "checkpoints" / _base_name(store.name(key))
    for name in ("config.yaml", STATE):
        store.download(f"{key}/{name}", local / name)
    if why := manifest.mismatch(local, {name: files[name] for name in ("config.yaml", STATE) if name in files}):
        raise ConfigError(f"{flag}: {store.name(key)}: downloaded to {local}, {why}")
    return Checkpoint(store, key, local, files)


NO_MANIFEST = f"no {manifest.MANIFEST} (an interrupted write or prune, or files deleted from it)"


def _verified(store: Store, key: str) -> tuple[str | None, dict[str, dict]]:
    """What keeps the checkpoint at `key` from being resumed from (None: nothing), and the files its manifest lists
    (none when it has no readable one). It must have a manifest (written last:
    one without may lack any of its files), the store lists every file the manifest names at its size, the manifest
    names every learner rank's part, and (on a path, where reading them is cheap) every file matches its checksum;
    from an object store each reader checks the checksums of what it downloads."""
    if not store.exists(f"{key}/{STATE}") or not store.exists(f"{key}/learner"):
        return f"no {STATE} or learner/", {}
    text = store.read_text(f"{key}/{manifest.MANIFEST}")
    if text is None:
        return NO_MANIFEST, {}
    try:
        files = _manifest(text)
    except (ValueError, KeyError, AttributeError) as err:
        return f"no readable {manifest.MANIFEST} ({type(err).__name__})", {}
    why = (
        _listing_problem(files, store.sizes(key))
        or _missing_part(files, _saved_learner(store.read_text(f"{key}/config.yaml")))
        or store.checksums(key, files)
    )
    return why, files


def _manifest(text: str) -> dict[str, dict]:
    """A checkpoint's manifest entries; one written by an earlier version in an object store holds sizes alone."""
    files = json.loads(text)["files"]
    return {name: entry if isinstance(entry, dict) else {"size": entry} for name, entry in files.items()}


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


def _differs(key: str, saved: dict, current: dict) -> bool:
    """Whether `key` changed: NaN equals NaN (a config may inject one, `faults.inject`), and a key the saved config
    does not have (a setting added since it was written) left empty is no change."""
    if key not in saved and current.get(key) in (None, [], {}):
        return False
    return json.dumps(saved.get(key), sort_keys=True) != json.dumps(current.get(key), sort_keys=True)


def check_config(cfg: Config, checkpoint: Checkpoint) -> list[str]:
    """Refuse a resume whose config changes what the checkpoint means; return the other changes, to report."""
    saved = _flat(yaml.safe_load((checkpoint.path / "config.yaml").read_text()))
    current = _flat(cfg.model_dump(mode="json"))
    changed = sorted(key for key in saved.keys() | current.keys() if _differs(key, saved, current))
    fixed = [key for key in changed if any(key == f or key.startswith(f + ".") for f in FIXED_KEYS)]
    if fixed:
        listed = "; ".join(f"{key}: {saved.get(key)!r} -> {current.get(key)!r}" for key in fixed)
        raise ConfigError(f"--resume from {checkpoint}: these changes would alter what it means: {listed}")
    return [f"{key}: {saved.get(key)!r} -> {current.get(key)!r}" for key in changed]


RUN_STATE_CLASSES = [
    Rollout,
    PromptRecord,
    Completion,
    Episode,
    Score,
    Failure,
    (Rollout, "grpo_dist.rollouts.rollout.Rollout"),
]
"""What the driver's run state holds besides plain data: the batch drawn ahead (its class also under the name a run
state written before the package's subpackages holds it by)."""


def load_learner(learner, checkpoint: Checkpoint, step: int) -> None:
    """Load the checkpoint's learner shards into every rank of `learner` (the learner group), its version set to
    `step`: each learner node fetches them first (`Store.fetch`: read in place on a path; downloaded and checked
    from an object store, and removed from every node once loaded or failed)."""
    fetch = ("fetch", checkpoint.store, f"{checkpoint.key}/learner", str(checkpoint.path / "learner"))
    try:
        learner.load_checkpoint(learner.on_each_node(*fetch, checkpoint.shards)[0], version=step)
    finally:
        if not checkpoint.store.local:
            try:
                learner.on_each_node("discard", str(checkpoint.path))
            except Exception as err:  # a rank lost while loading: what propagates is that; its node is gone
                print(f"warning: could not remove the downloaded copy of {checkpoint} from every node: {err}")


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

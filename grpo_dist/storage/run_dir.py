"""The run directory (`run.output_dir`/`run.name`), one place for every file of a run: resolved once, before any
actor starts, into the `RunStore` the run passes down (an absolute path, or an object store checked to answer);
created for a new run with its resolved config recorded (an earlier run found there is moved aside, never
overwritten, and put back if the new run fails its pre-flight; in an object store it is refused); and proved
reachable from every node that will write to it (`check_visible`) before any engine starts there."""

from __future__ import annotations

import logging
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import ray
import yaml

from grpo_dist.config import Config, ConfigError
from grpo_dist.faults import Bound, gather
from grpo_dist.storage import RunStore, StorageError, Store, StoreError, private_dir

log = logging.getLogger("grpo_dist")


def start_run_dir(cfg: Config, run: RunStore) -> Path | None:
    """Create the run directory and record the resolved config; an earlier run there is moved aside, not lost.
    Returns where the earlier run went (None if there was none)."""
    run_dir = run.work
    kept = None
    if cfg.checkpoint.dir and any(Path(cfg.checkpoint.dir).glob("step-*")):
        raise ConfigError(
            f"checkpoint.dir {cfg.checkpoint.dir} holds checkpoints of an earlier run: continue it with --resume, or "
            "set another checkpoint.dir (a new run's pruning would delete them)"
        )
    if run.staging:
        if set(run.store.children(run.run)) - {PROBE}:  # a probe alone: a failed start
            raise ConfigError(
                f"{run.store.name(run.run)} holds an earlier run: continue it with --resume, or set another run.name "
                "(a run in an object store is never moved or overwritten)"
            )
        shutil.rmtree(run_dir, ignore_errors=True)  # staging: what an earlier run left on this node's disk
    if run_dir.exists() and any(run_dir.iterdir()):
        kept = run_dir.with_name(f"{run_dir.name}-{time.strftime('%Y%m%d-%H%M%S')}")
        run_dir.rename(kept)
        print(f"an earlier run in {run_dir} was moved to {kept}")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    return kept


def discard_run_dir(run: RunStore, earlier: Path | None) -> None:
    """Undo `start_run_dir` after a failed pre-flight check: no new run directory, the earlier run back in place."""
    shutil.rmtree(run.work, ignore_errors=True)
    if earlier is not None:
        earlier.rename(run.work)


def publish_run_dir(run: RunStore) -> None:
    """The driver's files of the run (metrics, samples, W&B files) made the store's at the end of a run however it
    ends (uploaded to an object store; on a path they are in place); a failure is reported, never raised over the
    run's own outcome."""
    try:
        run.upload_run_files()
    except StoreError as err:
        log.error("could not upload the run's files from %s: %s", run.work, err)


PROBE = ".grpo-dist-probe"


def open_run(cfg: Config) -> tuple[Config, RunStore]:
    """Where the run lives, resolved once before any actor starts: the config with `run.output_dir`,
    `checkpoint.dir` and `run.staging_dir` made absolute (a copy: the loaded one is never changed), so every file
    lands in one place whatever the working directory of the process that writes it; and the `RunStore` passed
    down. An object store is opened and listed here, so a wrong URI or missing credentials stop the run before
    anything starts, and this node's staging directory is made (`private_dir`: never through a symbolic link,
    this user's, mode 0o700)."""
    try:
        store = Store(cfg.run.output_dir if cfg.object_store else str(Path(cfg.run.output_dir).expanduser().resolve()))
        if not store.local:
            store.check()
    except StoreError as err:
        raise StorageError(f"run.output_dir: {err}") from None
    run = {"output_dir": store.where}
    if not store.local:
        try:  # absolute, not resolved: a link in the staging directory's own part is refused, never followed
            run["staging_dir"] = str(private_dir(cfg.run.staging_dir, cfg.run.name).parent)
        except StorageError as err:
            raise StorageError(f"run.staging_dir: {err}") from None
    checkpoint = {"dir": str(Path(cfg.checkpoint.dir).expanduser().resolve())} if cfg.checkpoint.dir else {}
    cfg = cfg.model_copy(
        update={"run": cfg.run.model_copy(update=run), "checkpoint": cfg.checkpoint.model_copy(update=checkpoint)}
    )
    checkpoints = (Store(cfg.checkpoint.dir), "") if cfg.checkpoint.dir else (store, f"{cfg.run.name}/checkpoints")
    return cfg, RunStore(store, cfg.run.name, cfg.run_dir, *checkpoints)


@dataclass(frozen=True)
class Probe:
    """A file of the run holding a token of this run, at `key` in `store`."""

    store: Store
    key: str
    token: str

    def shown(self) -> str:
        return self.store.name(self.key)


def write_probe(run: RunStore) -> Probe:
    """A file in the run directory holding a token of this run, for the nodes that will write to find."""
    probe = Probe(run.store, f"{run.run}/{PROBE}", uuid.uuid4().hex)
    probe.store.write_text(probe.key, probe.token)
    return probe


def check_visible(probe: Probe, strategies: list, bound: Bound) -> None:
    """Run a task in each given placement (a learner rank's bundle: the nodes that write checkpoints and the final
    policy) that reads `probe`; raise `StorageError` naming the first node that cannot read it, before any engine
    starts there."""
    refs = [_sees.options(scheduling_strategy=strategy).remote(probe) for strategy in strategies]
    for rank, outcome in enumerate(gather(refs, bound)):
        if not outcome.ok:
            why = outcome.fault or outcome.error
            raise StorageError(f"could not check that learner rank {rank}'s node sees {probe.shown()}: {why}")
        node, problem = outcome.value
        if problem is None:
            continue
        if not probe.store.local:
            raise StorageError(
                f"run.output_dir: learner rank {rank}'s node ({node}) cannot read {probe.shown()}, which the driver "
                f"wrote ({problem}): every learner node uploads its checkpoint shards there, so it needs the same "
                "credentials and endpoint (AWS_*, GOOGLE_APPLICATION_CREDENTIALS, ... in its environment)"
            )
        raise StorageError(
            f"run.output_dir: learner rank {rank}'s node ({node}) cannot see {probe.shown()}, which the driver wrote: "
            "the learner ranks write their checkpoint shards and the final policy under run.output_dir, so it must "
            "be a filesystem every node mounts at the same path (NFS, Lustre, a PVC) or an object store (s3://...)"
        )


@ray.remote(num_cpus=0)
def _sees(probe: Probe) -> tuple[str, str | None]:
    """This node's address, and what keeps it from reading `probe`'s token (None: nothing)."""
    try:
        text = probe.store.read_text(probe.key)
    except StoreError as err:
        return ray.util.get_node_ip_address(), str(err)
    return ray.util.get_node_ip_address(), None if text == probe.token else "not there, or not this run's"

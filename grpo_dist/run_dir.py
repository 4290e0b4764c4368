"""The run directory (`run.output_dir`/`run.name`), one place for every file of a run: resolved to an absolute path
once, before any actor starts; created for a new run with its resolved config recorded (an earlier run found there
is moved aside, never overwritten, and put back if the new run fails its pre-flight); and proved visible from every
node that will write to it (`check_visible`) before any engine starts there."""

from __future__ import annotations

import shutil
import time
import uuid
from pathlib import Path

import ray
import yaml

from grpo_dist.config import Config, ConfigError
from grpo_dist.faults import Bound, gather


def start_run_dir(cfg: Config) -> Path | None:
    """Create the run directory and record the resolved config; an earlier run there is moved aside, not lost.
    Returns where the earlier run went (None if there was none)."""
    run_dir = cfg.run_dir
    kept = None
    if run_dir.exists() and any(run_dir.iterdir()):
        kept = run_dir.with_name(f"{run_dir.name}-{time.strftime('%Y%m%d-%H%M%S')}")
        run_dir.rename(kept)
        print(f"an earlier run in {run_dir} was moved to {kept}")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    return kept


def discard_run_dir(cfg: Config, earlier: Path | None) -> None:
    """Undo `start_run_dir` after a failed pre-flight check: no new run directory, the earlier run back in place."""
    shutil.rmtree(cfg.run_dir, ignore_errors=True)
    if earlier is not None:
        earlier.rename(cfg.run_dir)


PROBE = ".grpo-dist-probe"


class StorageError(ConfigError):
    """A node that will write the run's files cannot see its run directory; the message names the node and the path."""


def resolve_paths(cfg: Config) -> None:
    """Make `run.output_dir` (and `checkpoint.dir`, when set) absolute, once, before any actor starts: every file a
    run writes then lands in one place, whatever the working directory of the process that writes it."""
    cfg.run.output_dir = str(Path(cfg.run.output_dir).expanduser().resolve())
    if cfg.checkpoint.dir:
        cfg.checkpoint.dir = str(Path(cfg.checkpoint.dir).expanduser().resolve())


def write_probe(cfg: Config) -> Path:
    """A file in the run directory holding a token of this run, for the nodes that will write to find."""
    probe = cfg.run_dir / PROBE
    probe.write_text(uuid.uuid4().hex)
    return probe


def check_visible(probe: Path, strategies: list, bound: Bound) -> None:
    """Run a task in each given placement (a learner rank's bundle: the nodes that write checkpoints and the final
    policy) that reads `probe`; raise `StorageError` naming the first node that cannot see it, before any engine
    starts there."""
    token = probe.read_text()
    refs = [_sees.options(scheduling_strategy=strategy).remote(str(probe), token) for strategy in strategies]
    for rank, outcome in enumerate(gather(refs, bound)):
        if not outcome.ok:
            why = outcome.fault or outcome.error
            raise StorageError(f"could not check that learner rank {rank}'s node sees {probe}: {why}")
        node, seen = outcome.value
        if not seen:
            raise StorageError(
                f"run.output_dir: learner rank {rank}'s node ({node}) cannot see {probe}, which the driver wrote: the "
                "learner ranks write their checkpoint shards and the final policy under run.output_dir, so it must be "
                "a filesystem every node mounts at the same path (NFS, Lustre, a PVC)"
            )


@ray.remote(num_cpus=0)
def _sees(path: str, token: str) -> tuple[str, bool]:
    """This node's address, and whether the file at `path` holds `token`."""
    try:
        seen = Path(path).read_text() == token
    except OSError:
        seen = False
    return ray.util.get_node_ip_address(), seen

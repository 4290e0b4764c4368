"""The run directory (`run.output_dir`/`run.name`): created for a new run with its resolved config recorded; an
earlier run found there is moved aside, never overwritten, and put back if the new run fails its pre-flight."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import yaml

from grpo_dist.config import Config


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

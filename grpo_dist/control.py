"""Asking a running run to change: `grpo-dist scale RUN_DIR generators=N` (or `scale(run_dir, generators=N)` from
Python) leaves a request in the run directory; the run takes it between two steps (`take_request`)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from tqdm import tqdm

REQUEST = "scale.json"


def scale(run_dir: str | Path, generators: int) -> Path:
    """Ask the run in `run_dir` to run `generators` generators from its next step on; returns the request file."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise FileNotFoundError(f"{run_dir}: not a run directory (it has no config.yaml)")
    if isinstance(generators, bool) or not isinstance(generators, int) or generators < 1:
        raise ValueError(f"generators must be a whole number >= 1, got {generators!r}")
    request, partial = run_dir / REQUEST, run_dir / f".{REQUEST}.tmp"
    partial.write_text(json.dumps({"generators": generators}) + "\n")
    os.replace(partial, request)  # the run never reads half a request
    return request


def take_request(run_dir: Path) -> int | None:
    """The generator count asked for since the last call (the request is consumed), or None."""
    request, taken = run_dir / REQUEST, run_dir / f".{REQUEST}.taken"
    try:
        os.replace(request, taken)  # a request written from now on waits for the next call
    except FileNotFoundError:
        return None
    text = "?"
    try:
        text = taken.read_text()
        generators = json.loads(text)["generators"]
        if isinstance(generators, int) and not isinstance(generators, bool) and generators >= 1:
            return generators
    except (OSError, ValueError, KeyError, TypeError):
        pass
    finally:
        taken.unlink(missing_ok=True)
    tqdm.write(f'scale: ignored {request}: expected {{"generators": N}} with N >= 1, got {text.strip()[:200]!r}')
    return None

"""The run's append-only JSON Lines files (metrics.jsonl, eval.jsonl, completions.jsonl), read so that a crash
mid-write loses only the row being written, and rewritten so that a crash mid-rewrite loses nothing.

A row is written with one `write` and flushed, so a process killed mid-write leaves at most its last line torn (no
newline, or cut inside its JSON). Reading drops such a line with a printed warning, never an error; a line that
cannot be read anywhere else is dropped the same way, named by its number. A rewrite (a resumed run dropping the
steps it does again) goes to a temporary file beside the original, synced, then renamed over it."""

from __future__ import annotations

import json
import os
from pathlib import Path


class BadLine(ValueError):
    """A line other than a torn last one that is not a JSON object (`read_rows(strict=True)`)."""

    def __init__(self, path: Path, number: int, why: str) -> None:
        super().__init__(f"{path}:{number}: {why}")
        self.number, self.why = number, why


def read_rows(path: Path, strict: bool = False) -> list[dict]:
    """The rows of `path` that are whole JSON objects, in order; a torn last line dropped with a warning, and so is
    any other line that is not a JSON object, or with `strict`, `BadLine` raised for it."""
    text = path.read_text()
    rows = []
    lines = text.split("\n")
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            row, why = None, err.msg
        else:
            why = None if isinstance(row, dict) else "not a JSON object"
        if why is None:
            rows.append(row)
            continue
        torn = number == len(lines)  # the last line, without its newline: cut by a crash mid-write
        if strict and not torn:
            raise BadLine(path, number, why)
        what = "its last line, torn by a crash mid-write" if torn else f"line {number}, which cannot be read"
        print(f"warning: {path}: dropped {what} ({why})", flush=True)
    return rows


def rewrite(path: Path, rows: list[dict]) -> None:
    """Replace `path` with `rows`: written and synced under a temporary name, then renamed over it (atomic)."""
    partial = path.with_name(f".{path.name}.tmp")
    with partial.open("w") as file:
        file.writelines(json.dumps(row) + "\n" for row in rows)
        file.flush()
        os.fsync(file.fileno())
    os.replace(partial, path)

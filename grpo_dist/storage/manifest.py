"""A checkpoint's manifest (`manifest.json`): the size and checksum (xxh3-64) of every file in it, written last, after
every file is synced to disk, so that a checkpoint with a manifest that verifies is whole. Each writer records what
it wrote: on a path, the driver lists the finished directory; in an object store, each learner node reports the
files it uploaded and the driver its own, and the store's listing must hold every one at its size.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import xxhash

MANIFEST = "manifest.json"
CHUNK = 8 << 20


def checksum(path: Path) -> str:
    digest = xxhash.xxh3_64()
    with path.open("rb") as file:
        while chunk := file.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def files_under(directory: Path) -> list[Path]:
    return sorted(path for path in directory.rglob("*") if path.is_file() and path.name != MANIFEST)


def entries(directory: Path) -> dict[str, dict]:
    """Every file under `directory` synced to disk, with its size and checksum, by its path relative to it."""
    return {str(path.relative_to(directory)): entry(path) for path in files_under(directory)}


def entry(path: Path) -> dict:
    """A file synced to disk, and its size and checksum."""
    with path.open("rb") as file:
        os.fsync(file.fileno())
    return {"size": path.stat().st_size, "xxh3": checksum(path)}


def write(directory: Path) -> None:
    """Sync every file under `directory` to disk, then write its manifest (synced too)."""
    listed = entries(directory)
    with (directory / MANIFEST).open("w") as file:
        json.dump({"files": listed}, file, indent=1, sort_keys=True)
        file.flush()
        os.fsync(file.fileno())
    sync_dir(directory)


def sync_dir(directory: Path) -> None:
    """Make a rename or a new file in `directory` durable."""
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def mismatch(directory: Path, listed: dict[str, dict]) -> str | None:
    """The first file of `listed` (names relative to `directory`) that is missing or differs (None: none)."""
    for name, expected in listed.items():
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != expected["size"]:
            return f"{name} has {path.stat().st_size} bytes, not {expected['size']}"
        if "xxh3" in expected and checksum(path) != expected["xxh3"]:
            return f"{name} does not match its checksum"
    return None

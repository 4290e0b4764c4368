"""What an offline W&B run wrote, read back from its files (no W&B server): the records of its `run-<id>.wandb`
transaction log (a LevelDB-style log of W&B's protobuf `Record`s) and the tables it saved."""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32 * 1024  # the log is cut in blocks of this size; a record never starts in a block's last 6 bytes
HEADER = 7  # each chunk: checksum (4), length (2), type (1)
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list:
    """Every record of a `.wandb` file, in order."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    found, pending, position = [], b"", 7  # the file starts with W&B's own 7-byte header
    while position + HEADER <= len(data):
        if BLOCK - position % BLOCK < HEADER:  # the block's tail is padding
            position += BLOCK - position % BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + HEADER])
        if kind == 0:  # zeros: nothing more was written
            break
        pending += data[position + HEADER : position + HEADER + length]
        position += HEADER + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            found.append(record)
            pending = b""
    return found


def history(session: Path) -> list[dict]:
    """The rows a run session logged (`run.log`), each as {key: value}; nested keys joined with '/'."""
    (log,) = session.glob("run-*.wandb")
    rows = []
    for record in records(log):
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})  # fmt: skip
    return rows


def table(session: Path, row: dict, key: str) -> dict:
    """The table a history row logged under `key`: {"columns": [...], "data": [[...], ...]}."""
    return json.loads((session / "files" / row[f"{key}/path"]).read_text())

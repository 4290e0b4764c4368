"""An object store as a run's output directory (`run.output_dir: s3://bucket/runs`, or any other URI pyarrow.fs
opens: gs://, hdfs://, ...).

Nothing is written to an object store in place. Every process writes to its own node's disk under
`run.staging_dir` (the same absolute path on every node) and the process that wrote a file uploads it: each learner
node its DeepSpeed shards, learner rank 0 the Hugging Face model, the driver the run state, metrics and samples. A
checkpoint is uploaded whole, its run state last, before `latest` names it; `--resume` downloads it to each node
that needs it. Credentials and endpoints come from the environment every node has (AWS_ACCESS_KEY_ID,
AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL, GOOGLE_APPLICATION_CREDENTIALS, ...) or from the URI's query
(`s3://bucket/runs?endpoint_override=host:9000&scheme=http`).

Keys are relative to the URI's root, so a query in the URI is kept: `ObjectStore(uri).upload(path, "grpo/final")`.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow
import pyarrow.fs as pafs

from grpo_dist.config import uri_join
from grpo_dist.manifest import MANIFEST

# The driver's own files of a run directory that are uploaded (the other entries are uploaded by the learner).
LEARNER_WRITES = ("checkpoints", "final", "interrupted")


class StoreError(RuntimeError):
    """An object store that cannot be opened, read or written; the message names the URI and the key."""


class ObjectStore:
    """The directory an object-store URI names: upload, download, read, write, list and delete under it."""

    def __init__(self, uri: str) -> None:
        self.uri = uri
        try:
            self.fs, root = pafs.FileSystem.from_uri(uri)
        except (pyarrow.ArrowException, ValueError, OSError) as err:
            raise StoreError(f"{uri}: cannot open it as an object store ({err})") from None
        self.root = root.rstrip("/")

    def name(self, key: str) -> str:
        """A key as a URI, for messages and for `--resume`."""
        return uri_join(self.uri, key)

    def _path(self, key: str) -> str:
        return f"{self.root}/{key}".rstrip("/") if key else self.root

    def _do(self, what: str, key: str, call, *args):
        try:
            return call(*args)
        except (pyarrow.ArrowException, OSError) as err:
            raise StoreError(f"{self.name(key)}: could not {what} ({err})") from None

    def check(self) -> None:
        """Raise `StoreError` unless the store answers (a listing of the root)."""
        self._do("list it", "", self.fs.get_file_info, self.root)

    def upload(self, local: Path, key: str) -> None:
        """A file, or a directory's whole tree, to `key`."""
        local_fs = pafs.LocalFileSystem()
        self._do("upload", key, pafs.copy_files, str(local), self._path(key), local_fs, self.fs)

    def download(self, key: str, local: Path) -> None:
        """A file, or every file under `key`, to `local` (replacing what is there)."""
        source = self._path(key)
        info = self._do("look it up", key, self.fs.get_file_info, source)
        if info.type == pafs.FileType.NotFound:
            raise StoreError(f"{self.name(key)}: not there")
        if local.is_dir():
            shutil.rmtree(local)
        local.parent.mkdir(parents=True, exist_ok=True)
        if info.type == pafs.FileType.Directory:  # the local directories first: copying creates only files
            listing = self._do("list", key, self.fs.get_file_info, pafs.FileSelector(source, recursive=True))
            for entry in [info, *listing]:
                if entry.type == pafs.FileType.Directory:
                    (local / entry.path[len(source) :].lstrip("/")).mkdir(parents=True, exist_ok=True)
        self._do("download", key, pafs.copy_files, source, str(local), self.fs, pafs.LocalFileSystem())

    def exists(self, key: str) -> bool:
        info = self._do("look it up", key, self.fs.get_file_info, self._path(key))
        return info.type != pafs.FileType.NotFound

    def read_text(self, key: str) -> str | None:
        """The text at `key`, or None when there is none."""
        if not self.exists(key):
            return None
        with self._do("read", key, self.fs.open_input_stream, self._path(key)) as stream:
            return stream.read().decode()

    def write_text(self, key: str, text: str) -> None:
        with self._do("write", key, self.fs.open_output_stream, self._path(key)) as stream:
            stream.write(text.encode())

    def children(self, key: str) -> list[str]:
        """The names directly under `key` (none when it does not exist)."""
        if not self.exists(key):
            return []
        listing = self._do("list", key, self.fs.get_file_info, pafs.FileSelector(self._path(key)))
        return sorted(info.base_name for info in listing)

    def sizes(self, key: str) -> dict[str, int]:
        """The size of every file under `key`, by its path below `key` (the manifest of an uploaded checkpoint)."""
        source = self._path(key)
        listing = self._do("list", key, self.fs.get_file_info, pafs.FileSelector(source, recursive=True))
        return {
            entry.path[len(source) :].lstrip("/"): entry.size
            for entry in listing
            if entry.type == pafs.FileType.File and not entry.path.endswith(f"/{MANIFEST}")
        }

    def mtime(self, key: str) -> float:
        """When the object at `key` was written (seconds since the epoch; 0 when the store does not say)."""
        info = self._do("look it up", key, self.fs.get_file_info, self._path(key))
        return info.mtime.timestamp() if info.mtime else 0.0

    def delete(self, key: str) -> None:
        """Whatever is at `key` (a file or a tree); nothing there is not an error."""
        info = self._do("look it up", key, self.fs.get_file_info, self._path(key))
        if info.type == pafs.FileType.Directory:
            self._do("delete", key, self.fs.delete_dir, self._path(key))
        elif info.type == pafs.FileType.File:
            self._do("delete", key, self.fs.delete_file, self._path(key))


def upload_run_files(uri: str, run_dir: Path, key: str) -> None:
    """The driver's files of the run directory `run_dir` (metrics, samples, config, W&B files) to `key`; what the
    learner writes there is uploaded by the learner."""
    store = ObjectStore(uri)
    for entry in sorted(run_dir.iterdir()) if run_dir.is_dir() else []:
        if entry.name not in LEARNER_WRITES:
            store.upload(entry, f"{key}/{entry.name}")


def download_run_files(uri: str, key: str, run_dir: Path) -> None:
    """The driver's files of a run (as `upload_run_files` left them) into `run_dir`, to go on from."""
    store = ObjectStore(uri)
    run_dir.mkdir(parents=True, exist_ok=True)
    for name in store.children(key):
        if name not in LEARNER_WRITES:
            store.download(f"{key}/{name}", run_dir / name)

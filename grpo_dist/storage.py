"""An object store as a run's output directory (`run.output_dir: s3://bucket/runs`, or any other URI pyarrow.fs
opens: gs://, hdfs://, ...).

Nothing is written to an object store in place. Every process writes to its own node's disk under
`run.staging_dir` (the same absolute path on every node) and the process that wrote a file uploads it: each learner
node its DeepSpeed shards, learner rank 0 the Hugging Face model, the driver the run state, metrics and samples. A
checkpoint is uploaded whole, its run state last, before `latest` names it; `--resume` downloads it to each node
that needs it. Credentials come from the environment every node has (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
GOOGLE_APPLICATION_CREDENTIALS, ...) or the provider's own files (~/.aws/credentials), never from the URI: one with a
`user:password@` or a credential query parameter (`secret_key=...`) is refused, since a URI is printed and recorded in
config.yaml, every checkpoint and the W&B config. Endpoints come from the environment (AWS_ENDPOINT_URL) or the URI's
query (`s3://bucket/runs?endpoint_override=host:9000&scheme=http`). Every URI a message shows goes through `redact`.

The staging directory is created by `private_dir` on each node that writes there: never through a symbolic link,
mode 0o700, and refused when another user owns it (the default is under /tmp, which every user can write).

Keys are relative to the URI's root, so a query in the URI is kept: `ObjectStore(uri).upload(path, "grpo/final")`.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
from pathlib import Path

import pyarrow
import pyarrow.fs as pafs

from grpo_dist.config import ConfigError, redact, uri_credentials, uri_join
from grpo_dist.manifest import MANIFEST

# The driver's own files of a run directory that are uploaded (the other entries are uploaded by the learner).
LEARNER_WRITES = ("checkpoints", "final", "interrupted")


class StoreError(RuntimeError):
    """An object store that cannot be opened, read or written, or a checkpoint that is not whole once written (on a
    path or in a store); the message names where."""


class StagingError(ConfigError):
    """A staging directory that is not safely this user's own (a symbolic link, another user's, not a directory);
    the message names the path and what to do."""


class ObjectStore:
    """The directory an object-store URI names: upload, download, read, write, list and delete under it."""

    def __init__(self, uri: str) -> None:
        self.uri = uri
        if found := uri_credentials(uri):  # the config refuses them first; this is for any other way in
            raise StoreError(f"{redact(uri)}: carries credentials ({', '.join(found)}); set them in the environment")
        try:
            self.fs, root = pafs.FileSystem.from_uri(uri)
        except (pyarrow.ArrowException, ValueError, OSError) as err:
            raise StoreError(f"{redact(uri)}: cannot open it as an object store ({redact(str(err))})") from None
        self.root = root.rstrip("/")

    def name(self, key: str) -> str:
        """A key as a URI, for messages and for `--resume` (redacted, though a store's URI carries no secret)."""
        return redact(uri_join(self.uri, key))

    def _path(self, key: str) -> str:
        key = key.strip("/")  # "" names the store's own directory: "/run_state.pt" a file in it
        return f"{self.root}/{key}" if key else self.root

    def _do(self, what: str, key: str, call, *args):
        try:
            return call(*args)
        except (pyarrow.ArrowException, OSError) as err:
            raise StoreError(f"{self.name(key)}: could not {what} ({redact(str(err))})") from None

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


OWN = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
"""How a directory of the run's own part is opened: never through a symbolic link."""


def private_dir(root: str | Path, *parts: str) -> Path:
    """`root/parts...` (the staging directory and the run's directory in it) as directories of this user's alone,
    each created where missing with mode 0o700. From `root` down (and for any directory above it created here) each
    is opened relative to its parent without following a symbolic link, refused unless this user owns it, and
    brought to mode 0o700; the directories above `root` that exist (/tmp) are taken as they are. Returns the
    absolute path (not resolved: a link in it would have been refused); raises `StagingError` naming the path."""
    path = Path(os.path.abspath(os.path.expanduser(root)))
    names = [*path.parts[1:], *parts]
    own_from = len(path.parts) - 2  # the index in `names` of root's own name
    where, parent = Path(path.anchor), os.open(path.anchor, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for index, name in enumerate(names):
            where = where / name
            child = _enter(parent, name, where, own=_make(parent, name, where) or index >= own_from)
            os.close(parent)
            parent = child
    finally:
        os.close(parent)
    return where


def _make(parent: int, name: str, where: Path) -> bool:
    """Create `name` (mode 0o700) in the open directory `parent`; whether it was created (False: something is
    there already, a link included, which `mkdir` never follows)."""
    try:
        os.mkdir(name, 0o700, dir_fd=parent)
    except FileExistsError:
        return False
    except OSError as err:
        raise StagingError(f"{where}: cannot create it ({err.strerror}): set run.staging_dir to a directory on this "
                           "node's own disk that you can write") from None  # fmt: skip
    return True


def _enter(parent: int, name: str, where: Path, own: bool) -> int:
    """The open directory `name` in `parent`; one of the run's own (`own`) is not reached through a link, is this
    user's and is left with mode 0o700."""
    if own and stat.S_ISLNK(os.lstat(name, dir_fd=parent).st_mode):
        raise StagingError(f"{where} is a symbolic link (to {os.readlink(name, dir_fd=parent)}), which a staging "
                           "directory is never reached through: someone may have planted it to read or replace the "
                           "run's files; remove it, or set run.staging_dir to a directory of your own")  # fmt: skip
    try:
        child = os.open(name, OWN if own else os.O_RDONLY | os.O_DIRECTORY, dir_fd=parent)
    except OSError as err:
        why = "a symbolic link" if err.errno == errno.ELOOP else err.strerror
        raise StagingError(f"{where}: cannot open it as a directory ({why}): remove it, or set run.staging_dir to "
                           "a directory of your own") from None  # fmt: skip
    if own:
        _check_owner(child, where)
    return child


def _check_owner(directory: int, where: Path) -> None:
    """Refuse (closing it) the open `directory` unless this user owns it; bring its mode to 0o700."""
    info = os.fstat(directory)
    if info.st_uid != os.geteuid():
        os.close(directory)
        raise StagingError(f"{where} belongs to another user (uid {info.st_uid}, you are {os.geteuid()}), who could "
                           "read or replace the run's files there: set run.staging_dir to a directory of your own "
                           "(/tmp/grpo-dist-staging-$USER)")  # fmt: skip
    if stat.S_IMODE(info.st_mode) != 0o700:
        os.fchmod(directory, 0o700)

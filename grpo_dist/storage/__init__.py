"""Where a run's files live: one `Store` for a path (local, or a filesystem every node mounts) and for an object
store (`run.output_dir: s3://bucket/runs`, or any other URI pyarrow.fs opens: gs://, hdfs://, ...), the same calls on
both; and the `RunStore` a run resolves once and passes down.

Every file is written first where its writer can write it (`RunStore.staged`): beside its place under a temporary
name on a path, on the writer's own disk under `run.staging_dir` (the same absolute path on every node) with an
object store. The writer then publishes it (`Store.publish`): each file synced and checksummed, then renamed into
place or uploaded, the staged copy removed; what it reports is what a checkpoint's manifest lists. Each learner node
publishes its DeepSpeed shards, learner rank 0 the Hugging Face model, the driver the run state, metrics and
samples. Credentials for an object store come from the environment every node has (AWS_ACCESS_KEY_ID,
AWS_SECRET_ACCESS_KEY, GOOGLE_APPLICATION_CREDENTIALS, ...) or the provider's own files (~/.aws/credentials), never
from the URI: one with a `user:password@` or a credential query parameter (`secret_key=...`) is refused, since a URI
is printed and recorded in config.yaml, every checkpoint and the W&B config. Endpoints come from the environment
(AWS_ENDPOINT_URL) or the URI's query (`s3://bucket/runs?endpoint_override=host:9000&scheme=http`). Every URI a
message shows goes through `redact`.

The staging directory is created by `private_dir` on each node that writes there: never through a symbolic link,
mode 0o700, and refused when another user owns it (the default is under /tmp, which every user can write).

Keys are relative to the store's root, so a query in a URI is kept: `Store(uri).upload(path, "grpo/final")`. Every
failure to read or write is a `StoreError` naming where; storage a run cannot start with is a `StorageError`.

Also the run's directory (`run_dir`), checkpoint manifests (`manifest`), JSON Lines (`jsonl`), loading a
checkpoint without running code from it (`safe_load`), the console and its log (`console`), the status file
(`status`) and the mailbox a running run reads (`control`). May import: `algo`, `faults`, `config`, `types`.
"""

from __future__ import annotations

import errno
import os
import shutil
import socket
import stat
from dataclasses import dataclass
from pathlib import Path

import pyarrow
import pyarrow.fs as pafs

from grpo_dist.config import ConfigError
from grpo_dist.config.uris import redact, shown_uri, uri_credentials, uri_join
from grpo_dist.storage import manifest
from grpo_dist.storage.control import LOCK

# The driver's own files of a run directory that are uploaded (the other entries are uploaded by the learner).
LEARNER_WRITES = ("checkpoints", "final", "interrupted")


class StoreError(RuntimeError):
    """A run's storage that cannot be read or written, or a checkpoint that is not whole once written (on a path or
    in an object store); the message names where."""


class StorageError(ConfigError):
    """Storage a run cannot start with, found before anything starts: an object store that does not answer, a
    staging directory that is not safely this user's own, a node that cannot see the run directory. The message
    names the setting, the node or the path, and what to do."""


class Store:
    """A directory on a path (local, or a filesystem every node mounts) or in an object store (any URI pyarrow.fs
    opens), with the same calls and the same errors whichever it is: keys are `/`-separated paths under it. Built
    from its location alone, so it travels to actors as that (`__reduce__`)."""

    def __init__(self, where: str) -> None:
        self.local = "://" not in where
        if self.local:
            self.where = os.path.abspath(os.path.expanduser(where))
            self.fs, self.root = pafs.LocalFileSystem(), self.where.rstrip("/") or "/"
            return
        self.where = where
        if found := uri_credentials(where):  # the config refuses them first; this is for any other way in
            raise StoreError(
                f"{shown_uri(where)}: carries credentials ({', '.join(found)}); set them in the environment"
            )
        try:
            self.fs, root = pafs.FileSystem.from_uri(where)
        except (pyarrow.ArrowException, ValueError, OSError) as err:
            raise StoreError(f"{redact(where)}: cannot open it as an object store ({redact(str(err))})") from None
        self.root = root.rstrip("/")

    def __reduce__(self):
        return Store, (self.where,)

    def name(self, key: str = "") -> str:
        """Where `key` is, as its user finds it: a path, or a URI (redacted, though a store's URI carries none)."""
        if self.local:
            return str(self.path(key))
        return redact(uri_join(self.where, key))

    def path(self, key: str = "") -> Path:
        """`key` on this machine's filesystem (a path store only)."""
        assert self.local, "an object store's keys have no path"
        return Path(self._path(key))

    def _path(self, key: str) -> str:
        key = key.strip("/")  # "" names the store's own directory: "/run_state.pt" a file in it
        return f"{self.root.rstrip('/')}/{key}" if key else self.root

    def _do(self, what: str, key: str, call, *args):
        try:
            return call(*args)
        except (pyarrow.ArrowException, OSError) as err:
            raise StoreError(f"{self.name(key)}: could not {what} ({redact(str(err))})") from None

    def check(self) -> None:
        """Raise `StoreError` unless the store answers (a listing of its root; a path is created)."""
        if self.local:
            self._do("create it", "", self.fs.create_dir, self.root)
        self._do("list it", "", self.fs.get_file_info, self.root)

    def publish(self, local: Path, key: str) -> dict[str, dict]:
        """What this node wrote at `local` (a file or a tree) made the store's at `key`: synced and moved there on
        a path, uploaded to an object store (the local copy then removed, whether the upload succeeds or fails).
        Returns each file, by its path under `key`, with its size and checksum; nothing when `local` is not
        there (a node that staged nothing, or whose files another node of a shared filesystem published)."""
        try:
            if not local.exists():
                return {}
            written = manifest.entries(local) if local.is_dir() else {"": manifest.entry(local)}
            if self.local:
                target = self.path(key)
                if target != local:
                    self.delete(key)
                    target.parent.mkdir(parents=True, exist_ok=True)
                    os.replace(local, target)
                    manifest.sync_dir(target.parent)
            else:
                self.upload(local, key)
            return written
        finally:
            if not self.local:
                discard(local)

    def upload(self, local: Path, key: str) -> None:
        """A copy of a file, or of a directory's whole tree, at `key` (the local one kept)."""
        self._do("upload", key, pafs.copy_files, str(local), self._path(key), pafs.LocalFileSystem(), self.fs)

    def fetch(self, key: str, local: Path, expected: dict[str, dict]) -> Path:
        """The file or tree at `key` readable on this node, each file checked against the size and checksum its
        writer recorded (`expected`, by path under `key`): in place on a path (verified when the checkpoint was
        found), downloaded to `local` from an object store. Returns where it is."""
        if self.local:
            return self.path(key)
        self.download(key, local)
        if why := manifest.mismatch(local, expected):
            raise StoreError(f"{self.name(key)}: downloaded to {socket.gethostname()}:{local}, {why}")
        return local

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
        """`text` at `key`, whole or not at all: on a path written to a temporary name, synced, and renamed (an
        object store's put is atomic of itself)."""
        if not self.local:
            with self._do("write", key, self.fs.open_output_stream, self._path(key)) as stream:
                stream.write(text.encode())
            return
        target = self.path(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f".{target.name}.tmp")
        with partial.open("w") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.replace(partial, target)
        manifest.sync_dir(target.parent)

    def children(self, key: str) -> list[str]:
        """The names directly under `key` (none when it does not exist)."""
        if not self.exists(key):
            return []
        listing = self._do("list", key, self.fs.get_file_info, pafs.FileSelector(self._path(key)))
        return sorted(info.base_name for info in listing)

    def sizes(self, key: str) -> dict[str, int]:
        """The size of every file under `key`, by its path below `key`, as the store lists them."""
        source = self._path(key)
        if not self.exists(key):
            return {}
        listing = self._do("list", key, self.fs.get_file_info, pafs.FileSelector(source, recursive=True))
        return {
            entry.path[len(source) :].lstrip("/"): entry.size
            for entry in listing
            if entry.type == pafs.FileType.File and not entry.path.endswith(f"/{manifest.MANIFEST}")
        }

    def checksums(self, key: str, files: dict[str, dict]) -> str | None:
        """The first file of `files` under `key` whose content does not match its checksum (None: none). Reads
        every file: on a path only (in an object store each reader checks what it downloads, `fetch`)."""
        return manifest.mismatch(self.path(key), files) if self.local else None

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


def discard(local: Path) -> None:
    """A staged file or tree removed from this node's disk (nothing there is not an error)."""
    if local.is_dir() and not local.is_symlink():
        shutil.rmtree(local, ignore_errors=True)
    else:
        local.unlink(missing_ok=True)


@dataclass(frozen=True)
class RunStore:
    """Where a run lives, resolved once (`grpo_dist.storage.run_dir.open_run`) and passed down: `store` holds the run
    under the key `run` (run.output_dir/run.name), its checkpoints under `checkpoints_key` of `checkpoints` (the same
    store, or `checkpoint.dir`); `work` is where this process writes the run's files before they are the store's (the
    run directory itself on a path, this node's staging directory with an object store). Every node that writes stages
    under the same absolute paths."""

    store: Store
    run: str
    work: Path
    checkpoints: Store
    checkpoints_key: str

    @property
    def staging(self) -> bool:
        """Whether files are written on each node's disk and uploaded (an object store) rather than in place."""
        return not self.store.local

    def staged(self, store: Store, key: str) -> Path:
        """Where the writers of `key` in `store` write it on their node before `Store.publish`: beside it under a
        temporary name on a path (renamed when whole), under the staging directory with an object store."""
        final = store.path(key) if store.local else self.work.parent / key
        return final.with_name(f".{final.name}.tmp")

    def upload_run_files(self) -> None:
        """With an object store: the driver's files of the run (metrics, samples, config, W&B files) uploaded; what
        the learner writes there it uploads itself. Nothing to do on a path, where they are written in place."""
        if not self.staging:
            return
        for entry in sorted(self.work.iterdir()) if self.work.is_dir() else []:
            if entry.name not in LEARNER_WRITES and entry.name != LOCK:  # the lock is this node's running run's
                self.store.upload(entry, f"{self.run}/{entry.name}")

    def download_run_files(self) -> None:
        """The driver's files of a run in an object store (as `upload_run_files` left them) into `work`, to go on
        from; on a path they are there already."""
        if not self.staging:
            return
        self.work.mkdir(parents=True, exist_ok=True)
        for name in self.store.children(self.run):
            if name not in LEARNER_WRITES:
                self.store.download(f"{self.run}/{name}", self.work / name)


OWN = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
"""How a directory of the run's own part is opened: never through a symbolic link."""


def private_dir(root: str | Path, *parts: str) -> Path:
    """`root/parts...` (the staging directory and the run's directory in it) as directories of this user's alone,
    each created where missing with mode 0o700. From `root` down (and for any directory above it created here) each
    is opened relative to its parent without following a symbolic link, refused unless this user owns it, and
    brought to mode 0o700; the directories above `root` that exist (/tmp) are taken as they are. Returns the
    absolute path (not resolved: a link in it would have been refused); raises `StorageError` naming the path."""
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
        raise StorageError(
            f"{where}: cannot create it ({err.strerror}): set run.staging_dir to a directory on this "
            "node's own disk that you can write"
        ) from None
    return True


def _enter(parent: int, name: str, where: Path, own: bool) -> int:
    """The open directory `name` in `parent`; one of the run's own (`own`) is not reached through a link, is this
    user's and is left with mode 0o700."""
    if own and stat.S_ISLNK(os.lstat(name, dir_fd=parent).st_mode):
        raise StorageError(
            f"{where} is a symbolic link (to {os.readlink(name, dir_fd=parent)}), which a staging "
            "directory is never reached through: someone may have planted it to read or replace the "
            "run's files; remove it, or set run.staging_dir to a directory of your own"
        )
    try:
        child = os.open(name, OWN if own else os.O_RDONLY | os.O_DIRECTORY, dir_fd=parent)
    except OSError as err:
        why = "a symbolic link" if err.errno == errno.ELOOP else err.strerror
        raise StorageError(
            f"{where}: cannot open it as a directory ({why}): remove it, or set run.staging_dir to "
            "a directory of your own"
        ) from None
    if own:
        _check_owner(child, where)
    return child


def _check_owner(directory: int, where: Path) -> None:
    """Refuse (closing it) the open `directory` unless this user owns it; bring its mode to 0o700."""
    info = os.fstat(directory)
    if info.st_uid != os.geteuid():
        os.close(directory)
        raise StorageError(
            f"{where} belongs to another user (uid {info.st_uid}, you are {os.geteuid()}), who could "
            "read or replace the run's files there: set run.staging_dir to a directory of your own "
            "(/tmp/grpo-dist-staging-$USER)"
        )
    if stat.S_IMODE(info.st_mode) != 0o700:
        os.fchmod(directory, 0o700)

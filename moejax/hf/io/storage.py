"""Where a checkpoint's files are read from: `moejax.hf.io.location.open_location` turns a local
folder, an `https://` base URL or a Hugging Face repository `hf://org/name[@revision]` into a
`Storage`, so that one reader (`moejax.hf.io.checkpoint_reader`) and one strict header parser
(`moejax.hf.io.safetensors_format`) serve all three.

What the reader asks of a storage, and nothing more: a file's first bytes and its size (a shard's
header), an exact byte range (one tensor), a small file whole (config.json, the index), the shard
list of a folder without an index, and, for a local folder, the checks that keep reads inside it.
`LocalStorage` is the folder on disk; the remote storages (`moejax.hf.io.remote`, imported only when a
remote location is opened, so fsspec and huggingface_hub stay optional) read by range requests only.

Commands that write (prune, merge, save) or read every weight (a calibration pass, `from_pretrained`)
take local folders only; the read-only audits (inspect, plan, diff, data-free score) take either.
"""

from __future__ import annotations

import abc

import os
import stat
from pathlib import Path

from moejax.errors import CheckpointError, ConfigError

REMOTE_PREFIXES = ("http://", "https://", "hf://")
_MANGLED_PREFIXES = ("http:/", "https:/", "hf:/")  # a URL that went through pathlib.Path


class MissingFile(CheckpointError):
    """A file the checkpoint needs is not there: no such local file, or HTTP 404."""


class Storage(abc.ABC):
    """The reads a checkpoint reader needs. Paths are `root / name` objects (a `Path`, or a
    `moejax.hf.io.remote.RemotePath`); every error names the file (its path or URL)."""

    remote: bool = False
    root: object
    header_prefetch: int = 8  # bytes read before the header length is known (remote: more, one request)

    @abc.abstractmethod
    def read_prefix(self, path, length: int) -> tuple[int, bytes]:
        """(the file's size, its first min(length, size) bytes)."""
        ...

    def read_prefixes(self, paths, length: int) -> dict:
        """read_prefix of several files (concurrently where the storage can)."""
        return {path: self.read_prefix(path, length) for path in paths}

    @abc.abstractmethod
    def read_range(self, path, start: int, length: int) -> bytes:
        """The bytes [start, start + length) of `path`; remote storages return exactly that many or
        raise, a local read may come back short (the caller names the tensor)."""
        ...

    def read_into(self, path, start: int, buffer: bytearray) -> int:
        """Fill `buffer` from byte `start` of `path`; returns the count read."""
        data = self.read_range(path, start, len(buffer))
        buffer[:len(data)] = data
        return len(data)

    @abc.abstractmethod
    def read_file(self, path) -> bytes | None:
        """A small file whole (config.json, the index), or None when there is no such file."""
        ...

    def check_shard(self, path, index_path, shard: str) -> None:
        """Refuse a shard named by the index that is missing or unsafe to read (remote: checked
        when its header is read, which is the first request for it anyway)."""

    @abc.abstractmethod
    def shard_files(self, single_name: str) -> list:
        """Without an index: `single_name` (model.safetensors) if present, else every *.safetensors."""
        ...

    def describe(self) -> str:
        """What reports call the checkpoint: a remote one's URL (a local folder: its resolved path)."""
        return str(self.root)


def is_remote(location) -> bool:
    """True for an https:// or hf:// location (a string) or an opened remote storage."""
    if isinstance(location, Storage):
        return location.remote
    return isinstance(location, str) and location.startswith(REMOTE_PREFIXES)


def require_local(location, command: str) -> None:
    """Refuse a remote location for a command that writes or reads every weight, by name."""
    if is_remote(location):
        name = location.describe() if isinstance(location, Storage) else location
        raise ConfigError(
            f"{command}: {name} is a remote checkpoint; {command} reads every weight and takes a local "
            "folder only (remote checkpoints are read by `moejax inspect`, `plan`, `diff` and data-free "
            "`moejax score --scores bias,signed,l1`); download it first, e.g. `hf download ORG/NAME --local-dir DIR`")


# --------------------------------------------------------------------------------------------
# A local folder
# --------------------------------------------------------------------------------------------


class LocalStorage(Storage):
    """A checkpoint folder on disk (root None: single files, as `SafetensorsFile(path)` reads)."""

    def __init__(self, root: str | os.PathLike | None = None):
        self.root = None if root is None else Path(root)
        if self.root is not None and not self.root.is_dir():
            hint = ""
            if str(root).startswith(_MANGLED_PREFIXES):
                hint = (" (a URL? remote checkpoints are read by `moejax inspect`, `plan`, `diff` and data-free "
                        "`moejax score` only; pass the location as a string, not a pathlib.Path)")
            raise CheckpointError(f"{self.root}: checkpoint directory does not exist{hint}")

    def describe(self) -> str:
        return str(self.root.resolve())

    def read_prefix(self, path, length: int) -> tuple[int, bytes]:
        with open(path, "rb") as handle:
            return os.fstat(handle.fileno()).st_size, handle.read(length)

    def read_range(self, path, start: int, length: int) -> bytes:
        with open(path, "rb") as handle:
            handle.seek(start)
            return handle.read(length)

    def read_into(self, path, start: int, buffer: bytearray) -> int:
        with open(path, "rb") as handle:
            handle.seek(start)
            return handle.readinto(buffer)

    def read_file(self, path) -> bytes | None:
        try:
            return Path(path).read_bytes()
        except FileNotFoundError:
            return None

    def check_shard(self, path, index_path, shard: str) -> None:
        if not path.exists() and not path.is_symlink():
            raise MissingFile(f"{index_path}: names shard {shard!r}, which does not exist")
        check_regular_file(path, allowed_root(self.root), f"{index_path}: shard {shard!r}")

    def shard_files(self, single_name: str) -> list:
        single = self.root / single_name
        shards = [single] if single.exists() or single.is_symlink() else sorted(self.root.glob("*.safetensors"))
        root = allowed_root(self.root)
        for path in shards:
            check_regular_file(path, root, f"{self.root}: shard {path.name!r}")
        return shards


def allowed_root(directory: Path) -> Path:
    """The folder a checkpoint's files may resolve into: the checkpoint folder itself, or, for a
    Hugging Face cache snapshot (`models--org--name/snapshots/REV/`, whose files are symlinks to
    `../../blobs/HASH`), the cached repository's folder."""
    directory = Path(directory)
    if directory.resolve().parent.name == "snapshots" and (directory.resolve().parent.parent / "blobs").is_dir():
        return directory.resolve().parent.parent
    return directory.resolve()


def check_regular_file(path: Path, root: Path, where: str) -> Path:
    """`path` resolved, refused unless it is a regular file inside `root` (a symlink may point
    anywhere inside it). Dangling links, link loops, FIFOs and devices are refused by name."""
    try:
        resolved = Path(path).resolve(strict=True)
        mode = resolved.stat().st_mode
    except FileNotFoundError:
        raise CheckpointError(f"{where}: {path} does not exist (or is a dangling symbolic link)") from None
    except (OSError, RuntimeError) as error:  # ELOOP, EACCES; RuntimeError: a loop on older Pythons
        raise CheckpointError(f"{where}: {path} cannot be resolved: {error}") from None
    if not resolved.is_relative_to(root):
        raise CheckpointError(f"{where}: {path} resolves to {resolved}, outside the checkpoint folder {root}; "
                              "refusing to read or copy files from elsewhere")
    if not stat.S_ISREG(mode):
        raise CheckpointError(f"{where}: {path} is not a regular file (a FIFO, device or folder)")
    return resolved


LOCAL_FILES = LocalStorage()

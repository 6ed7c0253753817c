"""A Hugging Face checkpoint folder read one tensor at a time (`CheckpointReader`), and the path
checks that keep its reads inside the folder: a shard named by the index, or a symbolic link, must
resolve to a regular file inside the checkpoint (or, for a Hugging Face cache snapshot, inside the
cached repository's folder).

Only headers are parsed up front (`moejax.hf.safetensors_format`); tensor data is read on demand
and never cached, so a ~700 GB checkpoint is only ever visited tensor by tensor.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import numpy as np

from moejax.errors import CheckpointError
from moejax.hf.safetensors_format import (CONFIG_NAME, INDEX_NAME, SINGLE_SHARD_NAME, SafetensorsFile,
                                          TensorInfo)


class CheckpointReader:
    """A Hugging Face checkpoint folder read one tensor at a time.

    The tensor -> shard map comes from `model.safetensors.index.json` when present (never derived
    from shard names, which vary between publishers), else from `model.safetensors`, else from every
    `*.safetensors` file in the folder. Shard headers are parsed on first use and cached; tensor
    data is never cached.
    """

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise CheckpointError(f"{self.directory}: checkpoint directory does not exist")
        self._headers: dict[Path, SafetensorsFile] = {}
        self._index_path = self.directory / INDEX_NAME
        if self._index_path.exists():
            self._weight_map = _read_weight_map(self._index_path, allowed_root(self.directory))
            self._check_index_lists_every_tensor()
        else:
            self._weight_map = self._map_from_shard_headers()

    def keys(self) -> list[str]:
        return sorted(self._weight_map)

    def __contains__(self, name: str) -> bool:
        return name in self._weight_map

    def shard_of(self, name: str) -> Path:
        if name not in self._weight_map:
            source = self._index_path if self._index_path.exists() else self.directory
            raise CheckpointError(f"{source}: no tensor named {name!r}")
        return self._weight_map[name]

    def info(self, name: str) -> TensorInfo:
        shard = self._shard(self.shard_of(name))
        if name not in shard:
            raise CheckpointError(f"{self._index_path}: maps tensor {name!r} to {shard.path.name}, "
                                  f"which has no such tensor")
        return shard.info(name)

    def read(self, name: str) -> np.ndarray:
        return self._shard(self.info(name).file).read(name)

    def read_bytes(self, name: str) -> bytes:
        return self._shard(self.info(name).file).read_bytes(name)

    def files(self) -> list[Path]:
        """The shard files, sorted, each once."""
        return sorted(set(self._weight_map.values()))

    def total_bytes(self) -> int:
        """Bytes of tensor data (parses every shard header, reads no data)."""
        return sum(self.info(name).nbytes for name in self._weight_map)

    def validate(self) -> None:
        """Parse every shard header and check that each tensor is where the index says; call this
        before long work so that a broken checkpoint fails first, not halfway."""
        for name in self._weight_map:
            self.info(name)

    def config(self) -> dict:
        return read_json_object(self.directory / CONFIG_NAME)

    def has_index(self) -> bool:
        return self._index_path.exists()

    def names_in(self, path: Path) -> list[str]:
        """The tensors the weight map puts in shard `path`, sorted."""
        return sorted(name for name, shard in self._weight_map.items() if shard == path)

    def shard(self, path: Path) -> SafetensorsFile:
        """The parsed header of one shard file (its metadata, its tensors' infos)."""
        return self._shard(path)

    def _shard(self, path: Path) -> SafetensorsFile:
        if path not in self._headers:
            self._headers[path] = SafetensorsFile(path)
        return self._headers[path]

    def _map_from_shard_headers(self) -> dict[str, Path]:
        """Without an index, the shards' own headers say which tensor is where."""
        single = self.directory / SINGLE_SHARD_NAME
        shards = [single] if single.exists() or single.is_symlink() else sorted(self.directory.glob("*.safetensors"))
        if not shards:
            raise CheckpointError(
                f"{self.directory}: no {INDEX_NAME}, no {SINGLE_SHARD_NAME} and no *.safetensors files")
        root = allowed_root(self.directory)
        weight_map: dict[str, Path] = {}
        for path in shards:
            check_regular_file(path, root, f"{self.directory}: shard {path.name!r}")
            for name in self._shard(path).keys():
                if name in weight_map:
                    raise CheckpointError(f"{self.directory}: tensor {name!r} is in both "
                                          f"{weight_map[name].name} and {path.name}")
                weight_map[name] = path
        return weight_map

    def _check_index_lists_every_tensor(self) -> None:
        """Every tensor of every indexed shard must be in the index, under that shard: a tensor the
        index does not list would be invisible to every command and silently dropped by a copy."""
        unlisted = []
        for path in self.files():
            listed = set(self.names_in(path))
            unlisted += [f"{name!r} in {path.relative_to(self.directory)}"
                         for name in self._shard(path).keys() if name not in listed]
        if unlisted:
            raise CheckpointError(f"{self._index_path}: {len(unlisted)} tensor(s) are in a shard but not in the "
                                  f"index's weight_map (or listed under another shard), e.g. {unlisted[:3]}")


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


def read_json_object(path: Path) -> dict:
    """A JSON file that must hold an object (config.json, the index)."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as error:
        raise CheckpointError(f"{path}: file is missing") from error
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{path}: not valid UTF-8 JSON: {error}") from error
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def _read_weight_map(index_path: Path, root: Path) -> dict[str, Path]:
    """The index's weight_map with every shard checked before any is read: a relative path inside
    the checkpoint folder (subfolders allowed), resolving to a regular file inside `root`."""
    weight_map = read_json_object(index_path).get("weight_map")
    if not isinstance(weight_map, dict) or not all(
            isinstance(name, str) and isinstance(shard, str) for name, shard in weight_map.items()):
        raise CheckpointError(f"{index_path}: 'weight_map' must map tensor names to shard file names")
    for shard in sorted(set(weight_map.values())):
        relative = Path(shard)
        if not shard or relative.is_absolute() or ".." in relative.parts or "\\" in shard:
            raise CheckpointError(f"{index_path}: names shard {shard!r}; shard paths must be relative paths "
                                  "inside the checkpoint folder")
        if not (index_path.parent / shard).exists() and not (index_path.parent / shard).is_symlink():
            raise CheckpointError(f"{index_path}: names shard {shard!r}, which does not exist")
        check_regular_file(index_path.parent / shard, root, f"{index_path}: shard {shard!r}")
    return {name: index_path.parent / shard for name, shard in weight_map.items()}

"""A Hugging Face checkpoint read one tensor at a time (`CheckpointReader`), from a local folder or
a remote location (an https:// base URL, hf://org/name[@revision]) through the same code: the
location is opened once (`moejax.hf.io.location.open_location`) and every read goes through it.

For a local folder, the path checks keep reads inside it: a shard named by the index, or a symbolic
link, must resolve to a regular file inside the checkpoint (or, for a Hugging Face cache snapshot,
inside the cached repository's folder). A remote checkpoint is read by range requests only.

Only headers are parsed up front (`moejax.hf.io.safetensors_format`); tensor data is read on demand
and never cached, so a ~700 GB checkpoint is only ever visited tensor by tensor.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from moejax.errors import CheckpointError
from moejax.hf.io.safetensors_format import (CONFIG_NAME, INDEX_NAME, SINGLE_SHARD_NAME, SafetensorsFile,
                                          TensorInfo, refuse_duplicate_keys)
from moejax.hf.io.location import open_location
from moejax.hf.io.storage import MissingFile, Storage, allowed_root, check_regular_file

__all__ = ["CheckpointReader", "allowed_root", "check_regular_file", "parse_json_object", "read_json_object"]


class CheckpointReader:
    """A Hugging Face checkpoint read one tensor at a time, from a local folder or a remote location.

    The tensor -> shard map comes from `model.safetensors.index.json` when present (never derived
    from shard names, which vary between publishers), else from `model.safetensors`, else from every
    `*.safetensors` file in the folder (a local folder or an hf:// repository; an https:// server
    cannot be listed). Shard headers are parsed on first use and cached (a remote checkpoint's are
    all fetched at once, concurrently); tensor data is never cached.
    """

    def __init__(self, location: str | os.PathLike | Storage):
        self.storage = open_location(location)
        self.directory = self.storage.root
        self._headers: dict = {}
        self._index_path = self.directory / INDEX_NAME
        index = self.storage.read_file(self._index_path)
        self._has_index = index is not None
        if self._has_index:
            self._weight_map = _read_weight_map(index, self._index_path, self.storage)
            self._fetch_headers(self.files())
            self._check_index_lists_every_tensor()
        else:
            self._weight_map = self._map_from_shard_headers()

    def keys(self) -> list[str]:
        return sorted(self._weight_map)

    def __contains__(self, name: str) -> bool:
        return name in self._weight_map

    def shard_of(self, name: str):
        if name not in self._weight_map:
            source = self._index_path if self._has_index else self.directory
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

    def read_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of a tensor's first axis, reading only those bytes."""
        return self._shard(self.info(name).file).read_rows(name, start, stop)

    def files(self) -> list:
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
        path = self.directory / CONFIG_NAME
        data = self.storage.read_file(path)
        if data is None:
            raise MissingFile(f"{path}: file is missing")
        return parse_json_object(data, path)

    def has_index(self) -> bool:
        return self._has_index

    def names_in(self, path) -> list[str]:
        """The tensors the weight map puts in shard `path`, sorted."""
        return sorted(name for name, shard in self._weight_map.items() if shard == path)

    def shard(self, path) -> SafetensorsFile:
        """The parsed header of one shard file (its metadata, its tensors' infos)."""
        return self._shard(path)

    def _shard(self, path) -> SafetensorsFile:
        if path not in self._headers:
            self._headers[path] = SafetensorsFile(path, self.storage)
        return self._headers[path]

    def _fetch_headers(self, paths: list) -> None:
        """A remote checkpoint's shard headers, fetched together (one request per shard where the
        header fits the storage's prefetch, all in flight at once); a local folder's stay lazy."""
        if not self.storage.remote:
            return
        try:
            prefixes = self.storage.read_prefixes(paths, self.storage.header_prefetch)
        except MissingFile as error:
            where = self._index_path if self._has_index else self.directory
            raise MissingFile(f"{where}: names a shard that does not exist: {error}") from error
        for path in paths:
            self._headers[path] = SafetensorsFile(path, self.storage, prefix=prefixes[path])

    def _map_from_shard_headers(self) -> dict:
        """Without an index, the shards' own headers say which tensor is where."""
        shards = self.storage.shard_files(SINGLE_SHARD_NAME)
        if not shards:
            raise CheckpointError(
                f"{self.directory}: no {INDEX_NAME}, no {SINGLE_SHARD_NAME} and no *.safetensors files")
        try:
            self._fetch_headers(shards)
        except MissingFile as error:
            raise MissingFile(f"{self.directory}: no {INDEX_NAME} and no {SINGLE_SHARD_NAME} ({error}); "
                              "an http(s) server cannot be listed, so a checkpoint served over http(s) needs "
                              "one of the two") from None
        weight_map: dict = {}
        for path in shards:
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


def parse_json_object(data: bytes, path) -> dict:
    """A JSON file that must hold an object (config.json, the index), no key given twice."""
    try:
        value = json.loads(data.decode("utf-8"), object_pairs_hook=refuse_duplicate_keys)
    except (UnicodeDecodeError, ValueError) as error:  # JSONDecodeError and a repeated key are ValueErrors
        raise CheckpointError(f"{path}: not valid UTF-8 JSON: {error}") from error
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def read_json_object(path: Path) -> dict:
    """A local JSON file that must hold an object."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError as error:
        raise CheckpointError(f"{path}: file is missing") from error
    except OSError as error:
        raise CheckpointError(f"{path}: not valid UTF-8 JSON: {error}") from error
    return parse_json_object(data, path)


def _read_weight_map(index: bytes, index_path, storage: Storage) -> dict:
    """The index's weight_map with every shard checked before any is read: a relative path inside
    the checkpoint folder (subfolders allowed); a local one must resolve to a regular file inside
    the folder (or the cache repository it is a snapshot of)."""
    weight_map = parse_json_object(index, index_path).get("weight_map")
    if not isinstance(weight_map, dict) or not all(
            isinstance(name, str) and isinstance(shard, str) for name, shard in weight_map.items()):
        raise CheckpointError(f"{index_path}: 'weight_map' must map tensor names to shard file names")
    for shard in sorted(set(weight_map.values())):
        relative = Path(shard)
        if not shard or relative.is_absolute() or ".." in relative.parts or "\\" in shard:
            raise CheckpointError(f"{index_path}: names shard {shard!r}; shard paths must be relative paths "
                                  "inside the checkpoint folder")
        storage.check_shard(index_path.parent / shard, index_path, shard)
    return {name: index_path.parent / shard for name, shard in weight_map.items()}

"""Reading and writing Hugging Face safetensors checkpoints one tensor at a time.

The headers are parsed here rather than by the `safetensors` package so that every defect can be
reported as a `CheckpointError` naming the file and the tensor, so that raw bytes of dtypes numpy
lacks (FP8, FP4) can be carried through untouched, and so that no call ever maps or reads a whole
checkpoint: a DeepSeek-V3 checkpoint is ~700 GB and is only ever visited tensor by tensor.

Format (spec section 5.1): u64 little-endian header length N, N bytes of UTF-8 JSON, then the data
buffer. Offsets in the header are relative to the buffer; the tensors must tile it exactly.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
import shutil
import socket
import stat
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from moejax.errors import CheckpointError
from moejax.signals import KillSwitch

INDEX_NAME = "model.safetensors.index.json"
SINGLE_SHARD_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
DEFAULT_METADATA = {"format": "pt"}  # transformers refuses to load a file without it

_HEADER_LENGTH_BYTES = 8
_MAX_HEADER_BYTES = 100_000_000  # the official reader's limit; larger means a corrupt length field
_DATA_ALIGNMENT = 8  # the official writer pads the header so the data buffer starts 8-aligned

# Bits per element of every dtype code the format defines. Sub-byte codes (F4, F6_*) are legal as
# long as each tensor fills whole bytes; they can be carried as raw bytes but not read as arrays.
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8, "U8": 8, "I8": 8, "I16": 16, "U16": 16, "I32": 32, "U32": 32, "I64": 64, "U64": 64,
    "F16": 16, "BF16": 16, "F32": 32, "F64": 64, "C64": 64,
    "F8_E4M3": 8, "F8_E5M2": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8,
    "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}

# Explicitly little-endian, as the format is, so reads stay correct on a big-endian host.
_NUMPY_DTYPES: dict[str, np.dtype] = {
    code: np.dtype(numpy_type).newbyteorder("<")
    for code, numpy_type in {
        "BOOL": np.bool_, "U8": np.uint8, "I8": np.int8, "I16": np.int16, "U16": np.uint16,
        "I32": np.int32, "U32": np.uint32, "I64": np.int64, "U64": np.uint64,
        "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F32": np.float32, "F64": np.float64,
        "C64": np.complex64,
        "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
        "F8_E8M0": ml_dtypes.float8_e8m0fnu, "F8_E4M3FNUZ": ml_dtypes.float8_e4m3fnuz,
        "F8_E5M2FNUZ": ml_dtypes.float8_e5m2fnuz,
    }.items()
}


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: enough to read it later without re-parsing the header."""

    name: str
    dtype: str  # safetensors dtype code, e.g. "BF16"
    shape: tuple[int, ...]
    file: Path
    begin: int  # absolute byte offset in `file`
    end: int  # absolute, exclusive

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class RawTensor:
    """A tensor as bytes plus its dtype code, so dtypes numpy lacks are copied byte for byte."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes


def tensor_nbytes(dtype: str, shape: tuple[int, ...], where: str) -> int:
    """Bytes a tensor of this dtype and shape occupies; `where` names the file/tensor in errors."""
    if dtype not in DTYPE_BITS:
        raise CheckpointError(f"{where}: unknown dtype {dtype!r}, expected one of {sorted(DTYPE_BITS)}")
    bits = math.prod(shape) * DTYPE_BITS[dtype]
    if bits % 8:
        raise CheckpointError(f"{where}: {dtype} tensor of shape {list(shape)} does not fill whole bytes")
    return bits // 8


def numpy_dtype(dtype: str, where: str) -> np.dtype:
    """The numpy dtype for a safetensors code; ml_dtypes supplies BF16 and the FP8 formats."""
    if dtype not in _NUMPY_DTYPES:
        raise CheckpointError(f"{where}: dtype {dtype!r} has no numpy equivalent; use read_bytes")
    return _NUMPY_DTYPES[dtype]


def safetensors_dtype(dtype: np.dtype, where: str) -> str:
    """The safetensors code for a numpy dtype, whatever its byte order."""
    native = dtype.newbyteorder("=")
    for code, candidate in _NUMPY_DTYPES.items():
        if native == candidate.newbyteorder("="):
            return code
    raise CheckpointError(f"{where}: numpy dtype {dtype} has no safetensors equivalent")


# --------------------------------------------------------------------------------------------
# Reading one file
# --------------------------------------------------------------------------------------------


class SafetensorsFile:
    """One .safetensors file whose header is parsed and validated up front; data is read on demand.

    Validation happens at construction so that a corrupt file fails before any expensive work,
    with a message naming the file and the offending tensor.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        header, data_start, data_size = _read_header(self.path)
        self.metadata: dict[str, str] = _parse_metadata(header.pop("__metadata__", {}), self.path)
        self._infos = {
            name: _parse_entry(name, entry, self.path, data_start, data_size)
            for name, entry in header.items()
        }
        _check_offsets_tile_buffer(self._infos.values(), self.path, data_start, data_size)

    def keys(self) -> list[str]:
        return sorted(self._infos)

    def __contains__(self, name: str) -> bool:
        return name in self._infos

    def info(self, name: str) -> TensorInfo:
        if name not in self._infos:
            raise CheckpointError(f"{self.path}: no tensor named {name!r}")
        return self._infos[name]

    def read_bytes(self, name: str) -> bytes:
        """Exactly this tensor's bytes (one seek and one read, never the whole file)."""
        info = self.info(name)
        with open(info.file, "rb") as handle:
            handle.seek(info.begin)
            data = handle.read(info.nbytes)
        _check_complete_read(info, len(data))
        return data

    def read(self, name: str) -> np.ndarray:
        """The tensor as a writable numpy array of its dtype and shape."""
        info = self.info(name)
        dtype = numpy_dtype(info.dtype, f"{info.file}: tensor {name!r}")
        buffer = bytearray(info.nbytes)
        with open(info.file, "rb") as handle:
            handle.seek(info.begin)
            _check_complete_read(info, handle.readinto(buffer))
        return np.frombuffer(buffer, dtype=dtype).reshape(info.shape)


def _check_complete_read(info: TensorInfo, count: int) -> None:
    """A short read means the file shrank after its header was validated."""
    if count != info.nbytes:
        raise CheckpointError(
            f"{info.file}: tensor {info.name!r} expected {info.nbytes} bytes at offset {info.begin}, "
            f"read {count} (file changed since it was opened?)")


def _read_header(path: Path) -> tuple[dict, int, int]:
    """The header JSON as a dict, the absolute offset of the data buffer, and the buffer's size."""
    try:
        file_size = path.stat().st_size
        with open(path, "rb") as handle:
            length_field = handle.read(_HEADER_LENGTH_BYTES)
            if len(length_field) < _HEADER_LENGTH_BYTES:
                raise CheckpointError(
                    f"{path}: {file_size} bytes, shorter than the 8-byte header length field")
            (header_length,) = struct.unpack("<Q", length_field)
            if header_length > min(_MAX_HEADER_BYTES, file_size - _HEADER_LENGTH_BYTES):
                raise CheckpointError(
                    f"{path}: header length field says {header_length} bytes, but the file has "
                    f"{file_size - _HEADER_LENGTH_BYTES} after it (limit {_MAX_HEADER_BYTES}); "
                    "truncated or not a safetensors file")
            header_bytes = handle.read(header_length)
    except OSError as error:
        raise CheckpointError(f"{path}: cannot read safetensors file: {error}") from error
    header = _parse_header_json(header_bytes, path)
    data_start = _HEADER_LENGTH_BYTES + header_length
    return header, data_start, file_size - data_start


def _parse_header_json(header_bytes: bytes, path: Path) -> dict:
    """Decode the JSON header, refusing duplicate keys (the format forbids them)."""
    try:
        header = json.loads(header_bytes.decode("utf-8"), object_pairs_hook=_refuse_duplicate_keys)
    except (UnicodeDecodeError, json.JSONDecodeError, _DuplicateKey) as error:
        raise CheckpointError(f"{path}: header is not valid UTF-8 JSON: {error}") from error
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header must be a JSON object, got {type(header).__name__}")
    return header


class _DuplicateKey(ValueError):
    """Raised inside json.loads when a header names a tensor twice (json would keep the last)."""


def _refuse_duplicate_keys(pairs: list[tuple[str, object]]) -> dict:
    result = {}
    for key, value in pairs:
        if key in result:
            raise _DuplicateKey(f"duplicate key {key!r}")
        result[key] = value
    return result


def _parse_metadata(metadata: object, path: Path) -> dict[str, str]:
    if not isinstance(metadata, dict) or not all(
            isinstance(key, str) and isinstance(value, str) for key, value in metadata.items()):
        raise CheckpointError(f"{path}: __metadata__ must map strings to strings, got {metadata!r}")
    return metadata


def _parse_entry(name: str, entry: object, path: Path, data_start: int, data_size: int) -> TensorInfo:
    """One header entry validated into a TensorInfo with absolute offsets."""
    where = f"{path}: tensor {name!r}"
    if not isinstance(entry, dict) or {"dtype", "shape", "data_offsets"} - entry.keys():
        raise CheckpointError(
            f"{where}: entry must be an object with dtype, shape and data_offsets, got {entry!r}")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(shape, list) or not all(_is_natural(dim) for dim in shape):
        raise CheckpointError(f"{where}: shape must be a list of non-negative integers, got {shape!r}")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_natural(o) for o in offsets):
        raise CheckpointError(f"{where}: data_offsets must be two non-negative integers, got {offsets!r}")
    begin, end = offsets
    if not begin <= end <= data_size:
        raise CheckpointError(
            f"{where}: data_offsets {offsets} outside the {data_size}-byte data buffer (truncated file?)")
    expected = tensor_nbytes(dtype, tuple(shape), where)
    if end - begin != expected:
        raise CheckpointError(
            f"{where}: data_offsets {offsets} span {end - begin} bytes, expected {expected} "
            f"for {dtype} of shape {shape}")
    return TensorInfo(name, dtype, tuple(shape), path, data_start + begin, data_start + end)


def _is_natural(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_offsets_tile_buffer(
        infos: Iterable[TensorInfo], path: Path, data_start: int, data_size: int) -> None:
    """Tensors must cover the data buffer with no overlap and no gap, as the official reader
    requires; anything else means the header and the data disagree."""
    covered_until, previous = data_start, None
    for info in sorted(infos, key=lambda info: (info.begin, info.end)):
        if info.begin < covered_until:
            raise CheckpointError(f"{path}: tensor {info.name!r} overlaps tensor {previous!r}")
        if info.begin > covered_until:
            raise CheckpointError(
                f"{path}: tensor {info.name!r} starts at data offset {info.begin - data_start}, "
                f"expected {covered_until - data_start} (gap in the data buffer)")
        covered_until, previous = info.end, info.name
    if covered_until != data_start + data_size:
        raise CheckpointError(
            f"{path}: tensors cover {covered_until - data_start} bytes of a {data_size}-byte data buffer")


# --------------------------------------------------------------------------------------------
# Reading a checkpoint folder
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# Writing a checkpoint folder
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _PendingTensor:
    """A tensor accepted for the current shard: its code, shape, and bytes-like payload."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    # raw bytes, a flat uint8 view of a little-endian C-contiguous array, or a tensor of another
    # safetensors file copied by byte range
    payload: bytes | np.ndarray | TensorInfo
    nbytes: int


def write_checkpoint(
    out_dir: str | os.PathLike,
    tensors: Iterable[tuple[str, np.ndarray | RawTensor]],
    config: dict | None,
    *,
    max_shard_bytes: int = 5 * 2**30,
    metadata: dict[str, str] | None = None,
    overwrite: bool = False,
    extra_files: dict[str, bytes] | None = None,
    protect: str | os.PathLike | None = None,
) -> Path:
    """Write a Hugging Face checkpoint folder, streaming tensors into shards, and return its path.

    Only the current shard is held in memory (at most max_shard_bytes of tensor data, or one
    larger tensor). Everything is written to a hidden sibling folder first and renamed into place
    at the end, so out_dir is either the complete new checkpoint or untouched: a failure midway
    (including one raised by the `tensors` iterator) removes the temporary folder. `protect` is the
    source checkpoint, which must never be overwritten or end up inside the output. `metadata` is
    added to the header's __metadata__, which always carries {"format": "pt"} unless overridden,
    because transformers refuses files without it.
    """
    out_dir = Path(out_dir)
    check_destination(out_dir, overwrite, protect)
    _check_extra_file_names(extra_files or {}, config is not None)
    if max_shard_bytes <= 0:
        raise CheckpointError(f"{out_dir}: max_shard_bytes must be positive, got {max_shard_bytes}")
    header_metadata = _check_metadata({**DEFAULT_METADATA, **(metadata or {})}, out_dir)
    with staged_directory(out_dir, overwrite) as staging:
        _write_shards(staging, tensors, max_shard_bytes, header_metadata)
        if config is not None:
            (staging / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        for relative_name, content in (extra_files or {}).items():
            target = staging / relative_name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(content)
    return out_dir


STAGING_MARKER = ".moejax-staging"  # inside every staging folder: who made it, so a later run may remove it


@contextlib.contextmanager
def staged_directory(out_dir: Path, overwrite: bool) -> Iterator[Path]:
    """A hidden sibling folder to write into; renamed to out_dir when the block completes, removed
    when it raises, is interrupted (Ctrl-C) or terminated (SIGTERM: `moejax.signals.KillSwitch`
    turns both into `Killed`), so out_dir is either complete or untouched. A SIGKILL cannot be caught: the folder's marker file lets the next run for the same
    out_dir (or `moejax clean`) remove it once its process is gone."""
    out_dir = Path(out_dir)
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise CheckpointError(f"{out_dir.parent}: cannot create the output's parent folder: {error}") from error
    remove_stale_staging(out_dir.parent, out_dir.name)
    staging = out_dir.parent / f".{out_dir.name}.tmp-{secrets.token_hex(6)}"
    with KillSwitch() as switch:
        try:
            staging.mkdir()
            (staging / STAGING_MARKER).write_text(json.dumps(
                {"pid": os.getpid(), "host": socket.gethostname(), "destination": out_dir.name}) + "\n")
            yield staging
            switch.check()
            (staging / STAGING_MARKER).unlink()
            _move_into_place(staging, out_dir, overwrite)
        except BaseException:
            switch.stopped = True  # a second signal must not interrupt the clean-up
            shutil.rmtree(staging, ignore_errors=True)
            raise


def remove_stale_staging(folder: Path, destination: str | None = None) -> list[Path]:
    """Remove the staging folders in `folder` (those for `destination` only, when given) that
    moejax made (marker file inside) and whose process is gone (same host, pid not running).
    Nothing else is touched: no marker, another host, or a live process means leave it. Returns
    the folders removed."""
    removed = []
    pattern = f".{destination}.tmp-*" if destination else ".*.tmp-*"
    for candidate in sorted(Path(folder).glob(pattern)):
        marker = candidate / STAGING_MARKER
        if candidate.is_symlink() or not candidate.is_dir() or not marker.is_file():
            continue
        try:
            owner = json.loads(marker.read_text(encoding="utf-8"))
            pid, host = int(owner["pid"]), owner["host"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if host != socket.gethostname() or _process_alive(pid):
            continue
        shutil.rmtree(candidate, ignore_errors=True)
        removed.append(candidate)
    return removed


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def check_destination(out_dir: Path, overwrite: bool, protect: str | os.PathLike | None) -> None:
    """Refuse before any work: an existing folder without overwrite, a symbolic link (replacing it
    would delete or write through a folder elsewhere), or a path that would write into the source
    checkpoint or (by replacing a parent folder) delete it."""
    out_dir = Path(out_dir)
    if protect is not None:
        protected, target = Path(protect).resolve(), out_dir.resolve()
        if target.is_relative_to(protected) or protected.is_relative_to(target):
            raise CheckpointError(f"{out_dir}: refusing to write into, or replace a folder holding, "
                                  f"the source checkpoint {protect}")
    if out_dir.is_symlink():
        raise CheckpointError(f"{out_dir}: is a symbolic link (to {os.readlink(out_dir)}); refusing to replace "
                              "it or write through it: remove the link or choose another destination")
    if out_dir.exists() and not overwrite:
        raise CheckpointError(f"{out_dir}: already exists; pass --overwrite (overwrite=True) to replace it")
    if out_dir.exists() and not out_dir.is_dir():
        raise CheckpointError(f"{out_dir}: exists and is not a directory")
    parent = next((p for p in out_dir.absolute().parents if p.exists()), None)
    if parent is not None and (not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK)):
        raise CheckpointError(f"{out_dir}: cannot be created: {parent} is not a writable folder")


def _check_extra_file_names(extra_files: dict[str, bytes], writes_config: bool) -> None:
    """Extra files must stay inside the folder and not collide with what the writer produces."""
    for relative_name in extra_files:
        path = Path(relative_name)
        if path.is_absolute() or ".." in path.parts or not path.parts:
            raise CheckpointError(
                f"extra file {relative_name!r}: must be a relative path inside the checkpoint")
        if (relative_name.endswith(".safetensors") or relative_name == INDEX_NAME
                or (writes_config and relative_name == CONFIG_NAME)):
            raise CheckpointError(f"extra file {relative_name!r}: collides with a file the writer produces")


def _check_metadata(metadata: dict, out_dir: Path) -> dict[str, str]:
    if not all(isinstance(key, str) and isinstance(value, str) for key, value in metadata.items()):
        raise CheckpointError(
            f"{out_dir}: safetensors __metadata__ must map strings to strings, got {metadata!r}")
    return dict(metadata)


def _write_shards(staging: Path, tensors: Iterable, max_shard_bytes: int, metadata: dict[str, str]) -> None:
    """Stream tensors into numbered temporary shards, then give them their final names (the shard
    count is part of the names and only known at the end) and write the index if there are several."""
    temporary_shards: list[tuple[Path, list[str]]] = []
    total_size = 0
    for shard_tensors in _group_into_shards(_pending_tensors(tensors), max_shard_bytes):
        path = staging / f".shard-{len(temporary_shards) + 1:05d}.partial"
        _write_safetensors(path, shard_tensors, metadata)
        temporary_shards.append((path, [tensor.name for tensor in shard_tensors]))
        total_size += sum(tensor.nbytes for tensor in shard_tensors)
    if not temporary_shards:  # an empty checkpoint is still a readable one
        path = staging / ".shard-00001.partial"
        _write_safetensors(path, [], metadata)
        temporary_shards.append((path, []))
    weight_map = {}
    for number, (path, names) in enumerate(temporary_shards, start=1):
        final_name = _shard_name(number, len(temporary_shards))
        path.rename(staging / final_name)
        weight_map.update(dict.fromkeys(names, final_name))
    if len(temporary_shards) > 1:
        index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
        index_text = json.dumps(index, indent=2, sort_keys=True) + "\n"
        (staging / INDEX_NAME).write_text(index_text, encoding="utf-8")


def _shard_name(number: int, count: int) -> str:
    return SINGLE_SHARD_NAME if count == 1 else f"model-{number:05d}-of-{count:05d}.safetensors"


def _pending_tensors(tensors: Iterable) -> Iterator[_PendingTensor]:
    """Validate each (name, value) as it arrives; duplicates fail before that tensor is written."""
    seen: set[str] = set()
    for name, value in tensors:
        if not isinstance(name, str) or not name or name == "__metadata__":
            raise CheckpointError(f"tensor name {name!r}: must be a non-empty string other than __metadata__")
        if name in seen:
            raise CheckpointError(f"tensor {name!r}: given twice; tensor names must be unique")
        seen.add(name)
        yield _as_pending(name, value)


def _as_pending(name: str, value: np.ndarray | RawTensor | TensorInfo) -> _PendingTensor:
    where = f"tensor {name!r}"
    if isinstance(value, TensorInfo):
        return _PendingTensor(name, value.dtype, value.shape, value, value.nbytes)
    if isinstance(value, RawTensor):
        shape = tuple(value.shape)
        if not all(_is_natural(dim) for dim in shape):
            raise CheckpointError(f"{where}: shape must be non-negative integers, got {value.shape!r}")
        expected = tensor_nbytes(value.dtype, shape, where)
        if len(value.data) != expected:
            raise CheckpointError(
                f"{where}: RawTensor has {len(value.data)} bytes, "
                f"expected {expected} for {value.dtype} {list(shape)}")
        return _PendingTensor(name, value.dtype, shape, bytes(value.data), expected)
    if not isinstance(value, np.ndarray):
        raise CheckpointError(f"{where}: expected a numpy array or RawTensor, got {type(value).__name__}")
    dtype = safetensors_dtype(value.dtype, where)
    # Not np.ascontiguousarray, which turns a 0-d array into shape (1,).
    array = np.asarray(value, dtype=value.dtype.newbyteorder("<"), order="C")
    # A uint8 view, because ml_dtypes arrays (bfloat16, float8) do not export the buffer protocol.
    return _PendingTensor(name, dtype, array.shape, array.reshape(-1).view(np.uint8), array.nbytes)


def _group_into_shards(
        pending: Iterator[_PendingTensor], max_shard_bytes: int) -> Iterator[list[_PendingTensor]]:
    """Close a shard when the next tensor would push it past the limit; a tensor larger than the
    limit on its own gets a shard of its own."""
    shard: list[_PendingTensor] = []
    shard_bytes = 0
    for tensor in pending:
        if shard and shard_bytes + tensor.nbytes > max_shard_bytes:
            yield shard
            shard, shard_bytes = [], 0
        shard.append(tensor)
        shard_bytes += tensor.nbytes
    if shard:
        yield shard


def _write_safetensors(path: Path, tensors: list[_PendingTensor], metadata: dict[str, str]) -> None:
    """One safetensors file. Tensors are ordered by decreasing element size (then name), like the
    official writer, so with an 8-aligned data start every tensor is aligned to its element size
    and can be viewed in place by memory-mapping readers."""
    ordered = sorted(tensors, key=lambda tensor: (-_element_bytes(tensor.dtype), tensor.name))
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for tensor in ordered:
        header[tensor.name] = {"dtype": tensor.dtype, "shape": list(tensor.shape),
                               "data_offsets": [offset, offset + tensor.nbytes]}
        offset += tensor.nbytes
    header_bytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    header_bytes += b" " * (-len(header_bytes) % _DATA_ALIGNMENT)
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(header_bytes)))
        handle.write(header_bytes)
        for tensor in ordered:
            if isinstance(tensor.payload, TensorInfo):
                handle.flush()
                _copy_file_range(tensor.payload, handle.fileno())
                handle.seek(0, os.SEEK_END)
            else:
                handle.write(tensor.payload)


def write_safetensors_file(path: str | os.PathLike,
                           tensors: Iterable[tuple[str, np.ndarray | RawTensor | TensorInfo]],
                           metadata: dict[str, str] | None = None) -> int:
    """Write one safetensors file and return its tensor data bytes. A `TensorInfo` value (a tensor
    of another file, from `SafetensorsFile.info`) is copied by byte range, in the kernel where the
    platform allows, so carrying a tensor over costs no memory; this is how checkpoint surgery
    streams a shard through with every untouched tensor byte-identical."""
    path = Path(path)
    pending = list(_pending_tensors(tensors))
    _write_safetensors(path, pending, _check_metadata({**DEFAULT_METADATA, **(metadata or {})}, path))
    return sum(tensor.nbytes for tensor in pending)


_COPY_CHUNK = 64 * 2**20


def _copy_file_range(info: TensorInfo, out_fd: int) -> None:
    """Append the bytes of `info` to out_fd: os.copy_file_range (no user-space buffer) as far as
    the kernel allows for these files, then 64 MB chunks through memory for the rest."""
    with open(info.file, "rb", buffering=0) as source:
        copied = _copy_in_kernel(source.fileno(), out_fd, info)
        source.seek(info.begin + copied)
        while copied < info.nbytes:
            chunk = source.read(min(_COPY_CHUNK, info.nbytes - copied))
            if not chunk:
                break
            view = memoryview(chunk)
            while view:
                view = view[os.write(out_fd, view):]
            copied += len(chunk)
    _check_complete_read(info, copied)


def _copy_in_kernel(in_fd: int, out_fd: int, info: TensorInfo) -> int:
    """Bytes of `info` copied with os.copy_file_range before it stops or is refused (e.g. EXDEV
    across file systems on old kernels, or a platform without it): the caller copies the rest."""
    copied = 0
    if not hasattr(os, "copy_file_range"):
        return copied
    try:
        while copied < info.nbytes:
            count = os.copy_file_range(in_fd, out_fd, min(info.nbytes - copied, 2**30), info.begin + copied)
            if count == 0:
                break
            copied += count
    except OSError:
        return copied
    return copied


def _element_bytes(dtype: str) -> int:
    return max(1, DTYPE_BITS[dtype] // 8)


def _move_into_place(staging: Path, out_dir: Path, overwrite: bool) -> None:
    """Rename the finished folder to out_dir; an old out_dir (overwrite) is moved aside first and
    deleted only once the new one is in place, and restored if the rename fails."""
    if not out_dir.exists():
        staging.rename(out_dir)
        return
    if not overwrite:  # appeared while we were writing
        raise CheckpointError(f"{out_dir}: already exists; pass --overwrite (overwrite=True) to replace it")
    if (out_dir / STAGING_MARKER).is_file():  # out_dir is an outer write's staging folder: keep it marked
        shutil.copyfile(out_dir / STAGING_MARKER, staging / STAGING_MARKER)
    retired = out_dir.parent / f".{out_dir.name}.old-{secrets.token_hex(6)}"
    out_dir.rename(retired)
    try:
        staging.rename(out_dir)
    except BaseException:
        retired.rename(out_dir)
        raise
    shutil.rmtree(retired)

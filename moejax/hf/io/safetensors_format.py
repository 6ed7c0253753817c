"""The safetensors file format: one file's header parsed and validated, its tensors read one at a
time, and its header encoded for writing.

The headers are parsed here rather than by the `safetensors` package so that every defect can be
reported as a `CheckpointError` naming the file and the tensor, so that raw bytes of dtypes numpy
lacks (FP8, FP4) can be carried through untouched, and so that no call ever maps or reads a whole
file: a DeepSeek-V3 checkpoint is ~700 GB and is only ever visited tensor by tensor.

Format (spec section 5.1): u64 little-endian header length N, N bytes of UTF-8 JSON, then the data
buffer. Offsets in the header are relative to the buffer; the tensors must tile it exactly.

Also here: the dtype codes (bits per element, numpy equivalents), `TensorInfo` (where a tensor
lives), `RawTensor` (a tensor as bytes), and the file names of a Hugging Face checkpoint folder.
A folder is read by `moejax.hf.io.checkpoint_reader` and written by `moejax.hf.io.checkpoint_writer`.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from moejax.errors import CheckpointError
from moejax.hf.io.storage import LOCAL_FILES, Storage

# The files of a Hugging Face checkpoint folder.
INDEX_NAME = "model.safetensors.index.json"
SINGLE_SHARD_NAME = "model.safetensors"
CONFIG_NAME = "config.json"

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
    with a message naming the file and the offending tensor. `storage` says where the bytes come
    from (default: the local file `path`; a remote storage reads by range requests, the same
    parsing and checks applying); `prefix` = (file size, first bytes) already fetched for it.
    """

    def __init__(self, path, storage: Storage | None = None, *, prefix: tuple[int, bytes] | None = None):
        self.storage = storage or LOCAL_FILES
        self.path = Path(path) if storage is None else path
        header, data_start, data_size = _read_header(self.path, self.storage, prefix)
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
        """Exactly this tensor's bytes (one read, or one range request; never the whole file)."""
        info = self.info(name)
        data = self.storage.read_range(info.file, info.begin, info.nbytes)
        check_complete_read(info, len(data))
        return data

    def read(self, name: str) -> np.ndarray:
        """The tensor as a writable numpy array of its dtype and shape."""
        info = self.info(name)
        dtype = numpy_dtype(info.dtype, f"{info.file}: tensor {name!r}")
        buffer = bytearray(info.nbytes)
        check_complete_read(info, self.storage.read_into(info.file, info.begin, buffer))
        return np.frombuffer(buffer, dtype=dtype).reshape(info.shape)


    def read_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of the tensor's first axis (one read of just those bytes): an
        embedding table or output head a vocabulary chunk at a time."""
        info = self.info(name)
        dtype = numpy_dtype(info.dtype, f"{info.file}: tensor {name!r}")
        if not info.shape or not 0 <= start <= stop <= info.shape[0]:
            raise CheckpointError(f"{info.file}: tensor {name!r} of shape {list(info.shape)}: "
                                  f"rows [{start}, {stop}) out of range")
        row_bytes = info.nbytes // info.shape[0] if info.shape[0] else 0
        buffer = bytearray(row_bytes * (stop - start))
        count = self.storage.read_into(info.file, info.begin + start * row_bytes, buffer)
        if count != len(buffer):
            raise CheckpointError(f"{info.file}: tensor {name!r} rows [{start}, {stop}): expected {len(buffer)} "
                                  f"bytes, read {count} (file changed since it was opened?)")
        return np.frombuffer(buffer, dtype=dtype).reshape((stop - start,) + tuple(info.shape[1:]))


def check_complete_read(info: TensorInfo, count: int) -> None:
    """A short read means the file shrank after its header was validated."""
    if count != info.nbytes:
        raise CheckpointError(
            f"{info.file}: tensor {info.name!r} expected {info.nbytes} bytes at offset {info.begin}, "
            f"read {count} (file changed since it was opened?)")


def _read_header(path, storage: Storage, prefix: tuple[int, bytes] | None) -> tuple[dict, int, int]:
    """The header JSON as a dict, the absolute offset of the data buffer, and the buffer's size.
    The storage's first read takes `storage.header_prefetch` bytes (8 locally: the length field;
    remote: enough for most headers in one request); a second read fetches the rest of a longer
    header."""
    try:
        file_size, first = prefix if prefix is not None else storage.read_prefix(path, storage.header_prefetch)
        if len(first) < _HEADER_LENGTH_BYTES:
            raise CheckpointError(f"{path}: {file_size} bytes, shorter than the 8-byte header length field")
        (header_length,) = struct.unpack("<Q", first[:_HEADER_LENGTH_BYTES])
        if header_length > min(_MAX_HEADER_BYTES, file_size - _HEADER_LENGTH_BYTES):
            raise CheckpointError(
                f"{path}: header length field says {header_length} bytes, but the file has "
                f"{file_size - _HEADER_LENGTH_BYTES} after it (limit {_MAX_HEADER_BYTES}); "
                "truncated or not a safetensors file")
        data_start = _HEADER_LENGTH_BYTES + header_length
        header_bytes = first[_HEADER_LENGTH_BYTES:data_start]
        if len(first) < data_start:
            header_bytes += storage.read_range(path, len(first), data_start - len(first))
    except OSError as error:
        raise CheckpointError(f"{path}: cannot read safetensors file: {error}") from error
    header = _parse_header_json(header_bytes, path)
    return header, data_start, file_size - data_start


def _parse_header_json(header_bytes: bytes, path: Path) -> dict:
    """Decode the JSON header, refusing duplicate keys (the format forbids them)."""
    try:
        header = json.loads(header_bytes.decode("utf-8"), object_pairs_hook=refuse_duplicate_keys)
    except (UnicodeDecodeError, json.JSONDecodeError, _DuplicateKey) as error:
        raise CheckpointError(f"{path}: header is not valid UTF-8 JSON: {error}") from error
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header must be a JSON object, got {type(header).__name__}")
    return header


class _DuplicateKey(ValueError):
    """Raised inside json.loads when a header names a tensor twice (json would keep the last)."""


def refuse_duplicate_keys(pairs: list[tuple[str, object]]) -> dict:
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
    if not isinstance(shape, list) or not all(is_natural(dim) for dim in shape):
        raise CheckpointError(f"{where}: shape must be a list of non-negative integers, got {shape!r}")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(is_natural(o) for o in offsets):
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


def is_natural(value: object) -> bool:
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
# Writing one file's header
# --------------------------------------------------------------------------------------------


def encode_header(header: dict) -> bytes:
    """The bytes that open a safetensors file: the u64 length field and the compact JSON header,
    padded with spaces, as the official writer pads it, so that the data buffer starts 8-aligned."""
    header_bytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    header_bytes += b" " * (-len(header_bytes) % _DATA_ALIGNMENT)
    return struct.pack("<Q", len(header_bytes)) + header_bytes

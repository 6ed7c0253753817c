"""Writing Hugging Face checkpoints: `write_checkpoint` streams tensors into a sharded folder
(index and config.json included) published atomically through `moejax.hf.io.staging`, and
`write_safetensors_file` writes one safetensors file, copying tensors of other files by byte range.

Only the current shard is ever in memory, so a ~700 GB checkpoint is written tensor by tensor.
Files are laid out as the official writer lays them out (tensors by decreasing element size, an
8-aligned data buffer), so memory-mapping readers can view every tensor in place.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moejax.errors import CheckpointError
from moejax.hf.io.safetensors_format import (CONFIG_NAME, DTYPE_BITS, INDEX_NAME, SINGLE_SHARD_NAME, RawTensor,
                                          TensorInfo, check_complete_read, encode_header, is_natural,
                                          safetensors_dtype, tensor_nbytes)
from moejax.hf.io.staging import check_destination, staged_directory

DEFAULT_METADATA = {"format": "pt"}  # transformers refuses to load a file without it


@dataclass(frozen=True)
class JoinedTensor:
    """A tensor written as its pieces one after another (C order): each a tensor of another
    safetensors file copied by byte range, or an array of the same dtype. How `moejax prune` and
    `merge` rebuild a fused [E, ...] expert tensor from the kept experts' slabs without holding it."""

    dtype: str
    shape: tuple[int, ...]
    pieces: tuple[TensorInfo | np.ndarray, ...]


@dataclass(frozen=True)
class _PendingTensor:
    """A tensor accepted for the current shard: its code, shape, and bytes-like payload."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    # raw bytes, a flat uint8 view of a little-endian C-contiguous array, or a tensor of another
    # safetensors file copied by byte range; or a tuple of those last two written in turn
    payload: bytes | np.ndarray | TensorInfo | tuple
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
    check_destination(out_dir, overwrite, inputs=protect)
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


def _as_pending(name: str, value: np.ndarray | RawTensor | TensorInfo | JoinedTensor) -> _PendingTensor:
    where = f"tensor {name!r}"
    if isinstance(value, TensorInfo):
        return _PendingTensor(name, value.dtype, value.shape, value, value.nbytes)
    if isinstance(value, JoinedTensor):
        pieces = [piece if isinstance(piece, TensorInfo) else _as_pending(name, piece) for piece in value.pieces]
        wrong = sorted({piece.dtype for piece in pieces} - {value.dtype})
        if wrong:
            raise CheckpointError(f"{where}: {value.dtype} tensor joined from pieces of dtype {wrong}")
        expected, nbytes = tensor_nbytes(value.dtype, tuple(value.shape), where), sum(p.nbytes for p in pieces)
        if nbytes != expected:
            raise CheckpointError(f"{where}: pieces hold {nbytes} bytes, expected {expected} for "
                                  f"{value.dtype} {list(value.shape)}")
        payload = tuple(piece if isinstance(piece, TensorInfo) else piece.payload for piece in pieces)
        return _PendingTensor(name, value.dtype, tuple(value.shape), payload, expected)
    if isinstance(value, RawTensor):
        shape = tuple(value.shape)
        if not all(is_natural(dim) for dim in shape):
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
    if dtype.startswith(("F", "BF")) and value.size and not (finite := np.isfinite(value)).all():
        raise CheckpointError(f"{where}: {int(finite.size - finite.sum())} of {value.size} values are not finite "
                              "(NaN or inf); moejax never writes non-finite weights (nothing was written)")
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
    with open(path, "wb") as handle:
        handle.write(encode_header(header))
        for tensor in ordered:
            for payload in (tensor.payload if isinstance(tensor.payload, tuple) else (tensor.payload,)):
                if isinstance(payload, TensorInfo):
                    handle.flush()
                    _copy_file_range(payload, handle.fileno())
                    handle.seek(0, os.SEEK_END)
                else:
                    handle.write(payload)


def write_safetensors_file(path: str | os.PathLike,
                           tensors: Iterable[tuple[str, np.ndarray | RawTensor | TensorInfo | JoinedTensor]],
                           metadata: dict[str, str] | None = None) -> int:
    """Write one safetensors file and return its tensor data bytes. A `TensorInfo` value (a tensor
    of another file, from `SafetensorsFile.info`) is copied by byte range, in the kernel where the
    platform allows, so carrying a tensor over costs no memory; this is how checkpoint surgery
    streams a shard through with every untouched tensor byte-identical. A `JoinedTensor` is
    written piece by piece the same way."""
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
    check_complete_read(info, copied)


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

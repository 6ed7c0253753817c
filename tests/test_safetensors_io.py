"""moejax.hf's safetensors reading and writing (safetensors_format, checkpoint_reader,
checkpoint_writer) against the official `safetensors` package, which serves as an independent
reader and writer; plus every error path and the writer's atomicity."""

import json
import struct

import ml_dtypes
import numpy as np
import pytest
import safetensors
from safetensors.numpy import load_file, save_file

from moejax.errors import CheckpointError
from moejax.hf.io.checkpoint_reader import CheckpointReader
from moejax.hf.io.checkpoint_writer import write_checkpoint
from moejax.hf.io.safetensors_format import INDEX_NAME, RawTensor, SafetensorsFile

def sample_tensors() -> dict[str, np.ndarray]:
    """One tensor per dtype the checkpoints use, plus a scalar and an empty tensor; the same on
    every call."""
    rng = np.random.default_rng(0)
    floats = rng.standard_normal((3, 5)).astype(np.float32)
    return {
        "f32": floats,
        "f16": floats.astype(np.float16),
        "bf16": floats.astype(ml_dtypes.bfloat16),
        "f8": floats.astype(ml_dtypes.float8_e4m3fn),
        "i32": rng.integers(-1000, 1000, (4, 2), dtype=np.int32),
        "u8": rng.integers(0, 256, (7,), dtype=np.uint8),
        "scalar": np.array(2.5, dtype=np.float32),
        "empty": np.zeros((0, 4), dtype=np.float32),
    }


def official_raw_bytes(path) -> dict[str, tuple[str, list[int], bytes]]:
    """Every tensor's (dtype, shape, bytes) as the official deserializer finds them."""
    return {name: (spec["dtype"], spec["shape"], bytes(spec["data"]))
            for name, spec in safetensors.deserialize(path.read_bytes())}


def write_raw_file(path, header: dict, data: bytes) -> None:
    """A safetensors file with a hand-made header, for the error cases."""
    header_bytes = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(header_bytes)) + header_bytes + data)


def assert_same_tensor(actual: np.ndarray, expected: np.ndarray) -> None:
    assert actual.dtype == expected.dtype
    assert actual.shape == expected.shape
    assert actual.tobytes() == expected.tobytes()


# ---------------------------------------------------------------- reading official files


def test_reads_files_written_by_the_official_writer(tmp_path):
    tensors = sample_tensors()
    path = tmp_path / "official.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt", "note": "x"})

    file = SafetensorsFile(path)
    official = official_raw_bytes(path)
    assert file.keys() == sorted(tensors)
    assert file.metadata == {"format": "pt", "note": "x"}
    for name, expected in tensors.items():
        assert_same_tensor(file.read(name), expected)
        dtype, shape, raw = official[name]
        assert (file.info(name).dtype, list(file.info(name).shape)) == (dtype, shape)
        assert file.read_bytes(name) == raw
    assert file.read("bf16").flags.writeable


def test_values_match_official_numpy_reader(tmp_path):
    """The official numpy reader cannot load F8 (safetensors#682), so F8 is left to the test above."""
    tensors = {name: value for name, value in sample_tensors().items() if name != "f8"}
    path = tmp_path / "official.safetensors"
    save_file(tensors, str(path))
    file = SafetensorsFile(path)
    with safetensors.safe_open(str(path), framework="numpy") as official:
        assert official.metadata() is None and file.metadata == {}
        for name in official.keys():
            assert file.read_bytes(name) == official.get_tensor(name).tobytes()
            assert_same_tensor(file.read(name), official.get_tensor(name))


def test_info_offsets_are_absolute(tmp_path):
    path = tmp_path / "one.safetensors"
    save_file({"a": np.arange(3, dtype=np.int32)}, str(path))
    info = SafetensorsFile(path).info("a")
    content = path.read_bytes()
    assert content[info.begin:info.end] == np.arange(3, dtype=np.int32).tobytes()
    assert info.end == len(content) and info.nbytes == 12 and info.file == path


# ---------------------------------------------------------------- writing, read by the official reader


def test_written_checkpoint_is_read_by_the_official_reader(tmp_path):
    tensors = {name: value for name, value in sample_tensors().items() if name != "f8"}
    out = write_checkpoint(tmp_path / "out", tensors.items(), {"model_type": "deepseek_v3"})
    shard = out / "model.safetensors"

    loaded = load_file(str(shard))
    assert sorted(loaded) == sorted(tensors)
    for name, expected in tensors.items():
        assert_same_tensor(loaded[name], expected)
    with safetensors.safe_open(str(shard), framework="numpy") as official:
        assert official.metadata() == {"format": "pt"}
    header_length = struct.unpack("<Q", shard.read_bytes()[:8])[0]
    assert (8 + header_length) % 8 == 0
    assert json.loads((out / "config.json").read_text()) == {"model_type": "deepseek_v3"}
    assert not (out / INDEX_NAME).exists()


def test_every_written_tensor_is_aligned_to_its_element_size(tmp_path):
    tensors = [("u8", np.ones(3, np.uint8)), ("f64", np.ones(2, np.float64)), ("f16", np.ones(1, np.float16))]
    out = write_checkpoint(tmp_path / "out", tensors, None)
    file = SafetensorsFile(out / "model.safetensors")
    for name in file.keys():
        assert file.info(name).begin % file.read(name).itemsize == 0
    assert not (out / "config.json").exists()


def test_f8_written_is_read_back_by_the_official_deserializer(tmp_path):
    f8 = sample_tensors()["f8"]
    out = write_checkpoint(tmp_path / "out", [("w", f8)], None, metadata={"source": "test"})
    assert official_raw_bytes(out / "model.safetensors") == {"w": ("F8_E4M3", [3, 5], f8.tobytes())}
    assert SafetensorsFile(out / "model.safetensors").metadata == {"format": "pt", "source": "test"}


def test_big_endian_and_strided_arrays_are_written_little_endian_row_major(tmp_path):
    big_endian = np.arange(4, dtype=">f4")
    transposed = np.arange(6, dtype=np.int32).reshape(2, 3).T
    out = write_checkpoint(tmp_path / "out", [("x", big_endian), ("t", transposed)], None)
    loaded = load_file(str(out / "model.safetensors"))
    assert_same_tensor(loaded["x"], big_endian.astype("<f4"))
    assert_same_tensor(loaded["t"], np.ascontiguousarray(transposed))


def test_empty_checkpoint_is_one_readable_shard(tmp_path):
    out = write_checkpoint(tmp_path / "out", [], None)
    assert load_file(str(out / "model.safetensors")) == {}
    assert CheckpointReader(out).keys() == [] and not (out / INDEX_NAME).exists()


# ---------------------------------------------------------------- sharding


def test_small_shard_limit_gives_several_shards_and_a_correct_index(tmp_path):
    # 40 + 40 bytes fit a 100-byte shard, the third 40 does not; 400 bytes exceed it alone.
    tensors = [(f"t{i}", np.full(10, i, np.float32)) for i in range(3)]
    tensors += [("big", np.ones(100, np.float32)), ("last", np.ones(2, np.int32))]
    out = write_checkpoint(tmp_path / "out", tensors, {"a": 1}, max_shard_bytes=100)

    shards = ["model-00001-of-00004.safetensors", "model-00002-of-00004.safetensors",
              "model-00003-of-00004.safetensors", "model-00004-of-00004.safetensors"]
    assert sorted(p.name for p in out.glob("*.safetensors")) == shards
    index = json.loads((out / INDEX_NAME).read_text())
    assert index["metadata"]["total_size"] == 3 * 40 + 400 + 8
    assert index["weight_map"] == {"t0": shards[0], "t1": shards[0], "t2": shards[1],
                                   "big": shards[2], "last": shards[3]}

    reader = CheckpointReader(out)
    assert reader.keys() == sorted(name for name, _ in tensors)
    assert "big" in reader and "nope" not in reader
    assert [p.name for p in reader.files()] == shards
    assert reader.total_bytes() == index["metadata"]["total_size"]
    assert reader.shard_of("big").name == shards[2]
    reader.validate()
    for name, value in tensors:
        assert reader.read_bytes(name) == value.tobytes()
        assert_same_tensor(reader.read(name), value)
        assert_same_tensor(load_file(str(reader.shard_of(name)))[name], value)
    assert reader.config() == {"a": 1}


def test_reader_without_index_uses_all_safetensors_files(tmp_path):
    save_file({"a": np.ones(2, np.float32)}, str(tmp_path / "part1.safetensors"))
    save_file({"b": np.zeros(3, np.int32)}, str(tmp_path / "part2.safetensors"))
    reader = CheckpointReader(tmp_path)
    assert reader.keys() == ["a", "b"]
    assert reader.shard_of("b").name == "part2.safetensors"
    assert_same_tensor(reader.read("b"), np.zeros(3, np.int32))


def test_reader_without_index_refuses_a_tensor_in_two_files(tmp_path):
    save_file({"a": np.ones(2, np.float32)}, str(tmp_path / "part1.safetensors"))
    save_file({"a": np.ones(2, np.float32)}, str(tmp_path / "part2.safetensors"))
    with pytest.raises(CheckpointError, match=r"'a'.*part1.safetensors.*part2.safetensors"):
        CheckpointReader(tmp_path)


# ---------------------------------------------------------------- raw tensors


def test_raw_tensors_round_trip_byte_for_byte(tmp_path):
    source = write_checkpoint(tmp_path / "source", sample_tensors().items(), None, max_shard_bytes=64)
    reader = CheckpointReader(source)
    copied = ((name, RawTensor(reader.info(name).dtype, reader.info(name).shape, reader.read_bytes(name)))
              for name in reader.keys())
    copy = CheckpointReader(write_checkpoint(tmp_path / "copy", copied, None, protect=source))
    assert copy.keys() == reader.keys()
    for name in reader.keys():
        assert copy.info(name).dtype == reader.info(name).dtype
        assert copy.read_bytes(name) == reader.read_bytes(name)
    assert_same_tensor(copy.read("f8"), sample_tensors()["f8"])


def test_raw_f4_is_carried_but_not_read_as_an_array(tmp_path):
    out = write_checkpoint(tmp_path / "out", [("packed", RawTensor("F4", (2, 3), b"\x12\x34\x56"))], None)
    file = SafetensorsFile(out / "model.safetensors")
    assert file.read_bytes("packed") == b"\x12\x34\x56"
    with pytest.raises(CheckpointError, match="'packed'.*F4"):
        file.read("packed")


def test_raw_tensor_with_wrong_byte_count_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match=r"'w'.*3 bytes, expected 4"):
        write_checkpoint(tmp_path / "out", [("w", RawTensor("BF16", (2,), b"abc"))], None)
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- errors name the file and tensor


def test_file_shorter_than_the_length_field(tmp_path):
    path = tmp_path / "short.safetensors"
    path.write_bytes(b"\x01\x02\x03")
    with pytest.raises(CheckpointError, match=r"short\.safetensors.*shorter than the 8-byte"):
        SafetensorsFile(path)


def test_header_length_beyond_the_file(tmp_path):
    path = tmp_path / "long.safetensors"
    path.write_bytes(struct.pack("<Q", 1000) + b"{}")
    with pytest.raises(CheckpointError, match=r"long\.safetensors.*1000"):
        SafetensorsFile(path)


def test_corrupt_header_json(tmp_path):
    path = tmp_path / "corrupt.safetensors"
    path.write_bytes(struct.pack("<Q", 6) + b'{"a": ')
    with pytest.raises(CheckpointError, match=r"corrupt\.safetensors.*JSON"):
        SafetensorsFile(path)


def test_duplicate_header_keys(tmp_path):
    path = tmp_path / "dup.safetensors"
    entry = '{"dtype":"U8","shape":[1],"data_offsets":[0,1]}'
    header = f'{{"a":{entry},"a":{entry}}}'.encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\x00")
    with pytest.raises(CheckpointError, match=r"dup\.safetensors.*duplicate key 'a'"):
        SafetensorsFile(path)


def test_byte_count_disagreeing_with_shape(tmp_path):
    path = tmp_path / "count.safetensors"
    write_raw_file(path, {"w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 20]}}, bytes(20))
    with pytest.raises(CheckpointError, match=r"count\.safetensors.*'w'.*20 bytes, expected 24"):
        SafetensorsFile(path)


def test_unknown_dtype(tmp_path):
    path = tmp_path / "dtype.safetensors"
    write_raw_file(path, {"w": {"dtype": "F12", "shape": [1], "data_offsets": [0, 2]}}, bytes(2))
    with pytest.raises(CheckpointError, match=r"dtype\.safetensors.*'w'.*unknown dtype 'F12'"):
        SafetensorsFile(path)


@pytest.mark.parametrize("shape", [[2, -1], [2.0], "2", [True]])
def test_bad_shape(tmp_path, shape):
    path = tmp_path / "shape.safetensors"
    write_raw_file(path, {"w": {"dtype": "U8", "shape": shape, "data_offsets": [0, 2]}}, bytes(2))
    with pytest.raises(CheckpointError, match=r"shape\.safetensors.*'w'.*shape"):
        SafetensorsFile(path)


def test_offsets_beyond_the_data_buffer(tmp_path):
    """What a file truncated inside its data looks like."""
    path = tmp_path / "cut.safetensors"
    write_raw_file(path, {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, bytes(10))
    with pytest.raises(CheckpointError, match=r"cut\.safetensors.*'w'.*outside the 10-byte"):
        SafetensorsFile(path)


def test_overlapping_offsets(tmp_path):
    path = tmp_path / "overlap.safetensors"
    header = {"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
              "b": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]}}
    write_raw_file(path, header, bytes(6))
    with pytest.raises(CheckpointError, match=r"overlap\.safetensors.*'b' overlaps tensor 'a'"):
        SafetensorsFile(path)


def test_uncovered_bytes(tmp_path):
    path = tmp_path / "gap.safetensors"
    write_raw_file(path, {"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}}, bytes(5))
    with pytest.raises(CheckpointError, match=r"gap\.safetensors.*cover 2 bytes of a 5-byte"):
        SafetensorsFile(path)


def test_unknown_tensor_name(tmp_path):
    path = tmp_path / "one.safetensors"
    save_file({"a": np.ones(1, np.float32)}, str(path))
    with pytest.raises(CheckpointError, match=r"one\.safetensors.*'nope'"):
        SafetensorsFile(path).read("nope")
    with pytest.raises(CheckpointError, match=r"'nope'"):
        CheckpointReader(write_checkpoint(tmp_path / "out", [("a", np.ones(1))], None)).read("nope")


def sharded_checkpoint(tmp_path):
    tensors = [("a", np.ones(4, np.float32)), ("b", np.zeros(4, np.float32))]
    return write_checkpoint(tmp_path / "ckpt", tensors, None, max_shard_bytes=16)


def test_shard_missing_from_an_index_fails_at_construction(tmp_path):
    out = sharded_checkpoint(tmp_path)
    (out / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json.*'model-00002-of-00002"):
        CheckpointReader(out)


def test_tensor_missing_from_its_shard(tmp_path):
    out = sharded_checkpoint(tmp_path)
    index = json.loads((out / INDEX_NAME).read_text())
    index["weight_map"]["ghost"] = "model-00001-of-00002.safetensors"
    (out / INDEX_NAME).write_text(json.dumps(index))
    reader = CheckpointReader(out)
    assert "ghost" in reader.keys()
    with pytest.raises(CheckpointError, match=r"index\.json.*'ghost'.*model-00001-of-00002"):
        reader.read("ghost")
    with pytest.raises(CheckpointError, match="'ghost'"):
        reader.validate()


def test_corrupt_index(tmp_path):
    out = sharded_checkpoint(tmp_path)
    (out / INDEX_NAME).write_text('{"weight_map": ')
    with pytest.raises(CheckpointError, match=r"index\.json.*JSON"):
        CheckpointReader(out)
    (out / INDEX_NAME).write_text('{"metadata": {}}')
    with pytest.raises(CheckpointError, match=r"index\.json.*weight_map"):
        CheckpointReader(out)


def test_missing_or_invalid_config(tmp_path):
    reader = CheckpointReader(sharded_checkpoint(tmp_path))
    with pytest.raises(CheckpointError, match=r"config\.json.*missing"):
        reader.config()
    (reader.directory / "config.json").write_text("{oops")
    with pytest.raises(CheckpointError, match=r"config\.json.*JSON"):
        reader.config()


def test_folder_without_safetensors_files(tmp_path):
    with pytest.raises(CheckpointError, match="no .*safetensors"):
        CheckpointReader(tmp_path)


def test_duplicate_tensor_names_are_refused_and_nothing_is_left(tmp_path):
    tensors = [("a", np.ones(1)), ("b", np.ones(1)), ("a", np.ones(1))]
    with pytest.raises(CheckpointError, match="'a'.*twice"):
        write_checkpoint(tmp_path / "out", tensors, None, max_shard_bytes=8)
    assert list(tmp_path.iterdir()) == []


def test_unsupported_numpy_dtype_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="'s'.*<U3"):
        write_checkpoint(tmp_path / "out", [("s", np.array(["abc"]))], None)


# ---------------------------------------------------------------- atomicity and protection


def test_failure_inside_the_iterator_leaves_nothing(tmp_path):
    def tensors():
        yield "a", np.ones(100, np.float32)
        yield "b", np.ones(100, np.float32)  # the first shard has been flushed by now
        raise RuntimeError("source broke")

    with pytest.raises(RuntimeError, match="source broke"):
        write_checkpoint(tmp_path / "out", tensors(), {"x": 1}, max_shard_bytes=400)
    assert list(tmp_path.iterdir()) == []


def test_existing_folder_is_refused_without_overwrite_and_left_intact(tmp_path):
    out = write_checkpoint(tmp_path / "out", [("a", np.ones(2, np.float32))], None)
    before = (out / "model.safetensors").read_bytes()
    with pytest.raises(CheckpointError, match=r"out.*already exists"):
        write_checkpoint(out, [("b", np.zeros(2, np.float32))], None)
    assert (out / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_overwrite_replaces_the_folder(tmp_path):
    out = write_checkpoint(tmp_path / "out", [("a", np.ones(2, np.float32))], None,
                           extra_files={"stale.txt": b"old"})
    write_checkpoint(out, [("b", np.zeros(2, np.float32))], None, overwrite=True,
                     extra_files={"pruning.json": b"{}", "tokenizer/vocab.txt": b"hi"})
    assert CheckpointReader(out).keys() == ["b"]
    assert not (out / "stale.txt").exists()
    assert (out / "pruning.json").read_bytes() == b"{}"
    assert (out / "tokenizer" / "vocab.txt").read_bytes() == b"hi"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_failed_overwrite_keeps_the_old_folder(tmp_path):
    out = write_checkpoint(tmp_path / "out", [("a", np.ones(2, np.float32))], None)

    def tensors():
        yield "b", np.zeros(2, np.float32)
        raise RuntimeError("midway")

    with pytest.raises(RuntimeError, match="^midway$"):
        write_checkpoint(out, tensors(), None, overwrite=True)
    assert CheckpointReader(out).keys() == ["a"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.parametrize("relative_target", [".", "pruned", ".."])
def test_protect_refuses_the_source_inside_or_around_it(tmp_path, relative_target):
    source = write_checkpoint(tmp_path / "src", [("a", np.ones(2, np.float32))], None)
    with pytest.raises(CheckpointError, match="(is|is inside|holds) the input"):
        write_checkpoint(source / relative_target, [("b", np.ones(1))], None, overwrite=True, protect=source)
    assert CheckpointReader(source).keys() == ["a"]
    assert sorted(p.name for p in source.iterdir()) == ["model.safetensors"]


@pytest.mark.parametrize(
    "name", ["../escape.txt", "/abs.txt", "model.safetensors", INDEX_NAME, "config.json"])
def test_extra_files_may_not_escape_or_collide(tmp_path, name):
    with pytest.raises(CheckpointError, match="extra file"):
        write_checkpoint(tmp_path / "out", [("a", np.ones(1))], {"c": 1}, extra_files={name: b""})
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("kernel", ["refused", "partial"])
def test_byte_range_copy_falls_back_to_reading(tmp_path, monkeypatch, kernel):
    """Carrying a tensor of another file by byte range gives the same bytes whether the kernel
    copies it, refuses (EXDEV), or stops partway."""
    import errno
    import os

    from moejax.hf.io.checkpoint_writer import write_safetensors_file
    from moejax.hf.io.safetensors_format import SafetensorsFile

    rng = np.random.default_rng(0)
    src = tmp_path / "src.safetensors"
    arrays = {"a": rng.normal(size=(64, 33)).astype(np.float32), "b": rng.integers(0, 9, size=(7,)).astype(np.int64)}
    write_safetensors_file(src, arrays.items())
    real, calls = os.copy_file_range, []

    def kernel_copy(in_fd, out_fd, count, offset_src=None, offset_dst=None):
        calls.append(count)
        if kernel == "refused" or len(calls) > 1:
            raise OSError(errno.EXDEV, "cross-device")
        return real(in_fd, out_fd, min(count, 100), offset_src)  # 100 bytes, then refuse

    monkeypatch.setattr(os, "copy_file_range", kernel_copy)
    f = SafetensorsFile(src)
    write_safetensors_file(tmp_path / "out.safetensors", [(n, f.info(n)) for n in f.keys()])
    out = SafetensorsFile(tmp_path / "out.safetensors")
    for name, array in arrays.items():
        np.testing.assert_array_equal(out.read(name), array)
    assert calls  # the kernel path was tried first


@pytest.mark.parametrize("dtype", [np.float32, "bfloat16", np.float16])
def test_the_writer_refuses_non_finite_computed_weights(tmp_path, dtype):
    """Every computed tensor moejax writes (merged experts, rerouted routers, substitution constants,
    saved models) passes the writer: a NaN or inf is refused by name and nothing is left; a source
    tensor copied by byte range is the source's bytes and is not re-read."""
    import ml_dtypes

    dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype
    for bad in (np.nan, np.inf):
        values = np.array([1.0, bad, -2.0, bad], np.float32).astype(dtype)
        with pytest.raises(CheckpointError, match=r"^tensor 'w': 2 of 4 values are not finite \(NaN or inf\)"):
            write_checkpoint(tmp_path / "out", [("ok", np.ones(2, np.float32)), ("w", values)], None)
        assert list(tmp_path.iterdir()) == []
    write_checkpoint(tmp_path / "out", [("i", np.array([1, 2], np.int32)), ("w", np.ones(3, dtype))], None)

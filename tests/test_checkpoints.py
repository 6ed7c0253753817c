"""Checkpoint reading beyond the plain case: quantised experts, stray and MTP tensors, sharding,
and every kind of bad input failing with the file and tensor named."""

import json
import shutil

import numpy as np
import pytest

pytest.importorskip("transformers")

from hf_fixtures import QUANT_CONFIGS, aimer_ratio, make_checkpoint, quantize, rewrite  # noqa: E402

from moejax import from_pretrained, save_pretrained  # noqa: E402
from moejax.errors import CheckpointError  # noqa: E402
from moejax.hf.io.checkpoint_reader import CheckpointReader  # noqa: E402
from moejax.hf.quant import decode as quant  # noqa: E402
from moejax.scoring.score_checkpoint import score_data_free  # noqa: E402

@pytest.fixture(scope="module")
def source(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "src"
    make_checkpoint(path, seed=5)
    return path


@pytest.mark.parametrize("fmt", list(QUANT_CONFIGS))
def test_quantised_checkpoint_decodes_and_round_trips(source, tmp_path, fmt):
    qdir = rewrite(source, tmp_path / fmt, quantize(fmt), {"quantization_config": QUANT_CONFIGS[fmt]})
    dense = from_pretrained(source)
    model = from_pretrained(qdir)
    reader = CheckpointReader(qdir)
    # decoded expert weights: what the format's decoder gives, and close to the unquantised ones
    got = np.asarray(model.model.layers[1].mlp.experts_down[...][3]).T
    stem = "model.layers.1.mlp.experts.3.down_proj."
    if fmt == "fp8_block":
        want = quant.dequant_fp8_block(reader.read(stem + "weight"), reader.read(stem + "weight_scale_inv"))
    elif fmt == "int4_pack":
        want = quant.unpack_int4(reader.read(stem + "weight_packed"), reader.read(stem + "weight_scale"),
                                 reader.read(stem + "weight_shape"), 32)
    else:
        want = quant.dequant_mxfp4(reader.read(stem + "weight_packed"), reader.read(stem + "weight_scale"))
    np.testing.assert_array_equal(got, want)
    original = np.asarray(dense.model.layers[1].mlp.experts_down[...][3]).T
    assert np.abs(got - original).max() < 0.2 * np.abs(original).max()
    assert not np.array_equal(got, original)
    # the data-free aimer decodes the experts as the loader does (numpy on the loaded model's weights)
    free = score_data_free(qdir, scores=["aimer"])
    for l in (1, 2):
        mlp = model.model.layers[l].mlp
        want = [-aimer_ratio(*(w[...][e] for w in (mlp.experts_gate, mlp.experts_up, mlp.experts_down)))
                for e in range(8)]
        np.testing.assert_allclose(free[free.layer == l].sort_values("expert").value, want, rtol=1e-12)
    # load then save: every tensor back byte for byte, quantised ones with their companions
    out = save_pretrained(model, tmp_path / f"{fmt}-out")
    a, b = CheckpointReader(qdir), CheckpointReader(out)
    assert a.keys() == b.keys()
    for name in a.keys():
        assert (a.info(name).dtype, a.info(name).shape) == (b.info(name).dtype, b.info(name).shape), name
        assert a.read_bytes(name) == b.read_bytes(name), name
    assert b.config()["quantization_config"] == QUANT_CONFIGS[fmt]


def test_stray_and_mtp_tensors_are_skipped_then_carried(source, tmp_path, caplog):
    def add_extras(name, reader):
        items = [(name, reader.read(name))]
        if name == "model.norm.weight":
            items += [("model.layers.1.self_attn.rotary_emb.inv_freq", np.arange(4, dtype=np.float32)),
                      ("model.layers.3.embed_tokens.weight", np.ones((2, 3), np.float32))]  # MTP layer (L=3)
        if name.startswith("model.layers.2."):  # the MTP layer's decoder block, as DeepSeek-V3 ships it
            items.append((name.replace("model.layers.2.", "model.layers.3."), reader.read(name)))
        return items

    src = rewrite(source, tmp_path / "extras", add_extras, {"num_nextn_predict_layers": 1})
    with caplog.at_level("INFO", logger="moejax.hf.model_io"):
        model = from_pretrained(src)
    assert "not used by the forward" in caplog.text
    out = CheckpointReader(save_pretrained(model, tmp_path / "out"))
    assert out.read_bytes("model.layers.3.embed_tokens.weight") == np.ones((2, 3), np.float32).tobytes()
    assert "model.layers.1.self_attn.rotary_emb.inv_freq" in out.keys()


def test_sharded_save_and_load(source, tmp_path):
    model = from_pretrained(source)
    out = save_pretrained(model, tmp_path / "sharded", max_shard_bytes=100_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 3
    again = from_pretrained(out)
    np.testing.assert_array_equal(again.model.layers[2].mlp.experts_up[...], model.model.layers[2].mlp.experts_up[...])


def test_shape_and_missing_tensor_reported_together(source, tmp_path):
    def break_two(name, reader):
        if name == "model.layers.0.self_attn.o_proj.weight":
            return [(name, np.zeros((64, 5), np.float32))]
        if name == "model.layers.2.mlp.experts.7.up_proj.weight":
            return []
        return [(name, reader.read(name))]

    bad = rewrite(source, tmp_path / "bad", break_two)
    with pytest.raises(CheckpointError) as err:
        from_pretrained(bad)
    msg = str(err.value)
    assert "model.layers.0.self_attn.o_proj.weight in model.safetensors: shape [64, 5], expected [64, 48]" in msg
    assert "1 tensor(s) missing" in msg and "model.layers.2.mlp.experts.7.up_proj.weight" in msg


def test_router_fingerprint_is_one_for_a_bfloat16_checkpoint_and_its_float32_copy(source, tmp_path):
    """The fingerprint hashes the router values, not their storage: a bfloat16 checkpoint and its
    float32 copy (a lossless conversion) have one fingerprint, in checkpoint_fingerprint and in the
    data-free score's record (from the routers it read); rounding the float32 source to bfloat16
    changes values, and the fingerprint with them."""
    import ml_dtypes

    from moejax.hf.check import check_checkpoint
    from moejax.hf.provenance import checkpoint_fingerprint

    def cast(dtype):
        def transform(name, reader):
            value = reader.read(name)
            return [(name, value.astype(dtype) if value.dtype.kind == "f" or value.dtype == ml_dtypes.bfloat16
                     else value)]
        return transform

    bf16 = rewrite(source, tmp_path / "bf16", cast(ml_dtypes.bfloat16), {"dtype": "bfloat16"})
    f32 = rewrite(bf16, tmp_path / "f32", cast(np.float32), {"dtype": "float32"})
    router = "model.layers.1.mlp.gate.weight"
    assert CheckpointReader(bf16).info(router).dtype == "BF16" and CheckpointReader(f32).info(router).dtype == "F32"
    prints = [checkpoint_fingerprint(check_checkpoint(p)) for p in (bf16, f32, source)]
    assert prints[0] == prints[1] != prints[2]
    for p in (bf16, f32):
        score_data_free(p, scores=["l1"], out=tmp_path / f"{p.name}.parquet")
        assert json.loads((tmp_path / f"{p.name}.json").read_text())["fingerprint"] == prints[0]


def test_wrong_dtype_is_named(source, tmp_path):
    def as_int(name, reader):
        value = reader.read(name)
        return [(name, value.astype(np.int32) if name == "model.norm.weight" else value)]

    with pytest.raises(CheckpointError, match=r"model\.norm\.weight in model\.safetensors: dtype I32"):
        from_pretrained(rewrite(source, tmp_path / "bad", as_int))


def test_missing_shard_truncated_file_and_unknown_quantisation(source, tmp_path):
    sharded = save_pretrained(from_pretrained(source), tmp_path / "s", max_shard_bytes=100_000)
    victim = sorted(sharded.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=victim.name):
        from_pretrained(sharded)

    truncated = tmp_path / "t"
    shutil.copytree(source, truncated)
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[:1000])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        from_pretrained(truncated)

    awq = rewrite(source, tmp_path / "awq", config_update={"quantization_config": {"quant_method": "awq"}})
    with pytest.raises(CheckpointError, match="'awq'"):
        from_pretrained(awq)


def test_save_refuses_existing_folder_and_source(source, tmp_path):
    model = from_pretrained(source)
    existing = tmp_path / "exists"
    existing.mkdir()
    (existing / "keep.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="already exists"):
        save_pretrained(model, existing)
    assert (existing / "keep.txt").read_text() == "mine" and len(list(existing.iterdir())) == 1
    before = {p.name: p.read_bytes() for p in source.iterdir()}
    with pytest.raises(CheckpointError, match="(is|is inside|holds) the input"):
        save_pretrained(model, source, overwrite=True)
    assert {p.name: p.read_bytes() for p in source.iterdir()} == before

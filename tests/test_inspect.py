"""`moejax inspect` / `moejax plan` (moejax.surgery.inspect, moejax.surgery.plan): parameter counts
checked against transformers and the safetensors package, packed 4-bit tensors counted in logical
values, active parameters recomputed from the config, device plans hand-computed on sparse
header-only checkpoints, and all of it without reading a byte of tensor data."""

import argparse
import json
import math
import os
import re
import struct
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

from hf_fixtures import QUANT_CONFIGS, full_config, spec_shapes
from hf_fixtures import quantised_linear as fixture_linear
from moejax.errors import CheckpointError, ConfigError
from moejax.hf.io.checkpoint_reader import CheckpointReader
from moejax.hf.io.checkpoint_writer import write_checkpoint
from moejax.hf.io.safetensors_format import SafetensorsFile
from moejax.surgery import inspect as inspection
from moejax.surgery import plan as planning
from moejax.surgery.inspect import format_inspect, human_bytes, human_count, inspect_checkpoint
from moejax.surgery.plan import (
    ACCELERATORS_GB,
    format_plan,
    matrix_bytes,
    parse_gpu_specs,
    plan_checkpoint,
    smallest_device_count,
)

BF16 = ml_dtypes.bfloat16


def data_bytes(path):
    """Bytes of a safetensors file's data buffer: file size less the length field and header."""
    with open(path, "rb") as handle:
        (header_length,) = struct.unpack("<Q", handle.read(8))
    return os.path.getsize(path) - 8 - header_length


@pytest.fixture
def no_tensor_data(monkeypatch):
    """Every way moejax reads tensor data raises, so a passing test proves headers suffice."""
    def refuse(self, name):
        raise AssertionError(f"tensor data of {name!r} was read")

    for cls in (SafetensorsFile, CheckpointReader):
        monkeypatch.setattr(cls, "read", refuse)
        monkeypatch.setattr(cls, "read_bytes", refuse)


# --------------------------------------------------------------------------------------------
# A transformers checkpoint
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    pytest.importorskip("transformers")
    from hf_fixtures import make_checkpoint

    path = tmp_path_factory.mktemp("hf") / "src"
    return path, make_checkpoint(path, seed=3)


def transformers_count(model):
    """What transformers holds: parameters (tied ones once) plus the balance-bias buffers, which
    transformers keeps as buffers but saves, so HF's on-disk count includes them."""
    parameters = sum(p.numel() for p in model.parameters())
    biases = sum(b.numel() for name, b in model.named_buffers() if name.endswith("e_score_correction_bias"))
    return parameters, biases


def test_counts_match_transformers_and_safetensors(hf_checkpoint, no_tensor_data):
    path, model = hf_checkpoint
    report = inspect_checkpoint(path)
    from safetensors.numpy import load_file  # reads data itself, not through moejax

    tensors = load_file(path / "model.safetensors")
    parameters, biases = transformers_count(model)
    assert biases == 2 * 8  # two MoE layers of 8 experts
    assert report["parameters"]["total"] == sum(t.size for t in tensors.values()) == parameters + biases
    routed = sum(t.size for name, t in tensors.items() if ".mlp.experts." in name)
    assert report["parameters"]["routed_experts"] == routed == 2 * 8 * 3 * 64 * 32
    assert report["parameters"]["other"] == report["parameters"]["total"] - routed
    assert report["bytes"]["by_dtype"] == {"F32": data_bytes(path / "model.safetensors")}
    assert report["bytes"]["total"] == 4 * report["parameters"]["total"]
    assert report["bytes"]["routed_experts"] + report["bytes"]["other"] == report["bytes"]["total"]
    assert report["tensors"] == len(tensors)
    assert report["decoder_layers"] == {"count": 3, "indices": [0, 1, 2]}
    assert report["mtp_layers"] == {"count": 0, "indices": []}
    assert report["moe_layers"] == [1, 2] and report["routed_experts"] == {"1": 8, "2": 8}
    assert report["experts_per_token"] == 2 and report["parameters"]["mtp"] == 0
    assert json.loads(json.dumps(report)) == report


def test_active_parameters_from_the_config(hf_checkpoint):
    path, _ = hf_checkpoint
    config = json.loads((path / "config.json").read_text())
    report = inspect_checkpoint(path)
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    expert = 3 * hidden * config["moe_intermediate_size"]
    moe_layers = config["num_hidden_layers"] - config["first_k_dense_replace"]
    idle_experts = moe_layers * (config["n_routed_experts"] - config["num_experts_per_tok"]) * expert
    embedding_rows_not_looked_up = (vocab - 1) * hidden
    assert report["parameters"]["active_per_token"] == (
        report["parameters"]["total"] - idle_experts - embedding_rows_not_looked_up)


def test_tied_embeddings_count_once_and_fully_active(tmp_path):
    pytest.importorskip("transformers")
    from hf_fixtures import make_checkpoint

    model = make_checkpoint(tmp_path / "tied", seed=4, tie_word_embeddings=True, num_hidden_layers=2)
    report = inspect_checkpoint(tmp_path / "tied")
    assert report["parameters"]["total"] == sum(transformers_count(model))
    # the table is the output projection too, so every row of it is used for every token
    assert report["parameters"]["active_per_token"] == report["parameters"]["total"] - 1 * (8 - 2) * 3 * 64 * 32


# --------------------------------------------------------------------------------------------
# Hand-built quantised checkpoints, with an MTP layer
# --------------------------------------------------------------------------------------------

HIDDEN, INTER, VOCAB, EXPERTS, TOP_K = 64, 128, 50, 4, 2
# Layers 0 (dense) and 1 (MoE) plus MTP layer 2; group routing over 2 groups of 2 experts.
SMALL = dict(num_hidden_layers=2, first_k_dense_replace=1, num_nextn_predict_layers=1, hidden_size=HIDDEN,
             moe_intermediate_size=INTER, vocab_size=VOCAB, n_routed_experts=EXPERTS, num_experts_per_tok=TOP_K,
             n_group=2, topk_group=1)
MLP_LINEAR = re.compile(r"\.mlp\.(experts\.\d+\.|shared_experts\.)?(gate|up|down)_proj\.weight$")
ATTN_LINEAR = re.compile(r"\.self_attn\.\w+_proj(_with_mqa)?\.weight$")


def quantised_linear(name, w, fmt):
    """hf_fixtures' quantised Linear, with weight_shape stored as I32 (as Kimi checkpoints do)."""
    return [(n, v.astype(np.int32) if n.endswith("weight_shape") else v) for n, v in fixture_linear(name, w, fmt)]


def mtp_shapes(config, layer):
    """(name, shape) of a DeepSeek-V3 MTP layer at decoder index `layer`: a full decoder layer (its
    shapes as tensor_specs gives them for a model one layer deeper) plus its own embedding, norms,
    projection and head."""
    deeper = spec_shapes({**config, "num_hidden_layers": layer + 1, "num_nextn_predict_layers": 0})
    stem = f"model.layers.{layer}."
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    return [(n, s) for n, s in deeper if n.startswith(stem)] + [
        (stem + "embed_tokens.weight", (vocab, hidden)), (stem + "enorm.weight", (hidden,)),
        (stem + "hnorm.weight", (hidden,)), (stem + "eh_proj.weight", (hidden, 2 * hidden)),
        (stem + "shared_head.norm.weight", (hidden,)), (stem + "shared_head.head.weight", (vocab, hidden))]


def build_checkpoint(path, fmt=None, alter=None, extra=(), **overrides):
    """A complete checkpoint of full_config(**SMALL, **overrides): every tensor tensor_specs asks for
    plus MTP layer 2. MLP Linears (experts, shared experts, dense MLP) quantised in `fmt` (FP8:
    attention Linears too), as real releases store them; routers and balance biases F32, the rest
    BF16. `alter(name, array)` may replace an array before writing; `extra` adds (name, array)
    pairs. Returns the arrays written, by name."""
    rng = np.random.default_rng(0)
    config = full_config(**{**SMALL, **overrides})
    if fmt is not None:
        config["quantization_config"] = QUANT_CONFIGS[fmt]
    shapes = spec_shapes(config) + mtp_shapes(config, config["num_hidden_layers"])
    tensors = []
    for name, shape in shapes:
        w = rng.standard_normal(shape).astype(np.float32)
        if fmt is not None and (MLP_LINEAR.search(name) or (fmt == "fp8_block" and ATTN_LINEAR.search(name))):
            tensors += quantised_linear(name, w, fmt)
        else:
            tensors.append((name, w if ".mlp.gate." in name else w.astype(BF16)))
    tensors = [(n, alter(n, a) if alter else a) for n, a in tensors] + list(extra)
    write_checkpoint(path, tensors, config, max_shard_bytes=60_000)
    return dict(tensors)


def logical_size(name, array, fmt):
    """HF's count of one array, independently: 4-bit values for packed ones (8 per int32, 2 per byte)."""
    if name.endswith("weight_packed"):
        return array.size * {"int4_pack": 8, "mxfp4": 2}[fmt]
    return array.size


@pytest.mark.parametrize("fmt", ["fp8_block", "int4_pack", "mxfp4"])
def test_quantised_counts_packed_values_logically(tmp_path, fmt, no_tensor_data):
    arrays = build_checkpoint(tmp_path / fmt, fmt)
    report = inspect_checkpoint(tmp_path / fmt)
    sizes = {name: logical_size(name, array, fmt) for name, array in arrays.items()}

    assert report["quantization"] == fmt and report["tensors"] == len(arrays)
    assert report["parameters"]["total"] == sum(sizes.values())
    routed = {n: s for n, s in sizes.items() if ".experts." in n}
    assert report["parameters"]["routed_experts"] == sum(routed.values())
    # a packed expert matrix counts exactly its dense [out, in] values
    packed = [n for n in arrays if n.endswith("weight_packed")]
    assert all(sizes[n] == INTER * HIDDEN for n in packed if ".experts." in n)
    assert bool(packed) == (fmt != "fp8_block")
    mtp = sum(s for n, s in sizes.items() if n.startswith("model.layers.2."))
    assert report["parameters"]["mtp"] == mtp
    assert report["mtp_layers"] == {"count": 1, "indices": [2]}
    assert report["decoder_layers"] == {"count": 2, "indices": [0, 1]}
    assert report["routed_experts"] == {"1": EXPERTS, "2": EXPERTS}

    one_expert = sum(s for n, s in sizes.items() if n.startswith("model.layers.1.mlp.experts.0."))
    main_not_routed = sum(s for n, s in sizes.items() if n not in routed and not n.startswith("model.layers.2."))
    assert report["parameters"]["active_per_token"] == (
        main_not_routed - (VOCAB - 1) * HIDDEN + TOP_K * one_expert)

    shards = sorted((tmp_path / fmt).glob("*.safetensors"))
    assert len(shards) > 1
    assert sum(report["bytes"]["by_dtype"].values()) == report["bytes"]["total"] == sum(map(data_bytes, shards))
    stored = {}
    for array in arrays.values():
        code = {np.dtype(BF16): "BF16", np.dtype(np.float32): "F32", np.dtype(np.int32): "I32",
                np.dtype(np.uint8): "U8", np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3"}[array.dtype]
        stored[code] = stored.get(code, 0) + array.nbytes
    assert report["bytes"]["by_dtype"] == dict(sorted(stored.items()))
    assert report["bytes"]["routed_experts"] == sum(a.nbytes for n, a in arrays.items() if ".experts." in n)
    text = format_inspect(report)
    assert fmt in text and "active per token" in text
    plan = plan_checkpoint(tmp_path / fmt)  # headers only too (no_tensor_data)
    assert plan["quantization"] == fmt


def test_repricing_replaces_scales(tmp_path):
    """Re-pricing experts in their own format gives the bytes quantize_* wrote (values and scales,
    so the old scales are not counted twice); re-pricing FP8 experts in BF16 drops their scale_inv
    tensors (2 bytes per value, nothing else)."""
    arrays = build_checkpoint(tmp_path / "mx", "mxfp4")
    plan = plan_checkpoint(tmp_path / "mx")
    stored, mx_bf16 = plan["pricings"][0], next(p for p in plan["pricings"] if p["name"] == "experts MXFP4 / rest BF16")
    assert mx_bf16["bytes"]["routed_experts"] == stored["bytes"]["routed_experts"] == sum(
        a.nbytes for n, a in arrays.items() if ".experts." in n)

    arrays = build_checkpoint(tmp_path / "fp8", "fp8_block")
    plan = plan_checkpoint(tmp_path / "fp8")
    bf16 = next(p for p in plan["pricings"] if p["name"] == "experts BF16 / rest BF16")
    routed_values = sum(a.size for n, a in arrays.items() if ".experts." in n and n.endswith(".weight"))
    assert bf16["bytes"]["routed_experts"] == 2 * routed_values
    fp8 = next(p for p in plan["pricings"] if p["name"] == "experts FP8 / rest BF16")
    assert fp8["bytes"]["routed_experts"] == sum(a.nbytes for n, a in arrays.items() if ".experts." in n)


def test_packed_tensor_of_the_wrong_dtype_is_named(tmp_path):
    """A complete INT4 checkpoint but for one weight_packed stored as I64: 4-bit values would be
    unpacked from the wrong element size, so the shared check refuses it, naming tensor and shard."""
    name = "model.layers.1.mlp.experts.0.up_proj.weight_packed"
    build_checkpoint(tmp_path / "c", "int4_pack", alter=lambda n, a: a.astype(np.int64) if n == name else a)
    with pytest.raises(CheckpointError, match=rf"{re.escape(name)} in model-\d+-of-\d+\.safetensors: "
                                              r"dtype I64, expected I32 for int4_pack") as error:
        inspect_checkpoint(tmp_path / "c")
    assert "does not match its config.json" in str(error.value)
    with pytest.raises(CheckpointError, match=re.escape(name)):
        plan_checkpoint(tmp_path / "c")


def test_bad_config_key_names_the_file(tmp_path):
    """A size given as a string is refused by the config reader, naming config.json, the key, the
    value as written and what was expected; a size left out takes DeepSeek-V3's default, which the
    tensors then contradict."""
    build_checkpoint(tmp_path / "c")
    config_path = tmp_path / "c" / "config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "num_hidden_layers": "2"}))
    with pytest.raises(ConfigError, match=r"c/config\.json: num_hidden_layers=\"2\" \(str\), "
                                          r"expected a positive integer"):
        inspect_checkpoint(tmp_path / "c")

    del config["num_hidden_layers"]  # the default is DeepSeek-V3's 61 layers
    config_path.write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"c: checkpoint does not match its config\.json:(.|\n)*"
                                              r"tensor\(s\) missing"):
        inspect_checkpoint(tmp_path / "c")


def test_surplus_decoder_layer_is_refused(tmp_path):
    """num_hidden_layers=2 and num_nextn_predict_layers=1 allow layers 0..2: a layer 3 tensor is not
    taken for another MTP layer (nor counted), it is refused, naming the layer."""
    surplus = ("model.layers.3.input_layernorm.weight", np.ones(HIDDEN, BF16))
    build_checkpoint(tmp_path / "c", extra=[surplus])
    message = (r"decoder layer\(s\) \[3\] that config\.json does not account for: num_hidden_layers=2 and "
               r"num_nextn_predict_layers=1 allow layers 0\.\.2(.|\n)*model\.layers\.3\.input_layernorm\.weight")
    with pytest.raises(CheckpointError, match=message):
        inspect_checkpoint(tmp_path / "c")
    with pytest.raises(CheckpointError, match=message):
        plan_checkpoint(tmp_path / "c")


def test_router_stored_as_integers_is_refused(tmp_path, no_tensor_data):
    """A router of I32 bit patterns would be ranked as numbers by anything reading it: refused,
    naming the tensor, from the header alone."""
    name = "model.layers.1.mlp.gate.weight"
    build_checkpoint(tmp_path / "c", alter=lambda n, a: a.view(np.int32) if n == name else a)
    with pytest.raises(CheckpointError, match=rf"{re.escape(name)} in model-\d+-of-\d+\.safetensors: dtype I32, "
                                              r"expected one of \['BF16', 'F16', 'F32'\]"):
        inspect_checkpoint(tmp_path / "c")


# --------------------------------------------------------------------------------------------
# plan on sparse header-only checkpoints
# --------------------------------------------------------------------------------------------

BIG_HIDDEN, BIG_INTER = 65536, 32768


def write_sparse_checkpoint(path, tensors, config):
    """A one-shard checkpoint whose data buffer is a hole: the header is real, the bytes zeros the
    file system never stores. `tensors` maps name -> (dtype code, shape)."""
    bits = {"BF16": 16, "F32": 32, "I8": 8, "F8_E4M3": 8, "F8_E8M0": 8, "I64": 64}
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, (dtype, shape) in tensors.items():
        size = math.prod(shape) * bits[dtype] // 8
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.mkdir()
    with open(path / "model.safetensors", "wb") as handle:
        handle.write(struct.pack("<Q", len(text)) + text)
        handle.truncate(8 + len(text) + offset)
    if os.stat(path / "model.safetensors").st_blocks * 512 > 10**8:
        pytest.skip("file system without sparse files")
    (path / "config.json").write_text(json.dumps(config))
    return offset


def big_config(experts=16, heads=128):
    """One MoE layer (no dense layer, no shared expert) of `experts` BF16 experts of 3 x 2**31
    values each (12.9 GB per expert), a 1024-token vocabulary, BASE's small attention ranks."""
    return full_config(num_hidden_layers=1, first_k_dense_replace=0, hidden_size=BIG_HIDDEN,
                       moe_intermediate_size=BIG_INTER, vocab_size=1024, num_attention_heads=heads,
                       num_key_value_heads=heads, n_routed_experts=experts, n_shared_experts=0, n_group=1,
                       topk_group=1, num_experts_per_tok=2)


def big_moe(path, experts=16, heads=128):
    """A complete header-only checkpoint of big_config: every tensor the config implies (names and
    shapes from tensor_specs), BF16 but for the F32 balance bias. Returns the data bytes."""
    config = big_config(experts, heads)
    tensors = {name: ("F32" if name.endswith("e_score_correction_bias") else "BF16", shape)
               for name, shape in spec_shapes(config)}
    return write_sparse_checkpoint(path, tensors, config)


def pricing(plan, name):
    return next(p for p in plan["pricings"] if p["name"] == name)


def hand_shapes(config):
    """The checkpoint of a one-MoE-layer config (big_config) counted by hand from DeepSeek-V3's
    architecture, not from moejax: ([out, in] of each non-expert matrix, BF16 vector values)."""
    H, V, E, heads = (config[k] for k in ("hidden_size", "vocab_size", "n_routed_experts", "num_attention_heads"))
    q, kv, nope, rope, v = (config[k] for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                                                 "qk_rope_head_dim", "v_head_dim"))
    matrices = [(V, H), (V, H), (E, H),                          # embedding, lm_head, router
                (q, H), (heads * (nope + rope), q),              # q_a_proj, q_b_proj
                (kv + rope, H), (heads * (nope + v), kv),        # kv_a_proj_with_mqa, kv_b_proj
                (H, heads * v)]                                  # o_proj
    vectors = 3 * H + q + kv  # final norm, input and post-attention norms; q_a and kv_a norms
    return matrices, vectors


def fp8_bytes(rows, cols):
    """One byte per value plus a float32 scale per 128x128 block (a partial block is a block)."""
    return rows * cols + 4 * math.ceil(rows / 128) * math.ceil(cols / 128)


def test_plan_hand_computed(tmp_path, no_tensor_data):
    total = big_moe(tmp_path / "big")
    plan = plan_checkpoint(tmp_path / "big")
    config, experts = big_config(), 16
    expert_matrix = BIG_INTER * BIG_HIDDEN  # 2**31 values
    matrices, vectors = hand_shapes(config)
    bias = 4 * experts  # the F32 balance bias
    other = 2 * sum(r * c for r, c in matrices) + 2 * vectors + bias
    assert total == 2 * experts * 3 * expert_matrix + other == 206_637_236_368

    stored = pricing(plan, "as stored")
    assert stored["bytes"] == {"routed_experts": experts * 3 * 2 * expert_matrix, "other": other, "total": total}
    # 206.64 GB: H100 0.9*80 = 72 -> 4 (51.7 each); H200 126.9 -> 2; B200 162 -> 2; B300 259.2 -> 1;
    # TPU v5p 85.5 -> 4
    assert stored["devices"] == {"H100": 4, "H200": 2, "B200": 2, "B300": 1, "TPU v5p": 4}
    assert pricing(plan, "experts BF16 / rest BF16")["bytes"] == stored["bytes"]

    # FP8: every matrix in FP8 blocks; the norms keep their 2 bytes, the bias its 4
    fp8_rest = sum(fp8_bytes(r, c) for r, c in matrices) + 2 * vectors + bias
    fp8_experts = experts * 3 * fp8_bytes(BIG_INTER, BIG_HIDDEN)
    fp8 = pricing(plan, "experts FP8 / rest FP8")
    assert fp8["bytes"] == {"routed_experts": fp8_experts, "other": fp8_rest, "total": fp8_experts + fp8_rest}
    assert fp8["bytes"]["total"] == 103_344_044_384
    assert fp8["devices"] == {"H100": 2, "H200": 1, "B200": 1, "B300": 1, "TPU v5p": 2}

    # MXFP4: half a byte per value plus one E8M0 byte per 32 values of a row
    mx_matrix = BIG_INTER * (BIG_HIDDEN // 2 + BIG_HIDDEN // 32)
    mx = pricing(plan, "experts MXFP4 / rest BF16")
    assert mx["bytes"]["routed_experts"] == experts * 3 * mx_matrix == 54_760_833_024
    assert mx["bytes"]["other"] == stored["bytes"]["other"]
    assert set(mx["devices"].values()) == {1}
    assert plan["constraints"] == {"routed_experts": [16], "num_attention_heads": 128, "max_devices": 1024}
    assert plan["units"] == "GB = 1e9 bytes" and plan["headroom"] == 0.9
    text = format_plan(plan)
    assert "GB = 1e9 bytes" in text and "weights only" in text and "206.64 GB" in text


def test_plan_divisibility_bites(tmp_path):
    big_moe(tmp_path / "two_heads", heads=2)
    devices = pricing(plan_checkpoint(tmp_path / "two_heads"), "as stored")["devices"]
    assert devices == {"H100": None, "H200": 2, "B200": 2, "B300": 1, "TPU v5p": None}  # 4 does not divide 2

    big_moe(tmp_path / "twelve", experts=12)  # 155.10 GB
    plan = plan_checkpoint(tmp_path / "twelve", extra_gpus={"small": 30, "H100": 40})
    devices = pricing(plan, "as stored")["devices"]
    # small: 0.9*30 = 27 GB needs 8 (19.4 each), which does not divide 12 experts; H100 overridden
    # to 40 GB: 36 GB needs 8 too; H200 126.9 -> 2
    assert devices["small"] is None and devices["H100"] is None and devices["H200"] == 2
    assert plan["accelerators"]["H100"] == 40 and plan["accelerators"]["small"] == 30
    assert "no fit" in format_plan(plan)
    assert pricing(plan, "experts FP8 / rest BF16")["devices"]["small"] == 4  # 77.8 GB / 4 = 19.5


def test_smallest_device_count_rules():
    assert smallest_device_count(0, 1, 0.9, []) == 1
    assert smallest_device_count(9 * 10**8, 1, 0.9, []) == 1  # exactly at the headroom
    assert smallest_device_count(9 * 10**8 + 1, 1, 0.9, []) == 2
    assert smallest_device_count(1000 * 10**9, 1, 1.0, []) == 1024
    assert smallest_device_count(1025 * 10**9, 1, 1.0, []) is None
    assert smallest_device_count(3 * 10**9, 1, 1.0, [256, 96]) == 4
    assert smallest_device_count(3 * 10**9, 1, 1.0, [256, 6]) is None
    assert matrix_bytes((2, 100, 300), "fp8") == 2 * (100 * 300 + 4 * 1 * 3)


def test_plan_argument_errors(tmp_path):
    path = tmp_path / "q"
    build_checkpoint(path, "mxfp4")
    with pytest.raises(ConfigError, match="headroom"):
        plan_checkpoint(path, headroom=1.5)
    with pytest.raises(ConfigError, match="'X'.*positive number of GB"):
        plan_checkpoint(path, extra_gpus={"X": 0})


def test_parse_gpu_specs():
    assert parse_gpu_specs(["MI300X=192", " tiny = 0.5"]) == {"MI300X": 192.0, "tiny": 0.5}
    assert parse_gpu_specs(None) == {} == parse_gpu_specs([])
    for bad, message in [("MI300X", "expected NAME=GB"), ("=192", "expected NAME=GB"), ("X=", "expected NAME=GB"),
                         ("X=big", "'big' is not a number of GB"), ("X=0", "positive number of GB"),
                         ("X=-3", "positive number of GB"), ("X=nan", "positive number of GB"),
                         ("X=inf", "positive number of GB")]:
        with pytest.raises(ConfigError, match=message) as error:
            parse_gpu_specs([bad])
        assert repr(bad) in str(error.value)
    with pytest.raises(ConfigError, match="given twice"):
        parse_gpu_specs(["X=1", "X=2"])


# --------------------------------------------------------------------------------------------
# CLI and text
# --------------------------------------------------------------------------------------------


def run_cli(argv):
    parser = argparse.ArgumentParser()
    subparsers = parser.add_subparsers(dest="command", required=True)
    inspection.register_cli(subparsers)
    planning.register_cli(subparsers)
    args = parser.parse_args(argv)
    args.func(args)


def test_cli_json_and_text(hf_checkpoint, capsys, no_tensor_data):
    path, _ = hf_checkpoint
    run_cli(["inspect", str(path), "--json"])
    assert json.loads(capsys.readouterr().out) == inspect_checkpoint(path)
    run_cli(["inspect", str(path)])
    text = capsys.readouterr().out
    assert all(row in text for row in ("routed experts", "everything else", "active per token", "MoE layers"))

    run_cli(["plan", str(path), "--gpu", "tiny=0.0003", "--gpu", "MI300X=192", "--json"])
    plan = json.loads(capsys.readouterr().out)
    assert plan["accelerators"] == {**ACCELERATORS_GB, "tiny": 0.0003, "MI300X": 192.0}
    assert pricing(plan, "as stored")["devices"]["tiny"] == 4  # 743,712 bytes / 270,000 per device
    run_cli(["plan", str(path), "--headroom", "0.5"])
    assert "0.5 x device memory" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="NAME=GB"):
        run_cli(["plan", str(path), "--gpu", "tiny"])


def test_wired_into_moejax_main(hf_checkpoint, capsys):
    from moejax.cli import main

    path, _ = hf_checkpoint
    assert main(["inspect", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tensors"] == 91
    assert main(["plan", str(path), "--gpu", "X=-1"]) == 2
    assert "positive number of GB" in capsys.readouterr().err


def test_human_units():
    assert human_count(1_234_567_890) == "1.23 B" and human_count(671_026_419_200) == "671.03 B"
    assert human_count(1_000_000_000_000) == "1.00 T" and human_count(512) == "512"
    assert human_bytes(4_560_000_000) == "4.56 GB" and human_bytes(999) == "999 B"


def test_module_imports_no_jax_or_torch():
    code = ("import sys, moejax.surgery.inspect, moejax.surgery.plan; "
            "print(sorted(m for m in ('jax', 'torch', 'flax') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


V4_FP8 = re.compile(r"(\.attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|\.attn\.indexer\.wq_b|\.ffn\.shared_experts\.w[123])\.weight$")
V4_F32 = re.compile(r"(hc_\w+|attn_sink|\.ape|\.gate\.bias)$")


def v4_release_tensors(cfg) -> dict:
    """DeepSeek-V4's tensors as the published checkpoints store them (their weight listings): routed
    experts FP4 (I8 [out, in/2] with an E8M0 scale per 32 inputs), attention and shared-expert
    Linears FP8 (E4M3 with an E8M0 scale per 128 x 128 block), hyper-connection, sink, ape and
    balance-bias tensors F32, tid2eid I64, the rest BF16."""
    from moejax.hf.mapping import tensor_specs

    tensors = {}
    for s in tensor_specs(cfg):
        name, shape = s.hf_name, tuple(s.hf_shape)
        if s.expert is not None:
            tensors[name] = ("I8", (shape[0], shape[1] // 2))
            tensors[name[:-len("weight")] + "scale"] = ("F8_E8M0", (shape[0], shape[1] // 32))
        elif V4_FP8.search(name):
            tensors[name] = ("F8_E4M3", shape)
            blocks = (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128))
            tensors[name[:-len("weight")] + "scale"] = ("F8_E8M0", blocks)
        else:
            tensors[name] = ("I64" if name.endswith("tid2eid") else "F32" if V4_F32.search(name) else "BF16", shape)
    return tensors


@pytest.mark.parametrize("preset,layers,devices", [
    # V4-Flash, every layer: 156.0 GB as stored (147.2 GB of it FP4 experts): H100 (72 GB each) 4,
    # H200 (126.9) 2, B200 (162) 1, B300 1, TPU v5p (85.5) 2
    ("deepseek-v4-flash", None, {"H100": 4, "H200": 2, "B200": 1, "B300": 1, "TPU v5p": 2}),
    # V4-Pro cut to 8 of its 61 layers (a header of every layer is large): 114.8 GB
    ("deepseek-v4-pro", 8, {"H100": 2, "H200": 1, "B200": 1, "B300": 1, "TPU v5p": 2}),
])
def test_plan_of_deepseek_v4_counts_fp4_experts_at_4_bits(tmp_path, no_tensor_data, preset, layers, devices):
    """`moejax plan` on a header-only DeepSeek-V4 checkpoint of the full-size preset, stored as the
    release is: as stored, the routed experts take their bytes (FP4: half a byte per value plus an
    E8M0 byte per 32), which is exactly what MXFP4 re-pricing gives (the same format), and BF16
    re-pricing 2 bytes per logical value (FP4 experts counted at 4 bits, not as I8 bytes); the
    devices are those the total needs."""
    from moejax.models.registry import FAMILIES

    fam = FAMILIES["deepseek_v4"]
    config = dict(fam.presets[preset])
    if layers:
        config = {**config, "num_hidden_layers": layers}
    cfg = fam.config_class.from_dict(config, source=preset)
    tensors = v4_release_tensors(cfg)
    total = write_sparse_checkpoint(tmp_path / "v4", tensors, config)
    plan = plan_checkpoint(tmp_path / "v4")
    assert plan["quantization"] == "deepseek_v4_fp8"
    L, E, H, I = cfg.num_hidden_layers, cfg.n_experts, cfg.hidden_size, cfg.moe_intermediate_size
    one_expert = 2 * (I * H // 2 + I * H // 32) + (H * I // 2 + H * I // 32)   # w1, w3 [I, H]; w2 [H, I]
    routed = L * E * one_expert
    stored = pricing(plan, "as stored")
    assert stored["bytes"] == {"routed_experts": routed, "other": total - routed, "total": total}
    assert pricing(plan, "experts MXFP4 / rest BF16")["bytes"]["routed_experts"] == routed
    assert pricing(plan, "experts BF16 / rest BF16")["bytes"]["routed_experts"] == L * E * 3 * I * H * 2
    assert stored["devices"] == devices, (total / 1e9, stored["devices"])
    assert plan["constraints"]["routed_experts"] == [E] and plan["constraints"]["num_attention_heads"] == \
        cfg.num_attention_heads
    report = inspect_checkpoint(tmp_path / "v4")
    assert report["parameters"]["routed_experts"] == L * E * 3 * I * H + sum(
        math.prod(tensors[n][1]) for n in tensors if ".experts." in n and n.endswith(".scale"))

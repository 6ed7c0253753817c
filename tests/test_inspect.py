"""`moejax inspect` / `moejax plan` (moejax.hf.inspect): parameter counts checked against
transformers and the safetensors package, packed 4-bit tensors counted in logical values, active
parameters recomputed from the config, device plans hand-computed on sparse header-only
checkpoints, and all of it without reading a byte of tensor data."""

import argparse
import json
import math
import os
import struct
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

from hf_fixtures import QUANT_CONFIGS
from hf_fixtures import quantised_linear as fixture_linear
from moejax.errors import CheckpointError, ConfigError
from moejax.hf import quant
from moejax.hf.inspect import (
    ACCELERATORS_GB,
    format_inspect,
    format_plan,
    human_bytes,
    human_count,
    inspect_checkpoint,
    matrix_bytes,
    parse_gpu_specs,
    plan_checkpoint,
    register_cli,
    smallest_device_count,
)
from moejax.hf.safetensors_io import CheckpointReader, SafetensorsFile, write_checkpoint

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


def quantised_linear(name, w, fmt):
    """hf_fixtures' quantised Linear, with weight_shape stored as I32 (as Kimi checkpoints do)."""
    return [(n, v.astype(np.int32) if n.endswith("weight_shape") else v) for n, v in fixture_linear(name, w, fmt)]


def build_quantised(path, fmt):
    """Layers 0 (dense) and 1 (MoE) plus an MTP layer 2 with its own embedding and MoE block;
    expert and dense-MLP Linears quantised in `fmt`. Returns the arrays written, by name."""
    rng = np.random.default_rng(0)

    def dense(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    tensors = [("model.embed_tokens.weight", dense(VOCAB, HIDDEN).astype(BF16)),
               ("lm_head.weight", dense(VOCAB, HIDDEN).astype(BF16)),
               ("model.norm.weight", dense(HIDDEN).astype(BF16)),
               ("model.layers.0.input_layernorm.weight", dense(HIDDEN).astype(BF16))]
    tensors += quantised_linear("model.layers.0.mlp.down_proj.weight", dense(HIDDEN, INTER), fmt)
    for layer in (1, 2):
        stem = f"model.layers.{layer}.mlp."
        tensors += [(stem + "gate.weight", dense(EXPERTS, HIDDEN)),
                    (stem + "gate.e_score_correction_bias", dense(EXPERTS))]
        for e in range(EXPERTS):
            for proj, shape in (("gate_proj", (INTER, HIDDEN)), ("up_proj", (INTER, HIDDEN)),
                                ("down_proj", (HIDDEN, INTER))):
                tensors += quantised_linear(f"{stem}experts.{e}.{proj}.weight", dense(*shape), fmt)
    tensors += [("model.layers.2.embed_tokens.weight", dense(VOCAB, HIDDEN).astype(BF16)),
                ("model.layers.2.enorm.weight", dense(HIDDEN).astype(BF16)),
                ("model.layers.2.eh_proj.weight", dense(HIDDEN, 2 * HIDDEN).astype(BF16))]
    config = {"model_type": "deepseek_v3", "num_hidden_layers": 2, "hidden_size": HIDDEN, "vocab_size": VOCAB,
              "num_attention_heads": 4, "n_routed_experts": EXPERTS, "num_experts_per_tok": TOP_K,
              "num_nextn_predict_layers": 1, "quantization_config": QUANT_CONFIGS[fmt]}
    write_checkpoint(path, tensors, config, max_shard_bytes=60_000)
    return dict(tensors)


def logical_size(name, array, fmt):
    """HF's count of one array, independently: 4-bit values for packed ones (8 per int32, 2 per byte)."""
    if name.endswith("weight_packed"):
        return array.size * {"int4_pack": 8, "mxfp4": 2}[fmt]
    return array.size


@pytest.mark.parametrize("fmt", ["fp8_block", "int4_pack", "mxfp4"])
def test_quantised_counts_packed_values_logically(tmp_path, fmt, no_tensor_data):
    arrays = build_quantised(tmp_path / fmt, fmt)
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
    arrays = build_quantised(tmp_path / "mx", "mxfp4")
    plan = plan_checkpoint(tmp_path / "mx")
    stored, mx_bf16 = plan["pricings"][0], next(p for p in plan["pricings"] if p["name"] == "experts MXFP4 / rest BF16")
    assert mx_bf16["bytes"]["routed_experts"] == stored["bytes"]["routed_experts"] == sum(
        a.nbytes for n, a in arrays.items() if ".experts." in n)

    arrays = build_quantised(tmp_path / "fp8", "fp8_block")
    plan = plan_checkpoint(tmp_path / "fp8")
    bf16 = next(p for p in plan["pricings"] if p["name"] == "experts BF16 / rest BF16")
    routed_values = sum(a.size for n, a in arrays.items() if ".experts." in n and n.endswith(".weight"))
    assert bf16["bytes"]["routed_experts"] == 2 * routed_values
    fp8 = next(p for p in plan["pricings"] if p["name"] == "experts FP8 / rest BF16")
    assert fp8["bytes"]["routed_experts"] == sum(a.nbytes for n, a in arrays.items() if ".experts." in n)


def test_packed_tensor_of_the_wrong_dtype_is_named(tmp_path):
    name = "model.layers.1.mlp.experts.0.up_proj.weight_packed"
    tensors = [("model.layers.1.mlp.gate.weight", np.zeros((1, 8), np.float32)),
               (name, np.zeros((4, 4), np.uint8))]
    write_checkpoint(tmp_path / "c", tensors, {"num_hidden_layers": 2, "num_experts_per_tok": 1,
                                               "quantization_config": QUANT_CONFIGS["int4_pack"]})
    with pytest.raises(CheckpointError, match=rf"{name}.*dtype U8, expected I32 for int4_pack"):
        inspect_checkpoint(tmp_path / "c")


def test_missing_config_key_names_the_file(tmp_path):
    write_checkpoint(tmp_path / "c", [("model.norm.weight", np.zeros(4, np.float32))], {"hidden_size": 4})
    with pytest.raises(CheckpointError, match=r"config\.json: 'num_hidden_layers' must be a positive integer"):
        inspect_checkpoint(tmp_path / "c")


# --------------------------------------------------------------------------------------------
# plan on sparse header-only checkpoints
# --------------------------------------------------------------------------------------------

BIG_HIDDEN, BIG_INTER = 65536, 32768


def write_sparse_checkpoint(path, tensors, config):
    """A one-shard checkpoint whose data buffer is a hole: the header is real, the bytes zeros the
    file system never stores. `tensors` maps name -> (dtype code, shape)."""
    bits = {"BF16": 16, "F32": 32}
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


def big_moe(path, experts=16, heads=128):
    """One MoE layer of `experts` BF16 experts of 3 x 2**31 values each (12.9 GB per expert)."""
    tensors = {"model.embed_tokens.weight": ("BF16", (1024, BIG_HIDDEN)),
               "model.layers.0.input_layernorm.weight": ("BF16", (BIG_HIDDEN,)),
               "model.layers.0.mlp.gate.weight": ("BF16", (experts, BIG_HIDDEN))}
    for e in range(experts):
        stem = f"model.layers.0.mlp.experts.{e}."
        tensors[stem + "gate_proj.weight"] = ("BF16", (BIG_INTER, BIG_HIDDEN))
        tensors[stem + "up_proj.weight"] = ("BF16", (BIG_INTER, BIG_HIDDEN))
        tensors[stem + "down_proj.weight"] = ("BF16", (BIG_HIDDEN, BIG_INTER))
    config = {"num_hidden_layers": 1, "num_attention_heads": heads, "n_routed_experts": experts,
              "num_experts_per_tok": 2, "hidden_size": BIG_HIDDEN}
    return write_sparse_checkpoint(path, tensors, config)


def pricing(plan, name):
    return next(p for p in plan["pricings"] if p["name"] == name)


def test_plan_hand_computed(tmp_path, no_tensor_data):
    total = big_moe(tmp_path / "big")
    plan = plan_checkpoint(tmp_path / "big")
    expert_matrix = BIG_INTER * BIG_HIDDEN  # 2**31 values
    embed, norm, router = 1024 * BIG_HIDDEN, BIG_HIDDEN, 16 * BIG_HIDDEN
    assert total == 2 * (16 * 3 * expert_matrix + embed + norm + router) == 206_294_876_160

    stored = pricing(plan, "as stored")
    assert stored["bytes"] == {"routed_experts": 16 * 3 * 2 * expert_matrix,
                               "other": 2 * (embed + norm + router), "total": total}
    # 206.29 GB: H100 0.9*80 = 72 -> 4 (51.6 each); H200 126.9 -> 2; B200 162 -> 2; B300 259.2 -> 1;
    # TPU v5p 85.5 -> 4
    assert stored["devices"] == {"H100": 4, "H200": 2, "B200": 2, "B300": 1, "TPU v5p": 4}
    assert pricing(plan, "experts BF16 / rest BF16")["bytes"] == stored["bytes"]

    # FP8: one byte per value plus a 4-byte scale per 128x128 block; the norm keeps its 2 bytes
    fp8_matrix = expert_matrix + 4 * (BIG_INTER // 128) * (BIG_HIDDEN // 128)
    fp8_rest = (embed + 4 * 8 * 512) + (router + 4 * 1 * 512) + 2 * norm
    fp8 = pricing(plan, "experts FP8 / rest FP8")
    assert fp8["bytes"] == {"routed_experts": 16 * 3 * fp8_matrix, "other": fp8_rest,
                            "total": 16 * 3 * fp8_matrix + fp8_rest} and fp8["bytes"]["total"] == 103_172_687_872
    assert fp8["devices"] == {"H100": 2, "H200": 1, "B200": 1, "B300": 1, "TPU v5p": 2}

    # MXFP4: half a byte per value plus one E8M0 byte per 32 values of a row
    mx_matrix = BIG_INTER * (BIG_HIDDEN // 2 + BIG_HIDDEN // 32)
    mx = pricing(plan, "experts MXFP4 / rest BF16")
    assert mx["bytes"]["routed_experts"] == 16 * 3 * mx_matrix == 54_760_833_024
    assert mx["bytes"]["other"] == stored["bytes"]["other"]
    assert set(mx["devices"].values()) == {1}
    assert plan["constraints"] == {"routed_experts": [16], "num_attention_heads": 128, "max_devices": 1024}
    assert plan["units"] == "GB = 1e9 bytes" and plan["headroom"] == 0.9
    text = format_plan(plan)
    assert "GB = 1e9 bytes" in text and "weights only" in text and "206.29 GB" in text


def test_plan_divisibility_bites(tmp_path):
    big_moe(tmp_path / "two_heads", heads=2)
    devices = pricing(plan_checkpoint(tmp_path / "two_heads"), "as stored")["devices"]
    assert devices == {"H100": None, "H200": 2, "B200": 2, "B300": 1, "TPU v5p": None}  # 4 does not divide 2

    big_moe(tmp_path / "twelve", experts=12)  # 154.75 GB
    plan = plan_checkpoint(tmp_path / "twelve", extra_gpus={"small": 30, "H100": 40})
    devices = pricing(plan, "as stored")["devices"]
    # small: 0.9*30 = 27 GB needs 8 (19.3 each), which does not divide 12 experts; H100 overridden
    # to 40 GB: 36 GB needs 8 too; H200 126.9 -> 2
    assert devices["small"] is None and devices["H100"] is None and devices["H200"] == 2
    assert plan["accelerators"]["H100"] == 40 and plan["accelerators"]["small"] == 30
    assert "no fit" in format_plan(plan)
    assert pricing(plan, "experts FP8 / rest BF16")["devices"]["small"] == 4  # 77.4 GB / 4 = 19.4


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
    build_quantised(path, "mxfp4")
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
    register_cli(parser.add_subparsers(dest="command", required=True))
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
    code = "import sys, moejax.hf.inspect; print(sorted(m for m in ('jax', 'torch', 'flax') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"

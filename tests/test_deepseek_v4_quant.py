"""DeepSeek-V4's quantised checkpoints as the Hub ships them (`quantization_config` quant_method "fp8",
`expert_dtype` at config.json's top level, every quantised Linear `<x>.weight` beside `<x>.scale`):

* V4-Flash / V4-Pro: routed experts FP4 e2m1 packed two per I8 byte (low nibble first) with an
  F8_E8M0 scale per row and 32 inputs; attention and shared-expert Linears FP8 e4m3 with an F8_E8M0
  scale per 128x128 block;
* V4-Flash-Base (`expert_dtype` "fp8"): routed experts FP8 as well, scales F32.

On a tiny random checkpoint transformers writes and this file quantises into that layout: every
decoded weight equals transformers 5.24's own dequantisation (its FP8 quantiser, which on a
machine without a GPU dequantises at load) and an independent element-by-element decoder written
here from the format's definition; the logits equal transformers'; load-then-save gives back
every tensor's bytes; the one checkpoint check refuses a malformed scale or weight, naming file and
tensor."""

import json
import re

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from family_fixtures import make_family_checkpoint  # noqa: E402
from hf_fixtures import padded_logits_equal, rewrite  # noqa: E402

from moejax import AutoModelForCausalLM, save_pretrained  # noqa: E402
from moejax.errors import CheckpointError  # noqa: E402
from moejax.hf.check import check_checkpoint  # noqa: E402
from moejax.hf.io.checkpoint_reader import CheckpointReader  # noqa: E402
from moejax.hf.mapping import get_path, tensor_specs  # noqa: E402
from moejax.hf.quant import decode, encode  # noqa: E402

EXPERT = re.compile(r"\.ffn\.experts\.\d+\.w[123]\.weight$")
FP8 = re.compile(r"(\.attn\.(wq_a|wq_b|wkv|wo_b)|\.attn\.indexer\.wq_b|\.ffn\.shared_experts\.w[123])\.weight$")
QCFG = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128], "scale_fmt": "ue8m0"}
E2M1 = {0: 0.0, 1: 0.5, 2: 1.0, 3: 1.5, 4: 2.0, 5: 3.0, 6: 4.0, 7: 6.0}


def v4_quantise(expert_dtype: str):
    """A `rewrite` transform into the release's layout: routed experts FP4 (expert_dtype "fp4") or FP8
    with F32 scales ("fp8", as V4-Flash-Base); attention and shared experts FP8 with E8M0 scales."""
    def transform(name, reader):
        w, stem = reader.read(name), name[: -len("weight")]
        if EXPERT.search(name) and expert_dtype == "fp4":
            q, s = encode.quantize_deepseek_v4_fp4(w)
        elif EXPERT.search(name):
            q, s = encode.quantize_deepseek_v4_fp8(w)
            s = s.astype(np.float32)
        elif FP8.search(name):
            q, s = encode.quantize_deepseek_v4_fp8(w)
        else:
            return [(name, w)]
        return [(name, q), (stem + "scale", s)]
    return transform


def reference_decode(weight: np.ndarray, scale: np.ndarray, block=(128, 128)) -> np.ndarray:
    """The format from its definition, one element at a time (not moejax's vectorised decoder): an
    E8M0 byte e is 2**(e - 127); FP4: input column j of row i is nibble j % 2 (0: bits 0-3, 1: bits
    4-7) of byte j // 2, bit 3 the sign, bits 0-2 the e2m1 magnitude, times scale[i, j // 32]; FP8:
    the e4m3 value times scale[i // 128, j // 128]."""
    s = (np.ldexp(1.0, scale.view(np.uint8).astype(np.int64) - 127) if scale.dtype == ml_dtypes.float8_e8m0fnu
         else scale.astype(np.float64))
    if weight.dtype == np.int8:
        raw = weight.view(np.uint8)
        out = np.empty((raw.shape[0], 2 * raw.shape[1]))
        for i in range(out.shape[0]):
            for j in range(out.shape[1]):
                code = (int(raw[i, j // 2]) >> (4 * (j % 2))) & 0xF
                out[i, j] = (-1.0 if code & 8 else 1.0) * E2M1[code & 7] * s[i, j // 32]
        return out
    return weight.astype(np.float64) * np.repeat(np.repeat(s, block[0], 0), block[1], 1)[: weight.shape[0], : weight.shape[1]]


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    path = tmp_path_factory.mktemp("v4q") / "dense"
    make_family_checkpoint("deepseek_v4", path, seed=40, moe_intermediate_size=32)  # FP4 groups of 32 inputs
    return path


@pytest.fixture(scope="module", params=["fp4", "fp8"])
def quantised(request, dense):
    expert_dtype = request.param
    path = rewrite(dense, dense.parent / expert_dtype, v4_quantise(expert_dtype),
                   {"quantization_config": QCFG, "expert_dtype": expert_dtype})
    return expert_dtype, path, AutoModelForCausalLM.from_pretrained(path, dtype=jnp.float32)


def transformers_dequantised(path):
    """transformers' own reading: its FP8 quantiser on a machine without a GPU dequantises every
    `.weight` / `.scale` pair (FP4 too) at load, to float32 here; nothing missing or left over."""
    import transformers

    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager",
        output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return hf.eval()


def test_the_checkpoint_is_in_the_released_layout(quantised):
    expert_dtype, path, _ = quantised
    r = CheckpointReader(path)
    w, s = r.info("layers.2.ffn.experts.3.w2.weight"), r.info("layers.2.ffn.experts.3.w2.scale")
    if expert_dtype == "fp4":   # w2 [hidden 32, moe_intermediate 32]: 16 bytes, one scale per 32
        assert (w.dtype, list(w.shape), s.dtype, list(s.shape)) == ("I8", [32, 16], "F8_E8M0", [32, 1])
    else:
        assert (w.dtype, list(w.shape), s.dtype, list(s.shape)) == ("F8_E4M3", [32, 32], "F32", [1, 1])
    assert (r.info("layers.1.attn.wq_a.weight").dtype, r.info("layers.1.attn.wq_a.scale").dtype) == ("F8_E4M3", "F8_E8M0")
    assert r.info("layers.1.attn.wo_a.weight").dtype == "F32"   # left dense, as the release leaves wo_a
    assert check_checkpoint(path).fmt == "deepseek_v4_fp8"


def test_every_decoded_weight_equals_the_definition_and_transformers(quantised):
    expert_dtype, path, model = quantised
    r = CheckpointReader(path)
    specs = [s for s in tensor_specs(model.config) if s.hf_name[: -len("weight")] + "scale" in r.keys()]
    assert len(specs) > 100 and any(s.expert is not None for s in specs) and any(s.expert is None for s in specs)
    for s in specs:
        value = np.asarray(get_path(model, s.param)[...])
        value = value if s.expert is None else value[s.expert]
        want = reference_decode(r.read(s.hf_name), r.read(s.hf_name[: -len("weight")] + "scale"))
        np.testing.assert_array_equal(value.T if s.transpose else value, want.astype(np.float32), err_msg=s.hf_name)
    hf = transformers_dequantised(path)
    for l, layer in enumerate(model.model.layers):
        ex, mlp = hf.model.layers[l].mlp.experts, layer.mlp
        gate_up = np.concatenate([np.asarray(mlp.experts_gate[...]), np.asarray(mlp.experts_up[...])], axis=2)
        np.testing.assert_array_equal(gate_up.transpose(0, 2, 1), ex.gate_up_proj.detach().numpy())
        np.testing.assert_array_equal(np.asarray(mlp.experts_down[...]).transpose(0, 2, 1), ex.down_proj.detach().numpy())
        np.testing.assert_array_equal(np.asarray(layer.self_attn.q_a_proj[...]).T,
                                      hf.model.layers[l].self_attn.q_a_proj.weight.detach().numpy())
    assert np.abs(padded_logits_equal(model, hf, 96, seed=41)).max() > 0.5


def test_the_quantised_weights_differ_from_the_dense_ones(quantised, dense):
    """The comparisons above are of quantised values: decoding is not a copy of the dense weights."""
    _, _, model = quantised
    original = AutoModelForCausalLM.from_pretrained(dense, dtype=jnp.float32)
    got, was = (np.asarray(m.model.layers[2].mlp.experts_down[...]) for m in (model, original))
    assert not np.array_equal(got, was) and np.abs(got - was).max() < 0.5 * np.abs(was).max()


def test_load_then_save_gives_back_every_tensors_bytes(quantised, tmp_path):
    _, path, model = quantised
    out = save_pretrained(model, tmp_path / "saved")
    a, b = CheckpointReader(path), CheckpointReader(out)
    assert a.keys() == b.keys() and any(n.endswith(".scale") for n in a.keys())
    for name in a.keys():
        assert (a.info(name).dtype, a.info(name).shape) == (b.info(name).dtype, b.info(name).shape), name
        assert a.read_bytes(name) == b.read_bytes(name), name
    assert json.loads((out / "config.json").read_text()) == json.loads((path / "config.json").read_text())


def _with(src, dst, name, value):
    return rewrite(src, dst, lambda n, r: [(n, value if n == name else r.read(n))])


@pytest.mark.parametrize("case", ["scale_shape", "scale_dtype", "weight_dtype", "weight_shape", "no_scale"])
def test_the_one_check_refuses_a_malformed_tensor_naming_file_and_tensor(quantised, tmp_path, case):
    expert_dtype, path, _ = quantised
    if expert_dtype != "fp4":
        pytest.skip("the FP4 layout's refusals")
    r = CheckpointReader(path)
    w, s = "layers.2.ffn.experts.5.w1.weight", "layers.2.ffn.experts.5.w1.scale"   # [32, 32] -> I8 [32, 16]
    bad = tmp_path / case
    if case == "scale_shape":
        _with(path, bad, s, r.read(s)[:16])
        match = r"layers\.2\.ffn\.experts\.5\.w1\.scale in model\.safetensors: shape \[16, 1\], expected \[32, 1\]"
    elif case == "scale_dtype":
        _with(path, bad, s, r.read(s).astype(ml_dtypes.bfloat16))
        match = r"layers\.2\.ffn\.experts\.5\.w1\.scale in model\.safetensors: dtype BF16, expected F8_E8M0 or F32"
    elif case == "weight_dtype":
        _with(path, bad, w, r.read(w).view(np.uint8))
        match = r"layers\.2\.ffn\.experts\.5\.w1\.weight in model\.safetensors: dtype U8, expected I8 for an FP4 routed"
    elif case == "weight_shape":
        _with(path, bad, w, r.read(w)[:, :8])
        match = r"layers\.2\.ffn\.experts\.5\.w1\.weight in model\.safetensors: shape \[32, 8\], expected \[32, 16\]"
    else:
        rewrite(path, bad, lambda n, rd: [] if n == s else [(n, rd.read(n))])
        match = r"layers\.2\.ffn\.experts\.5\.w1\.weight in model\.safetensors: quantised weight \(I8\) without its scale"
    with pytest.raises(CheckpointError, match=match):
        check_checkpoint(bad)
    with pytest.raises(CheckpointError, match=match):
        AutoModelForCausalLM.from_pretrained(bad)


def test_an_fp8_linear_where_fp4_belongs_and_fp4_outside_the_experts_are_refused(quantised, tmp_path):
    expert_dtype, path, _ = quantised
    if expert_dtype != "fp4":
        pytest.skip("the FP4 layout's refusals")
    r = CheckpointReader(path)
    q, s = encode.quantize_deepseek_v4_fp4(decode.dequant_deepseek_v4(
        r.read("layers.1.attn.wq_a.weight"), r.read("layers.1.attn.wq_a.scale"), name="layers.1.attn.wq_a.weight"))
    bad = rewrite(path, tmp_path / "fp4_attn", lambda n, rd: [(n, q if n == "layers.1.attn.wq_a.weight" else
                                                                 s if n == "layers.1.attn.wq_a.scale" else rd.read(n))])
    with pytest.raises(CheckpointError, match=r"layers\.1\.attn\.wq_a\.weight in model\.safetensors: dtype I8, "
                                              r"expected F8_E4M3 for an FP8 Linear"):
        check_checkpoint(bad)


def test_config_detection():
    assert decode.detect_format({**QCFG, "expert_dtype": "fp4"}) == "deepseek_v4_fp8"
    assert decode.detect_format(QCFG) == "fp8_block"   # DeepSeek-V3's (weight_scale_inv names)
    with pytest.raises(CheckpointError, match="expert_dtype 'int4'"):
        decode.detect_format({**QCFG, "expert_dtype": "int4"})
    with pytest.raises(CheckpointError, match="scale_fmt 'e5m2'"):
        decode.detect_format({**QCFG, "expert_dtype": "fp8", "scale_fmt": "e5m2"})


def test_decoder_hand_bytes_low_nibble_first_and_e8m0_scales():
    # byte 0x72: column 0 = code 2 (1.0), column 1 = code 7 (6.0); byte 0x9F: column 2 = code 15
    # (-6.0), column 3 = code 9 (-0.5); the rest zeros. Scales 2**(126-127) and 2**(130-127).
    weight = np.zeros((2, 16), np.uint8)
    weight[0, :2] = [0x72, 0x9F]
    weight[1, 0] = 0x10
    scale = np.array([[126], [130]], np.uint8).view(ml_dtypes.float8_e8m0fnu)
    w = decode.dequant_deepseek_v4(weight.view(np.int8), scale, name="x.weight")
    np.testing.assert_array_equal(w[0, :4], [0.5, 3.0, -3.0, -0.25])
    assert w[1, 0] == 0.0 and w[1, 1] == 4.0 and not w[0, 4:].any()
    with pytest.raises(CheckpointError, match=r"x\.scale: shape \(2, 2\) does not fit FP4 x\.weight"):
        decode.dequant_deepseek_v4(weight.view(np.int8), np.concatenate([scale, scale], 1), name="x.weight")
    with pytest.raises(CheckpointError, match=r"x\.scale: expected dtype"):
        decode.dequant_deepseek_v4(weight.view(np.int8), scale.view(np.uint8), name="x.weight")

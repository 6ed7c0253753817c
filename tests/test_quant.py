"""moejax.hf.quant.decode (decoders) and moejax.hf.quant.encode (encoders): hand-computed decodes of each
quantised layout, encoder -> decoder round trips, shape checks, config detection, and (when
compressed-tensors is installed) its own pack/unpack functions as an independent reference."""

import ml_dtypes
import numpy as np
import pytest

from moejax.errors import CheckpointError
from moejax.hf.quant.decode import (
    QUANT_FORMATS,
    companion_tensor_names,
    dequant_fp8_block,
    dequant_mxfp4,
    detect_format,
    unpack_int4,
)
from moejax.hf.quant.encode import pack_int4, quantize_fp8_block, quantize_mxfp4

E4M3 = ml_dtypes.float8_e4m3fn
BF16 = ml_dtypes.bfloat16


def int32_words(*words):
    """Hex words as written (bit 31 may be set) -> int32, as they sit in a safetensors I32 tensor."""
    return np.array(words, dtype=np.uint32).view(np.int32)


# --------------------------------------------------------------------------------------------
# FP8 block
# --------------------------------------------------------------------------------------------


def test_fp8_each_element_takes_its_blocks_scale_including_partial_edge_blocks():
    # 130x200 with 128x128 blocks: a 2x2 scale grid whose bottom row (2 rows) and right column
    # (72 columns) are partial blocks.
    weight = np.full((130, 200), 1.5, dtype=E4M3)
    weight[129, 199] = -0.3125  # 1.25 * 2**-2, exact in e4m3
    scale_inv = np.array([[2.0, 0.5], [4.0, 0.25]], dtype=np.float32)

    w = dequant_fp8_block(weight, scale_inv)

    assert w.dtype == np.float32 and w.shape == (130, 200)
    assert w[0, 0] == 3.0 and w[127, 127] == 3.0  # top-left block, x2
    assert w[0, 128] == 0.75 and w[127, 199] == 0.75  # top-right (partial) block, x0.5
    assert w[128, 0] == 6.0 and w[129, 127] == 6.0  # bottom-left (partial) block, x4
    assert w[128, 128] == 0.375  # bottom-right (partial both ways), x0.25
    assert w[129, 199] == -0.078125
    assert np.all(w[:128, :128] == 3.0) and np.all(w[:128, 128:] == 0.75)
    assert np.all(w[128:, :128] == 6.0)


def test_fp8_custom_block_shape():
    weight = np.array([[1, 2, 3], [4, 5, 6], [0.5, -1, 448]], dtype=E4M3)
    scale_inv = np.array([[1.0, 10.0], [0.5, 2.0]], dtype=np.float32)  # blocks of 2x2
    expected = np.array([[1, 2, 30], [4, 5, 60], [0.25, -0.5, 896]], dtype=np.float32)
    np.testing.assert_array_equal(dequant_fp8_block(weight, scale_inv, block=(2, 2)), expected)


def test_fp8_scale_shape_mismatch_names_both_shapes():
    weight = np.zeros((130, 200), dtype=E4M3)
    with pytest.raises(CheckpointError) as err:
        dequant_fp8_block(weight, np.ones((1, 2), np.float32), name="model.layers.3.mlp.up_proj.weight")
    message = str(err.value)
    assert "model.layers.3.mlp.up_proj.weight_scale_inv" in message
    assert "(1, 2)" in message and "(130, 200)" in message and "(2, 2)" in message


def test_fp8_refuses_a_weight_that_is_not_e4m3():
    with pytest.raises(CheckpointError, match="float8_e4m3fn"):
        dequant_fp8_block(np.zeros((4, 4), np.float32), np.ones((1, 1), np.float32))


def test_fp8_round_trip_within_e4m3_precision():
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((130, 200)) * np.array([0.02, 3.0]).repeat([100, 100])).astype(np.float32)

    weight, scale_inv = quantize_fp8_block(w)

    assert weight.dtype == E4M3 and scale_inv.dtype == np.float32 and scale_inv.shape == (2, 2)
    amax = np.array([[np.abs(w[r:r + 128, c:c + 128]).max() for c in (0, 128)] for r in (0, 128)])
    np.testing.assert_allclose(scale_inv, amax / 448, rtol=1e-6)
    decoded = dequant_fp8_block(weight, scale_inv)
    # e4m3 keeps 3 fraction bits: half an ulp is 2**-4 relative for normals, and 2**-10 absolute
    # (in units of the block's scale) for subnormals below 2**-6.
    block_scale = np.repeat(np.repeat(scale_inv, 128, 0), 128, 1)[:130, :200]
    bound = np.maximum(np.abs(w) * 2.0**-4, block_scale * 2.0**-10)
    assert np.all(np.abs(decoded - w) <= bound * (1 + 1e-6))
    # Each block's largest magnitude lands on +-448.
    assert np.abs(weight.astype(np.float32)).max() == 448


def test_fp8_exact_for_values_on_the_grid():
    rng = np.random.default_rng(1)
    e4m3_values = np.unique(np.arange(256, dtype=np.uint8).view(E4M3).astype(np.float32))
    e4m3_values = e4m3_values[np.isfinite(e4m3_values)]
    codes = rng.choice(e4m3_values, size=(130, 200)).astype(np.float32)
    block_scales = np.array([[2.0**-7, 2.0**3], [0.5, 2.0**-12]], dtype=np.float32)
    for r, c in np.ndindex(2, 2):  # each block holds a 448 so that amax / 448 is its scale
        codes[r * 128, c * 128] = 448
    w = codes * np.repeat(np.repeat(block_scales, 128, 0), 128, 1)[:130, :200]

    weight, scale_inv = quantize_fp8_block(w)

    np.testing.assert_array_equal(scale_inv, block_scales)
    np.testing.assert_array_equal(dequant_fp8_block(weight, scale_inv), w)


def test_fp8_all_zero_block_gets_unit_scale_and_decodes_to_zero():
    weight, scale_inv = quantize_fp8_block(np.zeros((3, 5), np.float32))
    np.testing.assert_array_equal(scale_inv, [[1.0]])
    np.testing.assert_array_equal(dequant_fp8_block(weight, scale_inv), np.zeros((3, 5)))


# --------------------------------------------------------------------------------------------
# INT4 pack-quantized
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape_dtype", [np.int32, np.int64])  # Kimi-K2.5 stores I32, the writer I64
def test_int4_hand_packed_words(shape_dtype):
    # Element 8j + k is nibble k (bits 4k..4k+3) of word j; the nibble stores q + 8.
    packed = np.stack([
        int32_words(0x76543210, 0xFEDCBA98),  # codes 0..15 -> q = -8..7
        int32_words(0x8888888F, 0x08888888),  # q = 7 first, -8 last, 0 between
    ])
    assert packed[0, 1] == -19088744 and packed[1, 0] == -2004318065  # sign bit set: logical shift
    scale = np.array([[0.5, 2.0], [1.0, 0.25]], dtype=BF16)  # group_size 8: two groups per row

    w = unpack_int4(packed, scale, np.array([2, 16], dtype=shape_dtype), group_size=8)

    row0 = np.concatenate([np.arange(-8, 0) * 0.5, np.arange(0, 8) * 2.0])
    row1 = np.array([7.0] + [0.0] * 14 + [-8 * 0.25])
    assert w.dtype == np.float32
    np.testing.assert_array_equal(w, np.stack([row0, row1]))


def test_int4_last_word_padding_and_partial_groups():
    # 12 columns: the second word holds 4 values and 4 padding nibbles, groups of 4.
    packed = int32_words(0xBA987654, 0x0000FEDC)[None, :]  # codes 4..15 -> q = -4..7
    scale = np.array([[1.0, 2.0, 0.5]], dtype=np.float32)
    w = unpack_int4(packed, scale, [1, 12], group_size=4)
    np.testing.assert_array_equal(w[0], [-4, -3, -2, -1, 0, 2, 4, 6, 2, 2.5, 3, 3.5])


def test_int4_asymmetric_zero_point_packed_along_rows():
    packed = np.stack([int32_words(0xBBBBBBBB), int32_words(0xBBBBBBBB)])  # q = 3 everywhere
    # zero points [[1], [-2]] stored as 9 and 6, row r at nibble r of the column's word
    zero_point = int32_words(0x69)[None, :]
    scale = np.array([[1.0], [0.5]], dtype=np.float32)
    w = unpack_int4(packed, scale, [2, 8], group_size=8, weight_zero_point=zero_point)
    np.testing.assert_array_equal(w, [[2.0] * 8, [2.5] * 8])  # (3 - 1) * 1, (3 + 2) * 0.5


def reference_pack_int4(q: np.ndarray) -> np.ndarray:
    """An independent, loop-by-loop packer of q in [-8, 7] following the documented layout."""
    rows, cols = q.shape
    out = np.zeros((rows, -(-cols // 8)), dtype=np.int64)
    for r in range(rows):
        for c in range(cols):
            out[r, c // 8] |= (int(q[r, c]) + 8) << (4 * (c % 8))
    return np.where(out >= 2**31, out - 2**32, out).astype(np.int32)


def test_int4_matches_an_independent_loop_packer():
    rng = np.random.default_rng(2)
    q = rng.integers(-8, 8, size=(5, 44))
    scale = rng.choice([0.25, 0.5, 1.0, 3.0], size=(5, 11)).astype(BF16)
    w = unpack_int4(reference_pack_int4(q), scale, [5, 44], group_size=4)
    np.testing.assert_array_equal(w, q * np.repeat(scale.astype(np.float32), 4, axis=1))

    # and the encoder's words are the loop packer's words for the q it chose
    packed, scale, shape = pack_int4(rng.standard_normal((5, 44)).astype(np.float32), 4)
    chosen_q = unpack_int4(packed, scale, shape, 4) / np.repeat(scale.astype(np.float32), 4, axis=1)
    np.testing.assert_array_equal(packed, reference_pack_int4(np.rint(chosen_q).astype(np.int64)))


@pytest.mark.parametrize(
    "scale_dtype, unit_roundoff", [(BF16, 2.0**-8), (np.float16, 2.0**-11), (np.float32, 2.0**-24)]
)
def test_int4_round_trip_within_half_a_step(scale_dtype, unit_roundoff):
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((6, 70)) * 0.05).astype(np.float32)  # 70: partial last word and group
    w[2, 32:64] = 0.0  # an all-zero group

    packed, scale, shape = pack_int4(w, group_size=32, scale_dtype=scale_dtype)

    assert packed.dtype == np.int32 and packed.shape == (6, 9)
    assert scale.dtype == np.dtype(scale_dtype) and scale.shape == (6, 3)
    np.testing.assert_array_equal(shape, [6, 70])
    decoded = unpack_int4(packed, scale, shape, group_size=32)
    step = np.repeat(scale.astype(np.float32), 32, axis=1)[:, :70]
    # Half a step; the group maximum sits at 7.5 steps and is stored as 7 (7.5 rounds to even 8,
    # clipped), so it can miss by half a step plus 7.5 times the scale's rounding into its dtype.
    assert np.all(np.abs(decoded - w) <= (0.5 + 7.5 * unit_roundoff) * step)
    assert np.all(decoded[2, 32:64] == 0)
    # the scale is amax / 7.5, as compressed-tensors' symmetric observer makes it
    amax = np.abs(w[0, :32]).max()
    assert scale[0, 0] == np.asarray(amax / np.float32(7.5)).astype(scale_dtype)


def test_int4_packed_shape_mismatch_names_both_shapes():
    with pytest.raises(CheckpointError) as err:
        unpack_int4(np.zeros((2, 3), np.int32), np.ones((2, 2), np.float32), [2, 16], 8, name="x.weight")
    message = str(err.value)
    assert "x.weight_packed" in message and "(2, 3)" in message and "(2, 16)" in message


def test_int4_scale_shape_mismatch_names_both_shapes():
    with pytest.raises(CheckpointError) as err:
        unpack_int4(np.zeros((2, 2), np.int32), np.ones((2, 1), BF16), [2, 16], 8)
    message = str(err.value)
    assert "weight_scale" in message and "(2, 1)" in message and "(2, 16)" in message and "(2, 2)" in message


def test_int4_refuses_bad_weight_shape_and_dtypes():
    with pytest.raises(CheckpointError, match="weight_shape"):
        unpack_int4(np.zeros((2, 2), np.int32), np.ones((2, 2), np.float32), [2, 16, 1], 8)
    with pytest.raises(CheckpointError, match="int32"):
        unpack_int4(np.zeros((2, 2), np.int64), np.ones((2, 2), np.float32), [2, 16], 8)
    with pytest.raises(CheckpointError, match="weight_zero_point"):
        unpack_int4(np.zeros((2, 2), np.int32), np.ones((2, 2), np.float32), [2, 16], 8,
                    weight_zero_point=np.zeros((2, 2), np.int32))


# --------------------------------------------------------------------------------------------
# MXFP4
# --------------------------------------------------------------------------------------------


def test_mxfp4_hand_bytes_low_nibble_first():
    # 0x2F: low nibble 0xF = -6 is element 0, high nibble 0x2 = 1.0 is element 1.
    # 0x9B: 0xB = -1.5, 0x9 = -0.5.   0x70: 0x0 = 0, 0x7 = 6.   0x08: 0x8 = -0, 0x0 = 0.
    first_group = [0x2F, 0x9B, 0x70, 0x08] + [0] * 12
    second_group = [0x11] * 16  # every value 0.5
    packed = np.array([first_group + second_group] * 2, dtype=np.uint8)
    scale = np.array([[127, 130], [129, 125]], dtype=np.uint8)  # 1, 8 | 4, 0.25

    w = dequant_mxfp4(packed, scale)

    assert w.dtype == np.float32 and w.shape == (2, 64)
    head = [-6.0, 1.0, -1.5, -0.5, 0.0, 6.0, 0.0, 0.0]
    np.testing.assert_array_equal(w[0, :8], head)
    np.testing.assert_array_equal(w[1, :8], np.array(head) * 4)
    assert np.signbit(w[0, 6])  # code 8 is negative zero
    assert np.all(w[0, 8:32] == 0) and np.all(w[0, 32:] == 4.0) and np.all(w[1, 32:] == 0.125)


def test_mxfp4_every_code():
    codes = np.arange(16, dtype=np.uint8)
    packed = (codes | ((15 - codes) << 4)).astype(np.uint8)[None, :]  # low nibble: 0..15
    w = dequant_mxfp4(packed, np.array([[127]], dtype=np.uint8))
    e2m1 = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    np.testing.assert_array_equal(w[0, 0::2], e2m1)
    np.testing.assert_array_equal(w[0, 1::2], e2m1[::-1])


def test_mxfp4_e8m0_extremes():
    packed = np.full((3, 16), 0x22, dtype=np.uint8)  # every value 1.0
    w = dequant_mxfp4(packed, np.array([[0], [254], [255]], dtype=np.uint8))
    assert np.all(w[0] == np.float32(2.0**-127)) and np.all(w[1] == np.float32(2.0**127))
    assert np.all(np.isnan(w[2]))  # 255 is NaN in E8M0


def test_mxfp4_encoder_scale_rounding_and_ties():
    w = np.zeros((1, 128), dtype=np.float32)
    # group 0: amax 6 -> power of two 4 -> exponent 127 (scale 1); ties round to even codes
    w[0, :12] = [6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -5.0, -0.0, 0.0]
    w[0, 32] = 1.74  # group 1: 1.74 rounds down to 1 -> scale 2**-2 -> 6.96 clipped to 6 -> 1.5
    w[0, 64] = 1.75  # group 2: 1.75 rounds up to 2 -> scale 2**-1 -> 3.5 -> ties to 4 -> 2.0
    # group 3 stays all zero -> exponent 0

    packed, scale = quantize_mxfp4(w)

    np.testing.assert_array_equal(scale, [[127, 125, 126, 0]])
    decoded = dequant_mxfp4(packed, scale)
    np.testing.assert_array_equal(decoded[0, :10], [6, 0, 1, 1, 2, 2, 4, 4, -0.0, -4])
    assert decoded[0, 32] == 1.5 and decoded[0, 64] == 2.0
    assert np.all(decoded[0, 96:] == 0) and not np.any(np.signbit(decoded[0, 96:]))
    assert packed[0, 0] == 0x07 | (0x00 << 4)  # 6 -> code 7 (low), 0.25 -> code 0 (high)
    assert packed[0, 4] == 0x08 | (0x0E << 4)  # -0.25 -> -0 (code 8), -5 -> -4 (code 14)
    assert packed[0, 5] == 0x00  # an exact -0.0 gets code 0, as compressed-tensors' sign() gives it


def test_mxfp4_exact_for_values_on_the_grid():
    rng = np.random.default_rng(4)
    e2m1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)
    values = rng.choice(e2m1, size=(8, 96))
    powers = 2.0 ** rng.integers(-20, 20, size=(8, 3))  # one power of two per group of 32
    w = (values * np.repeat(powers, 32, axis=1)).astype(np.float32)

    packed, scale = quantize_mxfp4(w)

    assert packed.dtype == np.uint8 and packed.shape == (8, 48)
    assert scale.dtype == np.uint8 and scale.shape == (8, 3)
    np.testing.assert_array_equal(dequant_mxfp4(packed, scale), w)


def test_mxfp4_round_trip_within_one_step():
    rng = np.random.default_rng(5)
    w = (rng.standard_normal((16, 128)) * 0.03).astype(np.float32)
    packed, scale = quantize_mxfp4(w)
    step = np.repeat(2.0 ** (scale.astype(np.float64) - 127), 32, axis=1)
    # within a group the widest e2m1 gap is 4..6, so at most one step; the same bounds the clip
    assert np.all(np.abs(dequant_mxfp4(packed, scale) - w) <= step)


def test_mxfp4_scale_shape_mismatch_names_both_shapes():
    with pytest.raises(CheckpointError) as err:
        dequant_mxfp4(np.zeros((2, 32), np.uint8), np.zeros((2, 1), np.uint8), name="e.down_proj.weight")
    message = str(err.value)
    assert "e.down_proj.weight_scale" in message and "(2, 1)" in message and "(2, 32)" in message


def test_mxfp4_refuses_wrong_dtypes_and_odd_width():
    with pytest.raises(CheckpointError, match="uint8"):
        dequant_mxfp4(np.zeros((2, 16), np.int32), np.zeros((2, 1), np.uint8))
    with pytest.raises(CheckpointError, match="odd"):
        quantize_mxfp4(np.zeros((2, 31), np.float32))


# --------------------------------------------------------------------------------------------
# compressed-tensors itself as the reference (skipped when it is not installed)
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ct():
    torch = pytest.importorskip("torch")
    pytest.importorskip("compressed_tensors")
    try:
        from compressed_tensors.compressors.nvfp4.helpers import (
            pack_fp4_to_uint8,
            quantize_and_pack_fp4,
            unpack_fp4_from_uint8,
        )
        from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
        from compressed_tensors.quantization.utils.mxfp_utils import generate_mx_scales
    except ImportError as exc:  # the helpers moved between releases
        pytest.skip(f"compressed-tensors layout differs from 0.20: {exc}")
    return dict(torch=torch, pack_to_int32=pack_to_int32, unpack_from_int32=unpack_from_int32,
                pack_fp4_to_uint8=pack_fp4_to_uint8, unpack_fp4_from_uint8=unpack_fp4_from_uint8,
                quantize_and_pack_fp4=quantize_and_pack_fp4, generate_mx_scales=generate_mx_scales)


def test_int4_agrees_with_compressed_tensors(ct):
    torch = ct["torch"]
    rng = np.random.default_rng(6)
    q = rng.integers(-8, 8, size=(5, 44)).astype(np.int8)
    their_packed = ct["pack_to_int32"](torch.from_numpy(q), 4).numpy()
    ones = np.ones((5, 11), np.float32)
    np.testing.assert_array_equal(unpack_int4(their_packed, ones, [5, 44], 4), q)

    packed, scale, shape = pack_int4(rng.standard_normal((5, 44)).astype(np.float32), 4)
    their_q = ct["unpack_from_int32"](torch.from_numpy(packed), 4, torch.Size(shape.tolist())).numpy()
    np.testing.assert_array_equal(ct["pack_to_int32"](torch.from_numpy(their_q), 4).numpy(), packed)
    np.testing.assert_array_equal(
        unpack_int4(packed, scale, shape, 4), their_q * np.repeat(scale.astype(np.float32), 4, axis=1)
    )

    zero_point = rng.integers(-8, 8, size=(13, 3)).astype(np.int8)
    their_zp = ct["pack_to_int32"](torch.from_numpy(zero_point), 4, packed_dim=0).numpy()
    q_zero = np.full((13, 6), 0x88888888, dtype=np.uint32).view(np.int32)  # q = 0 for 48 columns
    w = unpack_int4(q_zero, np.ones((13, 3), np.float32), [13, 48], 16, weight_zero_point=their_zp)
    np.testing.assert_array_equal(w, -np.repeat(zero_point, 16, axis=1))


def test_mxfp4_agrees_with_compressed_tensors(ct):
    torch = ct["torch"]
    rng = np.random.default_rng(7)
    # bf16-representable inputs: compressed-tensors rounds to e2m1 via bf16 on CPU
    w = (rng.standard_normal((6, 96)) * 0.07).astype(BF16).astype(np.float32)
    w[0, :4] = [-0.0, -1e-6, 0.0, -0.0]  # signed zeros: code 0 for -0.0, code 8 for a tiny negative
    packed, scale = quantize_mxfp4(w)

    amax = torch.from_numpy(np.abs(w).reshape(6, 3, 32).max(axis=2))
    their_scale = ct["generate_mx_scales"](amax, num_bits=4).clamp(0, 255).round().to(torch.uint8)
    np.testing.assert_array_equal(scale, their_scale.numpy())

    scale_f32 = torch.from_numpy(np.ldexp(np.float32(1), scale.astype(np.int32) - 127).astype(np.float32))
    their_packed = ct["quantize_and_pack_fp4"](torch.from_numpy(w), scale_f32, group_size=32)
    np.testing.assert_array_equal(packed, their_packed.numpy())

    their_values = ct["unpack_fp4_from_uint8"](torch.from_numpy(packed), 6, 96, dtype=torch.float32).numpy()
    np.testing.assert_array_equal(
        dequant_mxfp4(packed, scale), their_values * np.repeat(scale_f32.numpy(), 32, axis=1)
    )


# --------------------------------------------------------------------------------------------
# Registry and config detection
# --------------------------------------------------------------------------------------------

DEEPSEEK_V3_FP8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                   "weight_block_size": [128, 128]}
KIMI_K2_INT4 = {
    "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
    "config_groups": {"group_0": {
        "targets": ["Linear"], "input_activations": None, "output_activations": None,
        "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32,
                    "dynamic": False, "actorder": None},
    }},
    "ignore": ["lm_head"], "kv_cache_scheme": None,
}
MXFP4 = {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
         "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "float", "group_size": 32,
                                                   "scale_dtype": "torch.uint8"}}}}


@pytest.mark.parametrize("config, expected", [
    (None, None), ({}, None), (DEEPSEEK_V3_FP8, "fp8_block"),
    ({**DEEPSEEK_V3_FP8, "scale_fmt": "ue8m0"}, "fp8_block"),  # V3.1: same decoding
    (KIMI_K2_INT4, "int4_pack"), (MXFP4, "mxfp4"),
    ({**MXFP4, "format": "mixed-precision",
      "config_groups": {"g": {"format": "mxfp4-pack-quantized", "weights": {}}}}, "mxfp4"),
])
def test_detect_format(config, expected):
    assert detect_format(config) == expected
    if expected is not None:
        assert expected in QUANT_FORMATS


def test_detect_format_unknown_method_names_it_and_the_supported_ones():
    with pytest.raises(CheckpointError) as err:
        detect_format({"quant_method": "gptq", "bits": 4})
    message = str(err.value)
    assert "'gptq'" in message and '"fp8"' in message and "pack-quantized" in message


@pytest.mark.parametrize("config, named", [
    ({**KIMI_K2_INT4, "format": "nvfp4-pack-quantized"}, "nvfp4-pack-quantized"),
    ({"quant_method": "fp8", "fmt": "e4m3"}, "weight_block_size"),
    ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "e5m2"),
    ({**KIMI_K2_INT4, "config_groups": {"g": {"weights": {"num_bits": 8, "type": "int"}}}}, "num_bits 8"),
    ({**KIMI_K2_INT4, "config_groups": {"g": {"weights": {"num_bits": 4, "actorder": "group"}}}}, "actorder"),
])
def test_detect_format_refuses_what_the_decoders_cannot_read(config, named):
    with pytest.raises(CheckpointError, match=named):
        detect_format(config)


def test_companion_tensor_names():
    stem = "model.layers.5.mlp.experts.17.gate_proj."
    fp8 = companion_tensor_names(stem + "weight", "fp8_block")
    assert fp8 == (stem + "weight", stem + "weight_scale_inv")
    assert companion_tensor_names(stem + "weight", "int4_pack") == (
        stem + "weight_packed", stem + "weight_scale", stem + "weight_shape")
    assert companion_tensor_names(stem + "weight", "mxfp4") == (stem + "weight_packed", stem + "weight_scale")
    assert QUANT_FORMATS["int4_pack"].optional_suffixes == ("weight_zero_point",)
    with pytest.raises(CheckpointError, match="nvfp4"):
        companion_tensor_names(stem + "weight", "nvfp4")
    with pytest.raises(CheckpointError, match="ending in 'weight'"):
        companion_tensor_names(stem + "bias", "fp8_block")

"""Encoders for the quantised weight formats of `moejax.hf.quant.decode`: float weights to the tensors a
quantised checkpoint stores, each the exact layout its decoder reads. The library itself only
decodes; the tests and their fixtures build quantised checkpoints with these, and check them
against compressed-tensors' own pack functions.

* ``quantize_fp8_block``: FP8 e4m3 with a float32 ``scale_inv`` per 128x128 block, as DeepSeek's
  quantiser.
* ``pack_int4``: compressed-tensors symmetric INT4 ``pack-quantized``, as its minmax observer.
* ``quantize_mxfp4``: compressed-tensors ``mxfp4-pack-quantized``.
* ``quantize_deepseek_v4_fp8`` / ``quantize_deepseek_v4_fp4``: DeepSeek-V4's ``<x>.weight`` and
  ``<x>.scale`` (FP8 e4m3 per 128x128 block; FP4 e2m1 two per int8 byte per 32), E8M0 scales.

Only numpy and ml_dtypes; every function is pure. Arrays are 2-D ``[out_features, in_features]``.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from moejax.errors import CheckpointError
from moejax.hf.quant.decode import (DSV4_FP4_GROUP, E8M0_BIAS, E8M0_NAN, FLOAT_SCALE_DTYPES, FP8_BLOCK, INT4_NIBBLES_PER_WORD, INT4_OFFSET,
                             MXFP4_GROUP_SIZE, ceil_div, e8m0_to_float32, expand_per_block, require_2d,
                             require_positive_pair)

FP8_E4M3_MAX = 448.0

INT4_Q_MIN, INT4_Q_MAX = -8, 7
INT4_SYMMETRIC_RANGE = 7.5  # compressed-tensors' symmetric scale is amax / (bit_range / 2) = amax / 7.5

FP4_E2M1_MAX = 6.0
# floor(log2(FP4_E2M1_MAX)): the E8M0 exponent sits this far below the group's rounded amax.
MXFP4_EXPONENT_OFFSET = 2


def _block_amax(w: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """max|w| over each block, edge blocks partial. Zero padding never changes a block's amax, which
    is also how DeepSeek handles edges (pads to 128, then drops the padding)."""
    rows, cols = block
    m, n = w.shape
    mb, nb = ceil_div(m, rows), ceil_div(n, cols)
    padded = np.zeros((mb * rows, nb * cols), dtype=np.float32)
    padded[:m, :n] = np.abs(w)
    return padded.reshape(mb, rows, nb, cols).max(axis=(1, 3))


def _as_float32_input(w, name: str) -> np.ndarray:
    w = np.asarray(w)
    require_2d(w, name)
    w = w.astype(np.float32)
    if not np.all(np.isfinite(w)):
        raise CheckpointError(f"{name}: cannot quantise non-finite values")
    return w


# ---------------------------------------------------------------------------------------------
# FP8 e4m3 with block scales (DeepSeek-V3, Kimi-K2)
# ---------------------------------------------------------------------------------------------


def quantize_fp8_block(
    w: np.ndarray, block: tuple[int, int] = FP8_BLOCK
) -> tuple[np.ndarray, np.ndarray]:
    """Encode float [M, N] as (``float8_e4m3fn`` [M, N], float32 ``scale_inv`` [ceil(M/bm), ceil(N/bn)]).

    Per block, as DeepSeek's quantiser: ``scale_inv = amax / 448`` (1 for an all-zero block, so it
    decodes to zeros), ``q = clip(w / scale_inv, -448, 448)`` rounded to nearest-even e4m3. A value
    equal to 448 * scale_inv of its block times an e4m3 number round-trips exactly when scale_inv
    is a power of two.
    """
    w = _as_float32_input(w, "weight")
    block = require_positive_pair(block, "block")
    amax = _block_amax(w, block)
    scale_inv = np.where(amax > 0, amax / np.float32(FP8_E4M3_MAX), np.float32(1.0)).astype(np.float32)
    scaled = w / expand_per_block(scale_inv, block, w.shape)
    # Clip before the cast: ml_dtypes turns anything past 448 into NaN (e4m3fn has no infinity),
    # and amax / (amax / 448) can land a rounding step above 448.
    scaled = np.clip(scaled, -FP8_E4M3_MAX, FP8_E4M3_MAX)
    return scaled.astype(ml_dtypes.float8_e4m3fn), scale_inv


# ---------------------------------------------------------------------------------------------
# compressed-tensors INT4 pack-quantized
# ---------------------------------------------------------------------------------------------


def _pack_nibbles(nibbles: np.ndarray) -> np.ndarray:
    """uint [R, C] values 0..15 -> int32 [R, ceil(C/8)], the inverse of the decoder's
    ``moejax.hf.quant.decode._unpack_nibbles``; a short last word is filled with zero nibbles (as
    compressed-tensors pads)."""
    rows, cols = nibbles.shape
    words = ceil_div(cols, INT4_NIBBLES_PER_WORD)
    padded = np.zeros((rows, words * INT4_NIBBLES_PER_WORD), dtype=np.uint32)
    padded[:, :cols] = nibbles
    shifts = np.arange(INT4_NIBBLES_PER_WORD, dtype=np.uint32) * 4
    packed = np.bitwise_or.reduce(padded.reshape(rows, words, INT4_NIBBLES_PER_WORD) << shifts, axis=2)
    return packed.astype(np.uint32).view(np.int32)


def pack_int4(
    w: np.ndarray, group_size: int, *, scale_dtype=ml_dtypes.bfloat16
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Encode float [M, N] as compressed-tensors symmetric INT4 ``pack-quantized``:
    (``weight_packed`` int32 [M, ceil(N/8)], ``weight_scale`` [M, ceil(N/group_size)] in
    ``scale_dtype`` (bf16 as in Kimi checkpoints), ``weight_shape`` int64 [2]).

    As compressed-tensors' minmax observer: ``scale = amax(group) / 7.5`` rounded to ``scale_dtype``
    (a zero scale becomes that dtype's eps), ``q = clip(round_half_even(w / scale), -8, 7)``, then
    packed as ``unpack_int4`` reads it. The division is float32 here (compressed-tensors divides in
    the weight's dtype), which can differ on an exact rounding tie. Per element the error is at
    most half a scale step, a little more for a group's largest value (7.5 rounds to 8, clipped to 7).
    """
    w = _as_float32_input(w, "weight")
    group_size = int(group_size)
    if group_size <= 0:
        raise CheckpointError(f"weight: group_size must be positive, got {group_size}")
    scale_dtype = np.dtype(scale_dtype)
    if scale_dtype not in FLOAT_SCALE_DTYPES:
        raise CheckpointError(f"weight_scale: unsupported scale dtype {scale_dtype}")
    rows, cols = w.shape
    amax = _block_amax(w, (1, group_size))
    scale = (amax / np.float32(INT4_SYMMETRIC_RANGE)).astype(scale_dtype)
    scale = np.where(scale == 0, ml_dtypes.finfo(scale_dtype).eps, scale).astype(scale_dtype)
    scaled = w / expand_per_block(scale.astype(np.float32), (1, group_size), w.shape)
    q = np.clip(np.rint(scaled), INT4_Q_MIN, INT4_Q_MAX).astype(np.int32)
    packed = _pack_nibbles((q + INT4_OFFSET).astype(np.uint32))
    return packed, scale, np.array([rows, cols], dtype=np.int64)


# ---------------------------------------------------------------------------------------------
# compressed-tensors MXFP4 (mxfp4-pack-quantized)
# ---------------------------------------------------------------------------------------------


def _mx_scale_exponent(amax: np.ndarray) -> np.ndarray:
    """E8M0 exponent per group, as compressed-tensors ``generate_mx_scales(amax, num_bits=4)``:
    round amax to a power of two (up when its significand is >= 1.75, else down: add a quarter to
    the fraction bits and mask them off), then ``e = 127 + log2(that) - 2``, clipped to [0, 255].
    With float32 bits that is the rounded value's exponent field minus 2."""
    bits = np.ascontiguousarray(amax, dtype=np.float32).view(np.uint32).astype(np.int64)
    rounded = bits + (1 << 21)  # a quarter of float32's 23 fraction bits
    exponent_field = (rounded >> 23) & 0xFF
    return np.clip(exponent_field - MXFP4_EXPONENT_OFFSET, 0, E8M0_NAN).astype(np.uint8)


def quantize_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Encode float [M, N] (N even) as compressed-tensors MXFP4: (``weight_packed`` uint8 [M, N/2],
    ``weight_scale`` uint8 E8M0 [M, ceil(N/32)]), the layout ``dequant_mxfp4`` reads.

    Per group of 32: the exponent from ``_mx_scale_exponent``; values ``w / scale`` clipped to +-6
    and rounded to the nearest e2m1 value, ties to even (compressed-tensors' thresholds 0.25, 0.75,
    1.25, 1.75, 2.5, 3.5, 5). Groups whose values are e2m1 numbers times one power of two round-trip
    exactly; otherwise the error is at most one scale step (half the widest e2m1 gap, 4 to 6).
    """
    w = _as_float32_input(w, "weight")
    rows, cols = w.shape
    if cols % 2:
        raise CheckpointError(f"weight: MXFP4 packs two values per byte; in_features {cols} is odd")
    exponents = _mx_scale_exponent(_block_amax(w, (1, MXFP4_GROUP_SIZE)))
    scaled = w / expand_per_block(e8m0_to_float32(exponents), (1, MXFP4_GROUP_SIZE), w.shape)
    # + 0.0 turns -0.0 into +0.0, so an exact zero gets code 0 as in compressed-tensors, while a
    # small negative value still rounds to -0 (code 8), also as there.
    scaled = np.clip(scaled, -FP4_E2M1_MAX, FP4_E2M1_MAX) + np.float32(0.0)
    # ml_dtypes rounds to nearest-even on the e2m1 grid; its byte holds the 4-bit code.
    codes = scaled.astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0x0F
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    return packed, exponents


# ---------------------------------------------------------------------------------------------
# DeepSeek-V4 (`.weight` + `.scale`, E8M0 scales)
# ---------------------------------------------------------------------------------------------


def quantize_deepseek_v4_fp8(w: np.ndarray, block: tuple[int, int] = FP8_BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """Encode float [M, N] as DeepSeek-V4 FP8 with E8M0 scales: (``float8_e4m3fn`` [M, N],
    ``float8_e8m0fnu`` [ceil(M/bm), ceil(N/bn)]), as transformers' ``Fp8Quantize`` with
    ``scale_fmt "ue8m0"``: per block ``scale = 2**ceil(log2(amax / 448))`` (1 for an all-zero block),
    ``q = clip(w / scale, -448, 448)`` rounded to nearest-even e4m3."""
    w = _as_float32_input(w, "weight")
    block = require_positive_pair(block, "block")
    amax = _block_amax(w, block)
    exponent = np.where(amax > 0, np.ceil(np.log2(np.maximum(amax, np.float32(1e-38)) / np.float32(FP8_E4M3_MAX))), 0)
    exponents = np.clip(exponent + E8M0_BIAS, 0, E8M0_NAN - 1).astype(np.uint8)
    scaled = w / expand_per_block(e8m0_to_float32(exponents), block, w.shape)
    scaled = np.clip(scaled, -FP8_E4M3_MAX, FP8_E4M3_MAX)
    return scaled.astype(ml_dtypes.float8_e4m3fn), exponents.view(ml_dtypes.float8_e8m0fnu)


def quantize_deepseek_v4_fp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Encode float [M, N] (N a multiple of 32) as DeepSeek-V4's FP4 experts: (int8 [M, N/2], input
    column 2j the low nibble of byte j, ``float8_e8m0fnu`` [M, N/32]): MXFP4's values and exponents
    (`quantize_mxfp4`) in the released containers."""
    w = _as_float32_input(w, "weight")
    if w.shape[1] % DSV4_FP4_GROUP:
        raise CheckpointError(f"weight: FP4 needs in_features a multiple of {DSV4_FP4_GROUP}, got {w.shape[1]}")
    packed, exponents = quantize_mxfp4(w)
    return packed.view(np.int8), exponents.view(ml_dtypes.float8_e8m0fnu)

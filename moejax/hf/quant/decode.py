"""Quantised weight formats of MoE checkpoints (as DeepSeek-V3, Kimi-K2 and compressed-tensors ship them): their layouts, a decoder for each (to
run the model, always float32 out), and their detection from config.json.

* ``fp8_block``: DeepSeek-V3 / Kimi-K2 FP8 e4m3 weights with one float32 ``weight_scale_inv`` per
  128x128 block (``quant_method: "fp8"``).
* ``int4_pack``: compressed-tensors ``pack-quantized`` INT4 group quantisation, eight 4-bit values
  per int32 (Kimi-K2-Thinking, Kimi-K2.5).
* ``mxfp4``: compressed-tensors ``mxfp4-pack-quantized``, two FP4 e2m1 values per byte and one E8M0
  exponent per 32 values.
* ``deepseek_v4_fp8``: DeepSeek-V4's release (``quant_method: "fp8"`` with ``expert_dtype``): every
  quantised Linear is ``<x>.weight`` plus ``<x>.scale`` (DeepSeek's own name for ``weight_scale_inv``);
  FP8 e4m3 weights with one scale per 128x128 block, and, where ``expert_dtype`` is ``"fp4"``, routed
  experts as FP4 e2m1 packed two per int8 byte with one scale per 32 input values (MXFP4's values);
  scales E8M0 (``scale_fmt: "ue8m0"``) or float32. See `dequant_deepseek_v4` for the sources.
* ``gpt_oss_mxfp4``: gpt-oss's own MXFP4 (``quant_method: "mxfp4"``): the same values and scales,
  stored fused per MoE layer beside the dense name they replace, ``experts.gate_up_proj_blocks``
  uint8 [E, out, in/32, 16] and ``experts.gate_up_proj_scales`` uint8 [E, out, in/32], decoded as
  transformers' ``convert_moe_packed_tensors`` does and transposed to the dense tensor's [in, out].

The layouts follow the compressed-tensors and DeepSeek sources (see
shared/reference/deepseek-v3-hf.md §4.1, §4.4, §4.5). Only numpy and ml_dtypes; every function is
pure but `read_decoded`, which reads a weight and its companions through a checkpoint reader.
Arrays are 2-D ``[out_features, in_features]`` as torch Linear stores them; groups and packing
run along the input (last) dimension. The encoders, which build quantised checkpoints for the tests,
are in `moejax.hf.quant.encode`.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from moejax.errors import CheckpointError

FP8_BLOCK = (128, 128)

INT4_NIBBLES_PER_WORD = 8
INT4_OFFSET = 8  # stored nibble = q + 8, q in [-8, 7]

MXFP4_GROUP_SIZE = 32
E8M0_BIAS = 127
E8M0_NAN = 255

# The value of each 4-bit e2m1 code: bit 3 is the sign, bits 0-2 index the magnitudes.
E2M1_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=np.float32,
)

FLOAT_SCALE_DTYPES = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def require_2d(array: np.ndarray, name: str) -> None:
    if array.ndim != 2:
        raise CheckpointError(f"{name}: expected a 2-D array, got shape {array.shape}")


def _require_dtype(array: np.ndarray, name: str, allowed: tuple) -> None:
    allowed = tuple(np.dtype(d) for d in allowed)
    if array.dtype not in allowed:
        names = ", ".join(str(d) for d in allowed)
        raise CheckpointError(f"{name}: expected dtype {names}, got {array.dtype}")


def require_positive_pair(block, name: str) -> tuple[int, int]:
    if len(block) != 2:
        raise CheckpointError(f"{name}: expected (rows, cols), got {tuple(block)}")
    rows, cols = (int(b) for b in block)
    if rows <= 0 or cols <= 0:
        raise CheckpointError(f"{name}: block sizes must be positive, got {tuple(block)}")
    return rows, cols


def expand_per_block(per_block: np.ndarray, block: tuple[int, int], shape: tuple[int, int]) -> np.ndarray:
    """Repeat a [ceil(M/bm), ceil(N/bn)] grid so every element of [M, N] sees its block's value;
    the slice drops what an edge block would cover beyond the matrix."""
    rows, cols = block
    return np.repeat(np.repeat(per_block, rows, axis=0), cols, axis=1)[: shape[0], : shape[1]]


# ---------------------------------------------------------------------------------------------
# FP8 e4m3 with block scales (DeepSeek-V3, Kimi-K2)
# ---------------------------------------------------------------------------------------------


def dequant_fp8_block(
    weight: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int] = FP8_BLOCK, *, name: str = "weight"
) -> np.ndarray:
    """Decode a DeepSeek FP8 block-quantised weight to float32 [M, N].

    Layout: ``weight`` is ``float8_e4m3fn`` [M, N]; ``scale_inv`` (the ``<name>_scale_inv`` tensor)
    is float [ceil(M/bm), ceil(N/bn)] for ``block = (bm, bn)``, default 128x128. Blocks at the bottom
    and right edges may be partial::

        W[i, j] = float32(weight[i, j]) * scale_inv[i // bm, j // bn]

    ``name`` is the weight's tensor name, used in error messages.
    """
    weight = np.asarray(weight)
    scale_inv = np.asarray(scale_inv)
    block = require_positive_pair(block, f"{name} block")
    require_2d(weight, name)
    _require_dtype(weight, name, (ml_dtypes.float8_e4m3fn,))
    require_2d(scale_inv, f"{name}_scale_inv")
    _require_dtype(scale_inv, f"{name}_scale_inv", FLOAT_SCALE_DTYPES)
    m, n = weight.shape
    expected = (ceil_div(m, block[0]), ceil_div(n, block[1]))
    if scale_inv.shape != expected:
        raise CheckpointError(
            f"{name}_scale_inv: shape {scale_inv.shape} does not fit weight shape {weight.shape} "
            f"with {block[0]}x{block[1]} blocks; expected {expected}"
        )
    scale = expand_per_block(scale_inv.astype(np.float32), block, (m, n))
    return weight.astype(np.float32) * scale


# ---------------------------------------------------------------------------------------------
# compressed-tensors INT4 pack-quantized
# ---------------------------------------------------------------------------------------------


def _weight_shape_pair(weight_shape, name: str) -> tuple[int, int]:
    shape = np.asarray(weight_shape)
    if shape.shape != (2,) or not np.issubdtype(shape.dtype, np.integer):
        raise CheckpointError(
            f"{name}_shape: expected 2 integers [out_features, in_features], got {shape.dtype} {shape.shape}"
        )
    rows, cols = (int(v) for v in shape)
    if rows < 0 or cols < 0:
        raise CheckpointError(f"{name}_shape: negative size in {[rows, cols]}")
    return rows, cols


def _unpack_nibbles(words: np.ndarray) -> np.ndarray:
    """int32 [R, W] -> nibbles uint8 [R, 8*W]: element ``8j + k`` sits at bits ``4k..4k+3`` of word j
    (little-endian nibble order along the row), as compressed-tensors ``unpack_from_int32`` reads it."""
    unsigned = np.ascontiguousarray(words).view(np.uint32)  # logical shifts, not sign-extending ones
    shifts = np.arange(INT4_NIBBLES_PER_WORD, dtype=np.uint32) * 4
    nibbles = (unsigned[:, :, None] >> shifts) & 0xF
    return nibbles.reshape(words.shape[0], -1).astype(np.uint8)


def _unpack_int4_zero_point(zero_point: np.ndarray, rows: int, groups: int, name: str) -> np.ndarray:
    """Asymmetric zero points: int32 [ceil(M/8), G] packed along dim 0 (the output dim), i.e.
    ``pack_to_int32(zp, 4, packed_dim=0)``; row ``8j + k`` of column g sits at bits ``4k..`` of
    ``zero_point[j, g]``, stored as zp + 8. Returns int32 [M, G] in [-8, 7]."""
    zero_point = np.asarray(zero_point)
    require_2d(zero_point, f"{name}_zero_point")
    _require_dtype(zero_point, f"{name}_zero_point", (np.int32,))
    expected = (ceil_div(rows, INT4_NIBBLES_PER_WORD), groups)
    if zero_point.shape != expected:
        raise CheckpointError(
            f"{name}_zero_point: shape {zero_point.shape} does not fit {rows} rows x {groups} groups "
            f"packed 8 per int32 along the rows; expected {expected}"
        )
    nibbles = _unpack_nibbles(zero_point.T).T[:rows]
    return nibbles.astype(np.int32) - INT4_OFFSET


def unpack_int4(
    weight_packed: np.ndarray,
    weight_scale: np.ndarray,
    weight_shape,
    group_size: int,
    *,
    weight_zero_point: np.ndarray | None = None,
    name: str = "weight",
) -> np.ndarray:
    """Decode compressed-tensors ``pack-quantized`` INT4 to float32 [M, N].

    Layout (``compressors/pack_quantized/helpers.py: pack_to_int32 / unpack_from_int32``):

    * ``weight_packed`` int32 [M, ceil(N/8)]: input column ``8j + k`` (k = 0..7) is the nibble at
      bits ``4k..4k+3`` of word j, read unsigned; the nibble stores ``q + 8`` with q in [-8, 7].
      Nibbles past N in the last word are padding.
    * ``weight_scale`` bf16/f16/f32 [M, ceil(N/group_size)]: one scale per row and group of
      ``group_size`` input columns.
    * ``weight_shape`` int32 or int64 [2] = [M, N].
    * ``weight_zero_point`` (only for ``symmetric: false``) int32 [ceil(M/8), G], packed along the
      output dim; then ``W = (q - zp) * scale``, else ``W = q * scale``.

    compressed-tensors multiplies in the scale's dtype; the float32 product here is exact for bf16
    and f16 scales (a 4-bit integer times an 8- or 11-bit significand), so casting the result to the
    scale dtype reproduces its decompressed weight bit for bit. ``name`` is the Linear's ``weight``
    tensor name (the tensors are ``<name>_packed`` etc.), used in error messages.
    """
    weight_packed = np.asarray(weight_packed)
    weight_scale = np.asarray(weight_scale)
    rows, cols = _weight_shape_pair(weight_shape, name)
    group_size = int(group_size)
    if group_size <= 0:
        raise CheckpointError(f"{name}: group_size must be positive, got {group_size}")
    require_2d(weight_packed, f"{name}_packed")
    _require_dtype(weight_packed, f"{name}_packed", (np.int32,))
    expected_packed = (rows, ceil_div(cols, INT4_NIBBLES_PER_WORD))
    if weight_packed.shape != expected_packed:
        raise CheckpointError(
            f"{name}_packed: shape {weight_packed.shape} does not fit weight_shape {(rows, cols)} "
            f"packed 8 per int32; expected {expected_packed}"
        )
    require_2d(weight_scale, f"{name}_scale")
    _require_dtype(weight_scale, f"{name}_scale", FLOAT_SCALE_DTYPES)
    groups = ceil_div(cols, group_size)
    if weight_scale.shape != (rows, groups):
        raise CheckpointError(
            f"{name}_scale: shape {weight_scale.shape} does not fit weight_shape {(rows, cols)} "
            f"with group_size {group_size}; expected {(rows, groups)}"
        )
    q = _unpack_nibbles(weight_packed)[:, :cols].astype(np.int32) - INT4_OFFSET
    if weight_zero_point is not None:
        zero_point = _unpack_int4_zero_point(weight_zero_point, rows, groups, name)
        q = q - expand_per_block(zero_point, (1, group_size), (rows, cols))
    scale = expand_per_block(weight_scale.astype(np.float32), (1, group_size), (rows, cols))
    return q.astype(np.float32) * scale


# ---------------------------------------------------------------------------------------------
# compressed-tensors MXFP4 (mxfp4-pack-quantized)
# ---------------------------------------------------------------------------------------------


def _unpack_fp4_codes(packed: np.ndarray) -> np.ndarray:
    """uint8 [M, P] -> 4-bit codes [M, 2P]: element 2j is the LOW nibble of byte j, element 2j+1 the
    high nibble (compressed-tensors ``unpack_fp4_from_uint8``)."""
    low = packed & 0x0F
    high = packed >> 4
    return np.stack([low, high], axis=-1).reshape(packed.shape[0], -1)


def e8m0_to_float32(exponents: np.ndarray) -> np.ndarray:
    """E8M0 scale bytes -> 2**(e - 127) in float32 (exact, 2**-127 being a float32 subnormal);
    255 is NaN, as the OCP MX spec defines it."""
    finite = np.minimum(exponents.astype(np.int32), E8M0_NAN - 1)  # 2**128 would overflow float32
    scale = np.ldexp(np.float32(1.0), finite - E8M0_BIAS).astype(np.float32)
    return np.where(exponents == E8M0_NAN, np.float32(np.nan), scale)


def dequant_mxfp4(weight_packed: np.ndarray, weight_scale: np.ndarray, *, name: str = "weight") -> np.ndarray:
    """Decode compressed-tensors ``mxfp4-pack-quantized`` to float32 [M, N], N = 2 * packed columns.

    Layout (``compressors/nvfp4/helpers.py: pack_fp4_to_uint8 / unpack_fp4_from_uint8``,
    ``compressors/mx_utils.py``):

    * ``weight_packed`` uint8 [M, N/2]: input column 2j is the low nibble of byte j, column 2j+1 the
      high nibble. A nibble is an FP4 e2m1 code: bit 3 sign, bits 0-2 index
      [0, 0.5, 1, 1.5, 2, 3, 4, 6].
    * ``weight_scale`` uint8 [M, ceil(N/32)]: E8M0 exponents, scale = 2**(e - 127), one per row and
      group of 32 input columns.

    ``W = e2m1(code) * scale``, exact in float32. ``name`` is the Linear's ``weight`` tensor name,
    used in error messages.
    """
    weight_packed = np.asarray(weight_packed)
    weight_scale = np.asarray(weight_scale)
    require_2d(weight_packed, f"{name}_packed")
    _require_dtype(weight_packed, f"{name}_packed", (np.uint8,))
    require_2d(weight_scale, f"{name}_scale")
    _require_dtype(weight_scale, f"{name}_scale", (np.uint8,))
    rows, cols = weight_packed.shape[0], 2 * weight_packed.shape[1]
    expected = (rows, ceil_div(cols, MXFP4_GROUP_SIZE))
    if weight_scale.shape != expected:
        raise CheckpointError(
            f"{name}_scale: shape {weight_scale.shape} does not fit {name}_packed shape "
            f"{weight_packed.shape} (= {rows}x{cols} FP4 values, groups of {MXFP4_GROUP_SIZE}); "
            f"expected {expected}"
        )
    values = E2M1_VALUES[_unpack_fp4_codes(weight_packed)]
    scale = expand_per_block(e8m0_to_float32(weight_scale), (1, MXFP4_GROUP_SIZE), (rows, cols))
    return values * scale


# ---------------------------------------------------------------------------------------------
# DeepSeek-V4: FP8 block and FP4 e2m1 weights beside a `.scale` tensor
# ---------------------------------------------------------------------------------------------

DSV4_FP4_GROUP = 32          # FP4 weights: one scale per row and 32 input values
DSV4_SCALE_DTYPES = (np.dtype(ml_dtypes.float8_e8m0fnu), np.dtype(np.float32))


def dsv4_scale_float32(scale: np.ndarray, *, name: str) -> np.ndarray:
    """A DeepSeek-V4 `.scale` tensor as float32: E8M0 bytes are 2**(e - 127) (255 NaN), float32 as is."""
    scale = np.asarray(scale)
    _require_dtype(scale, name, DSV4_SCALE_DTYPES)
    if scale.dtype == np.float32:
        return scale
    return e8m0_to_float32(np.ascontiguousarray(scale).view(np.uint8))


def dequant_deepseek_v4(weight: np.ndarray, scale: np.ndarray, block: tuple[int, int] = FP8_BLOCK, *,
                        name: str = "weight") -> np.ndarray:
    """Decode one DeepSeek-V4 quantised Linear (``<x>.weight``, ``<x>.scale``) to float32 [M, N]; the
    weight's dtype says which of the two kinds it is.

    * FP8: ``weight`` float8_e4m3fn [M, N], ``scale`` [ceil(M/bm), ceil(N/bn)] for ``block`` =
      ``weight_block_size``: ``W[i, j] = weight[i, j] * scale[i // bm, j // bn]`` (DeepSeek-V3's
      block layout, `dequant_fp8_block`, with the scale stored E8M0 or float32).
    * FP4 (routed experts with ``expert_dtype: "fp4"``): ``weight`` int8 [M, N/2], input column 2j the
      LOW nibble of byte j and 2j+1 the high nibble, each an e2m1 code (bit 3 sign, bits 0-2 index
      [0, 0.5, 1, 1.5, 2, 3, 4, 6]); ``scale`` [M, N/32]: ``W[i, j] = e2m1(code) * scale[i, j // 32]``
      (``block`` does not apply).

    Sources: transformers 5.24 ``integrations/finegrained_fp8.py`` (``FP8Experts``: ``expert_dtype
    "fp4"`` allocates an int8 weight with K halved and a per-row scale per 32; ``Fp8Dequantize
    ._unpack_fp4``: low nibble first, the e2m1 table above; ``scale_fmt "ue8m0"``: float8_e8m0fnu
    scales) and ``quantizers/quantizer_finegrained_fp8.py`` (DeepSeek-V4-Flash's ``.scale`` renamed to
    ``weight_scale_inv``); the released headers (``experts.{e}.w1.weight`` I8 [2048, 2048] with
    ``w1.scale`` F8_E8M0 [2048, 128]; ``attn.wq_a.weight`` F8_E4M3 [1024, 4096] with ``wq_a.scale``
    F8_E8M0 [8, 32]). Exact in float32 (an e4m3 or e2m1 value times a power of two or a float32)."""
    weight = np.asarray(weight)
    require_2d(weight, name)
    scale_name = name[: -len("weight")] + "scale" if name.endswith("weight") else name + ".scale"
    require_2d(np.asarray(scale), scale_name)
    s = dsv4_scale_float32(scale, name=scale_name)
    if weight.dtype == np.int8:
        rows, cols = weight.shape[0], 2 * weight.shape[1]
        if cols % DSV4_FP4_GROUP:
            raise CheckpointError(f"{name}: FP4 with {cols} input values, not a multiple of {DSV4_FP4_GROUP}")
        if s.shape != (rows, cols // DSV4_FP4_GROUP):
            raise CheckpointError(f"{scale_name}: shape {s.shape} does not fit FP4 {name} of shape {weight.shape} "
                                  f"(= {rows}x{cols} values, one scale per {DSV4_FP4_GROUP}); expected "
                                  f"{(rows, cols // DSV4_FP4_GROUP)}")
        values = E2M1_VALUES[_unpack_fp4_codes(np.ascontiguousarray(weight).view(np.uint8))]
        return values * expand_per_block(s, (1, DSV4_FP4_GROUP), (rows, cols))
    _require_dtype(weight, name, (ml_dtypes.float8_e4m3fn, np.int8))
    block = require_positive_pair(block, f"{name} block")
    m, n = weight.shape
    expected = (ceil_div(m, block[0]), ceil_div(n, block[1]))
    if s.shape != expected:
        raise CheckpointError(f"{scale_name}: shape {s.shape} does not fit FP8 {name} of shape {weight.shape} with "
                              f"{block[0]}x{block[1]} blocks; expected {expected}")
    return weight.astype(np.float32) * expand_per_block(s, block, (m, n))


# ---------------------------------------------------------------------------------------------
# Registry and detection from config.json
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class QuantFormat:
    """How a quantised Linear sits on disk: the tensors that replace its dense tensor, named by the
    suffix that takes the place of `replaces` at the end of the dense name (``…proj.weight`` ->
    ``…proj.weight_scale_inv``; gpt-oss: ``experts.gate_up_proj`` -> ``experts.gate_up_proj_blocks``)."""

    name: str
    tensor_suffixes: tuple[str, ...]
    optional_suffixes: tuple[str, ...]
    description: str
    replaces: str = "weight"          # the end of the dense name the suffixes replace ("": appended)
    packed_suffix: str | None = None  # the suffix of the tensor holding packed 4-bit values


QUANT_FORMATS: dict[str, QuantFormat] = {
    "fp8_block": QuantFormat(
        name="fp8_block",
        tensor_suffixes=("weight", "weight_scale_inv"),
        optional_suffixes=(),
        description='quant_method "fp8": float8_e4m3fn weight, float32 scale_inv per 128x128 block',
    ),
    "int4_pack": QuantFormat(
        name="int4_pack",
        tensor_suffixes=("weight_packed", "weight_scale", "weight_shape"),
        # only for symmetric: false; never in Kimi checkpoints
        optional_suffixes=("weight_zero_point",),
        description='compressed-tensors "pack-quantized": 8 int4 per int32, one scale per group',
        packed_suffix="weight_packed",
    ),
    "mxfp4": QuantFormat(
        name="mxfp4",
        tensor_suffixes=("weight_packed", "weight_scale"),
        optional_suffixes=(),
        description='compressed-tensors "mxfp4-pack-quantized": 2 e2m1 per byte, E8M0 scale per 32',
        packed_suffix="weight_packed",
    ),
    "deepseek_v4_fp8": QuantFormat(
        name="deepseek_v4_fp8",
        tensor_suffixes=("weight", "scale"),
        optional_suffixes=(),
        description='DeepSeek-V4 quant_method "fp8" with expert_dtype: float8_e4m3fn weight with a scale per '
                    '128x128 block, or (FP4 routed experts) int8 holding 2 e2m1 per byte with a scale per 32; '
                    'scales E8M0 or float32 under <x>.scale',
    ),
    "gpt_oss_mxfp4": QuantFormat(
        name="gpt_oss_mxfp4",
        tensor_suffixes=("_blocks", "_scales"),
        optional_suffixes=(),
        description='gpt-oss quant_method "mxfp4": fused experts as *_blocks (2 e2m1 per byte, 16 bytes per '
                    'block of 32) and *_scales (E8M0 per block)',
        replaces="",
        packed_suffix="_blocks",
    ),
}

GPT_OSS_BLOCK_BYTES = MXFP4_GROUP_SIZE // 2   # the last axis of a gpt-oss *_blocks tensor


def quant_stem(weight_name: str, format_name: str) -> str | None:
    """The part of a dense tensor name its quantised tensors share in ``format_name`` (``x.`` for
    ``x.weight``; gpt-oss: the whole name), or None for a name the format does not quantise."""
    replaces = _format(format_name).replaces
    if not weight_name.endswith(replaces):
        return None
    return weight_name[: len(weight_name) - len(replaces)]


def companion_tensor_names(weight_name: str, format_name: str) -> tuple[str, ...]:
    """The on-disk tensors holding the Linear whose dense weight is ``weight_name`` (ending in
    ``weight``; gpt-oss: any name) in ``format_name``, required ones only; e.g.
    ``("x.weight", "x.weight_scale_inv")``."""
    stem = quant_stem(weight_name, format_name)
    if stem is None:
        raise CheckpointError(f"{weight_name}: expected a tensor name ending in {_format(format_name).replaces!r}")
    return tuple(stem + suffix for suffix in _format(format_name).tensor_suffixes)


def fused_companions(layout: dict, format_name: str | None) -> dict:
    """A fused-expert layout (`moejax.hf.fused_experts.FusedExpertsReader`'s: stored name -> (per-expert
    templates, rank)) with, for a format stored fused beside the dense names (gpt-oss's), each matrix's
    quantised tensors too: ``gate_up_proj_blocks`` [E, out, in/32, 16] and ``gate_up_proj_scales``
    [E, out, in/32], each expert's slab presented under its per-expert name."""
    if format_name is None or _format(format_name).replaces:
        return layout
    out = dict(layout)
    for stored, (templates, rank) in layout.items():
        if rank == 3:   # a matrix per expert (biases are not quantised)
            out[stored + "_blocks"] = (tuple(t + "_blocks" for t in templates), rank + 1)
            out[stored + "_scales"] = (tuple(t + "_scales" for t in templates), rank)
    return out


def dequant_gpt_oss_mxfp4(blocks: np.ndarray, scales: np.ndarray, *, name: str) -> np.ndarray:
    """One expert's gpt-oss MXFP4 matrix as float32 [in, out] (the dense tensor's layout): blocks
    uint8 [out, in/32, 16] are compressed-tensors' packing with each row's bytes split in blocks of 16
    (low nibble first), scales uint8 [out, in/32] its E8M0 exponents (transformers'
    ``convert_moe_packed_tensors``, then its transpose; `moejax.hf.check` requires in to be a
    multiple of 32)."""
    blocks, scales = np.asarray(blocks), np.asarray(scales)
    if blocks.ndim != 3 or blocks.shape[2] != GPT_OSS_BLOCK_BYTES:
        raise CheckpointError(f"{name}_blocks: shape {list(blocks.shape)}, expected [out, in/32, {GPT_OSS_BLOCK_BYTES}]")
    w = dequant_mxfp4(blocks.reshape(blocks.shape[0], -1), scales, name=name)
    return w.T


def _format(format_name: str) -> QuantFormat:
    try:
        return QUANT_FORMATS[format_name]
    except KeyError:
        raise CheckpointError(
            f"unknown quantisation format {format_name!r}; supported: {sorted(QUANT_FORMATS)}"
        ) from None


_SUPPORTED_CONFIGS = (
    'quant_method "fp8" with weight_block_size (fp8_block; with expert_dtype "fp8" or "fp4": DeepSeek-V4\'s '
    'deepseek_v4_fp8); quant_method "compressed-tensors" with '
    'format "pack-quantized", 4-bit int (int4_pack) or "mxfp4-pack-quantized" (mxfp4); gpt-oss\'s '
    'quant_method "mxfp4" (gpt_oss_mxfp4)'
)

_COMPRESSED_TENSORS_FORMATS = {"pack-quantized": "int4_pack", "mxfp4-pack-quantized": "mxfp4"}


def detect_format(quantization_config: dict | None) -> str | None:
    """The quantisation format of a checkpoint from its config.json ``quantization_config``:
    ``"fp8_block"``, ``"int4_pack"``, ``"mxfp4"``, or None for an unquantised checkpoint (no or an
    empty ``quantization_config``). Anything else raises CheckpointError naming it."""
    if not quantization_config:
        return None
    method = quantization_config.get("quant_method")
    if method == "fp8":
        fmt = _detect_fp8(quantization_config)
        return _detect_deepseek_v4(quantization_config) if "expert_dtype" in quantization_config else fmt
    if method == "compressed-tensors":
        return _detect_compressed_tensors(quantization_config)
    if method == "mxfp4":
        return "gpt_oss_mxfp4"
    raise CheckpointError(
        f"quantization_config: unsupported quant_method {method!r}; supported: {_SUPPORTED_CONFIGS}"
    )


def _detect_fp8(config: dict) -> str:
    fmt = config.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise CheckpointError(f'quantization_config: fp8 fmt {fmt!r} is not supported; expected "e4m3"')
    block = config.get("weight_block_size")
    if block is None or len(block) != 2:
        raise CheckpointError(
            f"quantization_config: fp8 without a 2-entry weight_block_size (got {block!r}) is "
            f"per-tensor FP8, not supported; supported: {_SUPPORTED_CONFIGS}"
        )
    return "fp8_block"


def _detect_deepseek_v4(config: dict) -> str:
    """DeepSeek-V4's FP8 config (transformers' FineGrainedFP8Config with ``expert_dtype``, which
    transformers' DeepseekV4Config moves in from config.json's top level, as
    `moejax.models.deepseek_v4.config` does): its ``.scale`` tensor names and FP4 experts."""
    expert_dtype, scale_fmt = config.get("expert_dtype"), config.get("scale_fmt", "float")
    if expert_dtype not in ("fp8", "fp4"):
        raise CheckpointError(f'quantization_config: expert_dtype {expert_dtype!r}; expected "fp8" or "fp4"')
    if scale_fmt not in ("float", "ue8m0"):
        raise CheckpointError(f'quantization_config: scale_fmt {scale_fmt!r}; expected "float" or "ue8m0"')
    return "deepseek_v4_fp8"


def _detect_compressed_tensors(config: dict) -> str:
    groups = config.get("config_groups") or {}
    fmt = config.get("format")
    if fmt in (None, "mixed-precision"):
        # Newer compressed-tensors writes the format per config group; one shared format is fine.
        group_formats = {group.get("format") for group in groups.values()} - {None}
        if len(group_formats) != 1:
            raise CheckpointError(
                f"quantization_config: compressed-tensors format {fmt!r} with group formats "
                f"{sorted(group_formats)}; expected one of {sorted(_COMPRESSED_TENSORS_FORMATS)}"
            )
        fmt = group_formats.pop()
    if fmt not in _COMPRESSED_TENSORS_FORMATS:
        raise CheckpointError(
            f"quantization_config: unsupported compressed-tensors format {fmt!r}; supported: "
            f"{_SUPPORTED_CONFIGS}"
        )
    if fmt == "pack-quantized":
        for group_name, group in groups.items():
            _check_int4_weights(group_name, group.get("weights") or {})
    return _COMPRESSED_TENSORS_FORMATS[fmt]


def _check_int4_weights(group_name: str, weights: dict) -> None:
    """pack-quantized also carries 8-bit ints and activation-ordered groups; int4_pack decodes
    neither, so refuse them here rather than decode garbage later."""
    bits, kind = weights.get("num_bits", 4), weights.get("type", "int")
    if bits != 4 or kind != "int":
        raise CheckpointError(
            f"quantization_config.config_groups.{group_name}.weights: num_bits {bits!r}, type "
            f"{kind!r}; int4_pack expects num_bits 4, type 'int'"
        )
    if weights.get("actorder") == "group":
        raise CheckpointError(
            f"quantization_config.config_groups.{group_name}.weights: actorder 'group' "
            f"(weight_g_idx) is not supported; expected actorder null or 'weight'"
        )


def read_decoded(reader, name: str, stored: tuple, fmt: str | None, qcfg: dict | None):
    """The tensor `name` as a numpy array, decoded to float32 when stored quantised. `reader`: a
    checkpoint reader (`moejax.hf.io.checkpoint_reader`); `stored`: the on-disk tensors holding `name`
    (`moejax.hf.check.stored_as`). Here, not in the loader, so that JAX-free tools (the data-free
    scores that read expert weights) decode exactly as the model does."""
    if stored == (name,):
        return reader.read(name)
    stem = quant_stem(name, fmt)
    if fmt == "gpt_oss_mxfp4":
        return dequant_gpt_oss_mxfp4(reader.read(stem + "_blocks"), reader.read(stem + "_scales"), name=name)
    if fmt == "fp8_block":
        return dequant_fp8_block(reader.read(name), reader.read(stem + "weight_scale_inv"),
                                 tuple(qcfg["weight_block_size"]), name=name)
    if fmt == "deepseek_v4_fp8":
        return dequant_deepseek_v4(reader.read(name), reader.read(stem + "scale"), tuple(qcfg["weight_block_size"]),
                                   name=name)
    if fmt == "mxfp4":
        return dequant_mxfp4(reader.read(stem + "weight_packed"), reader.read(stem + "weight_scale"), name=name)
    zero_point = reader.read(stem + "weight_zero_point") if stem + "weight_zero_point" in stored else None
    return unpack_int4(reader.read(stem + "weight_packed"), reader.read(stem + "weight_scale"),
                       reader.read(stem + "weight_shape"), int4_group_size(qcfg),
                       weight_zero_point=zero_point, name=name)


def int4_group_size(qcfg: dict) -> int:
    """The one weights.group_size of an int4_pack quantization_config."""
    sizes = {g.get("weights", {}).get("group_size") for g in (qcfg.get("config_groups") or {}).values()} - {None}
    if len(sizes) != 1:
        raise CheckpointError(f"quantization_config: expected one weights.group_size across config_groups, "
                              f"got {sorted(sizes)}")
    return sizes.pop()

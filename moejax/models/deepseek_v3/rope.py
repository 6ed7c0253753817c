"""Rotary position embedding of the DeepSeek-V3 family: default and YaRN (transformers'
`modeling_rope_utils`), applied interleaved (DeepSeek weights) or half-split."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from moejax.models.deepseek_v3.config import DeepseekV3Config, yarn_mscale


def inv_freq_and_attention_factor(cfg: DeepseekV3Config) -> tuple[np.ndarray, float]:
    """inv_freq [d/2] (float32) and the factor that scales cos/sin, d = qk_rope_head_dim."""
    d, rope = cfg.qk_rope_head_dim, cfg.rope
    exponents = np.arange(0, d, 2, dtype=np.float32) / np.float32(d)
    pos_freqs = np.float32(rope.theta) ** exponents
    if rope.rope_type == "default":
        return (1.0 / pos_freqs).astype(np.float32), 1.0

    def correction_dim(n_rot):
        return d * math.log(rope.original_max_position_embeddings / (n_rot * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(d // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    extrapolation = 1 - ramp
    inv_freq = (1 / (rope.factor * pos_freqs)) * (1 - extrapolation) + (1 / pos_freqs) * extrapolation
    factor = rope.attention_factor
    if factor is None:
        if rope.mscale and rope.mscale_all_dim:
            factor = yarn_mscale(rope.factor, rope.mscale) / yarn_mscale(rope.factor, rope.mscale_all_dim)
        else:
            factor = yarn_mscale(rope.factor)
    return inv_freq.astype(np.float32), float(factor)


def cos_sin(cfg: DeepseekV3Config, positions, dtype):
    """cos, sin [..., d] (the half-angle table repeated twice), scaled by the attention factor, for
    positions of any shape: [S] (every row at 0..S-1) or [B, S] (per-row positions, as generation
    with left padding uses)."""
    inv_freq, factor = inv_freq_and_attention_factor(cfg)
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return (jnp.cos(emb) * factor).astype(dtype), (jnp.sin(emb) * factor).astype(dtype)


def apply_rope(x_BSNQ, cos, sin, interleave: bool):
    """Rotate the rope part of queries/keys x [B, S, N, Q]; cos/sin [S, Q] or [B, S, Q].
    Interleaved: pairs (2i, 2i+1) rotate together and the output is laid out half-split (evens
    then odds), exactly as transformers does; q and k are permuted alike, so q.k is unchanged."""
    cos, sin = cos[..., None, :], sin[..., None, :]  # broadcast over heads
    if interleave:
        half = x_BSNQ.shape[-1] // 2
        x1, x2 = x_BSNQ[..., 0::2], x_BSNQ[..., 1::2]
        c, s = cos[..., :half], sin[..., :half]
        return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    half = x_BSNQ.shape[-1] // 2
    rotated = jnp.concatenate([-x_BSNQ[..., half:], x_BSNQ[..., :half]], axis=-1)
    return x_BSNQ * cos + rotated * sin

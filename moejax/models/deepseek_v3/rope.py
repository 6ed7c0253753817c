"""Rotary position embedding of the DeepSeek-V3 family: default and YaRN (transformers'
`modeling_rope_utils`), applied interleaved (DeepSeek weights) or half-split."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from moejax.models import rope
from moejax.models.deepseek_v3.config import DeepseekV3Config


def inv_freq_and_attention_factor(cfg: DeepseekV3Config) -> tuple[np.ndarray, float]:
    """inv_freq [d/2] (float32) and the factor that scales cos/sin, d = qk_rope_head_dim."""
    return rope.inv_freq_and_attention_factor(cfg.qk_rope_head_dim, cfg.rope)


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

"""Rotary tables shared by the families: the inverse frequencies of the default rope and of YaRN
(transformers' `modeling_rope_utils`: `_compute_default_rope_parameters`, `_compute_yarn_parameters`)
for a rotary width `dim`, and the factor YaRN scales cos/sin by. Settings: `moejax.models.rope_settings`."""

from __future__ import annotations

import math

import numpy as np

from moejax.models.rope_settings import RopeConfig, yarn_mscale


def inv_freq_and_attention_factor(dim: int, rope: RopeConfig) -> tuple[np.ndarray, float]:
    """inv_freq [dim/2] (float32) and the factor that scales cos/sin (1 for the default rope)."""
    exponents = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    pos_freqs = np.float32(rope.theta) ** exponents
    if rope.rope_type == "default":
        return (1.0 / pos_freqs).astype(np.float32), 1.0

    def correction_dim(n_rot):
        return dim * math.log(rope.original_max_position_embeddings / (n_rot * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    extrapolation = 1 - ramp
    inv_freq = (1 / (rope.factor * pos_freqs)) * (1 - extrapolation) + (1 / pos_freqs) * extrapolation
    factor = rope.attention_factor
    if factor is None:
        if rope.mscale and rope.mscale_all_dim:
            factor = yarn_mscale(rope.factor, rope.mscale) / yarn_mscale(rope.factor, rope.mscale_all_dim)
        else:
            factor = yarn_mscale(rope.factor)
    return inv_freq.astype(np.float32), float(factor)

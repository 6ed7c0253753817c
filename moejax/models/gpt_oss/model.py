"""gpt-oss in Flax NNX: the shared decoder stack with grouped-query attention (biases, sinks, a
sliding window on the `sliding_attention` layers) and YaRN rope over the whole head."""

import jax.numpy as jnp

from moejax.models import rope
from moejax.models.causal_lm import CausalLM
from moejax.models.gpt_oss.config import GptOssConfig
from moejax.models.gqa_attention import GQAttention


def rope_tables(cfg: GptOssConfig, positions, dtype):
    """cos, sin [..., head_dim] of YaRN (or the default rope), scaled by YaRN's attention factor, in
    float32 and then cast, as transformers' `GptOssRotaryEmbedding` (whose half-width tables and
    `_apply_rotary_emb` are the half-split rotation `apply_rope` does)."""
    inv_freq, factor = rope.inv_freq_and_attention_factor(cfg.resolved_head_dim, cfg.rope)
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return (jnp.cos(emb) * factor).astype(dtype), (jnp.sin(emb) * factor).astype(dtype)


class GptOssForCausalLM(CausalLM):
    config_class = GptOssConfig
    attention_class = GQAttention
    rope_tables = staticmethod(rope_tables)

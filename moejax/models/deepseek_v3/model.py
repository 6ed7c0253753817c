"""DeepSeek-V3 family in Flax NNX: MLA attention on the shared decoder stack
(`moejax.models.causal_lm`: dense first layers, the MoE block with its sigmoid router, balance
bias, groups and shared experts).

Weights are stored [in, out] (x @ W). The forward follows transformers' eager implementation
(ref: shared/reference/deepseek-v3-hf.md section 2).

    model = moejax.from_pretrained(path, dtype=jnp.float32)   # a DeepSeek-V3 checkpoint: this class
    logits_BSV = model(input_ids_BS, attention_mask_BS, variant).logits_BSV
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.models.causal_lm import CausalLM
from moejax.models.deepseek_v3 import rope as rope_lib
from moejax.models.deepseek_v3.config import DeepseekV3Config
from moejax.models.layers import HIGHEST, RMSNorm, causal_attention, linear
from moejax.models.layers import param as _param

LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm use the class default, not rms_norm_eps


class MLA(nnx.Module):
    """Multi-head latent attention (with or without a q LoRA)."""

    def __init__(self, cfg: DeepseekV3Config, dtype, rngs: nnx.Rngs, layer: int = 0):
        H, nh = cfg.hidden_size, cfg.num_attention_heads
        self.cfg = cfg
        if cfg.q_lora_rank is None:
            self.q_proj = _param(rngs, (H, nh * cfg.qk_head_dim), dtype)
        else:
            self.q_a_proj = _param(rngs, (H, cfg.q_lora_rank), dtype)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS, dtype)
            self.q_b_proj = _param(rngs, (cfg.q_lora_rank, nh * cfg.qk_head_dim), dtype)
        self.kv_a_proj_with_mqa = _param(rngs, (H, cfg.kv_lora_rank + cfg.qk_rope_head_dim), dtype)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, LATENT_NORM_EPS, dtype)
        self.kv_b_proj = _param(rngs, (cfg.kv_lora_rank, nh * (cfg.qk_nope_head_dim + cfg.v_head_dim)), dtype)
        self.o_proj = _param(rngs, (nh * cfg.v_head_dim, H), dtype)
        if cfg.attention_bias:
            zeros = lambda n: nnx.Param(jnp.zeros((n,), dtype))  # noqa: E731
            if cfg.q_lora_rank is not None:
                self.q_a_proj_bias = zeros(cfg.q_lora_rank)
            self.kv_a_proj_with_mqa_bias = zeros(cfg.kv_lora_rank + cfg.qk_rope_head_dim)
            self.o_proj_bias = zeros(H)

    @staticmethod
    def empty_cache(cfg, batch: int, length: int, dtype) -> "LatentCache":
        """kv_lora_rank + qk_rope_head_dim numbers per token (the latent and the shared rope key)."""
        return LatentCache(jnp.zeros((batch, length, cfg.kv_lora_rank), dtype),
                           jnp.zeros((batch, length, cfg.qk_rope_head_dim), dtype))

    def _bias(self, name):
        b = getattr(self, name + "_bias", None)
        return None if b is None else b[...]

    def q_lora(self, x_BSH):
        """The normalised query LoRA q_a_layernorm(q_a_proj(x)) [B, S, q_lora_rank] (what q_b_proj
        reads, and DSA's lightning indexer too)."""
        return self.q_a_layernorm(linear(x_BSH, self.q_a_proj[...], self._bias("q_a_proj")))

    def _project(self, x_BSH, cos, sin, q_lora_BSR=None):
        """Queries split into their no-rope part [B, S, N, dn] and rotated rope part [B, S, N, dr],
        the normalised KV latent [B, S, R] and the rotated shared rope key [B, S, dr]: everything
        attention needs, and (latent, rope key) is all a cache must keep. q_lora_BSR: `q_lora(x)`
        when the caller has it already."""
        cfg = self.cfg
        B, S, _ = x_BSH.shape
        nh, dn, dr = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        if cfg.q_lora_rank is None:
            q = linear(x_BSH, self.q_proj[...])
        else:
            q = linear(self.q_lora(x_BSH) if q_lora_BSR is None else q_lora_BSR, self.q_b_proj[...])
        q = q.reshape(B, S, nh, dn + dr)                                # per head: [nope | rope]
        q_pass, q_rot = q[..., :dn], q[..., dn:]
        ckv = linear(x_BSH, self.kv_a_proj_with_mqa[...], self._bias("kv_a_proj_with_mqa"))
        kv_latent, k_rot = ckv[..., :cfg.kv_lora_rank], ckv[..., cfg.kv_lora_rank:]
        q_rot = rope_lib.apply_rope(q_rot, cos, sin, cfg.rope_interleave)
        k_rot = rope_lib.apply_rope(k_rot[:, :, None, :], cos, sin, cfg.rope_interleave)[:, :, 0]  # one shared head
        return q_pass, q_rot, self.kv_a_layernorm(kv_latent), k_rot

    def __call__(self, x_BSH, cos, sin, allowed_BSS):
        """Attention over the keys of the same sequence, each head's keys and values expanded from
        the latent (as transformers computes it). cos/sin [S, dr] or [B, S, dr]."""
        return self._expanded_attention(*self._project(x_BSH, cos, sin), allowed_BSS)

    def _expanded_attention(self, q_pass, q_rot, latent, k_rot, allowed_BSS):
        cfg = self.cfg
        B, S = latent.shape[:2]
        nh, dn, dr, dv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        kv = linear(latent, self.kv_b_proj[...]).reshape(B, S, nh, dn + dv)
        k_nope, v = kv[..., :dn], kv[..., dn:]                          # per head: [k_nope | v]
        q = jnp.concatenate([q_pass, q_rot], axis=-1)
        k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rot[:, :, None], (B, S, nh, dr))], axis=-1)
        o = causal_attention(q, k, v, allowed_BSS, cfg.softmax_scale()).reshape(B, S, nh * dv)
        return linear(o, self.o_proj[...], self._bias("o_proj"))

    def prefill(self, x_BSH, cos, sin, allowed_BSS, cache: "LatentCache"):
        """`__call__` on a prompt that also writes its latents into cache columns 0..S-1:
        (output, cache)."""
        q_pass, q_rot, latent, k_rot = self._project(x_BSH, cos, sin)
        cache = write_latents(cache, latent, k_rot, 0)
        return self._expanded_attention(q_pass, q_rot, latent, k_rot, allowed_BSS), cache

    def decode(self, x_B1H, cos, sin, cache: "LatentCache", column, allowed_B1C):
        """One new token per row, written into cache column `column`, attending to the cache's C
        columns where allowed_B1C. "Absorbed" MLA, as DeepSeek's own inference decodes: the
        per-head key projection is folded into the query (q_nope W_uk: scores against the latent
        itself) and the value projection is applied after the weighted sum of latents, so only
        kv_lora_rank + qk_rope_head_dim numbers per token are cached and nothing is expanded.
        Equal to `__call__` up to float rounding. Returns (output, updated cache)."""
        q_pass, q_rot, latent, k_rot = self._project(x_B1H, cos, sin)
        cache = write_latents(cache, latent, k_rot, column)
        return self._absorbed_attention(q_pass, q_rot, cache, allowed_B1C), cache

    def _absorbed_attention(self, q_pass, q_rot, cache: "LatentCache", allowed_B1C):
        """`decode`'s attention of the new queries over the cache's C columns where allowed_B1C."""
        cfg = self.cfg
        B, S = q_pass.shape[:2]
        nh, dn, dv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
        w_kv_b = self.kv_b_proj[...].reshape(cfg.kv_lora_rank, nh, dn + dv)  # [R, N, dn + dv]
        q_latent = jnp.einsum("bsnq,rnq->bnsr", q_pass, w_kv_b[..., :dn], precision=HIGHEST)
        scores = (jnp.einsum("bnsr,bcr->bnsc", q_latent, cache.latent_BCR, precision=HIGHEST)
                  + jnp.einsum("bsnq,bcq->bnsc", q_rot, cache.rope_BCQ, precision=HIGHEST)) * cfg.softmax_scale()
        scores = jnp.where(allowed_B1C[:, None], scores, jnp.finfo(scores.dtype).min)
        weights = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(q_pass.dtype)
        o_latent = jnp.einsum("bnsc,bcr->bsnr", weights, cache.latent_BCR, precision=HIGHEST)
        o = jnp.einsum("bsnr,rnu->bsnu", o_latent, w_kv_b[..., dn:], precision=HIGHEST).reshape(B, S, nh * dv)
        return linear(o, self.o_proj[...], self._bias("o_proj"))


class LatentCache(NamedTuple):
    """One MLA layer's KV cache: the normalised KV latent [B, C, R] (R = kv_lora_rank) and the
    rotated shared rope key [B, C, dr] of every cached token (C columns, preallocated)."""

    latent_BCR: jax.Array
    rope_BCQ: jax.Array


def write_latents(cache: LatentCache, latent_BSR, k_rot_BSQ, column) -> LatentCache:
    """The cache with S new tokens' latents and rope keys written into columns column..column+S-1."""
    return LatentCache(
        jax.lax.dynamic_update_slice(cache.latent_BCR, latent_BSR.astype(cache.latent_BCR.dtype), (0, column, 0)),
        jax.lax.dynamic_update_slice(cache.rope_BCQ, k_rot_BSQ.astype(cache.rope_BCQ.dtype), (0, column, 0)))


class DeepseekV3ForCausalLM(CausalLM):
    """DeepSeek-V3, Kimi-K2, Moonlight: `model(input_ids, attention_mask).logits_BSV`."""

    config_class = DeepseekV3Config
    attention_class = MLA
    rope_tables = staticmethod(rope_lib.cos_sin)

"""Grouped-query attention as the Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE and GLM-4.5 families compute it
(transformers' eager forward): q/k/v projections (optional biases), optional q/k RMSNorm (over each
head, or over the whole projection as OLMoE does), the default rope on the first `rotary_dim`
channels of each head (half-split; GLM-4.5 rotates half of each head), key/value heads shared by
num_attention_heads / num_key_value_heads query heads, softmax(q k^T / sqrt(head_dim)) v; gpt-oss adds a learned sink logit per head to every softmax and a
sliding window on some layers (`cfg.attention_window(layer)`).

N query heads, Q = head_dim; the cache keeps keys (after norm and rope) and values of the
num_key_value_heads heads.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moejax.models.layers import (RMSNorm, cached_attention, causal_attention, linear, param, within_window,
                                  zeros)


class KVLayerCache(NamedTuple):
    """One layer's cache: keys and values [B, C, kv heads, head_dim] of every cached token."""

    k_BCNQ: jax.Array
    v_BCNQ: jax.Array


def rope_tables(cfg, positions, dtype):
    """cos, sin [..., rotary_dim] of the default rope (theta = cfg.rope_theta) for positions [S] or
    [B, S], computed in float32 as transformers does, then cast."""
    dim = cfg.rotary_dim
    inv_freq = 1.0 / (np.float32(cfg.rope_theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq.astype(np.float32))
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def apply_rope(x_BSNQ, cos, sin):
    """Rotate the first cos.shape[-1] channels of each head (half-split pairs); the rest pass."""
    d = cos.shape[-1]
    cos, sin = cos[..., None, :], sin[..., None, :]
    rot, rest = x_BSNQ[..., :d], x_BSNQ[..., d:]
    rotated = jnp.concatenate([-rot[..., d // 2:], rot[..., :d // 2]], axis=-1)
    return jnp.concatenate([rot * cos + rotated * sin, rest], axis=-1)


class GQAttention(nnx.Module):
    def __init__(self, cfg, dtype, rngs: nnx.Rngs, layer: int = 0):
        H, N, Nk, Q = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.resolved_head_dim
        self.n_heads, self.n_kv, self.head_dim = N, Nk, Q
        self.window = cfg.attention_window(layer)  # None: full attention
        if cfg.attention_sinks:
            self.sinks = param(rngs, (N,), dtype)
        self.output_gate = cfg.attention_output_gate  # q_proj also gives each head's output gate
        self.q_proj = param(rngs, (H, N * Q * (2 if self.output_gate else 1)), dtype)
        self.k_proj = param(rngs, (H, Nk * Q), dtype)
        self.v_proj = param(rngs, (H, Nk * Q), dtype)
        self.o_proj = param(rngs, (N * Q, H), dtype)
        if cfg.qkv_bias:
            self.q_proj_bias, self.k_proj_bias, self.v_proj_bias = (zeros((n,), dtype) for n in (N * Q, Nk * Q, Nk * Q))
        if cfg.o_bias:
            self.o_proj_bias = zeros((H,), dtype)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm == "head":
            self.q_norm = RMSNorm.of(cfg, Q, dtype)
            self.k_norm = RMSNorm.of(cfg, Q, dtype)
        elif cfg.qk_norm == "full":
            self.q_norm = RMSNorm.of(cfg, N * Q, dtype)
            self.k_norm = RMSNorm.of(cfg, Nk * Q, dtype)

    @staticmethod
    def empty_cache(cfg, batch: int, length: int, dtype) -> KVLayerCache:
        shape = (batch, length, cfg.num_key_value_heads, cfg.resolved_head_dim)
        return KVLayerCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

    def _bias(self, name):
        b = getattr(self, name + "_bias", None)
        return None if b is None else b[...]

    def _project(self, x_BSH, cos, sin):
        """q [B, S, N, Q], k and v [B, S, kv heads, Q], q and k normalised and rotated; and the
        output gate [B, S, N * Q] (Qwen3-Next: q_proj gives each head's query, then its gate), or None."""
        B, S, _ = x_BSH.shape
        q = linear(x_BSH, self.q_proj[...], self._bias("q_proj"))
        gate = None
        if self.output_gate:
            q, gate = jnp.split(q.reshape(B, S, self.n_heads, 2 * self.head_dim), 2, axis=-1)
            q, gate = q.reshape(B, S, -1), gate.reshape(B, S, -1)
        k = linear(x_BSH, self.k_proj[...], self._bias("k_proj"))
        v = linear(x_BSH, self.v_proj[...], self._bias("v_proj")).reshape(B, S, self.n_kv, self.head_dim)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.reshape(B, S, self.n_heads, self.head_dim)
        k = k.reshape(B, S, self.n_kv, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, gate

    def _sinks(self):
        sinks = getattr(self, "sinks", None)
        return None if sinks is None else sinks[...]

    def _attend(self, q, k, v, allowed_BSS):
        """The whole sequence: query column s against key columns 0..s, within the window."""
        allowed = within_window(allowed_BSS, jnp.arange(allowed_BSS.shape[1]), self.window)
        return causal_attention(q, self._shared(k), self._shared(v), allowed, self.head_dim ** -0.5,
                                sinks_N=self._sinks())

    def _shared(self, kv):  # each key/value head serves n_heads / n_kv query heads, in order
        return jnp.repeat(kv, self.n_heads // self.n_kv, axis=2)

    def _out(self, o_BSNQ, gate):
        B, S = o_BSNQ.shape[:2]
        o = o_BSNQ.reshape(B, S, self.n_heads * self.head_dim)
        if gate is not None:
            o = o * jax.nn.sigmoid(gate)
        return linear(o, self.o_proj[...], self._bias("o_proj"))

    def __call__(self, x_BSH, cos, sin, allowed_BSS):
        q, k, v, gate = self._project(x_BSH, cos, sin)
        return self._out(self._attend(q, k, v, allowed_BSS), gate)

    def prefill(self, x_BSH, cos, sin, allowed_BSS, cache: KVLayerCache):
        """`__call__` on a prompt that also writes its keys and values into cache columns 0..S-1."""
        q, k, v, gate = self._project(x_BSH, cos, sin)
        cache = KVLayerCache(jax.lax.dynamic_update_slice(cache.k_BCNQ, k.astype(cache.k_BCNQ.dtype), (0, 0, 0, 0)),
                             jax.lax.dynamic_update_slice(cache.v_BCNQ, v.astype(cache.v_BCNQ.dtype), (0, 0, 0, 0)))
        return self._out(self._attend(q, k, v, allowed_BSS), gate), cache

    def decode(self, x_B1H, cos, sin, cache: KVLayerCache, column, allowed_B1C):
        """One new token per row, written into cache column `column`, attending to the cache's
        columns where allowed_B1C: (output, cache)."""
        q, k, v, gate = self._project(x_B1H, cos, sin)
        cache = KVLayerCache(
            jax.lax.dynamic_update_slice(cache.k_BCNQ, k.astype(cache.k_BCNQ.dtype), (0, column, 0, 0)),
            jax.lax.dynamic_update_slice(cache.v_BCNQ, v.astype(cache.v_BCNQ.dtype), (0, column, 0, 0)))
        allowed = within_window(allowed_B1C, jnp.reshape(column, (1,)), self.window)
        o = cached_attention(q, self._shared(cache.k_BCNQ), self._shared(cache.v_BCNQ), allowed,
                             self.head_dim ** -0.5, sinks_N=self._sinks())
        return self._out(o, gate), cache

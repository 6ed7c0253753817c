"""Building blocks every family shares, written once: matmul, RMSNorm, the SwiGLU MLP, the causal
mask and causal attention (transformers' order of operations), parameter initialisers.

Weights are stored [in, out] (x @ W)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.moe import dispatch as dispatch_lib

HIGHEST = jax.lax.Precision.HIGHEST


def param(rngs: nnx.Rngs, shape, dtype, std=0.02):
    return nnx.Param(jax.random.normal(rngs.params(), shape, jnp.float32).astype(dtype) * std)


def ones(shape, dtype):
    return nnx.Param(jnp.ones(shape, dtype))


def zeros(shape, dtype):
    return nnx.Param(jnp.zeros(shape, dtype))


def linear(x, w, b=None):
    y = jnp.matmul(x, w, precision=HIGHEST)
    return y if b is None else y + b


def rms_norm(x, w, eps, scale_in_float32: bool = False, plus_one: bool = False):
    """transformers' RMSNorm: normalise in float32, cast back, then scale (order matters in bf16);
    scale_in_float32: scale in float32, then cast back (gpt-oss's and Qwen3-Next's order);
    plus_one: the scale is 1 + w (Qwen3-Next's zero-centred weight)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if scale_in_float32 or plus_one:
        scale = w.astype(jnp.float32)
        return ((1.0 + scale if plus_one else scale) * xf).astype(x.dtype)
    return w * xf.astype(x.dtype)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype, scale_in_float32: bool = False, plus_one: bool = False):
        self.weight = (zeros if plus_one else ones)((dim,), dtype)  # the identity either way
        self.eps = eps
        self.scale_in_float32, self.plus_one = scale_in_float32, plus_one

    @classmethod
    def of(cls, cfg, dim: int, dtype) -> "RMSNorm":
        """The family's RMSNorm (its order of operations and weight convention, read off the config)."""
        return cls(dim, cfg.rms_norm_eps, dtype, cfg.NORM_SCALES_IN_FLOAT32, cfg.NORM_PLUS_ONE)

    def __call__(self, x):
        return rms_norm(x, self.weight[...], self.eps, self.scale_in_float32, self.plus_one)


class MLP(nnx.Module):
    """SwiGLU MLP: the dense layers and the shared experts. fn: the SwiGLU's form (`expert_fn(linear,
    w, x)` of `moejax.moe.dispatch` on gate/up/down; DeepSeek-V4's shared expert clamps, `LimitedSwiglu`)."""

    def __init__(self, hidden: int, inner: int, dtype, rngs: nnx.Rngs, fn=dispatch_lib.swiglu):
        self.gate_proj = param(rngs, (hidden, inner), dtype)
        self.up_proj = param(rngs, (hidden, inner), dtype)
        self.down_proj = param(rngs, (inner, hidden), dtype)
        self.fn = fn

    def __call__(self, x):
        w = {"gate": self.gate_proj[...], "up": self.up_proj[...], "down": self.down_proj[...]}
        return self.fn(linear, w, x)


def within_window(allowed_BSC, query_columns_S, window: int | None):
    """allowed narrowed to a sliding window: query column q sees key column c only when
    q - c < window (transformers' `sliding_window_overlay`; columns, not positions, so left padding
    shifts nothing: a row's real tokens are consecutive columns). window None: unchanged."""
    if window is None:
        return allowed_BSC
    keys_C = jnp.arange(allowed_BSC.shape[-1])
    return allowed_BSC & ((jnp.asarray(query_columns_S)[:, None] - keys_C[None, :]) < window)[None]


def causal_allowed(attention_mask_BS, B: int, S: int):
    """bool [B, S, S]: query s may attend to key s' <= s that is not padding (mask 0)."""
    allowed = jnp.tril(jnp.ones((S, S), bool))[None]
    if attention_mask_BS is not None:
        allowed = allowed & jnp.asarray(attention_mask_BS).astype(bool)[:, None, :]
    return jnp.broadcast_to(allowed, (B, S, S))


def attention_weights(scores_BNSC, dtype, sinks_N=None):
    """softmax over the keys in float32, cast to `dtype`. sinks_N: a learned logit per head (gpt-oss's
    attention sinks) that joins every row's softmax as one more column and is then dropped, so a
    row's weights sum to less than 1 (transformers' `eager_attention_forward` of gpt-oss)."""
    scores = scores_BNSC.astype(jnp.float32)
    if sinks_N is None:
        return jax.nn.softmax(scores, axis=-1).astype(dtype)
    sink = jnp.broadcast_to(sinks_N.astype(jnp.float32)[None, :, None, None], scores.shape[:-1] + (1,))
    return jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1].astype(dtype)


def causal_attention(q_BSNQ, k_BSNQ, v_BSNU, allowed_BSS, scale: float, block_rows: int = 256, sinks_N=None):
    """softmax(q k^T * scale, masked) v per head (N heads, Q query/key and U value channels), in
    transformers' order of operations (scores scaled after the matmul, softmax in float32, weights
    cast back before multiplying v); with `sinks_N`, each head's sink logit joins the softmax
    (`attention_weights`).

    allowed_BSS: True where query s may attend to key s'. It must be causal (False above the
    diagonal, padding may remove more): queries run in blocks of `block_rows`, and each block
    computes scores only for the keys up to its last query, so the masked upper triangle is neither
    multiplied nor exponentiated (about half the work). The arrays are head-major inside, where
    XLA:CPU runs both matmuls fastest (0.19 s against 0.41 s for the whole [S, S] in sequence-major
    layout at 2,048 tokens, Moonlight's 16 heads). A query that may attend to no key (left padding)
    gets uniform weights over its block's keys instead of over all keys: padding output either way.
    """
    B, S = q_BSNQ.shape[:2]
    q, k, v = (jnp.swapaxes(a, 1, 2) for a in (q_BSNQ, k_BSNQ, v_BSNU))  # [B, heads, S, d]
    block_rows = max(block_rows, -(-S // 16))  # at most 16 blocks: each is compiled separately
    bounds = list(range(0, S, block_rows)) + [S]
    outs = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        scores = jnp.einsum("bnqd,bnkd->bnqk", q[:, :, lo:hi], k[:, :, :hi], precision=HIGHEST) * scale
        scores = jnp.where(allowed_BSS[:, None, lo:hi, :hi], scores, jnp.finfo(scores.dtype).min)
        weights = attention_weights(scores, q.dtype, sinks_N)
        outs.append(jnp.einsum("bnqk,bnkc->bnqc", weights, v[:, :, :hi], precision=HIGHEST))
    return jnp.swapaxes(jnp.concatenate(outs, axis=2), 1, 2)


def cached_attention(q_BSNQ, k_BCNQ, v_BCNU, allowed_BSC, scale: float, sinks_N=None):
    """Attention of S new queries over C cache columns (decoding): softmax in float32, masked
    columns (not written yet, padding, or after the query) excluded; sinks as `causal_attention`."""
    scores = jnp.einsum("bsnq,bcnq->bnsc", q_BSNQ, k_BCNQ, precision=HIGHEST) * scale
    scores = jnp.where(allowed_BSC[:, None], scores, jnp.finfo(scores.dtype).min)
    weights = attention_weights(scores, q_BSNQ.dtype, sinks_N)
    return jnp.einsum("bnsc,bcnu->bsnu", weights, v_BCNU, precision=HIGHEST)

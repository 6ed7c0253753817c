"""Manifold-constrained hyper-connections (mHC; DeepSeek-V4 paper section 2.2, Xie et al. 2026), as
transformers' `DeepseekV4HyperConnection` and `DeepseekV4HyperHead` compute them, in float32.

The residual is W = hc_mult parallel streams [B, S, W, H]. Before each block (attention, MoE) a
one-layer perceptron of the RMS-normed, flattened streams gives three mappings per token:

    pre  [W]     = sigmoid(pre_w * scale[0] + base_pre) + eps        collapses the W streams into the
                                                                      block's input: sum_j pre_j x_j
    post [W]     = 2 sigmoid(post_w * scale[1] + base_post)           spreads the block's output to W
    comb [W, W]  = Sinkhorn(softmax(comb_w * scale[2] + base_comb) + eps)   mixes the streams

and the layer's output is  out_k = post_k * block(collapsed) + sum_j comb[j, k] x_j  (comb applied
transposed: Sinkhorn's result is doubly stochastic but not symmetric). Sinkhorn-Knopp (t_max =
`hc_sinkhorn_iters`) projects comb onto the doubly-stochastic matrices: first a column
normalisation, then t_max - 1 rounds of row and column normalisations, each denominator + eps, so
the mixing cannot grow the residual's norm across deep stacks. The final head collapses the streams
once more with its own `pre` (no post, no comb).

Private shape letter (over the package legend, in this module and `model.py`): W the
hyper-connection streams (hc_mult).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moejax.models.layers import linear


def unweighted_rms(x, eps: float):
    """x / rms(x) over the last axis, the rms in float32 (transformers' `DeepseekV4UnweightedRMSNorm`)."""
    xf = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps).astype(x.dtype)


def sinkhorn(comb_BSWW, iters: int, eps: float):
    """Sinkhorn-Knopp onto (nearly) doubly-stochastic matrices: columns, then `iters - 1` rounds of
    rows and columns, each sum + eps (transformers' order)."""
    comb = comb_BSWW / (jnp.sum(comb_BSWW, axis=-2, keepdims=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (jnp.sum(comb, axis=-1, keepdims=True) + eps)
        comb = comb / (jnp.sum(comb, axis=-2, keepdims=True) + eps)
    return comb


def hc_mappings(x_BSWH, fn_IJ, base_J, scale_3, iters: int, eps: float, rms_eps: float):
    """(post [B, S, W], comb [B, S, W, W], collapsed block input [B, S, H]) of the streams x
    (transformers' `DeepseekV4HyperConnection.forward`). fn [W H, (2 + W) W] (moejax's [in, out])."""
    B, S, W, H = x_BSWH.shape
    flat = unweighted_rms(x_BSWH.reshape(B, S, W * H).astype(jnp.float32), rms_eps)
    mixes = linear(flat, fn_IJ.astype(jnp.float32))
    pre_w, post_w, comb_w = mixes[..., :W], mixes[..., W:2 * W], mixes[..., 2 * W:].reshape(B, S, W, W)
    pre_b, post_b, comb_b = base_J[:W], base_J[W:2 * W], base_J[2 * W:].reshape(W, W)
    pre = jax.nn.sigmoid(pre_w * scale_3[0] + pre_b) + eps
    post = 2 * jax.nn.sigmoid(post_w * scale_3[1] + post_b)
    comb = sinkhorn(jax.nn.softmax(comb_w * scale_3[2] + comb_b, axis=-1) + eps, iters, eps)
    collapsed = jnp.sum(pre[..., None] * x_BSWH, axis=2).astype(x_BSWH.dtype)
    return post, comb, collapsed


def hc_residual(x_BSWH, out_BSH, post_BSW, comb_BSWW):
    """The streams after a block: post_k * out + sum_j comb[j, k] x_j (mappings cast to the streams' dtype)."""
    dtype = x_BSWH.dtype
    return post_BSW.astype(dtype)[..., None] * out_BSH[:, :, None, :] + jnp.einsum(
        "bsjk,bsjh->bskh", comb_BSWW.astype(dtype), x_BSWH, precision=jax.lax.Precision.HIGHEST)


def hc_head(x_BSWH, fn_IW, base_W, scale_1, eps: float, rms_eps: float):
    """The final collapse of the streams into one [B, S, H] (transformers' `DeepseekV4HyperHead`)."""
    B, S, W, H = x_BSWH.shape
    flat = unweighted_rms(x_BSWH.reshape(B, S, W * H).astype(jnp.float32), rms_eps)
    pre = jax.nn.sigmoid(linear(flat, fn_IW.astype(jnp.float32)) * scale_1.astype(jnp.float32)
                         + base_W.astype(jnp.float32)) + eps
    return jnp.sum(pre[..., None] * x_BSWH, axis=2).astype(x_BSWH.dtype)

"""DeepSeek-V4's attention (paper section 2.3), as transformers 5.24's `DeepseekV4Attention` computes
it on a whole sequence (no cache), in its order of operations:

    q    = rope(rms(q_b(rms_w(q_a(x)))))               [B, S, N, Q]  per-head unweighted RMSNorm
    kv   = rope(rms_w(kv_proj(x)))                     [B, S, Q]     one head, read as key AND value
    keys = kv of the sliding window (q - c < window, padding excluded)
           + compressed entries (CSA / HCA layers; no padding mask: transformers' compressors
             pool every column, padding included, and gate entries by position only)
    o    = softmax(q keys^T / sqrt(Q), a sink logit per head) keys
    o    = rope(o, at -position)                       undoes kv's rotation carried into o
    out  = o_b(group-wise o_a(o))                      grouped low-rank output (section 2.3.1)

rope: interleaved pairs (2i, 2i+1) on the last `rope_dim` channels of a head; "main" base in
sliding layers, "compress" base (and YaRN) in CSA / HCA layers, their compressors and indexer.

Compressed entries (`compress`): every `m` tokens one entry, a softmax-gated sum of its window's
projected tokens, per channel, with a learned position bias [m, ...] added to the gate logits, then
an RMSNorm and rope at position w * m. CSA (m = 4) pools 2m slots: the previous window's first
series (Ca) and its own second series (Cb), so windows overlap; HCA (m' = 128) pools its own m'.
A query at position t sees entry w only when w < (t + 1) // m (the entry's tokens are all at or
before t). CSA's lightning indexer scores each query against its own compressed keys,
sum_h w_{t,h} ReLU(q_{t,h} . k_s) (eq. 14-17), and the query attends to its `index_topk` best
visible entries only; HCA's entries are all visible.

Shape letters: the package legend, Q a head's width (head_dim, or index_head_dim), R a latent rank
(q_lora_rank, o_lora_rank), and, private to this module, O compressed entries and G output groups.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moejax.models import rope as rope_lib
from moejax.models.deepseek_v4.hyper import unweighted_rms
from moejax.models.layers import HIGHEST, attention_weights, linear, param, rms_norm, within_window

CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"


def rope_interleaved(x, cos, sin):
    """Rotate the pairs (2i, 2i+1) of x's last 2 * cos.shape[-1] channels by angle i (cos, sin [...,
    R/2] broadcast against x's leading axes), in float32, leaving the first channels as they are
    (transformers' V4 `apply_rotary_pos_emb`: `x * cos + rotate_half(x) * sin`, repeat-interleaved)."""
    width = 2 * cos.shape[-1]
    nope, rot = x[..., :-width], x[..., -width:].astype(jnp.float32)
    even, odd = rot[..., 0::2], rot[..., 1::2]
    turned = jnp.stack([even * cos - odd * sin, odd * cos + even * sin], axis=-1).reshape(rot.shape)
    return jnp.concatenate([nope, turned.astype(x.dtype)], axis=-1)


def rope_angles(cfg, which: str, positions, dtype=jnp.float32):
    """cos, sin [..., rope_dim / 2] of positions (float32, then cast) for the "main" or "compress"
    rope (transformers' `DeepseekV4RotaryEmbedding`; YaRN's attention factor is 1 for V4)."""
    rope = cfg.main_rope if which == "main" else cfg.compress_rope
    inv_freq, factor = rope_lib.inv_freq_and_attention_factor(cfg.rope_dim, rope)
    freqs = jnp.asarray(positions).astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    return (jnp.cos(freqs) * factor).astype(dtype), (jnp.sin(freqs) * factor).astype(dtype)


def rope_tables(cfg, positions, dtype):
    """The decoder's rope tables: ({"main", "compress"} cos, the same sin), each [..., rope_dim / 2]."""
    main, compress = rope_angles(cfg, "main", positions, dtype), rope_angles(cfg, "compress", positions, dtype)
    return {"main": main[0], "compress": compress[0]}, {"main": main[1], "compress": compress[1]}


def compress(x_BSH, kv_HJ, gate_HJ, bias_MJ, norm_Q, rate: int, overlap: bool, cfg):
    """The compressed entries [B, O, Q] of a sequence (O = S // rate; the last incomplete window is
    dropped, as transformers' stateless compressors drop it), each rotated at position w * rate
    (transformers' `DeepseekV4CSACompressor` / `HCACompressor` / the indexer's, without a cache)."""
    B, S, _ = x_BSH.shape
    O = S // rate
    width = norm_Q.shape[-1]
    if O == 0:
        return jnp.zeros((B, 0, width), x_BSH.dtype)
    kv = linear(x_BSH[:, :O * rate], kv_HJ).reshape(B, O, rate, -1)
    gate = linear(x_BSH[:, :O * rate], gate_HJ).reshape(B, O, rate, -1) + bias_MJ
    if overlap:  # slots [0, m): the window before's Ca (none for window 0: weight 0); [m, 2m): own Cb
        before_kv = jnp.pad(kv[:, :-1, :, :width], ((0, 0), (1, 0), (0, 0), (0, 0)))
        before_gate = jnp.pad(gate[:, :-1, :, :width], ((0, 0), (1, 0), (0, 0), (0, 0)), constant_values=-jnp.inf)
        kv = jnp.concatenate([before_kv, kv[..., width:]], axis=2)
        gate = jnp.concatenate([before_gate, gate[..., width:]], axis=2)
    weights = jax.nn.softmax(gate.astype(jnp.float32), axis=2).astype(kv.dtype)
    pooled = rms_norm(jnp.sum(kv * weights, axis=2), norm_Q, cfg.rms_norm_eps, scale_in_float32=True)
    cos, sin = rope_angles(cfg, "compress", np.arange(O) * rate, pooled.dtype)
    return rope_interleaved(pooled, cos, sin)


def visible_entries(S: int, O: int, rate: int):
    """bool [S, O]: query t sees entry w when w < (t + 1) // rate (all the entry's tokens are at or
    before t; positions are columns, as transformers' forward numbers them 0..S-1)."""
    return np.arange(O)[None, :] < ((np.arange(S) + 1) // rate)[:, None]


def select_entries(scores_BSO, visible_SO, top_k: int):
    """bool [B, S, O]: the `top_k` highest-scoring visible entries of each query (all visible ones
    when fewer), transformers' masked top-k with its -1 sentinel for picks beyond the visible."""
    O = scores_BSO.shape[-1]
    k = min(top_k, O)
    masked = jnp.where(visible_SO, scores_BSO, -jnp.inf)
    _, idx_BSK = jax.lax.top_k(masked, k)
    valid_BSK = jnp.take_along_axis(jnp.broadcast_to(visible_SO, masked.shape), idx_BSK, axis=-1)
    return jnp.any(jax.nn.one_hot(idx_BSK, O, dtype=bool) & valid_BSK[..., None], axis=-2)


class NormWeight(nnx.Module):
    """An RMSNorm's float32 weight at `<name>.weight` (V4 keeps its norms in float32)."""

    def __init__(self, dim: int):
        self.weight = nnx.Param(jnp.ones((dim,), jnp.float32))


class Compressor(nnx.Module):
    """A compressor's parameters: kv and gate projections [H, series * width], position bias [m,
    series * width] (float32) and the RMSNorm [width] (float32); series 2 overlaps windows (CSA)."""

    def __init__(self, cfg, width: int, rate: int, series: int, dtype, rngs: nnx.Rngs):
        H = cfg.hidden_size
        self.kv_proj = param(rngs, (H, series * width), dtype)
        self.gate_proj = param(rngs, (H, series * width), dtype)
        self.position_bias = nnx.Param(jnp.zeros((rate, series * width), jnp.float32))
        self.kv_norm = NormWeight(width)
        self.rate, self.overlap = rate, series == 2

    def __call__(self, x_BSH, cfg):
        return compress(x_BSH, self.kv_proj[...], self.gate_proj[...], self.position_bias[...],
                        self.kv_norm.weight[...], self.rate, self.overlap, cfg)


class Indexer(Compressor):
    """CSA's lightning indexer (eqs. 13-17): its own overlapping compressor at index_head_dim, a
    query projection from the q LoRA's normed latent, and per-head weights of each query."""

    def __init__(self, cfg, dtype, rngs: nnx.Rngs):
        super().__init__(cfg, cfg.index_head_dim, cfg.rates[0], 2, dtype, rngs)
        self.q_b_proj = param(rngs, (cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim), dtype)
        self.weights_proj = param(rngs, (cfg.hidden_size, cfg.index_n_heads), dtype)

    def select(self, x_BSH, q_lora_BSR, cos_S, sin_S, cfg):
        """bool [B, S, O]: the entries each query attends to (sum_h w_{t,h} ReLU(q_{t,h} . k_s), top
        `index_topk` of the visible ones), in float32 as transformers' scorer."""
        B, S, _ = x_BSH.shape
        keys_BOQ = self(x_BSH, cfg)
        O = keys_BOQ.shape[1]
        q = linear(q_lora_BSR, self.q_b_proj[...]).reshape(B, S, cfg.index_n_heads, cfg.index_head_dim)
        q = rope_interleaved(q, cos_S[..., None, :], sin_S[..., None, :])
        scores = jnp.einsum("bsnq,boq->bsno", q.astype(jnp.float32), keys_BOQ.astype(jnp.float32), precision=HIGHEST)
        scores = jax.nn.relu(scores) * cfg.index_head_dim ** -0.5
        weights = linear(x_BSH, self.weights_proj[...]).astype(jnp.float32) * cfg.index_n_heads ** -0.5
        index_BSO = jnp.sum(scores * weights[..., None], axis=2)
        return select_entries(index_BSO, visible_entries(S, O, self.rate), cfg.index_topk)


class DeepseekV4Attention(nnx.Module):
    """One layer's attention: sliding window, + CSA (compressor and indexer) or HCA (compressor)
    by the layer's type (module docstring). Generation's cache steps are not implemented (the
    model refuses them)."""

    def __init__(self, cfg, dtype, rngs: nnx.Rngs, layer: int):
        H, N, Q = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
        self.kind = cfg.attention_type(layer)
        self.rope = "main" if self.kind == "sliding_attention" else "compress"
        self.q_a_proj = param(rngs, (H, cfg.q_lora_rank), dtype)
        self.q_a_norm = NormWeight(cfg.q_lora_rank)
        self.q_b_proj = param(rngs, (cfg.q_lora_rank, N * Q), dtype)
        self.kv_proj = param(rngs, (H, Q), dtype)
        self.kv_norm = NormWeight(Q)
        self.o_a_proj = param(rngs, (N * Q // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank), dtype)
        self.o_b_proj = param(rngs, (cfg.o_groups * cfg.o_lora_rank, H), dtype)
        self.sinks = nnx.Param(jnp.zeros((N,), jnp.float32))
        if self.kind == CSA:
            self.compressor = Compressor(cfg, Q, cfg.rates[0], 2, dtype, rngs)
            self.indexer = Indexer(cfg, dtype, rngs)
        elif self.kind == HCA:
            self.compressor = Compressor(cfg, Q, cfg.rates[1], 1, dtype, rngs)
        self.cfg = cfg

    def __call__(self, x_BSH, cos, sin, allowed_BSS):
        cfg = self.cfg
        B, S, _ = x_BSH.shape
        N, Q, G = cfg.num_attention_heads, cfg.head_dim, cfg.o_groups
        cos_S, sin_S = cos[self.rope], sin[self.rope]
        q_lora = rms_norm(linear(x_BSH, self.q_a_proj[...]), self.q_a_norm.weight[...], cfg.rms_norm_eps,
                          scale_in_float32=True)
        q = unweighted_rms(linear(q_lora, self.q_b_proj[...]).reshape(B, S, N, Q), cfg.rms_norm_eps)
        q = rope_interleaved(q, cos_S[..., None, :], sin_S[..., None, :])
        kv = rms_norm(linear(x_BSH, self.kv_proj[...]), self.kv_norm.weight[...], cfg.rms_norm_eps,
                      scale_in_float32=True)
        keys = rope_interleaved(kv, cos_S, sin_S)                                   # [B, S, Q]
        seen = within_window(allowed_BSS, np.arange(S), cfg.sliding_window)        # [B, S, S]
        if self.kind == CSA:
            chosen = self.indexer.select(x_BSH, q_lora, cos["compress"], sin["compress"], cfg)
            entries = self.compressor(x_BSH, cfg)
            keys, seen = jnp.concatenate([keys, entries], axis=1), jnp.concatenate([seen, chosen], axis=-1)
        elif self.kind == HCA:
            entries = self.compressor(x_BSH, cfg)
            visible = jnp.broadcast_to(visible_entries(S, entries.shape[1], self.compressor.rate),
                                       (B, S, entries.shape[1]))
            keys, seen = jnp.concatenate([keys, entries], axis=1), jnp.concatenate([seen, visible], axis=-1)
        scores = jnp.einsum("bsnq,bcq->bnsc", q, keys, precision=HIGHEST) * Q ** -0.5
        scores = jnp.where(seen[:, None], scores, jnp.finfo(scores.dtype).min)
        weights = attention_weights(scores, q.dtype, self.sinks[...])
        out = jnp.einsum("bnsc,bcq->bsnq", weights, keys, precision=HIGHEST)
        out = rope_interleaved(out, cos_S[..., None, :], -sin_S[..., None, :])      # undo kv's rotation in o
        o_a = self.o_a_proj[...].reshape(N * Q // G, G, cfg.o_lora_rank)
        grouped = jnp.einsum("bsgi,igr->bsgr", out.reshape(B, S, G, N * Q // G), o_a, precision=HIGHEST)
        return linear(grouped.reshape(B, S, G * cfg.o_lora_rank), self.o_b_proj[...])

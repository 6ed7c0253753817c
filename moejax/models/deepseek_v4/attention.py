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

from typing import NamedTuple

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


def pool(kv_BOKQ, gate_BOKQ, norm_Q, positions_O, cfg):
    """Entries [B, O, Q] from windows of K slots: the softmax-gated sum over the slots (gate logits
    position bias included, softmax in float32), an RMSNorm, rope ("compress") at positions_O."""
    weights = jax.nn.softmax(gate_BOKQ.astype(jnp.float32), axis=2).astype(kv_BOKQ.dtype)
    pooled = rms_norm(jnp.sum(kv_BOKQ * weights, axis=2), norm_Q, cfg.rms_norm_eps, scale_in_float32=True)
    cos, sin = rope_angles(cfg, "compress", positions_O, pooled.dtype)
    return rope_interleaved(pooled, cos, sin)


def compress_projected(kv_BSJ, gate_BSJ, bias_MJ, norm_Q, rate: int, overlap: bool, cfg):
    """The compressed entries [B, O, Q] of a sequence's projected tokens (kv, gate [B, S, series *
    width]; O = S // rate; the last incomplete window is left out, as transformers' compressors
    leave it: stateless they drop it, with a cache it waits as the pending window), each rotated at
    position w * rate (transformers' `DeepseekV4CSACompressor` / `HCACompressor` / the indexer's on
    their first call)."""
    B, S, _ = kv_BSJ.shape
    O = S // rate
    width = norm_Q.shape[-1]
    if O == 0:
        return jnp.zeros((B, 0, width), kv_BSJ.dtype)
    kv = kv_BSJ[:, :O * rate].reshape(B, O, rate, -1)
    gate = gate_BSJ[:, :O * rate].reshape(B, O, rate, -1) + bias_MJ
    if overlap:  # slots [0, m): the window before's Ca (none for window 0: weight 0); [m, 2m): own Cb
        before_kv = jnp.pad(kv[:, :-1, :, :width], ((0, 0), (1, 0), (0, 0), (0, 0)))
        before_gate = jnp.pad(gate[:, :-1, :, :width], ((0, 0), (1, 0), (0, 0), (0, 0)), constant_values=-jnp.inf)
        kv = jnp.concatenate([before_kv, kv[..., width:]], axis=2)
        gate = jnp.concatenate([before_gate, gate[..., width:]], axis=2)
    return pool(kv, gate, norm_Q, np.arange(O) * rate, cfg)


def compress(x_BSH, kv_HJ, gate_HJ, bias_MJ, norm_Q, rate: int, overlap: bool, cfg):
    """`compress_projected` of x's projections by kv_HJ and gate_HJ."""
    return compress_projected(linear(x_BSH, kv_HJ), linear(x_BSH, gate_HJ), bias_MJ, norm_Q, rate, overlap, cfg)


def visible_entries(S: int, O: int, rate: int, positions_BS=None):
    """bool [S, O] (or [B, S, O] given positions_BS): query t sees entry w when w < (t + 1) // rate
    (all the entry's tokens are at or before t). t is the query's column (transformers' forward
    without position ids) or its rope position (with them, as `generate` passes: a left-padded
    row's real tokens then see fewer entries than their columns would)."""
    if positions_BS is None:
        return np.arange(O)[None, :] < ((np.arange(S) + 1) // rate)[:, None]
    return jnp.arange(O)[None, None, :] < ((jnp.asarray(positions_BS) + 1) // rate)[..., None]


def select_entries(scores_BSO, visible_SO, top_k: int):
    """bool [B, S, O]: the `top_k` highest-scoring visible entries of each query (all visible ones
    when fewer), transformers' masked top-k with its -1 sentinel for picks beyond the visible."""
    O = scores_BSO.shape[-1]
    k = min(top_k, O)
    masked = jnp.where(visible_SO, scores_BSO, -jnp.inf)
    _, idx_BSK = jax.lax.top_k(masked, k)
    valid_BSK = jnp.take_along_axis(jnp.broadcast_to(visible_SO, masked.shape), idx_BSK, axis=-1)
    return jnp.any(jax.nn.one_hot(idx_BSK, O, dtype=bool) & valid_BSK[..., None], axis=-2)


class CompressorCache(NamedTuple):
    """A compressor's state between cache steps (transformers' `compressed_kv`, `buffer_kv` /
    `buffer_gate` and, overlapping (CSA and its indexer), `overlap_kv` / `overlap_gate`):

    entries_BOQ   every compressed entry emitted so far, entry w at row w; written while the cache
                  has length // rate rows. Entry w exists once column (w + 1) * rate - 1 is in
                  (columns, not positions: a left-padded row's padding is compressed too)
    kv_BMJ, gate_BMJ   the pending window's projected tokens (gate without the position bias),
                  column c at row c % rate; a window is pooled when its last column arrives
    prior_kv_BMQ, prior_gate_BMQ   overlapping only (else None): the last complete window's first
                  series Ca (gate with its position bias; -inf before any window: weight 0), the
                  first half of the next entry's 2 * rate slots
    """

    entries_BOQ: jax.Array
    kv_BMJ: jax.Array
    gate_BMJ: jax.Array
    prior_kv_BMQ: jax.Array | None = None
    prior_gate_BMQ: jax.Array | None = None


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
        self.rate, self.overlap, self.width = rate, series == 2, width

    def __call__(self, x_BSH, cfg):
        return self.entries(*self.project(x_BSH), cfg)

    def project(self, x_BSH):
        """(kv, gate) [B, S, series * width] of the tokens x."""
        return linear(x_BSH, self.kv_proj[...]), linear(x_BSH, self.gate_proj[...])

    def entries(self, kv_BSJ, gate_BSJ, cfg):
        return compress_projected(kv_BSJ, gate_BSJ, self.position_bias[...], self.kv_norm.weight[...], self.rate,
                                  self.overlap, cfg)

    def empty_cache(self, batch: int, length: int, dtype) -> CompressorCache:
        m, J, Q = self.rate, self.position_bias.shape[-1], self.width
        prior = ((jnp.zeros((batch, m, Q), dtype), jnp.full((batch, m, Q), -jnp.inf, jnp.float32))
                 if self.overlap else (None, None))
        rows = max(1, length // m)  # at least one, so a step can write it; a row never closed is never seen
        return CompressorCache(jnp.zeros((batch, rows, Q), dtype), jnp.zeros((batch, m, J), dtype),
                               jnp.zeros((batch, m, J), dtype), *prior)

    def prefill(self, kv_BSJ, gate_BSJ, entries_BOQ, cache: CompressorCache) -> CompressorCache:
        """The cache after a prompt of S columns: its O = S // rate entries, the S % rate columns
        after them pending, and (overlapping) window O - 1's Ca."""
        S, m = kv_BSJ.shape[1], self.rate
        O, rest = S // m, S % m
        out = cache._replace(entries_BOQ=jax.lax.dynamic_update_slice(
            cache.entries_BOQ, entries_BOQ.astype(cache.entries_BOQ.dtype), (0, 0, 0)))
        if rest:
            out = out._replace(kv_BMJ=out.kv_BMJ.at[:, :rest].set(kv_BSJ[:, O * m:].astype(out.kv_BMJ.dtype)),
                               gate_BMJ=out.gate_BMJ.at[:, :rest].set(gate_BSJ[:, O * m:].astype(out.gate_BMJ.dtype)))
        if self.overlap and O:
            last = slice((O - 1) * m, O * m)
            out = out._replace(prior_kv_BMQ=kv_BSJ[:, last, :self.width].astype(out.prior_kv_BMQ.dtype),
                               prior_gate_BMQ=(gate_BSJ[:, last] + self.position_bias[...])[..., :self.width]
                               .astype(jnp.float32))
        return out

    def step(self, x_B1H, column, cache: CompressorCache, cfg) -> CompressorCache:
        """The cache after the token at `column` (one per row): written pending at row column % rate;
        when it closes its window (column % rate == rate - 1) the window is pooled into entry
        column // rate (rotated at that entry's first column), and its Ca becomes the prior."""
        m, Q = self.rate, self.width
        kv, gate = self.project(x_B1H)
        slot = column % m
        pending_kv = jax.lax.dynamic_update_slice(cache.kv_BMJ, kv.astype(cache.kv_BMJ.dtype), (0, slot, 0))
        pending_gate = jax.lax.dynamic_update_slice(cache.gate_BMJ, gate.astype(cache.gate_BMJ.dtype), (0, slot, 0))
        closes = slot == m - 1
        window_gate = pending_gate + self.position_bias[...]
        if self.overlap:
            slots_kv = jnp.concatenate([cache.prior_kv_BMQ.astype(pending_kv.dtype), pending_kv[..., Q:]], axis=1)
            slots_gate = jnp.concatenate([cache.prior_gate_BMQ.astype(window_gate.dtype), window_gate[..., Q:]], axis=1)
        else:
            slots_kv, slots_gate = pending_kv, window_gate
        w = column // m
        entry = pool(slots_kv[:, None], slots_gate[:, None], self.kv_norm.weight[...], jnp.reshape(w * m, (1,)), cfg)
        written = jax.lax.dynamic_update_slice(cache.entries_BOQ, entry.astype(cache.entries_BOQ.dtype), (0, w, 0))
        out = CompressorCache(jnp.where(closes, written, cache.entries_BOQ), pending_kv, pending_gate,
                              cache.prior_kv_BMQ, cache.prior_gate_BMQ)
        if self.overlap:
            prior_kv = pending_kv[..., :Q].astype(cache.prior_kv_BMQ.dtype)
            out = out._replace(
                prior_kv_BMQ=jnp.where(closes, prior_kv, cache.prior_kv_BMQ),
                prior_gate_BMQ=jnp.where(closes, window_gate[..., :Q].astype(jnp.float32), cache.prior_gate_BMQ))
        return out


class Indexer(Compressor):
    """CSA's lightning indexer (eqs. 13-17): its own overlapping compressor at index_head_dim, a
    query projection from the q LoRA's normed latent, and per-head weights of each query."""

    def __init__(self, cfg, dtype, rngs: nnx.Rngs):
        super().__init__(cfg, cfg.index_head_dim, cfg.rates[0], 2, dtype, rngs)
        self.q_b_proj = param(rngs, (cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim), dtype)
        self.weights_proj = param(rngs, (cfg.hidden_size, cfg.index_n_heads), dtype)

    def select(self, x_BSH, q_lora_BSR, cos_S, sin_S, cfg, positions_BS=None):
        """bool [B, S, O]: the entries each query attends to (`choose` over the sequence's own keys)."""
        S = x_BSH.shape[1]
        keys_BOQ = self(x_BSH, cfg)
        return self.choose(x_BSH, q_lora_BSR, keys_BOQ, cos_S, sin_S,
                           visible_entries(S, keys_BOQ.shape[1], self.rate, positions_BS), cfg)

    def choose(self, x_BSH, q_lora_BSR, keys_BOQ, cos_S, sin_S, visible, cfg):
        """bool [B, S, O]: sum_h w_{t,h} ReLU(q_{t,h} . k_s) against the keys, top `index_topk`
        of the visible ones, in float32 as transformers' scorer."""
        B, S, _ = x_BSH.shape
        q = linear(q_lora_BSR, self.q_b_proj[...]).reshape(B, S, cfg.index_n_heads, cfg.index_head_dim)
        q = rope_interleaved(q, cos_S[..., None, :], sin_S[..., None, :])
        scores = jnp.einsum("bsnq,boq->bsno", q.astype(jnp.float32), keys_BOQ.astype(jnp.float32), precision=HIGHEST)
        scores = jax.nn.relu(scores) * cfg.index_head_dim ** -0.5
        weights = linear(x_BSH, self.weights_proj[...]).astype(jnp.float32) * cfg.index_n_heads ** -0.5
        index_BSO = jnp.sum(scores * weights[..., None], axis=2)
        return select_entries(index_BSO, visible, cfg.index_topk)


class V4LayerCache(NamedTuple):
    """One V4 layer's cache: the sliding window's keys (= values) in a ring of `sliding_window`
    rows, column c at row c % window (transformers keeps window - 1 and adds the new one), and
    the compressor's and indexer's states (None where the layer has none)."""

    kv_BWQ: jax.Array
    compressor: CompressorCache | None = None
    indexer: CompressorCache | None = None


def ring_allowed(valid_BC, column, window: int):
    """bool [B, 1, W]: which ring rows the query at `column` attends to: row s holds column
    c_s = column - ((column - s) mod W), seen when c_s >= 0 and is a real token (valid_BC)."""
    held = column - (column - jnp.arange(window)) % window
    return (jnp.take(valid_BC, jnp.maximum(held, 0), axis=1) & (held >= 0)[None])[:, None, :]


class DeepseekV4Attention(nnx.Module):
    """One layer's attention: sliding window, + CSA (compressor and indexer) or HCA (compressor)
    by the layer's type (module docstring); generation's cache steps `prefill` and `decode` on a
    `V4LayerCache`."""

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

    def _project(self, x_BSH, cos_S, sin_S):
        """(q_lora [B, S, R], q [B, S, N, Q] normed and rotated, kv [B, S, Q] normed and rotated)."""
        cfg = self.cfg
        B, S, _ = x_BSH.shape
        q_lora = rms_norm(linear(x_BSH, self.q_a_proj[...]), self.q_a_norm.weight[...], cfg.rms_norm_eps,
                          scale_in_float32=True)
        q = unweighted_rms(linear(q_lora, self.q_b_proj[...]).reshape(B, S, cfg.num_attention_heads, cfg.head_dim),
                           cfg.rms_norm_eps)
        q = rope_interleaved(q, cos_S[..., None, :], sin_S[..., None, :])
        kv = rms_norm(linear(x_BSH, self.kv_proj[...]), self.kv_norm.weight[...], cfg.rms_norm_eps,
                      scale_in_float32=True)
        return q_lora, q, rope_interleaved(kv, cos_S, sin_S)

    def _out(self, q, keys, seen, cos_S, sin_S):
        """The attention of q [B, S, N, Q] over keys (= values) [B, C, Q] where seen [B, S, C], its
        rotation undone, through the grouped output projection: [B, S, H]."""
        cfg = self.cfg
        B, S, N, Q = q.shape
        G = cfg.o_groups
        scores = jnp.einsum("bsnq,bcq->bnsc", q, keys, precision=HIGHEST) * Q ** -0.5
        scores = jnp.where(seen[:, None], scores, jnp.finfo(scores.dtype).min)
        weights = attention_weights(scores, q.dtype, self.sinks[...])
        out = jnp.einsum("bnsc,bcq->bsnq", weights, keys, precision=HIGHEST)
        out = rope_interleaved(out, cos_S[..., None, :], -sin_S[..., None, :])      # undo kv's rotation in o
        o_a = self.o_a_proj[...].reshape(N * Q // G, G, cfg.o_lora_rank)
        grouped = jnp.einsum("bsgi,igr->bsgr", out.reshape(B, S, G, N * Q // G), o_a, precision=HIGHEST)
        return linear(grouped.reshape(B, S, G * cfg.o_lora_rank), self.o_b_proj[...])

    def __call__(self, x_BSH, cos, sin, allowed_BSS, positions_BS=None):
        return self._whole(x_BSH, cos, sin, allowed_BSS, positions_BS)[0]

    def _whole(self, x_BSH, cos, sin, allowed_BSS, positions_BS=None):
        """(output [B, S, H], {what a cache keeps of it}) on a whole sequence. positions_BS: the
        rope positions cos / sin were made of (None: the columns), which also decide which
        compressed entries a query sees (transformers' `position_ids`); the entries themselves
        are numbered by column."""
        cfg = self.cfg
        B, S, _ = x_BSH.shape
        cos_S, sin_S = cos[self.rope], sin[self.rope]
        q_lora, q, keys = self._project(x_BSH, cos_S, sin_S)
        kept = {"kv": keys}
        seen = within_window(allowed_BSS, np.arange(S), cfg.sliding_window)        # [B, S, S]
        if self.kind in (CSA, HCA):
            kv, gate = self.compressor.project(x_BSH)
            entries = self.compressor.entries(kv, gate, cfg)
            kept["compressor"] = (kv, gate, entries)
            O = entries.shape[1]
            if self.kind == CSA:
                ikv, igate = self.indexer.project(x_BSH)
                ikeys = self.indexer.entries(ikv, igate, cfg)
                kept["indexer"] = (ikv, igate, ikeys)
                visible = self.indexer.choose(x_BSH, q_lora, ikeys, cos["compress"], sin["compress"],
                                              visible_entries(S, O, self.compressor.rate, positions_BS), cfg)
            else:
                visible = visible_entries(S, O, self.compressor.rate, positions_BS)
            keys = jnp.concatenate([keys, entries], axis=1)
            seen = jnp.concatenate([seen, jnp.broadcast_to(visible, (B, S, O))], axis=-1)
        return self._out(q, keys, seen, cos_S, sin_S), kept

    # --- generation's cache steps (transformers' DeepseekV4HCACache / DeepseekV4CSACache) ---

    def empty_cache(self, cfg, batch: int, length: int, dtype) -> V4LayerCache:
        return V4LayerCache(
            jnp.zeros((batch, cfg.sliding_window, cfg.head_dim), dtype),
            self.compressor.empty_cache(batch, length, dtype) if self.kind in (CSA, HCA) else None,
            self.indexer.empty_cache(batch, length, dtype) if self.kind == CSA else None)

    def prefill(self, x_BSH, cos, sin, allowed_BSS, positions_BS, cache: V4LayerCache):
        """The forward on a prompt of S columns (positions_BS: its rope positions), and the cache
        after it: the last `sliding_window` columns' keys in the ring, the compressors' entries,
        pending window and prior Ca."""
        out, kept = self._whole(x_BSH, cos, sin, allowed_BSS, positions_BS)
        S, W = x_BSH.shape[1], self.cfg.sliding_window
        columns = np.arange(max(0, S - W), S)
        cache = cache._replace(kv_BWQ=cache.kv_BWQ.at[:, columns % W].set(
            kept["kv"][:, columns].astype(cache.kv_BWQ.dtype)))
        if "compressor" in kept:
            cache = cache._replace(compressor=self.compressor.prefill(*kept["compressor"], cache.compressor))
        if "indexer" in kept:
            cache = cache._replace(indexer=self.indexer.prefill(*kept["indexer"], cache.indexer))
        return out, cache

    def decode(self, x_B1H, cos, sin, positions_B1, cache: V4LayerCache, column, ring_B1W):
        """One new token per row at `column` (rope position positions_B1): its key into ring row
        column % window, its projections into the compressors' pending windows (closing one pools
        an entry), then attention over the window (ring_B1W: `ring_allowed`) and the compressed
        entries (HCA: every entry emitted; CSA: the indexer's top-k of the entries its position
        sees, as transformers' decoding does): (output [B, 1, H], cache)."""
        cfg = self.cfg
        B, W = x_B1H.shape[0], cfg.sliding_window
        cos_S, sin_S = cos[self.rope], sin[self.rope]
        q_lora, q, kv = self._project(x_B1H, cos_S, sin_S)
        cache = cache._replace(kv_BWQ=jax.lax.dynamic_update_slice(
            cache.kv_BWQ, kv.astype(cache.kv_BWQ.dtype), (0, column % W, 0)))
        keys, seen = cache.kv_BWQ, ring_B1W
        if self.kind in (CSA, HCA):
            rate = self.compressor.rate
            cache = cache._replace(compressor=self.compressor.step(x_B1H, column, cache.compressor, cfg))
            entries = cache.compressor.entries_BOQ
            O = entries.shape[1]
            emitted = (jnp.arange(O) < (column + 1) // rate)[None, None, :]              # [1, 1, O]
            if self.kind == CSA:
                cache = cache._replace(indexer=self.indexer.step(x_B1H, column, cache.indexer, cfg))
                sees = emitted & (jnp.arange(O)[None, None, :] < ((positions_B1 + 1) // rate)[..., None])
                visible = self.indexer.choose(x_B1H, q_lora, cache.indexer.entries_BOQ, cos["compress"],
                                              sin["compress"], sees, cfg)
            else:
                visible = emitted
            keys = jnp.concatenate([keys, entries.astype(keys.dtype)], axis=1)
            seen = jnp.concatenate([seen, jnp.broadcast_to(visible, (B, 1, O))], axis=-1)
        return self._out(q, keys, seen, cos_S, sin_S), cache

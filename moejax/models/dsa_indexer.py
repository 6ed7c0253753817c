"""The lightning indexer of DeepSeek sparse attention (DSA), one implementation for DeepSeek-V3.2
(`deepseek_v32`) and GLM-5 (`glm_moe_dsa`), exact against transformers' `DeepseekV32Indexer` and
`GlmMoeDsaIndexer` (transformers 5.24), and the way MLA attention applies its selection.

What it computes, per query s and key column c (transformers' order of operations):

    q[s, h]  = rope(wq_b(q_lora[s]))              [N, D]  in the model dtype, then float32
    k[c]     = rope(LayerNorm(wk(x[c])))          [D]     in the model dtype, then float32
    w[s, h]  = weights_proj(float32 x[s]) * N**-0.5   float32 (weights_proj is kept in float32)
    score[s, c] = sum_h w[s, h] * relu(q[s, h] . k[c] * D**-0.5)          float32
    selected[s] = the index_topk allowed columns of highest score   (all allowed ones if fewer)

N = index_n_heads, D = index_head_dim, q_lora = MLA's `q_a_layernorm(q_a_proj(x))` (the normalised
query LoRA, [B, S, q_lora_rank]; DSA models always have a q LoRA), x the layer's input (after the
input layernorm). The rope is applied to the FIRST qk_rope_head_dim channels of q and k (the
indexer's layout is [rope | pass], the reverse of MLA's [nope | rope]) with the same cos/sin tables
as MLA (width qk_rope_head_dim, YaRN attention factor included). The rope form differs:
DeepSeek-V3.2's indexer rotates half-split (`apply_rotary_pos_emb`, rotate_half), unlike its MLA;
GLM-5's indexer rotates interleaved pairs (`apply_rotary_pos_emb_interleave`, output laid out
evens then odds; q and k alike, so q.k is unchanged). `IndexerConfig.rope_interleave` holds which;
an explicit `indexer_rope_interleave` key in config.json (GLM-5.2 writes `true`) overrides the
model type's default (transformers ignores that key).

Parameters ([in, out], x @ W; HF stores torch Linear weights [out, in]), for a layer l that has
an indexer (prefix `model.layers.{l}.self_attn.indexer.`):

    wq_b            [q_lora_rank, N * D]  <- indexer.wq_b.weight          [N * D, q_lora_rank], transposed
                                           (output columns head-major: head h is D columns h*D..)
    wk              [hidden, D]           <- indexer.wk.weight            [D, hidden], transposed
    k_norm.weight   [D]                   <- indexer.k_norm.weight        (torch nn.LayerNorm, eps 1e-6,
    k_norm.bias     [D]                   <- indexer.k_norm.bias           with a bias: not an RMSNorm)
    weights_proj    [hidden, N]  float32  <- indexer.weights_proj.weight  [N, hidden], transposed
                                           (transformers' `_keep_in_fp32_modules`; upcast on load)

No Linear has a bias. A GLM-5 "shared" layer has no indexer and no `indexer.*` tensors.

Which layers compute a selection: DeepSeek-V3.2, every layer. GLM-5: `indexer_types` in
config.json (one "full"/"shared" per layer) or, when absent, `index_topk_pattern` ("F"/"S" per
layer) or the schedule `index_topk_freq` (default 1) / `index_skip_topk_offset` (default 2): layer
i is full iff max(i - offset + 1, 0) % freq == 0 (`indexer_types`). A shared layer reuses the
selection of the nearest full layer below it (`selection_sources`). GLM-5.2's freq 4 / offset 3
over 78 layers gives full layers 0, 1, 2, 6, 10, ..., 74 (21 indexers). (Both functions are defined
JAX-free with the configs that read them, `moejax.models.deepseek_v32.config`, and re-exported here.)

How MLA applies it (`sparse_allowed`): transformers scatters the top-k indices into a "not
selected" mask and folds it into the attention mask, additive masks getting finfo(dtype).min at the
unselected keys (eager), boolean masks `mask & ~not_selected` (sdpa): the attention mask becomes
`allowed & selected`, on every layer (shared layers with the borrowed selection); the softmax, the
scale and everything else are MLA's, unchanged. The indexer itself masks its scores with the same
causal/padding mask before top-k (`allowed_BSC`).

Left padding and ties: transformers takes top-k over the padded row (padding at -inf, topk = min(
index_topk, row length)) and returns column indices of the padded row; with fewer allowed keys than
index_topk it returns padding columns too (harmless: the attention mask excludes them). Here the
selection is the boolean mask intersected with `allowed_BSC`, so padding is never selected and a
query with at most index_topk allowed keys selects exactly its allowed keys. Exact score ties at
the top-k boundary (common: a key every head scores <= 0 gets exactly 0) are broken towards the
LOWEST column (the earliest key), which is invariant under left padding, so each row of a padded
batch selects exactly what it selects alone. torch.topk's CPU tie order is an artefact of
std::nth_element / partial_sort (e.g. 8 of 10 zeros give [5, 9, 8, 7, 6, 3, 1, 2]) and is not
reproduced; away from ties the sets equal transformers'. -0.0 and +0.0 are equal for torch.topk
but ordered by XLA's top_k, so scores are canonicalised (-0.0 -> +0.0) before selection.

Use (full sequence, as `sparse_mla.SparseMLA.attend`; decode with `IndexerCache`, as its
`prefill_carrying`/`decode_carrying`):

    selected_BSS = indexer(x_BSH, q_lora_BSR, cos, sin, allowed_BSS)
    o = causal_attention(q, k, v, sparse_allowed(allowed_BSS, selected_BSS), scale)
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.models.deepseek_v3.rope import apply_rope
# the layer schedule is read by the (JAX-free) configs and name tables: it lives with them
from moejax.models.deepseek_v32.config import _get, indexer_types, selection_sources  # noqa: F401 (re-exports)
from moejax.models.layers import HIGHEST, linear, ones, param, zeros

K_NORM_EPS = 1e-6  # nn.LayerNorm(index_head_dim, eps=1e-6), not rms_norm_eps
MODEL_TYPES = ("deepseek_v32", "glm_moe_dsa")
_INTERLEAVED = {"deepseek_v32": False, "glm_moe_dsa": True}  # transformers' indexer rope, by model type


@dataclasses.dataclass(frozen=True)
class IndexerConfig:
    """The sizes the indexer needs; `of(...)` reads them from a config.json dictionary or any
    object with these attributes (a transformers config, a moejax config)."""

    hidden_size: int
    q_lora_rank: int
    qk_rope_head_dim: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    rope_interleave: bool

    @classmethod
    def of(cls, source) -> "IndexerConfig":
        if isinstance(source, cls):
            return source
        model_type = _get(source, "model_type")
        interleave = _get(source, "indexer_rope_interleave")
        if interleave is None:
            interleave = _INTERLEAVED.get(model_type)
        if interleave is None:
            raise ValueError(f"model_type {model_type!r}: say whether the indexer's rope is interleaved "
                             f"(indexer_rope_interleave); known model types {MODEL_TYPES}")
        cfg = cls(**{f.name: _get(source, f.name) for f in dataclasses.fields(cls) if f.name != "rope_interleave"},
                  rope_interleave=bool(interleave))
        missing = [f.name for f in dataclasses.fields(cls) if getattr(cfg, f.name) is None]
        if missing:
            raise ValueError(f"the DSA indexer needs {missing} (a q LoRA among them)")
        if cfg.qk_rope_head_dim > cfg.index_head_dim or cfg.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim {cfg.qk_rope_head_dim} must be even and at most "
                             f"index_head_dim {cfg.index_head_dim}")
        return cfg


class IndexerCache(NamedTuple):
    """One indexer's key cache: the rotated, normalised indexer key of every cached token
    [B, C, index_head_dim] (C columns, preallocated; transformers caches the same tensor)."""

    keys_BCD: jax.Array


class LayerNorm(nnx.Module):
    """torch nn.LayerNorm with weight and bias: statistics and affine in float32 (biased variance),
    the result rounded once to the input dtype, as torch does for bfloat16 inputs."""

    def __init__(self, dim: int, eps: float, dtype):
        self.weight = ones((dim,), dtype)
        self.bias = zeros((dim,), dtype)
        self.eps = eps

    def __call__(self, x):
        xf = x.astype(jnp.float32)
        mean = jnp.mean(xf, axis=-1, keepdims=True)
        centred = xf - mean
        var = jnp.mean(centred * centred, axis=-1, keepdims=True)
        y = centred * jax.lax.rsqrt(var + self.eps)
        return (y * self.weight[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(x.dtype)


class LightningIndexer(nnx.Module):
    """DSA's lightning indexer of one layer (see the module docstring for the maths, the
    parameters and the HF tensors they come from)."""

    def __init__(self, cfg, dtype, rngs: nnx.Rngs):
        cfg = IndexerConfig.of(cfg)
        self.cfg = cfg
        N, D = cfg.index_n_heads, cfg.index_head_dim
        self.wq_b = param(rngs, (cfg.q_lora_rank, N * D), dtype)
        self.wk = param(rngs, (cfg.hidden_size, D), dtype)
        self.k_norm = LayerNorm(D, K_NORM_EPS, dtype)
        self.weights_proj = param(rngs, (cfg.hidden_size, N), jnp.float32)

    @staticmethod
    def empty_cache(cfg, batch: int, length: int, dtype) -> IndexerCache:
        return IndexerCache(jnp.zeros((batch, length, IndexerConfig.of(cfg).index_head_dim), dtype))

    def _rope(self, x_BSND, cos, sin):
        """Rotate the first qk_rope_head_dim channels (the indexer's [rope | pass] layout)."""
        dr = self.cfg.qk_rope_head_dim
        rot = apply_rope(x_BSND[..., :dr], cos, sin, self.cfg.rope_interleave)
        return jnp.concatenate([rot, x_BSND[..., dr:]], axis=-1)

    def keys(self, x_BSH, cos, sin):
        """The indexer keys [B, S, D] in the model dtype (what a cache keeps): LayerNorm(x wk),
        rotated. cos/sin [S, dr] or [B, S, dr]."""
        k = self.k_norm(linear(x_BSH, self.wk[...]))
        return self._rope(k[:, :, None, :], cos, sin)[:, :, 0]

    def queries(self, x_BSH, q_lora_BSR, cos, sin):
        """(q [B, S, N, D] rotated, in the model dtype; head weights w [B, S, N] float32, already
        times N^-0.5)."""
        B, S, _ = q_lora_BSR.shape
        c = self.cfg
        q = linear(q_lora_BSR, self.wq_b[...]).reshape(B, S, c.index_n_heads, c.index_head_dim)
        w = linear(x_BSH.astype(jnp.float32), self.weights_proj[...].astype(jnp.float32))
        return self._rope(q, cos, sin), w * (c.index_n_heads ** -0.5)

    def scores(self, x_BSH, q_lora_BSR, cos, sin):
        """Unmasked float32 index scores [B, S, S] of a sequence against its own tokens."""
        q, w = self.queries(x_BSH, q_lora_BSR, cos, sin)
        return index_scores(q, w, self.keys(x_BSH, cos, sin), self.cfg.index_head_dim ** -0.5)

    def __call__(self, x_BSH, q_lora_BSR, cos, sin, allowed_BSS, block_rows: int = 256):
        """selected_BSS (bool): query s may attend to key s' (the top index_topk of its allowed
        keys). allowed_BSS must be causal (False above the diagonal): query blocks then score only
        the keys up to their last query, as `layers.causal_attention` does."""
        q, w = self.queries(x_BSH, q_lora_BSR, cos, sin)
        return select(q, w, self.keys(x_BSH, cos, sin), allowed_BSS, self.cfg.index_topk,
                      self.cfg.index_head_dim ** -0.5, block_rows=block_rows, causal=True)

    def prefill(self, x_BSH, q_lora_BSR, cos, sin, allowed_BSS, cache: IndexerCache, block_rows: int = 256):
        """`__call__` on a prompt that also writes its keys into cache columns 0..S-1:
        (selected_BSS, cache)."""
        k = self.keys(x_BSH, cos, sin)
        cache = IndexerCache(jax.lax.dynamic_update_slice(cache.keys_BCD, k.astype(cache.keys_BCD.dtype), (0, 0, 0)))
        q, w = self.queries(x_BSH, q_lora_BSR, cos, sin)
        return select(q, w, k, allowed_BSS, self.cfg.index_topk, self.cfg.index_head_dim ** -0.5,
                      block_rows=block_rows, causal=True), cache

    def decode(self, x_BSH, q_lora_BSR, cos, sin, cache: IndexerCache, column, allowed_BSC):
        """S new tokens per row (usually one) written into cache columns column..column+S-1, each
        selecting among the cache's C columns where allowed_BSC (columns not written yet, padding
        and later tokens must be False there). Returns (selected_BSC, cache)."""
        keys = jax.lax.dynamic_update_slice(cache.keys_BCD, self.keys(x_BSH, cos, sin).astype(cache.keys_BCD.dtype),
                                            (0, column, 0))
        q, w = self.queries(x_BSH, q_lora_BSR, cos, sin)
        return select(q, w, keys, allowed_BSC, self.cfg.index_topk, self.cfg.index_head_dim ** -0.5), IndexerCache(keys)


def index_scores(q_BSND, w_BSN, k_BCD, scale: float):
    """score[b, s, c] = sum_h w[b, s, h] * relu(q[b, s, h] . k[b, c] * scale), float32 [B, S, C]
    (transformers: fp32 matmul, scale, relu, then the head-weighted sum as a matmul)."""
    dots = jnp.einsum("bsnd,bcd->bsnc", q_BSND.astype(jnp.float32), k_BCD.astype(jnp.float32),
                      precision=HIGHEST) * scale
    return jnp.einsum("bsn,bsnc->bsc", w_BSN.astype(jnp.float32), jax.nn.relu(dots), precision=HIGHEST)


def topk_selection(scores_BSC, allowed_BSC, topk: int):
    """bool [B, S, C]: the `topk` allowed columns of highest score per query, ties to the lowest
    column; every allowed column when a query has at most `topk`; never a disallowed one."""
    C = scores_BSC.shape[-1]
    allowed_BSC = jnp.broadcast_to(allowed_BSC, scores_BSC.shape)
    if topk >= C:
        return allowed_BSC
    scores = jnp.where(scores_BSC == 0, jnp.float32(0), scores_BSC)  # -0.0 ties +0.0, as for torch
    scores = jnp.where(allowed_BSC, scores, -jnp.inf)
    _, idx = jax.lax.top_k(scores, topk)                              # stable: lower index first
    B, S = scores.shape[:2]
    chosen = jnp.zeros(scores.shape, bool).at[jnp.arange(B)[:, None, None], jnp.arange(S)[None, :, None],
                                              idx].set(True)
    return chosen & allowed_BSC


def select(q_BSND, w_BSN, k_BCD, allowed_BSC, topk: int, scale: float, block_rows: int = 256,
           causal: bool = False):
    """The selection of S queries among C keys: `topk_selection(index_scores(...))`, computed in
    query blocks of `block_rows` (at most 16 blocks) so the [B, rows, N, C] float32 products stay
    small. causal=True (S == C, allowed_BSC causal): a block scores only the keys up to its last
    query; the same numbers and the same selection, as the keys after it are never allowed."""
    B, S = q_BSND.shape[:2]
    C = k_BCD.shape[1]
    block_rows = max(block_rows, -(-S // 16))
    bounds = list(range(0, S, block_rows)) + [S]
    out = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        width = hi if causal else C
        sc = index_scores(q_BSND[:, lo:hi], w_BSN[:, lo:hi], k_BCD[:, :width], scale)
        sel = topk_selection(sc, allowed_BSC[:, lo:hi, :width], topk)
        if width < C:
            sel = jnp.concatenate([sel, jnp.zeros((B, hi - lo, C - width), bool)], axis=-1)
        out.append(sel)
    return out[0] if len(out) == 1 else jnp.concatenate(out, axis=1)


def sparse_allowed(allowed_BSC, selected_BSC):
    """The attention mask MLA uses on a DSA layer: allowed (causal, padding) and selected by the
    layer's indexer, or by the nearest full layer below on a GLM-5 "shared" layer. Give it to
    `layers.causal_attention` / `cached_attention` (or MLA's absorbed decode) in place of allowed."""
    return allowed_BSC & selected_BSC

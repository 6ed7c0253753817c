"""Exact top-k over the expert axis without `lax.top_k`, for the hot loops on CPU.

`route` (moejax/moe/routing.py) chooses experts with `lax.top_k`, which XLA:CPU runs at roughly
10 ns per element: in toy3, routing 6,000 tokens under 768 pruning masks spent most of its time
there. These functions choose the same experts from elementwise work over tokens:

1. `kth_largest`: each token's K-th largest `sel` (repeats counted), by an insertion network
   over the expert axis: one fused loop, about 1 ns per element.
2. `topk_indices_at_threshold`: the experts strictly above that value, plus the lowest-index
   experts equal to it until K are seated: the set `lax.top_k` chooses (ties to the lower index).
   The sets are packed into 32-bit words, one bit per expert, and read off with bit tricks.

Layout: expert-major, `sel_ET` with tokens last, so every step is elementwise over tokens.
Ties are by value (`==`): -0.0 and 0.0 are equal here, where `lax.top_k` would rank 0.0 first.
Routing scores are sigmoid(x) + bias, which is never -0.0.

One XLA pitfall shapes the API: compute the K-th value in its own jitted call (or carry it through
a loop) and pass it in. Fused into its consumer, XLA recomputes the whole network once per expert.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_ONE = jnp.uint32(1)


def kth_largest(sel_ET: jax.Array, k: int, keep_E: jax.Array | None = None,
                unrolled: bool = True) -> jax.Array:
    """The k-th largest value over the expert axis (-2), counting repeats: [..., E, T] -> [..., T].

    keep_E: bool [..., E], False = pruned (counts as -inf); its leading axes (e.g. pruning
      variants) broadcast against sel's. Masking here, one expert at a time, keeps XLA from
      writing the masked scores of every variant to memory first (5x slower in toy3).

    Keeps the k largest seen so far, sorted (best_0 >= ... >= best_{k-1}); each new value v
    goes in with best_i <- max(best_i, min(best_{i-1}, v)). Unrolled over E, XLA fuses the E
    steps into one loop; `unrolled=False` runs them as a `fori_loop` instead, about 10x slower
    but far cheaper to compile (for a value needed once).
    """
    def row(e):  # expert e's scores, -inf where pruned (e: an int, or traced in the fori_loop)
        v = jax.lax.dynamic_index_in_dim(sel_ET, e, axis=-2, keepdims=False)
        if keep_E is None:
            return v
        return jnp.where(jax.lax.dynamic_index_in_dim(keep_E, e, axis=-1, keepdims=True), v, -jnp.inf)

    def insert(best, v):
        return [jnp.maximum(best[0], v)] + [jnp.maximum(best[i], jnp.minimum(best[i - 1], v))
                                            for i in range(1, k)]

    lead = sel_ET.shape[:-2] if keep_E is None else jnp.broadcast_shapes(sel_ET.shape[:-2], keep_E.shape[:-1])
    best = [jnp.full(lead + sel_ET.shape[-1:], -jnp.inf, sel_ET.dtype)] * k
    if unrolled:
        for e in range(sel_ET.shape[-2]):
            best = insert(best, row(e))
    else:
        best = jax.lax.fori_loop(0, sel_ET.shape[-2], lambda e, b: insert(b, row(e)), best)
    return best[-1]


def topk_indices_at_threshold(sel_ET: jax.Array, kth_T: jax.Array, k: int,
                              keep_E: jax.Array | None = None) -> jax.Array:
    """The k chosen experts of each token, int32 [..., T, k] in ascending expert index.

    kth_T: `kth_largest(sel_ET, k, keep_E)`, computed outside this call (see the module docstring).
    keep_E: as in `kth_largest`. The same set as `lax.top_k` of the masked scores (ties to the
    lower index), in a different order; with fewer than k experts kept the empty seats are -1.
    """
    above_ET, tied_ET = sel_ET > kth_T[..., None, :], sel_ET == kth_T[..., None, :]
    if keep_E is not None:
        above_ET, tied_ET = above_ET & keep_E[..., None], tied_ET & keep_E[..., None]
    above, tied = _bit_words(above_ET), _bit_words(tied_ET)
    seats_T = k - sum(jax.lax.population_count(w).astype(jnp.int32) for w in above)
    chosen = above
    for i in range(k):  # seat the lowest-index tied experts while seats are left
        _, lowest, tied = _split_lowest_bit(tied)
        chosen = [jnp.where(i < seats_T, c | low, c) for c, low in zip(chosen, lowest)]
    idx = []
    for _ in range(k):
        i_T, _, chosen = _split_lowest_bit(chosen)
        idx.append(i_T)
    return jnp.stack(idx, axis=-1)


def _bit_words(flags_ET: jax.Array) -> list[jax.Array]:
    """bool [..., E, T] -> ceil(E/32) uint32 words [..., T]: bit e % 32 of word e // 32 is flags[e]."""
    words = []
    for start in range(0, flags_ET.shape[-2], 32):
        part = flags_ET[..., start:start + 32, :]
        bit = (_ONE << jnp.arange(part.shape[-2], dtype=jnp.uint32))[:, None]
        words.append(jnp.sum(jnp.where(part, bit, jnp.uint32(0)), axis=-2, dtype=jnp.uint32))
    return words


def _split_lowest_bit(words: list[jax.Array]):
    """(index of the lowest set bit, -1 if none; words holding only that bit; words without it)."""
    found = jnp.zeros(words[0].shape, bool)
    idx = jnp.full(words[0].shape, -1, jnp.int32)
    lowest, rest = [], []
    for i, w in enumerate(words):
        here = ~found & (w != 0)
        low = jnp.where(here, w & (~w + _ONE), jnp.uint32(0))  # two's complement: w & -w
        idx = jnp.where(here, jax.lax.population_count(low - _ONE).astype(jnp.int32) + 32 * i, idx)
        lowest.append(low)
        rest.append(w ^ low)
        found = found | here
    return idx, lowest, rest

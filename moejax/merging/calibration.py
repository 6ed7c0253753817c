"""What merging needs from a calibration pass, beside the scores' statistics: per MoE layer,
accumulated over batches in float64, padding tokens left out.

    counts_E        |X_j|: top-k routing decisions per expert (freq_j = counts_j / sum_i counts_i)
    output_sum_EH   sum over *all* calibration tokens x of f_j(x), every expert on every token
                    (HC-SMoE's c_j = output_sum_j / n_tokens)
    logit_gram_EE   G = sum_x l(x) l(x)^T, l(x) = the router logits of x (M-SMoE's cosine of logit
                    columns: cos(l_i, l_j) = G_ij / sqrt(G_ii G_jj))

and, only for REAM (`merge_stats(..., ream=True)`; hc_smoe and m_smoe compute nothing more):

    gated_output_sum_EH  sum over all calibration tokens x of p_j(x) f_j(x), p(x) = softmax of the
                         raw router logits over all E (REAM's router-weighted outputs, `gated_sim`)
    act_inputs_NH        the router inputs x of a fixed random sample of at most N calibration tokens
                         (`subsample_positions`, seeded), float32: REAM's neuron alignment computes
                         every expert's intermediate activations on them at merge time, from the
                         weights, so the pass holds [N, H] per layer, never [E, N, F] or [E, T, H]

Every expert on every token costs E / top_k times the routed experts' work, so this runs only
when a merge is asked for.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moejax.errors import ConfigError
from moejax.models.layers import linear

HIGHEST = jax.lax.Precision.HIGHEST


@dataclasses.dataclass
class MergeStats:
    counts_E: np.ndarray
    output_sum_EH: np.ndarray
    logit_gram_EE: np.ndarray
    n_tokens: int
    gated_output_sum_EH: np.ndarray | None = None   # REAM only (ream=True)
    act_inputs_NH: np.ndarray | None = None         # REAM only (ream=True)

    @property
    def mean_output_EH(self) -> np.ndarray:
        return self.output_sum_EH / max(self.n_tokens, 1)

    @property
    def has_ream(self) -> bool:
        return self.gated_output_sum_EH is not None and self.act_inputs_NH is not None


def subsample_positions(n_valid: int, n: int, seed: int = 0) -> np.ndarray:
    """Sorted ordinals, among the n_valid calibration tokens that are not padding (in batch order),
    of min(n, n_valid) tokens drawn without replacement by `numpy.random.default_rng(seed)`; all of
    them when n >= n_valid. The same for every layer of one pass, and for any batching of the same
    tokens."""
    if n >= n_valid:
        return np.arange(n_valid)
    return np.sort(np.random.default_rng(seed).choice(n_valid, size=n, replace=False))


@functools.partial(jax.jit, static_argnums=(0, 4))
def _sums(graphdef, state, x_TH, valid_T, ream: bool):
    """(G [E, E], sum_x f_j(x) [E, H], top-k counts [E], and with `ream` sum_x p_j(x) f_j(x) [E, H]
    (p = softmax of the raw logits over E), else None) of one batch of router inputs, in float32."""
    moe = nnx.merge(graphdef, state)
    raw = moe.router_logits(x_TH)
    logits = raw * valid_T[:, None]
    gram = jnp.matmul(logits.T, logits, precision=HIGHEST)
    valid_T1 = valid_T[:, None] > 0
    # REAM's router weights of the valid tokens (0 elsewhere), applied by a [T] x [T, H] product
    pv_ET = (jax.nn.softmax(raw, axis=-1) * valid_T[:, None]).T if ream else None

    def out_sums(e, carry):  # expert e on every token, summed: [H] (a loop over experts keeps memory at [T, F])
        sums, gated, weights = carry
        # the weights ride in the carry through a barrier, so XLA cannot hoist the float32
        # conversion of a bfloat16 stack out of the loop (a float32 copy of every expert, 2.2 GB at
        # Moonlight's shape; as in `moejax.moe.grouped._SortedExpertLoop.run`)
        weights = jax.lax.optimization_barrier(weights)
        w_e = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, e, keepdims=False), weights)
        f = moe.expert_fn(linear, w_e, x_TH).astype(jnp.float32)
        # the padding tokens' outputs selected away, not multiplied by 0: XLA:CPU fuses a product by a
        # [T, 1] mask into the expert's fusion and runs the whole of it 10x slower (25 GFLOP/s)
        sums = sums.at[e].set(jnp.sum(jnp.where(valid_T1, f, 0.0), axis=0))
        if pv_ET is not None:
            gated = gated.at[e].set(jnp.matmul(pv_ET[e], f, precision=HIGHEST))
        return sums, gated, weights

    E, H = moe.router.shape
    zeros = jnp.zeros((E, H), jnp.float32)
    sums, gated, _ = jax.lax.fori_loop(0, E, out_sums, (zeros, zeros if ream else None, moe.expert_weights()))
    idx = moe.route(x_TH).expert_idx_TK
    counts = jnp.zeros(logits.shape[1], jnp.float32).at[idx.reshape(-1)].add(jnp.repeat(valid_T, idx.shape[1]))
    return gram, sums, counts, gated


def merge_stats(moe, router_inputs, masks, ream: bool = False, ream_tokens: int | None = None,
                seed: int = 0) -> MergeStats:
    """MergeStats of one MoE layer over batches of router inputs [T, H] (masks [T] or None).
    ream: also REAM's statistics (the router-weighted output sums and the router inputs of
    `subsample_positions(n_valid, ream_tokens, seed)`; ream_tokens is `Ream.tokens`, which
    `Ream.stats_options()` passes)."""
    if ream and (isinstance(ream_tokens, bool) or not isinstance(ream_tokens, (int, np.integer)) or ream_tokens < 1):
        raise ConfigError(f"ream_tokens={ream_tokens!r}: expected an integer >= 1 (calibration tokens REAM's "
                          "neuron alignment samples)")
    graphdef, state = nnx.split(moe)
    E, H = moe.router.shape
    router_inputs = list(router_inputs)
    valid_host = [np.ones(x.shape[0], bool) if m is None else np.asarray(m, bool).reshape(-1)
                  for x, m in zip(router_inputs, masks)]
    chosen = subsample_positions(int(sum(v.sum() for v in valid_host)), int(ream_tokens), seed) if ream else None
    gram, sums, counts, gated, n, picked = np.zeros((E, E)), np.zeros((E, H)), np.zeros(E), np.zeros((E, H)), 0, []
    for x_TH, valid in zip(router_inputs, valid_host):
        g, s, c, gs = jax.device_get(_sums(graphdef, state, x_TH, jnp.asarray(valid, jnp.float32), ream))
        gram += g
        sums += s
        counts += c
        if ream:
            gated += gs
            local = chosen[(chosen >= n) & (chosen < n + valid.sum())] - n   # ordinals among this batch's valid tokens
            if len(local):
                picked.append(np.asarray(jax.device_get(x_TH[np.flatnonzero(valid)[local]]), np.float32))
        n += int(valid.sum())
    if not ream:
        return MergeStats(counts_E=counts, output_sum_EH=sums, logit_gram_EE=gram, n_tokens=n)
    x_NH = np.concatenate(picked) if picked else np.zeros((0, H), np.float32)
    return MergeStats(counts_E=counts, output_sum_EH=sums, logit_gram_EE=gram, n_tokens=n,
                      gated_output_sum_EH=gated, act_inputs_NH=x_NH)

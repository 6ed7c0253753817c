"""What merging needs from a calibration pass, beside the scores' statistics: per MoE layer,
accumulated over batches in float64, padding tokens left out.

    counts_E        |X_j|: top-k routing decisions per expert (freq_j = counts_j / sum_i counts_i)
    output_sum_EH   sum over *all* calibration tokens x of f_j(x), every expert on every token
                    (HC-SMoE's c_j = output_sum_j / n_tokens)
    logit_gram_EE   G = sum_x l(x) l(x)^T, l(x) = the router logits of x (M-SMoE's cosine of logit
                    columns: cos(l_i, l_j) = G_ij / sqrt(G_ii G_jj))

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

HIGHEST = jax.lax.Precision.HIGHEST


@dataclasses.dataclass
class MergeStats:
    counts_E: np.ndarray
    output_sum_EH: np.ndarray
    logit_gram_EE: np.ndarray
    n_tokens: int

    @property
    def mean_output_EH(self) -> np.ndarray:
        return self.output_sum_EH / max(self.n_tokens, 1)


@functools.partial(jax.jit, static_argnums=0)
def _sums(graphdef, state, x_TH, valid_T):
    """(G [E, E], sum_x f_j(x) [E, H], top-k counts [E]) of one batch of router inputs, in float32."""
    moe = nnx.merge(graphdef, state)
    logits = moe.router_logits(x_TH) * valid_T[:, None]
    gram = jnp.matmul(logits.T, logits, precision=HIGHEST)
    w = valid_T.astype(jnp.float32)[:, None]

    def out_sum(weights):  # one expert on every token, summed: [H] (a loop over experts keeps memory at [T, F])
        f = moe.expert_fn(lambda a, b: jnp.matmul(a, b, precision=HIGHEST), weights, x_TH)
        return jnp.sum(f.astype(jnp.float32) * w, axis=0)

    sums = jax.lax.map(out_sum, moe.expert_weights())
    idx = moe.route(x_TH).expert_idx_TK
    counts = jnp.zeros(logits.shape[1], jnp.float32).at[idx.reshape(-1)].add(jnp.repeat(valid_T, idx.shape[1]))
    return gram, sums, counts


def merge_stats(moe, router_inputs, masks) -> MergeStats:
    """MergeStats of one MoE layer over batches of router inputs [T, H] (masks [T] or None)."""
    graphdef, state = nnx.split(moe)
    E, H = moe.router.shape
    gram, sums, counts, n = np.zeros((E, E)), np.zeros((E, H)), np.zeros(E), 0
    for x_TH, mask in zip(router_inputs, masks):
        valid = jnp.ones(x_TH.shape[0], jnp.float32) if mask is None else jnp.asarray(mask, jnp.float32)
        g, s, c = jax.device_get(_sums(graphdef, state, x_TH, valid))
        gram += g
        sums += s
        counts += c
        n += int(np.asarray(valid).sum())
    return MergeStats(counts_E=counts, output_sum_EH=sums, logit_gram_EE=gram, n_tokens=n)

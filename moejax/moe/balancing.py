"""Auxiliary-loss-free load balancing (DeepSeek-V3): bias -= rate * sign(load - mean(load)).

The hot loop of the toy experiment. Each step needs only the expert *loads* under the current
bias, not the gates, so instead of a top-k per token it finds each token's K-th largest biased
score (with multiplicity) by K rounds of max-and-remove in an expert-major layout (every round is
elementwise over tokens), then counts the experts at or above it; when a float tie puts more than K
experts there, it keeps those above plus the lowest-index tied ones: exactly the set `route` (top-k, ties to the lower index) chooses.

Batched natively over leading axes (several seeds and conditions at once).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moejax.moe.routing import RouterConfig, route, routing_counts


def _loads_by_threshold(scores_BET: jax.Array, bias_BE: jax.Array, top_k: int) -> jax.Array:
    """Expert loads [B, E] of sigmoid top-k routing without groups or masks."""
    sel_BET = scores_BET + bias_BE[..., None]
    rest_BET = sel_BET
    kth_BT = jnp.full(sel_BET.shape[:-2] + sel_BET.shape[-1:], jnp.inf, sel_BET.dtype)
    taken_BT = jnp.zeros(kth_BT.shape, jnp.int32)
    for _ in range(top_k):  # each round removes all copies of the current max
        top_BT = rest_BET.max(axis=-2)
        is_top_BET = rest_BET >= top_BT[..., None, :]
        need_BT = taken_BT < top_k
        kth_BT = jnp.where(need_BT, top_BT, kth_BT)
        taken_BT = taken_BT + jnp.where(need_BT, is_top_BET.sum(axis=-2, dtype=jnp.int32), 0)
        rest_BET = jnp.where(is_top_BET, -jnp.inf, rest_BET)
    at_or_above_BET = sel_BET >= kth_BT[..., None, :]
    fast = jnp.sum(at_or_above_BET, axis=-1, dtype=jnp.int32)

    def with_ties():  # some token has more than K experts at or above its K-th value
        above_BET = sel_BET > kth_BT[..., None, :]
        at_BET = at_or_above_BET & ~above_BET
        free_BT = top_k - above_BET.sum(axis=-2, dtype=jnp.int32)  # seats left for the tied experts
        tie_rank_BET = jnp.cumsum(at_BET, axis=-2, dtype=jnp.int32) - at_BET  # lower index first
        chosen_BET = above_BET | (at_BET & (tie_rank_BET < free_BT[..., None, :]))
        return jnp.sum(chosen_BET, axis=-1, dtype=jnp.int32)

    n_tokens = sel_BET.shape[-1]
    return jax.lax.cond(jnp.all(fast.sum(axis=-1) == n_tokens * top_k), lambda: fast, with_ties)

def balance_bias(logits_BTE: jax.Array, cfg: RouterConfig, steps: int, rate: float) -> jax.Array:
    """`steps` balancing updates on fixed router logits [..., T, E], starting from a zero bias.

    Returns the final bias [..., E]; each leading index is balanced independently.
    """
    *batch, n_tokens, n_experts = logits_BTE.shape
    logits_NTE = logits_BTE.reshape(-1, n_tokens, n_experts).astype(jnp.float32)
    scores_NET = jnp.swapaxes(jax.nn.sigmoid(logits_NTE), -1, -2)

    def loads(b_NE):
        if cfg.scoring_func == "sigmoid" and cfg.n_group == 1:
            return _loads_by_threshold(scores_NET, b_NE, cfg.top_k)
        # softmax or group-limited routing: plain top-k through the routing function
        idx = jax.vmap(lambda lg, b: route(lg, cfg, b).expert_idx_TK)(logits_NTE, b_NE)
        return jax.vmap(lambda i: routing_counts(i, n_experts))(idx)

    def step(b_NE, _):
        load = loads(b_NE)
        return b_NE - rate * jnp.sign(load - load.mean(axis=-1, keepdims=True)), None

    b0 = jnp.zeros(logits_NTE.shape[::2], jnp.float32)
    return jax.lax.scan(step, b0, None, length=steps)[0].reshape(*batch, n_experts)

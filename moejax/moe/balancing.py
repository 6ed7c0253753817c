"""Auxiliary-loss-free load balancing (DeepSeek-V3): bias -= rate * sign(load - mean(load)).

The hot loop of the toy experiment. Each step needs only the expert *loads* under the current
bias, not the gates. So instead of a top-k per token it finds each token's K-th largest biased
score (with multiplicity) and counts, per expert, the tokens where the expert is at or above it.
When a float tie puts more than K experts there, it keeps those above plus the lowest-index tied
ones: exactly the set `route` (top-k, ties to the lower index) chooses.

The K-th largest comes from `moejax.moe.topk.kth_largest`, an insertion network over the expert
axis run as one fused loop (about 10x faster on CPU than `lax.top_k` or K rounds of
max-and-remove).

Batched natively over leading axes (several seeds and conditions at once).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moejax.moe.routing import RouterConfig, route, routing_counts
from moejax.moe.topk import kth_largest


def loads_at_threshold(sel_BET: jax.Array, kth_BT: jax.Array, top_k: int, max_tied: int = 64) -> jax.Array:
    """Expert loads [..., E] of top-k routing, given each token's K-th largest `sel` (`kth_largest`).

    Counting the experts at or above the K-th value is exact unless a float tie puts more than K
    experts there. Ties are rare but not negligible (a bias moving in steps of the balancing rate
    meets a score gap of the same size in about every other step of toy3), so they are mended
    where they are: up to `max_tied` tied tokens are routed one by one with `lax.top_k` (ties to
    the lower index, as `route` does); more than that falls back to a rank over every token.

    Keep `kth_BT` a materialised array (an argument or a loop carry): computed in the same fusion,
    XLA would recompute it for every expert.
    """
    *batch, n_experts, n_tokens = sel_BET.shape
    sel_NET = sel_BET.reshape(-1, n_experts, n_tokens)
    kth_NT = kth_BT.reshape(-1, n_tokens)
    at_or_above_NET = sel_NET >= kth_NT[:, None, :]
    # summed in float32 (exact below 2**24 tokens): XLA:CPU reduces float32 about 2x faster than int32
    fast_NE = jnp.sum(at_or_above_NET.astype(jnp.float32), axis=-1).astype(jnp.int32)

    def mend_ties():
        tied_NT = at_or_above_NET.sum(axis=-2, dtype=jnp.int32) > top_k
        return jax.lax.cond(tied_NT.sum() <= max_tied, mend_few, mend_all, tied_NT)

    def mend_few(tied_NT):  # subtract, per tied token, the experts counted beyond its top-k
        n_M, t_M = jnp.nonzero(tied_NT, size=max_tied, fill_value=0)
        real_M = jnp.arange(max_tied) < tied_NT.sum()
        sel_ME = sel_NET[n_M, :, t_M]
        _, idx_MK = jax.lax.top_k(sel_ME, top_k)
        chosen_ME = jax.nn.one_hot(idx_MK, n_experts, dtype=jnp.int32).sum(axis=-2)
        extra_ME = (sel_ME >= kth_NT[n_M, t_M][:, None]).astype(jnp.int32) - chosen_ME
        return fast_NE.at[n_M].add(-jnp.where(real_M[:, None], extra_ME, 0))

    def mend_all(tied_NT):  # many ties: the experts above, plus the lowest-index tied ones
        above_NET = sel_NET > kth_NT[:, None, :]
        at_NET = at_or_above_NET & ~above_NET
        free_NT = top_k - above_NET.sum(axis=-2, dtype=jnp.int32)  # seats left for the tied experts
        tie_rank_NET = jnp.cumsum(at_NET, axis=-2, dtype=jnp.int32) - at_NET  # lower index first
        chosen_NET = above_NET | (at_NET & (tie_rank_NET < free_NT[:, None, :]))
        return jnp.sum(chosen_NET, axis=-1, dtype=jnp.int32)

    no_ties = jnp.all(fast_NE.sum(axis=-1) == n_tokens * top_k)
    return jax.lax.cond(no_ties, lambda: fast_NE, mend_ties).reshape(*batch, n_experts)


def balance_bias(logits_BTE: jax.Array, cfg: RouterConfig, steps: int, rate: float,
                 max_period: int = 4) -> jax.Array:
    """`steps` balancing updates on fixed router logits [..., T, E], starting from a zero bias.

    Returns the final bias [..., E]; each leading index is balanced independently.

    Each step is a function of the bias alone, so once a bias comes back bit for bit (after p
    steps, p <= max_period) the rest of the trajectory is a known cycle and the bias after
    `steps` steps is read off it. toy3's 16 balancing runs fall into a 2-cycle within 80-145 of
    their 300 steps; the loop stops when every run has. max_period=0 always runs every step.
    """
    *batch, n_tokens, n_experts = logits_BTE.shape
    logits_NTE = logits_BTE.reshape(-1, n_tokens, n_experts).astype(jnp.float32)
    b0 = jnp.zeros(logits_NTE.shape[::2], jnp.float32)

    def update(b_NE, load_NE):
        return b_NE - rate * jnp.sign(load_NE - load_NE.mean(axis=-1, keepdims=True))

    if cfg.scoring_func == "sigmoid" and cfg.n_group == 1:
        scores_NET = jnp.swapaxes(jax.nn.sigmoid(logits_NTE), -1, -2)  # expert-major: tokens elementwise

        def advance(carry):
            # The carry holds each token's K-th value under the current bias, computed at the
            # end of the previous step, so it is materialised between the loops (see
            # loads_at_threshold) rather than recomputed inside the counting pass.
            b_NE, kth_NT = carry
            b_NE = update(b_NE, loads_at_threshold(scores_NET + b_NE[..., None], kth_NT, cfg.top_k))
            return b_NE, kth_largest(scores_NET + b_NE[..., None], cfg.top_k)

        init = (b0, kth_largest(scores_NET, cfg.top_k))
    else:  # softmax or group-limited routing: plain top-k through the routing function
        def advance(carry):
            idx = jax.vmap(lambda lg, b: route(lg, cfg, b).expert_idx_TK)(logits_NTE, carry[0])
            return (update(carry[0], jax.vmap(lambda i: routing_counts(i, n_experts))(idx)),)

        init = (b0,)
    return _bias_after(advance, init, steps, max_period).reshape(*batch, n_experts)


def _bias_after(advance, init: tuple, steps: int, max_period: int) -> jax.Array:
    """Apply `advance` (carry -> carry, carry[0] the bias [N, E]) `steps` times, stopping early
    once every row's bias has repeated (bitwise) with a period of at most `max_period`."""
    b0_NE = init[0]
    n_rows = b0_NE.shape[0]
    rows_N = jnp.arange(n_rows)
    periods_P = jnp.arange(1, max_period + 1)
    # recent[i] = the bias i steps ago, as int32 bits (bitwise equality: no -0.0 == 0.0)
    recent0 = jnp.zeros((max_period + 1,) + b0_NE.shape, jnp.int32).at[0].set(
        jax.lax.bitcast_convert_type(b0_NE, jnp.int32))

    def unfinished(state):
        n, _, _, done_N, _ = state
        return (n < steps) & ~jnp.all(done_N)

    def step(state):
        n, carry, recent, done_N, answer_NE = state
        carry, n = advance(carry), n + 1
        recent = jnp.concatenate([jax.lax.bitcast_convert_type(carry[0], jnp.int32)[None], recent[:-1]])
        # period p: the bias now equals the bias p steps ago (which must exist: p <= n)
        same_PN = jnp.all(recent[1:] == recent[:1], axis=-1) & (periods_P <= n)[:, None]
        found_N = same_PN.any(axis=0)
        p_N = jnp.argmax(same_PN, axis=0) + 1  # the smallest period
        # bias(steps) = bias(n - p + (steps - n) mod p), i.e. p - (steps - n) mod p steps ago
        ago_N = p_N - (steps - n) % p_N
        target_NE = jax.lax.bitcast_convert_type(recent[ago_N, rows_N], jnp.float32)
        answer_NE = jnp.where((found_N & ~done_N)[:, None], target_NE, answer_NE)
        return n, carry, recent, done_N | found_N, answer_NE

    if max_period < 1:
        return jax.lax.fori_loop(0, steps, lambda _, carry: advance(carry), init)[0]
    state = (jnp.int32(0), init, recent0, jnp.zeros(n_rows, bool), b0_NE)
    _, carry, _, done_N, answer_NE = jax.lax.while_loop(unfinished, step, state)
    return jnp.where(done_N[:, None], answer_NE, carry[0])

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
from moejax.moe.topk import kth_largest, topk_indices_at_threshold


def bias_step(bias_E: jax.Array, load_E: jax.Array, rate: float) -> jax.Array:
    """One step of auxiliary-loss-free balancing (DeepSeek-V3 section 2.1.2), over the last axis:
    bias - rate * sign(load - mean(load)). Busy experts' biases fall, idle ones rise."""
    load_E = load_E.astype(jnp.float32)
    return bias_E - rate * jnp.sign(load_E - load_E.mean(axis=-1, keepdims=True))


def loads_at_threshold(sel_BET: jax.Array, kth_BT: jax.Array, top_k: int) -> jax.Array:
    """Expert loads [..., E] of top-k routing, given each token's K-th largest `sel` (`kth_largest`).

    Counting the experts at or above the K-th value is exact unless a float tie puts more than K
    experts there. Ties are rare but not negligible (a bias moving in steps of the balancing rate
    meets a score gap of the same size in about every other step of toy3); a step with one reads
    every token's chosen experts off `topk_indices_at_threshold` (ties to the lower index, as
    `route` chooses) and counts those.

    Keep `kth_BT` a materialised array (an argument or a loop carry): computed in the same fusion,
    XLA would recompute it for every expert.
    """
    *batch, n_experts, n_tokens = sel_BET.shape
    sel_BET = sel_BET.reshape(-1, n_experts, n_tokens)
    kth_BT = kth_BT.reshape(-1, n_tokens)
    # summed in float32 (exact below 2**24 tokens): XLA:CPU reduces float32 about 2x faster than int32
    fast_BE = jnp.sum((sel_BET >= kth_BT[:, None, :]).astype(jnp.float32), axis=-1).astype(jnp.int32)

    def with_ties():
        idx_BTK = topk_indices_at_threshold(sel_BET, kth_BT, top_k)
        rows_B11 = jnp.arange(idx_BTK.shape[0])[:, None, None]
        return jnp.zeros_like(fast_BE).at[rows_B11, idx_BTK].add(1)

    no_ties = jnp.all(fast_BE.sum(axis=-1) == n_tokens * top_k)
    return jax.lax.cond(no_ties, lambda: fast_BE, with_ties).reshape(*batch, n_experts)


def balance_bias(logits_BTE: jax.Array, cfg: RouterConfig, steps: int, rate: float,
                 max_period: int = 4) -> jax.Array:
    """`steps` balancing updates on fixed router logits [..., T, E], starting from a zero bias.

    Returns the final bias [..., E]; each leading index is balanced independently, one after
    another (`lax.map`), so each stops at its own step.

    Each step is a function of the bias alone, so once a bias comes back bit for bit (after p
    steps, p <= max_period) the rest of the trajectory is a known cycle and the bias after
    `steps` steps is read off it. toy3's 16 balancing runs fall into a 2-cycle within 80-145 of
    their 300 steps: batched together, every run stepped until the last had (0.80 s on the 16;
    one at a time 0.50 s, and the same biases). max_period=0 always runs every step.
    """
    *batch, n_tokens, n_experts = logits_BTE.shape
    logits_BTE = logits_BTE.reshape(-1, n_tokens, n_experts).astype(jnp.float32)

    def one_run(logits_TE):
        return _balance_runs(logits_TE[None], cfg, steps, rate, max_period)[0]

    return jax.lax.map(one_run, logits_BTE).reshape(*batch, n_experts)


def _balance_runs(logits_BTE: jax.Array, cfg: RouterConfig, steps: int, rate: float, max_period: int) -> jax.Array:
    """`balance_bias` of runs [B, T, E] stepped together until all have stopped (`balance_bias`
    passes one run at a time)."""
    n_experts = logits_BTE.shape[-1]
    b0 = jnp.zeros(logits_BTE.shape[::2], jnp.float32)

    def update(b_BE, load_BE):
        return bias_step(b_BE, load_BE, rate)

    if cfg.scoring_func == "sigmoid" and cfg.n_group == 1:
        scores_BET = jnp.swapaxes(jax.nn.sigmoid(logits_BTE), -1, -2)  # expert-major: tokens elementwise

        def advance(carry):
            # The carry holds each token's K-th value under the current bias, computed at the
            # end of the previous step, so it is materialised between the loops (see
            # loads_at_threshold) rather than recomputed inside the counting pass.
            b_BE, kth_BT = carry
            b_BE = update(b_BE, loads_at_threshold(scores_BET + b_BE[..., None], kth_BT, cfg.top_k))
            return b_BE, kth_largest(scores_BET + b_BE[..., None], cfg.top_k)

        init = (b0, kth_largest(scores_BET, cfg.top_k, unrolled=False))  # once: cheap to compile
    else:  # softmax or group-limited routing: plain top-k through the routing function
        def advance(carry):
            idx = jax.vmap(lambda lg, b: route(lg, cfg, b).expert_idx_TK)(logits_BTE, carry[0])
            return (update(carry[0], jax.vmap(lambda i: routing_counts(i, n_experts))(idx)),)

        init = (b0,)
    return _bias_after(advance, init, steps, max_period)


def _bias_after(advance, init: tuple, steps: int, max_period: int) -> jax.Array:
    """Apply `advance` (carry -> carry, carry[0] the bias [B, E]) `steps` times, stopping early
    once every row's bias has repeated (bitwise) with a period of at most `max_period`."""
    b0_BE = init[0]
    n_rows = b0_BE.shape[0]
    rows_B = jnp.arange(n_rows)
    periods = jnp.arange(1, max_period + 1)  # the candidate periods 1..max_period
    # recent[i] = the bias i steps ago, as int32 bits (bitwise equality: no -0.0 == 0.0)
    recent0 = jnp.zeros((max_period + 1,) + b0_BE.shape, jnp.int32).at[0].set(
        jax.lax.bitcast_convert_type(b0_BE, jnp.int32))

    def unfinished(state):
        n, _, _, done_B, _ = state
        return (n < steps) & ~jnp.all(done_B)

    def step(state):
        n, carry, recent, done_B, answer_BE = state
        carry, n = advance(carry), n + 1
        recent = jnp.concatenate([jax.lax.bitcast_convert_type(carry[0], jnp.int32)[None], recent[:-1]])
        # period p: the bias now equals the bias p steps ago (which must exist: p <= n)
        same_at_period = jnp.all(recent[1:] == recent[:1], axis=-1) & (periods <= n)[:, None]  # [periods, B]
        found_B = same_at_period.any(axis=0)
        p_B = jnp.argmax(same_at_period, axis=0) + 1  # the smallest period
        # bias(steps) = bias(n - p + (steps - n) mod p), i.e. p - (steps - n) mod p steps ago
        ago_B = p_B - (steps - n) % p_B
        target_BE = jax.lax.bitcast_convert_type(recent[ago_B, rows_B], jnp.float32)
        answer_BE = jnp.where((found_B & ~done_B)[:, None], target_BE, answer_BE)
        return n, carry, recent, done_B | found_B, answer_BE

    if max_period < 1:
        return jax.lax.fori_loop(0, steps, lambda _, carry: advance(carry), init)[0]
    state = (jnp.int32(0), init, recent0, jnp.zeros(n_rows, bool), b0_BE)
    _, carry, _, done_B, answer_BE = jax.lax.while_loop(unfinished, step, state)
    return jnp.where(done_B[:, None], answer_BE, carry[0])

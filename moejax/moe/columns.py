"""Several routers' outputs of one MoE layer from one set of expert calls.

prune_real's carried pass compares the unpruned routed output with every variant's on the same
tokens. Each variant is a router *column*: a slot mask and the weight row each slot computes with
(`moejax.moe.expert_map.ExpertMap`). Running each column's routed output separately would call
K experts per token per column; here every token's experts are the *union* of the rows its
columns chose (at most K x C, usually far fewer), each called once, and each column's output is
that union weighted by its own gates:

    y_c(x_t) = sum_u gate[t, u, c] f_{row_u}(x_t)      (gate 0 where column c did not choose row u)

Every column is routed by the one routing function (`moejax.moe.routing.route`) in one loop body,
so a column whose choice equals another's gets bitwise-equal gates; and the sum runs term by term
in union order for every column, so equal gates give bitwise-equal outputs (a variant that leaves a
token's choice unchanged has error exactly 0).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from moejax.moe.dispatch import pair_outputs
from moejax.moe.expert_map import ExpertMap
from moejax.moe.grouped import exact_expert_loop_combined, large_experts, table_rows
from moejax.moe.routing import route


# Private letters of this module (over the package legend): J each token's (column, slot) pairs,
# K slots of every column side by side; U the union of a token's distinct table rows (at most
# min(rows, J)); A the columns (variants), as in the package legend.
def routed_columns(x_TD, logits_TE, router_cfg, bias_E, mask_AE, rows_AE, table: dict, expert_fn,
                   novice_AE=None, constants_ED=None):
    """[T, A, D]: column a's routed output on each token (router slots `mask_AE[a]`, slot e
    computing with row `rows_AE[a, e]` of `table`), from one call per (token, distinct row).
    novice_AE: each column's novice slots (MoNE substitution, `ExpertMap.novice_E`), returning
    constants_ED[e] (shared by the columns) times the gate instead of computing; their pairs join
    no union (absent), and their constants are added to the column's output in float32."""
    n_tokens, n_rows = x_TD.shape[0], table_rows(table)

    def column(per_column):
        mask, rows, novice = per_column
        em = ExpertMap(mask, rows, None, novice, None if novice is None else constants_ED)
        r, novices_TD = em.expert_routing(route(logits_TE, router_cfg, bias_E, mask), n_rows)
        return (r.expert_idx_TK, r.gate_TK) + (() if novices_TD is None else (novices_TD,))

    idx_ATK, gate_ATK, *novices = jax.lax.map(column, (mask_AE, rows_AE, novice_AE))
    n_cols, _, top_k = idx_ATK.shape
    idx_TJ = jnp.moveaxis(idx_ATK, 0, 1).reshape(n_tokens, -1)
    gate_TJ = jnp.moveaxis(gate_ATK, 0, 1).reshape(n_tokens, -1)
    owner_J = np.repeat(np.arange(n_cols), top_k)
    gate_TJA = gate_TJ[..., None] * jnp.asarray(np.eye(n_cols, dtype=np.float32)[owner_J])
    # the union: each token's distinct rows once (later copies of a row become absent, index n_rows,
    # their gates added to the first copy's)
    order_TJ = jnp.argsort(idx_TJ, axis=1, stable=True)
    idx_sorted = jnp.take_along_axis(idx_TJ, order_TJ, axis=1)
    gate_sorted = jnp.take_along_axis(gate_TJA, order_TJ[..., None], axis=1)
    first = jnp.concatenate([jnp.ones((n_tokens, 1), bool), idx_sorted[:, 1:] != idx_sorted[:, :-1]], axis=1)
    segment = jnp.cumsum(first, axis=1) - 1                                    # [T, J]: union slot
    n_union = min(n_rows, idx_TJ.shape[1])
    union_TU = jnp.full((n_tokens, n_union), n_rows, jnp.int32).at[
        jnp.arange(n_tokens)[:, None], jnp.where(first, segment, n_union)].set(idx_sorted, mode="drop")
    gate_TUA = jnp.zeros((n_tokens, n_union, gate_TJA.shape[-1]), jnp.float32).at[
        jnp.arange(n_tokens)[:, None], segment].add(gate_sorted)
    y_TAD = union_output(x_TD, union_TU, gate_TUA, table, expert_fn)
    return y_TAD if not novices else y_TAD + jnp.moveaxis(novices[0], 0, 1)


def union_output(x_TD, idx_TU, gate_TUA, table: dict, expert_fn):
    """[T, A, D]: column a's sum_u gate[t, u, a] f_{idx_tu}(x_t), each pair's output computed once
    (index = table rows: absent); large experts by the exact per-expert loop, small ones through
    the sorted grouped matmul."""
    if large_experts(table):
        return exact_expert_loop_combined(x_TD, idx_TU, gate_TUA, table, expert_fn)
    f_TUD = pair_outputs(x_TD, idx_TU, table, expert_fn, "sorted", forward_only=True).astype(jnp.float32)
    # term by term in union (= expert) order, the same operations for every column: columns with
    # equal gates give bitwise-equal outputs (a dot over u may round each output row differently)
    return jax.lax.fori_loop(0, idx_TU.shape[1], lambda u, y: y + gate_TUA[:, u, :, None] * f_TUD[:, u, None, :],
                             jnp.zeros(gate_TUA.shape[:1] + gate_TUA.shape[2:] + f_TUD.shape[-1:], jnp.float32))

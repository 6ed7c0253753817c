"""Interventional statistics of one MoE layer, from the calibration pass (NVIDIA ModelOpt's expert
removal importance, `modelopt/torch/prune/importance_hooks/expert_removal_hooks.py`):

- **leave one out, rerouted** (`RemoveExpertsIndependentHook`): for each token t and each expert j
  it chose, the routed output y^(-j)(x_t) the layer gives with j removed (router slot j masked, so
  the top-k is taken again over the other experts and the gates recomputed by the family's own
  routing, as a pruned checkpoint routes), against the unpruned y(x_t) (routed experts only, shared
  experts excluded): ||y^(-j) - y||^2 and cos(y^(-j), y), per (token, chosen slot) [T, K].
  A token that did not choose j is unchanged by removing it (error 0), so these pairs are all
  there is. Every column (unpruned, and one per chosen slot) is routed by the one routing function
  and computed from one set of expert calls per token (`moejax.moe.columns.routed_columns`: the
  union of the rows the columns chose, about K + 1), so the cost is a little more than the pass's
  own pairs.
- **each token's preference order** (`RankedChoiceVotingHook`): the experts by descending router
  logit (the router's own output: its logit bias included, a balance bias not), ties to the lower
  index; `moejax.scoring.scores.ranked_vote` runs the vote over them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moejax.moe.columns import routed_columns


def leave_one_out(x_TH, logits_TE, router_cfg, bias_E, idx_TK, table: dict, expert_fn):
    """(||y^(-j) - y||^2 [T, K], cos(y^(-j), y) [T, K]) for j = idx_TK[t, k], float32."""
    T, K = idx_TK.shape
    E = logits_TE.shape[-1]
    removed_KTE = jax.nn.one_hot(idx_TK.T, E, dtype=bool)
    mask_ATE = jnp.concatenate([jnp.ones((1, T, E), bool), ~removed_KTE])
    rows_AE = jnp.broadcast_to(jnp.arange(E, dtype=jnp.int32), (K + 1, E))
    y_TAH = routed_columns(x_TH, logits_TE, router_cfg, bias_E, mask_ATE, rows_AE, table, expert_fn)
    y_TH, rerouted_TKH = y_TAH[:, 0], y_TAH[:, 1:]
    sq_TK = jnp.sum(jnp.square(rerouted_TKH - y_TH[:, None]), axis=-1)
    dot_TK = jnp.sum(rerouted_TKH * y_TH[:, None], axis=-1)
    norms_TK = jnp.linalg.norm(rerouted_TKH, axis=-1) * jnp.linalg.norm(y_TH, axis=-1)[:, None]
    cos_TK = jnp.where(norms_TK > 0, dot_TK / jnp.where(norms_TK > 0, norms_TK, 1.0), 1.0)
    return sq_TK, cos_TK


def preference_order(logits_TE):
    """[T, E] int32: each token's experts by descending logit, ties to the lower index."""
    return jnp.argsort(-logits_TE.astype(jnp.float32), axis=-1, stable=True).astype(jnp.int32)

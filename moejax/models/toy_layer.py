"""The toy MoE layer of SPEC section 4 as pure functions of its weights (no Flax).

`moejax.models.toy.ToyMoE` is the same layer as a Flax NNX module and calls these; experiments
that hold the weights of many seeds as arrays (toy3) call them directly, which also spares a
cold run the Flax import (~0.6 s).

    weights = {"router": [E, d], "w1": [E, d, h], "w2": [E, h, d]}
    logits  = x @ router.T                 (float32)
    f_j(x)  = w2[j] . relu(w1[j] . x)
    y       = sum over the routed experts of gate * f_j(x)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moejax.moe import dispatch, grouped
from moejax.moe.routing import RouterConfig, Routing, route


def router_config(top_k: int) -> RouterConfig:
    """Sigmoid scores, no groups, gates renormalised over the chosen experts, scale 1."""
    return RouterConfig(top_k=top_k, scoring_func="sigmoid", norm_topk_prob=True)


def router_logits(router_ED: jax.Array, x_TD: jax.Array) -> jax.Array:
    """x @ W_router.T in float32 (the router always runs in float32)."""
    return jnp.matmul(x_TD.astype(jnp.float32), router_ED.astype(jnp.float32).T,
                      precision=jax.lax.Precision.HIGHEST)


def route_tokens(router_ED: jax.Array, x_TD: jax.Array, top_k: int, bias_E: jax.Array | None = None,
                 expert_mask_E: jax.Array | None = None) -> Routing:
    """The layer's routing of tokens x (SPEC section 1, through `route`)."""
    return route(router_logits(router_ED, x_TD), router_config(top_k), bias_E, expert_mask_E)


def routed_pass(weights: dict, x_TD: jax.Array, top_k: int, bias_E: jax.Array | None = None,
                expert_mask_E: jax.Array | None = None, backend: str = "sorted"):
    """Routing, each routed pair's expert output f_j(x) [T, K, D], and the layer output y [T, D]."""
    routing = route_tokens(weights["router"], x_TD, top_k, bias_E, expert_mask_E)
    f_TKD = dispatch.pair_outputs(x_TD, routing.expert_idx_TK, expert_weights(weights), dispatch.relu_mlp, backend)
    return routing, f_TKD, dispatch.combine(routing.gate_TK, f_TKD)


def expert_output_table(weights: dict, x_TD: jax.Array) -> jax.Array:
    """f_j(x_t) for every expert, [E, T, D]: the table every pruned variant's output is read from."""
    return grouped.expert_output_table(x_TD, expert_weights(weights), dispatch.relu_mlp)


def expert_weights(weights: dict) -> dict:
    """The experts' part of the layer's weights, as `dispatch.relu_mlp` takes them."""
    return {"w1": weights["w1"], "w2": weights["w2"]}

"""The toy MoE layer of SPEC section 4 as pure functions of its weights (no Flax).

`moejax.models.toy.ToyMoE` is the same layer as a Flax NNX module and calls these; experiments
that hold the weights of many seeds as arrays (toy3) call them directly, which also spares a
cold run the Flax import (~0.6 s).

    weights = {"router": [E, d], "w1": [E, d, h], "w2": [E, h, d]}
    logits  = x @ router.T                 (float32)
    s       = sigmoid(logits)              (router="sigmoid", DeepSeek-V3; the default)
              softmax(logits) over the E   (router="softmax", Qwen3-MoE / Mixtral; no balance bias)
    chosen  = top K of s + bias            (ties to the lower index), gates s renormalised over the K
    f_j(x)  = w2[j] . relu(w1[j] . x)
    y       = sum over the routed experts of gate * f_j(x)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moejax.errors import ConfigError
from moejax.moe import dispatch, grouped
from moejax.moe.routing import RouterConfig, Routing, route


ROUTERS = ("sigmoid", "softmax")


def router_config(top_k: int, router: str = "sigmoid") -> RouterConfig:
    """`router` scores (sigmoid or softmax), no groups, gates renormalised over the chosen
    experts (`norm_topk_prob`), scale 1."""
    if router not in ROUTERS:
        raise ConfigError(f"toy layer: router={router!r}; valid routers: {list(ROUTERS)}")
    return RouterConfig(top_k=top_k, scoring_func=router, norm_topk_prob=True)


def router_scores(logits_TE: jax.Array, router: str = "sigmoid") -> jax.Array:
    """The unpruned layer's affinities s [..., E] as `route` computes them: sigmoid(logits), or
    softmax(logits) over all E experts."""
    if router == "sigmoid":
        return jax.nn.sigmoid(logits_TE)
    if router == "softmax":
        return jax.nn.softmax(logits_TE, axis=-1)
    raise ConfigError(f"toy layer: router={router!r}; valid routers: {list(ROUTERS)}")


def router_logits(router_ED: jax.Array, x_TD: jax.Array) -> jax.Array:
    """x @ W_router.T in float32 (the router always runs in float32)."""
    return jnp.matmul(x_TD.astype(jnp.float32), router_ED.astype(jnp.float32).T,
                      precision=jax.lax.Precision.HIGHEST)


def route_tokens(router_ED: jax.Array, x_TD: jax.Array, top_k: int, bias_E: jax.Array | None = None,
                 expert_mask_E: jax.Array | None = None, router: str = "sigmoid") -> Routing:
    """The layer's routing of tokens x (SPEC section 1, through `route`)."""
    return route(router_logits(router_ED, x_TD), router_config(top_k, router), bias_E, expert_mask_E)


def routed_pass(weights: dict, x_TD: jax.Array, top_k: int, bias_E: jax.Array | None = None,
                expert_mask_E: jax.Array | None = None, backend: str = "sorted", router: str = "sigmoid"):
    """Routing, each routed pair's expert output f_j(x) [T, K, D], and the layer output y [T, D]."""
    routing = route_tokens(weights["router"], x_TD, top_k, bias_E, expert_mask_E, router)
    f_TKD = dispatch.pair_outputs(x_TD, routing.expert_idx_TK, expert_weights(weights), dispatch.relu_mlp, backend)
    return routing, f_TKD, dispatch.combine(routing.gate_TK, f_TKD)


def expert_output_table(weights: dict, x_TD: jax.Array) -> jax.Array:
    """f_j(x_t) for every expert, [E, T, D]: the table every pruned variant's output is read from."""
    return grouped.expert_output_table(x_TD, expert_weights(weights), dispatch.relu_mlp)


def mean_expert_outputs(weights: dict, x_TD: jax.Array) -> jax.Array:
    """c_j = mean_t f_j(x_t) for every expert, [E, D] (HC-SMoE's representation of an expert), as
    w2[j]^T . mean_t relu(w1[j]^T x_t): f_j is linear after its ReLU, so the mean moves inside and
    only the first matmul runs per token. A loop over experts, each a whole GEMM."""
    def one(w):
        h_TF = jax.nn.relu(jnp.matmul(x_TD, w["w1"], precision=jax.lax.Precision.HIGHEST))
        return jnp.matmul(jnp.mean(h_TF, axis=0), w["w2"], precision=jax.lax.Precision.HIGHEST)

    return jax.lax.map(one, expert_weights(weights))


def gated_expert_output_sums(weights: dict, x_TD: jax.Array, p_TE: jax.Array) -> jax.Array:
    """m_j = sum_t p_j(x_t) f_j(x_t) for every expert, [E, D] (REAM's router-weighted outputs, p the
    softmax of the raw router logits over all E), as w2[j]^T . sum_t p_j(x_t) relu(w1[j]^T x_t), as
    `mean_expert_outputs` moves the mean inside."""
    def one(args):
        w, p_T = args
        h_TF = jax.nn.relu(jnp.matmul(x_TD, w["w1"], precision=jax.lax.Precision.HIGHEST))
        return jnp.matmul(p_T @ h_TF, w["w2"], precision=jax.lax.Precision.HIGHEST)

    return jax.lax.map(one, (expert_weights(weights), p_TE.T))


def expert_weights(weights: dict) -> dict:
    """The experts' part of the layer's weights, as `dispatch.relu_mlp` takes them."""
    return {"w1": weights["w1"], "w2": weights["w2"]}

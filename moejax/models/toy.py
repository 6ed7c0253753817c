"""The toy MoE layer of SPEC section 4, as a Flax NNX module (the math: moejax/models/toy_layer.py).

One layer routed as DeepSeek-V3 routes (sigmoid, top K of E, balance bias, `norm_topk_prob`),
no groups and no shared expert; each expert is a two-layer ReLU MLP `W2 . relu(W1 . x)`.

| weight        | shape      | init                    |
|---------------|------------|-------------------------|
| router        | [E, d]     | normal, std 1/sqrt(d)   |
| w1 (per exp.) | [E, d, h]  | normal, std 1/sqrt(d)   |
| w2 (per exp.) | [E, h, d]  | normal, std 1/sqrt(h)   |
| bias          | [E]        | zeros (balancing moves it; never trained by gradient) |
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.models import toy_layer
from moejax.moe.routing import RouterConfig, Routing


class BalanceBias(nnx.Variable):
    """`e_score_correction_bias`: set by auxiliary-loss-free balancing, not by gradients, so it is
    its own Variable type and an optimizer built with `wrt=nnx.Param` leaves it alone."""


class ToyMoE(nnx.Module):
    def __init__(self, d_model: int = 32, d_hidden: int = 64, n_experts: int = 64, top_k: int = 4,
                 *, rngs: nnx.Rngs):
        self.router_cfg = self.router_cfg_for(top_k)
        self.router_cfg.check_experts(n_experts)
        normal = jax.nn.initializers.normal
        self.router = nnx.Param(normal(d_model ** -0.5)(rngs.params(), (n_experts, d_model)))
        self.w1 = nnx.Param(normal(d_model ** -0.5)(rngs.params(), (n_experts, d_model, d_hidden)))
        self.w2 = nnx.Param(normal(d_hidden ** -0.5)(rngs.params(), (n_experts, d_hidden, d_model)))
        self.bias = BalanceBias(jnp.zeros((n_experts,), jnp.float32))

    @staticmethod
    def router_cfg_for(top_k: int) -> RouterConfig:
        """Sigmoid scores, no groups, gates renormalised over the chosen experts, scale 1."""
        return toy_layer.router_config(top_k)

    @property
    def n_experts(self) -> int:
        return self.router.shape[0]

    def weights(self) -> dict:
        return {"router": self.router[...], "w1": self.w1[...], "w2": self.w2[...]}

    def expert_weights(self) -> dict:
        return toy_layer.expert_weights(self.weights())

    def router_logits(self, x_TD: jax.Array) -> jax.Array:
        """x @ W_router.T in float32 (the router always runs in float32)."""
        return toy_layer.router_logits(self.router[...], x_TD)

    def route(self, x_TD: jax.Array, expert_mask_E: jax.Array | None = None,
              bias_E: jax.Array | None = None) -> Routing:
        """Route with the layer's own balance bias, or with `bias_E` when given."""
        bias_E = self.bias[...] if bias_E is None else bias_E
        return toy_layer.route_tokens(self.router[...], x_TD, self.router_cfg.top_k, bias_E, expert_mask_E)

    def routed_pass(self, x_TD, expert_mask_E=None, backend: str = "sorted", bias_E=None):
        """Routing, each routed pair's expert output f_j(x) [T, K, D], and the layer output y [T, D]."""
        bias_E = self.bias[...] if bias_E is None else bias_E
        return toy_layer.routed_pass(self.weights(), x_TD, self.router_cfg.top_k, bias_E, expert_mask_E, backend)

    def __call__(self, x_TD, expert_mask_E=None, backend: str = "sorted", bias_E=None) -> jax.Array:
        return self.routed_pass(x_TD, expert_mask_E, backend, bias_E)[2]

    def expert_output_table(self, x_TD) -> jax.Array:
        """f_j(x_t) for every expert, [E, T, D]: the table every pruned variant's output is read from."""
        return toy_layer.expert_output_table(self.weights(), x_TD)

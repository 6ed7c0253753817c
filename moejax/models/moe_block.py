"""The one MoE block every family uses, and the interface executors and scorers read:

    moe.router_logits(x_TH)   float32 [T, E]: x @ W_router.T (+ the logit bias where the family has
                              one, gpt-oss; the router stays float32)
    moe.route(x_TH, mask_E)   `moejax.moe.routing.route` with the family's RouterConfig
                              (sigmoid/softmax/sqrtsoftplus, balance bias, groups, norm_topk_prob,
                              scaling); a hash-routed layer (DeepSeek-V4's `hash_moe`, `moe.tid2eid`
                              set) takes its experts from `tid2eid[ids_T]` and needs the tokens' ids
    moe.expert_weights()      the routed experts' stacked weights, as `moe.expert_fn` reads them
    moe.expert_fn             `moejax.moe.dispatch.swiglu` (gpt-oss: `ClampedSwiglu`), `cfg.expert_fn()`
    moe.balance_bias()        e_score_correction_bias [E], or None for a family without one
    moe.shared_experts        the shared-expert MLP or None; `shared_gate` [H, 1] when the shared
                              output is gated by sigmoid(x @ shared_gate) (Qwen2-MoE's form)
    moe(x_BSH, variant, ids_BS=)  (output [B, S, H], Routing of the router's slots); variant: None, a
                              pruning mask [E] or an `ExpertMap` (pruned, merged or substituted
                              experts); ids_BS: the tokens' ids (read by a hash-routed layer only)

A family config supplies what the block is built from: `n_experts`, `hidden_size`,
`moe_intermediate_size`, `router_settings()`, `HAS_BALANCE_BIAS`, `shared_intermediate_size`
(and `shared_expert_gate`, default False). A checkpoint pruned per layer (`moe_sparsity_config.
num_experts`) builds each block with its own layer's count (`n_experts=cfg.experts_in_layer(l)`):
the block is then exactly that checkpoint's layer, its expert index e the tensor `experts.{e}`
(with routing groups, groups of n_experts / n_group consecutive experts, as transformers reads a
checkpoint of that count).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.errors import ConfigError
from moejax.models.layers import HIGHEST, MLP, linear, param
from moejax.models.toy import BalanceBias
from moejax.moe import dispatch as dispatch_lib
from moejax.moe.expert_map import as_expert_map
from moejax.moe.grouped import table_rows
from moejax.moe.routing import RouterConfig, route


class HashTable(nnx.Variable):
    """`tid2eid` [V, K] (int32): the experts a hash-routed layer gives each token id, a frozen table
    read from the checkpoint (DeepSeek-V4 paper section 2.1); its own Variable type, so an optimizer
    built with `wrt=nnx.Param` and gradients leave it alone."""


class MoE(nnx.Module):
    """Router (float32, optional balance bias, optional logit bias, optional groups) + routed experts
    (fast dispatch; SwiGLU, or gpt-oss's biased clamped SwiGLU: `cfg.EXPERT_KIND`) + optional shared
    experts."""

    def __init__(self, cfg, dtype, rngs: nnx.Rngs, backend: str = "sorted", n_experts: int | None = None,
                 hashed: bool = False):
        """n_experts: the routed experts of this layer (default cfg.n_experts; a checkpoint pruned
        per layer: `cfg.experts_in_layer(layer)`). hashed: the layer's experts come from a
        `tid2eid` table [vocab_size, top_k] by token id (DeepSeek-V4's `hash_moe` layers, which have
        no balance bias)."""
        H, F, E = cfg.hidden_size, cfg.moe_intermediate_size, n_experts or cfg.n_experts
        self.router_cfg = RouterConfig(**cfg.router_settings())
        self.router_cfg.check_experts(E)  # a count the router cannot route over fails here, not in a trace
        self.router = param(rngs, (E, H), jnp.float32)                 # HF gate.weight layout, float32
        self.tid2eid = HashTable(jnp.zeros((cfg.vocab_size, self.router_cfg.top_k), jnp.int32)) if hashed else None
        self.bias = BalanceBias(jnp.zeros((E,), jnp.float32)) if cfg.HAS_BALANCE_BIAS and not hashed else None
        self.router_bias = nnx.Param(jnp.zeros((E,), jnp.float32)) if cfg.HAS_ROUTER_BIAS else None
        self.expert_fn = cfg.expert_fn()
        self.expert_names = tuple(dispatch_lib.EXPERT_SHAPES[cfg.EXPERT_KIND](H, F))
        for name, shape in dispatch_lib.EXPERT_SHAPES[cfg.EXPERT_KIND](H, F).items():
            setattr(self, "experts_" + name, param(rngs, (E, *shape), dtype))
        shared = cfg.shared_intermediate_size
        self.shared_experts = MLP(H, shared, dtype, rngs, cfg.shared_expert_fn()) if shared else None
        self.shared_gate = param(rngs, (H, 1), dtype) if shared and getattr(cfg, "shared_expert_gate", False) else None
        self.backend = backend

    def router_logits(self, x_TH, router_EH=None):
        """[T, E] in float32 (the router stays float32 whatever the model dtype); router_EH: other
        router weights to route with (a rerouted variant's), default the layer's own."""
        weights = self.router[...] if router_EH is None else jnp.asarray(router_EH, jnp.float32)
        logits = jnp.matmul(x_TH.astype(jnp.float32), weights.T, precision=HIGHEST)
        return logits if self.router_bias is None else logits + self.router_bias[...]

    def balance_bias(self):
        return None if self.bias is None else self.bias[...]

    def route(self, x_TH, expert_mask_E=None, router_EH=None, ids_T=None):
        """The Routing of tokens x [T, H]; ids_T: their token ids, which a hash-routed layer needs."""
        return route(self.router_logits(x_TH, router_EH), self.router_cfg, self.balance_bias(), expert_mask_E,
                     self.hashed_choice(ids_T))

    def hashed_choice(self, ids_T):
        """The experts [T, K] a hash-routed layer gives tokens of ids `ids_T`; None for a routed layer."""
        if self.tid2eid is None:
            return None
        if ids_T is None:
            raise ConfigError("a hash-routed MoE layer (DeepSeek-V4 hash_moe) chooses its experts by token id "
                              "(tid2eid[input_ids]); this pass did not hand it the tokens' ids")
        return self.tid2eid[...][jnp.asarray(ids_T).reshape(-1)]

    def expert_weights(self) -> dict:
        """The routed experts' stacked weights as `expert_fn` reads them ({"gate", "up", "down"} for SwiGLU)."""
        return {name: getattr(self, "experts_" + name)[...] for name in self.expert_names}

    def routed(self, x_TH, routing, forward_only: bool = False, weights: dict | None = None):
        """The gate-weighted sum of the routed experts' outputs [T, H] under `routing`, whose expert
        indices are rows of `weights` (default: the layer's own experts)."""
        return dispatch_lib.dispatch(x_TH, routing.expert_idx_TK, routing.gate_TK,
                                     self.expert_weights() if weights is None else weights,
                                     self.expert_fn, self.backend, forward_only=forward_only)

    def routed_variant(self, x_TH, variant, forward_only: bool = False, ids_T=None):
        """(routed output [T, H], the router's Routing over its slots) under a variant (None, a
        mask or an ExpertMap): the router chooses among the remaining slots, each chosen slot
        computes with its weight row; a novice slot (MoNE substitution) returns its gate times its
        constant instead (`ExpertMap.expert_routing`: its pairs are absent from a forward-only
        dispatch, gate 0 in any), added to the dispatch's output in float32."""
        em = as_expert_map(variant)
        if em is None:
            r = self.route(x_TH, ids_T=ids_T)
            return self.routed(x_TH, r, forward_only), r
        r = self.route(x_TH, em.mask_E, em.router_EH, ids_T)
        table = em.table(self.expert_weights())
        absent = table_rows(table) if forward_only else None
        experts_r, novices_TH = em.expert_routing(r, absent)
        y = self.routed(x_TH, experts_r, forward_only, table)
        if novices_TH is not None:
            y = (y.astype(jnp.float32) + novices_TH).astype(y.dtype)
        return y, r

    def shared(self, x_BSH):
        """The shared experts' output (zero-free: None when the family has none)."""
        if self.shared_experts is None:
            return None
        y = self.shared_experts(x_BSH)
        if self.shared_gate is not None:
            y = jax.nn.sigmoid(linear(x_BSH, self.shared_gate[...])) * y
        return y

    def __call__(self, x_BSH, variant=None, forward_only: bool = False, ids_BS=None):
        """(output [B, S, H], the routing of the B*S tokens). variant: None, a pruning mask [E] (or
        [B*S, E]) or an ExpertMap. forward_only: no gradients will be taken, so the routed experts
        may take the faster exact path (moejax.moe.dispatch). ids_BS: the tokens' ids (a hash-routed
        layer's choice; ignored by the others)."""
        B, S, H = x_BSH.shape
        x_TH = x_BSH.reshape(B * S, H)
        y, r = self.routed_variant(x_TH, variant, forward_only, None if ids_BS is None else ids_BS.reshape(B * S))
        y = y.reshape(B, S, H)
        shared = self.shared(x_BSH)
        return (y if shared is None else y + shared), r

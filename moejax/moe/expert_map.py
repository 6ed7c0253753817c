"""A variant's MoE layer as an *expert map*: which of the layer's router slots remain, and which
expert weights each remaining slot computes with (DESIGN: pruning and merging are one kind of
variant, evaluated by the same forward).

    ExpertMap(mask_E, rows_E=None, weights=None)
      mask_E   bool [E] (or [T, E], one row per token): the router slots a token may be routed to;
               the router itself is unchanged (softmax over the remaining slots, -inf elsewhere:
               `moejax.moe.routing.route`)
      rows_E   int [E] (or [T, E]): the row of `weights` that slot e computes with; None: row e
      weights  the expert table {name: [R, ...]} that rows index; None: the layer's own experts

Pruning keeps weights:       ExpertMap(kept_E)
Merging, `tied` router:      ExpertMap(all True, rows = each slot's cluster's merged expert, table)
Merging, `shrunk` router:    ExpertMap(True at each cluster's representative, same rows and table):
                             one router row per cluster, which is what a merged checkpoint holds.

`apply(routing)` turns the router's choice of slots into the choice of weight rows; the dispatch
backends then run unchanged on the table (one dispatch signature, whatever the variant).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp

from moejax.moe.routing import Routing


class ExpertMap(NamedTuple):
    mask_E: Any
    rows_E: Any = None
    weights: dict | None = None

    def apply(self, routing: Routing) -> Routing:
        """The routing with each chosen slot replaced by the weight row it computes with."""
        if self.rows_E is None:
            return routing
        rows = jnp.broadcast_to(self.rows_E, routing.expert_idx_TK.shape[:-1] + self.rows_E.shape[-1:])
        idx = jnp.take_along_axis(rows, routing.expert_idx_TK, axis=-1).astype(routing.expert_idx_TK.dtype)
        return routing._replace(expert_idx_TK=idx)

    def table(self, own: dict) -> dict:
        """The expert table the rows index: `weights`, or the layer's own experts."""
        return own if self.weights is None else self.weights


def as_expert_map(variant) -> ExpertMap | None:
    """None (the unpruned layer), an ExpertMap, or a bool mask (pruning: `ExpertMap(mask)`)."""
    if variant is None or isinstance(variant, ExpertMap):
        return variant
    return ExpertMap(variant)

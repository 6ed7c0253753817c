"""A variant's MoE layer as an *expert map*: which of the layer's router slots remain, and which
expert weights each remaining slot computes with (DESIGN: pruning, merging and substitution are one
kind of variant, evaluated by the same forward).

    ExpertMap(mask_E, rows_E=None, weights=None, novice_E=None, constants_EH=None, router_EH=None)
      mask_E       bool [E] (or [T, E], one row per token): the router slots a token may be routed
                   to; the router itself is unchanged (softmax over the remaining slots, -inf
                   elsewhere: `moejax.moe.routing.route`)
      rows_E       int [E] (or [T, E]): the row of `weights` that slot e computes with; None: row e
      weights      the expert table {name: [R, ...]} that rows index; None: the layer's own experts;
                   or a table in parts, rows numbered on across them (`moejax.moe.grouped`: the
                   carried pass's merge, the layer's own experts then the merged rows, uncopied)
      novice_E     bool [E] (or [T, E]): slots that return a constant instead of computing (MoNE's
                   "novices", arXiv 2507.00390); None: none. A novice slot keeps its router row and
                   stays routable (mask True); only what it returns changes
      constants_EH float [E, H]: slot e's constant output (read at novice slots only)
      router_EH    float32 [E, H]: the router weights this variant routes with (router
                   distillation, `moejax.training.reroute`); None: the layer's own

Pruning keeps weights:       ExpertMap(kept_E)
Merging, `tied` router:      ExpertMap(all True, rows = each slot's cluster's merged expert, table)
Merging, `shrunk` router:    ExpertMap(True at each cluster's representative, same rows and table):
                             one router row per cluster, which is what a merged checkpoint holds.
Substitution (MoNE):         ExpertMap(all True, novice_E = the substituted slots, constants_EH =
                             each one's mean output over the calibration tokens routed to it).

`expert_routing(routing)` turns the router's choice of slots into what the experts compute: the
weight row of each chosen slot (`apply`), and for a novice slot gate 0 in the dispatch (the expert
is not used for that pair) plus, beside the dispatch, the gate times the slot's constant:

    y(x) = sum_{k: slot_k not novice} g_k f_{row(slot_k)}(x)  +  sum_{k: slot_k novice} g_k c_{slot_k}

The dispatch backends then run unchanged on the table (one dispatch signature, whatever the variant).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from moejax.moe.routing import Routing


class ExpertMap(NamedTuple):
    mask_E: Any
    rows_E: Any = None
    weights: dict | None = None
    novice_E: Any = None
    constants_EH: Any = None
    router_EH: Any = None

    def apply(self, routing: Routing) -> Routing:
        """The routing with each chosen slot replaced by the weight row it computes with."""
        if self.rows_E is None:
            return routing
        return routing._replace(expert_idx_TK=_per_slot(self.rows_E, routing.expert_idx_TK).astype(
            routing.expert_idx_TK.dtype))

    def table(self, own: dict) -> dict:
        """The expert table the rows index: `weights`, or the layer's own experts."""
        return own if self.weights is None else self.weights

    def expert_routing(self, routing: Routing, absent_row: int | None = None) -> tuple[Routing, jax.Array | None]:
        """(the routing the experts compute under, the novices' output [T, H] float32 or None).

        Every chosen slot becomes its weight row (`apply`). Without novices that is all (None
        beside it: the dispatch is exactly a map without novice fields). A pair whose slot is a
        novice gets gate 0, and index `absent_row` when given (the table's row count: an absent
        pair, which a forward-only dispatch does not compute); its output g * constants[slot] is
        summed per token in float32, slot order, and returned beside for the caller to add."""
        mapped = self.apply(routing)
        if self.novice_E is None and self.constants_EH is None:
            return mapped, None
        if self.novice_E is None or self.constants_EH is None:
            raise ValueError("ExpertMap: novice_E and constants_EH go together (both or neither)")
        novice_TK = _per_slot(self.novice_E, routing.expert_idx_TK).astype(bool)
        gate_TK = routing.gate_TK.astype(jnp.float32)
        constants_EH = jnp.asarray(self.constants_EH, jnp.float32)
        out_TH = jnp.zeros(gate_TK.shape[:-1] + constants_EH.shape[-1:], jnp.float32)
        for k in range(gate_TK.shape[-1]):  # K gathered rows [T, H], summed as they come (no [T, K, H])
            g_T = jnp.where(novice_TK[..., k], gate_TK[..., k], 0.0)
            out_TH = out_TH + g_T[..., None] * constants_EH[routing.expert_idx_TK[..., k]]
        idx_TK = mapped.expert_idx_TK if absent_row is None else jnp.where(
            novice_TK, jnp.asarray(absent_row, mapped.expert_idx_TK.dtype), mapped.expert_idx_TK)
        return mapped._replace(expert_idx_TK=idx_TK, gate_TK=jnp.where(novice_TK, 0.0, mapped.gate_TK)), out_TH


def _per_slot(value_E, idx_TK):
    """value[t, idx_tk] of a per-slot value [E] (or [T, E], one row per token), [T, K]."""
    value = jnp.broadcast_to(value_E, idx_TK.shape[:-1] + value_E.shape[-1:])
    return jnp.take_along_axis(value, idx_TK, axis=-1)


def as_expert_map(variant) -> ExpertMap | None:
    """None (the unpruned layer), an ExpertMap, or a bool mask (pruning: `ExpertMap(mask)`)."""
    if variant is None or isinstance(variant, ExpertMap):
        return variant
    return ExpertMap(variant)

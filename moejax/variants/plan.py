"""What was decided: a variant's *plan*, per MoE layer, and the one place it becomes the
`{layer: ExpertMap}` the forward, prefill, decode, generate and the lm-eval backend take.

    Kept(kept_E)                              pruning: the router slots that remain (bool [E])
    Merged(merge, form)                       merging: a `moejax.merging.layer.LayerMerge` (clusters,
                                              leaders, merged experts) under router form tied | shrunk
    Substituted(kept_E, constants_EH)         substitution (MoNE): every slot stays routable; a slot
                                              not kept returns its constant row of constants_EH

    VariantPlan(spec, layers)                 {MoE layer: one of the above} for a `VariantSpec`
      .expert_maps()                          {layer: ExpertMap}
      .kept()                                 {layer: [router slots that remain as experts]}
    stacked_expert_map(plans, own, E)         many variants of one layer as one ExpertMap stacked
                                              over variants (the carried pass's held-out streams)

A merged plan can be recorded without its merged weights (`merge.weights` None: the clusters only,
what `prune_real` writes); it then has no expert maps.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from moejax.errors import ConfigError
from moejax.variants.spec import ROUTER_FORMS, VariantSpec


@dataclasses.dataclass(frozen=True)
class Kept:
    kept_E: np.ndarray      # bool [E]

    @property
    def routable_E(self) -> np.ndarray:
        """bool [E]: the router slots a token may be routed to (`check_routable` checks these)."""
        return np.asarray(self.kept_E, bool)

    def experts(self) -> list[int]:
        return np.flatnonzero(self.kept_E).tolist()

    def expert_map(self):
        import jax.numpy as jnp

        from moejax.moe.expert_map import ExpertMap

        return ExpertMap(jnp.asarray(self.kept_E, bool))


@dataclasses.dataclass(frozen=True)
class Merged:
    merge: object           # moejax.merging.layer.LayerMerge
    form: str               # the router form: tied | shrunk (a spec's `router`)

    def __post_init__(self):
        if self.form not in ROUTER_FORMS:
            raise ConfigError(f"merged layer plan: router form {self.form!r}; expected one of {list(ROUTER_FORMS)}")

    @property
    def routable_E(self) -> np.ndarray:
        return self.merge.kept_E(self.form)

    def experts(self) -> list[int]:
        """The leaders (one expert per cluster), ascending."""
        return sorted(int(e) for e in self.merge.leaders)

    def expert_map(self):
        if self.merge.weights is None:
            raise ConfigError(f"a {self.merge.method} merge recorded without its merged weights has no expert map "
                              "(evaluate_pruning(..., merged_weights=True) keeps them)")
        return self.merge.expert_map(self.form)


@dataclasses.dataclass(frozen=True)
class Substituted:
    kept_E: np.ndarray          # bool [E]: slots that keep their expert
    constants_EH: np.ndarray    # [E, H]: each slot's constant output (rows of kept slots unused)

    @property
    def routable_E(self) -> np.ndarray:
        return np.ones(len(self.kept_E), bool)

    def experts(self) -> list[int]:
        return np.flatnonzero(self.kept_E).tolist()

    def expert_map(self):
        import jax.numpy as jnp

        from moejax.moe.expert_map import ExpertMap

        kept = np.asarray(self.kept_E, bool)
        return ExpertMap(jnp.ones(kept.shape, bool), novice_E=jnp.asarray(~kept),
                         constants_EH=jnp.asarray(self.constants_EH))


LayerPlan = Kept | Merged | Substituted


@dataclasses.dataclass
class VariantPlan:
    spec: VariantSpec
    layers: dict = dataclasses.field(default_factory=dict)    # MoE layer -> LayerPlan

    def expert_maps(self) -> dict | None:
        """{MoE layer: ExpertMap}, None for the unpruned model: the one conversion of a plan."""
        if self.spec.form == "none":
            return None
        return {layer: plan.expert_map() for layer, plan in self.layers.items()}

    def kept(self) -> dict[int, list[int]]:
        """{MoE layer: the experts that remain as experts (pruning, substitution: kept; merging: leaders)}."""
        return {layer: plan.experts() for layer, plan in self.layers.items()}


TABLE_PAD = 16   # merged rows of a stacked expert table come in multiples of this


def stacked_expert_map(plans: list, own: dict, n_experts: int):
    """Several variants of one MoE layer as one ExpertMap stacked over them (mask, rows and
    novices [A, E]; one expert table, one set of constants): plans[a] is variant a's LayerPlan, or
    None for the unpruned layer (every slot, its own experts). A pruned variant keeps its slots
    and the layer's own experts; a merged one its router form's slots, computing with its merge's
    experts; a substituted one every slot, its removed slots returning their constants. The
    table is the layer's own experts, then each merge's merged experts of clusters of two or more
    (a singleton's merged expert is its expert exactly, so its slot keeps its own row). Without
    merges the rows are the identity and are left out (None); without substitutions, the novices."""
    import jax.numpy as jnp

    from moejax.moe.expert_map import ExpertMap

    E = n_experts
    mask_AE = jnp.stack([jnp.ones((E,), bool) if p is None else jnp.asarray(p.routable_E) for p in plans])
    substituted = [p for p in plans if isinstance(p, Substituted)]
    novices = {}
    if substituted:  # every substituted variant of a layer returns the same constants (its experts' means)
        novices = dict(novice_E=jnp.asarray(np.stack([~np.asarray(p.kept_E, bool) if isinstance(p, Substituted)
                                                      else np.zeros(E, bool) for p in plans])),
                       constants_EH=jnp.asarray(substituted[0].constants_EH, jnp.float32))
    merges = {id(p.merge): p.merge for p in plans if isinstance(p, Merged)}   # tied and shrunk share one
    if not merges:
        return ExpertMap(mask_AE, **novices)
    rows_of, extra, n_rows = {}, [], E
    for key, lm in merges.items():
        rows = np.arange(E, dtype=np.int32)
        for c in range(lm.n_clusters):
            members = lm.labels_E == c
            if members.sum() > 1:
                extra.append({k: np.asarray(v[c]) for k, v in lm.weights.items()})
                rows[members] = n_rows
                n_rows += 1
        rows_of[key] = rows
    # padded with zero experts no slot points at to a multiple of TABLE_PAD rows, so layers whose
    # merges leave different numbers of clusters of two or more share a few compiled shapes; the
    # merged rows in the dtype the layer holds its experts in (the table is one array)
    pad = -len(extra) % TABLE_PAD
    table = {k: jnp.concatenate([own[k], jnp.asarray(np.stack([e[k] for e in extra]).astype(own[k].dtype, copy=False)),
                                 jnp.zeros((pad,) + own[k].shape[1:], own[k].dtype)]) if extra else own[k]
             for k in own}
    identity = jnp.arange(E, dtype=jnp.int32)
    rows_AE = jnp.stack([jnp.asarray(rows_of[id(p.merge)]) if isinstance(p, Merged) else identity for p in plans])
    return ExpertMap(mask_AE, rows_AE, table, **novices)

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
    stacked_expert_map(plans, own, E)         variants of one layer computing with one expert table
                                              (the layer's own, or one merge's) as one ExpertMap
                                              stacked over them (the carried pass's held-out streams)

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


# a merge's merged rows come in multiples of this many: few compiled shapes across layers, little
# padding held (each Moonlight row is 17 MB; 16 held 0.2 GB of zero rows at keep 32)
TABLE_PAD = 4


def stacked_expert_map(plans: list, own: dict, n_experts: int, averaged=None):
    """Several variants of one MoE layer as one ExpertMap stacked over them (mask, rows and novices
    [A, E]; one table, one set of constants). Either variants of the layer's own experts (plans[a]
    None for the unpruned layer: every slot; Kept: its slots; Substituted: every slot, its removed
    slots returning their constants), whose table is `own` (rows the identity, left out: None), or
    the router forms of *one* merge (Merged plans sharing one LayerMerge), whose table comes in two
    parts (`moejax.moe.grouped`): the layer's own experts, then the merge's merged experts of its
    clusters of two or more in cluster order. A slot in such a cluster computes with its merged row;
    a singleton's slot with its own expert, which is its merged expert exactly. Neither part is
    copied into the other. averaged: those rows as an `AveragedRows` over the layer's experts
    (`moejax.merging.average.averaged_rows` of `LayerMerge.shared_clusters`, padded past them),
    made only when read, so a merge holds no expert of its own; None: taken from the merge's
    weights, padded with zero rows no slot points at to a multiple of TABLE_PAD rows, so layers
    whose merges leave different numbers of shared clusters share a few compiled shapes."""
    import jax.numpy as jnp

    from moejax.moe.expert_map import ExpertMap

    E = n_experts
    mask_AE = jnp.stack([jnp.ones((E,), bool) if p is None else jnp.asarray(p.routable_E) for p in plans])
    merges = {id(p.merge): p.merge for p in plans if isinstance(p, Merged)}
    if merges:
        if len(merges) > 1 or not all(isinstance(p, Merged) for p in plans):
            raise ValueError("stacked_expert_map: a merge's variants compute with its own table; stack them "
                             "apart from the layer's own experts and from other merges")
        (lm,) = merges.values()
        shared = lm.shared_clusters()
        if averaged is None:
            if lm.weights is None:
                raise ConfigError(f"a {lm.method} merge recorded without its merged weights has no expert table")
            padded = padded_shared(lm)
            extra = {k: jnp.asarray(np.stack([w[c] if c is not None else np.zeros_like(w[0]) for c in padded])
                                    if padded else w[:0]) for k, w in lm.weights.items()}
        else:
            extra = averaged
        rows = np.arange(E, dtype=np.int32)
        for i, c in enumerate(shared):
            rows[lm.labels_E == c] = E + i
        return ExpertMap(mask_AE, jnp.broadcast_to(jnp.asarray(rows), mask_AE.shape), (own, extra))
    substituted = [p for p in plans if isinstance(p, Substituted)]
    if not substituted:
        return ExpertMap(mask_AE)
    # every substituted variant of a layer returns the same constants (its experts' means)
    return ExpertMap(mask_AE, novice_E=jnp.asarray(np.stack([~np.asarray(p.kept_E, bool) if isinstance(p, Substituted)
                                                             else np.zeros(E, bool) for p in plans])),
                     constants_EH=jnp.asarray(substituted[0].constants_EH, jnp.float32))


def padded_shared(merge) -> list:
    """A merge's clusters of two or more, ascending, then None (a zero row) up to a multiple of
    TABLE_PAD: the merged rows of its table in `stacked_expert_map`."""
    shared = merge.shared_clusters()
    return shared + [None] * (-len(shared) % TABLE_PAD)

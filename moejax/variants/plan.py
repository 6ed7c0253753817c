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

A merged plan can be recorded without its merged weights (`merge.weights` None: the clusters only,
what `prune_real` writes); it then has no expert maps.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from moejax.errors import ConfigError
from moejax.variants.spec import MERGE_FORMS, VariantSpec


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
    form: str               # tied | shrunk

    def __post_init__(self):
        if self.form not in MERGE_FORMS:
            raise ConfigError(f"merged layer plan: form {self.form!r}; expected one of {list(MERGE_FORMS)}")

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

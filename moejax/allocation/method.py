"""What an allocation is: one frozen settings object, registered by name, that decides how many
experts (or clusters) each MoE layer keeps under one total (issue 45). Each is defined beside its
rule (`threshold.Uniform`, `threshold.Global`, `shape.Shape`, `evo_esap.EvoEsap`) with
`@register(name)`; adding one is its module, its line in `ALLOCATIONS` and its tests.

    ALLOCATIONS    the registry (`moejax.registry.Registry`): `parse(name, **settings)` is the only
                   check of an allocation's name; `ALLOCATIONS.names()` the CLI's choices
    Allocation     the base: counts(budget, statistic, fitness) -> {layer: count}
                   reads: the per-expert statistic it allocates by: None (nothing: uniform),
                   RANKING (the variant's own ranking score; a merge's routing counts) or a score's
                   name ("shapley": `moejax.scoring.scores`), known before the first layer is cut
                   searches: it evaluates candidate allocations by a fitness (EvoESAP's ESAP),
                   which the caller builds from the model and tokens held apart from the scoring ones
    Budget         the request: each layer's count under a uniform allocation (their sum is the
                   total every allocation keeps), each layer's expert count, the per-layer minimum

A count is a number of router slots kept (pruning) or clusters (merging); the caller keeps each
layer's `count` best experts by its ranking (`moejax.scoring.select.select_kept`) or merges the layer
into `count` clusters. JAX-free.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Callable, ClassVar

import numpy as np

from moejax.errors import ConfigError
from moejax.registry import Registered, Registry

RANKING = "ranking"   # `Allocation.reads`: the variant's own ranking score


def is_count(v) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, np.integer))


@dataclasses.dataclass(frozen=True)
class Budget:
    """keep {layer: count} (a uniform allocation: the total is their sum), n_experts {layer: E_l},
    minimum: the fewest a layer may keep (top_k: every token routes to top_k experts)."""
    keep: dict
    n_experts: dict
    minimum: int

    def __post_init__(self):
        if not self.keep:
            raise ConfigError("allocation: no MoE layers to allocate a budget over")
        if set(self.keep) != set(self.n_experts):
            raise ConfigError(f"allocation: keep is given for layers {sorted(self.keep)}, the layers are "
                              f"{sorted(self.n_experts)}")
        for layer, k in self.keep.items():
            if not is_count(k):
                raise ConfigError(f"allocation: layer {layer}'s keep={k!r} must be a count (int)")
            if not self.minimum <= k <= self.n_experts[layer]:
                raise ConfigError(f"allocation: keep={k} per layer must lie in [top_k, E] = [{self.minimum}, "
                                  f"{self.n_experts[layer]}] (layer {layer}: every token routes to top_k="
                                  f"{self.minimum} experts)")

    @classmethod
    def of(cls, keep, n_experts: dict, minimum: int) -> "Budget":
        """keep: one count for every layer, or {layer: count}."""
        if not isinstance(keep, dict):
            if not is_count(keep):
                raise ConfigError(f"allocation: keep={keep!r} must be a per-layer count (int)")
            keep = dict.fromkeys(n_experts, keep)
        return cls({int(l): int(k) for l, k in sorted(keep.items())}, {int(l): int(e) for l, e in
                                                                      sorted(n_experts.items())}, int(minimum))

    @property
    def layers(self) -> list:
        return list(self.keep)

    @property
    def total(self) -> int:
        return sum(self.keep.values())

    def check(self, counts: dict, who: str) -> dict:
        """counts, refused unless they keep the total, each layer within [minimum, E_l]."""
        counts = {l: int(counts[l]) for l in self.layers}
        wrong = {l: c for l, c in counts.items() if not self.minimum <= c <= self.n_experts[l]}
        if wrong or sum(counts.values()) != self.total:
            raise AssertionError(f"{who}: counts {counts} break the budget (total {self.total}, each in "
                                 f"[{self.minimum}, E])")
        return counts


class Allocation(Registered, abc.ABC):
    """An allocation's settings (its dataclass fields) and rule. Subclasses are registered with
    `@register(name)`, which makes them frozen dataclasses."""

    reads: ClassVar[str | None] = None
    searches: ClassVar[bool] = False

    @abc.abstractmethod
    def counts(self, budget: Budget, statistic: dict | None = None,
               fitness: Callable | None = None) -> dict[int, int]:
        """{layer: count}, summing to budget.total, each in [budget.minimum, E_l]. statistic:
        {layer: [E]} of what it `reads`; fitness: candidates [P, L] (counts, the budget's layers in
        order) -> [P] to maximise (`searches`)."""

    def check_budget(self, budget: Budget) -> None:
        """Its settings against a budget, refused before any calibration (ConfigError)."""


def allocation_record(allocation) -> dict:
    """What a checkpoint's record keeps of its allocation: `allocation` (its name, as records before
    the registry held it) and `allocation_settings`."""
    allocation = parse(allocation)
    return {"allocation": allocation.name, "allocation_settings": allocation.settings()}


def statistic_of(allocation: Allocation, ranking: str) -> str | None:
    """The score an allocation allocates by for a variant ranked by `ranking` (None: nothing)."""
    return ranking if allocation.reads == RANKING else allocation.reads


def check_statistic(statistic: dict | None, budget: Budget, who: str) -> dict:
    """{layer: float64 [E_l]}: each budget layer's statistic, finite, refused naming the layer."""
    if statistic is None:
        raise ConfigError(f"allocation {who}: it needs a per-expert statistic of every layer, none was given")
    out = {}
    for layer in budget.layers:
        if layer not in statistic:
            raise ConfigError(f"allocation {who}: no statistic for layer {layer}")
        s = np.asarray(statistic[layer], np.float64)
        if s.shape != (budget.n_experts[layer],):
            raise ConfigError(f"allocation {who}: layer {layer}'s statistic must be a vector [E] = "
                              f"[{budget.n_experts[layer]}], got shape {s.shape}")
        if not np.isfinite(s).all():
            raise ConfigError(f"allocation {who}: layer {layer}'s statistic holds NaN or infinity at experts "
                              f"{np.flatnonzero(~np.isfinite(s)).tolist()[:16]}")
        out[layer] = s
    return out


ALLOCATIONS = Registry("allocation", Allocation, modules=(
    "moejax.allocation.threshold", "moejax.allocation.shape", "moejax.allocation.evo_esap"))
register = ALLOCATIONS.register
parse = ALLOCATIONS.parse


def allocate(allocation, budget: Budget, statistic: dict | None = None, fitness: Callable | None = None) -> dict:
    """{layer: count} of `allocation` (a name or object) under `budget`, checked to keep the total
    with every layer in [minimum, E_l]; statistic: {layer: [E]} of what it reads; fitness: what a
    searching allocation maximises (candidates [P, L] of kept counts, the budget's layers in order,
    -> [P])."""
    allocation = parse(allocation)
    allocation.check_budget(budget)
    return budget.check(allocation.counts(budget, statistic, fitness), allocation.name)


def layer_counts(statistic: dict | None, keep, top_k: int, allocation, n_experts: dict | None = None) -> dict[int, int]:
    """{layer: count} under `allocation` (a name or an `Allocation`) for an allocation that needs no
    search: statistic {layer: [E]} (its `reads`; may be None for uniform), keep one count or {layer:
    count}, n_experts {layer: E_l} (default: each statistic's length)."""
    allocation = parse(allocation)
    if allocation.searches:
        raise ConfigError(f"allocation {allocation.name} searches with a fitness of the model: its counts "
                          "come from a calibration pass (`moejax prune --text`, `merge`, the experiments)")
    if n_experts is None:
        if statistic is None:
            raise ConfigError("allocation: the layers' expert counts are needed when no statistic is given")
        n_experts = {l: len(np.asarray(s)) for l, s in statistic.items()}
    return allocate(allocation, Budget.of(keep, n_experts, top_k), statistic)

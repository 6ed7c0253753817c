"""What a merge method is: one frozen settings object, registered by name, that checks its settings
and carries its algorithm: how it clusters one MoE layer's experts, which member leads each
cluster, and how a cluster's members become one expert. Each method is defined beside its math
(`clusters.HcSmoe`, `clusters.MSmoe`, `ream.Ream`) with `@register(name)`, and `MERGE_METHODS`
lists the modules that define them; adding a method is its module, that line and its tests.

    MERGE_METHODS    the registry (`moejax.registry.Registry`): `parse(name, **settings)` is the
                     only check of a method's name; `MERGE_METHODS.names()` the CLI's choices
    MergeMethod      the base: clusters(keep, ctx) -> labels [E]; leaders(labels, ctx) -> [C];
                     averaging(weights, labels, leaders, ctx) -> Averaging; check(keep, n_experts):
                     the settings against a layer (its own range checks run when it is made);
                     scores: the scores it reads per expert (the experiments and `moejax merge`
                     compute them); stats_options(): what `merge_stats` must gather for it beyond
                     the baselines' statistics; seed_use: what its seed draws (said where a seed is
                     refused)
    MergeContext     what a layer's merge may read: its calibration statistics (None when only
                     recorded clusters are merged again), the routing counts, a score per expert
                     (its `scores`' first), the seed, the sampled router inputs, M-SMoE's alignments
                     already computed for this layer
    Averaging        how a cluster's members become one expert, for every method: a weighted
                     average of the members, each one's neurons permuted first (or not)

A method's merged experts are its `Averaging` applied to the layer's experts
(`moejax.merging.average.merge_weights` on the host; `moejax.merging.average.averaged_rows` for a
table whose rows are made when read). JAX-free (the experiments' settings are checked before JAX
is imported).
"""

from __future__ import annotations

import abc
import dataclasses
from typing import ClassVar

import numpy as np

from moejax.registry import Registered, Registry


@dataclasses.dataclass(frozen=True)
class MergeContext:
    stats: object | None                 # moejax.merging.calibration.MergeStats, or None
    counts_E: np.ndarray                 # routing decisions per expert on the calibration tokens
    scores_E: np.ndarray | None = None   # the method's score per expert (REAM's centroids and weights)
    seed: int = 0
    act_inputs_NH: np.ndarray | None = None   # REAM: sampled router inputs for its alignment
    alignments: dict | None = None       # M-SMoE: {(leader, member): perm} of this layer's weights, shared
                                         # by its merges at several keeps (`average.align_layer`)
    expert_fn: object = None             # the model's expert (`cfg.expert_fn()`): REAM's hidden activations of
                                         # gpt-oss's clamped experts read its alpha and limit (None: SwiGLU's)

    @classmethod
    def of(cls, stats, scores_E=None, seed: int = 0, alignments: dict | None = None,
           expert_fn=None) -> "MergeContext":
        """The context of a layer's `MergeStats` (its counts and sampled router inputs)."""
        return cls(stats, stats.counts_E, scores_E, seed, stats.act_inputs_NH, alignments, expert_fn)


@dataclasses.dataclass(frozen=True)
class Averaging:
    """W_c = sum_{j in c} weights_E[j] P_j(W_j) / sum_{j in c} weights_E[j] for each cluster c
    (uniform where a cluster's weights sum to 0), P_j the permutation perms[j] of expert j's
    intermediate neurons (the identity for an expert not in perms)."""
    weights_E: np.ndarray   # float64 [E], >= 0: frequencies (HC-SMoE, M-SMoE) or saliencies (REAM)
    perms: dict             # {expert: int [F]}


class MergeMethod(Registered, abc.ABC):
    """A merge method's settings (its dataclass fields) and algorithm. Subclasses are registered
    with `@register(name)`, which makes them frozen dataclasses and refuses one that leaves
    `clusters`, `leaders` or `averaging` unwritten."""

    seed_use: ClassVar[str] = "it draws nothing at random; the seed is recorded"
    reads: ClassVar[tuple] = ()   # the `MergeStats` fields it reads (beyond counts_E): what a pass must gather

    @property
    def sampled_tokens(self) -> int:
        """Calibration tokens whose router inputs it reads (`MergeStats.act_inputs_NH`); 0: none."""
        return 0

    @property
    def scores(self) -> tuple:
        """The scores (`moejax.scoring.scores`) it reads per expert, as `MergeContext.scores_E`."""
        return ()

    def stats_options(self) -> dict:
        """What `moejax.merging.calibration.merge_stats` must gather for it (keyword arguments)."""
        return {}

    def check(self, keep: int | None, n_experts: int) -> None:
        """Its settings against a layer of `n_experts` merged to `keep` clusters (None: the count is
        known only per layer, later), refused before any work (ConfigError)."""

    @abc.abstractmethod
    def clusters(self, keep: int, ctx: MergeContext) -> np.ndarray:
        """labels [E]: each expert's cluster, numbered by lowest member."""

    @abc.abstractmethod
    def leaders(self, labels_E, ctx: MergeContext) -> np.ndarray:
        """int [C]: each cluster's leader."""

    @abc.abstractmethod
    def averaging(self, weights: dict, labels_E, leaders, ctx: MergeContext) -> Averaging:
        """How each cluster of `labels_E` becomes one expert (host weights {name: [E, ...]})."""


MERGE_METHODS = Registry("merge method", MergeMethod, modules=("moejax.merging.clusters", "moejax.merging.ream"))
register = MERGE_METHODS.register
parse = MERGE_METHODS.parse

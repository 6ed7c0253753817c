"""What a merge method is: how it clusters one MoE layer's experts, which member leads each cluster,
and how a cluster's members become one expert. Each method is one `MergeMethod`, defined beside its
math (`clusters.HC_SMOE`, `clusters.M_SMOE`, `ream.REAM`) and named once in the registry
(`moejax.merging.layer.MERGE_METHODS`); adding a method is its module, its registry line and its
tests.

    MergeContext     what a layer's merge may read: its calibration statistics (None when only
                     recorded clusters are merged again), the routing counts, and the settings
                     (a score per expert, REAM's group size, HC-SMoE's linkage, the seed, the
                     sampled router inputs, M-SMoE's alignments already computed for this layer)
    Averaging        how a cluster's members become one expert, for every method: a weighted
                     average of the members, each one's neurons permuted first (or not)
    MergeMethod      clusters(keep, ctx) -> labels [E]; leaders(labels, ctx) -> [C];
                     averaging(weights, labels, leaders, ctx) -> Averaging; stats: what
                     `merge_stats` must gather for it beyond the baselines' statistics; scored:
                     whether it reads a score per expert; check: its settings' check; seed_use: what
                     its seed draws (said where a seed is refused)

A method's merged experts are its `Averaging` applied to the layer's experts
(`moejax.merging.average.merge_weights` on the host; `moejax.merging.average.averaged_rows` for a
table whose rows are made when read).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np


@dataclasses.dataclass(frozen=True)
class MergeContext:
    stats: object | None                 # moejax.merging.calibration.MergeStats, or None
    counts_E: np.ndarray                 # routing decisions per expert on the calibration tokens
    scores_E: np.ndarray | None = None   # a score per expert (REAM's centroids and weights)
    group_size: int = 16                 # REAM's C
    hc_method: str = "average"           # HC-SMoE's clustering
    seed: int = 0
    act_inputs_NH: np.ndarray | None = None   # REAM: sampled router inputs for its alignment
    alignments: dict | None = None       # M-SMoE: {(leader, member): perm} of this layer's weights, shared
                                         # by its merges at several keeps (`average.align_layer`)


@dataclasses.dataclass(frozen=True)
class Averaging:
    """W_c = sum_{j in c} weights_E[j] P_j(W_j) / sum_{j in c} weights_E[j] for each cluster c
    (uniform where a cluster's weights sum to 0), P_j the permutation perms[j] of expert j's
    intermediate neurons (the identity for an expert not in perms)."""
    weights_E: np.ndarray   # float64 [E], >= 0: frequencies (HC-SMoE, M-SMoE) or saliencies (REAM)
    perms: dict             # {expert: int [F]}


@dataclasses.dataclass(frozen=True)
class MergeMethod:
    name: str
    clusters: Callable      # (keep, MergeContext) -> labels_E
    leaders: Callable       # (labels_E, MergeContext) -> leaders_C
    averaging: Callable     # (host weights {name: [E, ...]}, labels_E, leaders_C, MergeContext) -> Averaging
    stats: dict = dataclasses.field(default_factory=dict)   # merge_stats options it needs
    scored: bool = False    # reads a score per expert (MergeContext.scores_E): the experiments compute it
    check: Callable | None = None   # (keep or None, n_experts, score, group_size) -> None: its settings,
                                    # refused before any work (ConfigError)
    seed_use: str = "it draws nothing at random; the seed is recorded"   # what MergeContext.seed draws

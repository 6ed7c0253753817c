"""toy3's variants: the axes its evaluated arrays share, and the merges as expert maps.

  conditions  the (seed, offset, load) of a batch, in the order every [Z, O, W, ...] array has them
  Layout      the variant axis: pruning variants, the merges' shrunk and tied forms, the Eq. 6 pairs
  MergeMap    one merge of the layer: the router slots that remain and the table row each computes with
              (`merge_map` for a method's clusters, `pair_map` for one Eq. 6 pair)

Numpy only; the clusters and merged weights come from moejax.merging.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import numpy as np

from moejax.experiments.toy3.config import Toy3Config


def conditions(cfg: Toy3Config, seeds):
    """An iterator over a batch's conditions, ((s, seed), (o, offset), (l, load)), seed-major: the
    order of the leading [Z, O, W] axes of every array of the batch."""
    return itertools.product(enumerate(seeds), enumerate(cfg.offsets), enumerate(cfg.loads))


class Layout(NamedTuple):
    """The variant axis of stage two, the same for every (seed, offset, load): the pruning variants
    (score, keep), then per merge (method, keep) its shrunk form, then its tied form, then the Eq. 6
    pairs. The pruning and shrunk variants are routed under their own masks (`n_masked` of them);
    the tied forms and the pairs keep every slot, so they are routed as the unpruned layer is.

    Merged experts get rows of the table after the layer's E own experts, per load: merge m's
    clusters of two or more members at rows first_slot[m] .., the Eq. 6 pairs from first_slot[-1];
    n_slots rows per load in all."""

    pruned: list      # (score, keep)
    merged: list      # (MergeMethod, keep)
    first_slot: list
    n_slots: int
    substituted: list = []   # (score, keep): MoNE's variants, evaluated apart (`stage_two.stage_substitutes`)

    @property
    def n_masked(self) -> int:
        return len(self.pruned) + len(self.merged)

    @property
    def n_mapped(self) -> int:
        """The merges' variants, each an expert map: the shrunk forms, the tied forms, the Eq. 6 pairs."""
        return 2 * len(self.merged) + self.n_slots - self.first_slot[-1]

    def labels(self, pairs) -> list:
        """(score, keep) of every variant; pairs: the (i, j) of the Eq. 6 variants."""
        return (self.pruned + [(f"{m.name}:shrunk", k) for m, k in self.merged]
                + [(f"{m.name}:tied", k) for m, k in self.merged] + [(f"pair:{i}+{j}", None) for i, j in pairs])


def layout(cfg: Toy3Config) -> Layout:
    keeps = cfg.keep_counts()
    merged = [(method, keep) for method in cfg.merges for keep in keeps]
    first_slot = np.cumsum([0] + [merge_slots(keep, cfg.n_experts) for _, keep in merged]).tolist()
    return Layout([(name, keep) for name in cfg.scores for keep in keeps], merged, first_slot,
                  first_slot[-1] + cfg.eq6_pairs, [(name, keep) for name in cfg.substitutes for keep in keeps])


def merge_slots(keep: int, n_experts: int) -> int:
    """How many clusters of two or more members a partition of E experts into `keep` clusters can
    have: min(keep, E - keep) (with s singletons, keep - s clusters share the other E - s experts, two
    or more each: keep - s <= (E - s) / 2, so keep - s <= E - keep). Singletons compute with their own
    expert, so only these need a merged row."""
    return min(keep, n_experts - keep)


class MergeMap(NamedTuple):
    """One merge of the layer as expert maps: the shrunk form keeps the router slots `leaders` (each
    cluster's most frequent member, ties to the lower index), the tied form every slot; under both,
    slot e computes with table row rows_E[e]: its own expert (row e) if its cluster is a singleton,
    else its cluster's merged expert, `experts[i]` at row first_row + i for the i-th cluster of two
    or more members."""

    leaders: np.ndarray
    rows_E: np.ndarray
    experts: list


def merge_map(method, labels_E, ctx, w1_EDF, w2_EFD, first_row: int) -> MergeMap:
    """The merge of clusters `labels_E` by `method` (a `MergeMethod`; `moejax.merging.layer.merge_clusters`
    under the context `ctx`): each cluster G becomes W_G = sum_{j in G} freq_j W_j / sum_{j in G} freq_j,
    w1 and w2 separately, freq the routing counts; m_smoe first aligns each member's neurons to its
    cluster's leader, the dominant expert (ctx.alignments: its memo of the layer's alignments); ream
    aligns each member to its centroid and weights by the scores."""
    from moejax.merging.layer import merge_clusters

    merge = merge_clusters(method, labels_E, ctx, {"w1": w1_EDF, "w2": w2_EFD})
    rows, experts = np.arange(len(merge.labels_E), dtype=np.int32), []
    for c in range(merge.n_clusters):
        members = np.flatnonzero(merge.labels_E == c)
        if len(members) > 1:
            experts.append({k: w[c] for k, w in merge.weights.items()})
            rows[members] = first_row + len(experts) - 1
    return MergeMap(merge.leaders, rows, experts)


def pair_map(pair, counts_E, w1_EDF, w2_EFD, row: int) -> MergeMap:
    """One pair (i < j) merged as HC-SMoE merges a cluster, W = (freq_i W_i + freq_j W_j) / (freq_i + freq_j)
    (`merge_cluster`), every other expert alone: both slots compute with the merged expert at `row`."""
    from moejax.merging.average import merge_cluster

    i, j = pair
    rows = np.arange(len(counts_E), dtype=np.int32)
    rows[[i, j]] = row
    merged = merge_cluster([{"w1": w1_EDF[e], "w2": w2_EFD[e]} for e in (i, j)], np.asarray(counts_E)[[i, j]])
    leaders = np.delete(np.arange(len(counts_E)), j)  # clusters by lowest member: the pair's is the i-th
    leaders[i] = i if counts_E[i] >= counts_E[j] else j
    return MergeMap(leaders, rows, [merged])

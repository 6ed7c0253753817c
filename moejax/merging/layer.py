"""One MoE layer merged (SPEC section 8): clusters, each cluster's leader, its merged expert, and
the layer's expert map under either router form. Every method is a `MergeMethod` defined beside its
math and named once in `MERGE_METHODS`, the registry the functions below dispatch through:

    hc_smoe   clusters = average-linkage clustering of c_j = mean_{x in X} f_j(x)
              (`clusters.hc_smoe_clusters`); members averaged as they are
    m_smoe    clusters = the `keep` most frequent experts dominate, every other expert joins the
              dominant one with the most similar router-logit column (`clusters.m_smoe_groups_from_gram`);
              members' neurons aligned to the dominant expert before averaging
    ream      groups = the `keep` highest-scoring experts (`scores_E`, REAP by default) are centroids;
              pseudo-pruning: each centroid, most salient first, takes its C - 1 most similar
              unassigned experts (C = group_size; 0: each joins its most similar centroid), similarity
              = the mean of REAM's output and router-logit similarities (`ream.ream_similarity`);
              members' neurons aligned to the centroid on activations plus PCA weight rows
              (`ream.ream_align`); averaged with weights = the scores (zeros raised, `ream.saliency_weights`)
    merged    W_G = sum_{j in G} freq_j W_j / sum_{j in G} freq_j, for every matrix separately
              (ream: the score weights in place of freq_j)
    leader    a cluster's most frequent member (ties: the lower index); for m_smoe, its dominant expert;
              for ream, its centroid

Router forms (`ExpertMap`):
    tied      every router slot remains; slot e computes its cluster's merged expert (the papers' form)
    shrunk    only each cluster's leader's slot remains (one router row and bias per cluster: what a
              merged checkpoint holds, `moejax merge`); it computes the merged expert
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import jax.numpy as jnp
import numpy as np

from moejax.errors import ConfigError
from moejax.merging.clusters import HC_SMOE, M_SMOE, canonical_labels, cluster_leaders  # noqa: F401 (cluster_leaders: the leader rule)
from moejax.merging.average import layer_dtype, merge_weights
from moejax.merging.method import Averaging, MergeContext
from moejax.merging.ream import GROUP_SIZE, REAM
from moejax.moe.expert_map import ExpertMap
from moejax.variants.spec import ROUTER_FORMS

if TYPE_CHECKING:   # the statistics' type only: computing them (JAX, flax) is the calibration pass's
    from moejax.merging.calibration import MergeStats

# The registry: every merge method, each a `moejax.merging.method.MergeMethod` defined beside its math.
MERGE_METHODS = {m.name: m for m in (HC_SMOE, M_SMOE, REAM)}


def check_merge_names(methods, where: str = "merges") -> None:
    unknown = [m for m in methods if m not in MERGE_METHODS]
    if unknown:
        raise ConfigError(f"{where}: unknown merge method(s) {unknown}; valid: {list(MERGE_METHODS)}")


def check_router_form(router: str) -> None:
    if router not in ROUTER_FORMS:
        raise ConfigError(f"router={router!r}: expected one of {list(ROUTER_FORMS)} (tied: every router slot "
                          "kept, pointing at its cluster's merged expert; shrunk: one router row per cluster)")


@dataclasses.dataclass(frozen=True)
class LayerMerge:
    method: str
    labels_E: np.ndarray     # int [E]: each expert's cluster, clusters numbered by their lowest member
    leaders: np.ndarray    # int [C]: each cluster's leader (its most frequent member; ream: its centroid)
    weights: dict            # name -> [C, ...]: the merged experts, in the layer's dtype

    @property
    def n_clusters(self) -> int:
        return len(self.leaders)

    def kept_E(self, router: str) -> np.ndarray:
        """bool [E]: the router slots that remain under `router`."""
        check_router_form(router)
        if router == "tied":
            return np.ones(len(self.labels_E), bool)
        kept = np.zeros(len(self.labels_E), bool)
        kept[self.leaders] = True
        return kept

    def expert_map(self, router: str) -> ExpertMap:
        """The layer's ExpertMap: slot e computes with row labels_E[e] of `self.weights`."""
        return ExpertMap(jnp.asarray(self.kept_E(router)), jnp.asarray(self.labels_E, jnp.int32),
                         {k: jnp.asarray(v) for k, v in self.weights.items()})

    def shared_clusters(self) -> list[int]:
        """The clusters of two or more experts, ascending (a singleton's merged expert is its expert)."""
        return np.flatnonzero(np.bincount(self.labels_E, minlength=self.n_clusters) > 1).tolist()

    def clusters(self) -> list[list[int]]:
        """Each cluster's experts, the leader first, clusters by label."""
        return leader_first_clusters(self.labels_E, self.leaders)


def leader_first_clusters(labels_E, leaders) -> list[list[int]]:
    """[[leader, other members ascending], ...] for clusters 0..C-1."""
    labels = np.asarray(labels_E)
    return [[int(lead)] + [int(e) for e in np.flatnonzero(labels == c) if e != lead] for c, lead in enumerate(leaders)]


def labels_from_clusters(clusters, n_experts: int) -> np.ndarray:
    """int [E] from a list of clusters (each a list of experts), renumbered by lowest member."""
    labels = np.full(n_experts, -1, np.int64)
    for c, members in enumerate(clusters):
        labels[np.asarray(members, np.int64)] = c
    if (labels < 0).any() or sum(len(m) for m in clusters) != n_experts:
        raise ConfigError(f"clusters {clusters}: expected a partition of the {n_experts} experts")
    return canonical_labels(labels)


def merge_stats_options(methods) -> dict:
    """What `merge_stats` must gather for these merge methods beyond the baselines' statistics
    (each method's `stats`: REAM's only when it is asked for)."""
    check_merge_names(methods)
    options = {}
    for m in methods:
        options.update(MERGE_METHODS[m].stats)
    return options


def layer_clusters(method: str, keep: int, stats: MergeStats, hc_method: str = "average", seed: int = 0,
                   scores_E=None, group_size: int = GROUP_SIZE) -> np.ndarray:
    """labels [E] of one layer's experts under `method` (ream: scores_E required, group_size its C)."""
    check_merge_names([method])
    ctx = MergeContext(stats, stats.counts_E, scores_E, group_size, hc_method, seed)
    return MERGE_METHODS[method].clusters(keep, ctx)


def layer_leaders(method: str, labels_E, counts_E, scores_E=None) -> np.ndarray:
    """int [C]: each cluster's leader under `method`: its most frequent member (`cluster_leaders`),
    or for ream its centroid (`ream.centroid_leaders`)."""
    check_merge_names([method])
    return MERGE_METHODS[method].leaders(np.asarray(labels_E), MergeContext(None, counts_E, scores_E))


def merge_layer(method: str, keep: int, stats: MergeStats, expert_weights: dict, hc_method: str = "average",
                seed: int = 0, scores_E=None, group_size: int = GROUP_SIZE, alignments: dict | None = None) -> LayerMerge:
    """The layer merged to `keep` clusters by `method`; expert_weights: name -> [E, ...] arrays
    (host or device), the merged experts returned in their dtype. ream: scores_E (float64 [E],
    >= 0, higher = keep) required, stats from merge_stats(..., ream=True), group_size its C; seed
    also seeds its randomised PCA (large layers only). alignments: M-SMoE's memo of this layer's
    neuron alignments (`MergeContext.alignments`), one dict for every merge of the same weights."""
    labels = layer_clusters(method, keep, stats, hc_method, seed, scores_E, group_size)
    return merge_clusters(method, labels, stats.counts_E, expert_weights, scores_E=scores_E,
                          act_inputs_NH=stats.act_inputs_NH, seed=seed, alignments=alignments)


def merge_clusters(method: str, labels_E, counts_E, expert_weights: dict, scores_E=None, act_inputs_NH=None,
                   seed: int = 0, alignments: dict | None = None) -> LayerMerge:
    """The layer's clusters `labels_E` merged as `method` merges them (hc_smoe: each member weighted
    by its share of the cluster's counts; m_smoe: neurons aligned to each cluster's leader first;
    ream: each group's centroid leads it, members aligned on their activations over the sampled
    router inputs `act_inputs_NH` plus their weights, weighted by `scores_E`)."""
    check_merge_names([method])
    labels = np.asarray(labels_E)
    leaders = MERGE_METHODS[method].leaders(labels, MergeContext(None, counts_E, scores_E))
    return LayerMerge(method, labels, leaders, merged_rows(method, labels, leaders, counts_E, expert_weights,
                                                           scores_E=scores_E, act_inputs_NH=act_inputs_NH, seed=seed,
                                                           alignments=alignments))


def merge_averaging(method: str, labels_E, leaders, counts_E, expert_weights: dict, scores_E=None,
                    act_inputs_NH=None, seed: int = 0, alignments: dict | None = None) -> Averaging:
    """How `method` makes each cluster of `labels_E` one expert (`Averaging`: each member's weight,
    and the neuron permutations M-SMoE and REAM align the members by). leaders: each cluster's
    (`layer_leaders`). The averaging's work (alignment) is done here; applying it is cheap."""
    check_merge_names([method])
    ctx = MergeContext(None, counts_E, scores_E, seed=seed, act_inputs_NH=act_inputs_NH, alignments=alignments)
    host = {k: np.asarray(v) for k, v in expert_weights.items()}
    return MERGE_METHODS[method].averaging(host, np.asarray(labels_E), np.asarray(leaders), ctx)


def merged_rows(method: str, labels_E, leaders, counts_E, expert_weights: dict, scores_E=None, act_inputs_NH=None,
                seed: int = 0, alignments: dict | None = None) -> dict:
    """{name: [C, ...]}: the merged experts, row c of cluster c, in the layer's dtype (rounded a
    cluster at a time): `merge_averaging` applied by `merge_weights`."""
    host = {k: np.asarray(v) for k, v in expert_weights.items()}
    a = merge_averaging(method, labels_E, leaders, counts_E, host, scores_E, act_inputs_NH, seed, alignments)
    merged = merge_weights(host, labels_E, a.weights_E, perms=a.perms, out_dtype=layer_dtype(host))
    return {k: np.asarray(merged[k]).astype(host[k].dtype, copy=False) for k in host}

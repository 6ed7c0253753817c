"""One MoE layer merged (SPEC section 8): clusters, each cluster's leader, its merged expert, and
the layer's expert map under either router form.

    hc_smoe   clusters = average-linkage clustering of c_j = mean_{x in X} f_j(x)
              (`clusters.hc_smoe_clusters`); members averaged as they are
    m_smoe    clusters = the `keep` most frequent experts dominate, every other expert joins the
              dominant one with the most similar router-logit column (`clusters.m_smoe_groups_from_gram`);
              members' neurons aligned to the dominant expert before averaging
    merged    W_G = sum_{j in G} freq_j W_j / sum_{j in G} freq_j, for every matrix separately
    leader    a cluster's most frequent member (ties: the lower index); for m_smoe, its dominant expert

Router forms (`ExpertMap`):
    tied      every router slot remains; slot e computes its cluster's merged expert (the papers' form)
    shrunk    only each cluster's leader's slot remains (one router row and bias per cluster: what a
              merged checkpoint holds, `moejax merge`); it computes the merged expert
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from moejax.errors import ConfigError
from moejax.merging.average import merge_weights
from moejax.merging.calibration import MergeStats
from moejax.merging.clusters import hc_smoe_clusters, m_smoe_groups_from_gram
from moejax.moe.expert_map import ExpertMap

MERGE_METHODS = ("hc_smoe", "m_smoe")
ROUTER_FORMS = ("tied", "shrunk")


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
    leaders: np.ndarray    # int [C]: each cluster's leader (its most frequent member)
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

    def clusters(self) -> list[list[int]]:
        """Each cluster's experts, the leader first, clusters by label."""
        return leader_first_clusters(self.labels_E, self.leaders)


def leader_first_clusters(labels_E, leaders) -> list[list[int]]:
    """[[leader, other members ascending], ...] for clusters 0..C-1."""
    labels = np.asarray(labels_E)
    return [[int(lead)] + [int(e) for e in np.flatnonzero(labels == c) if e != lead] for c, lead in enumerate(leaders)]


def labels_from_clusters(clusters, n_experts: int) -> np.ndarray:
    """int [E] from a list of clusters (each a list of experts), renumbered by lowest member."""
    from moejax.merging.clusters import canonical_labels

    labels = np.full(n_experts, -1, np.int64)
    for c, members in enumerate(clusters):
        labels[np.asarray(members, np.int64)] = c
    if (labels < 0).any() or sum(len(m) for m in clusters) != n_experts:
        raise ConfigError(f"clusters {clusters}: expected a partition of the {n_experts} experts")
    return canonical_labels(labels)


def cluster_leaders(labels_E, counts_E) -> np.ndarray:
    """int [C]: each cluster's most frequent member (ties: the lower index)."""
    labels_E, counts = np.asarray(labels_E), np.asarray(counts_E, np.float64)
    leaders = []
    for c in range(int(labels_E.max()) + 1):
        members = np.flatnonzero(labels_E == c)
        leaders.append(int(members[np.argmax(counts[members])]))  # argmax: the first (lowest) on ties
    return np.asarray(leaders, np.int64)


def layer_clusters(method: str, keep: int, stats: MergeStats, hc_method: str = "average", seed: int = 0) -> np.ndarray:
    """labels [E] of one layer's experts under `method`."""
    check_merge_names([method])
    if method == "hc_smoe":
        return hc_smoe_clusters(stats.mean_output_EH, keep, method=hc_method, seed=seed)
    return m_smoe_groups_from_gram(stats.logit_gram_EE, stats.counts_E, keep)


def merge_layer(method: str, keep: int, stats: MergeStats, expert_weights: dict, hc_method: str = "average",
                seed: int = 0) -> LayerMerge:
    """The layer merged to `keep` clusters by `method`; expert_weights: name -> [E, ...] arrays
    (host or device), the merged experts returned in their dtype."""
    labels = layer_clusters(method, keep, stats, hc_method, seed)
    return merge_clusters(method, labels, stats.counts_E, expert_weights)


def merge_clusters(method: str, labels_E, counts_E, expert_weights: dict) -> LayerMerge:
    """The layer's clusters `labels_E` merged as `method` merges them (m_smoe: neurons aligned to
    each cluster's leader first), each member weighted by its share of the cluster's counts."""
    check_merge_names([method])
    labels = np.asarray(labels_E)
    leaders = cluster_leaders(labels, counts_E)
    host = {k: np.asarray(v) for k, v in expert_weights.items()}
    merged = merge_weights(host, labels, np.asarray(counts_E, np.float64), align=method == "m_smoe",
                           leaders=leaders)
    return LayerMerge(method, labels, leaders, {k: np.asarray(merged[k]).astype(host[k].dtype) for k in host})

"""Which experts merge: HC-SMoE's hierarchical clustering and M-SMoE's dominant-expert grouping, each
cluster's leader (its most frequent member), and the two methods as registered `MergeMethod`s
(`HcSmoe`, `MSmoe`: members averaged by frequency, M-SMoE's aligned to the leader first)."""

from __future__ import annotations

import numpy as np

from moejax.errors import ConfigError
from moejax.merging.average import align_layer
from moejax.merging.method import Averaging, MergeContext, MergeMethod, register
from moejax.scoring.select import select_kept

HC_SMOE_METHODS = ("average", "kmeans")


def canonical_labels(labels_E) -> np.ndarray:
    """Renumber clusters by their lowest member (0 for expert 0's cluster, ...): equal partitions,
    equal labels."""
    labels_E = np.asarray(labels_E)
    first = {}
    for e, c in enumerate(labels_E.tolist()):
        first.setdefault(c, len(first))
    return np.array([first[c] for c in labels_E.tolist()], np.int64)


def _check_keep(keep: int, n_experts: int) -> None:
    if not 1 <= keep <= n_experts:
        raise ConfigError(f"keep={keep}: expected a number of clusters in [1, {n_experts}]")


def hc_smoe_clusters(mean_output_ED, keep: int, method: str = "average", seed: int = 0) -> np.ndarray:
    """HC-SMoE's clusters of one layer's E experts into `keep` groups.

    mean_output_ED: each expert's mean output f_j(x) over *all* calibration tokens (not only those
    routed to it), float64. method "average": agglomerative clustering, Euclidean distance, average
    linkage (the paper's method): `scipy.cluster.hierarchy.linkage(method="average")` cut at `keep`
    clusters (`_cut`). scipy merges the closest pair of clusters first; its order among exactly
    equal distances is scipy's own (deterministic for a given input), not an index rule. method
    "kmeans": `scipy.cluster.vq.kmeans2` (k-means++ seeding from `seed`), what the public HC-SMoE
    scripts silently fall back to through a misspelled option; offered by name, never by default."""
    from scipy.cluster import hierarchy, vq

    x = np.asarray(mean_output_ED, np.float64)
    E = x.shape[0]
    _check_keep(keep, E)
    if not np.isfinite(x).all():
        raise ConfigError("hc_smoe: the experts' mean outputs hold NaN or infinity")
    if method == "average":
        if keep == E:
            return np.arange(E)
        return _cut(hierarchy.linkage(x, method="average", metric="euclidean"), keep)
    if method == "kmeans":
        _, labels = vq.kmeans2(x, keep, minit="++", seed=np.random.default_rng(seed))
        return canonical_labels(labels)
    raise ConfigError(f"hc_smoe: method={method!r}; expected one of {HC_SMOE_METHODS}")


def _cut(tree, keep: int) -> np.ndarray:
    """The clusters [E] after a linkage's first E - keep merges (what `scipy.cluster.hierarchy.cut_tree`
    returns for n_clusters=keep: 1.5-4.6 ms a call on 64 experts, in Python loops; this 0.03 ms), labels by
    lowest member. Cluster E + i is the one merge i of `tree` made."""
    n_leaves = len(tree) + 1
    members = {e: [e] for e in range(n_leaves)}
    for i, (a, b) in enumerate(np.asarray(tree[:n_leaves - keep, :2], np.int64).tolist()):
        members[n_leaves + i] = members.pop(a) + members.pop(b)
    labels = np.empty(n_leaves, np.int64)
    for c, group in enumerate(members.values()):
        labels[group] = c
    return canonical_labels(labels)


def m_smoe_groups(router_logits_TE, counts_E, keep: int) -> np.ndarray:
    """M-SMoE's groups of one layer's experts: the `keep` most frequently routed experts are
    dominant (ties to the lower index); every other expert joins the dominant expert whose
    router-logit column over the calibration tokens is most similar by cosine (ties to the lower
    index). router_logits_TE: float [T, E]; counts_E: routing decisions per expert."""
    logits = np.asarray(router_logits_TE, np.float64)
    return m_smoe_groups_from_gram(logits.T @ logits, counts_E, keep)


def m_smoe_groups_from_gram(logit_gram_EE, counts_E, keep: int) -> np.ndarray:
    """`m_smoe_groups` from the Gram matrix of the router-logit columns, G = L^T L summed over the
    calibration tokens (what a streamed pass accumulates): cos(l_i, l_j) = G_ij / sqrt(G_ii G_jj)."""
    gram = np.asarray(logit_gram_EE, np.float64)
    E = gram.shape[0]
    _check_keep(keep, E)
    dominant = np.flatnonzero(select_kept(np.asarray(counts_E, np.float64), keep))
    norms = np.sqrt(np.maximum(np.diag(gram), 1e-300))
    similarity = gram[:, dominant] / (norms[:, None] * norms[dominant][None])   # [E, keep]
    joins = dominant[np.argmax(similarity, axis=1)]               # argmax: the first (lowest) on ties
    joins[dominant] = dominant
    return canonical_labels(joins)


def cluster_leaders(labels_E, counts_E) -> np.ndarray:
    """int [C]: each cluster's most frequent member (ties: the lower index)."""
    labels_E, counts = np.asarray(labels_E), np.asarray(counts_E, np.float64)
    leaders = []
    for c in range(int(labels_E.max()) + 1):
        members = np.flatnonzero(labels_E == c)
        leaders.append(int(members[np.argmax(counts[members])]))  # argmax: the first (lowest) on ties
    return np.asarray(leaders, np.int64)


class FrequencyAveraged(MergeMethod):
    """Leaders are each cluster's most frequent member (`cluster_leaders`); members averaged by
    frequency, W_G = sum_{j in G} freq_j P_j(W_j) / sum_{j in G} freq_j, P_j the alignment onto the
    leader when `ALIGN` (`average.align_layer`), else the identity."""

    ALIGN = False

    def leaders(self, labels_E, ctx: MergeContext) -> np.ndarray:
        return cluster_leaders(labels_E, ctx.counts_E)

    def averaging(self, weights, labels_E, leaders, ctx: MergeContext) -> Averaging:
        return Averaging(np.asarray(ctx.counts_E, np.float64),
                         align_layer(weights, labels_E, leaders, ctx.alignments) if self.ALIGN else {})


@register("hc_smoe")
class HcSmoe(FrequencyAveraged):
    """HC-SMoE: `hc_smoe_clusters` of the experts' mean outputs over all calibration tokens."""

    clustering: str = "average"   # "average": average-linkage clustering (the paper's); "kmeans": k-means++
    reads = ("mean_output_EH",)
    seed_use = "it seeds k-means++ with --hc-method kmeans; average linkage draws nothing at random"

    def check_settings(self) -> None:
        if self.clustering not in HC_SMOE_METHODS:
            raise ConfigError(f"hc_smoe: clustering={self.clustering!r} (--hc-method, merge.hc_smoe.clustering): "
                              f"expected one of {list(HC_SMOE_METHODS)}")

    def clusters(self, keep: int, ctx: MergeContext) -> np.ndarray:
        return hc_smoe_clusters(ctx.stats.mean_output_EH, keep, method=self.clustering, seed=ctx.seed)


@register("m_smoe")
class MSmoe(FrequencyAveraged):
    """M-SMoE: the `keep` most frequent experts dominate (`m_smoe_groups_from_gram`); members' neurons
    aligned to their dominant expert before averaging."""

    ALIGN = True
    reads = ("logit_gram_EE",)

    def clusters(self, keep: int, ctx: MergeContext) -> np.ndarray:
        return m_smoe_groups_from_gram(ctx.stats.logit_gram_EE, ctx.counts_E, keep)

"""One MoE layer merged (SPEC section 8): clusters, each cluster's leader, its merged expert, and
the layer's expert map under either router form. Every method is a registered `MergeMethod`
object (`moejax.merging.method`: `parse(name, **settings)`), defined beside its math; the
functions below take the object and call its algorithm, never its name:

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

import jax.numpy as jnp
import numpy as np

from moejax.errors import ConfigError
from moejax.merging.average import layer_dtype, merge_weights
from moejax.merging.method import Averaging, MergeContext, MergeMethod
from moejax.moe.expert_map import ExpertMap
from moejax.variants.spec import ROUTER_FORMS


def check_router_form(router: str) -> None:
    if router not in ROUTER_FORMS:
        raise ConfigError(f"router={router!r}: expected one of {list(ROUTER_FORMS)} (tied: every router slot "
                          "kept, pointing at its cluster's merged expert; shrunk: one router row per cluster)")


@dataclasses.dataclass(frozen=True)
class LayerMerge:
    method: MergeMethod
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


def merge_stats_options(methods) -> dict:
    """What `merge_stats` must gather for these merge methods beyond the baselines' statistics
    (each method's `stats_options()`: REAM's only when it is asked for)."""
    options = {}
    for m in methods:
        options.update(m.stats_options())
    return options


def merge_layer(method: MergeMethod, keep: int, ctx: MergeContext, expert_weights: dict) -> LayerMerge:
    """The layer merged to `keep` clusters by `method`; expert_weights: name -> [E, ...] arrays
    (host or device), the merged experts returned in their dtype. ctx: the layer's statistics
    (`MergeContext.of(stats, scores_E, seed, alignments)`; REAM: its scores_E required, stats from
    merge_stats(..., **method.stats_options()); the seed also seeds its randomised PCA, large layers
    only)."""
    return merge_clusters(method, method.clusters(keep, ctx), ctx, expert_weights)


def merge_clusters(method: MergeMethod, labels_E, ctx: MergeContext, expert_weights: dict) -> LayerMerge:
    """The layer's clusters `labels_E` merged as `method` merges them (hc_smoe: each member weighted
    by its share of the cluster's counts; m_smoe: neurons aligned to each cluster's leader first;
    ream: each group's centroid leads it, members aligned on their activations over the sampled
    router inputs `ctx.act_inputs_NH` plus their weights, weighted by `ctx.scores_E`)."""
    labels = np.asarray(labels_E)
    leaders = method.leaders(labels, ctx)
    return LayerMerge(method, labels, leaders, merged_rows(method, labels, leaders, ctx, expert_weights))


def merge_averaging(method: MergeMethod, labels_E, leaders, ctx: MergeContext, expert_weights: dict) -> Averaging:
    """How `method` makes each cluster of `labels_E` one expert (`Averaging`: each member's weight,
    and the neuron permutations M-SMoE and REAM align the members by). leaders: each cluster's
    (`method.leaders`). The averaging's work (alignment) is done here; applying it is cheap."""
    host = {k: np.asarray(v) for k, v in expert_weights.items()}
    return method.averaging(host, np.asarray(labels_E), np.asarray(leaders), ctx)


def merged_rows(method: MergeMethod, labels_E, leaders, ctx: MergeContext, expert_weights: dict) -> dict:
    """{name: [C, ...]}: the merged experts, row c of cluster c, in the layer's dtype (rounded a
    cluster at a time): `merge_averaging` applied by `merge_weights`."""
    host = {k: np.asarray(v) for k, v in expert_weights.items()}
    a = merge_averaging(method, labels_E, leaders, ctx, host)
    merged = merge_weights(host, labels_E, a.weights_E, perms=a.perms, out_dtype=layer_dtype(host))
    return {k: np.asarray(merged[k]).astype(host[k].dtype, copy=False) for k in host}

"""toy3's host step, per batch of seeds, in numpy: from stage one's calibration results, each
condition's statistics and scores (float64, ties to the lower index), then every variant stage two
evaluates: the pruning variants' kept sets, MoNE's removed experts and their constants, the merges'
clusters and merged experts (moejax.merging), and the Eq. 6 pairs. `decide_variants` returns them
as a `BatchVariants`."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

from moejax.experiments.toy3.config import Toy3Config
from moejax.experiments.toy3.eq6 import coroute_pairs
from moejax.experiments.toy3.variants import Layout, MergeMap, conditions, merge_map, pair_map
from moejax.merging.method import MergeContext
from moejax.scoring.scores import LayerStats, compute_scores, stats_from_pairs
from moejax.scoring.select import select_kept


@dataclasses.dataclass
class BatchVariants:
    """Every variant of a batch of seeds, per condition (the leading axes [Z, O, W]); the variant
    axis A of each array is the part of `Layout`'s that the array serves.

      masks_ZOWAE      bool: the router slots that remain, for the variants routed under a mask
                       (`Layout.n_masked`): the pruning variants' kept sets, then the merges'
                       shrunk forms (each cluster's leader)
      rows_ZOWAE       int32: the row of the expert table each slot computes with, for the merges'
                       variants (`Layout.n_mapped`: shrunk forms, tied forms, Eq. 6 pairs)
      merged           {"w1": [Z, O, W, n_slots, D, F], "w2": [..., F, D]} float32: the merged experts
                       at their slots (`Layout`), or None when the layout has no slot
      pairs            {(s, o, l): the Eq. 6 pairs (i, j) of that condition}
      novice_ZOWAE     bool: MoNE's variants (`Layout.substituted`), the slots whose expert was removed
      constants_ZOWED  float32: each expert's mean routed output (MoNE's constant), or None
      top16_share_ZOW  the share of the calibration routing the 16 most used experts take
      overlap_ZOWA     how many of each pruning variant's kept experts frequency keeps as well
    """

    masks_ZOWAE: np.ndarray
    rows_ZOWAE: np.ndarray
    merged: dict | None
    pairs: dict
    novice_ZOWAE: np.ndarray
    constants_ZOWED: np.ndarray | None
    top16_share_ZOW: np.ndarray
    overlap_ZOWA: np.ndarray

    @classmethod
    def empty(cls, cfg: Toy3Config, lay: Layout, stacked: dict) -> "BatchVariants":
        """Nothing decided yet: no slot remains, every slot its own row. stacked: the batch's draw."""
        lead, n_experts = (len(stacked["router"]), len(cfg.offsets), len(cfg.loads)), cfg.n_experts
        n_sub = len(lay.substituted)
        return cls(
            masks_ZOWAE=np.zeros((*lead, lay.n_masked, n_experts), bool),
            rows_ZOWAE=np.broadcast_to(np.arange(n_experts, dtype=np.int32), (*lead, lay.n_mapped, n_experts)).copy(),
            merged=({k: np.zeros((*lead, lay.n_slots, *stacked[k].shape[2:]), np.float32) for k in ("w1", "w2")}
                    if lay.n_slots else None),
            pairs={},
            novice_ZOWAE=np.zeros((*lead, n_sub, n_experts), bool),
            constants_ZOWED=np.zeros((*lead, n_experts, stacked["x_cal"].shape[-1]), np.float32) if n_sub else None,
            top16_share_ZOW=np.zeros(lead),
            overlap_ZOWA=np.zeros((*lead, len(lay.pruned)), np.int64))

    def place(self, at: tuple, placed: "Placed") -> None:
        """Write one merge map of condition `at` = (s, o, l): its shrunk form's mask, its variants'
        rows and its merged experts."""
        if placed.shrunk is not None:
            self.masks_ZOWAE[(*at, placed.shrunk, placed.merge.leaders)] = True
        self.rows_ZOWAE[(*at, placed.variants)] = placed.merge.rows_E
        for slot, weights in enumerate(placed.merge.experts, start=placed.first_slot):
            for k in self.merged:
                self.merged[k][(*at, slot)] = weights[k]


class Placed(NamedTuple):
    """A MergeMap and where it goes among a condition's variants."""

    merge: MergeMap
    variants: list      # its variants among the merges' (rows_ZOWAE's A axis)
    first_slot: int     # the slot of its first merged expert
    shrunk: int | None  # its shrunk form among the masked variants (masks_ZOWAE's A axis); None: a pair


def decide_variants(cfg: Toy3Config, lay: Layout, seeds, stacked: dict, host: dict) -> BatchVariants:
    """The host step of one batch of seeds. stacked: the batch's draw, stacked over seeds
    (`draw_inputs`); host: stage one's results on the host, with the router weights."""
    out = BatchVariants.empty(cfg, lay, stacked)
    n_pruned = len(lay.pruned)
    clustering = {}   # per (seed, offset): what the clusters read (`_clustering_inputs`)
    alignments = {}   # per seed (its experts): M-SMoE's (leader, member) alignments, for every offset, load, keep
    for (s, seed), (o, _), (l_, _) in conditions(cfg, seeds):
        stats = _condition_stats(cfg, host, stacked, (s, o, l_), int(seed))
        scores = compute_scores(stats, cfg.scores)
        if lay.substituted:
            out.novice_ZOWAE[s, o, l_], out.constants_ZOWED[s, o, l_] = _substitution(cfg, lay, stats)
        out.top16_share_ZOW[s, o, l_] = _top16_share(stats.counts_E)
        out.masks_ZOWAE[s, o, l_, :n_pruned], out.overlap_ZOWA[s, o, l_] = _pruning(cfg, lay, stats, scores)
        if (s, o) not in clustering:
            clustering[s, o] = _clustering_inputs(cfg, host, stacked["x_cal"][s, o], (s, o))
        w1, w2 = stacked["w1"][s], stacked["w2"][s]
        first_row = cfg.n_experts + l_ * lay.n_slots  # this load's merged experts in the table
        placed = _merges(cfg, lay, stats, clustering[s, o], alignments.setdefault(s, {}), (w1, w2), first_row,
                         int(seed))
        out.pairs[s, o, l_] = coroute_pairs(host["cal_idx"][s, o, l_], cfg.n_experts, cfg.eq6_pairs)
        placed += _pair_merges(lay, out.pairs[s, o, l_], stats.counts_E, (w1, w2), first_row)
        for one in placed:
            out.place((s, o, l_), one)
    return out


def _condition_stats(cfg: Toy3Config, host: dict, stacked: dict, at: tuple, seed: int) -> LayerStats:
    """The layer's statistics under condition `at` = (s, o, l), from its calibration routing."""
    s, o, l_ = at
    return stats_from_pairs(host["cal_idx"][s, o, l_], host["cal_gate"][s, o, l_],
                            host["cal_norm"][s, o, l_], host["x_cal_mean"][s, o],
                            host["router"][s], host["bias"][s, o, l_] if cfg.has_balance_bias else None,
                            seed=seed, layer=0,  # aimer reads the experts' w1, w2
                            expert_weights=[stacked["w1"][s], stacked["w2"][s]] if "aimer" in cfg.scores
                            else None, out_TKH=host["cal_out"][s, o, l_] if cfg.needs_outputs else None)


def _substitution(cfg: Toy3Config, lay: Layout, stats: LayerStats) -> tuple[np.ndarray, np.ndarray]:
    """MoNE (novice [A, E], constants [E, D]): each named score's kept set; every other slot returns
    its mean routed output."""
    sub_scores = compute_scores(stats, cfg.substitutes)
    novice_AE = np.zeros((len(lay.substituted), len(stats.counts_E)), bool)
    for v, (name, keep) in enumerate(lay.substituted):
        novice_AE[v] = ~select_kept(sub_scores[name], keep)
    return novice_AE, stats.mean_output_EH


def _top16_share(counts_E) -> float:
    usage = np.sort(counts_E)[::-1]
    return float(usage[:16].sum() / usage.sum())


def _pruning(cfg: Toy3Config, lay: Layout, stats: LayerStats, scores: dict) -> tuple[np.ndarray, np.ndarray]:
    """The pruning variants (kept [A, E]: each score's top `keep` experts) and how many of each
    one's kept experts frequency keeps as well [A]."""
    frequency_kept = {keep: select_kept(stats.counts_E, keep) for keep in cfg.keep_counts()}
    kept_AE = np.zeros((len(lay.pruned), cfg.n_experts), bool)
    overlap_A = np.zeros(len(lay.pruned), np.int64)
    for v, (name, keep) in enumerate(lay.pruned):
        kept_AE[v] = kept = select_kept(scores[name], keep)
        overlap_A[v] = np.sum(kept & frequency_kept[keep])
    return kept_AE, overlap_A


def _clustering_inputs(cfg: Toy3Config, host: dict, x_cal_TD, at: tuple) -> dict:
    """What the merges read, per (seed, offset) `at`, by `MergeStats` field (each only when a merge
    reads it, `MergeMethod.reads`): the experts' mean outputs over all calibration tokens, the Gram
    matrix L^T L of the calibration tokens' router logits L [T, E] (float64), the router-weighted
    output sums; and the calibration tokens' router inputs, which `_merge_stats` samples."""
    inputs = {"x_cal_TD": x_cal_TD}
    if "cal_mean_output" in host:
        inputs["mean_output_EH"] = host["cal_mean_output"][at]
    if "logits_cal" in host:
        logits = np.asarray(host["logits_cal"][at], np.float64)
        inputs["logit_gram_EE"] = logits.T @ logits
    if "cal_gated_output" in host:
        inputs["gated_output_sum_EH"] = host["cal_gated_output"][at]
    return inputs


def _merge_stats(method, inputs: dict, counts_E, seed: int):
    """One condition's `MergeStats` for `method`, from `_clustering_inputs` and the load's routing
    counts: the fields it reads (`method.reads`); its sampled router inputs, `method.sampled_tokens`
    of the calibration tokens (`subsample_positions`, seeded by the toy's seed). The mean outputs
    are given as the sums over one token, so `mean_output_EH` is them exactly."""
    from moejax.merging.calibration import MergeStats, subsample_positions   # (JAX: the host step runs after it)

    reads = set(method.reads)
    x_cal_TD = inputs["x_cal_TD"]
    act = (x_cal_TD[subsample_positions(len(x_cal_TD), method.sampled_tokens, seed)]
           if "act_inputs_NH" in reads else None)
    return MergeStats(counts_E, inputs.get("mean_output_EH"), inputs.get("logit_gram_EE"), 1,
                      inputs.get("gated_output_sum_EH") if "gated_output_sum_EH" in reads else None, act)


def _merges(cfg: Toy3Config, lay: Layout, stats: LayerStats, inputs: dict, alignments: dict, weights: tuple,
            first_row: int, seed: int) -> list[Placed]:
    """Each merge (method, keep) of one condition: its clusters (SPEC section 8, the method's own
    `clusters`), merged into the table rows from `first_row`, placed as its shrunk and tied forms.
    inputs: `_clustering_inputs`; alignments: M-SMoE's memo for this seed's experts; weights: (w1,
    w2) of this seed's layer. A merge reading a score (REAM's centroids) reads it under this load's
    routing."""
    merge_scores = compute_scores(stats, list(cfg.merge_scores)) if cfg.merge_scores else {}
    n_pruned, n_merged = len(lay.pruned), len(lay.merged)
    contexts = {}   # per method: its MergeContext under this condition, for every keep
    placed = []
    for m, (method, keep) in enumerate(lay.merged):
        if method not in contexts:
            contexts[method] = MergeContext.of(_merge_stats(method, inputs, stats.counts_E, seed),
                                               merge_scores[method.scores[0]] if method.scores else None, seed,
                                               alignments)
        ctx = contexts[method]
        mm = merge_map(method, method.clusters(keep, ctx), ctx, *weights, first_row + lay.first_slot[m])
        placed.append(Placed(mm, [m, n_merged + m], lay.first_slot[m], n_pruned + m))
    return placed


def _pair_merges(lay: Layout, pairs: list, counts_E, weights: tuple, first_row: int) -> list[Placed]:
    """Each Eq. 6 pair merged alone (its variant keeps every slot), at its slot after the merges'."""
    n_merged = len(lay.merged)
    placed = []
    for p, pair in enumerate(pairs):
        slot = lay.first_slot[-1] + p
        placed.append(Placed(pair_map(pair, counts_E, *weights, first_row + slot), [2 * n_merged + p], slot, None))
    return placed

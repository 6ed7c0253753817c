"""The toy3 experiment (SPEC section 4): when does a data-free router score pick the experts
that calibration would pick?

One toy MoE layer (top 4 of 64, ReLU-MLP experts). For each seed, condition
(offset direction x load) and score, keep the top-`keep` experts and measure how wrong the pruned
layer is on held-out tokens.

    router  sigmoid:  s = sigmoid(logits), chosen = top 4 of s + bias (DeepSeek-V3; the default)
            softmax:  s = softmax(logits) over the experts, chosen = top 4 of s, no bias
                      (Qwen3-MoE, Mixtral); either way gates = s of the chosen, renormalised over the 4
    offset  ones:     x = mu + noise, mu along the all-ones vector, ||mu|| = 0.5 sqrt(d)
            random:   mu along a random unit direction (per seed)
    load    skewed:   bias 0
            balanced: 300 steps of bias -= 0.002 sign(load - mean(load)) on the calibration tokens
                      (sigmoid only: a softmax router has no balance bias, and Qwen3-MoE / Mixtral
                      balance by an auxiliary loss in training, which a router-only toy does not
                      define; so router=softmax refuses loads containing `balanced`, and scores
                      that read the bias)

Beside the scores, the merging baselines of SPEC section 8 at the same keeps (`merges`): HC-SMoE
and M-SMoE by default, REAM when named (`toy.merges=[hc_smoe,m_smoe,ream]`: centroids by
`merge.ream.score`, REAP by default, groups of at most `merge.ream.group_size`), each under both router forms,
    tied      every router slot remains; slot e computes its cluster's merged expert
    shrunk    only each cluster's leader's slot remains (its most frequent member, ties to the lower
              index); it computes the merged expert
reported as the scores are, with score "hc_smoe:tied", "m_smoe:shrunk", ...; MoNE's substitution
when named (`toy.substitutes=[mone]`: each named score's kept set, every other expert's slot kept
in the router and returning its mean output over the calibration tokens routed to it), score
"mone:substituted"; and the check of the
REAP paper's Eq. 6 (`eq6_pairs` pairs per seed and condition merged one at a time, tied router:
the measured increase in error against the formula's prediction; rows `eq6_*`, score "pair:i+j").

Every variant is an expert map (moejax.moe.expert_map): a mask of the router slots that remain and
the row each slot computes with, in one table of expert outputs on the held-out tokens (the
layer's own experts, then the merged ones). Pruning: its mask, every slot its own row.

Seeds are vectorised inside one job (`job.run`), batch by batch; each module holds one step:
  config.py     Toy3Config: every setting, its default and its checks (no JAX)
  draw.py       host (numpy): draw every seed's layer and tokens
  stage_one.py  jit: balance, route the calibration tokens (sorted grouped-matmul backend: only
                routed pairs); with merges, each expert's mean output over the calibration
                tokens (HC-SMoE) and the router logits of the calibration tokens (M-SMoE); and
                (`held_table`, run while the host decides the variants) f_j(x) for every held-out
                token and expert, once (each variant's output is a gate-weighted sum of entries of
                that table, so no variant recomputes an expert)
  host.py       host (numpy): float64 statistics, scores, kept sets (ties to the lower index);
                clusters and merged experts (moejax.merging), the variants' masks and rows
  variants.py   the variant axis (`Layout`) and the merges as expert maps (`MergeMap`)
  stage_two.py  jit: route the held-out tokens under every kept set (masks, one compile) and
                measure the errors (SPEC section 3), one (seed, offset) at a time, tabulating its
                f_j(x) first when stage one did not; the merges' variants likewise, in a program
                of their own that first tabulates the merged experts on the held-out tokens
  eq6.py        host (numpy): the pairs Eq. 6 merges and its prediction for them
  results.py    the tidy rows and the summary table
  job.py        the steps in order, timed, and what a cold job overlaps on a second thread

This module is what moejax.experiments.runner reads (`Config`, `settings_from`, `run`,
`summary_title`, `summary_table`) and the names callers import; importing it imports no JAX.
"""

from moejax.experiments.toy3.config import (DEFAULT_MERGES, DEFAULT_SCORES, LOADS, OFFSETS, ROUTERS,
                                            Toy3Config, settings_from)
from moejax.experiments.toy3.draw import draw_inputs
from moejax.experiments.toy3.eq6 import coroute_pairs, eq6_metrics, eq6_prediction
from moejax.experiments.toy3.job import run
from moejax.experiments.toy3.results import summary_table, summary_title
from moejax.experiments.toy3.stage_one import merges_read_table
from moejax.experiments.toy3.variants import Layout, MergeMap, layout, merge_map, merge_slots, pair_map

# What moejax.experiments.runner looks for in an experiment module (see moejax.experiments).
Config = Toy3Config

__all__ = ["Config", "DEFAULT_MERGES", "DEFAULT_SCORES", "LOADS", "Layout", "MergeMap", "OFFSETS", "ROUTERS",
           "Toy3Config", "coroute_pairs", "draw_inputs", "eq6_metrics", "eq6_prediction", "layout",
           "merge_map", "merge_slots", "merges_read_table", "pair_map", "run", "settings_from",
           "summary_table", "summary_title"]

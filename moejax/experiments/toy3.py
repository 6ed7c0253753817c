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
`toy.merge_score`, REAP by default, groups of at most `toy.group_size`), each under both router forms,
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

Seeds are vectorised inside one job. How the work is laid out:
  host (numpy)   draw every seed's layer and tokens;
  stage 1 (jit)  balance, route the calibration tokens
                 (sorted grouped-matmul backend: only routed pairs); with merges, tabulate f_j(x)
                 for every held-out token and expert once (each variant's output is a
                 gate-weighted sum of entries of that table, so no variant recomputes an expert),
                 each expert's mean output over the calibration tokens (HC-SMoE) and the router
                 logits of the calibration tokens (M-SMoE);
  host (numpy)   float64 statistics, scores, kept sets (ties to the lower index); clusters and
                 merged experts (moejax.merging), the variants' masks and rows;
  stage 2 (jit)  route the held-out tokens under every kept set (masks, one compile) and
                 measure the errors (SPEC section 3), one (seed, offset) at a time, tabulating its
                 f_j(x) first when stage 1 did not; the merges' variants likewise, in a program
                 of their own that first tabulates the merged experts on the held-out tokens;
  host (numpy)   Eq. 6's prediction for the merged pairs.
A cold job overlaps what it can on a second thread (`_compile_ahead`, `_import_in_background`):
stage 2 compiles, and pandas imports, while stage 1 is traced, compiled and run.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import itertools
import logging
import sys
import threading
import time
from typing import NamedTuple

import numpy as np

from moejax.errors import ConfigError
from moejax.experiments import refuse_repeats, refuse_unknown_settings
from moejax.parallel.mesh import MeshConfig, mesh_context
from moejax.scoring.scores import scores_for
from moejax.scoring.select import resolve_keep

log = logging.getLogger(__name__)

OFFSETS = ("ones", "random")
LOADS = ("skewed", "balanced")
ROUTERS = ("sigmoid", "softmax")  # toy_layer.ROUTERS, not imported: validating needs no JAX
DEFAULT_SCORES = ("frequency", "signed", "l1", "random", "reap", "ean")
MERGES = ("hc_smoe", "m_smoe", "ream")  # moejax.merging.layer.MERGE_METHODS, not imported: validating needs no JAX
DEFAULT_MERGES = ("hc_smoe", "m_smoe")


@dataclasses.dataclass(frozen=True)
class Toy3Config:
    """Every setting of toy3; defaults are SPEC section 4."""

    seed: int = 0                 # first seed
    seeds: int = 8                # seeds seed .. seed + seeds - 1, vectorised in one job
    keep: tuple = (8, 16, 32, 48)  # counts, or ratios of E (floats in (0, 1])
    scores: tuple = DEFAULT_SCORES  # any registered score but reap_code (aimer reads the experts' w1, w2)
    merges: tuple = DEFAULT_MERGES  # merging baselines (SPEC section 8), each under both router forms; () = none;
                                  # ream as well when named
    substitutes: tuple = ()       # scores whose kept sets are also evaluated substituted (MoNE), e.g. [mone]
    group_size: int = 16          # ream: the most experts a group holds, its centroid included (REAM's C)
    merge_score: str = "reap"     # ream: the score its centroids are ranked and averaged by
    eq6_pairs: int = 16           # Eq. 6 check: pairs merged one at a time per seed and condition; 0 = none
    offsets: tuple = OFFSETS
    loads: tuple = LOADS
    d_model: int = 32
    d_hidden: int = 64
    n_experts: int = 64
    top_k: int = 4
    n_calib: int = 6000
    n_heldout: int = 6000
    balance_steps: int = 300
    balance_rate: float = 0.002
    offset_scale: float = 0.5     # ||mu|| = offset_scale * sqrt(d)
    router: str = "sigmoid"       # sigmoid (balance bias, DeepSeek-V3) or softmax (no bias, Qwen3-MoE)
    backend: str = "sorted"       # dispatch backend of the calibration pass ("ep" on a mesh); the Hydra
    #                               config's toy.backend=auto picks it from the mesh (settings_from)
    mesh_data: int = 1            # devices: data x expert (from the Hydra `mesh` group)
    mesh_expert: int = 1
    seed_batch: int = 8           # seeds vectorised together (bounds memory)

    @classmethod
    def from_mapping(cls, cfg: dict) -> "Toy3Config":
        """Build from a plain dict (a resolved Hydra config), rejecting unknown keys and bad values."""
        cfg = dict(cfg)
        refuse_unknown_settings(cls, cfg, "toy3")
        if "keep" in cfg and cfg["keep"] is not None:
            keep = cfg["keep"]
            cfg["keep"] = tuple(keep) if isinstance(keep, (list, tuple)) else (keep,)
        elif "keep" in cfg:
            del cfg["keep"]
        for key in ("scores", "merges", "substitutes", "offsets", "loads"):
            if key in cfg:
                cfg[key] = tuple(cfg[key]) if isinstance(cfg[key], (list, tuple)) else (cfg[key],)
        out = cls(**cfg)
        out.validate()
        return out

    def validate(self) -> None:
        for name in ("seed", "seeds", "d_model", "d_hidden", "n_experts", "top_k", "n_calib",
                     "n_heldout", "balance_steps", "seed_batch", "mesh_data", "mesh_expert", "eq6_pairs", "group_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"toy3: {name} must be an integer, got {value!r}")
        if self.seeds < 1:
            raise ConfigError(f"toy3: seeds={self.seeds}; need at least one seed (seeds >= 1)")
        if self.seed < 0:
            raise ConfigError(f"toy3: seed={self.seed}; seeds are non-negative integers")
        for name, value, valid in (("offsets", self.offsets, OFFSETS), ("loads", self.loads, LOADS)):
            bad = [v for v in value if v not in valid]
            if bad or not value:
                raise ConfigError(f"toy3: {name}={list(value)}; valid values: {list(valid)}")
            refuse_repeats("toy3", name, value)
        self.check_router()
        if [m for m in self.merges if m not in MERGES]:
            raise ConfigError(f"toy3: merges={list(self.merges)}; valid merges: {list(MERGES)}, each at most "
                              "once (toy.merges=[] for none)")
        refuse_repeats("toy3", "merges", self.merges)
        if "ream" in self.merges:
            from moejax.merging.ream import check_group_size, check_ream_score   # numpy only

            try:
                check_ream_score(self.merge_score, "toy.merge_score")
                if self.merge_score == "reap_code":
                    raise ConfigError("toy.merge_score 'reap_code': the toy does not compute it (see scores)")
                for keep in self.keep_counts():
                    check_group_size(self.group_size, keep, self.n_experts)
            except ConfigError as e:
                raise ConfigError(f"toy3: {e}") from None
        refuse_repeats("toy3", "scores", self.scores)
        n_pairs = self.n_experts * (self.n_experts - 1) // 2
        if not 0 <= self.eq6_pairs <= n_pairs:
            raise ConfigError(f"toy3: eq6_pairs={self.eq6_pairs}; expected 0 (no Eq. 6 check) to {n_pairs} "
                              f"(every pair of the {self.n_experts} experts)")
        if self.eq6_pairs and not self.merges:
            raise ConfigError(f"toy3: eq6_pairs={self.eq6_pairs} with merges=[]: the Eq. 6 check merges its pairs in "
                              "the merges' program, which merges=[] turns off; set toy.eq6_pairs=0 as well (or "
                              "keep a merge)")
        if "reap_code" in (*self.scores, *self.substitutes):
            raise ConfigError("toy3: the reap_code score needs expert outputs for pairs the layer did not "
                              "route, which the toy does not compute; use reap")
        refuse_repeats("toy3", "substitutes", self.substitutes)
        if self.substitutes:
            scores_for(self.substitutes, self.has_balance_bias, where=f"toy3 substitutes (router={self.router})")
        if not self.keep:
            raise ConfigError("toy3: keep is empty; give a count, a ratio of E, or a list of them")
        refuse_repeats("toy3", "keep", self.keep_counts(), self.keep)
        if self.n_calib < 1 or self.n_heldout < 1 or self.seed_batch < 1:
            raise ConfigError("toy3: n_calib, n_heldout and seed_batch must be >= 1")
        mesh = MeshConfig(self.mesh_data, self.mesh_expert)
        if self.backend == "ep" and self.n_experts % mesh.expert:
            raise ConfigError(f"toy3: n_experts={self.n_experts} does not split over mesh.expert={mesh.expert}")
        if mesh.expert_parallel and self.backend != "ep":
            raise ConfigError(f"toy3: mesh.expert={mesh.expert} needs toy.backend=ep (got {self.backend!r})")

    def check_router(self) -> None:
        """A softmax router has no balance bias: the `balanced` load (bias trained by auxiliary-loss-free
        steps) and scores that read the bias are not defined for it; refused here, naming the setting."""
        if self.router not in ROUTERS:
            raise ConfigError(f"toy3: router={self.router!r}; valid routers: {list(ROUTERS)}")
        has_bias = self.has_balance_bias
        if not has_bias and "balanced" in self.loads:
            raise ConfigError(f"toy3: loads={list(self.loads)} with router={self.router}: the balanced load trains "
                              "the sigmoid router's balance bias, and a softmax router has none; "
                              "use loads=[skewed] (toy.loads=[skewed])")
        scores_for(self.scores, has_bias, where=f"toy3 (router={self.router})")

    @property
    def needs_outputs(self) -> bool:
        """Whether the calibration pass brings the routed pairs' outputs to the host: the mone score
        and the substitutes' constants read their sums."""
        return bool(self.substitutes) or "mone" in self.scores or ("ream" in self.merges
                                                                    and self.merge_score == "mone")

    @property
    def has_balance_bias(self) -> bool:
        """Whether the layer's router has a balance bias (e_score_correction_bias): sigmoid only."""
        return self.router == "sigmoid"

    def keep_counts(self) -> list[int]:
        return [resolve_keep(k, self.n_experts, self.top_k) for k in self.keep]


# What moejax.experiments.runner looks for in an experiment module (see moejax.experiments).
Config = Toy3Config


def settings_from(cfg: dict) -> dict:
    """toy3's settings from the resolved Hydra config: the `toy` block plus seed, seeds and keep."""
    settings = dict(cfg.get("toy") or {})
    settings.update({k: cfg[k] for k in ("seed", "seeds", "keep") if cfg.get(k) is not None})
    mesh = MeshConfig.from_dict(cfg.get("mesh"))
    settings.update(mesh_data=mesh.data, mesh_expert=mesh.expert)
    if settings.get("backend", "auto") == "auto":  # the routed experts' backend follows the mesh
        settings["backend"] = "ep" if mesh.expert_parallel else "sorted"
    return settings


def summary_title(cfg: Toy3Config) -> str:
    merges = " (merges: method:router form)" if cfg.merges else ""
    return f"{cfg.router} router: mean rel_error over {cfg.seeds} seed(s) (± std), by keep{merges}:"


def draw_inputs(cfg: Toy3Config, seeds) -> list[dict]:
    """Everything random about each seed (SPEC section 4), drawn on the host with numpy: the
    layer's weights router [E, d], w1 [E, d, h], w2 [E, h, d], and the tokens under each offset,
    x_cal [O, n_calib, d] and x_held [O, n_heldout, d], all float32.

    numpy rather than jax.random: the draw is cheap either way, but XLA took ~2.6 s to compile
    the jax.random version, a quarter of a cold run. Weights, offset direction, calibration and
    held-out tokens come from separate child streams, so changing a token count leaves the
    weights as they were. (The `random` score uses its own stream, [seed, 0].)
    """
    return [_draw(cfg, int(seed)) for seed in seeds]


def _draw(cfg: Toy3Config, seed: int) -> dict:
    g_model, g_dir, g_cal, g_held = (np.random.default_rng(s)
                                     for s in np.random.SeedSequence([seed, 1]).spawn(4))
    d, h, n_experts = cfg.d_model, cfg.d_hidden, cfg.n_experts

    def normal(gen, shape, std=1.0):
        return gen.standard_normal(shape, dtype=np.float32) * np.float32(std)

    router = normal(g_model, (n_experts, d), d ** -0.5)
    w1 = normal(g_model, (n_experts, d, h), d ** -0.5)
    w2 = normal(g_model, (n_experts, h, d), h ** -0.5)
    v = g_dir.standard_normal(d)
    directions = {"ones": np.ones(d) / np.sqrt(d), "random": v / np.linalg.norm(v)}
    mu_OD = (cfg.offset_scale * np.sqrt(d) * np.stack([directions[o] for o in cfg.offsets])).astype(np.float32)
    # The same noise under both offsets: the offset comparison is paired.
    x_cal = mu_OD[:, None] + normal(g_cal, (cfg.n_calib, d))
    x_held = mu_OD[:, None] + normal(g_held, (cfg.n_heldout, d))
    return {"router": router, "w1": w1, "w2": w2, "x_cal": x_cal, "x_held": x_held}


class Layout(NamedTuple):
    """The variant axis of stage two, the same for every (seed, offset, load): the pruning variants
    (score, keep), then per merge (method, keep) its shrunk form, then its tied form, then the Eq. 6
    pairs. The pruning and shrunk variants are routed under their own masks (`n_masked` of them);
    the tied forms and the pairs keep every slot, so they are routed as the unpruned layer is.

    Merged experts get rows of the table after the layer's E own experts, per load: merge m's
    clusters of two or more members at rows first_slot[m] .., the Eq. 6 pairs from first_slot[-1];
    n_slots rows per load in all."""

    pruned: list      # (score, keep)
    merged: list      # (method, keep)
    first_slot: list
    n_slots: int
    substituted: list = []   # (score, keep): MoNE's variants, evaluated apart (`_stage_substitutes`)

    @property
    def n_masked(self) -> int:
        return len(self.pruned) + len(self.merged)

    def labels(self, pairs) -> list:
        """(score, keep) of every variant; pairs: the (i, j) of the Eq. 6 variants."""
        return (self.pruned + [(f"{m}:shrunk", k) for m, k in self.merged]
                + [(f"{m}:tied", k) for m, k in self.merged] + [(f"pair:{i}+{j}", None) for i, j in pairs])


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


def merge_labels(method: str, keep: int, counts_E, mean_output_ED=None, logit_gram_EE=None) -> np.ndarray:
    """The clusters [E] of `method` (SPEC section 8): hc_smoe from the experts' mean outputs over all
    calibration tokens (average linkage), m_smoe from the Gram matrix L^T L of the calibration
    tokens' router logits L [T, E] (the cosines of its columns) and the routing counts. (ream:
    `ream_labels`.)"""
    from moejax.merging.clusters import hc_smoe_clusters, m_smoe_groups_from_gram

    if method == "hc_smoe":
        return hc_smoe_clusters(mean_output_ED, keep)
    return m_smoe_groups_from_gram(logit_gram_EE, counts_E, keep)


def ream_labels(keep: int, scores_E, similarity_EE, group_size: int) -> np.ndarray:
    """REAM's groups [E] (`moejax.merging.ream.ream_groups`): the `keep` highest-scoring experts are
    centroids, each takes its group_size - 1 most similar unassigned experts, similarity =
    `ream_similarity` of the router-weighted output sums and the router-logit Gram."""
    from moejax.merging.ream import ream_groups

    return ream_groups(scores_E, similarity_EE, keep, group_size)


class MergeMap(NamedTuple):
    """One merge of the layer as expert maps: the shrunk form keeps the router slots `leaders` (each
    cluster's most frequent member, ties to the lower index), the tied form every slot; under both,
    slot e computes with table row rows_E[e]: its own expert (row e) if its cluster is a singleton,
    else its cluster's merged expert, `experts[i]` at row first_row + i for the i-th cluster of two
    or more members."""

    leaders: np.ndarray
    rows_E: np.ndarray
    experts: list


def merge_map(method: str, labels_E, counts_E, w1_EDF, w2_EFD, first_row: int, **extra) -> MergeMap:
    """The merge of clusters `labels_E` (`moejax.merging.layer.merge_clusters`): each cluster G becomes
    W_G = sum_{j in G} freq_j W_j / sum_{j in G} freq_j, w1 and w2 separately, freq the routing
    counts; m_smoe first aligns each member's neurons to its cluster's leader, the dominant expert;
    ream (extra: scores_E, act_inputs_NH, seed) aligns each member to its centroid and weights by
    the scores; m_smoe's extra may be `alignments`, its memo of the layer's alignments (`MergeContext`)."""
    from moejax.merging.layer import merge_clusters

    merge = merge_clusters(method, labels_E, counts_E, {"w1": w1_EDF, "w2": w2_EFD}, **extra)
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


def _ream_inputs(gated_output_ED, gram_EE, x_cal_TD, seed: int) -> dict:
    """What REAM reads beside the scores, per (seed, offset): the similarity its groups are formed
    by, and the router inputs of `REAM_TOKENS` calibration tokens (`subsample_positions`, seeded by
    the toy's seed) its alignment computes activations on."""
    from moejax.merging.calibration import REAM_TOKENS, subsample_positions
    from moejax.merging.ream import ream_similarity

    return {"similarity": ream_similarity(gated_output_ED, gram_EE),
            "act_inputs": x_cal_TD[subsample_positions(len(x_cal_TD), REAM_TOKENS, seed)]}


def coroute_pairs(expert_idx_TK, n_experts: int, n_pairs: int) -> list:
    """The `n_pairs` pairs (i < j) routed together (both among a token's chosen experts) on the most
    calibration tokens; ties to the lower i, then the lower j."""
    idx_TK = np.sort(np.asarray(expert_idx_TK), axis=1)
    a, b = np.triu_indices(idx_TK.shape[1], k=1)  # every two of a token's K chosen experts, lower first
    together = np.bincount((idx_TK[:, a] * n_experts + idx_TK[:, b]).ravel(), minlength=n_experts ** 2)
    i, j = np.triu_indices(n_experts, k=1)
    order = np.lexsort((j, i, -together[i * n_experts + j]))[:n_pairs]
    return [(int(i[o]), int(j[o])) for o in order]


def eq6_prediction(g_i, g_j, d_ij) -> float:
    """REAP's Eq. 6 (SPEC section 8) summed over a set of N tokens:
    N * E[(g_i + g_j)^2] * Var[r] * E[||f_i(x) - f_j(x)||^2],  r = g_i / (g_i + g_j),
    expectations (and the population variance) over the set; g_e = 0 where e is not routed;
    d_ij = ||f_i(x) - f_j(x)||^2 per token. 0 for an empty set. In float64."""
    g_i, g_j, d_ij = (np.asarray(a, np.float64) for a in (g_i, g_j, d_ij))
    if g_i.size == 0:
        return 0.0
    return float(g_i.size * np.mean((g_i + g_j) ** 2) * np.var(g_i / (g_i + g_j)) * np.mean(d_ij))


def eq6_metrics(pair, idx_TK, gate_TK, f_ETD, err_sq_T) -> dict:
    """Eq. 6 for one merged pair (i, j) on the held-out tokens, tied router (idx, gate: the unpruned
    routing; f: the held-out table; err_sq_T = ||y_merged - y||^2 per token, only this pair merged):
      eq6_measured        sum over every token of err_sq (nonzero only where i or j is routed)
      eq6_predicted       `eq6_prediction` over the tokens routed to i or j: every token the merge
                          changes, and the set on which the algebra holds (g = 0 for an expert not
                          routed, so r is 1 or 0 on a token routed to only one of them)
      eq6_measured_both   sum of err_sq over the tokens routed to both (r strictly inside (0, 1))
      eq6_predicted_both  `eq6_prediction` over the tokens routed to both"""
    i, j = pair
    g_i, g_j = ((gate_TK * (idx_TK == e)).sum(axis=1, dtype=np.float64) for e in (i, j))
    on_i, on_j = (idx_TK == i).any(axis=1), (idx_TK == j).any(axis=1)

    def predicted(tokens):
        d = np.sum((f_ETD[i, tokens].astype(np.float64) - f_ETD[j, tokens]) ** 2, axis=1)
        return eq6_prediction(g_i[tokens], g_j[tokens], d)

    both = on_i & on_j
    return {"eq6_measured": float(np.sum(err_sq_T, dtype=np.float64)), "eq6_predicted": predicted(on_i | on_j),
            "eq6_measured_both": float(np.sum(err_sq_T[both], dtype=np.float64)),
            "eq6_predicted_both": predicted(both)}


@functools.lru_cache(maxsize=8)
def _stage_one(cfg: Toy3Config):
    """Per seed: balancing, the calibration pass and the held-out table, from the drawn inputs
    (`draw_inputs`, stacked over seeds); for the merges, each expert's mean output over the
    calibration tokens (hc_smoe) and the calibration tokens' router logits (m_smoe). Returns a
    jitted function (cached per config, so repeated runs reuse it)."""
    import jax
    import jax.numpy as jnp

    from moejax.models import toy_layer
    from moejax.moe.balancing import balance_bias

    @jax.jit
    def run(router_Z, w1_Z, w2_Z, x_cal_ZOTD, x_held_ZOTD):
        def weights(s):
            return {"router": router_Z[s], "w1": w1_Z[s], "w2": w2_Z[s]}

        logits_cal_ZOTE = jax.vmap(jax.vmap(toy_layer.router_logits, in_axes=(None, 0)))(router_Z, x_cal_ZOTD)
        zeros_ZOE = jnp.zeros(logits_cal_ZOTE.shape[:2] + logits_cal_ZOTE.shape[3:], jnp.float32)
        if "balanced" in cfg.loads:  # sigmoid only (Toy3Config.check_router)
            balanced_ZOE = balance_bias(logits_cal_ZOTE, toy_layer.router_config(cfg.top_k, cfg.router),
                                        cfg.balance_steps, cfg.balance_rate)
        # a softmax router has no bias: its zeros choose nothing (s + 0 = s)
        bias_ZOWE = jnp.stack([balanced_ZOE if ld == "balanced" else zeros_ZOE for ld in cfg.loads], axis=2)

        n_offsets, n_loads = len(cfg.offsets), len(cfg.loads)

        def calibrate(i):  # routing and each routed pair's ||f_j(x)|| of one (seed, offset, load)
            s, o, ld = i // (n_offsets * n_loads), i // n_loads % n_offsets, i % n_loads
            routing, f_TKD, _ = toy_layer.routed_pass(weights(s), x_cal_ZOTD[s, o], cfg.top_k,
                                                      bias_ZOWE[s, o, ld], backend=cfg.backend,
                                                      router=cfg.router)
            out = routing.expert_idx_TK, routing.gate_TK, jnp.linalg.norm(f_TKD, axis=-1)
            return (*out, f_TKD) if cfg.needs_outputs else out

        # loops over conditions, not vmap: XLA:CPU runs the grouped matmuls of one condition at a
        # time about 1.5x faster than batched over all of them (likewise the table below)
        cal = [a.reshape(*bias_ZOWE.shape[:3], *a.shape[1:])
               for a in jax.lax.map(calibrate, jnp.arange(bias_ZOWE.shape[0] * n_offsets * n_loads))]
        logits_held = jax.vmap(jax.vmap(toy_layer.router_logits, in_axes=(None, 0)))(router_Z, x_held_ZOTD)

        n_held = x_held_ZOTD.shape[0] * x_held_ZOTD.shape[1]
        out = dict(cal_idx=cal[0], cal_gate=cal[1], cal_norm=cal[2], x_cal_mean=x_cal_ZOTD.mean(axis=2),
                   bias=bias_ZOWE, logits_held=logits_held)
        if cfg.needs_outputs:  # the routed pairs' outputs [Z, O, W, T, K, D]
            out["cal_out"] = cal[3]
        if _merges_read_table(cfg):  # else stage two tabulates each (seed, offset) as it goes
            def held_table(i):  # f_j(x) of every held-out token and expert of one (seed, offset)
                s, o = i // n_offsets, i % n_offsets
                return toy_layer.expert_output_table(weights(s), x_held_ZOTD[s, o])

            out["f_held"] = jax.lax.map(held_table, jnp.arange(n_held)).reshape(
                *x_held_ZOTD.shape[:2], cfg.n_experts, *x_held_ZOTD.shape[2:])
        if "hc_smoe" in cfg.merges:
            def mean_outputs(i):  # c_j = mean over the calibration tokens of f_j(x), one (seed, offset)
                return toy_layer.mean_expert_outputs(weights(i // n_offsets), x_cal_ZOTD[i // n_offsets, i % n_offsets])

            out["cal_mean_output"] = jax.lax.map(mean_outputs, jnp.arange(n_held)).reshape(
                *x_cal_ZOTD.shape[:2], cfg.n_experts, x_cal_ZOTD.shape[-1])
        if "m_smoe" in cfg.merges or "ream" in cfg.merges:
            out["logits_cal"] = logits_cal_ZOTE
        if "ream" in cfg.merges:
            def gated_outputs(i):  # m_j = sum_t softmax(l(x_t))_j f_j(x_t), one (seed, offset)
                s, o = i // n_offsets, i % n_offsets
                p_TE = jax.nn.softmax(logits_cal_ZOTE[s, o], axis=-1)
                return toy_layer.gated_expert_output_sums(weights(s), x_cal_ZOTD[s, o], p_TE)

            out["cal_gated_output"] = jax.lax.map(gated_outputs, jnp.arange(n_held)).reshape(
                *x_cal_ZOTD.shape[:2], cfg.n_experts, x_cal_ZOTD.shape[-1])
        return out

    return run


def _merges_read_table(cfg: Toy3Config) -> bool:
    """Whether the merges' variants or Eq. 6 need the whole held-out table [Z, O, E, T, D] (786 MB
    at the full settings): then stage one tabulates it once for them and stage two; without merges
    stage two tabulates each (seed, offset) in its loop, and the table is never whole."""
    return bool(cfg.merges) or cfg.eq6_pairs > 0 or bool(cfg.substitutes)


def _flat_seed_offset(a):
    """[Z, O, ...] -> [Z * O, ...] (sizes spelt out: -1 is undefined beside a zero-size axis)."""
    return a.reshape(a.shape[0] * a.shape[1], *a.shape[2:])


def _with_unpruned(masks_AE):
    """The masks led by variant 0, which keeps every expert (the full layer)."""
    import jax.numpy as jnp

    return jnp.concatenate([jnp.ones_like(masks_AE[..., :1, :]), masks_AE], axis=-2)


@functools.lru_cache(maxsize=8)
def _kth_values(cfg: Toy3Config):
    """A jitted function (logits [Z, O, T, E], bias [Z, O, W, E], masks [Z, O, W, A, E]) -> each held-out
    token's K-th largest biased score s + bias under the full layer and every mask [Z, O, W, 1 + A, T]."""
    import jax
    import jax.numpy as jnp

    from moejax.models import toy_layer
    from moejax.moe.topk import kth_largest

    @jax.jit
    def kth_values(logits, bias, masks):
        sel_ZOWET = jnp.swapaxes(toy_layer.router_scores(logits, cfg.router)[:, :, None] + bias[:, :, :, None], -1, -2)
        # the masks go into the network (one expert at a time), not onto a copy of the scores per variant
        return kth_largest(sel_ZOWET[:, :, :, None], cfg.top_k, keep_E=_with_unpruned(masks))

    return kth_values


@functools.lru_cache(maxsize=8)
def _stage_two(cfg: Toy3Config):
    """Route the held-out tokens under every kept set and measure the error of each variant.
    Returns a function (logits_held, bias, masks, f_held=None, w1=None, w2=None, x_held=None) ->
    (all-token relative error [..., A], per-token relative errors [..., A, T]); the median is taken
    on the host (numpy's partition-based median is far cheaper than a sort per variant on the device).
    Without the held-out table f_held (when the merges did not need stage one to make it whole,
    `_merges_read_table`), each (seed, offset)'s table is made here from the experts w1, w2 [Z, ...]
    and tokens x_held [Z, O, T, D], in the loop that uses it: a 25 MB table reused, where the
    whole one was 786 MB of fresh memory for every run.

    Routing is `route`'s choice computed without `lax.top_k` (moejax/moe/topk.py, tested equal):
    one jitted call finds each token's K-th largest biased score under every mask, a second reads
    off the chosen experts and combines their outputs from the held-out table. (Two calls, so the
    K-th values are materialised; fused into their consumer XLA recomputes them per expert.)
    The unpruned layer is routed the same way, as variant 0, so a variant that routes every token
    as the full layer does has an error of exactly zero.

    Softmax router: a pruned layer's softmax runs over its kept experts only (what `route` computes
    under a mask, and a physically pruned checkpoint computes). With `norm_topk_prob` neither the
    choice (the top K kept logits, softmax being increasing) nor the gates
    (exp(l_j) / sum over the K chosen of exp(l_i)) depends on that normaliser, so both are read off
    the full layer's softmax over all E; equal to `route` under the mask up to float rounding
    (tests/test_toy3.py checks against numpy's softmax over the kept experts).
    """
    import jax
    import jax.numpy as jnp

    from moejax.models import toy_layer
    from moejax.moe.dispatch import combine_from_table
    from moejax.moe.routing import gates
    from moejax.moe.topk import topk_indices_at_threshold

    router_cfg = toy_layer.router_config(cfg.top_k, cfg.router)

    def scores(logits):  # s of the unpruned layer: sigmoid, or softmax over all E
        return toy_layer.router_scores(logits, cfg.router)

    # per (seed, offset): [T, E] logits, [W, E] biases, [W, A, E] masks; the loads vmapped
    @functools.partial(jax.vmap, in_axes=(None, None, 0, 0, 0))
    def condition(f_ETD, s_TE, bias_E, masks_AE, kth_AT):
        idx_ATK = topk_indices_at_threshold((s_TE + bias_E).T, kth_AT, cfg.top_k, keep_E=_with_unpruned(masks_AE))
        gate_ATK = gates(s_TE, idx_ATK, router_cfg)
        # the unpruned output in its own call: sliced off the variants' outputs, XLA
        # recomputed it for every variant (4x slower)
        y_TD = combine_from_table(gate_ATK[0], idx_ATK[0], f_ETD)
        err_sq_AT = jnp.sum((combine_from_table(gate_ATK[1:], idx_ATK[1:], f_ETD) - y_TD) ** 2, axis=-1)
        y_sq_T = jnp.sum(y_TD ** 2, axis=-1)
        return err_sq_AT.sum(axis=-1) / y_sq_T.sum(), err_sq_AT / y_sq_T

    kth_values = _kth_values(cfg)

    @jax.jit
    def errors(logits, bias, masks, kth, f, w1, w2, x):
        n_offsets = logits.shape[1]

        def seed_offset(args):
            i, logits_TE, bias_WE, masks_WAE, kth_WAT, f_ETD, x_TD = args
            if f_ETD is None:
                s = i // n_offsets
                f_ETD = toy_layer.expert_output_table({"w1": w1[s], "w2": w2[s]}, x_TD)
            return condition(f_ETD, scores(logits_TE), bias_WE, masks_WAE, kth_WAT)

        lead = logits.shape[:2]  # one (seed, offset) at a time bounds memory: [W, A, T, D] outputs
        flat = jax.tree.map(_flat_seed_offset, (logits, bias, masks, kth, f, x))
        rel, per_token = jax.lax.map(seed_offset, (jnp.arange(lead[0] * lead[1]), *flat))
        return rel.reshape(*lead, *rel.shape[1:]), per_token.reshape(*lead, *per_token.shape[1:])

    def run(logits, bias, masks, f_held=None, w1=None, w2=None, x_held=None):
        if f_held is not None:
            w1 = w2 = x_held = None
        return errors(logits, bias, masks, kth_values(logits, bias, masks), f_held, w1, w2, x_held)

    def compile_for(n_seeds: int) -> None:
        """Compile both programs for a batch of n_seeds seeds, from the shapes alone (`run`'s calls
        then find them compiled)."""
        O, W, T, E = len(cfg.offsets), len(cfg.loads), cfg.n_heldout, cfg.n_experts
        D, F = cfg.d_model, cfg.d_hidden

        def f32(*shape):
            return jax.ShapeDtypeStruct((n_seeds, *shape), jnp.float32)

        logits, bias = f32(O, T, E), f32(O, W, E)
        masks = jax.ShapeDtypeStruct((n_seeds, O, W, len(layout(cfg).pruned), E), jnp.bool_)
        kth = jax.eval_shape(kth_values, logits, bias, masks)
        kth_values.lower(logits, bias, masks).compile()
        table = (f32(O, E, T, D), None, None, None) if _merges_read_table(cfg) else (
            None, f32(E, D, F), f32(E, F, D), f32(O, T, D))
        errors.lower(logits, bias, masks, kth, *table).compile()

    run.compile_for = compile_for
    return run


def _compile_ahead(cfg: Toy3Config, batch_sizes) -> threading.Thread | None:
    """Compile stage two on a second thread while the main thread traces, compiles and runs stage
    one (XLA's compilation releases the GIL and keeps about one core busy, so on two cores most of
    the second compilation overlaps; only tracing contends). JAX's cache hands the compiled programs
    to `_stage_two`'s calls. One device only (a mesh's programs are compiled under its context).
    Returns the thread to join before stage two, or None."""
    if MeshConfig(cfg.mesh_data, cfg.mesh_expert).n_devices > 1:
        return None

    def work():
        try:
            for n_seeds in sorted(set(batch_sizes)):
                _stage_two(cfg).compile_for(n_seeds)
        except Exception:  # the main thread's call compiles (and raises) as usual
            log.debug("toy3: compiling stage two ahead failed", exc_info=True)

    # not a daemon: the interpreter waits for it at exit (a job killed by a signal included), since
    # a thread still inside XLA while Python finalises aborts the process
    thread = threading.Thread(target=work, name="toy3-compile-ahead")
    thread.start()
    return thread


@functools.lru_cache(maxsize=8)
def _stage_merges(cfg: Toy3Config):
    """The merges' variants, as `_stage_two` evaluates the pruning ones: tabulate the merged experts
    on the held-out tokens, route the held-out tokens and measure each variant's error. Returns a
    function (f_held, logits_held, bias, masks, rows, x_held, merged) -> (sum_t ||y'_t - y_t||^2
    [..., A], per-token relative errors ||y'_t - y_t||^2 / ||y_t||^2 [..., A, T], ||y_t||^2 [..., T],
    and the full layer's routing, experts and gates [..., T, K]).

    A variant is an expert map. The merges' shrunk forms are routed under their masks
    [..., n_shrunk, E] (`kth_values` as in `_stage_two`); the rest (tied forms, Eq. 6 pairs) keep
    every slot, so they take the full layer's routing. rows [..., A, E]: the row of the table
    [E + W * n_slots, T, D] that each slot computes with: the layer's own experts (f_held), then
    each load's merged experts (merged: {"w1": [..., W, n_slots, D, F], "w2": ...}, None when there
    are none), tabulated here once per (seed, offset).

    The batch of variants is led by the full layer (every slot its own row), its reference, computed
    by the same code as they are: a variant that routes and computes a token as the full layer does
    (a merge of singletons) has an error of exactly zero. (Computed apart, as `_stage_two` does,
    the reference came out of a differently fused loop, 1 ulp off, once the merged table was in the
    program; which is also why the merges are a program of their own, leaving the pruning one as it
    was.) The batch's outputs are materialised (the barrier): sliced off them inside the error's
    fusion, XLA recomputed the reference for every variant (1.3x slower).
    """
    import jax
    import jax.numpy as jnp

    from moejax.models import toy_layer
    from moejax.moe.dispatch import combine_from_table
    from moejax.moe.routing import gates
    from moejax.moe.topk import topk_indices_at_threshold

    router_cfg = toy_layer.router_config(cfg.top_k, cfg.router)
    n_shrunk = len(layout(cfg).merged)
    kth_values = _kth_values(cfg)

    # the table (rows: the layer's experts, then the merged ones) and logits shared by the loads;
    # [W, ...] biases, masks, K-th values, rows
    @functools.partial(jax.vmap, in_axes=(None, None, 0, 0, 0, 0))
    def condition(table_ETD, logits_TE, bias_E, masks_AE, kth_AT, rows_AE):
        s_TE = toy_layer.router_scores(logits_TE, cfg.router)
        idx_ATK = topk_indices_at_threshold((s_TE + bias_E).T, kth_AT, cfg.top_k, keep_E=_with_unpruned(masks_AE))
        gate_ATK = gates(s_TE, idx_ATK, router_cfg)
        same = (rows_AE.shape[0] - n_shrunk,) + idx_ATK.shape[1:]
        slot_ATK = jnp.concatenate([idx_ATK, jnp.broadcast_to(idx_ATK[0], same)])
        gate_v_ATK = jnp.concatenate([gate_ATK, jnp.broadcast_to(gate_ATK[0], same)])
        rows_v_AE = jnp.concatenate([jnp.arange(rows_AE.shape[1], dtype=rows_AE.dtype)[None], rows_AE])
        row_ATK = jnp.take_along_axis(rows_v_AE[:, None, :], slot_ATK, axis=-1)  # ExpertMap.apply
        y_ATD = jax.lax.optimization_barrier(combine_from_table(gate_v_ATK, row_ATK, table_ETD))
        y_TD = y_ATD[0]
        err_sq_AT = jnp.sum((y_ATD[1:] - y_TD) ** 2, axis=-1)
        y_sq_T = jnp.sum(y_TD ** 2, axis=-1)
        return err_sq_AT.sum(axis=-1), err_sq_AT / y_sq_T, y_sq_T, idx_ATK[0], gate_ATK[0]

    @jax.jit
    def errors(f, logits, bias, masks, kth, rows, x, merged):
        def seed_offset(args):
            f_ETD, x_TD, merged_W, *per_load = args
            table_ETD = f_ETD
            if merged_W is not None:  # every load's merged experts, after the layer's own
                flat = {k: w.reshape(-1, *w.shape[2:]) for k, w in merged_W.items()}
                table_ETD = jnp.concatenate([f_ETD, toy_layer.expert_output_table(flat, x_TD)])
            return condition(table_ETD, *per_load)

        lead = f.shape[:2]  # one (seed, offset) at a time bounds memory: [W, A, T, D] outputs
        flat = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), (f, x, merged, logits, bias, masks, kth, rows))
        out = jax.lax.map(seed_offset, flat)
        return jax.tree.map(lambda a: a.reshape(*lead, *a.shape[1:]), out)

    def run(f, logits, bias, masks, rows, x=None, merged=None):
        return errors(f, logits, bias, masks, kth_values(logits, bias, masks), rows, x, merged)

    return run


@functools.lru_cache(maxsize=8)
def _stage_substitutes(cfg: Toy3Config):
    """MoNE's variants: every router slot remains, so a held-out token is routed as the full layer
    routes it, and a chosen slot whose expert was removed (a novice) returns its constant instead
    of f_j(x): y'_t - y_t = sum_k g_tk novice[i_tk] (c_{i_tk} - f_{i_tk}(x_t)). Returns a jitted
    function (f_held [Z, O, E, T, D], logits_held, bias [Z, O, W, E], novice [Z, O, W, A, E],
    constants [Z, O, W, E, D]) -> (sum_t ||y'_t - y_t||^2 [..., A], per-token relative errors
    [..., A, T], ||y_t||^2 [..., T])."""
    import jax
    import jax.numpy as jnp

    from moejax.models import toy_layer
    from moejax.moe.routing import route

    router_cfg = toy_layer.router_config(cfg.top_k, cfg.router)

    @functools.partial(jax.vmap, in_axes=(None, None, 0, 0, 0))   # over the loads
    def condition(f_ETD, logits_TE, bias_E, novice_AE, c_ED):
        r = route(logits_TE, router_cfg, bias_E if cfg.has_balance_bias else None)
        idx_TK, gate_TK = r.expert_idx_TK, r.gate_TK
        f_TKD = f_ETD[idx_TK, jnp.arange(idx_TK.shape[0])[:, None]]
        y_TD = jnp.einsum("tk,tkd->td", gate_TK, f_TKD)
        swap_ATK = novice_AE[:, idx_TK] * gate_TK
        err_AT = jnp.sum(jnp.einsum("atk,tkd->atd", swap_ATK, c_ED[idx_TK] - f_TKD) ** 2, axis=-1)
        y_sq_T = jnp.sum(y_TD ** 2, axis=-1)
        return err_AT.sum(axis=-1), err_AT / y_sq_T, y_sq_T

    @jax.jit
    def run(f, logits, bias, novice, constants):
        lead = f.shape[:2]   # one (seed, offset) at a time
        flat = jax.tree.map(_flat_seed_offset, (f, logits, bias, novice, constants))
        out = jax.lax.map(lambda args: condition(*args), flat)
        return jax.tree.map(lambda a: a.reshape(*lead, *a.shape[1:]), out)

    return run


def run(cfg: Toy3Config, progress=None, job_dir=None):
    """Run toy3; returns (tidy pandas DataFrame, timings dict)."""
    cfg.validate()
    with mesh_context(MeshConfig(cfg.mesh_data, cfg.mesh_expert)):
        return _run(cfg, progress)


def _import_in_background(*names: str) -> None:
    """Import modules that the job needs only at its end on a second thread: pandas and pyarrow
    (~0.7 s) then load while XLA compiles and runs stage one, which release the GIL, instead of
    before the job starts. A failed import is left for the main thread's own import to raise."""
    missing = [name for name in names if name not in sys.modules]

    def work():
        try:
            for name in missing:
                importlib.import_module(name)
        except Exception:
            log.debug("toy3: importing %s in the background failed", missing, exc_info=True)

    if missing:
        threading.Thread(target=work, name="toy3-imports").start()  # not a daemon: see _compile_ahead


def _run(cfg: Toy3Config, progress=None):
    import jax

    from moejax.parallel.distributed import to_host  # jax.device_get, gathering across processes
    from moejax.scoring.scores import compute_scores, stats_from_pairs
    from moejax.scoring.select import select_kept

    keeps = cfg.keep_counts()
    lay = layout(cfg)
    n_pruned, n_merged, n_experts = len(lay.pruned), len(lay.merged), cfg.n_experts
    n_rel = lay.n_masked + n_merged  # variants reported by rel_error; the Eq. 6 pairs follow them
    n_merge_variants = 2 * n_merged + cfg.eq6_pairs  # shrunk forms, tied forms, pairs
    _import_in_background("pandas", "pyarrow.parquet")  # for the results table, at the end
    all_seeds = np.arange(cfg.seed, cfg.seed + cfg.seeds)
    batches = [all_seeds[i:i + cfg.seed_batch] for i in range(0, len(all_seeds), cfg.seed_batch)]
    rows, timings = [], {"stage_one_s": 0.0, "host_s": 0.0, "stage_two_s": 0.0}
    ahead = _compile_ahead(cfg, [len(b) for b in batches])
    for batch in batches:
        conditions = list(itertools.product(enumerate(batch), enumerate(cfg.offsets), enumerate(cfg.loads)))
        t0 = time.perf_counter()
        drawn = draw_inputs(cfg, batch)
        stacked = {k: np.stack([d[k] for d in drawn]) for k in ("router", "w1", "w2", "x_cal", "x_held")}
        one = jax.block_until_ready(_stage_one(cfg)(*stacked.values()))
        host = to_host({k: v for k, v in one.items() if k not in ("f_held", "logits_held")})
        host["router"] = stacked["router"]
        t1 = time.perf_counter()
        lead = (len(batch), len(cfg.offsets), len(cfg.loads))
        masks = np.zeros((*lead, lay.n_masked, n_experts), bool)  # pruning, then the shrunk forms
        weight_rows = np.broadcast_to(np.arange(n_experts, dtype=np.int32), (*lead, n_merge_variants, n_experts)).copy()
        merged = ({k: np.zeros((*lead, lay.n_slots, *stacked[k].shape[2:]), np.float32) for k in ("w1", "w2")}
                  if lay.n_slots else None)
        pairs, clustering = {}, {}
        alignments = {}   # per seed (its experts): M-SMoE's (leader, member) alignments, shared by every offset, load and keep
        n_sub = len(lay.substituted)
        novice = np.zeros((*lead, n_sub, n_experts), bool)
        constants = np.zeros((*lead, n_experts, stacked["x_cal"].shape[-1]), np.float32) if n_sub else None
        for (s, seed), (o, offset), (l_, load) in conditions:
            base = dict(offset=offset, load=load, seed=int(seed))
            stats = stats_from_pairs(host["cal_idx"][s, o, l_], host["cal_gate"][s, o, l_],
                                     host["cal_norm"][s, o, l_], host["x_cal_mean"][s, o],
                                     host["router"][s], host["bias"][s, o, l_] if cfg.has_balance_bias else None,
                                     seed=int(seed), layer=0,  # aimer reads the experts' w1, w2
                                     expert_weights=[stacked["w1"][s], stacked["w2"][s]] if "aimer" in cfg.scores
                                     else None, out_TKH=host["cal_out"][s, o, l_] if cfg.needs_outputs else None)
            scores = compute_scores(stats, cfg.scores)
            if n_sub:  # MoNE: each named score's kept set; every other slot returns its mean routed output
                sub_scores = compute_scores(stats, cfg.substitutes)
                for v, (name, keep) in enumerate(lay.substituted):
                    novice[s, o, l_, v] = ~select_kept(sub_scores[name], keep)
                constants[s, o, l_] = stats.mean_output_EH
            frequency_kept = {keep: select_kept(stats.counts_E, keep) for keep in keeps}
            usage = np.sort(stats.counts_E)[::-1]
            rows.append({**base, "score": None, "keep": None, "metric": "top16_share",
                         "value": float(usage[:16].sum() / usage.sum())})
            for v, (name, keep) in enumerate(lay.pruned):
                masks[s, o, l_, v] = kept = select_kept(scores[name], keep)
                rows.append({**base, "score": name, "keep": keep, "metric": "overlap_frequency",
                             "value": float(np.sum(kept & frequency_kept[keep]))})
            first_row = n_experts + l_ * lay.n_slots  # this load's merged experts in the table
            w1, w2 = stacked["w1"][s], stacked["w2"][s]
            if (s, o) not in clustering:  # what the clusters read, per (seed, offset)
                logits = np.asarray(host["logits_cal"][s, o], np.float64) if "logits_cal" in host else None
                clustering[s, o] = {"mean_output": host["cal_mean_output"][s, o] if "cal_mean_output" in host else None,
                                    "gram": None if logits is None else logits.T @ logits}
                if "ream" in cfg.merges:
                    clustering[s, o].update(_ream_inputs(host["cal_gated_output"][s, o], clustering[s, o]["gram"],
                                                         stacked["x_cal"][s, o], int(seed)))
            inputs = clustering[s, o]
            if "ream" in cfg.merges:  # its centroid score, under this load's routing
                ream_scores = compute_scores(stats, [cfg.merge_score])[cfg.merge_score]
            maps = []  # (variants, slot of its first merged expert, MergeMap)
            for m, (method, keep) in enumerate(lay.merged):
                extra = {}   # the method's own merge arguments
                if method == "hc_smoe":  # the same clusters under either load (only the weights' freq differ)
                    if keep not in inputs:
                        inputs[keep] = merge_labels(method, keep, stats.counts_E, inputs["mean_output"])
                    labels = inputs[keep]
                elif method == "ream":
                    labels = ream_labels(keep, ream_scores, inputs["similarity"], cfg.group_size)
                    extra = dict(scores_E=ream_scores, act_inputs_NH=inputs["act_inputs"], seed=int(seed))
                else:
                    labels = merge_labels(method, keep, stats.counts_E, logit_gram_EE=inputs["gram"])
                    extra = dict(alignments=alignments.setdefault(s, {}))
                mm = merge_map(method, labels, stats.counts_E, w1, w2, first_row + lay.first_slot[m], **extra)
                masks[s, o, l_, n_pruned + m, mm.leaders] = True  # shrunk: only the leaders' slots
                maps.append(([m, n_merged + m], lay.first_slot[m], mm))
            pairs[s, o, l_] = coroute_pairs(host["cal_idx"][s, o, l_], n_experts, cfg.eq6_pairs)
            for p, pair in enumerate(pairs[s, o, l_]):
                slot = lay.first_slot[-1] + p
                maps.append(([2 * n_merged + p], slot, pair_map(pair, stats.counts_E, w1, w2, first_row + slot)))
            for variants, first_slot, mm in maps:
                weight_rows[s, o, l_, variants] = mm.rows_E
                for slot, weights in enumerate(mm.experts, start=first_slot):
                    for k in merged:
                        merged[k][s, o, l_, slot] = weights[k]
        t2 = time.perf_counter()
        if ahead is not None:
            ahead.join()
        rel_all, rel_per_token = to_host(jax.block_until_ready(_stage_two(cfg)(
            one["logits_held"], one["bias"], masks[..., :n_pruned, :], f_held=one.get("f_held"),
            w1=stacked["w1"], w2=stacked["w2"], x_held=stacked["x_held"])))
        rel_median = np.median(rel_per_token, axis=-1)
        if n_merge_variants:
            err_sum, merge_per_token, y_sq, idx_held, gate_held = to_host(jax.block_until_ready(
                _stage_merges(cfg)(one["f_held"], one["logits_held"], one["bias"], masks[..., n_pruned:, :],
                                   weight_rows, None if merged is None else stacked["x_held"], merged)))
            rel_all = np.concatenate([rel_all, err_sum[..., :2 * n_merged] / y_sq.sum(axis=-1)[..., None]], axis=-1)
            merge_median = np.median(merge_per_token[..., :2 * n_merged, :], axis=-1)
            rel_median = np.concatenate([rel_median, merge_median], axis=-1)
        if n_sub:
            err_sub, sub_per_token, sub_y_sq = to_host(jax.block_until_ready(_stage_substitutes(cfg)(
                one["f_held"], one["logits_held"], one["bias"], novice, constants)))
            sub_rel, sub_median = err_sub / sub_y_sq.sum(axis=-1)[..., None], np.median(sub_per_token, axis=-1)
        t3 = time.perf_counter()
        f_held = to_host(one["f_held"]) if cfg.eq6_pairs else None  # no copy on CPU (Eq. 6's prediction)
        for (s, seed), (o, offset), (l_, load) in conditions:
            for v, (name, keep) in enumerate(lay.labels(pairs[s, o, l_])):
                base = dict(offset=offset, load=load, seed=int(seed), score=name, keep=keep)
                if v < n_rel:
                    rows.append({**base, "metric": "rel_error", "value": float(rel_all[s, o, l_, v])})
                    rows.append({**base, "metric": "rel_error_median", "value": float(rel_median[s, o, l_, v])})
                    continue
                err_sq_T = merge_per_token[s, o, l_, v - n_pruned] * y_sq[s, o, l_].astype(np.float64)
                for metric, value in eq6_metrics(pairs[s, o, l_][v - n_rel], idx_held[s, o, l_], gate_held[s, o, l_],
                                                 f_held[s, o], err_sq_T).items():
                    rows.append({**base, "metric": metric, "value": value})
            for v, (name, keep) in enumerate(lay.substituted):
                base = dict(offset=offset, load=load, seed=int(seed), score=f"{name}:substituted", keep=keep)
                rows.append({**base, "metric": "rel_error", "value": float(sub_rel[s, o, l_, v])})
                rows.append({**base, "metric": "rel_error_median", "value": float(sub_median[s, o, l_, v])})
        timings["stage_one_s"] += t1 - t0
        timings["host_s"] += t2 - t1 + time.perf_counter() - t3
        timings["stage_two_s"] += t3 - t2
        if progress is not None:
            progress(len(batch))
    import pandas as pd

    df = pd.DataFrame(rows, columns=["offset", "load", "seed", "score", "keep", "metric", "value"])
    df["keep"] = df["keep"].astype("Int64")
    return df, timings


def summary_table(df):
    """Mean +- std over seeds of rel_error, rows (offset, load, score), one column per keep; within a
    condition the scores first, then the merges ("method:router form")."""
    err = df[df.metric == "rel_error"]
    agg = err.groupby(["offset", "load", "score", "keep"])["value"].agg(["mean", "std"]).reset_index()
    agg["cell"] = [f"{m:.3f} ± {0.0 if np.isnan(s) else s:.3f}" for m, s in zip(agg["mean"], agg["std"])]
    table = agg.pivot(index=["offset", "load", "score"], columns="keep", values="cell")
    table.columns = [f"keep={k}" for k in table.columns]
    return table.iloc[sorted(range(len(table)), key=lambda i: (*table.index[i][:2], ":" in table.index[i][2]))]


"""Expert scores, one small function each, beside the equation it implements (SPEC section 2).

Every score reads a `LayerStats` (the per-layer sums of one calibration pass, kept in float64 so
rankings do not depend on summation order) and returns float64 [E]. Higher = keep.

To add a score: write `def my_score(st: LayerStats) -> np.ndarray`, decorate it with
`@register("my_score")`, and it is available to every experiment by name.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from moejax.errors import ConfigError


@dataclasses.dataclass
class LayerStats:
    """Sufficient statistics of one MoE layer from one calibration pass.

    counts_E:         |X_j|, tokens whose chosen experts contain j
    gate_norm_sum_E:  sum_{x in X_j} g_j(x) * ||f_j(x)||_2   (model's real gate)
    norm_sum_E:       sum_{x in X_j} ||f_j(x)||_2
    mean_input_D:     mu, the mean router input over calibration tokens
    router_ED:        W_router (float64 copy)
    bias_E:           e_score_correction_bias
    seed, layer:      what `random` is seeded by
    """

    counts_E: np.ndarray
    gate_norm_sum_E: np.ndarray
    norm_sum_E: np.ndarray
    mean_input_D: np.ndarray
    router_ED: np.ndarray
    bias_E: np.ndarray
    seed: int = 0
    layer: int = 0

    @property
    def n_experts(self) -> int:
        return self.router_ED.shape[0]


def stats_from_pairs(expert_idx_TK, gate_TK, out_norm_TK, mean_input_D, router_ED, bias_E, seed=0, layer=0,
                     token_mask_T=None) -> LayerStats:
    """Sum per-pair quantities of a routed pass into `LayerStats`, in float64 (np.bincount sums in
    float64), so the ranking of near-equal experts is reproducible."""
    idx = np.asarray(expert_idx_TK)
    keep_T = np.ones(idx.shape[0], bool) if token_mask_T is None else np.asarray(token_mask_T, bool)
    n_experts = np.asarray(router_ED).shape[0]
    flat = idx[keep_T].ravel()
    gate = np.asarray(gate_TK, np.float64)[keep_T].ravel()
    norm = np.asarray(out_norm_TK, np.float64)[keep_T].ravel()
    return LayerStats(
        counts_E=np.bincount(flat, minlength=n_experts).astype(np.float64),
        gate_norm_sum_E=np.bincount(flat, weights=gate * norm, minlength=n_experts),
        norm_sum_E=np.bincount(flat, weights=norm, minlength=n_experts),
        mean_input_D=np.asarray(mean_input_D, np.float64),
        router_ED=np.asarray(router_ED, np.float64),
        bias_E=np.asarray(bias_E, np.float64),
        seed=int(seed), layer=int(layer))


SCORES: dict[str, Callable[[LayerStats], np.ndarray]] = {}


def register(name: str):
    def deco(fn):
        SCORES[name] = fn
        return fn
    return deco


@register("frequency")
def frequency(st: LayerStats) -> np.ndarray:
    """|X_j|"""
    return st.counts_E.copy()


@register("reap")
def reap(st: LayerStats) -> np.ndarray:
    """(1/|X_j|) sum_{x in X_j} g_j(x) ||f_j(x)||_2   (REAP, arXiv 2510.13999 Eq. 9); 0 if X_j is empty."""
    return np.divide(st.gate_norm_sum_E, st.counts_E, out=np.zeros_like(st.gate_norm_sum_E),
                     where=st.counts_E > 0)


@register("ean")
def ean(st: LayerStats) -> np.ndarray:
    """sum_{x in X_j} ||f_j(x)||_2   (expert activation norm, no gate)"""
    return st.norm_sum_E.copy()


@register("w_mean")
def w_mean(st: LayerStats) -> np.ndarray:
    """W_router[j] . mu   (the expected logit)"""
    return st.router_ED @ st.mean_input_D


@register("bias")
def bias(st: LayerStats) -> np.ndarray:
    """-e_score_correction_bias[j]   (lowest bias = busiest in training = keep)"""
    return -st.bias_E


@register("signed")
def signed(st: LayerStats) -> np.ndarray:
    """sum_d W_router[j, d]   (signed row sum)"""
    return st.router_ED.sum(axis=1)


@register("l1")
def l1(st: LayerStats) -> np.ndarray:
    """sum_d |W_router[j, d]|   (compressed-tensors MagnitudeExpertPruner default)"""
    return np.abs(st.router_ED).sum(axis=1)


@register("random")
def random(st: LayerStats) -> np.ndarray:
    """Uniform random, seeded per (seed, layer)."""
    return np.random.default_rng([st.seed, st.layer]).random(st.n_experts)


def check_score_names(names) -> list[str]:
    names = list(names)
    unknown = [n for n in names if n not in SCORES]
    if unknown:
        raise ConfigError(f"unknown score(s) {unknown}; valid scores: {', '.join(sorted(SCORES))}")
    if not names:
        raise ConfigError(f"no scores requested; valid scores: {', '.join(sorted(SCORES))}")
    return names


def compute_scores(st: LayerStats, names) -> dict[str, np.ndarray]:
    """{name: float64 [E]} for the requested scores."""
    return {n: np.asarray(SCORES[n](st), np.float64) for n in check_score_names(names)}

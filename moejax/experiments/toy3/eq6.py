"""The check of the REAP paper's Eq. 6 in toy3 (SPEC section 8): the expert pairs routed together
most often (`coroute_pairs`) are merged one at a time under the tied router, and each pair's
measured increase in error is set against the formula's prediction (`eq6_metrics`). Numpy, float64."""

from __future__ import annotations

import numpy as np


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
    hit_i, hit_j = idx_TK == i, idx_TK == j
    changed = np.flatnonzero(hit_i.any(axis=1) | hit_j.any(axis=1))   # the tokens routed to i or j
    hit_i, hit_j, gate = hit_i[changed], hit_j[changed], gate_TK[changed]
    g_i, g_j = ((gate * hit).sum(axis=1, dtype=np.float64) for hit in (hit_i, hit_j))
    d = np.sum((f_ETD[i, changed].astype(np.float64) - f_ETD[j, changed]) ** 2, axis=1)
    both = hit_i.any(axis=1) & hit_j.any(axis=1)
    return {"eq6_measured": float(np.sum(err_sq_T, dtype=np.float64)), "eq6_predicted": eq6_prediction(g_i, g_j, d),
            "eq6_measured_both": float(np.sum(err_sq_T[changed[both]], dtype=np.float64)),
            "eq6_predicted_both": eq6_prediction(g_i[both], g_j[both], d[both])}

"""SHAPE's quality-coverage allocation (arXiv 2606.09886, code Alizen-1009/Shapley-Moe,
`pruning/methods/select_by_shapley.py`, its default `alpha_per_layer`): each layer keeps the
smallest prefix of its experts, by descending Shapley value (`moejax.scoring.scores.shapley`),
that holds a share alpha of the layer's Shapley mass; one alpha for every layer, found by bisection
so that the counts sum to the total.

    share_l   = phi_l / sum(phi_l)  (`normalised_shares`: uniform when a layer's phi sum is 0)
    cover_l(a) = the smallest c >= 1 with  sum of the c largest shares >= a
    count_l(a) = min(E_l, max(top_k, cover_l(a)))

count_l is a non-decreasing step function of alpha, so the total is too. The bisection narrows
[lo, hi] (total(lo) < total <= total(hi)) until hi - lo is below float resolution; where several
layers step at the same alpha (equal cumulative shares), total(hi) may still pass the total, and
the places left are given to the layers that step there, the lower layer first. SHAPE stops within
1% of the keep rate and has no floor (a layer may keep one expert); here the total is exact and
every layer keeps at least top_k, as routing needs.
"""

from __future__ import annotations

import numpy as np

from moejax.allocation.method import Allocation, Budget, check_statistic, register
from moejax.allocation.threshold import normalised_shares

ITERATIONS = 200   # bisection steps: the interval halves each step, far below float resolution


def coverage_counts(shares: dict, budget: Budget, alpha: float) -> dict[int, int]:
    """{layer: count_l(alpha)} for each layer's shares (float64 [E], summing to 1)."""
    out = {}
    for layer, share in shares.items():
        cumulative = np.cumsum(np.sort(share)[::-1])
        cover = int(np.searchsorted(cumulative, alpha, side="left")) + 1   # the first prefix reaching alpha
        out[layer] = min(budget.n_experts[layer], max(budget.minimum, cover))
    return out


def shape_counts(phi: dict, budget: Budget) -> dict[int, int]:
    """{layer: count} under SHAPE's coverage rule, summing exactly to budget.total (module doc)."""
    shares = {l: normalised_shares(phi[l]) for l in budget.layers}
    lo, hi = 0.0, 2.0    # total(0) is the floor (<= the total); total(2) keeps everything (>= the total)
    at_lo, at_hi = coverage_counts(shares, budget, lo), coverage_counts(shares, budget, hi)
    if sum(at_lo.values()) == budget.total:   # keep is the floor
        return at_lo
    for _ in range(ITERATIONS):
        mid = (lo + hi) / 2
        if mid in (lo, hi):
            break
        at_mid = coverage_counts(shares, budget, mid)
        if sum(at_mid.values()) < budget.total:
            lo, at_lo = mid, at_mid
        else:
            hi, at_hi = mid, at_mid
    counts, left = dict(at_lo), budget.total - sum(at_lo.values())
    for layer in budget.layers:   # the layers stepping between lo and hi, lower layer first
        step = min(left, at_hi[layer] - at_lo[layer])
        counts[layer] += step
        left -= step
    return counts


@register("shape")
class Shape(Allocation):
    """SHAPE's coverage of the Shapley mass, one alpha for every layer (`shape_counts`)."""

    reads = "shapley"

    def counts(self, budget: Budget, statistic=None, fitness=None) -> dict[int, int]:
        phi = check_statistic(statistic, budget, self.name)
        return shape_counts(phi, budget)

"""The two allocations by threshold (issue 18, item 5):

    uniform   every layer keeps `keep`
    global    the same total, keep x L, spread by one threshold: M-SMoE's rule on normalised
              frequency, and for any score a global rank of per-layer normalised scores
"""

from __future__ import annotations

import numpy as np

from moejax.allocation.method import RANKING, Allocation, Budget, check_statistic, register


def normalised_shares(score_E) -> np.ndarray:
    """A layer's scores as shares that sum to 1:

        s_norm = (s - m) / sum(s - m),   m = min(min(s), 0)

    (for non-negative scores such as frequency, s / sum(s); the shift makes signed scores usable);
    uniform 1/E when sum(s - m) = 0."""
    s = np.asarray(score_E, np.float64)
    shifted = s - min(s.min(), 0.0)
    total = shifted.sum()
    return shifted / total if total > 0 else np.full(len(s), 1.0 / len(s))


def global_counts(scores: dict[int, np.ndarray], budget: Budget) -> dict[int, int]:
    """{layer: count} from one global threshold, the counts summing to the budget's total (keep x L
    for L layers keeping keep each; layers of different sizes E_l: the sum of their keeps).

    Each layer's scores become shares (`normalised_shares`). Every layer first gets its top_k floor
    (its top_k largest shares, ties to the lower expert index); the remaining keep x L - top_k x L
    places go to the largest of all remaining shares across layers (ties: the lower layer, then the
    lower expert index):

        count_l = top_k + #{e outside l's floor : (l, e) among the keep x L - top_k x L largest
                            s_norm[l', e'] over all (l', e') outside the floors}

    (never more than E_l: each place is one expert)."""
    top_k = budget.minimum
    layers = budget.layers
    counts = dict.fromkeys(layers, int(top_k))
    share, layer_idx, expert = [], [], []
    for i, layer in enumerate(layers):
        s = normalised_shares(scores[layer])
        rest = np.argsort(-s, kind="stable")[top_k:]     # after the floor, best first
        share.append(s[rest])
        layer_idx.append(np.full(len(rest), i))
        expert.append(rest)
    share, layer_idx, expert = map(np.concatenate, (share, layer_idx, expert))
    order = np.lexsort((expert, layer_idx, -share))[:budget.total - top_k * len(layers)]
    for i, n in zip(*np.unique(layer_idx[order], return_counts=True)):
        counts[layers[i]] += int(n)
    return counts


@register("uniform")
class Uniform(Allocation):
    """Every layer keeps what was asked of it."""

    def counts(self, budget: Budget, statistic=None, fitness=None) -> dict[int, int]:
        return dict(budget.keep)


@register("global")
class Global(Allocation):
    """One threshold over the layers' normalised ranking scores (`global_counts`)."""

    reads = RANKING

    def counts(self, budget: Budget, statistic=None, fitness=None) -> dict[int, int]:
        return global_counts(check_statistic(statistic, budget, self.name), budget)

"""How many experts (or clusters) each MoE layer keeps: the same number everywhere, or one global
threshold over the layers' normalised scores (issue 18, item 5).

    uniform   every layer keeps `keep`
    global    the same total, keep x L, spread by one threshold: M-SMoE's rule on normalised
              frequency, and for any score a global rank of per-layer normalised scores

The caller keeps each layer's `count` best experts (`moejax.scoring.select.select_kept`) or merges
it into `count` clusters.
"""

from __future__ import annotations

import numpy as np

from moejax.errors import ConfigError

ALLOCATIONS = ("uniform", "global")


def normalised_shares(score_E) -> np.ndarray:
    """A layer's scores as shares that sum to 1:

        s_norm = (s - m) / sum(s - m),   m = min(min(s), 0)

    (for non-negative scores such as frequency, s / sum(s); the shift makes signed scores usable);
    uniform 1/E when sum(s - m) = 0."""
    s = np.asarray(score_E, np.float64)
    shifted = s - min(s.min(), 0.0)
    total = shifted.sum()
    return shifted / total if total > 0 else np.full(len(s), 1.0 / len(s))


def _check(scores_by_layer: dict, keep: int, top_k: int) -> dict[int, np.ndarray]:
    if not scores_by_layer:
        raise ConfigError("allocation: no MoE layers to allocate a budget over")
    if isinstance(keep, bool) or not isinstance(keep, (int, np.integer)):
        raise ConfigError(f"allocation: keep={keep!r} must be a per-layer count (int)")
    scores = {}
    for layer, s in sorted(scores_by_layer.items()):
        s = np.asarray(s, np.float64)
        if s.ndim != 1:
            raise ConfigError(f"allocation: layer {layer}'s scores must be a vector [E], got shape {s.shape}")
        if not np.isfinite(s).all():
            raise ConfigError(f"allocation: layer {layer}'s scores hold NaN or infinity at experts "
                              f"{np.flatnonzero(~np.isfinite(s)).tolist()[:16]}")
        if not top_k <= keep <= len(s):
            raise ConfigError(f"allocation: keep={keep} per layer must lie in [top_k, E] = [{top_k}, {len(s)}] "
                              f"(layer {layer}: every token routes to top_k={top_k} experts)")
        scores[layer] = s
    return scores


def global_counts(scores_by_layer: dict[int, np.ndarray], keep: int, top_k: int) -> dict[int, int]:
    """{layer: count} from one global threshold, the counts summing to keep x L (L layers).

    Each layer's scores become shares (`normalised_shares`). Every layer first gets its top_k floor
    (its top_k largest shares, ties to the lower expert index); the remaining keep x L - top_k x L
    places go to the largest of all remaining shares across layers (ties: the lower layer, then the
    lower expert index):

        count_l = top_k + #{e outside l's floor : (l, e) among the keep x L - top_k x L largest
                            s_norm[l', e'] over all (l', e') outside the floors}

    (never more than E_l: each place is one expert)."""
    scores = _check(scores_by_layer, keep, top_k)
    layers = list(scores)
    counts = dict.fromkeys(layers, int(top_k))
    share, layer_idx, expert = [], [], []
    for i, layer in enumerate(layers):
        s = normalised_shares(scores[layer])
        rest = np.argsort(-s, kind="stable")[top_k:]     # after the floor, best first
        share.append(s[rest])
        layer_idx.append(np.full(len(rest), i))
        expert.append(rest)
    share, layer_idx, expert = map(np.concatenate, (share, layer_idx, expert))
    order = np.lexsort((expert, layer_idx, -share))[:(keep - top_k) * len(layers)]
    for i, n in zip(*np.unique(layer_idx[order], return_counts=True)):
        counts[layers[i]] += int(n)
    return counts


def layer_counts(scores_by_layer: dict[int, np.ndarray], keep: int, top_k: int, allocation: str) -> dict[int, int]:
    """{layer: count} under `allocation`: "uniform" keep in every layer; "global" `global_counts`."""
    if allocation == "uniform":
        return dict.fromkeys(_check(scores_by_layer, keep, top_k), int(keep))
    if allocation == "global":
        return global_counts(scores_by_layer, keep, top_k)
    raise ConfigError(f"allocation={allocation!r}: expected one of {list(ALLOCATIONS)}")

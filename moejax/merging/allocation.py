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


def _is_count(v) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, np.integer))


def _check(scores_by_layer: dict, keep, top_k: int) -> dict[int, np.ndarray]:
    """keep: a per-layer count, or {layer: count} (layers of different sizes: each layer's share
    of the budget, e.g. a keep ratio resolved against each layer's own E)."""
    if not scores_by_layer:
        raise ConfigError("allocation: no MoE layers to allocate a budget over")
    per_layer = isinstance(keep, dict)
    if per_layer and (set(keep) != set(scores_by_layer) or not all(map(_is_count, keep.values()))):
        raise ConfigError(f"allocation: keep={keep!r} must give a count (int) for each of the layers "
                          f"{sorted(scores_by_layer)}")
    if not per_layer and not _is_count(keep):
        raise ConfigError(f"allocation: keep={keep!r} must be a per-layer count (int)")
    scores = {}
    for layer, s in sorted(scores_by_layer.items()):
        s = np.asarray(s, np.float64)
        if s.ndim != 1:
            raise ConfigError(f"allocation: layer {layer}'s scores must be a vector [E], got shape {s.shape}")
        if not np.isfinite(s).all():
            raise ConfigError(f"allocation: layer {layer}'s scores hold NaN or infinity at experts "
                              f"{np.flatnonzero(~np.isfinite(s)).tolist()[:16]}")
        k = keep[layer] if per_layer else keep
        if not top_k <= k <= len(s):
            raise ConfigError(f"allocation: keep={k} per layer must lie in [top_k, E] = [{top_k}, {len(s)}] "
                              f"(layer {layer}: every token routes to top_k={top_k} experts)")
        scores[layer] = s
    return scores


def global_counts(scores_by_layer: dict[int, np.ndarray], keep, top_k: int) -> dict[int, int]:
    """{layer: count} from one global threshold, the counts summing to keep x L (L layers; keep
    given per layer as {layer: count}: their sum, layers of different sizes E_l).

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
    budget = sum(keep.values()) if isinstance(keep, dict) else keep * len(layers)
    order = np.lexsort((expert, layer_idx, -share))[:budget - top_k * len(layers)]
    for i, n in zip(*np.unique(layer_idx[order], return_counts=True)):
        counts[layers[i]] += int(n)
    return counts


def layer_counts(scores_by_layer: dict[int, np.ndarray], keep: int, top_k: int, allocation: str) -> dict[int, int]:
    """{layer: count} under `allocation`: "uniform" keep in every layer (or keep[layer]); "global"
    `global_counts`."""
    if allocation == "uniform":
        layers = _check(scores_by_layer, keep, top_k)
        return {l: int(keep[l]) for l in layers} if isinstance(keep, dict) else dict.fromkeys(layers, int(keep))
    if allocation == "global":
        return global_counts(scores_by_layer, keep, top_k)
    raise ConfigError(f"allocation={allocation!r}: expected one of {list(ALLOCATIONS)}")

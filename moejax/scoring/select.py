"""From a score to a kept set (SPEC section 2): keep counts, ratios, the routing floor, ties."""

from __future__ import annotations

import numpy as np

from moejax.errors import ConfigError


def resolve_keep(keep, n_experts: int, top_k: int) -> int:
    """A keep given as a count (int) or as a ratio of E (float in (0, 1]) -> a count.

    A ratio r keeps max(1, E - round((1 - r) * E)) with Python's round-half-even (the
    compressed-tensors convention). Never fewer than top_k (the routing floor) or more than E.
    """
    if isinstance(keep, bool) or not isinstance(keep, (int, float, np.integer, np.floating)):
        raise ConfigError(f"keep must be a count (int) or a ratio of E (float), got {keep!r}")
    if isinstance(keep, (float, np.floating)):
        if not 0.0 < keep <= 1.0:
            raise ConfigError(f"keep={keep} as a ratio of E must lie in (0, 1]")
        count = max(1, n_experts - round((1.0 - float(keep)) * n_experts))
        what = f"keep={keep} (ratio of E={n_experts}) gives {count} experts, which"
    else:
        count = int(keep)
        what = f"keep={count}"
    if count < top_k:
        raise ConfigError(f"{what} is below top_k={top_k}: every token routes to {top_k} experts, "
                          f"so at least {top_k} must be kept")
    if count > n_experts:
        raise ConfigError(f"{what} exceeds the number of experts E={n_experts}")
    return count


def select_kept(score_E: np.ndarray, keep: int, where: str = "score") -> np.ndarray:
    """Boolean mask of the `keep` highest-scoring experts. Ranked in float64; ties break toward
    the lower expert index (a stable sort of -score). A NaN or infinity is refused, the message
    starting with `where` (e.g. "layer 3: score 'reap'")."""
    score = np.asarray(score_E, np.float64)
    if not np.all(np.isfinite(score)):
        raise ConfigError(f"{where}: non-finite values (NaN or inf) at experts "
                          f"{np.flatnonzero(~np.isfinite(score)).tolist()[:16]}")
    order = np.argsort(-score, kind="stable")
    mask = np.zeros(score.shape[0], bool)
    mask[order[:keep]] = True
    return mask


def select_kept_grouped(score_E: np.ndarray, keep: int, n_group: int) -> np.ndarray:
    """Boolean mask keeping keep / n_group experts in every routing group (groups are contiguous
    blocks of E / n_group experts), so that after renumbering every kept expert is still in its
    group. Within a group, the same ranking and ties as `select_kept`."""
    score = np.asarray(score_E, np.float64)
    E = score.shape[0]
    if keep % n_group:
        raise ConfigError(f"keep={keep} is not divisible by n_group={n_group}: group-aware pruning keeps "
                          f"an equal number per group (choose a multiple of {n_group})")
    size = E // n_group
    return np.concatenate([select_kept(score[g * size:(g + 1) * size], keep // n_group) for g in range(n_group)])


def group_counts(mask_E: np.ndarray, n_group: int) -> np.ndarray:
    """Kept experts per routing group."""
    return np.asarray(mask_E, bool).reshape(n_group, -1).sum(axis=1)

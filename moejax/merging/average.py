"""How a cluster's experts become one: M-SMoE's neuron alignment and the frequency-weighted average
of the SwiGLU matrices (gate and up [H, F], down [F, H], moejax's [in, out] layout)."""

from __future__ import annotations

import numpy as np


def neuron_features(w: dict) -> np.ndarray:
    """[F, 3H]: each intermediate neuron's gate and up columns and its down row, side by side (what
    a permutation of the neurons moves together)."""
    return np.concatenate([np.asarray(w["gate"]).T, np.asarray(w["up"]).T, np.asarray(w["down"])], axis=1)


def align_neurons(dominant: dict, member: dict) -> np.ndarray:
    """perm [F]: the member's neuron perm[i] goes to the dominant expert's position i, maximising
    sum_i <features_dominant[i], features_member[perm[i]]> (equivalently minimising the summed
    squared distance; `scipy.optimize.linear_sum_assignment`, the Hungarian assignment)."""
    from scipy.optimize import linear_sum_assignment

    a, b = neuron_features(dominant).astype(np.float64), neuron_features(member).astype(np.float64)
    rows, cols = linear_sum_assignment(-(a @ b.T))
    perm = np.empty(len(rows), np.int64)
    perm[rows] = cols
    return perm


def permute_neurons(w: dict, perm) -> dict:
    """The same expert with its intermediate neurons reordered (its function is unchanged)."""
    return {"gate": np.asarray(w["gate"])[:, perm], "up": np.asarray(w["up"])[:, perm],
            "down": np.asarray(w["down"])[perm, :]}


def merge_cluster(experts: list[dict], freq, align: bool = False) -> dict:
    """One expert from a cluster: each matrix the average of the members', weighted by their share
    of the cluster's routing decisions (uniform when none was routed). align: first permute every
    member's neurons onto the first member's (M-SMoE; pass the dominant expert first)."""
    freq = np.asarray(freq, np.float64)
    weights = freq / freq.sum() if freq.sum() > 0 else np.full(len(experts), 1.0 / len(experts))
    if align:
        experts = [experts[0]] + [permute_neurons(m, align_neurons(experts[0], m)) for m in experts[1:]]
    return {k: sum(w * np.asarray(e[k], np.float64) for w, e in zip(weights, experts)) for k in ("gate", "up", "down")}

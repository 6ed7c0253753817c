"""How a cluster's experts become one: M-SMoE's neuron alignment and the frequency-weighted average
of an expert's matrices.

An expert is a dict of matrices that share one axis of intermediate neurons (F). `NEURON_AXES`
says where that axis is, per layout, in moejax's [in, out] convention:

    swiglu    gate [H, F], up [H, F], down [F, H]     (every model family)
    relu_mlp  w1 [d, F], w2 [F, d]                    (the toy layer)

A permutation of the neurons moves a column of each input matrix and a row of each output matrix
together, and leaves the expert's function unchanged.
"""

from __future__ import annotations

import numpy as np

NEURON_AXES = {"swiglu": {"gate": 1, "up": 1, "down": 0}, "relu_mlp": {"w1": 1, "w2": 0}}


def _axes(w: dict) -> dict:
    for axes in NEURON_AXES.values():
        if set(axes) == set(w):
            return axes
    raise ValueError(f"an expert's matrices {sorted(w)} match no layout in NEURON_AXES {NEURON_AXES}")


def neuron_features(w: dict) -> np.ndarray:
    """[F, sum of the other axes]: each intermediate neuron's weights in every matrix, side by side
    (for SwiGLU its gate and up columns and its down row: what a permutation moves together)."""
    axes = _axes(w)
    return np.concatenate([np.moveaxis(np.asarray(w[k]), axes[k], 0) for k in axes], axis=1)


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
    axes = _axes(w)
    return {k: np.take(np.asarray(w[k]), perm, axis=axes[k]) for k in w}


def merge_cluster(experts: list[dict], freq, align: bool = False) -> dict:
    """One expert from a cluster: each matrix the average of the members', weighted by their share
    of the cluster's routing decisions (uniform when none was routed), in float64. align: first
    permute every member's neurons onto the first member's (M-SMoE; pass the dominant expert first)."""
    freq = np.asarray(freq, np.float64)
    weights = freq / freq.sum() if freq.sum() > 0 else np.full(len(experts), 1.0 / len(experts))
    if align:
        experts = [experts[0]] + [permute_neurons(m, align_neurons(experts[0], m)) for m in experts[1:]]
    return {k: sum(w * np.asarray(e[k], np.float64) for w, e in zip(weights, experts)) for k in experts[0]}

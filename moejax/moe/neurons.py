"""Where an expert keeps its intermediate neurons: the one layout every merge reads.

An expert is a dict of matrices that share one axis of F intermediate neurons. A permutation of the
neurons moves each matrix's slice along that axis together and leaves the expert's function
unchanged; M-SMoE and REAM align neurons before they average, so they need to know, per matrix,
which axis and how many consecutive entries a neuron owns:

    swiglu          gate [H, F], up [H, F], down [F, H]               (every family but gpt-oss)
    clamped_swiglu  gate_up [H, 2F]   neuron i: columns 2i (gate), 2i+1 (up)   (gpt-oss)
                    gate_up_bias [2F] neuron i: entries 2i, 2i+1
                    down [F, H], down_bias [H] (no neuron axis: averaged as it is)
    relu_mlp        w1 [d, F], w2 [F, d]                              (the toy layer)

Axes are one expert's, in moejax's [in, out] convention; a layer's arrays carry a leading expert
axis. A neuron's features (what M-SMoE's and REAM's similarities compare) are its entries in every
matrix that has a neuron axis, side by side: SwiGLU's gate column, up column and down row; gpt-oss's
gate and up columns, their two biases and its down row.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from moejax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class NeuronAxis:
    axis: int        # the neuron axis of one expert's matrix
    width: int = 1   # consecutive entries along it that one neuron owns (gpt-oss's interleaved gate_up: 2)


_IN, _OUT = NeuronAxis(1), NeuronAxis(0)

# expert kind (`moejax.moe.dispatch.EXPERT_SHAPES`) -> {matrix: NeuronAxis, or None for a matrix with
# no neuron axis}
NEURON_LAYOUTS = {
    "swiglu": {"gate": _IN, "up": _IN, "down": _OUT},
    "clamped_swiglu": {"gate_up": NeuronAxis(1, 2), "gate_up_bias": NeuronAxis(0, 2), "down": _OUT,
                       "down_bias": None},
    "relu_mlp": {"w1": _IN, "w2": _OUT},
}


def check_mergeable(expert_kind: str, where: str) -> None:
    """Refuse, before any pass, experts with no neuron layout here: HC-SMoE, M-SMoE and REAM average
    neuron by neuron."""
    if expert_kind not in NEURON_LAYOUTS:
        raise ConfigError(f"{where}: merging {expert_kind!r} experts is not implemented (the merge methods average "
                          f"experts neuron by neuron; layouts known: {sorted(NEURON_LAYOUTS)}); prune them instead")


def layout_of(w: dict) -> dict:
    """The layout whose matrices are exactly w's (one expert's or a layer's)."""
    for layout in NEURON_LAYOUTS.values():
        if set(layout) == set(w):
            return layout
    raise ConfigError(f"an expert's matrices {sorted(w)} match no layout in NEURON_LAYOUTS "
                      f"{ {k: sorted(v) for k, v in NEURON_LAYOUTS.items()} }")


def n_neurons(w: dict, expert_axis: bool = False) -> int:
    """F of one expert (expert_axis=False) or of a layer's stacked experts."""
    name, ax = next((k, a) for k, a in layout_of(w).items() if a is not None)
    return np.shape(w[name])[ax.axis + expert_axis] // ax.width


def neuron_first(m, ax: NeuronAxis):
    """One expert's matrix as [F, rest], neuron i's entries in row i (a view where numpy can)."""
    moved = np.moveaxis(np.asarray(m), ax.axis, 0)
    return moved.reshape(moved.shape[0] // ax.width, -1)


def neuron_blocks(w: dict, dtype) -> list[np.ndarray]:
    """Each matrix with a neuron axis as [F, rest] in `dtype`, in sorted name order."""
    layout = layout_of(w)
    return [neuron_first(np.asarray(w[k], dtype), layout[k]) for k in sorted(layout) if layout[k] is not None]


def entry_index(perm, width: int, xp=np):
    """The permutation of a neuron axis's entries that moves whole neurons by perm [F]: neuron perm[i]'s
    `width` entries to positions width*i, ..., width*i + width - 1 (xp: numpy, or jax.numpy in a trace)."""
    perm = xp.asarray(perm)
    return perm if width == 1 else (perm[:, None] * width + xp.arange(width, dtype=perm.dtype)).reshape(-1)


def permute(m, perm, ax: NeuronAxis | None, out=None) -> np.ndarray:
    """One expert's matrix with its neurons reordered by perm (a matrix with no neuron axis as it is)."""
    if ax is None:
        return np.asarray(m)
    return np.take(np.asarray(m), entry_index(perm, ax.width), axis=ax.axis, out=out, mode="clip")


def permute_neurons(w: dict, perm) -> dict:
    """The same expert with its intermediate neurons reordered (its function is unchanged)."""
    layout = layout_of(w)
    return {k: permute(w[k], perm, layout[k]) for k in w}


def hidden_activations(expert: dict, x_NH, expert_fn=None) -> np.ndarray:
    """h [N, F] in float64: the expert's intermediate activations (the input of its output matrix)
    on tokens x [N, H]: SwiGLU silu(x gate) * (x up); gpt-oss's (up + 1) * gate * sigmoid(alpha gate)
    with its biases and clamps (`expert_fn`, the model's `moejax.moe.dispatch.ClampedSwiglu`, gives
    alpha and the limit); the toy's relu(x w1)."""
    from scipy.special import expit

    x = np.asarray(x_NH, np.float64)
    layout = layout_of(expert)
    if "gate_up" in layout:
        if not hasattr(expert_fn, "limit"):
            raise ConfigError(f"the hidden activations of gpt-oss's experts need the model's ClampedSwiglu "
                              f"(its alpha and limit), got {expert_fn!r}")
        gu = x @ np.asarray(expert["gate_up"], np.float64) + np.asarray(expert["gate_up_bias"], np.float64)
        gate = np.minimum(gu[:, 0::2], expert_fn.limit)
        up = np.clip(gu[:, 1::2], -expert_fn.limit, expert_fn.limit)
        return (up + 1) * gate * expit(expert_fn.alpha * gate)
    if "gate" in layout:
        g = x @ np.asarray(expert["gate"], np.float64)
        return g * expit(g) * (x @ np.asarray(expert["up"], np.float64))
    return np.maximum(x @ np.asarray(expert["w1"], np.float64), 0.0)

"""M-SMoE's neuron similarity for a bfloat16 layer, on XLA: each expert neuron-first as one device
array, and the similarity of two experts accumulated in float32 (`moejax.merging.average.align_layer`
imports this module only for a bfloat16 layer, so the rest of `moejax.merging` stays JAX-free)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from moejax.host_memory import aligned_empty
from moejax.moe.neurons import neuron_first


def bf16_neuron_block(w: dict, layout: dict) -> jax.Array:
    """One bfloat16 expert as a [F, K] device array, each matrix neuron-first side by side in
    `moejax.moe.neurons.neuron_blocks`' order (K = 3H for SwiGLU), copied once by numpy into an aligned buffer that
    the array uses in place (no second copy). layout: each matrix's neuron axis (`moejax.moe.neurons.layout_of`)."""
    moved = [neuron_first(w[k], layout[k]) for k in sorted(layout) if layout[k] is not None]
    out = aligned_empty((moved[0].shape[0], sum(m.shape[1] for m in moved)), np.uint16)
    at = 0
    for m in moved:  # as uint16: numpy's plain copy loop (bfloat16 goes through ml_dtypes' casts)
        np.copyto(out[:, at:at + m.shape[1]], m.view(np.uint16))
        at += m.shape[1]
    return jax.device_put(out.view(ml_dtypes.bfloat16))


@jax.jit
def bf16_similarity(dominant, member):
    """`moejax.merging.average._similarity` of two bfloat16 experts as `bf16_neuron_block` lays them out ([F, K] each),
    S [F, F] float32 = dominant @ member.T: the bfloat16 products exact in float32, accumulated in
    float32."""
    return jax.lax.dot_general(dominant, member, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)

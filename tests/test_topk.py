"""The elementwise top-k (moejax/moe/topk.py) chooses exactly what lax.top_k chooses, ties included."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.moe.dispatch import combine, combine_from_table
from moejax.moe.topk import kth_largest, topk_indices_at_threshold


def _sel(key, n_experts, coarse):
    """[3, E, 500] expert-major scores; on a coarse grid ties are everywhere, also at the K-th place.
    A few experts are masked (-inf) per row, as pruning does."""
    k1, k2 = jax.random.split(key)
    sel = jax.random.normal(k1, (3, n_experts, 500))
    if coarse:  # + 0.0 turns -0.0 into 0.0: ties are by value (lax.top_k ranks 0.0 above -0.0)
        sel = jnp.round(sel * 2) / 2 + 0.0
    masked = jax.random.uniform(k2, (3, n_experts, 1)) < 0.3
    return jnp.where(masked, -jnp.inf, sel), sel, ~masked[..., 0]


@pytest.mark.parametrize("n_experts,k,coarse", [pytest.param(64, 4, True, marks=pytest.mark.slow), (64, 4, False),
                                                (40, 6, True), (70, 1, True),
                                                (16, 8, True), (32, 2, False)])
def test_same_choice_as_lax_top_k(n_experts, k, coarse):
    sel_ET, unmasked_ET, keep_E = _sel(jax.random.key(n_experts * 10 + k), n_experts, coarse)
    values_TK, idx_TK = jax.lax.top_k(jnp.swapaxes(sel_ET, -1, -2), k)
    kth_T = jax.jit(kth_largest, static_argnums=1)(sel_ET, k)
    np.testing.assert_array_equal(kth_T, values_TK[..., -1])
    np.testing.assert_array_equal(kth_largest(sel_ET, k, unrolled=False), values_TK[..., -1])
    np.testing.assert_array_equal(kth_largest(unmasked_ET, k, keep_E=keep_E), values_TK[..., -1])
    # a mask with its own leading axis (variants) broadcast against the scores
    two_VE = jnp.stack([keep_E[0], jnp.ones_like(keep_E[0])])
    np.testing.assert_array_equal(kth_largest(unmasked_ET[0], k, keep_E=two_VE, unrolled=False),
                                  jnp.stack([values_TK[0, :, -1], jax.lax.top_k(unmasked_ET[0].T, k)[0][:, -1]]))
    got = jax.jit(topk_indices_at_threshold, static_argnums=2)(sel_ET, kth_T, k)
    np.testing.assert_array_equal(got, np.sort(np.asarray(idx_TK), axis=-1))
    got = topk_indices_at_threshold(unmasked_ET, kth_T, k, keep_E=keep_E)
    np.testing.assert_array_equal(got, np.sort(np.asarray(idx_TK), axis=-1))
    if coarse:  # the test really has ties across the K-th place
        at_or_above = (sel_ET >= kth_T[..., None, :]).sum(axis=-2)
        assert (at_or_above > k).mean() > 0.05


def test_combine_from_table_equals_gathered_combine():
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    f_ETD = jax.random.normal(k1, (16, 50, 8))
    f_TED = jnp.swapaxes(f_ETD, 0, 1)
    idx_VTK = jax.random.randint(k2, (3, 50, 4), 0, 16)
    gate_VTK = jax.random.uniform(k3, (3, 50, 4))
    got = combine_from_table(gate_VTK, idx_VTK, f_ETD)
    for v in range(3):
        want = combine(gate_VTK[v], jnp.take_along_axis(f_TED, idx_VTK[v][..., None], axis=1))
        np.testing.assert_allclose(got[v], want, rtol=1e-6, atol=1e-6)

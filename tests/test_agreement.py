"""ESAP, KL and top-1 agreement (moejax.inference.agreement) folded a vocabulary chunk at a time,
against float64 numpy from the definitions, on hand-made distributions: equal ones, disjoint ones,
and exact ties of the top logit across and within chunks."""

import jax.numpy as jnp
import numpy as np
import pytest

from moejax.inference.agreement import agreement_init, agreement_update


def chunked(ref, logits, chunk):
    """The module's sums over [B, T, V] logits against reference logits, `chunk` entries at a time."""
    def lse(z):
        m = z.max(-1, keepdims=True)
        return (m + np.log(np.exp(z - m).sum(-1, keepdims=True)))[..., 0]
    lse_ref, lse_q = lse(ref.astype(np.float64)), lse(logits.astype(np.float64))
    state = agreement_init(ref.shape[:-1])
    for v0 in range(0, ref.shape[-1], chunk):
        ref_logp = jnp.asarray(ref[..., v0:v0 + chunk] - lse_ref[..., None], jnp.float32)
        state = agreement_update(state, jnp.asarray(logits[..., v0:v0 + chunk]), jnp.asarray(lse_q, jnp.float32),
                                 ref_logp, v0)
    esap, kl, _, arg = (np.asarray(s) for s in state)
    return esap, kl, arg


def numpy_metrics(p_logits, q_logits):
    lp = p_logits - np.log(np.exp(p_logits).sum(-1, keepdims=True))
    lq = q_logits - np.log(np.exp(q_logits).sum(-1, keepdims=True))
    return np.minimum(np.exp(lp), np.exp(lq)).sum(-1), (np.exp(lp) * (lp - lq)).sum(-1), np.argmax(q_logits, -1)


@pytest.mark.parametrize("chunk", [1, 3, 7, 64])
def test_chunked_sums_equal_the_definitions(chunk):
    rng = np.random.default_rng(0)
    p = rng.normal(size=(2, 5, 11)) * 3
    q = p + rng.normal(size=p.shape)
    q[0, 0] = p[0, 0]                                  # equal distributions: ESAP 1, KL 0
    p[0, 1], q[0, 1] = np.r_[20.0, np.zeros(10)], np.r_[np.zeros(10), 20.0]   # nearly disjoint
    q[1, 2] = 0.0; q[1, 2, [2, 9]] = 5.0              # a tie of the top logit: the lower index wins
    q[1, 3] = 1.0                                      # all equal: index 0
    esap, kl, arg = chunked(p, q, chunk)
    want_esap, want_kl, want_arg = numpy_metrics(p, q)
    np.testing.assert_allclose(esap, want_esap, atol=2e-6)
    np.testing.assert_allclose(kl, want_kl, rtol=1e-4, atol=2e-5)
    np.testing.assert_array_equal(arg, want_arg)
    assert esap[0, 0] == pytest.approx(1.0, abs=1e-6) and abs(kl[0, 0]) < 1e-5
    assert esap[0, 1] < 1e-6 and kl[0, 1] > 15
    assert arg[1, 2] == 2 and arg[1, 3] == 0

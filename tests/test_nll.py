"""The one NLL (moejax.inference.nll): the vocabulary-chunked log-sum-exp equals log-softmax over the whole
vocabulary, from numpy."""

import jax.numpy as jnp
import numpy as np

from moejax.inference.nll import chunked_nll, chunked_nll_init, chunked_nll_update, next_token_nll


def test_chunked_nll_equals_the_whole_vocabulary():
    rng = np.random.default_rng(0)
    B, S, V = 3, 7, 50
    logits = (rng.standard_normal((B, S, V)) * 4).astype(np.float32)
    logits[0, 0, 3] = 60.0  # a dominant logit in the first chunk: the running max must rescale the sum
    ids = rng.integers(0, V, size=(B, S))
    state = chunked_nll_init((B, S - 1))
    for v0 in range(0, V, 16):  # chunks of 16, the last one 2 wide
        state = chunked_nll_update(state, jnp.asarray(logits[:, :-1, v0:v0 + 16]), jnp.asarray(ids[:, 1:]), v0)
    x = logits[:, :-1].astype(np.float64)
    want = np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1)) + x.max(-1) \
        - np.take_along_axis(x, ids[:, 1:, None], -1)[..., 0]
    np.testing.assert_allclose(chunked_nll(state), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(chunked_nll(state), next_token_nll(jnp.asarray(logits), jnp.asarray(ids)),
                               rtol=1e-5, atol=1e-5)

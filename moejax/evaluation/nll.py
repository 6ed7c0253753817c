"""The one next-token log-likelihood: log p(target) from logits, in float32 (SPEC section 3's
perplexity, train_tiny's loss, the lm-eval backend's loglikelihoods all read it)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def target_logprobs(logits_BSV, targets_BS):
    """log softmax(logits)[target] at every position, float32 [B, S]."""
    logp = jax.nn.log_softmax(logits_BSV.astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(logp, targets_BS[..., None], axis=-1)[..., 0]


def next_token_nll(logits_BSV, ids_BS):
    """-log p(ids[:, t + 1] | ids[:, :t + 1]) for t = 0..S-2: float32 [B, S-1]."""
    return -target_logprobs(logits_BSV[:, :-1], ids_BS[:, 1:])


def chunked_nll_init(targets_shape) -> tuple:
    """The running state of `chunked_nll_update` before the first vocabulary chunk: (running max,
    running sum of exp(logit - max), the target's logit), float32 each."""
    return (jnp.full(targets_shape, -jnp.inf, jnp.float32), jnp.zeros(targets_shape, jnp.float32),
            jnp.zeros(targets_shape, jnp.float32))


def chunked_nll_update(state, logits_NC, targets_N, start):
    """Fold the logits of vocabulary entries [start, start + C) into the running log-sum-exp (and
    pick up the target's logit if it falls in them): the output head a chunk at a time, never a
    [N, V] logits array (Moonlight's V = 163,840 is 0.7 GB per 1,024 tokens)."""
    m, s, t = state
    logits_NC = logits_NC.astype(jnp.float32)
    m_new = jnp.maximum(m, jnp.max(logits_NC, axis=-1))
    s = s * jnp.exp(m - m_new) + jnp.sum(jnp.exp(logits_NC - m_new[..., None]), axis=-1)
    local = targets_N - start
    inside = (local >= 0) & (local < logits_NC.shape[-1])
    picked = jnp.take_along_axis(logits_NC, jnp.clip(local, 0, logits_NC.shape[-1] - 1)[..., None], axis=-1)[..., 0]
    return m_new, s, t + jnp.where(inside, picked, 0.0)


def chunked_nll(state):
    """-log p(target) once every vocabulary chunk is folded in: logsumexp - target logit."""
    m, s, t = state
    return m + jnp.log(s) - t

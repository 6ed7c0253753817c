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

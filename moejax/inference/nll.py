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


def chunked_nll_update(state, logits_BV, targets_B, start):
    """Fold one vocabulary chunk's logits [B, V] (B: any leading axes, V: the chunk's entries
    [start, start + V)) into the running log-sum-exp, and pick up the target's logit if it falls in
    them: the output head a chunk at a time, never the whole vocabulary's logits (Moonlight's
    163,840 entries are 0.7 GB per 1,024 tokens)."""
    m, s, t = state
    logits_BV = logits_BV.astype(jnp.float32)
    m_new = jnp.maximum(m, jnp.max(logits_BV, axis=-1))
    s = s * jnp.exp(m - m_new) + jnp.sum(jnp.exp(logits_BV - m_new[..., None]), axis=-1)
    local = targets_B - start
    inside = (local >= 0) & (local < logits_BV.shape[-1])
    picked = jnp.take_along_axis(logits_BV, jnp.clip(local, 0, logits_BV.shape[-1] - 1)[..., None], axis=-1)[..., 0]
    return m_new, s, t + jnp.where(inside, picked, 0.0)


def chunked_logsumexp(state):
    """The log-sum-exp of every logit once every vocabulary chunk is folded in."""
    m, s, _ = state
    return m + jnp.log(s)


def chunked_nll(state):
    """-log p(target) once every vocabulary chunk is folded in: logsumexp - target logit."""
    return chunked_logsumexp(state) - state[2]


def compiled_scorer(model):
    """fn(ids [B, S], targets [B, S], variant) -> (log p(target) [B, S], target == argmax [B, S]) of
    every position under a variant (`moejax.models.variant`), in one compiled call: the [B, S, V]
    logits never leave it. The weights are arguments (a variant of another kind compiles once more;
    masks and maps of one structure reuse the program)."""
    from flax import nnx

    graphdef, state = nnx.split(model)

    @jax.jit
    def score(state, ids_BS, targets_BS, variant):
        logits = nnx.merge(graphdef, state)(ids_BS, None, variant, forward_only=True).logits_BSV
        return target_logprobs(logits, targets_BS), jnp.argmax(logits, axis=-1) == targets_BS

    return lambda ids, targets, variant: score(state, ids, targets, variant)

"""How closely a variant's next-token distribution agrees with the unpruned model's, teacher-forced
(issue 45; EvoESAP, arXiv 2603.06003, code ZongfangLiu/EvoESAP). At a held-out position t that
predicts a next token, p_t is the unpruned model's distribution and q_t the variant's, both on the
same (held-out) prefix:

    ESAP_t = sum_v min(p_t[v], q_t[v])
             the expected acceptance of speculative decoding with q drafting for p: a drafted token
             v ~ q is accepted with probability min(1, p[v] / q[v]) (Leviathan et al. 2023), so
             E[accept] = sum_v q[v] min(1, p[v] / q[v]) = sum_v min(p[v], q[v]) = 1 - TV(p, q).
             EvoESAP's fitness is its mean over positions (no generation needed).
    KL_t   = sum_v p_t[v] (log p_t[v] - log q_t[v])      KL(unpruned || variant), nats
    top1_t = [argmax_v p_t[v] == argmax_v q_t[v]]         ties: the lowest index, as numpy's argmax

Each is averaged over positions (per text, and over all texts by position count). The output head
is read a vocabulary chunk at a time (`moejax.inference.stream.head_pass`): a first pass gives
each stream's log-sum-exp (as for the NLL), this module's `agreement_update` folds the second
pass's chunks into the sums, float32, never holding [tokens, V] logits.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.scipy.special import logsumexp


def agreement_init(shape) -> tuple:
    """(ESAP sum, KL sum, running max logit, its index) per position [B, T] of one stream, before
    the first vocabulary chunk."""
    return (jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32), jnp.full(shape, -jnp.inf, jnp.float32),
            jnp.zeros(shape, jnp.int32))


def agreement_update(state, logits_BTC, lse_BT, ref_logp_BTC, start):
    """Fold one vocabulary chunk [start, start + C) of a stream's logits into its sums against the
    unpruned stream's log-probabilities of the same chunk (ref_logp = its logits - its lse)."""
    esap, kl, best, arg = state
    logits = logits_BTC.astype(jnp.float32)
    logp = logits - lse_BT[..., None]
    p_ref = jnp.exp(ref_logp_BTC)
    esap = esap + jnp.sum(jnp.minimum(p_ref, jnp.exp(logp)), axis=-1)
    kl = kl + jnp.sum(p_ref * (ref_logp_BTC - logp), axis=-1)
    chunk_best = jnp.max(logits, axis=-1)
    better = chunk_best > best   # strictly: an equal logit in a later chunk keeps the lower index
    arg = jnp.where(better, jnp.argmax(logits, axis=-1).astype(jnp.int32) + start, arg)
    return esap, kl, jnp.where(better, chunk_best, best), arg


def logits_agreement(ref_logits_BTV, logits_BTV) -> tuple:
    """(ESAP, KL, top-1 agreement) per position [B, T] of whole logits against the reference's (one
    vocabulary chunk: for a forward that holds the logits anyway)."""
    ref, logits = ref_logits_BTV.astype(jnp.float32), logits_BTV.astype(jnp.float32)
    ref_logp = ref - logsumexp(ref, axis=-1, keepdims=True)
    esap, kl, _, arg = agreement_update(agreement_init(logits.shape[:-1]), logits, logsumexp(logits, axis=-1),
                                        ref_logp, 0)
    return esap, kl, arg == jnp.argmax(ref, axis=-1)

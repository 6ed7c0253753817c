"""The jitted pieces of one decoder layer that the carried pass (`moejax.evaluation.carried`) runs:
the attention and MLP halves of a layer, on one stream or on A streams stacked into the batch,
and the routed output's layer-local errors under each variant. The graphdef is static; weights,
masks and expert maps are arguments, so one compilation serves every layer of a shape.

Shape letters as in `moejax/__init__.py`; A is the variants axis throughout: streams stacked one
per variant, the variants measured on one stream's inputs, and the columns of `routed_columns`
(column 0 the unpruned router, then the variants).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.models.causal_lm import Attended
from moejax.moe.columns import routed_columns
from moejax.moe.expert_map import ExpertMap


@functools.partial(jax.jit, static_argnums=0)
def attention(graphdef, state, x_BSH, cos, sin, allowed, carry=None):
    """h = x + attn(norm(x)), z = the MLP's (router's) input, and what the attention hands on
    (`Attended`; carry: what the layers before handed on, None for most families)."""
    return nnx.merge(graphdef, state).attend(x_BSH, cos, sin, allowed, carry)


@functools.partial(jax.jit, static_argnums=0)
def mlp(graphdef, state, h_BSH, z_BSH, variant, ids_BS=None):
    """h + mlp(z), a MoE layer under `variant` (None, a mask [E] or an ExpertMap); ids_BS: the
    tokens' ids, which a hash-routed layer (DeepSeek-V4) chooses its experts by."""
    return nnx.merge(graphdef, state).feed(Attended(h_BSH, z_BSH), variant, forward_only=True, ids_BS=ids_BS).out_BSH


def streams_slice(em_A: ExpertMap, sl) -> ExpertMap:
    """Streams `sl` of an ExpertMap stacked over streams (mask, rows and novices [A, E]; one table,
    one set of constants)."""
    return em_A._replace(mask_E=em_A.mask_E[sl], rows_E=None if em_A.rows_E is None else em_A.rows_E[sl],
                         novice_E=None if em_A.novice_E is None else em_A.novice_E[sl])


@functools.partial(jax.jit, static_argnums=0)
def routed_errors(graphdef, state, z_TH, em_A: ExpertMap):
    """Per-token squared norms of the unpruned routed output and of its error under each of the A
    variants of em_A (mask and rows [A, E] over the layer's own experts), and the unpruned routed
    output itself: (||y_t||^2 [T], ||y'_t - y_t||^2 [A, T], y [T, H]); shared experts excluded
    (SPEC section 3). Column 0 is the unpruned router (every slot, rows the identity), column 1 + v
    variant v, all from one set of expert calls (`routed_columns`), so a token whose choice a
    variant leaves unchanged has error exactly 0."""
    moe = nnx.merge(graphdef, state).mlp
    n_slots = em_A.mask_E.shape[-1]
    identity = jnp.arange(n_slots, dtype=jnp.int32)
    mask_AE = jnp.concatenate([jnp.ones((1, n_slots), bool), em_A.mask_E.astype(bool)])
    rows_AE = jnp.concatenate([identity[None], jnp.broadcast_to(identity, em_A.mask_E.shape)
                               if em_A.rows_E is None else em_A.rows_E.astype(jnp.int32)])
    novice_AE = None if em_A.novice_E is None else jnp.concatenate([jnp.zeros((1, n_slots), bool),
                                                                     em_A.novice_E.astype(bool)])
    y_TAH = routed_columns(z_TH, moe.router_logits(z_TH), moe.router_cfg, moe.balance_bias(), mask_AE, rows_AE,
                           em_A.table(moe.expert_weights()), moe.expert_fn, novice_AE, em_A.constants_EH)
    y_TH = y_TAH[:, 0]
    err_AT = jnp.sum((y_TAH[:, 1:] - y_TH[:, None]) ** 2, axis=-1).T
    return jnp.sum(y_TH ** 2, axis=-1), err_AT, y_TH


@functools.partial(jax.jit, static_argnums=0)
def routed_errors_vs(graphdef, state, z_TH, y_TH, em_A: ExpertMap):
    """||y'_t - y_t||^2 [A, T] of em_A's A variants computing with em_A's own table (a merge's
    experts), against the unpruned routed output y [T, H] given (`routed_errors`' third result)."""
    moe = nnx.merge(graphdef, state).mlp
    rows_AE = jnp.broadcast_to(jnp.arange(em_A.mask_E.shape[-1], dtype=jnp.int32), em_A.mask_E.shape) \
        if em_A.rows_E is None else em_A.rows_E.astype(jnp.int32)
    y_TAH = routed_columns(z_TH, moe.router_logits(z_TH), moe.router_cfg, moe.balance_bias(), em_A.mask_E.astype(bool),
                           rows_AE, em_A.table(moe.expert_weights()), moe.expert_fn,
                           None if em_A.novice_E is None else em_A.novice_E.astype(bool), em_A.constants_EH)
    return jnp.sum((y_TAH - y_TH[:, None]) ** 2, axis=-1).T


@functools.partial(jax.jit, static_argnums=(0, 4))
def routed_errors_each(graphdef, state, z_ABSH, em_A: ExpertMap, own: bool = True):
    """`routed_errors` of stream n's own inputs under its own variant n: ([A, B, S], [A, B, S]).
    own=False: em_A computes with its own table (a merge's), the unpruned output from the layer's."""
    def one(args):
        z, mask, rows, novice = args
        em = em_A._replace(mask_E=mask[None], rows_E=None if rows is None else rows[None],
                           novice_E=None if novice is None else novice[None])
        z_TH = z.reshape(-1, z.shape[-1])
        if own:
            norm, err, _ = routed_errors(graphdef, state, z_TH, em)
        else:
            norm, _, y_TH = routed_errors(graphdef, state, z_TH, ExpertMap(jnp.ones((0,) + mask.shape, bool)))
            err = routed_errors_vs(graphdef, state, z_TH, y_TH, em)
        return norm.reshape(z.shape[:-1]), err[0].reshape(z.shape[:-1])
    return jax.lax.map(one, (z_ABSH, em_A.mask_E, em_A.rows_E, em_A.novice_E))


@functools.partial(jax.jit, static_argnums=0)
def stacked_attention(graphdef, state, x_ABSH, cos, sin, allowed_BSS, carry_A=None):
    """The attention half of one decoder layer on A streams at once (stacked into the batch, so
    each weight is read once per call for all of them): `Attended` with h = x + attn(norm(x)) and
    the MLP's input z, both [A, B, S, H], and the carry per stream [A, B, ...] (carry_A: what the
    layers before handed each stream, [A or 1, B, ...], or None). The residual may have more
    trailing axes than H (DeepSeek-V4's hyper-connection streams [A, B, S, W, H]); z is [A, B, S, H]."""
    A, B, S = x_ABSH.shape[:3]
    layer = nnx.merge(graphdef, state)
    x = x_ABSH.reshape((A * B,) + x_ABSH.shape[2:])
    allowed = jnp.broadcast_to(allowed_BSS[None], (A, B, S, S)).reshape(A * B, S, S)
    carry = jax.tree.map(lambda c: jnp.broadcast_to(c, (A,) + c.shape[1:]).reshape((A * B,) + c.shape[2:]), carry_A)
    return jax.tree.map(lambda a: a.reshape((A, B) + a.shape[1:]), layer.attend(x, cos, sin, allowed, carry))


@functools.partial(jax.jit, static_argnums=(0, 4))
def stacked_mlp(graphdef, state, h_ABSH, z_ABSH, n_streams, em_A: ExpertMap | None, ids_BS=None):
    """The MLP half on `n_streams` streams (h and z broadcast from one stream when they hold one),
    stream n's MoE under variant n of em_A (mask and rows [n_streams, E], one table; None: a dense
    layer or one kept whole): h + mlp(z), [n_streams, B, S, H] (h's trailing axes: DeepSeek-V4's
    streams [.., W, H]). ids_BS: the tokens' ids, the same for every stream (a hash-routed layer's
    choice), or None."""
    B, S = h_ABSH.shape[1:3]
    layer = nnx.merge(graphdef, state)
    h, z = (jnp.broadcast_to(a, (n_streams,) + a.shape[1:]).reshape((n_streams * B,) + a.shape[2:])
            for a in (h_ABSH, z_ABSH))
    ids = None if ids_BS is None else jnp.broadcast_to(ids_BS, (n_streams,) + ids_BS.shape).reshape(n_streams * B, S)
    variant = None
    if em_A is not None:  # stream n's mask, rows and novices on each of its tokens
        mask, rows, novice = jax.tree.map(lambda a: jnp.repeat(a, B * S, axis=0),
                                          (em_A.mask_E, em_A.rows_E, em_A.novice_E))
        variant = em_A._replace(mask_E=mask, rows_E=rows, novice_E=novice)
    out = layer.feed(Attended(h, z), variant, forward_only=True, ids_BS=ids).out_BSH
    return out.reshape((n_streams, B) + out.shape[1:])

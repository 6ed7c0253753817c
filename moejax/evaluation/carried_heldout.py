"""The carried pass's held-out streams through one decoder layer (`moejax.evaluation.carried`).

At a MoE layer the streams run by *table group*: the variants computing with the same expert
table, stacked into one ExpertMap (`moejax.variants.plan.stacked_expert_map`). The layer's own
experts come first (the unpruned stream, pruned, substituted and sequential pruned variants), then
one group per merge (its router forms; a sequential merge, its own), whose table is in two parts:
the layer's own experts, read in place, and the merge's merged experts of its clusters of two or
more. Those exist only while the group runs (`TableGroup.expert_map` makes them), so beside the
layer's experts at most one merge's merged rows are held.

Each batch's streams [A, B, S, H] are updated in place, group by group (the groups' streams are
disjoint): a call's output is written over its inputs (a donated buffer), its chunks taken last
to first so that a chunk moved back to share one compiled size reads only inputs not yet written.

Layer-local errors (SPEC section 3): one-shot, merged and substituted variants on the unpruned
stream's router inputs z0, against its routed output y0 (computed with the own group: every
pruned variant's columns come from the same expert calls, so a token whose choice a variant leaves
unchanged has error exactly 0; a merge's columns come from calls of their own, so such a token's
error is 0 up to float rounding); sequential variants on their own inputs.

Shape letters as in `moejax/__init__.py`; A is the variants axis.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from moejax.evaluation.carried_layer import (routed_errors, routed_errors_each, routed_errors_vs, stacked_attention,
                                             stacked_mlp, streams_slice)
from moejax.host_memory import release_free_memory
from moejax.moe.expert_map import ExpertMap


@dataclasses.dataclass(frozen=True)
class TableGroup:
    """Held-out streams `streams` (indices into the pass's stream order, ascending) that compute
    with one expert table; expert_map() makes their stacked ExpertMap (None: a dense layer)."""
    streams: list
    expert_map: Callable[[], ExpertMap | None]
    own: bool = True      # the layer's own experts (the group holding the unpruned stream 0)


@functools.partial(jax.jit, donate_argnums=0)
def _put(x_ABSH, at_A, y_ABSH):
    """x with streams `at` replaced by y, in place (x is donated)."""
    return x_ABSH.at[at_A].set(y_ABSH)


def chunks(n: int, chunk: int) -> list[tuple[int, int, int]]:
    """Positions [0, n) in calls of one size: (p0, p1, skip), at most `chunk` positions each
    (balanced), the last moved back to end at n, its first `skip` positions already computed by the
    one before. One size means one compiled program whose every row computes alike: a variant that
    prunes nothing gets the unpruned stream's numbers bitwise (a last call of another size may
    round differently)."""
    size = -(-n // -(-n // chunk))
    return [(min(p0, n - size), min(p0, n - size) + size, p0 - min(p0, n - size)) for p0 in range(0, n, size)]


def carry_heldout(graphdef, state, held: dict, held_carry: dict, held_geo: dict, groups: list[TableGroup] | None,
                  chunk: int, first_seq: int, add_error: Callable | None, held_ids: dict | None = None) -> float:
    """The layer on every held-out stream (held: text -> per batch [A, B, S, H], or [1, B, S, H]
    while every stream is still the unpruned one; replaced by the layer's output; held_carry: what
    the attentions before handed each of them, `DecoderLayer.attend`'s carry, [A or 1, B, ...] or
    None, replaced likewise), `chunk` streams per call, group by group (None: a dense layer), and at
    a MoE layer each variant's layer-local errors, `add_error(stream index, norm [B, S], err [B, S])`.
    first_seq: the first stream measured on its own inputs (sequential variants). Returns the
    unpruned routed output's share of energy at position 0 (NaN at a dense layer, and with
    add_error None: no layer-local error is measured, the streams are only carried). held_ids:
    text -> per batch the token ids [B, S], which a hash-routed layer (DeepSeek-V4's, kept whole:
    groups None) chooses its experts by; None where no layer reads them. The residual may have
    trailing axes beyond H (DeepSeek-V4's hyper-connection streams [A, B, S, W, H])."""
    def ids_of(text, b):
        return None if held_ids is None else held_ids[text][b]

    if groups is None:   # every stream through the same dense layer, in place (held once while unpruned)
        for text, xs in held.items():
            carries = held_carry[text]
            for b, (cos, sin, allowed) in enumerate(held_geo[text]):
                xs[b], carries[b] = _run_group(graphdef, state, xs[b], carries[b], list(range(xs[b].shape[0])), None,
                                               chunk, cos, sin, allowed, {}, ids_BS=ids_of(text, b))
                xs[b].block_until_ready()
        return float("nan")
    n_streams = 1 + max(a for g in groups for a in g.streams)
    energy0, energy = 0.0, 0.0
    shared_hz, ref = {}, {}   # per (text, batch): the unpruned stream's (h, z) while shared; (z0, norm0, y0)
    for g in groups:
        em = g.expert_map()
        for text, xs in held.items():
            carries = held_carry[text]
            for b, (cos, sin, allowed) in enumerate(held_geo[text]):
                hz = shared_hz.get((text, b))
                if hz is None and xs[b].shape[0] == 1 and n_streams > 1:   # every stream still the unpruned one:
                    hz = shared_hz[text, b] = stacked_attention(graphdef, state, xs[b], cos, sin, allowed[0],
                                                                carries[b])
                    xs[b] = jnp.zeros((n_streams,) + xs[b].shape[1:], xs[b].dtype)   # its attention once
                    carries[b] = _each_stream(hz.carry, n_streams)
                z_at = {a: None for a in g.streams if (a == 0 or a >= first_seq) and add_error}   # the router inputs
                out, carries[b] = _run_group(graphdef, state, xs[b], carries[b], g.streams, em, chunk, cos, sin,
                                             allowed, z_at, hz, ids_of(text, b))                # errors need
                if add_error is None:
                    xs[b] = out.block_until_ready()
                    del out
                    continue
                B, S = xs[b].shape[1:3]   # (the residual's trailing axes: H, or DeepSeek-V4's W, H)
                on_unpruned = np.asarray([p for p, a in enumerate(g.streams) if 0 < a < first_seq], np.int32)
                if g.own:  # stream 0: the unpruned router inputs and routed output every variant is measured on
                    z0 = z_at[0].reshape(B * S, -1)
                    norm, err, y0 = routed_errors(graphdef, state, z0, streams_slice(em, on_unpruned))
                    ref[text, b] = z0, norm, y0
                    n = np.asarray(norm, np.float64).reshape(B, S)
                    energy0, energy = energy0 + n[:, 0].sum(), energy + n.sum()
                elif len(on_unpruned):
                    z0, norm, y0 = ref[text, b]
                    err = routed_errors_vs(graphdef, state, z0, y0, streams_slice(em, on_unpruned))
                for i, p in enumerate(on_unpruned):
                    add_error(g.streams[p], norm.reshape(B, S), err[i].reshape(B, S))
                own_inputs = np.asarray([p for p, a in enumerate(g.streams) if a >= first_seq], np.int32)
                if len(own_inputs):  # sequential variants on their own (pruned or merged) inputs
                    norms, errs = routed_errors_each(graphdef, state,
                                                     jnp.stack([z_at[g.streams[p]] for p in own_inputs]),
                                                     streams_slice(em, own_inputs), g.own)
                    for i, p in enumerate(own_inputs):
                        add_error(g.streams[p], norms[i], errs[i])
                # one batch in flight: dispatching ahead would keep every queued call's buffers alive
                xs[b] = out.block_until_ready()
                del out, z_at
                release_free_memory()   # the batch's temporaries
        del em   # a merge's table goes before the next group's is made,
        release_free_memory()   # and its pages with it
    return float(energy0 / energy) if energy else float("nan")


def _each_stream(carry, n_streams: int):
    """A carry held once for every stream ([1, B, ...]) as one per stream ([n_streams, B, ...])."""
    return jax.tree.map(lambda c: c if c.shape[0] == n_streams else jnp.broadcast_to(c, (n_streams,) + c.shape[1:]),
                        carry)


def _run_group(graphdef, state, x, carry, streams: list, em, chunk: int, cos, sin, allowed, z_at: dict, hz=None,
               ids_BS=None):
    """(x, carry) with streams `streams` replaced by the layer's output on them and what its
    attention hands on, in place (x donated), `chunk` per call, the chunks last to first so that a
    chunk reads only streams not yet written; hz: the `Attended` of every stream while they are
    still the unpruned one (x and carry then only receive outputs). Fills each stream of z_at with
    its router input [B, S, H]. ids_BS: the batch's token ids (a hash-routed layer's choice), or None."""
    n_streams = x.shape[0]
    for p0, p1, skip in reversed(chunks(len(streams), chunk)):
        at = np.asarray(streams[p0:p1])
        a = hz if hz is not None else stacked_attention(
            graphdef, state, x[at], cos, sin, allowed[0],
            jax.tree.map(lambda c: c if c.shape[0] == 1 else c[at], carry))
        y = stacked_mlp(graphdef, state, a.h_BSH, a.z_BSH, p1 - p0,
                        None if em is None else streams_slice(em, slice(p0, p1)), ids_BS)
        for i in range(skip, p1 - p0):
            if int(at[i]) in z_at:
                z_at[int(at[i])] = a.z_BSH[0 if hz is not None else i]
        written = jnp.asarray(at[skip:])
        x = _put(x, written, y[skip:])
        if a.carry is not None:
            if carry is None:   # the first layer (every stream at the embeddings: one chunk)
                carry = jax.tree.map(lambda c: jnp.zeros((n_streams,) + c.shape[1:], c.dtype), a.carry)
            carry = jax.tree.map(lambda c, new: _put(c, written, jnp.broadcast_to(new, (p1 - p0,) + new.shape[1:])[skip:]),
                                 carry, a.carry)
    return x, carry

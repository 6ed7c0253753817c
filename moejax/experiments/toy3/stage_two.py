"""toy3's stage two, jitted programs per batch of seeds: route the held-out tokens under every
variant and measure its error against the full layer (SPEC section 3).

  stage_two          the pruning variants: each kept set a mask, one compile for them all
  stage_merges       the merges' shrunk and tied forms and the Eq. 6 pairs: expert maps over a
                     table of the layer's own and the merged experts' outputs
  stage_substitutes  MoNE's variants: removed experts return their constants
"""

from __future__ import annotations

import functools
import logging

from moejax.experiments.toy3.config import Toy3Config
from moejax.experiments.toy3.stage_one import merges_read_table
from moejax.experiments.toy3.variants import layout

log = logging.getLogger(__name__)


def _flat_seed_offset(a):
    """[Z, O, ...] -> [Z * O, ...] (sizes spelt out: -1 is undefined beside a zero-size axis)."""
    return a.reshape(a.shape[0] * a.shape[1], *a.shape[2:])


def _with_unpruned(masks_AE):
    """The masks led by variant 0, which keeps every expert (the full layer)."""
    import jax.numpy as jnp

    return jnp.concatenate([jnp.ones_like(masks_AE[..., :1, :]), masks_AE], axis=-2)


def _errors_against_reference(gate_ATK, row_ATK, rows_MD):
    """(||y_a - y_0||^2 [A - 1, T], ||y_0||^2 [T]): every variant's output y_a, a >= 1, against
    variant 0's, the full layer's, each read from the flat table of pair outputs rows_MD
    (`combine_rows`) by the same code, so a variant that routes and computes a token as the full
    layer does has an error of exactly zero. The reference is computed once and materialised (the
    barrier); the variants' outputs go straight into their errors. (Sliced off all the variants'
    outputs inside the errors' fusion, XLA recomputed the reference for every variant, 4x slower;
    materialising every variant's output, [A, T, D], cost 0.5 s of the merges' 2.4 at toy3's defaults.)"""
    import jax
    import jax.numpy as jnp

    from moejax.moe.dispatch import combine_rows

    y_TD = jax.lax.optimization_barrier(combine_rows(gate_ATK[0], row_ATK[0], rows_MD))
    err_sq_AT = jnp.sum((combine_rows(gate_ATK[1:], row_ATK[1:], rows_MD) - y_TD) ** 2, axis=-1)
    return err_sq_AT, jnp.sum(y_TD ** 2, axis=-1)


@functools.lru_cache(maxsize=8)
def kth_values(cfg: Toy3Config):
    """A jitted function (logits [Z, O, T, E], bias [Z, O, W, E], masks [Z, O, W, A, E]) -> each held-out
    token's K-th largest biased score s + bias under the full layer and every mask [Z, O, W, 1 + A, T].
    The job calls it once for every masked variant (`Layout.n_masked`: the pruning variants, then
    the merges' shrunk forms), and both programs of stage two read their part: one compilation."""
    import jax
    import jax.numpy as jnp

    from moejax.models import toy_layer
    from moejax.moe.topk import kth_largest

    @jax.jit
    def kth_values(logits, bias, masks):
        sel_ZOWET = jnp.swapaxes(toy_layer.router_scores(logits, cfg.router)[:, :, None] + bias[:, :, :, None], -1, -2)
        # the masks go into the network (one expert at a time), not onto a copy of the scores per variant
        return kth_largest(sel_ZOWET[:, :, :, None], cfg.top_k, keep_E=_with_unpruned(masks))

    return kth_values


def _compile_kth_values(cfg: Toy3Config, n_seeds: int) -> tuple:
    """Compile `kth_values(cfg)` for a batch of n_seeds seeds and every masked variant from the
    shapes alone; returns the specs (logits, bias, masks, kth) the programs after it are compiled for."""
    import jax
    import jax.numpy as jnp

    O, W, T, E = len(cfg.offsets), len(cfg.loads), cfg.n_heldout, cfg.n_experts
    logits = jax.ShapeDtypeStruct((n_seeds, O, T, E), jnp.float32)
    bias = jax.ShapeDtypeStruct((n_seeds, O, W, E), jnp.float32)
    masks = jax.ShapeDtypeStruct((n_seeds, O, W, layout(cfg).n_masked, E), jnp.bool_)
    kth = kth_values(cfg)
    kth.lower(logits, bias, masks).compile()
    return logits, bias, masks, jax.eval_shape(kth, logits, bias, masks)


@functools.lru_cache(maxsize=8)
def stage_two(cfg: Toy3Config):
    """Route the held-out tokens under every kept set and measure the error of each variant.
    Returns a function (logits_held, bias, masks, kth, f_held=None, w1=None, w2=None, x_held=None) ->
    (all-token relative error [..., A], per-token relative errors [..., A, T]) of the pruning
    variants, A of them; masks [..., n_masked, E] are every masked variant's and kth
    (`kth_values`) their K-th values, of which it reads the pruning variants'. The median is taken
    on the host (numpy's partition-based median is far cheaper than a sort per variant on the device).
    Without the held-out table f_held (when the merges did not need stage one to make it whole,
    `merges_read_table`), each (seed, offset)'s table is made here from the experts w1, w2 [Z, ...]
    and tokens x_held [Z, O, T, D], in the loop that uses it: a 25 MB table reused, where the
    whole one was 786 MB of fresh memory for every run.

    Routing is `route`'s choice computed without `lax.top_k` (moejax/moe/topk.py, tested equal):
    one jitted call finds each token's K-th largest biased score under every mask (`kth_values`),
    a second reads off the chosen experts and combines their outputs from the held-out table. (Two
    calls, so the K-th values are materialised; fused into their consumer XLA recomputes them per
    expert.)
    The unpruned layer is routed the same way, as variant 0, so a variant that routes every token
    as the full layer does has an error of exactly zero.

    Softmax router: a pruned layer's softmax runs over its kept experts only (what `route` computes
    under a mask, and a physically pruned checkpoint computes). With `norm_topk_prob` neither the
    choice (the top K kept logits, softmax being increasing) nor the gates
    (exp(l_j) / sum over the K chosen of exp(l_i)) depends on that normaliser, so both are read off
    the full layer's softmax over all E; equal to `route` under the mask up to float rounding
    (tests/test_toy3.py checks against numpy's softmax over the kept experts).
    """
    import jax
    import jax.numpy as jnp

    from moejax.models import toy_layer
    from moejax.moe.dispatch import table_rows
    from moejax.moe.routing import gates
    from moejax.moe.topk import topk_indices_at_threshold

    router_cfg = toy_layer.router_config(cfg.top_k, cfg.router)

    def scores(logits):  # s of the unpruned layer: sigmoid, or softmax over all E
        return toy_layer.router_scores(logits, cfg.router)

    # per (seed, offset): [T, E] logits, [W, E] biases, [W, A, E] masks; the loads vmapped
    @functools.partial(jax.vmap, in_axes=(None, None, 0, 0, 0))
    def condition(f_ETD, s_TE, bias_E, masks_AE, kth_AT):
        idx_ATK = topk_indices_at_threshold((s_TE + bias_E).T, kth_AT, cfg.top_k, keep_E=_with_unpruned(masks_AE))
        gate_ATK = gates(s_TE, idx_ATK, router_cfg)
        n_experts, n_tokens, d = f_ETD.shape
        err_sq_AT, y_sq_T = _errors_against_reference(gate_ATK, table_rows(idx_ATK, n_tokens),
                                                      f_ETD.reshape(n_experts * n_tokens, d))
        return err_sq_AT.sum(axis=-1) / y_sq_T.sum(), err_sq_AT / y_sq_T

    n_pruned = len(layout(cfg).pruned)

    @jax.jit
    def errors(logits, bias, masks, kth, f, w1, w2, x):
        n_offsets = logits.shape[1]
        masks, kth = masks[..., :n_pruned, :], kth[..., :1 + n_pruned, :]   # the full layer and the pruning variants

        def seed_offset(args):
            i, logits_TE, bias_WE, masks_WAE, kth_WAT, f_ETD, x_TD = args
            if f_ETD is None:
                s = i // n_offsets
                f_ETD = toy_layer.expert_output_table({"w1": w1[s], "w2": w2[s]}, x_TD)
            return condition(f_ETD, scores(logits_TE), bias_WE, masks_WAE, kth_WAT)

        lead = logits.shape[:2]  # one (seed, offset) at a time bounds memory: [W, A, T, D] outputs
        flat = jax.tree.map(_flat_seed_offset, (logits, bias, masks, kth, f, x))
        rel, per_token = jax.lax.map(seed_offset, (jnp.arange(lead[0] * lead[1]), *flat))
        return rel.reshape(*lead, *rel.shape[1:]), per_token.reshape(*lead, *per_token.shape[1:])

    def run(logits, bias, masks, kth, f_held=None, w1=None, w2=None, x_held=None):
        if f_held is not None:
            w1 = w2 = x_held = None
        return errors(logits, bias, masks, kth, f_held, w1, w2, x_held)

    def compile_for(n_seeds: int) -> None:
        """Compile both programs for a batch of n_seeds seeds, from the shapes alone (`run`'s calls
        then find them compiled)."""
        O, T, E, D, F = len(cfg.offsets), cfg.n_heldout, cfg.n_experts, cfg.d_model, cfg.d_hidden

        def f32(*shape):
            return jax.ShapeDtypeStruct((n_seeds, *shape), jnp.float32)

        logits, bias, masks, kth = _compile_kth_values(cfg, n_seeds)
        table = (f32(O, E, T, D), None, None, None) if merges_read_table(cfg) else (
            None, f32(E, D, F), f32(E, F, D), f32(O, T, D))
        errors.lower(logits, bias, masks, kth, *table).compile()

    run.compile_for = compile_for
    return run


# The merged experts' table rows are computed only for the (row, token) pairs some variant reads
# (`grouped.sparse_output_table`), in blocks of MERGED_BLOCK_ROWS, into a buffer sized for
# MERGED_SHARE of the whole table, plus a block per row for its padding: at toy3's defaults the
# variants read 17-19% of it (the pairs whose token routes to a member of the row's cluster); each
# 0.1 of share the buffer holds costs about 0.2 s of the merges' program even where it is skipped,
# and 256-row blocks ran fastest. A batch that needs more is computed again at full capacity
# (`stage_merges`' run): slower, never wrong.
MERGED_SHARE = 0.25
MERGED_BLOCK_ROWS = 256


def merged_capacity(n_rows: int, n_tokens: int, share: float) -> int:
    """Blocks for `share` of the merged table's n_rows x n_tokens pairs, plus one per row for its
    padding, never more than the whole table needs."""
    from moejax.moe.grouped import full_capacity_blocks

    wanted = -(-int(share * n_rows * n_tokens) // MERGED_BLOCK_ROWS) + n_rows
    return min(wanted, full_capacity_blocks(n_rows, n_tokens, MERGED_BLOCK_ROWS))


@functools.lru_cache(maxsize=8)
def stage_merges(cfg: Toy3Config, share: float = MERGED_SHARE):
    """The merges' variants, as `stage_two` evaluates the pruning ones: route the held-out tokens,
    compute the merged experts on the tokens that reach them and measure each variant's error.
    Returns a function (f_held, logits_held, bias, masks, kth, rows, x_held, merged) -> (sum_t
    ||y'_t - y_t||^2 [..., A], per-token relative errors ||y'_t - y_t||^2 / ||y_t||^2 [..., A, T],
    ||y_t||^2 [..., T], the full layer's routing, experts and gates [..., T, K], and the merged
    (row, token) pairs computed [...]).

    A variant is an expert map. The merges' shrunk forms are routed under their masks (masks,
    kth: every masked variant's, as `stage_two` takes them; it reads the shrunk forms', after the
    pruning variants'); the rest (tied forms, Eq. 6 pairs) keep
    every slot, so they take the full layer's routing. rows [..., A, E]: the row of the table
    [E + W * n_slots, T, D] that each slot computes with: the layer's own experts (f_held), then
    each load's merged experts (merged: {"w1": [..., W, n_slots, D, F], "w2": ...}, None when there
    are none). Per (seed, offset), every load is routed first; then the merged rows are computed
    for the (row, token) pairs some variant of some load reads, and only those
    (`grouped.sparse_output_table`, `MERGED_SHARE`): a token reaches a merged expert only through
    a member of its cluster, and the whole table cost 5.6x the FLOPs.

    The batch of variants is led by the full layer (every slot its own row), its reference
    (`_errors_against_reference`): a merge of singletons has an error of exactly zero
    (tests/test_toy3_merging.py checks it).
    """
    import jax
    import jax.numpy as jnp
    import numpy as np

    from moejax.models import toy_layer
    from moejax.moe.dispatch import relu_mlp, table_rows
    from moejax.moe.grouped import sparse_output_table
    from moejax.moe.routing import gates
    from moejax.moe.topk import topk_indices_at_threshold

    router_cfg = toy_layer.router_config(cfg.top_k, cfg.router)
    lay = layout(cfg)
    n_pruned, n_shrunk = len(lay.pruned), len(lay.merged)
    n_merged_rows = len(cfg.loads) * lay.n_slots
    n_blocks = merged_capacity(n_merged_rows, cfg.n_heldout, share)

    # per load ([W, ...] biases, masks, K-th values, rows; logits shared): every variant's slots
    # [A, T, K], their table rows and gates, and the full layer's routing
    @functools.partial(jax.vmap, in_axes=(None, 0, 0, 0, 0))
    def route(logits_TE, bias_E, masks_AE, kth_AT, rows_AE):
        s_TE = toy_layer.router_scores(logits_TE, cfg.router)
        idx_ATK = topk_indices_at_threshold((s_TE + bias_E).T, kth_AT, cfg.top_k, keep_E=_with_unpruned(masks_AE))
        gate_ATK = gates(s_TE, idx_ATK, router_cfg)
        same = (rows_AE.shape[0] - n_shrunk,) + idx_ATK.shape[1:]
        slot_ATK = jnp.concatenate([idx_ATK, jnp.broadcast_to(idx_ATK[0], same)])
        gate_v_ATK = jnp.concatenate([gate_ATK, jnp.broadcast_to(gate_ATK[0], same)])
        rows_v_AE = jnp.concatenate([jnp.arange(rows_AE.shape[1], dtype=rows_AE.dtype)[None], rows_AE])
        row_ATK = jnp.take_along_axis(rows_v_AE[:, None, :], slot_ATK, axis=-1)  # ExpertMap.apply
        return row_ATK, gate_v_ATK, idx_ATK[0], gate_ATK[0]

    @functools.partial(jax.vmap, in_axes=(None, 0, 0))  # per load, the table shared
    def measure(rows_MD, at_ATK, gate_v_ATK):
        err_sq_AT, y_sq_T = _errors_against_reference(gate_v_ATK, at_ATK, rows_MD)
        return err_sq_AT.sum(axis=-1), err_sq_AT / y_sq_T, y_sq_T

    @jax.jit
    def errors(f, logits, bias, masks, kth, rows, x, merged):
        # the shrunk forms' masks, and the K-th values of the full layer and the shrunk forms
        masks = masks[..., n_pruned:, :]
        kth = jnp.concatenate([kth[..., :1, :], kth[..., 1 + n_pruned:, :]], axis=-2)

        def seed_offset(args):
            f_ETD, x_TD, merged_W, logits_TE, *per_load = args
            row_WATK, gate_v_WATK, idx_WTK, gate_WTK = route(logits_TE, *per_load)
            n_experts, n_tokens, d = f_ETD.shape
            token_T1 = jnp.arange(n_tokens, dtype=row_WATK.dtype)[:, None]
            at_WATK = table_rows(row_WATK, n_tokens)   # the own experts' rows of the flat table
            rows_MD, n_pairs = f_ETD.reshape(n_experts * n_tokens, d), jnp.zeros((), jnp.int32)
            overflow = jnp.zeros((), bool)
            if merged_W is not None:  # every load's merged experts, after the layer's own
                merged_WATK = row_WATK >= n_experts
                selected_ET = jnp.zeros((n_merged_rows, n_tokens), bool).at[
                    jnp.where(merged_WATK, row_WATK - n_experts, n_merged_rows),
                    jnp.broadcast_to(token_T1, row_WATK.shape)].set(True, mode="drop")
                flat = {k: w.reshape(-1, *w.shape[2:]) for k, w in merged_W.items()}
                out = sparse_output_table(x_TD, selected_ET, flat, relu_mlp, n_blocks, MERGED_BLOCK_ROWS)
                at_merged_WATK = n_experts * n_tokens + out.pos_ET[jnp.where(merged_WATK, row_WATK - n_experts, 0),
                                                                   jnp.broadcast_to(token_T1, row_WATK.shape)]
                at_WATK = jnp.where(merged_WATK, at_merged_WATK, at_WATK)
                rows_MD = jnp.concatenate([rows_MD, out.rows_MD])
                n_pairs, overflow = jnp.sum(selected_ET, dtype=jnp.int32), out.overflow
            return (*measure(rows_MD, at_WATK, gate_v_WATK), idx_WTK, gate_WTK, n_pairs, overflow)

        lead = f.shape[:2]  # one (seed, offset) at a time bounds memory: [W, A, T, D] outputs
        flat = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), (f, x, merged, logits, bias, masks, kth, rows))
        out = jax.lax.map(seed_offset, flat)
        return jax.tree.map(lambda a: a.reshape(*lead, *a.shape[1:]), out)

    def run(f, logits, bias, masks, kth, rows, x=None, merged=None):
        *out, overflow = errors(f, logits, bias, masks, kth, rows, x, merged)
        if share < 1 and np.any(jax.device_get(overflow)):   # more pairs than the capacity: all of them
            log.info("toy3: the merged experts' pairs overflowed a buffer for %.0f%% of the table; computing "
                     "them again at full capacity (slower, the same results)", 100 * share)
            return stage_merges(cfg, 1.0)(f, logits, bias, masks, kth, rows, x, merged)
        return tuple(out)

    def compile_for(n_seeds: int) -> None:
        """Compile both programs for a batch of n_seeds seeds from the shapes alone (as
        `stage_two`'s compile_for; `run`'s calls then find them compiled)."""
        O, W, T, E = len(cfg.offsets), len(cfg.loads), cfg.n_heldout, cfg.n_experts
        D, F = cfg.d_model, cfg.d_hidden

        def spec(dtype, *shape):
            return jax.ShapeDtypeStruct((n_seeds, *shape), dtype)

        logits, bias, masks, kth = _compile_kth_values(cfg, n_seeds)
        merged = {"w1": spec(jnp.float32, O, W, lay.n_slots, D, F),
                  "w2": spec(jnp.float32, O, W, lay.n_slots, F, D)} if lay.n_slots else None
        errors.lower(spec(jnp.float32, O, E, T, D), logits, bias, masks, kth, spec(jnp.int32, O, W, lay.n_mapped, E),
                     None if merged is None else spec(jnp.float32, O, T, D), merged).compile()

    run.compile_for = compile_for
    return run


@functools.lru_cache(maxsize=8)
def stage_substitutes(cfg: Toy3Config):
    """MoNE's variants: every router slot remains, so a held-out token is routed as the full layer
    routes it, and a chosen slot whose expert was removed (a novice) returns its constant instead
    of f_j(x): y'_t - y_t = sum_k g_tk novice[i_tk] (c_{i_tk} - f_{i_tk}(x_t)). Returns a jitted
    function (f_held [Z, O, E, T, D], logits_held, bias [Z, O, W, E], novice [Z, O, W, A, E],
    constants [Z, O, W, E, D]) -> (sum_t ||y'_t - y_t||^2 [..., A], per-token relative errors
    [..., A, T], ||y_t||^2 [..., T])."""
    import jax
    import jax.numpy as jnp

    from moejax.models import toy_layer
    from moejax.moe.routing import route

    router_cfg = toy_layer.router_config(cfg.top_k, cfg.router)

    @functools.partial(jax.vmap, in_axes=(None, None, 0, 0, 0))   # over the loads
    def condition(f_ETD, logits_TE, bias_E, novice_AE, c_ED):
        r = route(logits_TE, router_cfg, bias_E if cfg.has_balance_bias else None)
        idx_TK, gate_TK = r.expert_idx_TK, r.gate_TK
        f_TKD = f_ETD[idx_TK, jnp.arange(idx_TK.shape[0])[:, None]]
        y_TD = jnp.einsum("tk,tkd->td", gate_TK, f_TKD)
        swap_ATK = novice_AE[:, idx_TK] * gate_TK
        err_AT = jnp.sum(jnp.einsum("atk,tkd->atd", swap_ATK, c_ED[idx_TK] - f_TKD) ** 2, axis=-1)
        y_sq_T = jnp.sum(y_TD ** 2, axis=-1)
        return err_AT.sum(axis=-1), err_AT / y_sq_T, y_sq_T

    @jax.jit
    def run(f, logits, bias, novice, constants):
        lead = f.shape[:2]   # one (seed, offset) at a time
        flat = jax.tree.map(_flat_seed_offset, (f, logits, bias, novice, constants))
        out = jax.lax.map(lambda args: condition(*args), flat)
        return jax.tree.map(lambda a: a.reshape(*lead, *a.shape[1:]), out)

    return run

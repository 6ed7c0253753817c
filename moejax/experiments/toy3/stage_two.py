"""toy3's stage two, jitted programs per batch of seeds: route the held-out tokens under every
variant and measure its error against the full layer (SPEC section 3).

  stage_two          the pruning variants (`PruningProgram`): each kept set a mask, one compile
                     for them all
  stage_merges       the merges' shrunk and tied forms and the Eq. 6 pairs (`MergesProgram`):
                     expert maps over a table of the layer's own and the merged experts' outputs
  stage_substitutes  MoNE's variants: removed experts return their constants

`stage_two` and `stage_merges` return their program made once per config (cached): an object
called on a batch, whose `compile_for(n_seeds)` compiles it ahead from the shapes alone
(`job._compile_ahead`); the jitted bodies are the module's functions `_pruning_errors` and
`_merges_errors`, one (seed, offset) at a time.
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
def stage_two(cfg: Toy3Config) -> PruningProgram:
    """The pruning variants' program for `cfg` (`PruningProgram`), made once per config: its calls
    and `compile_for` share one jitted function, so a program compiled ahead is the one called."""
    return PruningProgram(cfg)


class PruningProgram:
    """Route the held-out tokens under every kept set and measure the error of each variant.
    Called as (logits_held, bias, masks, kth, f_held=None, w1=None, w2=None, x_held=None) ->
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

    def __init__(self, cfg: Toy3Config):
        import jax

        self.cfg = cfg
        self.errors = jax.jit(functools.partial(_pruning_errors, cfg))

    def __call__(self, logits, bias, masks, kth, f_held=None, w1=None, w2=None, x_held=None):
        if f_held is not None:
            w1 = w2 = x_held = None
        return self.errors(logits, bias, masks, kth, f_held, w1, w2, x_held)

    def compile_for(self, n_seeds: int) -> None:
        """Compile both programs for a batch of n_seeds seeds, from the shapes alone (the calls
        then find them compiled)."""
        import jax
        import jax.numpy as jnp

        cfg = self.cfg
        O, T, E, D, F = len(cfg.offsets), cfg.n_heldout, cfg.n_experts, cfg.d_model, cfg.d_hidden

        def f32(*shape):
            return jax.ShapeDtypeStruct((n_seeds, *shape), jnp.float32)

        logits, bias, masks, kth = _compile_kth_values(cfg, n_seeds)
        table = (f32(O, E, T, D), None, None, None) if merges_read_table(cfg) else (
            None, f32(E, D, F), f32(E, F, D), f32(O, T, D))
        self.errors.lower(logits, bias, masks, kth, *table).compile()


def _pruning_errors(cfg: Toy3Config, logits, bias, masks, kth, f, w1, w2, x):
    """`PruningProgram`'s jitted body: one (seed, offset) at a time (`_pruning_seed_offset`), which
    bounds memory ([W, A, T, D] outputs)."""
    import jax
    import jax.numpy as jnp

    n_pruned = len(layout(cfg).pruned)
    n_offsets = logits.shape[1]
    masks, kth = masks[..., :n_pruned, :], kth[..., :1 + n_pruned, :]   # the full layer and the pruning variants
    seed_offset = functools.partial(_pruning_seed_offset, cfg, n_offsets, w1, w2)
    lead = logits.shape[:2]
    flat = jax.tree.map(_flat_seed_offset, (logits, bias, masks, kth, f, x))
    rel, per_token = jax.lax.map(seed_offset, (jnp.arange(lead[0] * lead[1]), *flat))
    return rel.reshape(*lead, *rel.shape[1:]), per_token.reshape(*lead, *per_token.shape[1:])


def _pruning_seed_offset(cfg: Toy3Config, n_offsets: int, w1, w2, args):
    """One (seed, offset): its held-out table (tabulated here when not given), then every load's
    errors (`_pruning_condition`, vmapped over the loads)."""
    import jax

    from moejax.models import toy_layer

    i, logits_TE, bias_WE, masks_WAE, kth_WAT, f_ETD, x_TD = args
    if f_ETD is None:
        s = i // n_offsets
        f_ETD = toy_layer.expert_output_table({"w1": w1[s], "w2": w2[s]}, x_TD)
    condition = jax.vmap(functools.partial(_pruning_condition, cfg), in_axes=(None, None, 0, 0, 0))
    # s of the unpruned layer: sigmoid, or softmax over all E
    return condition(f_ETD, toy_layer.router_scores(logits_TE, cfg.router), bias_WE, masks_WAE, kth_WAT)


def _pruning_condition(cfg: Toy3Config, f_ETD, s_TE, bias_E, masks_AE, kth_AT):
    """Per (seed, offset, load): [T, E] scores, [E] bias, [A, E] masks -> (all-token relative error
    [A], per-token relative errors [A, T])."""
    from moejax.models import toy_layer
    from moejax.moe.dispatch import table_rows
    from moejax.moe.routing import gates
    from moejax.moe.topk import topk_indices_at_threshold

    router_cfg = toy_layer.router_config(cfg.top_k, cfg.router)
    idx_ATK = topk_indices_at_threshold((s_TE + bias_E).T, kth_AT, cfg.top_k, keep_E=_with_unpruned(masks_AE))
    gate_ATK = gates(s_TE, idx_ATK, router_cfg)
    n_experts, n_tokens, d = f_ETD.shape
    err_sq_AT, y_sq_T = _errors_against_reference(gate_ATK, table_rows(idx_ATK, n_tokens),
                                                  f_ETD.reshape(n_experts * n_tokens, d))
    return err_sq_AT.sum(axis=-1) / y_sq_T.sum(), err_sq_AT / y_sq_T


# The merged experts' table rows are computed only for the (row, token) pairs some variant reads
# (`grouped.sparse_output_table`), in blocks of MERGED_BLOCK_ROWS, into a buffer sized for
# MERGED_SHARE of the whole table, plus a block per row for its padding: at toy3's defaults the
# variants read 17-19% of it (the pairs whose token routes to a member of the row's cluster); each
# 0.1 of share the buffer holds costs about 0.2 s of the merges' program even where it is skipped,
# and 256-row blocks ran fastest. A batch that needs more is computed again at full capacity
# (`MergesProgram.__call__`): slower, never wrong.
MERGED_SHARE = 0.25
MERGED_BLOCK_ROWS = 256


def merged_capacity(n_rows: int, n_tokens: int, share: float) -> int:
    """Blocks for `share` of the merged table's n_rows x n_tokens pairs, plus one per row for its
    padding, never more than the whole table needs."""
    from moejax.moe.grouped import full_capacity_blocks

    wanted = -(-int(share * n_rows * n_tokens) // MERGED_BLOCK_ROWS) + n_rows
    return min(wanted, full_capacity_blocks(n_rows, n_tokens, MERGED_BLOCK_ROWS))


@functools.lru_cache(maxsize=8)
def stage_merges(cfg: Toy3Config, share: float = MERGED_SHARE) -> MergesProgram:
    """The merges' program for `cfg` with a buffer for `share` of the merged table
    (`MergesProgram`), made once per (config, share): its calls and `compile_for` share one jitted
    function, so a program compiled ahead is the one called."""
    return MergesProgram(cfg, share)


class MergesProgram:
    """The merges' variants, as `PruningProgram` evaluates the pruning ones: route the held-out
    tokens, compute the merged experts on the tokens that reach them and measure each variant's
    error. Called as (f_held, logits_held, bias, masks, kth, rows, x_held, merged) -> (sum_t
    ||y'_t - y_t||^2 [..., A], per-token relative errors ||y'_t - y_t||^2 / ||y_t||^2 [..., A, T],
    ||y_t||^2 [..., T], the full layer's routing, experts and gates [..., T, K], and the merged
    (row, token) pairs computed [...]).

    A variant is an expert map. The merges' shrunk forms are routed under their masks (masks,
    kth: every masked variant's, as `PruningProgram` takes them; it reads the shrunk forms', after
    the pruning variants'); the rest (tied forms, Eq. 6 pairs) keep
    every slot, so they take the full layer's routing. rows [..., A, E]: the row of the table
    [E + W * n_slots, T, D] that each slot computes with: the layer's own experts (f_held), then
    each load's merged experts (merged: {"w1": [..., W, n_slots, D, F], "w2": ...}, None when there
    are none). Per (seed, offset), every load is routed first; then the merged rows are computed
    for the (row, token) pairs some variant of some load reads, and only those
    (`grouped.sparse_output_table`, `MERGED_SHARE`): a token reaches a merged expert only through
    a member of its cluster, and the whole table cost 5.6x the FLOPs. A batch with more pairs than
    the buffer holds is computed again by the full-capacity program (share 1).

    The batch of variants is led by the full layer (every slot its own row), its reference
    (`_errors_against_reference`): a merge of singletons has an error of exactly zero
    (tests/test_toy3_merging.py checks it).
    """

    def __init__(self, cfg: Toy3Config, share: float = MERGED_SHARE):
        import jax

        self.cfg, self.share = cfg, share
        n_blocks = merged_capacity(len(cfg.loads) * layout(cfg).n_slots, cfg.n_heldout, share)
        self.errors = jax.jit(functools.partial(_merges_errors, cfg, n_blocks))

    def __call__(self, f, logits, bias, masks, kth, rows, x=None, merged=None):
        import jax
        import numpy as np

        *out, overflow = self.errors(f, logits, bias, masks, kth, rows, x, merged)
        if self.share < 1 and np.any(jax.device_get(overflow)):   # more pairs than the capacity: all of them
            log.info("toy3: the merged experts' pairs overflowed a buffer for %.0f%% of the table; computing "
                     "them again at full capacity (slower, the same results)", 100 * self.share)
            return stage_merges(self.cfg, 1.0)(f, logits, bias, masks, kth, rows, x, merged)
        return tuple(out)

    def compile_for(self, n_seeds: int) -> None:
        """Compile both programs for a batch of n_seeds seeds from the shapes alone (as
        `PruningProgram.compile_for`; the calls then find them compiled)."""
        import jax
        import jax.numpy as jnp

        cfg, lay = self.cfg, layout(self.cfg)
        O, W, T, E = len(cfg.offsets), len(cfg.loads), cfg.n_heldout, cfg.n_experts
        D, F = cfg.d_model, cfg.d_hidden

        def spec(dtype, *shape):
            return jax.ShapeDtypeStruct((n_seeds, *shape), dtype)

        logits, bias, masks, kth = _compile_kth_values(cfg, n_seeds)
        merged = {"w1": spec(jnp.float32, O, W, lay.n_slots, D, F),
                  "w2": spec(jnp.float32, O, W, lay.n_slots, F, D)} if lay.n_slots else None
        self.errors.lower(spec(jnp.float32, O, E, T, D), logits, bias, masks, kth,
                          spec(jnp.int32, O, W, lay.n_mapped, E),
                          None if merged is None else spec(jnp.float32, O, T, D), merged).compile()


def _merges_errors(cfg: Toy3Config, n_blocks: int, f, logits, bias, masks, kth, rows, x, merged):
    """`MergesProgram`'s jitted body: one (seed, offset) at a time (`_merges_seed_offset`), which
    bounds memory ([W, A, T, D] outputs)."""
    import jax
    import jax.numpy as jnp

    n_pruned = len(layout(cfg).pruned)
    # the shrunk forms' masks, and the K-th values of the full layer and the shrunk forms
    masks = masks[..., n_pruned:, :]
    kth = jnp.concatenate([kth[..., :1, :], kth[..., 1 + n_pruned:, :]], axis=-2)
    seed_offset = functools.partial(_merges_seed_offset, cfg, n_blocks)
    lead = f.shape[:2]
    flat = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), (f, x, merged, logits, bias, masks, kth, rows))
    out = jax.lax.map(seed_offset, flat)
    return jax.tree.map(lambda a: a.reshape(*lead, *a.shape[1:]), out)


def _merges_seed_offset(cfg: Toy3Config, n_blocks: int, args):
    """One (seed, offset): every load routed (`_route_load`), the merged rows computed for the
    pairs some variant reads (`_merged_rows`), every load's errors (`_measure_load`)."""
    import jax
    import jax.numpy as jnp

    from moejax.moe.dispatch import table_rows

    f_ETD, x_TD, merged_W, logits_TE, *per_load = args
    route = jax.vmap(functools.partial(_route_load, cfg), in_axes=(None, 0, 0, 0, 0))   # logits shared
    row_WATK, gate_v_WATK, idx_WTK, gate_WTK = route(logits_TE, *per_load)
    n_experts, n_tokens, d = f_ETD.shape
    token_T1 = jnp.arange(n_tokens, dtype=row_WATK.dtype)[:, None]
    at_WATK = table_rows(row_WATK, n_tokens)   # the own experts' rows of the flat table
    rows_MD, n_pairs = f_ETD.reshape(n_experts * n_tokens, d), jnp.zeros((), jnp.int32)
    overflow = jnp.zeros((), bool)
    if merged_W is not None:  # every load's merged experts, after the layer's own
        at_WATK, rows_MD, n_pairs, overflow = _merged_rows(cfg, n_blocks, n_experts, x_TD, merged_W, row_WATK,
                                                           token_T1, at_WATK, rows_MD)
    measure = jax.vmap(_measure_load, in_axes=(None, 0, 0))   # per load, the table shared
    return (*measure(rows_MD, at_WATK, gate_v_WATK), idx_WTK, gate_WTK, n_pairs, overflow)


def _route_load(cfg: Toy3Config, logits_TE, bias_E, masks_AE, kth_AT, rows_AE):
    """Per load (its bias, masks, K-th values and rows; the logits shared): every variant's slots
    [A, T, K], their table rows and gates, and the full layer's routing."""
    import jax.numpy as jnp

    from moejax.models import toy_layer
    from moejax.moe.routing import gates
    from moejax.moe.topk import topk_indices_at_threshold

    router_cfg = toy_layer.router_config(cfg.top_k, cfg.router)
    n_shrunk = len(layout(cfg).merged)
    s_TE = toy_layer.router_scores(logits_TE, cfg.router)
    idx_ATK = topk_indices_at_threshold((s_TE + bias_E).T, kth_AT, cfg.top_k, keep_E=_with_unpruned(masks_AE))
    gate_ATK = gates(s_TE, idx_ATK, router_cfg)
    same = (rows_AE.shape[0] - n_shrunk,) + idx_ATK.shape[1:]
    slot_ATK = jnp.concatenate([idx_ATK, jnp.broadcast_to(idx_ATK[0], same)])
    gate_v_ATK = jnp.concatenate([gate_ATK, jnp.broadcast_to(gate_ATK[0], same)])
    rows_v_AE = jnp.concatenate([jnp.arange(rows_AE.shape[1], dtype=rows_AE.dtype)[None], rows_AE])
    row_ATK = jnp.take_along_axis(rows_v_AE[:, None, :], slot_ATK, axis=-1)  # ExpertMap.apply
    return row_ATK, gate_v_ATK, idx_ATK[0], gate_ATK[0]


def _merged_rows(cfg: Toy3Config, n_blocks: int, n_experts: int, x_TD, merged_W, row_WATK, token_T1, at_WATK,
                 rows_MD):
    """Every load's merged experts computed on the (row, token) pairs some variant reads
    (`sparse_output_table`), appended to the flat table rows_MD: (each slot's position in the
    table, the table, the pairs computed, whether they overflowed the buffer)."""
    import jax.numpy as jnp

    from moejax.moe.dispatch import relu_mlp
    from moejax.moe.grouped import sparse_output_table

    n_merged_rows, n_tokens = len(cfg.loads) * layout(cfg).n_slots, token_T1.shape[0]
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
    return at_WATK, rows_MD, jnp.sum(selected_ET, dtype=jnp.int32), out.overflow


def _measure_load(rows_MD, at_ATK, gate_v_ATK):
    """Per load (the table shared): (sum_t of each variant's squared error [A], its per-token
    relative errors [A, T], ||y_t||^2 [T])."""
    err_sq_AT, y_sq_T = _errors_against_reference(gate_v_ATK, at_ATK, rows_MD)
    return err_sq_AT.sum(axis=-1), err_sq_AT / y_sq_T, y_sq_T


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

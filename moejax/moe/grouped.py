"""Routed experts on one device: the pair-output implementations behind `moejax.moe.dispatch`'s
"dense" (the oracle), "sorted" (block-padded grouped matmul in plain XLA) and "ragged"
(`jax.lax.ragged_dot`) backends, and the per-expert output table. The expert-parallel backend
(`moejax.moe.expert_parallel`) runs `sorted_pair_outputs` on each device's own experts.

Experts are a pure `expert_fn(linear, w, x)` (see `moejax.moe.dispatch.swiglu`); `linear` is the
matmul to use, so the same function runs vmapped as the oracle and blocked as a grouped matmul.

An expert table is {name: [R, ...]}, or a table *in parts*: a tuple of parts whose rows are
numbered on from one part to the next, the first such a table and each later one a table or an
`AveragedRows` over the first (rows made from the first part's when read: the carried pass's
merge, the layer's own experts then its merged experts, neither ever copied into the other). The
exact forward-only loop reads the parts in place, making an averaged row when it reaches it; every
other path joins them first (`joined`).
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from moejax.moe.averaged_rows import AveragedRows

Linear = Callable[..., jax.Array]  # linear(x, w, b=None): x @ w (+ b), for one expert or a block of rows


def _plus(y, b):
    return y if b is None else y + b
ExpertFn = Callable[[Linear, dict, jax.Array], jax.Array]


def _matmul(x, w, b=None):
    return _plus(jnp.matmul(x, w, precision=jax.lax.Precision.HIGHEST), b)


def _parts(table) -> tuple:
    return table if isinstance(table, tuple) else (table,)


def _part_rows(part) -> int:
    return part.n_rows if isinstance(part, AveragedRows) else jax.tree.leaves(part)[0].shape[0]


def table_rows(table) -> int:
    """The number of rows of an expert table (or of a table in parts, all parts together)."""
    return sum(_part_rows(part) for part in _parts(table))


def joined(table) -> dict:
    """A table in parts as one table (a copy, averaged rows made); a table as it is."""
    parts = _parts(table)
    if len(parts) == 1:
        return parts[0]
    made = [p.materialize(parts[0]) if isinstance(p, AveragedRows) else p for p in parts]
    return {k: jnp.concatenate([part[k] for part in made]) for k in parts[0]}


def expert_output_table(x_TD: jax.Array, weights: dict, expert_fn: ExpertFn) -> jax.Array:
    """f_j(x_t) for every expert and every token, expert-major: [E, T, D].

    A loop over experts (`lax.map`), so each expert's matmuls run as whole GEMMs: XLA:CPU ran the
    vmapped form (one batched dot over the experts) at about half the speed. Call it outside
    `vmap` for that reason (vmapped, the loop body becomes a batched dot again).
    """
    return jax.lax.map(lambda w: expert_fn(_matmul, w, x_TD), weights)


def all_expert_outputs(x_TD: jax.Array, weights: dict, expert_fn: ExpertFn) -> jax.Array:
    """f_j(x_t) for every token and every expert: [T, E, D]."""
    return jnp.swapaxes(expert_output_table(x_TD, weights, expert_fn), 0, 1)


class SelectedOutputs(NamedTuple):
    """`sparse_output_table`'s result: the selected pairs' outputs rows_MD [M, D], pair (e, t) at
    row pos_ET[e, t] (meaningful where selected), and whether the selection overflowed the capacity
    (then rows past it were never computed, and the result must not be read)."""

    rows_MD: jax.Array
    pos_ET: jax.Array
    overflow: jax.Array


def full_capacity_blocks(n_experts: int, n_tokens: int, block_rows: int) -> int:
    """The blocks `sparse_output_table` needs when every pair is selected (it never overflows)."""
    return n_experts * -(-n_tokens // block_rows)


def sparse_output_table(x_TD: jax.Array, selected_ET: jax.Array, weights: dict, expert_fn: ExpertFn,
                        n_blocks: int, block_rows: int, group_blocks: int = 16) -> SelectedOutputs:
    """f_e(x_t) for the (expert, token) pairs `selected_ET` marks, and no other: what
    `expert_output_table` computes, where most of the table would go unread.

    Each expert's selected tokens, in token order, are padded to whole blocks of `block_rows`; the
    blocks go one after another, expert by expert, into a buffer of `n_blocks` blocks (a static
    capacity: the selection is data, rounded up to whole groups of `group_blocks`). Each group of
    blocks is one batched matmul, every block with its expert's weights (gathered per block, as the
    sorted backend's small experts are); groups past the last used block are skipped. Selections
    needing more blocks than n_blocks overflow: `overflow` says so, and the caller computes again
    with more (`full_capacity_blocks` always suffices)."""
    n_experts, n_tokens = selected_ET.shape
    n_groups = -(-n_blocks // group_blocks)
    capacity = n_groups * group_blocks * block_rows
    sizes_E = jnp.sum(selected_ET, axis=1, dtype=jnp.int32)
    padded_E = -(-sizes_E // block_rows) * block_rows
    ends_E = jnp.cumsum(padded_E)
    pos_ET = (ends_E - padded_E)[:, None] + jnp.cumsum(selected_ET, axis=1, dtype=jnp.int32) - 1
    token_M = jnp.zeros((capacity,), jnp.int32).at[jnp.where(selected_ET, pos_ET, capacity)].set(
        jnp.broadcast_to(jnp.arange(n_tokens, dtype=jnp.int32), (n_experts, n_tokens)), mode="drop")
    starts_Y = jnp.arange(n_groups * group_blocks, dtype=jnp.int32) * block_rows
    block_expert_Y = jnp.minimum(jnp.searchsorted(ends_E, starts_Y, side="right"), n_experts - 1)
    group_rows = group_blocks * block_rows
    out = jax.eval_shape(lambda w: expert_fn(_matmul, w, x_TD[:1]), jax.tree.map(lambda w: w[0], weights))
    skip = jnp.zeros((group_blocks, block_rows, out.shape[-1]), out.dtype)

    def group(args):  # one group of blocks, its inputs gathered as it runs
        g, token_M, block_expert_Y = args

        def compute():
            x_YMD = x_TD[token_M].reshape(group_blocks, block_rows, -1)
            return expert_fn(_gathered_block_linear(block_expert_Y), weights, x_YMD)

        return jax.lax.cond(g * group_rows < ends_E[-1], compute, lambda: skip)

    y = jax.lax.map(group, (jnp.arange(n_groups), token_M.reshape(n_groups, group_rows),
                            block_expert_Y.reshape(n_groups, group_blocks)))
    return SelectedOutputs(y.reshape(capacity, -1), pos_ET, ends_E[-1] > capacity)


def _gathered_block_linear(block_expert_Y):
    """A `linear` over blocks [Y, M, I] whose weights [E, I, J] are gathered per block (block y
    with expert block_expert_Y[y]): for small experts, gathering each block's weights costs no
    more than its activations, and one batched matmul over all blocks beats a loop."""
    def block_linear(h_YMI, w_EIJ, b_EJ=None):
        y = jnp.einsum("ymi,yij->ymj", h_YMI, w_EIJ[block_expert_Y], precision=jax.lax.Precision.HIGHEST)
        return y if b_EJ is None else y + b_EJ[block_expert_Y][:, None, :]

    return block_linear


def dense_pair_outputs(x_TD, expert_idx_TK, weights, expert_fn):
    """Oracle: compute every expert on every token, keep the routed pairs. [T, K, D]."""
    f_TED = all_expert_outputs(x_TD, weights, expert_fn)
    return jnp.take_along_axis(f_TED, expert_idx_TK[..., None], axis=1)


def _sort_by_expert(expert_idx_TK: jax.Array, n_experts: int):
    """Pairs (m = t * K + k) ordered by expert, token order kept within an expert; and group sizes."""
    flat_M = expert_idx_TK.reshape(-1)
    order_M = jnp.argsort(flat_M, stable=True)
    group_sizes_E = jnp.zeros((n_experts,), jnp.int32).at[flat_M].add(1)
    return flat_M, order_M, group_sizes_E


class BlockLayout:
    """Where each routed pair sits in the expert-sorted, block-padded buffer.

    pair_slot_M: buffer row of pair m (m = t * K + k)
    row_pair_R: the pair in buffer row r (n_pairs on the padding rows)
    block_expert_Y: the expert that owns block n (trailing unused blocks point at E-1; their rows are
      zero and nobody reads them back)
    """

    def __init__(self, expert_idx_TK: jax.Array, n_experts: int, block_rows: int):
        flat_M, order_M, group_sizes_E = _sort_by_expert(expert_idx_TK, n_experts)
        n_pairs = flat_M.shape[0]
        self.block_rows = block_rows
        self.n_blocks = -(-(n_pairs + n_experts * (block_rows - 1)) // block_rows)
        padded_E = -(-group_sizes_E // block_rows) * block_rows
        padded_end_E = jnp.cumsum(padded_E)
        group_start_E = jnp.cumsum(group_sizes_E) - group_sizes_E
        sorted_expert_M = flat_M[order_M]
        rank_in_group_M = jnp.arange(n_pairs, dtype=jnp.int32) - group_start_E[sorted_expert_M]
        slot_sorted_M = padded_end_E[sorted_expert_M] - padded_E[sorted_expert_M] + rank_in_group_M
        self.pair_slot_M = jnp.zeros((n_pairs,), jnp.int32).at[order_M].set(slot_sorted_M)
        # the inverse map, buffer row -> pair (n_pairs on padding rows): both directions are gathers
        self.row_pair_R = jnp.full((self.n_blocks * block_rows,), n_pairs, jnp.int32).at[slot_sorted_M].set(order_M)
        block_start_Y = jnp.arange(self.n_blocks, dtype=jnp.int32) * block_rows
        self.block_expert_Y = jnp.minimum(
            jnp.searchsorted(padded_end_E, block_start_Y, side="right"), n_experts - 1).astype(jnp.int32)
        self.group_sizes_E = group_sizes_E
        self._padded_end_E = padded_end_E

    def blocks_before_group(self, group: int) -> jax.Array:
        """How many blocks the groups before `group` fill (a traced scalar)."""
        return self._padded_end_E[group - 1] // self.block_rows


# Pairs into the block buffer and back. Each map is the other's transpose (a partial permutation:
# the buffer's padding rows are nobody's), so each one's gradient is the other, a gather both ways.
# Written through `.at[].set` and indexing, XLA:CPU differentiates them into scatter-adds, which
# cost a training step of the skills model about 5% (docs/perf-notes.md). Being custom-VJP
# functions, they take reverse-mode gradients only (`jax.jvp` through the sorted dispatch raises).
@jax.custom_vjp
def pairs_to_blocks(p_MD: jax.Array, pair_slot_M: jax.Array, row_pair_R: jax.Array) -> jax.Array:
    """The buffer [R, D]: row r holds pair row_pair_R[r], zeros on padding rows."""
    return jnp.take(p_MD, row_pair_R, axis=0, mode="fill", fill_value=0)


@jax.custom_vjp
def blocks_to_pairs(buf_RD: jax.Array, pair_slot_M: jax.Array, row_pair_R: jax.Array) -> jax.Array:
    """The pairs [M, D]: pair m is buffer row pair_slot_M[m]."""
    return jnp.take(buf_RD, pair_slot_M, axis=0)


pairs_to_blocks.defvjp(lambda p, slot, row: (pairs_to_blocks(p, slot, row), (slot, row)),
                       lambda res, ct: (blocks_to_pairs(ct, *res), None, None))
blocks_to_pairs.defvjp(lambda b, slot, row: (blocks_to_pairs(b, slot, row), (slot, row)),
                       lambda res, ct: (pairs_to_blocks(ct, *res), None, None))


# The exact forward-only loop pays per expert (a loop iteration, a copy of its weights) to save
# block padding: worth it for large experts (Moonlight's 2048 x 1408), not for small ones (measured
# on the train_tiny model, 128 x 64: the block loop ran a [8, 128]-token forward in 31 ms against 72
# and compiled in 3.6-4.7 s against 5-13 s).
EXACT_LOOP_MIN_WEIGHTS = 1 << 18


def large_experts(weights) -> bool:
    """Experts large enough for the exact forward-only loop (every matrix at least
    EXACT_LOOP_MIN_WEIGHTS numbers)."""
    return min(math.prod(w.shape[1:]) for w in jax.tree.leaves(_parts(weights)[0])) >= EXACT_LOOP_MIN_WEIGHTS


def gathered_blocks(weights, block_rows: int) -> bool:
    """Whether blocks of `block_rows` rows take their experts' weights gathered per block (one
    batched matmul over all blocks) rather than a loop over blocks reading them in place: when no
    matrix of one expert [I, J] holds more numbers than a block's rows in and out, I J <= B (I + J)
    (small experts: the toy's, the trained tiny models' 128 x 64; not Moonlight's 2048 x 1408)."""
    def small(w):
        i, j = (1, w.shape[-1]) if w.ndim < 3 else w.shape[-2:]
        return i * j <= block_rows * (i + j)

    return all(small(w) for w in jax.tree.leaves(weights))


def _default_block_rows(n_pairs: int, n_experts: int, weights) -> int:
    """Rows per block, balancing padded compute (about E * B / 2 rows) against per-block weight
    cost (n_blocks * D * F): the minimum of a * (M + E B / 2) + b * (M / B + E) is at
    B = sqrt(2 M b / (E a)). Measured on a 2-core CPU: b/a ~ 20 when every block's weights are
    gathered for one batched matmul (small experts: the toy; the skills model's training step ran
    3-7% faster with 64-row blocks than 128, docs/perf-notes.md), b/a ~ 80 when large experts are read in place by a loop
    over blocks (Moonlight-sized experts, scripts/bench_score.py)."""
    def rule(cost_ratio):
        b = int(max(8, min(256, (2 * cost_ratio * n_pairs / n_experts) ** 0.5)))
        return 1 << (b.bit_length() - 1)

    small = rule(20)
    return small if gathered_blocks(weights, small) else rule(80)


def sorted_pair_outputs(x_TD, expert_idx_TK, weights, expert_fn, block_rows: int | None = None,
                        forward_only: bool = False, absent: bool = False):
    """Only the routed pairs, as a block-sparse grouped matmul. [T, K, D].

    absent: pairs whose expert index is E (one past the last expert) are absent and output zeros
      (an expert-parallel shard's pairs that other shards compute; a second routing's pairs that
      the first already computed). They are laid out after every expert's blocks.
    forward_only: absent pairs allowed, and large experts (each matrix at least
      EXACT_LOOP_MIN_WEIGHTS numbers) run exactly, without block padding (`_exact_expert_loop`:
      dynamic trip counts, so no reverse-mode gradient)."""
    n_tokens, top_k = expert_idx_TK.shape
    n_experts = jax.tree.leaves(weights)[0].shape[0]
    absent = absent or forward_only
    block_rows = block_rows or _default_block_rows(n_tokens * top_k, n_experts, weights)
    if forward_only and large_experts(weights):
        return _exact_expert_loop(x_TD, expert_idx_TK, weights, expert_fn)
    layout = BlockLayout(expert_idx_TK, n_experts + 1 if absent else n_experts, block_rows)
    block_expert_Y = jnp.minimum(layout.block_expert_Y, n_experts - 1)
    rows = layout.n_blocks * block_rows
    x_MD = jnp.broadcast_to(x_TD[:, None], (n_tokens, top_k, x_TD.shape[-1])).reshape(n_tokens * top_k, -1)
    x_YMD = pairs_to_blocks(x_MD, layout.pair_slot_M, layout.row_pair_R).reshape(layout.n_blocks, block_rows, -1)

    if gathered_blocks(weights, block_rows):
        y_YMD = expert_fn(_gathered_block_linear(block_expert_Y), weights, x_YMD)
    else:
        y_YMD = _loop_over_blocks(x_YMD, block_expert_Y, layout.blocks_before_group(n_experts), weights,
                                  expert_fn)
    y_TKD = blocks_to_pairs(y_YMD.reshape(rows, -1), layout.pair_slot_M, layout.row_pair_R)
    y_TKD = y_TKD.reshape(n_tokens, top_k, -1)
    return jnp.where((expert_idx_TK < n_experts)[..., None], y_TKD, 0) if absent else y_TKD


def _f32_matmul(h_MI, w_IJ, b_J=None):
    # Compute in float32 from the sliced expert. (XLA's loop-invariant code motion still hoists
    # the conversion of a bfloat16 stack out of the loop, a float32 copy of all experts;
    # `moejax score` turns that pass off for its memory budget, see moejax.cli.)
    y = jnp.matmul(h_MI.astype(jnp.float32), w_IJ.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    return _plus(y, None if b_J is None else b_J.astype(jnp.float32)).astype(h_MI.dtype)


def _expert_weights(weights, e):
    """Expert e's weights (a traced index) out of the stacked [E, ...] weights."""
    return jax.tree.map(lambda w_E: jax.lax.dynamic_index_in_dim(w_E, e, keepdims=False), weights)


def _loop_over_blocks(x_YMD, block_expert_Y, n_used, weights, expert_fn):
    """Large experts, differentiable: a loop over blocks that reads each block's expert weights in
    place (instead of materialising n_blocks copies of them) and runs the whole expert on the
    block in one iteration, so its hidden activations stay in cache. Blocks from `n_used` on
    (absent pairs, trailing padding) are skipped by a conditional, which keeps the loop
    differentiable (a dynamic trip count would not be)."""
    def one(x_MD, e):
        return expert_fn(_f32_matmul, _expert_weights(weights, e), x_MD)

    out = jax.eval_shape(one, x_YMD[0], block_expert_Y[0])
    skip = jnp.zeros(out.shape, out.dtype)
    return jax.lax.map(lambda xei: jax.lax.cond(xei[2] < n_used, lambda: one(xei[0], xei[1]), lambda: skip),
                       (x_YMD, block_expert_Y, jnp.arange(x_YMD.shape[0])))


def _exact_expert_loop(x_TD, expert_idx_TK, weights, expert_fn, chunk_rows: int = 512, granule: int = 32):
    """Forward only, large experts: each expert's pairs exactly, no block padding. [T, K, D].

    Pairs are sorted by expert (absent pairs, index E, last). A loop over experts runs each
    expert's group as full chunks of `chunk_rows` rows plus one remainder chunk rounded up to
    `granule` rows (a switch over the static sizes), so at most granule - 1 rows per expert are
    wasted instead of up to a whole block. A remainder chunk may spill into the next experts'
    rows: the loop is in expert order, so they are overwritten later; spill into absent rows is
    zeroed at the end. 512-row chunks ran the Moonlight-shaped layer 7% faster than 128 (fewer,
    larger matmuls per expert) for 0.3 s more compilation (16 remainder sizes instead of 4)."""
    n_tokens, top_k = expert_idx_TK.shape
    n_experts = table_rows(weights)
    loop = _SortedExpertLoop(x_TD, expert_idx_TK, weights, expert_fn, chunk_rows, granule)
    n_pairs = n_tokens * top_k
    out = loop.out_shape()
    ys_MD = jnp.zeros((n_pairs + chunk_rows, out.shape[-1]), out.dtype)
    ys_MD = loop.run(ys_MD, lambda ys, start, valid_M, y_MD: jax.lax.dynamic_update_slice_in_dim(ys, y_MD, start, 0))
    y_TKD = jnp.zeros((n_pairs, out.shape[-1]), out.dtype).at[loop.order_M].set(ys_MD[:n_pairs])
    y_TKD = y_TKD.reshape(n_tokens, top_k, -1)
    return jnp.where((expert_idx_TK < n_experts)[..., None], y_TKD, 0)


def exact_expert_loop_combined(x_TD, expert_idx_TK, gate_TK, weights, expert_fn, chunk_rows: int = 512,
                               granule: int = 32):
    """Forward only, large experts: the routed output y_t = sum_k g_tk f_{idx_tk}(x_t) itself,
    float32 [T, D], by the loop of `_exact_expert_loop`, each chunk's gate-weighted outputs added
    into y by token as they come. Nothing of size [T, K, D] is ever held (a Moonlight-shaped layer
    on 17 streams of 1,024 tokens held three such buffers, 0.9 GB each). A token's K terms are
    summed in expert order, not in slot order as `combine` sums them: equal up to float rounding.

    gate_TK may carry trailing variants, gate [T, K, A]: then A outputs at once, [T, A, D], variant a
    weighing the same pair outputs by gate[..., a] (every pruning variant's output from one
    evaluation of the pairs any of them routes to: `moejax.evaluation.carried`)."""
    loop = _SortedExpertLoop(x_TD, expert_idx_TK, weights, expert_fn, chunk_rows, granule)
    n_tokens, top_k = expert_idx_TK.shape
    variants = gate_TK.shape[2:]
    gate_M = gate_TK.reshape((n_tokens * top_k,) + variants).astype(jnp.float32)[loop.order_M]
    gate_M = jnp.concatenate([gate_M, jnp.zeros((chunk_rows,) + variants, jnp.float32)])

    def add(y, start, valid_M, f_MD):  # one chunk: its chunk_rows pairs
        token_M = jax.lax.dynamic_slice_in_dim(loop.token_M, start, chunk_rows)
        g_M = jax.lax.dynamic_slice_in_dim(gate_M, start, chunk_rows)
        g_M = jnp.where(valid_M.reshape((chunk_rows,) + (1,) * len(variants)), g_M, 0.0)
        return y.at[token_M].add(g_M[..., None] * f_MD.astype(jnp.float32).reshape(
            (chunk_rows,) + (1,) * len(variants) + f_MD.shape[-1:]), mode="promise_in_bounds")

    out = loop.out_shape()
    return loop.run(jnp.zeros((n_tokens,) + variants + out.shape[-1:], jnp.float32), add)


class _SortedExpertLoop:
    """The loop behind the exact forward-only paths: the pairs sorted by expert (absent pairs,
    index E, last), then for each expert that has pairs, in expert order, its pairs as full chunks
    of `chunk_rows` rows plus one remainder chunk rounded up to `granule` rows. Each chunk's input
    rows are gathered as it runs (no [T*K, D] copy of the inputs); `consume(acc, start, valid_M,
    f_MD)` takes each chunk's expert outputs f_MD [chunk_rows, D] (zero rows past the remainder)
    at sorted position `start`, valid_M marking the rows that are this expert's pairs."""

    def __init__(self, x_TD, expert_idx_TK, weights, expert_fn, chunk_rows, granule):
        n_tokens, top_k = expert_idx_TK.shape
        self.n_experts = table_rows(weights)
        _, self.order_M, self.sizes_E = _sort_by_expert(expert_idx_TK, self.n_experts + 1)
        self.starts_E = jnp.cumsum(self.sizes_E) - self.sizes_E
        self.token_M = jnp.concatenate([self.order_M // top_k, jnp.zeros((chunk_rows,), self.order_M.dtype)])
        self.x_TD, self.weights, self.expert_fn = x_TD, weights, expert_fn
        self.chunk_rows, self.granule = chunk_rows, granule

    def out_shape(self):
        one = jax.tree.map(lambda w: jax.ShapeDtypeStruct(w.shape[1:], w.dtype), _parts(self.weights)[0])
        return jax.eval_shape(lambda w: self.expert_fn(_f32_matmul, w, self.x_TD[:1]), one)

    def _rows_out(self, w, start, n_rows):
        x_MD = self.x_TD[jax.lax.dynamic_slice_in_dim(self.token_M, start, n_rows)]
        y = self.expert_fn(_f32_matmul, w, x_MD)
        return jnp.pad(y, ((0, self.chunk_rows - n_rows), (0, 0))) if n_rows < self.chunk_rows else y

    def run(self, acc, consume):
        chunk_rows, granule = self.chunk_rows, self.granule
        rows_M = jnp.arange(chunk_rows)

        def one_expert(e, acc, w):   # w: expert e's weights
            start, size = self.starts_E[e], self.sizes_E[e]
            n_full = size // chunk_rows

            def full_chunk(i, acc):
                at = start + i * chunk_rows
                return consume(acc, at, rows_M < chunk_rows, self._rows_out(w, at, chunk_rows))

            acc = jax.lax.fori_loop(0, n_full, full_chunk, acc)
            # The remainder: the branches return a chunk-sized result (zero rows past n), so the
            # accumulator itself never passes through the switch (which would copy it).
            rest_start = start + n_full * chunk_rows
            out = self.out_shape()
            branches = [lambda: jnp.zeros((chunk_rows, out.shape[-1]), out.dtype)] + [
                (lambda n=n: self._rows_out(w, rest_start, n)) for n in range(granule, chunk_rows + 1, granule)]
            rest = size - n_full * chunk_rows
            which = -(-rest // granule)
            return consume(acc, rest_start, rows_M < rest, jax.lax.switch(which, branches))

        # Only the experts that got pairs, still in expert order (which the spill rule of
        # `_exact_expert_loop` needs): XLA copies an expert's weights out of the stack at the top
        # of each iteration, so an iteration for an empty expert would still cost a copy of its
        # weights. A table in parts: one loop per part, in row order.
        # The weights ride in the loop's carry through an optimisation barrier, so XLA cannot see
        # them as loop-invariant: it would otherwise hoist the float32 conversion of a bfloat16
        # stack out of the loop (a float32 copy of every expert: +2.2 GB at Moonlight's shape)
        # instead of converting one expert per iteration. An averaged part carries the first part
        # too, and makes each row it reaches from it (`AveragedRows.row`).
        parts = _parts(self.weights)
        first = 0
        for part in parts:
            rows = _part_rows(part)
            if not rows:   # (a merge whose every cluster is a singleton adds no rows)
                continue
            used_E = self.sizes_E[first:first + rows] > 0
            used_in_order = jnp.argsort(~used_E, stable=True).astype(jnp.int32)
            averaged = isinstance(part, AveragedRows)

            def body(i, carry, used_in_order=used_in_order, first=first, averaged=averaged):
                acc, weights = carry
                weights = jax.lax.optimization_barrier(weights)
                e = used_in_order[i]
                w = weights[0].row(weights[1], e) if averaged else _expert_weights(weights, e)
                return one_expert(first + e, acc, w), weights

            carried = (part, parts[0]) if averaged else part
            acc = jax.lax.fori_loop(0, jnp.sum(used_E, dtype=jnp.int32), body, (acc, carried))[0]
            first += rows
        return acc


def ragged_pair_outputs(x_TD, expert_idx_TK, weights, expert_fn):
    """Routed pairs through `jax.lax.ragged_dot` (GPU/TPU grouped matmul). [T, K, D]."""
    n_tokens, top_k = expert_idx_TK.shape
    n_experts = jax.tree.leaves(weights)[0].shape[0]
    _, order_M, group_sizes_E = _sort_by_expert(expert_idx_TK, n_experts)
    xs_MD = x_TD[order_M // top_k]

    expert_M = expert_idx_TK.reshape(-1)[order_M]

    def ragged_linear(h_MI, w_EIJ, b_EJ=None):
        y = jax.lax.ragged_dot(h_MI, w_EIJ, group_sizes_E, precision=jax.lax.Precision.HIGHEST)
        return y if b_EJ is None else y + b_EJ[expert_M]

    ys_MD = expert_fn(ragged_linear, weights, xs_MD)
    y_MD = jnp.zeros_like(ys_MD).at[order_M].set(ys_MD)
    return y_MD.reshape(n_tokens, top_k, -1)

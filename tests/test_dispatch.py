"""Every dispatch backend equals the dense oracle, forward and backward, empty experts included."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.moe import dispatch as D
from moejax.moe import grouped as G
from moejax.moe.neurons import NEURON_LAYOUTS
from moejax.moe.routing import RouterConfig, route

SWIGLU_NEURONS = tuple(sorted(NEURON_LAYOUTS["swiglu"].items()))   # AveragedRows' static layout

T, E, DM, H, K = 96, 16, 8, 12, 3


def setup(seed=0, expert_fn="relu"):
    ks = jax.random.split(jax.random.key(seed), 6)
    x = jax.random.normal(ks[0], (T, DM))
    router = jax.random.normal(ks[1], (E, DM))
    if expert_fn == "relu":
        w = {"w1": jax.random.normal(ks[2], (E, DM, H)), "w2": jax.random.normal(ks[3], (E, H, DM))}
        fn = D.relu_mlp
    else:
        w = {"gate": jax.random.normal(ks[2], (E, DM, H)), "up": jax.random.normal(ks[4], (E, DM, H)),
             "down": jax.random.normal(ks[3], (E, H, DM))}
        fn = D.swiglu
    mask = jnp.arange(E) % 3 != 1  # a third of the experts pruned: they get no tokens
    r = route(x @ router.T, RouterConfig(top_k=K), jax.random.normal(ks[5], (E,)) * 0.3, mask)
    return x, r, w, fn, mask


@pytest.mark.parametrize("backend", ["sorted", "ragged"])
@pytest.mark.parametrize("expert_fn", ["relu", "swiglu"])
def test_forward_equals_dense_oracle(backend, expert_fn):
    x, r, w, fn, mask = setup(1, expert_fn)
    counts = np.bincount(np.asarray(r.expert_idx_TK).ravel(), minlength=E)
    assert (counts[~np.asarray(mask)] == 0).all() and (counts == 0).any()  # empty experts present
    want = D.dispatch(x, r.expert_idx_TK, r.gate_TK, w, fn, "dense")
    got = jax.jit(D.dispatch, static_argnums=(4, 5))(x, r.expert_idx_TK, r.gate_TK, w, fn, backend)
    np.testing.assert_allclose(got, want, atol=1e-6 * float(jnp.abs(want).max()), rtol=1e-6)
    # and the per-pair outputs themselves, against a plain per-pair loop
    f = D.pair_outputs(x, r.expert_idx_TK, w, fn, backend)
    t, k = 5, 1
    j = int(r.expert_idx_TK[t, k])
    one = fn(lambda a, b: a @ b, jax.tree.map(lambda a: a[j], w), x[t])
    np.testing.assert_allclose(f[t, k], one, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block_rows", [1, 4, 32, 256])
def test_sorted_backend_any_block_size(block_rows):
    x, r, w, fn, _ = setup(2)
    want = D.dense_pair_outputs(x, r.expert_idx_TK, w, fn)
    got = D.sorted_pair_outputs(x, r.expert_idx_TK, w, fn, block_rows=block_rows)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("backend", ["sorted", "ragged"])
def test_gradients_equal_dense_oracle(backend):
    x, r, w, fn, _ = setup(3)

    def loss(x, w, gate, be):
        y = D.dispatch(x, r.expert_idx_TK, gate, w, fn, be)
        return jnp.sum(jnp.sin(y))

    want = jax.grad(loss, argnums=(0, 1, 2))(x, w, r.gate_TK, "dense")
    got = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), static_argnums=3)(x, w, r.gate_TK, backend)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6 * float(jnp.abs(b).max()))
    # pruned experts received no tokens, so their weights get exactly zero gradient
    unused = np.setdiff1d(np.arange(E), np.asarray(r.expert_idx_TK))
    assert unused.size and float(jnp.abs(got[1]["w1"][unused]).max()) == 0.0


def test_unknown_backend_lists_valid_ones():
    x, r, w, fn, _ = setup()
    with pytest.raises(ValueError, match="dense, sorted, ragged"):
        D.dispatch(x, r.expert_idx_TK, r.gate_TK, w, fn, "magic")


@pytest.mark.parametrize("block_rows", [4, 64])  # 4: the per-block loop (large experts); 64: batched
def test_sorted_backend_gradients_in_both_block_strategies(block_rows):
    x, r, w, fn, _ = setup(4)

    def loss(x, w, impl):
        return jnp.sum(jnp.cos(impl(x, r.expert_idx_TK, w, fn)))

    want = jax.grad(loss, argnums=(0, 1))(x, w, D.dense_pair_outputs)
    got = jax.grad(loss, argnums=(0, 1))(
        x, w, lambda *a: D.sorted_pair_outputs(*a, block_rows=block_rows))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=2e-6 * float(jnp.abs(b).max()))


@pytest.mark.parametrize("block_rows", [4, 64])
def test_forward_only_skips_absent_pairs(block_rows):
    x, r, w, fn, _ = setup(5)
    idx = np.asarray(r.expert_idx_TK).copy()
    absent = np.random.default_rng(0).random(idx.shape) < 0.6
    idx[absent] = E  # "no expert"
    got = D.sorted_pair_outputs(x, jnp.asarray(idx), w, fn, block_rows=block_rows, forward_only=True)
    want = D.dense_pair_outputs(x, r.expert_idx_TK, w, fn)
    np.testing.assert_allclose(got[~absent], want[~absent], rtol=1e-6, atol=1e-5)
    assert float(jnp.abs(got[absent]).max()) == 0.0


@pytest.mark.parametrize("chunk_rows,granule", [(8, 2), (8, 8), (16, 4)])
def test_exact_expert_loop_every_group_size(chunk_rows, granule):
    """The forward-only path for large experts: groups of every size class (empty, below a granule,
    exact multiples of the chunk, several chunks plus a remainder), absent pairs zero, and a
    remainder's spill into the next expert's rows overwritten."""
    x, _, w, fn, _ = setup(6, "swiglu")
    rng = np.random.default_rng(1)
    # skewed choices: expert 0 takes many pairs, some experts none, 20% absent (index E)
    p = rng.dirichlet(np.full(E, 0.3))
    idx = rng.choice(E, size=(T, K), p=p)
    idx[rng.random(idx.shape) < 0.2] = E
    counts = np.bincount(idx.ravel(), minlength=E + 1)[:E]
    assert counts.max() > 2 * chunk_rows and (counts == 0).any() and ((counts % chunk_rows) != 0).any()
    got = jax.jit(G._exact_expert_loop, static_argnums=(3, 4, 5))(x, jnp.asarray(idx), w, fn, chunk_rows, granule)
    want = D.dense_pair_outputs(x, jnp.asarray(np.minimum(idx, E - 1)), w, fn)
    present = idx < E
    np.testing.assert_allclose(got[present], want[present], rtol=1e-6, atol=1e-5)
    assert float(jnp.abs(got[~present]).max()) == 0.0


def test_exact_loop_combined_equals_gate_weighted_pairs(chunk_rows=8, granule=2):
    """The combined forward-only path (large experts' outputs added into y as computed) gives the
    oracle's gate-weighted sum for groups of every size class, absent pairs (index E) and a
    remainder spilling into the next expert's rows contributing nothing."""
    x, r, w, fn, _ = setup(7, "swiglu")
    rng = np.random.default_rng(2)
    p = rng.dirichlet(np.full(E, 0.3))
    idx = rng.choice(E, size=(T, K), p=p)
    idx[rng.random(idx.shape) < 0.2] = E
    gate = rng.standard_normal((T, K)).astype(np.float32)
    got = jax.jit(G.exact_expert_loop_combined, static_argnums=(4, 5, 6))(
        x, jnp.asarray(idx), jnp.asarray(gate), w, fn, chunk_rows, granule)
    f = D.dense_pair_outputs(x, jnp.asarray(np.minimum(idx, E - 1)), w, fn)
    want = np.einsum("tk,tkd->td", np.where(idx < E, gate, 0), np.asarray(f, np.float64))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_exact_loop_combined_with_gate_columns():
    """Gate columns [T, K, G] give G outputs from one evaluation of the pairs, each the oracle's
    sum weighted by its column."""
    x, r, w, fn, _ = setup(8, "swiglu")
    rng = np.random.default_rng(3)
    idx = rng.choice(E + 1, size=(T, K))
    gate = rng.standard_normal((T, K, 3)).astype(np.float32)
    got = jax.jit(G.exact_expert_loop_combined, static_argnums=(4, 5, 6))(
        x, jnp.asarray(idx), jnp.asarray(gate), w, fn, 8, 2)
    f = np.asarray(D.dense_pair_outputs(x, jnp.asarray(np.minimum(idx, E - 1)), w, fn), np.float64)
    want = np.einsum("tkg,tkd->tgd", np.where((idx < E)[..., None], gate, 0), f)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_exact_loop_with_bfloat16_experts_equals_float32_bitwise():
    """Experts held in bfloat16 (as stored) compute what the same values upcast to float32 compute,
    bit for bit: each expert is converted as its iteration runs (the streamed pass relies on this
    to halve a layer's memory without changing a result)."""
    x, r, w, fn, _ = setup(9, "swiglu")
    w16 = {k: v.astype(jnp.bfloat16) for k, v in w.items()}
    f = jax.jit(G.exact_expert_loop_combined, static_argnums=(4, 5, 6))
    got = f(x, r.expert_idx_TK, r.gate_TK, w16, fn, 8, 2)
    want = f(x, r.expert_idx_TK, r.gate_TK, {k: v.astype(jnp.float32) for k, v in w16.items()}, fn, 8, 2)
    assert np.array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("split", [0, 3, E])
def test_a_table_in_parts_computes_what_the_joined_table_does(split):
    """An expert table in parts (the carried pass's merge: the layer's own experts, then merged rows,
    never concatenated) gives the joined table's numbers bitwise through the exact loop (which reads
    the parts in place, one loop per part, an empty part skipped) and through every other path
    (which joins them), absent pairs (index = all rows) zero."""
    x, _, w, fn, _ = setup(10, "swiglu")
    parts = ({k: v[:split] for k, v in w.items()}, {k: v[split:] for k, v in w.items()})
    assert G.table_rows(parts) == E and all(G.joined(parts)[k].shape == w[k].shape for k in w)
    rng = np.random.default_rng(4)
    idx = jnp.asarray(rng.choice(E + 1, size=(T, K)))
    gate = jnp.asarray(rng.standard_normal((T, K)).astype(np.float32))
    loop = jax.jit(G.exact_expert_loop_combined, static_argnums=(4, 5, 6))
    np.testing.assert_array_equal(loop(x, idx, gate, parts, fn, 8, 2), loop(x, idx, gate, w, fn, 8, 2))
    pairs = jax.jit(G._exact_expert_loop, static_argnums=(3, 4, 5))
    np.testing.assert_array_equal(pairs(x, idx, parts, fn, 8, 2), pairs(x, idx, w, fn, 8, 2))
    for backend in ("sorted", "dense"):
        np.testing.assert_array_equal(D.pair_outputs(x, idx, parts, fn, backend, forward_only=True),
                                      D.pair_outputs(x, idx, w, fn, backend, forward_only=True))


def test_averaged_rows_in_a_table_compute_what_their_made_rows_do():
    """A table (own experts, AveragedRows over them): the exact loop, making each averaged row as
    it reaches it, gives bitwise what the table with those rows made first gives (`joined`), on
    pairs of own rows, averaged rows (members permuted, weighted) and absent ones; and a made row
    is the weighted sum of its permuted members (numpy, to float rounding)."""
    from moejax.moe.averaged_rows import AveragedRows

    x, _, w, fn, _ = setup(11, "swiglu")
    rng = np.random.default_rng(5)
    F = w["gate"].shape[-1]
    members = np.zeros((4, E), np.int32)
    members[0, :3], members[1, :2], members[2, :1] = [1, 5, 9], [0, 2], [7]   # row 3: empty (zero)
    counts = np.array([3, 2, 1, 0], np.int32)
    shares = rng.uniform(0.1, 1.0, E).astype(np.float32)
    perms = np.stack([rng.permutation(F) for _ in range(E)]).astype(np.int32)
    rows = AveragedRows(jnp.asarray(members), jnp.asarray(counts), jnp.asarray(shares), jnp.asarray(perms),
                        SWIGLU_NEURONS, np.float32)
    parts = (w, rows)
    assert G.table_rows(parts) == E + 4
    made = G.joined(parts)
    want = sum(shares[j] * np.take(np.asarray(w["gate"][j]), perms[j], axis=1) for j in (1, 5, 9))
    np.testing.assert_allclose(made["gate"][E], want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(made["down"][E + 3], 0)
    idx = jnp.asarray(rng.choice(E + 5, size=(T, K)))
    gate = jnp.asarray(rng.standard_normal((T, K)).astype(np.float32))
    loop = jax.jit(G.exact_expert_loop_combined, static_argnums=(4, 5, 6))
    np.testing.assert_array_equal(loop(x, idx, gate, parts, fn, 8, 2), loop(x, idx, gate, made, fn, 8, 2))
    for backend in ("sorted", "dense"):
        np.testing.assert_array_equal(D.pair_outputs(x, idx, parts, fn, backend, forward_only=True),
                                      D.pair_outputs(x, idx, made, fn, backend, forward_only=True))


def test_averaged_rows_convert_one_member_at_a_time():
    """Making an averaged row in the exact loop converts one member of a bfloat16 table at a time:
    the compiled temporaries stay under a quarter of a float32 copy of the stack (XLA hoisted the
    conversion of the whole stack out of the loop over members: 2.2 GB at Moonlight's shape)."""
    import ml_dtypes

    from moejax.moe.averaged_rows import AveragedRows

    n, hidden, ffn = 16, 512, 384
    rng = np.random.default_rng(6)
    w = {k: jnp.asarray(rng.standard_normal(s).astype(ml_dtypes.bfloat16))
         for k, s in (("gate", (n, hidden, ffn)), ("up", (n, hidden, ffn)), ("down", (n, ffn, hidden)))}
    members, counts = np.zeros((n, n), np.int32), np.zeros(n, np.int32)
    members[0, :4], counts[0] = [1, 2, 3, 4], 4
    rows = AveragedRows(jnp.asarray(members), jnp.asarray(counts), jnp.full((n,), 0.25, jnp.float32),
                        jnp.tile(jnp.arange(ffn, dtype=jnp.int32), (n, 1)), SWIGLU_NEURONS, ml_dtypes.bfloat16)
    x = jnp.asarray(rng.standard_normal((64, hidden)).astype(ml_dtypes.bfloat16))
    idx = jnp.asarray(rng.integers(0, 2 * n, (64, 2)))
    compiled = jax.jit(G.exact_expert_loop_combined, static_argnums=(4,)).lower(
        x, idx, jnp.ones((64, 2), jnp.float32), (w, rows), D.swiglu).compile()
    f32_stack = 3 * n * hidden * ffn * 4
    assert compiled.memory_analysis().temp_size_in_bytes < f32_stack / 4


def test_sparse_output_table_computes_the_selected_pairs_of_the_table():
    """`sparse_output_table` gives each selected (row, token) pair the table's f_r(x_t) (rows with
    no pair, with every pair, and one pair past a block included), and says when the selection
    needs more blocks than it was given."""
    x, _, w, fn, _ = setup(7)
    rng = np.random.default_rng(2)
    selected = rng.random((E, T)) < rng.uniform(0, 0.6, size=(E, 1))
    selected[0], selected[1], selected[2] = False, True, np.arange(T) < 9
    table = np.asarray(G.expert_output_table(x, w, fn))
    run = jax.jit(G.sparse_output_table, static_argnums=(3, 4, 5, 6))
    block_rows = 8
    needed = int(np.sum(-(-selected.sum(axis=1) // block_rows)))
    for n_blocks, group_blocks in ((needed, 1), (needed, 3), (G.full_capacity_blocks(E, T, block_rows), 4)):
        out = run(x, jnp.asarray(selected), w, fn, n_blocks, block_rows, group_blocks)
        r, t = np.nonzero(selected)
        assert not bool(out.overflow)
        np.testing.assert_allclose(np.asarray(out.rows_MD)[np.asarray(out.pos_ET)[r, t]], table[r, t],
                                   rtol=1e-6, atol=1e-5)
    assert bool(run(x, jnp.asarray(selected), w, fn, needed - 1, block_rows, 1).overflow)


def test_block_strategy_follows_expert_size():
    """Small experts (the trained tiny models' 128 x 64, whose down matrix is wider than a block)
    take gathered blocks of the rule's size; Moonlight-sized experts the loop over blocks."""
    def table(D, F):
        return {k: jax.ShapeDtypeStruct((32,) + s, jnp.float32)
                for k, s in {"gate": (D, F), "up": (D, F), "down": (F, D)}.items()}

    tiny, moonlight = table(128, 64), table(2048, 1408)
    rows = G._default_block_rows(4096, 32, tiny)   # one micro-batch of the skills recipe: 1,024 tokens, top 4
    assert rows == 64 and G.gathered_blocks(tiny, rows)
    rows = G._default_block_rows(4096, 32, moonlight)
    assert not G.gathered_blocks(moonlight, rows)

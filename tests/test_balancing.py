"""The balancing shortcut gives exactly the loads of top-k routing, ties included."""

import jax
import jax.numpy as jnp
import numpy as np

import pytest

from moejax.moe.balancing import balance_bias, loads_at_threshold
from moejax.moe.topk import kth_largest
from moejax.moe.routing import RouterConfig, route, routing_counts

CFG = RouterConfig(top_k=4)


def topk_loads(logits, bias):
    return jax.vmap(lambda lg, b: routing_counts(route(lg, CFG, b).expert_idx_TK, 16))(logits, bias)


def test_threshold_loads_equal_topk_loads_with_many_ties():
    # logits on a coarse grid and a zero bias: ties everywhere, including at the K-th value
    logits = jnp.round(jax.random.normal(jax.random.key(0), (3, 400, 16)) * 2) / 2
    bias = jnp.round(jax.random.normal(jax.random.key(1), (3, 16))) * 0.25
    sel = jnp.swapaxes(jax.nn.sigmoid(logits), -1, -2) + bias[..., None]
    got = loads_at_threshold(sel, kth_largest(sel, 4), 4)
    np.testing.assert_array_equal(got, topk_loads(logits, bias))
    assert (got.sum(-1) == 400 * 4).all()


def test_threshold_loads_mend_a_few_ties():
    # continuous logits with three tokens given an exact tie across the K-th place
    logits = np.array(jax.random.normal(jax.random.key(3), (2, 300, 16)))
    for n, t in ((0, 5), (1, 7), (1, 250)):
        order = np.argsort(-logits[n, t], kind="stable")
        logits[n, t, order[4]] = logits[n, t, order[3]]  # 4th and 5th best equal
    logits, bias = jnp.asarray(logits), jnp.zeros((2, 16))
    sel = jnp.swapaxes(jax.nn.sigmoid(logits), -1, -2)
    kth = kth_largest(sel, 4)
    np.testing.assert_array_equal(kth, jax.lax.top_k(jnp.swapaxes(sel, -1, -2), 4)[0][..., 3])
    got = loads_at_threshold(sel, kth, 4)
    np.testing.assert_array_equal(got, topk_loads(logits, bias))
    assert (got.sum(-1) == 300 * 4).all()


def numpy_balance(logits, steps, rate, k):
    """SPEC section 4 in numpy: bias -= rate * sign(load - mean(load)), top-k ties to lower index."""
    s = 1 / (1 + np.exp(-logits.astype(np.float32)))
    b = np.zeros(s.shape[1], np.float32)
    for _ in range(steps):
        idx = np.argsort(-(s + b), axis=1, kind="stable")[:, :k]
        load = np.bincount(idx.ravel(), minlength=s.shape[1])
        b = (b - np.float32(rate) * np.sign(load - load.mean())).astype(np.float32)
    return b


def test_balance_bias_matches_numpy_and_flattens_load():
    rng = np.random.default_rng(0)
    mu = rng.normal(size=8) * 0.8
    x = mu + rng.normal(size=(500, 8))
    w = rng.normal(size=(24, 8)) / np.sqrt(8)
    logits = (x @ w.T).astype(np.float32)
    got = np.asarray(jax.jit(lambda lg: balance_bias(lg, CFG, 60, 0.01))(jnp.asarray(logits)[None]))[0]
    np.testing.assert_allclose(got, numpy_balance(logits, 60, 0.01, 4), atol=1e-6)
    before = routing_counts(route(jnp.asarray(logits), CFG).expert_idx_TK, 24)
    after = routing_counts(route(jnp.asarray(logits), CFG, jnp.asarray(got)).expert_idx_TK, 24)
    assert float(jnp.std(after)) < 0.5 * float(jnp.std(before))


def numpy_choice(logits, bias, k, scoring_func="sigmoid", n_group=1, topk_group=1):
    """SPEC section 1's choice in numpy: s = sigmoid or softmax of the logits (float32), sel = s +
    bias; with n_group > 1 a group scores the sum of its two best `sel` and only the topk_group
    best groups stay (the others -inf); then the top k of `sel`, ties to the lower index."""
    logits = logits.astype(np.float32)
    if scoring_func == "sigmoid":
        s = np.float32(1) / (np.float32(1) + np.exp(-logits))
    else:
        e = np.exp(logits - logits.max(axis=-1, keepdims=True))
        s = e / e.sum(axis=-1, keepdims=True)
    sel = (s + bias).astype(np.float32)
    T, E = sel.shape
    if n_group > 1:
        grouped = sel.reshape(T, n_group, E // n_group)
        group_score = np.sort(grouped, axis=-1)[..., -2:].sum(axis=-1)          # [T, G]
        best = np.argsort(-group_score, axis=-1, kind="stable")[:, :topk_group]
        keep = np.zeros((T, n_group), bool)
        np.put_along_axis(keep, best, True, axis=-1)
        sel = np.where(np.repeat(keep, E // n_group, axis=-1), sel, -np.inf)
    return np.argsort(-sel, axis=-1, kind="stable")[:, :k]


def numpy_balance_routed(logits, steps, rate, k, **routing):
    """SPEC section 4's balancing in numpy under any routing of `numpy_choice`: the load is counted
    with the *current* bias every step, then bias -= rate * sign(load - mean(load))."""
    b = np.zeros(logits.shape[-1], np.float32)
    for _ in range(steps):
        load = np.bincount(numpy_choice(logits, b, k, **routing).ravel(), minlength=logits.shape[-1])
        b = (b - np.float32(rate) * np.sign(load - load.mean())).astype(np.float32)
    return b


def _two_runs(seed, T, E):
    """Two balancing runs whose load is far from flat (a shared offset in the router inputs)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(2, T, 8)) + rng.normal(size=(2, 1, 8))
    w = rng.normal(size=(2, E, 8)) / np.sqrt(8)
    return np.einsum("btd,bed->bte", x, w).astype(np.float32)


@pytest.mark.parametrize("routing", [dict(scoring_func="sigmoid", n_group=4, topk_group=2),
                                     dict(scoring_func="softmax")], ids=["grouped_sigmoid", "softmax"])
def test_grouped_and_softmax_balancing_match_numpy(routing):
    """balance_bias's general branch (group-limited sigmoid, softmax) step by step against numpy
    straight from SPEC: a bias that the routing did not see, a sign flip or a group rule ignored
    gives a different trajectory."""
    k, steps, rate = (2, 40, 0.01) if routing.get("n_group", 1) > 1 else (4, 40, 0.002)
    logits = _two_runs(4, 200, 16)
    cfg = RouterConfig(top_k=k, **routing)
    got = np.asarray(balance_bias(jnp.asarray(logits), cfg, steps, rate))
    for row in range(2):
        want = numpy_balance_routed(logits[row], steps, rate, k, **routing)
        np.testing.assert_allclose(got[row], want, rtol=0, atol=1e-6, err_msg=f"run {row}")
        # the bias steered the choice: the final load is flatter than the unbiased one
        zero = np.bincount(numpy_choice(logits[row], np.zeros(16, np.float32), k, **routing).ravel(), minlength=16)
        final = np.bincount(numpy_choice(logits[row], want, k, **routing).ravel(), minlength=16)
        assert final.std() < 0.6 * zero.std()
        # secondary: moejax's `route` chooses the numpy reference's experts under that bias
        idx = np.asarray(route(jnp.asarray(logits[row]), cfg, jnp.asarray(want)).expert_idx_TK)
        np.testing.assert_array_equal(np.sort(idx, -1), np.sort(numpy_choice(logits[row], want, k, **routing), -1))


def _cycling_logits():
    """Two balancing runs that settle into a 2-cycle well within 200 steps of rate 0.01."""
    rng = np.random.default_rng(5)
    x = rng.normal(size=(2, 400, 8)) + rng.normal(size=(2, 1, 8)) * 0.8
    w = rng.normal(size=(2, 16, 8)) / np.sqrt(8)
    return np.einsum("btd,bed->bte", x, w).astype(np.float32)


@pytest.mark.parametrize("steps", [200, 201])
def test_cycle_shortcut_is_bitwise_the_full_trajectory(steps):
    logits = _cycling_logits()
    full = np.asarray(balance_bias(jnp.asarray(logits), CFG, steps, 0.01, max_period=0))
    short = np.asarray(balance_bias(jnp.asarray(logits), CFG, steps, 0.01))
    np.testing.assert_array_equal(full.view(np.int32), short.view(np.int32))
    for row in range(2):  # and both agree with the plain numpy loop
        np.testing.assert_allclose(short[row], numpy_balance(logits[row], steps, 0.01, 4), atol=1e-6)


def test_cycle_shortcut_reads_far_steps_off_the_cycle():
    logits = jnp.asarray(_cycling_logits())
    even, odd, even2 = (np.asarray(balance_bias(logits, CFG, n, 0.01, max_period=0)) for n in (200, 201, 202))
    assert not np.array_equal(even, odd) and np.array_equal(even, even2)  # a 2-cycle by step 200
    np.testing.assert_array_equal(balance_bias(logits, CFG, 10**6, 0.01), even)
    np.testing.assert_array_equal(balance_bias(logits, CFG, 10**6 + 1, 0.01), odd)

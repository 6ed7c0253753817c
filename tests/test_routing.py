"""Routing (SPEC section 1): hand-computed cases, then a numpy reference on random inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.errors import ConfigError
from moejax.moe.routing import RouterConfig, route, routing_counts


def logit(p):
    return np.log(np.asarray(p, np.float32) / (1 - np.asarray(p, np.float32)))


def sorted_idx(r):
    return np.sort(np.asarray(r.expert_idx_TK), axis=-1)


def test_bias_chooses_but_gates_come_from_unbiased_scores():
    s = [0.9, 0.8, 0.7, 0.6]
    bias = jnp.array([-0.5, 0.0, 0.0, 0.15])  # negative bias pushes expert 0 out; expert 3 in
    r = route(jnp.asarray(logit([s])), RouterConfig(top_k=2, norm_topk_prob=False), bias)
    # sel = [0.4, 0.8, 0.7, 0.75] -> experts 1 and 3
    assert sorted_idx(r).tolist() == [[1, 3]]
    gates = dict(zip(np.asarray(r.expert_idx_TK)[0].tolist(), np.asarray(r.gate_TK)[0].tolist()))
    assert gates[1] == pytest.approx(0.8, abs=1e-6) and gates[3] == pytest.approx(0.6, abs=1e-6)


def test_norm_topk_prob_and_scaling_factor():
    r = route(jnp.asarray(logit([[0.9, 0.6, 0.1]])),
              RouterConfig(top_k=2, norm_topk_prob=True, routed_scaling_factor=2.5))
    np.testing.assert_allclose(np.asarray(r.gate_TK)[0], [2.5 * 0.9 / 1.5, 2.5 * 0.6 / 1.5], rtol=1e-6)


def test_masked_expert_never_chosen_even_with_all_negative_biases():
    # Every kept expert has a negative biased score; a 0.0 fill would let the pruned expert 0 win.
    s = [0.9, 0.2, 0.1, 0.05]
    bias = jnp.array([0.0, -0.9, -0.9, -0.9])
    mask = jnp.array([False, True, True, True])
    r = route(jnp.asarray(logit([s])), RouterConfig(top_k=2), bias, mask)
    assert sorted_idx(r).tolist() == [[1, 2]]
    np.testing.assert_allclose(np.asarray(r.gate_TK)[0], [0.2 / 0.3, 0.1 / 0.3], rtol=1e-6)


def test_group_limited_topk_uses_sum_of_top_two_biased_scores():
    # 3 groups of 2. Group scores (sum of both): g0 = 0.9+0.1 = 1.0, g1 = 0.6+0.55 = 1.15,
    # g2 = 0.7+0.5 = 1.2. With topk_group=2, groups 1 and 2 survive although expert 0 is best.
    s = [0.9, 0.1, 0.6, 0.55, 0.7, 0.5]
    r = route(jnp.asarray(logit([s])), RouterConfig(top_k=2, n_group=3, topk_group=2))
    assert sorted_idx(r).tolist() == [[2, 4]]
    # A bias on expert 1 lifts group 0 (1.0 + 0.3 = 1.3) above group 1: now experts 0 and 4.
    bias = jnp.array([0.0, 0.3, 0.0, 0.0, 0.0, 0.0])
    r = route(jnp.asarray(logit([s])), RouterConfig(top_k=2, n_group=3, topk_group=2), bias)
    assert sorted_idx(r).tolist() == [[0, 4]]


def test_dropped_group_is_minus_inf_not_zero():
    # Only group 1 is kept; its experts have negative biased scores, the dropped group's would be 0.0.
    s = [0.9, 0.8, 0.3, 0.2]
    bias = jnp.array([-0.2, -0.2, -0.5, -0.5])
    mask = jnp.array([True, True, True, True])
    # groups: g0 = 0.7 + 0.6 = 1.3, g1 = -0.2 + -0.3 = -0.5 -> with topk_group=1 group 0 is chosen
    r = route(jnp.asarray(logit([s])), RouterConfig(top_k=2, n_group=2, topk_group=1), bias, mask)
    assert sorted_idx(r).tolist() == [[0, 1]]
    # now prune group 0's experts entirely: group 1 must supply both, never a masked expert
    mask = jnp.array([False, False, True, True])
    r = route(jnp.asarray(logit([s])), RouterConfig(top_k=2, n_group=2, topk_group=1), bias, mask)
    assert sorted_idx(r).tolist() == [[2, 3]]


def test_ties_break_toward_lower_index():
    r = route(jnp.zeros((1, 6)), RouterConfig(top_k=3))
    assert np.asarray(r.expert_idx_TK).tolist() == [[0, 1, 2]]
    bias = jnp.array([0.0, 0.0, 0.1, 0.0, 0.1, 0.0])
    r = route(jnp.zeros((1, 6)), RouterConfig(top_k=3), bias)
    assert np.asarray(r.expert_idx_TK).tolist() == [[2, 4, 0]]


def test_softmax_is_over_kept_experts_only():
    logits = jnp.asarray([[2.0, 1.0, 0.0, -1.0]])
    mask = jnp.array([False, True, True, True])
    r = route(logits, RouterConfig(top_k=2, scoring_func="softmax", norm_topk_prob=False), None, mask)
    p = np.exp([1.0, 0.0, -1.0]) / np.exp([1.0, 0.0, -1.0]).sum()
    assert np.asarray(r.expert_idx_TK).tolist() == [[1, 2]]
    np.testing.assert_allclose(np.asarray(r.gate_TK)[0], p[:2], rtol=1e-6)


def numpy_route(logits, bias, mask, k, n_group, topk_group, norm, scale):
    """SPEC section 1 straight in numpy (float64, stable sorts)."""
    s = 1 / (1 + np.exp(-logits.astype(np.float64)))
    sel = np.where(mask, s + bias, -np.inf)
    T, E = sel.shape
    if n_group > 1:
        g = sel.reshape(T, n_group, E // n_group)
        gs = -np.sort(-g, axis=-1)[..., :2].sum(-1)
        best = np.argsort(-gs, axis=-1, kind="stable")[:, :topk_group]
        keep = np.zeros((T, n_group), bool)
        np.put_along_axis(keep, best, True, axis=1)
        sel = np.where(np.repeat(keep, E // n_group, axis=1), sel, -np.inf)
    idx = np.argsort(-sel, axis=1, kind="stable")[:, :k]
    gate = np.take_along_axis(s, idx, 1)
    if norm:
        gate = gate / (gate.sum(1, keepdims=True) + 1e-20)
    return idx, gate * scale


@pytest.mark.parametrize("n_group,topk_group", [(1, 1), (4, 2), (8, 3)])
@pytest.mark.parametrize("jit", [False, True])
def test_matches_numpy_reference_on_random_inputs(n_group, topk_group, jit):
    rng = np.random.default_rng(n_group)
    T, E, K = 300, 32, 4
    logits = (rng.normal(size=(T, E)) * 3).astype(np.float32)  # wide: routing is not a coin toss
    bias = rng.normal(scale=0.3, size=E).astype(np.float32)   # partly negative
    mask = rng.random(E) > 0.3
    cfg = RouterConfig(top_k=K, n_group=n_group, topk_group=topk_group, routed_scaling_factor=2.5)
    fn = jax.jit(route, static_argnums=1) if jit else route
    r = fn(jnp.asarray(logits), cfg, jnp.asarray(bias), jnp.asarray(mask))
    idx, gate = numpy_route(logits, bias, mask, K, n_group, topk_group, True, 2.5)
    order = np.argsort(np.asarray(r.expert_idx_TK), axis=1)
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(r.expert_idx_TK), order, 1), np.sort(idx, 1))
    np.testing.assert_allclose(np.take_along_axis(np.asarray(r.gate_TK), order, 1),
                               np.take_along_axis(gate, np.argsort(idx, 1), 1), rtol=1e-5)
    assert not np.isin(np.asarray(r.expert_idx_TK), np.flatnonzero(~mask)).any()


def test_routing_counts_excludes_padding():
    idx = jnp.array([[0, 1], [1, 2], [2, 3]])
    assert routing_counts(idx, 4).tolist() == [1, 2, 2, 1]
    assert routing_counts(idx, 4, jnp.array([True, True, False])).tolist() == [1, 2, 1, 0]


def test_bad_router_settings_are_refused():
    with pytest.raises(ConfigError, match="scoring_func"):
        RouterConfig(top_k=2, scoring_func="relu")
    with pytest.raises(ConfigError, match="divisible"):
        route(jnp.zeros((1, 10)), RouterConfig(top_k=2, n_group=4, topk_group=1))


@pytest.mark.parametrize("cfg", [RouterConfig(top_k=2, n_group=4, topk_group=2),
                                 RouterConfig(top_k=3, n_group=4, topk_group=2),
                                 RouterConfig(top_k=2, n_group=2, topk_group=1),
                                 RouterConfig(top_k=3, scoring_func="softmax")])
def test_check_mask_refuses_exactly_the_masks_that_route_a_token_to_a_pruned_expert(cfg):
    """`RouterConfig.check_mask`, the rule every variant is checked by, against `route` itself on
    every mask of 8 experts: a mask passes iff no token (of 3,000 with widely spread logits and
    biases, so every choice of groups occurs) is routed to a pruned expert. The group-short masks
    pass a plain count (e.g. experts 0 and 7 of 4 groups of 2, top-2 of 2 groups: both groups
    score -inf, groups 0 and 1 are chosen, and expert 1, pruned, is routed to at its full gate)."""
    E = 8
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(3000, E)) * 6, jnp.float32)
    bias = jnp.asarray(rng.normal(size=E), jnp.float32) if cfg.scoring_func == "sigmoid" else None
    masks = np.array([[(m >> e) & 1 for e in range(E)] for m in range(1, 2 ** E)], bool)  # [255, E]
    idx = np.asarray(route(logits, cfg, bias, jnp.asarray(masks)[:, None, :]).expert_idx_TK)  # [255, T, K]
    reaches_pruned = ~np.take_along_axis(masks[:, None, :], idx.reshape(len(masks), 1, -1), -1).reshape(idx.shape)
    refused = []
    for m in masks:
        try:
            cfg.check_mask(m, "m")
            refused.append(False)
        except ConfigError:
            refused.append(True)
    np.testing.assert_array_equal(np.array(refused), reaches_pruned.any(axis=(1, 2)))
    assert not all(refused) and any(refused)


def test_check_mask_names_the_count_or_the_groups():
    with pytest.raises(ConfigError, match=r"layer 3: keeps 1 experts, below num_experts_per_tok=2"):
        RouterConfig(top_k=2).check_mask(np.eye(8, dtype=bool)[0], "layer 3")
    with pytest.raises(ConfigError, match=r"keeps 0 experts"):
        RouterConfig(top_k=2).check_mask(np.zeros(8, bool), "x")
    short = np.isin(np.arange(8), [0, 7])  # 2 kept, but in groups of fewer than 2
    with pytest.raises(ConfigError, match=r"keeps \[1, 0, 0, 1\] experts per routing group; group-limited routing "
                                          r"\(n_group=4, topk_group=2\) can give a token groups holding only 1"):
        RouterConfig(top_k=2, n_group=4, topk_group=2).check_mask(short, "x")
    RouterConfig(top_k=2, n_group=4, topk_group=2).check_mask(np.isin(np.arange(8), [6, 7]), "x")  # one full group


# --- the routable check against DeepSeek-V3's group-limited routing, where the group order matters ----


def numpy_group_limited_choice(logits_TE, bias_E, mask_E, k, n_group, topk_group):
    """(chosen experts [T, K], their biased scores `sel` [T, K]) under transformers'
    DeepseekV3TopkRouter.forward (5.24), in float64 numpy: sel = sigmoid + bias, a pruned expert's
    sel -inf before grouping (SPEC section 1), group score = sum of the group's top-2 sel (its only
    one for groups of a single expert), the topk_group best groups kept, every other expert's sel
    -inf, then top-k. Ties to the lower index (stable sorts), as moejax. A token is given only kept
    experts of its groups iff every chosen sel is finite."""
    s = 1 / (1 + np.exp(-np.asarray(logits_TE, np.float64)))
    sel = np.where(mask_E, s + np.asarray(bias_E, np.float64), -np.inf)
    T, E = sel.shape
    g = sel.reshape(T, n_group, E // n_group)
    group_score = -np.sort(-g, axis=-1)[..., :min(2, E // n_group)].sum(-1)
    best = np.argsort(-group_score, axis=1, kind="stable")[:, :topk_group]
    chosen_group = np.zeros((T, n_group), bool)
    np.put_along_axis(chosen_group, best, True, axis=1)
    sel = np.where(np.repeat(chosen_group, E // n_group, axis=1), sel, -np.inf)
    idx = np.argsort(-sel, axis=1, kind="stable")[:, :k]
    return idx, np.take_along_axis(sel, idx, 1)


def reaches_unkept(logits_TE, bias_E, mask_E, cfg) -> bool:
    """Whether some token is given a pruned expert or one of a dropped group (a -inf choice)."""
    _, sel = numpy_group_limited_choice(logits_TE, bias_E, mask_E, cfg.top_k, cfg.n_group, cfg.topk_group)
    return not np.isfinite(sel).all()


def test_numpy_group_limited_routing_is_transformers_deepseek_v3_router():
    """The reference below is transformers' own router (no mask; decisive random tokens, a random
    partly negative bias) on DeepSeek-V3's shapes and on 2 groups of 4, top-3 of one group."""
    pytest.importorskip("transformers")
    import torch
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    rng = np.random.default_rng(11)
    for E, k, n_group, topk_group in ((256, 8, 8, 4), (8, 3, 2, 1)):
        cfg = DeepseekV3Config(hidden_size=E, n_routed_experts=E, num_experts_per_tok=k, n_group=n_group,
                               topk_group=topk_group, norm_topk_prob=True, routed_scaling_factor=1.0)
        router = DeepseekV3TopkRouter(cfg)
        bias = rng.normal(scale=0.3, size=E)
        with torch.no_grad():
            router.weight.copy_(torch.eye(E))            # logits = the token itself
            router.e_score_correction_bias.copy_(torch.as_tensor(bias, dtype=torch.float32))
        logits = (rng.normal(size=(200, E)) * 4).astype(np.float32)
        with torch.no_grad():
            _, _, idx = router(torch.as_tensor(logits))
        got, _ = numpy_group_limited_choice(logits, bias.astype(np.float32), np.ones(E, bool), k, n_group, topk_group)
        np.testing.assert_array_equal(np.sort(got, 1), np.sort(idx.numpy(), 1))


def adversarial_tokens(E, n_group, topk_group, rng, per_subset=2, n_random=100):
    """Logits [T, E] that give every possible choice of groups: for each topk_group-subset of the
    groups, tokens whose experts there are near-certain (logit +12) and elsewhere near-impossible
    (-12), the order within groups random; then widely spread random tokens."""
    import itertools

    size = E // n_group
    rows = []
    for subset in itertools.combinations(range(n_group), topk_group):
        on = np.isin(np.arange(E) // size, subset)
        for _ in range(per_subset):
            rows.append(np.where(on, 12.0, -12.0) + rng.normal(scale=0.5, size=E))
    rows += list(rng.normal(size=(n_random, E)) * 6)
    return np.asarray(rows, np.float32)


def refused(cfg, mask):
    try:
        cfg.check_mask(mask, "m")
        return False
    except ConfigError:
        return True


# Setups where which groups a token can be given decides the answer: top-3 of one of 2 groups of 4
# (groups keeping [2, 3] must be refused: a token given the group of 2 gets a pruned expert; the
# group keeping more is not the one that counts), top-4 likewise, top-3 of 3 of 4 groups of 2 (a
# group keeping 1 scores -inf and is chosen last, lower group index first), and groups of a single
# expert (a kept one scores its own sel, finitely: it needs 1 kept, not 2).
ORDER_MATTERS = [RouterConfig(top_k=3, n_group=2, topk_group=1), RouterConfig(top_k=4, n_group=2, topk_group=1),
                 RouterConfig(top_k=3, n_group=4, topk_group=3), RouterConfig(top_k=2, n_group=8, topk_group=4),
                 RouterConfig(top_k=3, n_group=8, topk_group=3)]


@pytest.mark.parametrize("cfg", ORDER_MATTERS, ids=lambda c: f"k{c.top_k}-g{c.n_group}-tg{c.topk_group}")
def test_check_mask_is_numpy_group_limited_routing_on_every_8_expert_mask(cfg):
    """check_mask refuses exactly the masks under which DeepSeek-V3's routing (numpy, above) gives
    some token a pruned expert or one of a dropped group, on every mask of 8 experts; moejax's
    `route` never reaches a pruned expert under a mask check_mask passes."""
    E = 8
    rng = np.random.default_rng(3)
    logits = adversarial_tokens(E, cfg.n_group, cfg.topk_group, rng)
    bias = rng.uniform(-0.3, 0.2, size=E).astype(np.float32)                # partly negative
    masks = np.array([[(m >> e) & 1 for e in range(E)] for m in range(1, 2 ** E)], bool)
    want = np.array([reaches_unkept(logits, bias, m, cfg) for m in masks])
    got = np.array([refused(cfg, m) for m in masks])
    wrong = np.flatnonzero(got != want)
    assert not len(wrong), [(masks[i].astype(int).tolist(), "refused" if got[i] else "passed") for i in wrong[:5]]
    assert want.any() and not want.all()
    ok = masks[~got]
    idx = np.asarray(route(jnp.asarray(logits), cfg, jnp.asarray(bias), jnp.asarray(ok)[:, None, :]).expert_idx_TK)
    assert np.take_along_axis(ok[:, None, :], idx.reshape(len(ok), 1, -1), -1).all()


def test_check_mask_is_numpy_group_limited_routing_with_deepseek_v3_shapes():
    """DeepSeek-V3's router (256 experts, 8 groups of 32, top-4 groups, top-8): masks keeping few
    experts in some groups, against the numpy routing of tokens that reach every choice of groups.
    [2, 2, 3, 0, 0, 0, 0, 1] kept per group must be refused: a token given the three groups that
    score finitely gets the next group by lower index (group 3, none kept), so 7 kept experts;
    counting the group keeping 1 (group 7) instead lets the mask through."""
    cfg = RouterConfig(top_k=8, n_group=8, topk_group=4)
    E, size = 256, 32
    rng = np.random.default_rng(5)
    logits = adversarial_tokens(E, 8, 4, rng, per_subset=1, n_random=60)
    bias = rng.uniform(-0.3, 0.2, size=E).astype(np.float32)

    def mask_of(counts):
        m = np.zeros(E, bool)
        for g, c in enumerate(counts):
            m[g * size + rng.choice(size, c, replace=False)] = True
        return m

    hand = [[2, 2, 3, 0, 0, 0, 0, 1], [2, 2, 3, 1, 0, 0, 0, 0], [0, 1, 0, 0, 2, 2, 3, 0], [2, 2, 2, 2, 0, 0, 0, 0],
            [2, 2, 3, 0, 1, 1, 1, 0], [3, 1, 1, 1, 2, 0, 0, 32], [1, 1, 1, 1, 1, 1, 1, 1], [32] * 8]
    drawn = [rng.choice([0, 1, 2, 3, 5, 32], size=8, p=[0.3, 0.3, 0.2, 0.1, 0.05, 0.05]) for _ in range(150)]
    masks = np.array([mask_of(c) for c in hand + drawn if sum(c) >= 1])
    want = np.array([reaches_unkept(logits, bias, m, cfg) for m in masks])
    got = np.array([refused(cfg, m) for m in masks])
    assert want[:len(hand)].tolist() == [True, False, True, False, True, False, True, False]
    wrong = np.flatnonzero(got != want)
    assert not len(wrong), [(masks[i].reshape(8, -1).sum(1).tolist(), "refused" if got[i] else "passed")
                            for i in wrong[:5]]
    assert 20 < want.sum() < len(masks) - 20
    ok = masks[~got]
    idx = np.asarray(route(jnp.asarray(logits), cfg, jnp.asarray(bias), jnp.asarray(ok)[:, None, :]).expert_idx_TK)
    assert np.take_along_axis(ok[:, None, :], idx.reshape(len(ok), 1, -1), -1).all()

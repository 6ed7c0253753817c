"""Scores against numpy computed straight from SPEC section 2, on a real routed pass of the toy layer."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moejax.errors import ConfigError
from moejax.models.toy import ToyMoE
from moejax.scoring import SCORES, compute_scores, resolve_keep, select_kept, stats_from_pairs


@pytest.fixture(scope="module")
def routed():
    model = ToyMoE(d_model=8, d_hidden=16, n_experts=16, top_k=3, rngs=nnx.Rngs(0))
    model.bias[...] = jax.random.normal(jax.random.key(5), (16,)) * 0.3  # partly negative
    x = jax.random.normal(jax.random.key(1), (400, 8)) + 0.7
    routing, f, _ = model.routed_pass(x)
    st = stats_from_pairs(routing.expert_idx_TK, routing.gate_TK, jnp.linalg.norm(f, axis=-1),
                          np.asarray(x).mean(0), model.router[...], model.bias[...], seed=7, layer=2,
                          expert_weights=model.expert_weights())
    return model, np.asarray(x, np.float64), st


def numpy_reference(model, x):
    """Routing and expert outputs re-done in numpy from the definitions."""
    W = np.asarray(model.router[...], np.float64)
    b = np.asarray(model.bias[...], np.float64)
    w1, w2 = np.asarray(model.w1[...], np.float64), np.asarray(model.w2[...], np.float64)
    s = 1 / (1 + np.exp(-(x @ W.T)))
    idx = np.argsort(-(s + b), axis=1, kind="stable")[:, :3]
    g = np.take_along_axis(s, idx, 1)
    g = g / g.sum(1, keepdims=True)
    E = W.shape[0]
    freq, reap, ean, man, msan, max_act, aimer = (np.zeros(E) for _ in range(7))
    for j in range(E):
        t, k = np.nonzero(idx == j)
        f = np.maximum(x[t] @ w1[j], 0) @ w2[j]
        n = np.linalg.norm(f, axis=1)
        freq[j], ean[j] = len(t), n.sum()
        reap[j] = (g[t, k] * n).sum() / len(t) if len(t) else 0.0
        man[j], msan[j], max_act[j] = (n.mean(), (n ** 2).mean(), n.max()) if len(t) else (0.0, 0.0, 0.0)
        w = np.concatenate([w1[j].ravel(), w2[j].ravel()])
        aimer[j] = -np.abs(w).mean() / np.sqrt((w ** 2).mean())
    return {"frequency": freq, "reap": reap, "ean": ean, "w_mean": W @ x.mean(0), "bias": -b,
            "signed": W.sum(1), "l1": np.abs(W).sum(1), "man": man, "msan": msan, "max_act": max_act, "aimer": aimer}


def test_every_score_matches_its_definition(routed):
    model, x, st = routed
    ref = numpy_reference(model, x)
    got = compute_scores(st, list(ref))
    assert (ref["frequency"] == 0).any(), "want an expert with no tokens (reap must be 0 there)"
    for name, want in ref.items():
        np.testing.assert_allclose(got[name], want, rtol=1e-5, atol=1e-6, err_msg=name)
    # Rankings: exact for scores whose values are exact; for the float32 forward's reap and ean,
    # wherever neighbouring values are not near-tied.
    for name, want in ref.items():
        if name in ("reap", "ean", "man", "msan", "max_act") and \
                np.min(np.diff(np.sort(want))) <= 1e-4 * np.abs(want).max():
            continue
        assert np.array_equal(np.argsort(-got[name], kind="stable"), np.argsort(-want, kind="stable")), name

def test_aimer_of_an_all_zero_expert_is_minus_one_and_ranks_it_last(routed):
    """aimer's documented value for an expert whose weights are all zero (a ratio 0/0): -1, the
    lowest value the score takes (the ratio lies in (0, 1]), so the expert is removed first; 0
    would rank it above every other expert (their scores are negative)."""
    model, x, st = routed
    weights = {k: np.array(v, np.float64) for k, v in model.expert_weights().items()}
    for w in weights.values():
        w[4] = 0.0
    idx = np.zeros((1, 3), np.int64)
    zeroed = stats_from_pairs(idx + [0, 1, 2], np.ones((1, 3)), np.ones((1, 3)), np.zeros(8),
                              np.asarray(model.router[...]), None, expert_weights=weights)
    got = compute_scores(zeroed, ["aimer"])["aimer"]
    w = np.concatenate([weights[k].reshape(16, -1) for k in sorted(weights)], axis=1)
    for j in range(16):
        if j != 4:
            assert got[j] == pytest.approx(-np.abs(w[j]).mean() / np.sqrt((w[j] ** 2).mean()), rel=1e-12)
    assert got[4] == -1.0 and np.delete(got, 4).min() > -1.0
    assert np.flatnonzero(~select_kept(got, 15)).tolist() == [4]


def test_output_norm_scores_leave_out_padding_and_unrouted_experts():
    """man, msan and max_act over the routed pairs of the unpadded tokens only: a padding token
    with a huge output norm changes none of them, and an expert no token chose scores 0."""
    rng = np.random.default_rng(0)
    idx = rng.integers(0, 5, size=(40, 2))
    idx[:, 1] = (idx[:, 0] + 1) % 5  # two distinct experts per token; expert 5 is never chosen
    norm = rng.uniform(0.5, 2.0, size=(40, 2))
    mask = np.ones(40, bool)
    mask[[3, 17, 30]] = False
    norm[~mask] = 1e3  # padding: would win every maximum and dominate every mean
    st = stats_from_pairs(idx, np.full((40, 2), 0.5), norm, np.zeros(4), np.ones((6, 4)), None, token_mask_T=mask)
    got = compute_scores(st, ["man", "msan", "max_act"])
    for j in range(6):
        n = norm[mask][idx[mask] == j]
        want = (n.mean(), (n ** 2).mean(), n.max()) if n.size else (0.0, 0.0, 0.0)
        np.testing.assert_allclose([got["man"][j], got["msan"][j], got["max_act"][j]], want, rtol=1e-12, err_msg=j)
    assert got["max_act"][5] == got["man"][5] == got["msan"][5] == 0


def test_scores_a_pass_did_not_compute_are_refused_by_name(routed):
    st = routed[2]
    bare = type(st)(**{**st.__dict__, "norm_sq_sum_E": None, "norm_max_E": None, "weight_abs_sum_E": None})
    for name in ("msan", "max_act", "aimer"):
        with pytest.raises(ConfigError, match=f"layer 2: score '{name}' needs"):
            compute_scores(bare, [name])


def test_random_is_seeded_per_seed_and_layer(routed):
    _, _, st = routed
    a = SCORES["random"](st)
    assert np.array_equal(a, SCORES["random"](st))
    st2 = type(st)(**{**st.__dict__, "layer": 3})
    assert not np.array_equal(a, SCORES["random"](st2))


def test_unknown_score_lists_valid_ones(routed):
    with pytest.raises(ConfigError, match="valid scores: .*frequency"):
        compute_scores(routed[2], ["frequency", "magic"])


def test_select_kept_ties_to_lower_index():
    score = np.array([1.0, 3.0, 3.0, 0.0, 3.0, 1.0])
    assert np.flatnonzero(select_kept(score, 2)).tolist() == [1, 2]
    assert np.flatnonzero(select_kept(score, 4)).tolist() == [0, 1, 2, 4]
    assert np.flatnonzero(select_kept(np.zeros(5), 3)).tolist() == [0, 1, 2]


def test_resolve_keep_counts_ratios_and_floor():
    assert resolve_keep(16, 64, 4) == 16
    assert resolve_keep(0.25, 64, 4) == 16
    # (1 - r) * E = 30.5 -> round-half-even gives 30 -> keep 34 (half-up would keep 33)
    assert resolve_keep(1 - 30.5 / 64, 64, 4) == 34
    assert resolve_keep(1.0, 64, 4) == 64
    with pytest.raises(ConfigError, match="below top_k=4"):
        resolve_keep(3, 64, 4)
    with pytest.raises(ConfigError, match="below top_k=4"):
        resolve_keep(0.05, 64, 4)
    with pytest.raises(ConfigError, match="exceeds"):
        resolve_keep(65, 64, 4)
    with pytest.raises(ConfigError, match="ratio"):
        resolve_keep(1.5, 64, 4)


def test_ranked_vote_with_ties_and_unvoted_experts_equals_the_vote_run_literally():
    """`ranked_vote`'s O(T E) elimination equals the vote run literally round by round (numpy, every
    expert still in counted), on integer logits full of ties (preference ties to the lower index,
    vote-count ties to the lowest index) and experts no token ranks in its top k, which leave first."""
    import sys
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from hf_fixtures import ranked_vote_reference

    from moejax.scoring.scores import vote_out_rounds

    rng = np.random.default_rng(0)
    for trial in range(40):
        T, E = int(rng.integers(1, 25)), int(rng.integers(2, 9))
        k = int(rng.integers(1, E + 1))
        logits = rng.integers(0, 3, size=(T, E)).astype(np.float64)
        order = np.argsort(-logits, axis=1, kind="stable")
        np.testing.assert_array_equal(vote_out_rounds(order, E, k), ranked_vote_reference(logits, k), err_msg=trial)
    # written out: one voter, top 1, preferring 2 > 0 > 1 > 3: experts 0, 1 and 3 have no votes and
    # leave first, in index order; 2 last (ModelOpt's count of voted experts only would keep 0, 1 and
    # 3 to the end)
    np.testing.assert_array_equal(vote_out_rounds(np.array([[2, 0, 1, 3]]), 4, 1), [0, 1, 3, 2])
    # two voters, top 1: 0 > 1 > 2 and 1 > 0 > 2: expert 2 (no votes) leaves first, then 0 and 1 tie
    # at one vote each and 0 (the lower index) leaves; its voter moves to 1
    np.testing.assert_array_equal(vote_out_rounds(np.array([[0, 1, 2], [1, 0, 2]]), 3, 1), [1, 2, 0])


def test_interventional_scores_a_pass_did_not_compute_are_refused_by_name(routed):
    st = routed[2]
    for name in ("loo_reroute", "loo_reroute_cos", "ranked_vote"):
        with pytest.raises(ConfigError, match=f"layer 2: score '{name}' needs"):
            compute_scores(st, [name])

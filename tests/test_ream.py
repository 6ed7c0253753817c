"""REAM merging (moejax.merging.ream, `merge_layer(Ream(...))`, `moejax merge --method ream`) against
plain float64 numpy written here from REAM's rules (SamsungSAILMontreal/ream: `ream/ream.py`
`pseudo_group`, `ream/merger.py` `Merger.fit` / `_merge`, `ream/moe_utils.py` `run_all_experts`,
`ream/weight_utils.py`), and a merged checkpoint checked on transformers' own numbers.

The rules, as the reference below implements them (loops, no moejax code):
  similarity  S = ((1 + cos(m_i, m_j)) / 2 + 1 - D_ij / max D) / 2, m_j = sum_x softmax(l(x))_j f_j(x),
              D_ij = || l_i/|l_i| - l_j/|l_j| || over the columns of raw router logits
  grouping    centroids = the keep highest scores (ties: lower index), most salient first; C > 0: each
              takes its C - 1 most similar unassigned non-centroids (ties: lower index); C = 0: each
              non-centroid joins its most similar centroid (ties: the more salient); nobody dropped
  alignment   cost = cdist(unit activation rows over sampled tokens) + cdist(unit rows of the
              PCA-64 projection X_c V S of all experts' unit neuron weight rows); scipy Hungarian
  average     sum_j w_j P_j(W_j) / sum_j w_j, w = scores with zeros raised to min(0.5, min positive)
"""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from scipy.optimize import linear_sum_assignment

from moejax.errors import ConfigError
from moejax.merging.calibration import MergeStats, merge_stats, subsample_positions
from moejax.merging.clusters import canonical_labels, m_smoe_groups_from_gram
from moejax.merging.layer import merge_layer
from moejax.merging.method import MergeContext, parse
from moejax.merging.ream import (ream_align, ream_groups, ream_merge, ream_similarity, saliency_weights,
                                 weight_features)

# --- the reference, from the rules ---------------------------------------------------------------


def ref_unit(v):
    v = np.asarray(v, np.float64)
    n = np.sqrt((v ** 2).sum())
    return v / n if n > 0 else v


def ref_softmax(z):
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def ref_similarity(f_ETH, logits_TE):
    """S from per-token expert outputs and router logits (no Gram matrix)."""
    E = f_ETH.shape[0]
    p = ref_softmax(logits_TE)
    m = [sum(p[t, j] * f_ETH[j, t] for t in range(f_ETH.shape[1])) for j in range(E)]
    cols = [ref_unit(logits_TE[:, j]) for j in range(E)]
    d = np.array([[np.sqrt(((cols[i] - cols[j]) ** 2).sum()) for j in range(E)] for i in range(E)])
    s = np.empty((E, E))
    for i in range(E):
        for j in range(E):
            cos = float(ref_unit(m[i]) @ ref_unit(m[j]))
            s[i, j] = ((1 + cos) / 2 + 1 - d[i, j] / d.max()) / 2
    return s


def ref_groups(scores, sim, keep, C):
    E = len(scores)
    centroids = sorted(range(E), key=lambda e: (-scores[e], e))[:keep]
    owner = {c: c for c in centroids}
    if C == 0:
        for j in range(E):
            if j not in owner:
                best = centroids[0]
                for c in centroids[1:]:
                    if sim[c][j] > sim[best][j]:
                        best = c
                owner[j] = best
    else:
        for c in centroids:
            group = [c]
            for j in sorted(range(E), key=lambda j: (-sim[c][j], j)):
                if len(group) >= C:
                    break
                if j != c and j not in owner:
                    group.append(j)
                    owner[j] = c
            if len(owner) == E:
                break
    assert len(owner) == E
    return canonical_labels([owner[e] for e in range(E)]), centroids


def ref_weights(scores):
    s = [float(v) for v in scores]
    floor = min(0.5, min(v for v in s if v > 0))
    return [v if v > 0 else floor for v in s]


def ref_activations(G, U, x):
    """[F, N] unit rows: silu(x G^T) * (x U^T), G, U [F, H] (HF layout: a row per neuron)."""
    g = x @ G.T
    a = (g / (1 + np.exp(-g)) * (x @ U.T)).T
    return np.array([ref_unit(r) for r in a])


def ref_pca_rows(experts, dim=64):
    """[E, F, k]: unit rows of X_c V_k S_k, X = every expert's unit rows [gate_i | up_i | down_col_i]."""
    X = np.concatenate([np.array([ref_unit(np.concatenate([G[i], U[i], D[:, i]])) for i in range(G.shape[0])])
                        for G, U, D in experts])
    Xc = X - X.mean(axis=0)
    _, S, Vt = np.linalg.svd(Xc, full_matrices=False)
    k = min(dim, *X.shape)
    Y = Xc @ Vt[:k].T * S[:k]
    return np.array([ref_unit(r) for r in Y]).reshape(len(experts), -1, k)


def ref_merge(experts, labels, centroids, scores, x):
    """{cluster label: (G, U, D)} merged from HF-layout experts [(G [F, H], U [F, H], D [H, F])]."""
    w = ref_weights(scores)
    Y = ref_pca_rows(experts)
    out, perms = {}, {}
    for c in centroids:
        members = [j for j in range(len(labels)) if labels[j] == labels[c]]
        Gc, Uc, Dc = experts[c]
        Ac = ref_activations(Gc, Uc, x)
        acc = [w[c] * Gc, w[c] * Uc, w[c] * Dc]
        for j in members:
            if j == c:
                continue
            Gj, Uj, Dj = experts[j]
            Aj = ref_activations(Gj, Uj, x)
            F = Gc.shape[0]
            cost = np.array([[np.sqrt(((Ac[a] - Aj[b]) ** 2).sum()) + np.sqrt(((Y[c, a] - Y[j, b]) ** 2).sum())
                              for b in range(F)] for a in range(F)])
            rows, cols = linear_sum_assignment(cost)
            perm = cols[np.argsort(rows)]
            perms[j] = perm
            acc = [acc[0] + w[j] * Gj[perm], acc[1] + w[j] * Uj[perm], acc[2] + w[j] * Dj[:, perm]]
        total = sum(w[j] for j in members)
        out[int(labels[c])] = tuple(m / total for m in acc)
    return out, perms


def to_hf(weights, e):
    """moejax's [in, out] expert e -> HF layout (G [F, H], U [F, H], D [H, F]), float64."""
    return tuple(np.asarray(weights[k][e], np.float64).T for k in ("gate", "up", "down"))


def random_layer(rng, E=6, H=5, F=4, T=30, N=12):
    weights = {"gate": rng.normal(size=(E, H, F)), "up": rng.normal(size=(E, H, F)), "down": rng.normal(size=(E, F, H))}
    x = rng.normal(size=(T, H))
    logits = rng.normal(size=(T, E))
    return weights, x, logits, x[:N]


def numpy_outputs(weights, x):
    """f [E, T, H] in float64: every expert on every token."""
    g = np.einsum("th,ehf->etf", x, weights["gate"])
    return np.einsum("etf,efh->eth", g / (1 + np.exp(-g)) * np.einsum("th,ehf->etf", x, weights["up"]),
                     weights["down"])


# --- the rules one by one ----------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1])
def test_similarity_from_the_definition(seed):
    rng = np.random.default_rng(seed)
    weights, x, logits, _ = random_layer(rng, E=7, T=25)
    f = numpy_outputs(weights, x)
    gated = np.einsum("te,eth->eh", ref_softmax(logits), f)
    got = ream_similarity(gated, logits.T @ logits)
    want = ref_similarity(f, logits)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    assert np.allclose(np.diag(got), 1) and np.allclose(got, got.T) and got.min() > 0


def test_groups_from_the_definition_with_ties_leftover_groups_and_c0():
    rng = np.random.default_rng(3)
    seen_partial = seen_tied_scores = 0
    for trial in range(300):
        E = int(rng.integers(2, 14))
        keep = int(rng.integers(1, E + 1))
        C = int(rng.integers(0, E + 2))
        if C and keep * C < E:
            C = -(-E // keep)                                 # the smallest C that holds every expert
        scores = rng.integers(0, 4, size=E).astype(np.float64) if trial % 2 else rng.random(E)
        sim = rng.random((E, E))
        sim = (sim + sim.T) / 2
        np.fill_diagonal(sim, 1.0)
        want, centroids = ref_groups(scores, sim, keep, C)
        got = ream_groups(scores, sim, keep, C)
        assert got.tolist() == want.tolist(), (scores, keep, C)
        sizes = np.bincount(got)
        assert len(sizes) == keep and (C == 0 or sizes.max() <= C)
        seen_partial += bool(C and 1 < sizes.max() and sizes.min() < sizes.max())
        seen_tied_scores += len(set(scores.tolist())) < E
    assert seen_partial > 20 and seen_tied_scores > 50


def test_group_size_zero_is_m_smoes_rule_on_the_same_similarity():
    rng = np.random.default_rng(4)
    for _ in range(50):
        E, keep = 10, int(rng.integers(1, 10))
        logits = rng.normal(size=(40, E))
        gram = logits.T @ logits
        counts = rng.permutation(E).astype(np.float64) + 1      # distinct: M-SMoE's dominant experts
        norms = np.sqrt(np.diag(gram))
        cos = gram / np.outer(norms, norms)
        assert ream_groups(counts, cos, keep, 0).tolist() == m_smoe_groups_from_gram(gram, counts, keep).tolist()


def test_leftovers_are_refused_not_dropped():
    """REAM merges every expert: groups of at most C cannot hold E experts when keep * C < E.
    (REAM's own pre-check, keep >= E // C, lets E=10, keep=3, C=3 through, then asserts.)"""
    sim = np.eye(10) + 0.1
    scores = np.arange(10.0)
    with pytest.raises(ConfigError, match="cannot hold all 10"):
        ream_groups(scores, sim, 3, 3)
    with pytest.raises(ConfigError, match="cannot hold all 10"):
        ream_groups(scores, sim, 9, 1)
    assert ream_groups(scores, sim, 10, 1).tolist() == list(range(10))
    assert sorted(np.bincount(ream_groups(scores, sim, 3, 4)).tolist()) == [2, 4, 4]   # the last group partial
    for bad in (-1, 2.5, True):
        with pytest.raises(ConfigError, match="group_size"):
            ream_groups(scores, sim, 3, bad)
    with pytest.raises(ConfigError, match="non-negative"):
        ream_groups(scores - 1, sim, 3, 4)


def test_saliency_weights_raise_zeros():
    assert saliency_weights([0, 0.2, 3, 0]).tolist() == [0.2, 0.2, 3, 0.2] == ref_weights([0, 0.2, 3, 0])
    assert saliency_weights([0, 2, 3]).tolist() == [0.5, 2, 3]
    assert saliency_weights([1, 2]).tolist() == [1, 2]
    with pytest.raises(ConfigError, match="every score"):
        saliency_weights([0, 0])


@pytest.mark.parametrize("seed", [5, 6])
def test_alignment_and_average_from_the_definition(seed):
    rng = np.random.default_rng(seed)
    E, H, F = 7, 6, 5
    weights, _, _, x = random_layer(rng, E=E, H=H, F=F, N=9)
    scores = np.array([3.0, 0.0, 1.5, 0.7, 0.0, 2.2, 0.1])
    sim = rng.random((E, E))
    sim = (sim + sim.T) / 2
    labels, centroids = ref_groups(scores, sim, 3, 3)
    experts = [to_hf(weights, e) for e in range(E)]
    want, want_perms = ref_merge(experts, labels, centroids, scores, x)
    leaders = np.empty(3, np.int64)
    leaders[labels[centroids]] = centroids
    perms = ream_align(weights, labels, leaders, x)
    assert sorted(perms) == sorted(want_perms) and len(perms) == E - 3
    for j, perm in want_perms.items():
        assert perms[j].tolist() == perm.tolist(), j
    assert any((p != np.arange(F)).any() for p in perms.values())  # alignment moves neurons here
    merged = ream_merge(weights, labels, leaders, scores, x)
    for c, (G, U, D) in want.items():
        np.testing.assert_allclose(merged["gate"][c].T, G, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(merged["up"][c].T, U, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(merged["down"][c].T, D, rtol=1e-12, atol=1e-12)


def test_alignment_with_one_sampled_token_compares_raw_activations():
    """With one sampled token REAM does not unit-normalise the activation rows (`merger.py: _merge`:
    `normalize_rows(act) if act.shape[-1] > 1 else act`; a unit row of one value would be its
    sign): the Hungarian cost compares the neurons' raw activations on that token plus their PCA
    weight rows, and the merge averages the neurons so aligned."""
    rng = np.random.default_rng(8)
    E, F = 6, 6
    weights, _, _, x = random_layer(rng, E=E, H=5, F=F, N=1)
    scores = np.array([0.4, 2.0, 0.0, 1.1, 0.3, 0.9])
    sim = rng.random((E, E))
    sim = (sim + sim.T) / 2
    labels, centroids = ref_groups(scores, sim, 2, 3)
    experts = [to_hf(weights, e) for e in range(E)]
    Y = ref_pca_rows(experts)

    def raw(e):                                           # [F, 1]: silu(x G^T) * (x U^T), no normalising
        G, U, _ = experts[e]
        g = x @ G.T
        return (g / (1 + np.exp(-g)) * (x @ U.T)).T

    want, unit_rule = {}, {}
    for c in centroids:
        for j in np.flatnonzero(labels == labels[c]):
            if j != c:
                for acts, out in ((raw, want), (lambda e: ref_activations(*experts[e][:2], x), unit_rule)):
                    cost = np.array([[np.sqrt(((acts(c)[a] - acts(j)[b]) ** 2).sum()) + np.sqrt(((Y[c, a] - Y[j, b]) ** 2).sum())
                                      for b in range(F)] for a in range(F)])
                    rows, cols = linear_sum_assignment(cost)
                    out[int(j)] = cols[np.argsort(rows)].tolist()
    leaders = np.empty(2, np.int64)
    leaders[labels[centroids]] = centroids
    perms = ream_align(weights, labels, leaders, x)
    assert {j: p.tolist() for j, p in perms.items()} == want and len(want) == E - 2
    assert want != unit_rule                               # the rule decides the alignment here
    merged = ream_merge(weights, labels, leaders, scores, x)
    w = np.array(ref_weights(scores))
    for c in centroids:
        members = np.flatnonzero(labels == labels[c])
        G = sum(w[j] * (experts[j][0] if j == c else experts[j][0][want[int(j)]]) for j in members) / w[members].sum()
        np.testing.assert_allclose(merged["gate"][labels[c]].T, G, rtol=1e-12, atol=1e-12)


def test_ties_in_similarity_follow_reams_order():
    """Exact ties in the similarity (REAM's distances tie when experts' statistics coincide): with
    C = 0 a non-centroid joins the MORE SALIENT of equally similar centroids (REAM's argmin over
    its centroid order), whatever their indices; with C > 0 a centroid takes the lower-index of
    equally similar experts. Checked by hand, then against the reference on similarities of few
    distinct values."""
    scores = np.array([3.0, 0.0, 5.0, 1.0, 0.5])          # centroids (keep 2): 2, then 0
    sim = np.full((5, 5), 0.5)
    np.fill_diagonal(sim, 1.0)
    assert ream_groups(scores, sim, 2, 0).tolist() == canonical_labels([0, 2, 2, 2, 2]).tolist()
    assert ream_groups(scores, sim, 2, 3).tolist() == canonical_labels([0, 2, 2, 2, 0]).tolist()
    rng = np.random.default_rng(9)
    moved = 0
    for trial in range(300):
        E = int(rng.integers(3, 12))
        keep = int(rng.integers(2, E))
        scores = rng.permutation(E).astype(np.float64)     # distinct: the centroid order is the salience order
        sim = rng.integers(0, 3, size=(E, E)) / 2.0
        sim = np.maximum(sim, sim.T)
        np.fill_diagonal(sim, 1.0)
        for C in (0, -(-E // keep) + int(rng.integers(0, 2))):
            want, centroids = ref_groups(scores, sim, keep, C)
            assert ream_groups(scores, sim, keep, C).tolist() == want.tolist(), (scores, sim, keep, C)
            if C == 0:
                lowest = canonical_labels([e if e in centroids else min(
                    (c for c in centroids if sim[c, e] == max(sim[centroids, e])), key=int) for e in range(E)])
                moved += lowest.tolist() != want.tolist()
    assert moved > 50                                      # ties whose lower-index centroid is the less salient


def test_randomised_pca_equals_the_exact_one_when_its_sketch_spans_the_rows():
    rng = np.random.default_rng(7)
    weights = {"gate": rng.normal(size=(3, 5, 4)), "up": rng.normal(size=(3, 5, 4)), "down": rng.normal(size=(3, 4, 5))}
    exact, sketched = weight_features(weights), weight_features(weights, exact_max=0)
    want = ref_pca_rows([to_hf(weights, e) for e in range(3)])
    def dist(y):
        rows = y.reshape(-1, y.shape[-1])
        return np.sqrt(((rows[:, None] - rows[None]) ** 2).sum(-1))

    np.testing.assert_allclose(dist(exact), dist(want), atol=1e-10)
    np.testing.assert_allclose(dist(sketched), dist(want), atol=1e-10)


# --- a layer through merge_stats and merge_layer ---------------------------------------------------


@pytest.fixture(scope="module")
def dsv3(tmp_path_factory):
    """Tiny DeepSeek-V3 (sigmoid router, balance bias, shared experts; one routing group), its
    transformers model and calibration ids."""
    from hf_fixtures import make_checkpoint

    path = tmp_path_factory.mktemp("ream") / "dsv3"
    hf = make_checkpoint(path, seed=21, n_group=1, topk_group=1)
    calib = np.random.default_rng(22).integers(0, 96, size=(4, 20)).astype(np.int32)
    return path, hf, calib


@pytest.fixture(scope="module")
def moe_layer(dsv3):
    from moejax.hf.model_io import load_pretrained

    model = load_pretrained(dsv3[0])
    return model.model.layers[1].mlp


def test_merge_stats_ream_from_the_definition(moe_layer):
    """The router-weighted output sums and the sampled router inputs (two batches, padding) equal
    numpy; the other statistics equal the plain pass's; the sample does not depend on batching."""
    rng = np.random.default_rng(8)
    moe = moe_layer
    xs = [rng.normal(size=(12, 64)).astype(np.float32), rng.normal(size=(9, 64)).astype(np.float32)]
    masks = [np.r_[np.ones(10, bool), np.zeros(2, bool)], np.r_[np.zeros(3, bool), np.ones(6, bool)]]
    plain = merge_stats(moe, [jnp.asarray(x) for x in xs], masks)
    got = merge_stats(moe, [jnp.asarray(x) for x in xs], masks, ream=True, ream_tokens=7, seed=3)
    w = {k: np.asarray(v, np.float64) for k, v in moe.expert_weights().items()}
    x = np.concatenate([x[m] for x, m in zip(xs, masks)]).astype(np.float64)
    logits = x @ np.asarray(moe.router[...], np.float64).T
    want = np.einsum("te,eth->eh", ref_softmax(logits), numpy_outputs(w, x))
    np.testing.assert_allclose(got.gated_output_sum_EH, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())
    for name in ("counts_E", "output_sum_EH", "logit_gram_EE"):
        np.testing.assert_allclose(getattr(got, name), getattr(plain, name), rtol=1e-6, atol=1e-6, err_msg=name)
    assert got.n_tokens == plain.n_tokens == 16 and plain.gated_output_sum_EH is None and got.has_ream
    chosen = subsample_positions(16, 7, 3)
    assert len(set(chosen.tolist())) == 7 and chosen.max() < 16
    np.testing.assert_array_equal(got.act_inputs_NH, x[chosen].astype(np.float32))
    one = merge_stats(moe, [jnp.asarray(x.astype(np.float32))], [None], ream=True, ream_tokens=7, seed=3)
    np.testing.assert_array_equal(one.act_inputs_NH, got.act_inputs_NH)
    every = merge_stats(moe, [jnp.asarray(x) for x in xs], masks, ream=True, ream_tokens=100)
    np.testing.assert_array_equal(every.act_inputs_NH, x.astype(np.float32))


def test_permuted_copies_are_recovered(moe_layer):
    """Experts 0..7 are neuron-permuted copies of two experts (router rows copied too): REAM groups
    the copies with their centroid and the merge gives back the centroid exactly, as a function and
    weight by weight; averaging without alignment would not."""
    from flax import nnx

    rng = np.random.default_rng(9)
    moe = nnx.clone(moe_layer)
    base = {k: np.asarray(v) for k, v in moe.expert_weights().items()}
    router = np.asarray(moe.router[...])
    F = base["gate"].shape[2]
    perms = [rng.permutation(F) for _ in range(8)]
    src = [e % 2 for e in range(8)]
    new = {"gate": np.stack([base["gate"][src[e]][:, perms[e]] for e in range(8)]),
           "up": np.stack([base["up"][src[e]][:, perms[e]] for e in range(8)]),
           "down": np.stack([base["down"][src[e]][perms[e]] for e in range(8)])}
    for k, attr in (("gate", "experts_gate"), ("up", "experts_up"), ("down", "experts_down")):
        getattr(moe, attr)[...] = jnp.asarray(new[k])
    moe.router[...] = jnp.asarray(router[src])
    x = jnp.asarray(rng.normal(size=(48, 64)).astype(np.float32))
    stats = merge_stats(moe, [x], [None], ream=True, ream_tokens=32)
    scores = np.array([1.0, 0.5, 0.9, 2.0, 0.3, 0.0, 0.8, 0.6])   # centroids: 3 (copies of 1) and 0 (copies of 0)
    lm = merge_layer(parse("ream", group_size=4), 2, MergeContext.of(stats, scores), new)
    assert lm.clusters() == [[0, 2, 4, 6], [3, 1, 5, 7]] and lm.leaders.tolist() == [0, 3]
    for c, lead in enumerate(lm.leaders):
        for k in new:
            np.testing.assert_allclose(lm.weights[k][c], new[k][lead], rtol=1e-5, atol=1e-6, err_msg=k)
    w = np.array(ref_weights(scores))[[3, 1, 5, 7]]
    unaligned = np.einsum("j,jfh->fh", w / w.sum(), new["down"][[3, 1, 5, 7]])   # the same average, no alignment
    assert np.abs(unaligned - new["down"][3]).max() > 0.1 * np.abs(new["down"][3]).max()


def test_merge_layer_needs_scores_and_ream_statistics(moe_layer):
    rng = np.random.default_rng(10)
    x = jnp.asarray(rng.normal(size=(16, 64)).astype(np.float32))
    w = moe_layer.expert_weights()
    ream = parse("ream")
    with pytest.raises(ConfigError, match="scores_E"):
        merge_layer(ream, 4, MergeContext.of(merge_stats(moe_layer, [x], [None], **ream.stats_options())), w)
    with pytest.raises(ConfigError, match="ream=True"):
        merge_layer(ream, 4, MergeContext.of(merge_stats(moe_layer, [x], [None]), np.ones(8)), w)
    with pytest.raises(ConfigError, match="ream_tokens"):
        merge_stats(moe_layer, [x], [None], ream=True, ream_tokens=0)


def test_ream_does_not_collapse_into_one_giant_cluster_where_hc_smoe_does(capsys):
    """Heavy-tailed expert output norms (as real layers have): HC-SMoE's average linkage on the mean
    outputs leaves a few outliers alone and puts nearly everything else in one cluster; REAM's
    groups hold at most C experts."""
    rng = np.random.default_rng(11)
    E, H, T, keep, C = 32, 16, 200, 8, 8
    direction = rng.normal(size=(E, H))
    norms = np.exp(rng.normal(0, 1.5, size=E))
    mean_out = direction / np.linalg.norm(direction, axis=1, keepdims=True) * norms[:, None]
    logits = rng.normal(size=(T, E))
    stats = MergeStats(counts_E=rng.integers(1, 50, size=E).astype(np.float64), output_sum_EH=mean_out * T,
                       logit_gram_EE=logits.T @ logits, n_tokens=T, gated_output_sum_EH=mean_out * T / E,
                       act_inputs_NH=rng.normal(size=(4, H)))
    reap = norms * rng.uniform(0.5, 1.5, size=E)
    hc = sorted(np.bincount(parse("hc_smoe").clusters(keep, MergeContext.of(stats))).tolist(), reverse=True)
    ream = sorted(np.bincount(parse("ream", group_size=C).clusters(keep, MergeContext.of(stats, reap))).tolist(),
                  reverse=True)
    with capsys.disabled():
        print(f"\n{E} experts into {keep} clusters, sizes: hc_smoe {hc}, ream (C={C}) {ream}")
    assert hc[0] >= 0.75 * E and ream[0] <= C and len(ream) == keep


# --- moejax merge --method ream ----------------------------------------------------------------------


def test_merge_refuses_bad_ream_settings_before_the_pass(dsv3, tmp_path, monkeypatch, capsys):
    import moejax.inference.stream
    from moejax.cli import main
    from moejax.surgery.merge import merge_checkpoint

    path, _, calib = dsv3
    tokens = tmp_path / "calib.npy"
    np.save(tokens, calib)

    def no_pass(*args, **kwargs):
        raise AssertionError("the calibration pass started")

    monkeypatch.setattr(moejax.inference.stream, "stream_layers", no_pass)
    # (the method's settings, merge_checkpoint's own arguments, the refusal): a method's settings are
    # checked when it is made (`parse`), the keep-dependent ones and the command's by merge_checkpoint
    bad = [(dict(score="nonsense"), {}, "^ream: score \\(--score, merge\\.ream\\.score\\) 'nonsense': unknown score; "
                                        "REAM takes one of \\['reap'"),
           (dict(score="w_mean"), {}, "'w_mean': can be negative"), (dict(score="bias"), {}, "'bias': can be negative"),
           (dict(group_size=-1), {}, "group_size"),
           (dict(group_size=2), dict(keep=3), "cannot hold all 8"), (dict(tokens=0), {}, "ream_tokens"),
           (dict(method="m_smoe", score="reap"), {}, "^merge method m_smoe: unknown setting\\(s\\) \\['score'\\]; "
                                                     "its settings: none"),
           (dict(method="hc_smoe", group_size=4), {},
            "^merge method hc_smoe: unknown setting\\(s\\) \\['group_size'\\]; its settings: \\['clustering'\\]"),
           ({}, dict(sequential=True, allocation="global"), "--sequential with --allocation global")]
    for settings, kwargs, match in bad:
        settings, kwargs = {"method": "ream", **settings}, {"keep": 4, **kwargs}
        with pytest.raises(ConfigError, match=match):
            merge_checkpoint(path, tmp_path / "out", tokens=tokens, method=parse(settings.pop("method"), **settings),
                             **kwargs)
    # the command line: a flag of a setting the method lacks is refused, naming the method it belongs to
    for flags, message in ((["--method", "m_smoe", "--score", "reap"],
                            "--score: not a setting of --method m_smoe (its settings: none); --score is ream's"),
                           (["--method", "hc_smoe", "--group-size", "4"],
                            "--group-size: not a setting of --method hc_smoe (its settings: ['clustering']); "
                            "--group-size is ream's")):
        assert main(["merge", str(path), str(tmp_path / "out"), "--keep", "4", "--tokens", str(tokens), *flags]) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_ream_checkpoint_equals_the_definitions_on_transformers_numbers_and_loads(dsv3, tmp_path):
    """`moejax merge --method ream` on DeepSeek-V3: REAP scores, groups, alignment and average from
    the rules on what transformers' own forward computes (router inputs, raw logits, its experts'
    weights), float64; the merged checkpoint holds them and transformers loads it and computes the
    source model with the leaders' experts replaced by the merged ones and the others unreachable."""
    import torch
    import transformers

    from hf_fixtures import batch, hook_router, reference_scores
    from moejax.cli import main
    from moejax.hf.io.checkpoint_reader import CheckpointReader

    path, _, calib = dsv3
    tokens = tmp_path / "calib.npy"
    np.save(tokens, calib)
    dst, C, N = tmp_path / "merged", 3, 40
    assert main(["merge", str(path), str(dst), "--method", "ream", "--keep", "4", "--group-size", str(C),
                 "--tokens", str(tokens), "--ream-tokens", str(N), "--batch-size", "3"]) == 0
    record = json.loads((dst / "pruning.json").read_text())
    assert (record["method"], record["form"], record["settings"]) == ("ream", "shrunk",
                                                                      {"score": "reap", "group_size": C, "tokens": N})
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager",
                                                           experts_implementation="eager").eval()
    mask = np.ones(calib.shape, np.int32)
    _, seen = hook_router(hf, calib, mask)
    scores = reference_scores(hf, seen, mask)
    a, b = CheckpointReader(path), CheckpointReader(dst)
    replaced, merged_groups = {}, 0
    for l, (x, logits, _, _) in seen.items():
        x, logits = x.double().numpy(), logits.double().numpy()
        block = hf.model.layers[l].mlp.experts
        gate_up, down = block.gate_up_proj.detach().double().numpy(), block.down_proj.detach().double().numpy()
        F = gate_up.shape[1] // 2
        experts = [(gate_up[e, :F], gate_up[e, F:], down[e]) for e in range(8)]
        g = np.einsum("th,efh->etf", x, gate_up[:, :F])
        f = np.einsum("etf,ehf->eth", g / (1 + np.exp(-g)) * np.einsum("th,efh->etf", x, gate_up[:, F:]), down)
        reap = scores[l]["reap"]
        labels, centroids = ref_groups(reap, ref_similarity(f, logits), 4, C)
        want, _ = ref_merge(experts, labels, centroids, reap, x[subsample_positions(len(x), N, 0)])
        clusters = sorted([[c] + [j for j in range(8) if labels[j] == labels[c] and j != c] for c in centroids])
        layer, stem = record["layers"][str(l)], f"model.layers.{l}.mlp."
        assert layer["clusters"] == clusters and layer["kept"] == sorted(centroids)
        np.testing.assert_allclose(layer["scores"], reap, rtol=1e-4)
        for new, members in enumerate(clusters):
            names = [f"{stem}experts.{new}.{p}_proj.weight" for p in ("gate", "up", "down")]
            if len(members) == 1:
                assert all(b.read_bytes(n) == a.read_bytes(n.replace(f".{new}.", f".{members[0]}.")) for n in names)
                continue
            merged_groups += 1
            G, U, D = want[int(labels[members[0]])]
            for n, ref in zip(names, (G, U, D)):
                np.testing.assert_allclose(b.read(n), ref, rtol=1e-5, atol=1e-6 * np.abs(ref).max(), err_msg=n)
            replaced[l, members[0]] = (G, U, D)
    assert merged_groups >= 2
    # transformers' source model with each merged group's leader replaced by the reference merge and
    # every non-leader unreachable (its balance bias -1e4, per layer): what the merged checkpoint computes
    ids, bmask = batch(96, seed=7)
    saved = {}
    with torch.no_grad():
        for (l, lead), (G, U, D) in replaced.items():
            block = hf.model.layers[l].mlp.experts
            block.gate_up_proj[lead] = torch.as_tensor(np.concatenate([G, U]), dtype=torch.float32)
            block.down_proj[lead] = torch.as_tensor(D, dtype=torch.float32)
        for l in seen:
            gate = hf.model.layers[l].mlp.gate
            saved[l] = gate.e_score_correction_bias.clone()
            gate.e_score_correction_bias[sorted(set(range(8)) - set(record["layers"][str(l)]["kept"]))] = -1e4
        want_logits = hf(torch.as_tensor(ids, dtype=torch.long), attention_mask=torch.as_tensor(bmask)).logits.numpy()
    merged_hf = transformers.AutoModelForCausalLM.from_pretrained(dst, attn_implementation="eager").eval()
    assert merged_hf.config.n_routed_experts == 4
    with torch.no_grad():
        got = merged_hf(torch.as_tensor(ids, dtype=torch.long), attention_mask=torch.as_tensor(bmask)).logits.numpy()
    valid = bmask.astype(bool)
    np.testing.assert_allclose(got[valid], want_logits[valid], rtol=1e-4, atol=1e-4)


def test_sequential_ream_checkpoint_is_the_carried_pass_sequential_merge(dsv3, tmp_path):
    """`moejax merge --method ream --sequential`: each layer's groups and merged experts are the
    carried pass's `sequential_shrunk` merge (each layer merged on the model merged up to it,
    checked against the whole model's forward in test_variants), not the one-shot one."""
    from moejax.cli import main
    from moejax.evaluation.carried import evaluate_pruning
    from moejax.hf.io.checkpoint_reader import CheckpointReader
    from moejax.hf.model_io import open_checkpoint

    path, _, calib = dsv3
    tokens = tmp_path / "calib.npy"
    np.save(tokens, calib)
    dst = tmp_path / "merged"
    assert main(["merge", str(path), str(dst), "--method", "ream", "--keep", "4", "--group-size", "3",
                 "--tokens", str(tokens), "--batch-size", "4", "--sequential"]) == 0
    record = json.loads((dst / "pruning.json").read_text())
    assert record["form"] == "sequential_shrunk"
    _, info = evaluate_pruning(open_checkpoint(path), calib, {"a": calib}, ["frequency"], [4],
                               merges=(parse("ream", group_size=3),), sequential_merges=True, batch_size=4,
                               merged_weights=True)
    plans = {p.spec.form: p for p in info["plans"] if p.spec.method == "ream"}
    b, same = CheckpointReader(dst), {}
    for l, layer in record["layers"].items():
        seq, one_shot = plans["sequential_shrunk"].layers[int(l)].merge, plans["shrunk"].layers[int(l)].merge
        assert layer["clusters"] == sorted(seq.clusters())
        same[int(l)] = one_shot.labels_E.tolist() == seq.labels_E.tolist()
        for new, members in enumerate(layer["clusters"]):
            if len(members) == 1:
                continue
            c = int(seq.labels_E[members[0]])
            for p in ("gate", "up", "down"):
                got = b.read(f"model.layers.{l}.mlp.experts.{new}.{p}_proj.weight")
                np.testing.assert_allclose(got, np.asarray(seq.weights[p][c]).T, rtol=1e-5, atol=1e-6)
                same[int(l)] &= bool(np.allclose(np.asarray(one_shot.weights[p][c]).T, got, rtol=1e-5))
    first, *later = sorted(same)
    assert same[first] and not all(same[l] for l in later), same   # layer 1 sees the unmerged model; later ones do not

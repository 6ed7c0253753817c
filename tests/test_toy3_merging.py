"""toy3's merging variants (SPEC section 8) and its Eq. 6 check, against numpy from the definitions:
routing, calibration counts, mean outputs, merged weights (M-SMoE's neuron alignment included),
the merged layer's output under both router forms, and Eq. 6's prediction. The clusters come from
the library's `hc_smoe_clusters` / `m_smoe_groups` (scipy), fed with inputs computed here."""

import numpy as np
import pytest
from scipy.optimize import linear_sum_assignment

from toy3_reference import np_balance, np_route
from moejax.errors import ConfigError
from moejax.experiments import toy3
from moejax.merging.clusters import hc_smoe_clusters, m_smoe_groups
from moejax.merging.method import MergeContext, parse
from test_toy3 import np_softmax_route

# A small layer (16 experts, compiles fast); keep=16 is every expert (test_singleton_clusters_change_nothing)
SMALL = dict(n_experts=16, d_model=8, d_hidden=16, n_calib=400, n_heldout=300, balance_steps=25, keep=(4, 8, 16),
             scores=("frequency",), offsets=("random",), eq6_pairs=5)
SEED = 2


@pytest.fixture(scope="module", params=["sigmoid", "softmax"])
def run(request):
    loads = ("skewed", "balanced") if request.param == "sigmoid" else ("skewed",)
    cfg = toy3.Toy3Config(seed=SEED, seeds=1, router=request.param, loads=loads, **SMALL)
    df, _ = toy3.run(cfg)
    return cfg, df, toy3.draw_inputs(cfg, [SEED])[0]


def value(df, load, score, keep, metric):
    sel = df[(df.load == load) & (df.score == score) & (df.metric == metric)
             & (df.keep.isna() if keep is None else df.keep == keep)]
    assert len(sel) == 1, (load, score, keep, metric)
    return float(sel.value.iloc[0])


def np_expert(w1, w2, x):
    """f(x) = w2 . relu(w1 . x), float64."""
    return np.maximum(np.asarray(x, np.float64) @ w1, 0) @ w2


def np_layer_output(x, idx_TK, gate_TK, experts):
    """y_t = sum_k g_tk f_{idx_tk}(x_t); experts: e -> (w1, w2)."""
    y = np.zeros((len(x), x.shape[1]))
    for e in np.unique(idx_TK):
        tok, slot = np.nonzero(idx_TK == e)
        y[tok] += gate_TK[tok, slot, None] * np_expert(*experts[e], x[tok])
    return y


class Condition:
    """One (seed, offset, load) of the toy in numpy: routing of the calibration and held-out tokens
    under a kept set of router slots, counts, and the unpruned output."""

    def __init__(self, cfg, inp, load):
        self.cfg, self.router, self.load = cfg, cfg.router, load
        self.w1, self.w2 = inp["w1"].astype(np.float64), inp["w2"].astype(np.float64)
        self.x_cal, self.x_held = inp["x_cal"][0], inp["x_held"][0]
        self.logits_cal, self.logits_held = self.x_cal @ inp["router"].T, self.x_held @ inp["router"].T
        E = len(self.w1)
        self.bias = np.zeros(E, np.float32)
        if load == "balanced":
            self.bias = np_balance(self._sigmoid(self.logits_cal), cfg.balance_steps, cfg.balance_rate, cfg.top_k)
        idx, _ = self.route(self.logits_cal, np.ones(E, bool))
        self.counts = np.bincount(idx.ravel(), minlength=E).astype(np.float64)
        self.idx_cal = idx
        self.idx_held, self.gate_held = self.route(self.logits_held, np.ones(E, bool))
        self.own = {e: (self.w1[e], self.w2[e]) for e in range(E)}
        self.y = np_layer_output(self.x_held, self.idx_held, self.gate_held, self.own)

    @staticmethod
    def _sigmoid(logits):
        return 1 / (1 + np.exp(-logits))

    def route(self, logits, kept_E):
        """Top K of s + bias over the kept slots (ties to the lower index), gates s renormalised."""
        if self.router == "softmax":
            return np_softmax_route(logits, kept_E, self.cfg.top_k)
        s = self._sigmoid(logits)
        return np_route(np.where(kept_E, s + self.bias, -np.inf), s, self.cfg.top_k)

    def rel_error(self, y_merged):
        err, ref = ((y_merged - self.y) ** 2).sum(1), (self.y ** 2).sum(1)
        return err.sum() / ref.sum(), float(np.median(err / ref))


def np_align(dominant, member):
    """perm: the member's neuron perm[i] goes to the dominant's position i, maximising the summed
    inner product of each neuron's weights (its w1 column beside its w2 row): Hungarian assignment."""
    feats = [np.concatenate([w1.T, w2], axis=1) for w1, w2 in (dominant, member)]
    rows, cols = linear_sum_assignment(feats[0] @ feats[1].T, maximize=True)
    return cols[np.argsort(rows)]


def np_merged_experts(method, keep, cond):
    """Slot e -> (w1, w2) its cluster computes with: W_G = sum_j freq_j W_j / sum_j freq_j over G,
    M-SMoE's members first permuted onto the dominant expert; and each cluster's most frequent member
    (ties to the lower index)."""
    E = len(cond.w1)
    if method == "hc_smoe":
        c = np.stack([np_expert(cond.w1[j], cond.w2[j], cond.x_cal).mean(0) for j in range(E)])
        labels = hc_smoe_clusters(c, keep)
    else:
        labels = m_smoe_groups(cond.logits_cal.astype(np.float64), cond.counts, keep)
    dominant = np.argsort(-cond.counts, kind="stable")[:keep]
    slots, leaders = {}, []
    for c in range(labels.max() + 1):
        members = np.flatnonzero(labels == c)
        leaders.append(max(members, key=lambda j: (cond.counts[j], -j)))
        freq = cond.counts[members] / cond.counts[members].sum()
        weights = {j: (cond.w1[j], cond.w2[j]) for j in members}
        if method == "m_smoe" and len(members) > 1:
            (d,) = set(members) & set(dominant)
            for j in members:
                perm = np_align(weights[d], weights[j])
                weights[j] = (weights[j][0][:, perm], weights[j][1][perm])
        merged = tuple(sum(f * weights[j][k] for f, j in zip(freq, members)) for k in (0, 1))
        slots.update({j: merged for j in members})
    return slots, np.array(leaders)


@pytest.mark.parametrize("method", ["hc_smoe", "m_smoe"])
def test_merged_error_matches_numpy(run, method):
    """(a) The merged layer's held-out error, tied and shrunk, equals numpy's from the definitions."""
    cfg, df, inp = run
    for load in cfg.loads:
        cond = Condition(cfg, inp, load)
        for keep in (4, 8):
            slots, leaders = np_merged_experts(method, keep, cond)
            tied = np_layer_output(cond.x_held, cond.idx_held, cond.gate_held, slots)
            kept = np.isin(np.arange(len(cond.w1)), leaders)
            shrunk = np_layer_output(cond.x_held, *cond.route(cond.logits_held, kept), slots)
            for form, y in (("tied", tied), ("shrunk", shrunk)):
                rel, median = cond.rel_error(y)
                score = f"{method}:{form}"
                np.testing.assert_allclose(value(df, load, score, keep, "rel_error"), rel, rtol=1e-4)
                np.testing.assert_allclose(value(df, load, score, keep, "rel_error_median"), median, rtol=1e-4)
                assert rel > 1e-3  # a merge to `keep` < E clusters changes the layer


def test_singleton_clusters_change_nothing(run):
    """(b) keep = E: every cluster a singleton, so every merge reproduces the unpruned layer exactly."""
    cfg, df, _ = run
    full = df[(df.keep == cfg.n_experts) & df.score.str.contains(":")]
    assert len(full) == len(cfg.loads) * 2 * 2 * 2  # loads x methods x forms x (rel_error, median)
    assert (full.value == 0).all()


def test_tied_and_shrunk_share_weights_and_differ_in_routing():
    """(c) Both forms compute with the same rows (a singleton with its own expert, a cluster with its
    merged one); tied keeps every router slot, shrunk one per cluster: its most frequent member,
    ties to the lower index."""
    rng = np.random.default_rng(0)
    w1, w2 = rng.standard_normal((6, 3, 5)), rng.standard_normal((6, 5, 3))
    labels, counts = np.array([0, 1, 0, 2, 1, 1]), np.array([5.0, 2.0, 5.0, 7.0, 3.0, 0.0])
    mm = toy3.merge_map(parse("hc_smoe"), labels, MergeContext(None, counts), w1, w2, first_row=6)
    np.testing.assert_array_equal(mm.leaders, [0, 4, 3])  # 0 and 2 tie: the lower; 4 has the most; 3 alone
    np.testing.assert_array_equal(mm.rows_E, [6, 7, 6, 3, 7, 7])  # expert 3 computes with itself
    np.testing.assert_allclose(mm.experts[0]["w1"], (5 * w1[0] + 5 * w1[2]) / 10)
    np.testing.assert_allclose(mm.experts[1]["w2"], (2 * w2[1] + 3 * w2[4] + 0 * w2[5]) / 5)
    # in the experiment: the shrunk form is routed under its leaders, the tied form as the unpruned layer
    lay = toy3.layout(toy3.Toy3Config(**SMALL))
    labels = lay.labels([(0, 1)] * SMALL["eq6_pairs"])
    assert labels[len(lay.pruned):lay.n_masked] == [(f"{m.name}:shrunk", k) for m in toy3.DEFAULT_MERGES
                                                     for k in (4, 8, 16)]
    assert labels[lay.n_masked:lay.n_masked + len(lay.merged)] == [(f"{m.name}:tied", k) for m in toy3.DEFAULT_MERGES
                                                                    for k in (4, 8, 16)]


def test_m_smoe_shrunk_keeps_the_frequency_slots(run):
    """M-SMoE's leaders are its dominant experts, the `keep` most frequent: its shrunk form routes
    exactly as `frequency` pruning does, so the two differ only in the kept slots' weights."""
    cfg, df, inp = run
    cond = Condition(cfg, inp, cfg.loads[0])
    _, leaders = np_merged_experts("m_smoe", 4, cond)
    np.testing.assert_array_equal(np.sort(leaders), np.sort(np.argsort(-cond.counts, kind="stable")[:4]))


def np_eq6(g_i, g_j, d):
    """N * E[(g_i + g_j)^2] * Var[g_i / (g_i + g_j)] * E[d] over N tokens (0 for none)."""
    if len(g_i) == 0:
        return 0.0
    r = g_i / (g_i + g_j)
    return len(g_i) * np.mean((g_i + g_j) ** 2) * np.mean((r - r.mean()) ** 2) * np.mean(d)


def test_eq6_matches_numpy(run):
    """(d) The Eq. 6 pairs (the most co-routed on calibration tokens), their measured increase in
    error (only that pair merged, tied router) and the formula's prediction, from the definitions."""
    cfg, df, inp = run
    for load in cfg.loads:
        cond = Condition(cfg, inp, load)
        E = len(cond.w1)
        together = {(i, j): int(np.sum(np.any(cond.idx_cal == i, 1) & np.any(cond.idx_cal == j, 1)))
                    for i in range(E) for j in range(i + 1, E)}
        pairs = sorted(together, key=lambda p: (-together[p], p))[:cfg.eq6_pairs]
        rows = df[(df.load == load) & df.metric.str.startswith("eq6_")]
        assert sorted(rows.score.unique()) == sorted(f"pair:{i}+{j}" for i, j in pairs)
        assert rows.keep.isna().all() and len(rows) == 4 * cfg.eq6_pairs
        for i, j in pairs:
            merged = tuple((cond.counts[i] * w[i] + cond.counts[j] * w[j]) / (cond.counts[i] + cond.counts[j])
                           for w in (cond.w1, cond.w2))
            y = np_layer_output(cond.x_held, cond.idx_held, cond.gate_held, {**cond.own, i: merged, j: merged})
            err_T = ((y - cond.y) ** 2).sum(1)
            g_i, g_j = ((cond.gate_held * (cond.idx_held == e)).sum(1) for e in (i, j))
            on_i, on_j = g_i > 0, g_j > 0
            d = ((np_expert(*cond.own[i], cond.x_held) - np_expert(*cond.own[j], cond.x_held)) ** 2).sum(1)
            score = f"pair:{i}+{j}"
            expect = {"eq6_measured": err_T.sum(), "eq6_measured_both": err_T[on_i & on_j].sum(),
                      "eq6_predicted": np_eq6(g_i[on_i | on_j], g_j[on_i | on_j], d[on_i | on_j]),
                      "eq6_predicted_both": np_eq6(g_i[on_i & on_j], g_j[on_i & on_j], d[on_i & on_j])}
            assert np.all(err_T[~(on_i | on_j)] == 0) and expect["eq6_predicted"] > 0
            for metric, v in expect.items():
                np.testing.assert_allclose(value(df, load, score, None, metric), v, rtol=1e-4, atol=1e-9)


def test_eq6_prediction_is_the_formula():
    g_i, g_j, d = np.array([0.2, 0.5, 0.0, 0.3]), np.array([0.3, 0.1, 0.4, 0.0]), np.array([1.0, 2.0, 3.0, 4.0])
    r = np.array([0.4, 5 / 6, 0.0, 1.0])
    expect = 4 * np.mean((g_i + g_j) ** 2) * np.var(r) * 2.5
    assert toy3.eq6_prediction(g_i, g_j, d) == pytest.approx(expect, rel=1e-12)
    assert toy3.eq6_prediction(g_i[:1], g_j[:1], d[:1]) == 0.0  # one token: no variance of the mix
    assert toy3.eq6_prediction([], [], []) == 0.0


def test_merges_in_the_summary_table(run):
    cfg, df, _ = run
    table = toy3.summary_table(df)
    scores = [s for _, _, s in table.index[:len(table) // len(cfg.loads)]]
    assert scores == ["frequency", "hc_smoe:shrunk", "hc_smoe:tied", "m_smoe:shrunk", "m_smoe:tied"]
    assert not any(s.startswith("pair:") for _, _, s in table.index)


@pytest.mark.parametrize("kw,match", [
    (dict(merges=("hc_smoe", "zipit")),
     r"toy3: merges: unknown merge method 'zipit'; valid: \['hc_smoe', 'm_smoe', 'ream'\]"),
    (dict(merges=("ream",), merge={"ream": {"score": "signed"}}),
     r"toy3: ream: score \(--score, merge\.ream\.score\) 'signed': can be negative"),
    (dict(merges=("ream",), keep=(4,), merge={"ream": {"group_size": 4}}), "toy3: REAM with keep=4 and group_size=4"),
    (dict(substitutes=("nope",)), "unknown score"),
    (dict(substitutes=("reap_code",)), "reap_code"),
    (dict(merges=("m_smoe", "m_smoe")), "each at most once"),
    (dict(eq6_pairs=-1), "eq6_pairs=-1"),
    (dict(eq6_pairs=2017), "eq6_pairs=2017; expected 0"),
])
def test_bad_merge_settings_fail_before_compute(kw, match):
    with pytest.raises(ConfigError, match=match):
        toy3.Toy3Config.from_mapping(kw)


def test_no_merges():
    cfg = toy3.Toy3Config.from_mapping({"merges": [], "eq6_pairs": 0})
    assert cfg.merges == () and toy3.layout(cfg).n_slots == 0
    assert toy3.Toy3Config().merges == (parse("hc_smoe"), parse("m_smoe")) and toy3.Toy3Config().eq6_pairs == 16


def test_pair_map_merges_one_pair():
    """An Eq. 6 variant: the pair's slots compute with their frequency-weighted average, every other
    slot with its own expert; its leaders are those of the partition {i, j} + singletons."""
    from moejax.merging.clusters import canonical_labels
    from moejax.merging.clusters import cluster_leaders

    rng = np.random.default_rng(1)
    w1, w2 = rng.standard_normal((6, 3, 5)), rng.standard_normal((6, 5, 3))
    counts = np.array([1.0, 4.0, 2.0, 4.0, 0.0, 3.0])
    for (i, j), lead in (((1, 3), 1), ((2, 5), 5), ((0, 4), 0)):
        mm = toy3.pair_map((i, j), counts, w1, w2, row=6)
        rows = np.arange(6)
        rows[[i, j]] = 6
        np.testing.assert_array_equal(mm.rows_E, rows)
        np.testing.assert_array_equal(mm.leaders, cluster_leaders(canonical_labels(rows), counts))
        assert lead in mm.leaders and len(mm.leaders) == 5
        expect = (counts[i] * w1[i] + counts[j] * w1[j]) / (counts[i] + counts[j])
        np.testing.assert_allclose(mm.experts[0]["w1"], expect, rtol=1e-6)


# --- REAM and MoNE substitution in toy3 (issue 28) ----------------------------------------------------

NEW = dict(SMALL, eq6_pairs=0, merges=(parse("ream"),), substitutes=("frequency", "mone"), keep=(4, 8))


@pytest.fixture(scope="module")
def run_new():
    cfg = toy3.Toy3Config(seed=SEED, seeds=1, **NEW)
    df, _ = toy3.run(cfg)
    return cfg, df, toy3.draw_inputs(cfg, [SEED])[0]


def np_calibration(cond):
    """The calibration tokens' routing (every slot), each routed pair's expert output, float64."""
    idx, gate = cond.route(cond.logits_cal, np.ones(len(cond.w1), bool))
    f = np.stack([np_expert(cond.w1[e], cond.w2[e], cond.x_cal) for e in range(len(cond.w1))])   # [E, T, D]
    return idx, gate, f[idx, np.arange(len(idx))[:, None]]                                       # [T, K, D]


def test_ream_in_toy3_matches_numpy(run_new):
    """toy3's REAM variants: REAP from the routed pairs, REAM's router-weighted output sums (softmax of
    the raw logits over all E) and logit Gram, all computed here in numpy from the definitions, fed
    to the library's groups and merge (tested against their own definitions in test_ream); the
    merged layer's held-out error under both router forms equals numpy's."""
    from moejax.merging.ream import centroid_leaders, ream_groups, ream_merge, ream_similarity

    cfg, df, inp = run_new
    for load in cfg.loads:
        cond = Condition(cfg, inp, load)
        idx, gate, f_TKD = np_calibration(cond)
        E = len(cond.w1)
        reap = np.array([np.mean(gate[idx == j] * np.linalg.norm(f_TKD[idx == j], axis=-1)) if (idx == j).any()
                         else 0.0 for j in range(E)])
        p = np.exp(cond.logits_cal - cond.logits_cal.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        gated = np.stack([p[:, j] @ np_expert(cond.w1[j], cond.w2[j], cond.x_cal) for j in range(E)])
        L = cond.logits_cal.astype(np.float64)
        for keep in (4, 8):
            labels = ream_groups(reap, ream_similarity(gated, L.T @ L), keep, cfg.merges[0].group_size)
            leaders = centroid_leaders(labels, reap)
            merged = ream_merge({"w1": cond.w1, "w2": cond.w2}, labels, leaders, reap, cond.x_cal)
            slots = {e: (merged["w1"][labels[e]], merged["w2"][labels[e]]) for e in range(E)}
            tied = np_layer_output(cond.x_held, cond.idx_held, cond.gate_held, slots)
            shrunk = np_layer_output(cond.x_held, *cond.route(cond.logits_held, np.isin(np.arange(E), leaders)), slots)
            for form, y in (("tied", tied), ("shrunk", shrunk)):
                rel, median = cond.rel_error(y)
                np.testing.assert_allclose(value(df, load, f"ream:{form}", keep, "rel_error"), rel, rtol=1e-4)
                np.testing.assert_allclose(value(df, load, f"ream:{form}", keep, "rel_error_median"), median,
                                           rtol=1e-4)
                assert rel > 1e-3


def test_substitution_in_toy3_matches_numpy(run_new):
    """toy3's MoNE variants: the kept set by frequency or by the mone score (from the definition:
    output standard deviation norm times mean gate), every other expert's slot kept in the router
    and returning its mean output over the calibration tokens routed to it; the held-out error
    equals numpy's, and a constant beats removing the expert (the pruned variant's error)."""
    from toy3_reference import np_keep_mask

    cfg, df, inp = run_new
    for load in cfg.loads:
        cond = Condition(cfg, inp, load)
        idx, gate, f_TKD = np_calibration(cond)
        E, T = len(cond.w1), len(idx)
        counts = np.bincount(idx.ravel(), minlength=E).astype(np.float64)
        mean = np.stack([f_TKD[idx == j].mean(0) if (idx == j).any() else np.zeros(f_TKD.shape[-1])
                         for j in range(E)])
        sq = np.stack([(f_TKD[idx == j] ** 2).mean(0) if (idx == j).any() else np.zeros(f_TKD.shape[-1])
                       for j in range(E)])
        gate_sum = np.array([gate[idx == j].sum() for j in range(E)])
        mone = np.sqrt(np.maximum(sq - mean ** 2, 0).sum(1)) * gate_sum / T
        f_held = {e: np_expert(cond.w1[e], cond.w2[e], cond.x_held) for e in range(E)}
        for name, score in (("frequency", counts), ("mone", mone)):
            for keep in (4, 8):
                kept = np_keep_mask(score, keep)
                y = np.zeros_like(cond.y)
                for t in range(len(y)):
                    for e, g in zip(cond.idx_held[t], cond.gate_held[t]):
                        y[t] += g * (f_held[e][t] if kept[e] else mean[e])
                rel, median = cond.rel_error(y)
                np.testing.assert_allclose(value(df, load, f"{name}:substituted", keep, "rel_error"), rel, rtol=1e-4)
                np.testing.assert_allclose(value(df, load, f"{name}:substituted", keep, "rel_error_median"), median,
                                           rtol=1e-4)
                if name == "frequency":
                    assert rel < value(df, load, "frequency", keep, "rel_error")


def test_merged_pairs_past_the_capacity_are_computed_again_in_full(monkeypatch, caplog):
    """Stage two computes the merged experts only on the (row, token) pairs some variant reads, in
    a buffer sized for a share of the table (`MERGED_SHARE`); a batch needing more is computed
    again at full capacity, with the same results as a run that never overflowed. (The results
    themselves are checked against numpy in test_merged_error_matches_numpy.)"""
    from moejax.experiments.toy3 import job, stage_two
    from moejax.experiments.toy3.host import decide_variants

    cfg = toy3.Toy3Config(seed=SEED, seeds=1, **{**SMALL, "n_heldout": 600})
    lay, seeds = toy3.layout(cfg), np.array([SEED])
    stacked, one, host = job._calibrate(cfg, seeds)
    variants = decide_variants(cfg, lay, seeds, stacked, host)
    kth = stage_two.kth_values(cfg)(one["logits_held"], one["bias"], variants.masks_ZOWAE)
    args = (one["f_held"], one["logits_held"], one["bias"], variants.masks_ZOWAE, kth, variants.rows_ZOWAE,
            stacked["x_held"], variants.merged)
    shares = []   # the shares the fallback asks for
    real = stage_two.stage_merges

    def recorded(c, share=stage_two.MERGED_SHARE):
        shares.append(share)
        return real(c, share)

    monkeypatch.setattr(stage_two, "stage_merges", recorded)
    full = real(cfg, 1.0)(*args)
    assert shares == []
    for share in (stage_two.MERGED_SHARE, 0.0):
        with caplog.at_level("INFO", logger=stage_two.__name__):
            got = real(cfg, share)(*args)
        for a, b in zip(got, full):
            np.testing.assert_array_equal(a, b)
    assert shares == [1.0]   # the share-0 buffer (padding only) overflowed, and only it
    assert [r.getMessage() for r in caplog.records if "full capacity" in r.getMessage()] == [
        "toy3: the merged experts' pairs overflowed a buffer for 0% of the table; computing them again at full "
        "capacity (slower, the same results)"]
    assert 0 < int(np.sum(full[-1])) < 2 * lay.n_slots * cfg.n_heldout   # a part of the table

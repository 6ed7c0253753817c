"""Merging's math (moejax.merging) against numpy written here from the definitions: HC-SMoE's
average-linkage clusters, M-SMoE's dominant-expert groups, the Hungarian neuron alignment (against
brute force over every permutation) and the frequency-weighted average."""

import itertools

import ml_dtypes
import numpy as np
import pytest

from moejax.errors import ConfigError
from moejax.merging.average import align_layer, align_neurons, merge_cluster, merge_weights
from moejax.moe.neurons import permute_neurons
from moejax.merging.clusters import canonical_labels, hc_smoe_clusters, m_smoe_groups


def average_linkage(x, keep):
    """Agglomerative clustering from the definition: start from singletons; repeatedly merge the two
    clusters whose mean pairwise Euclidean distance is smallest (ties: the pair of lowest first
    members); stop at `keep` clusters. Labels numbered by lowest member."""
    d = np.sqrt(((x[:, None] - x[None]) ** 2).sum(-1))
    clusters = [[e] for e in range(len(x))]
    while len(clusters) > keep:
        best = None
        for a, b in itertools.combinations(range(len(clusters)), 2):
            dist = d[np.ix_(clusters[a], clusters[b])].mean()
            if best is None or dist < best[0]:
                best = (dist, a, b)
        _, a, b = best
        clusters[a] = sorted(clusters[a] + clusters[b])
        del clusters[b]
        clusters.sort()
    labels = np.empty(len(x), np.int64)
    for c, members in enumerate(sorted(clusters)):
        labels[members] = c
    return labels


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_hc_smoe_default_is_average_linkage_from_the_definition(seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(12, 5)) * rng.uniform(0.2, 3, size=(12, 1))  # uneven spreads: real hierarchy
    for keep in range(1, 13):
        np.testing.assert_array_equal(hc_smoe_clusters(x, keep), average_linkage(x, keep), err_msg=f"keep={keep}")


def test_kmeans_is_a_named_option_and_not_the_default():
    rng = np.random.default_rng(3)
    x = np.concatenate([rng.normal(size=(6, 4)), rng.normal(size=(6, 4)) + 8])  # two clear groups
    assert hc_smoe_clusters(x, 2, method="kmeans").tolist() == [0] * 6 + [1] * 6
    # where k-means and average linkage disagree, the default is average linkage
    for seed in range(20):
        y = np.random.default_rng(seed).normal(size=(10, 3)) ** 3
        a, k = hc_smoe_clusters(y, 3), hc_smoe_clusters(y, 3, method="kmeans", seed=seed)
        if not np.array_equal(a, k):
            np.testing.assert_array_equal(a, average_linkage(y, 3))
            break
    else:
        pytest.fail("no data where k-means and average linkage differ: the test cannot tell them apart")
    with pytest.raises(ConfigError, match="method='single'"):
        hc_smoe_clusters(y, 3, method="single")


def m_smoe_reference(logits, counts, keep):
    E = logits.shape[1]
    order = sorted(range(E), key=lambda e: (-counts[e], e))
    dominant = sorted(order[:keep])
    joins = []
    for e in range(E):
        if e in dominant:
            joins.append(e)
            continue
        sims = [float(logits[:, e] @ logits[:, d] / (np.linalg.norm(logits[:, e]) * np.linalg.norm(logits[:, d])))
                for d in dominant]
        joins.append(dominant[int(np.argmax(sims))])
    return canonical_labels(joins)


def test_m_smoe_groups_from_the_definition_with_ties():
    rng = np.random.default_rng(4)
    logits = rng.normal(size=(50, 10))
    counts = np.array([5, 9, 9, 1, 7, 0, 9, 3, 2, 7])  # ties at the cut: 9, 9, 9 then 7, 7
    for keep in (1, 3, 4, 5, 10):
        np.testing.assert_array_equal(m_smoe_groups(logits, counts, keep), m_smoe_reference(logits, counts, keep))
    labels = m_smoe_groups(logits, counts, 4)
    assert len(set(labels.tolist())) == 4 and labels[1] != labels[2] != labels[6]  # three dominants apart
    logits[:, 3] = logits[:, 1]            # expert 3 equals dominant 1 exactly: it must join it
    assert m_smoe_groups(logits, counts, 3)[3] == m_smoe_groups(logits, counts, 3)[1]


def features(w):
    """[F, 3H]: each intermediate neuron's gate column, up column and down row, side by side."""
    return np.concatenate([np.asarray(w["gate"]).T, np.asarray(w["up"]).T, np.asarray(w["down"])], axis=1)


def test_alignment_is_the_best_permutation():
    rng = np.random.default_rng(5)
    H, F = 6, 5
    dom = {"gate": rng.normal(size=(H, F)), "up": rng.normal(size=(H, F)), "down": rng.normal(size=(F, H))}
    mem = {k: v + 0.1 * rng.normal(size=v.shape) for k, v in dom.items()}
    mem = permute_neurons(mem, rng.permutation(F))
    a, b = features(dom), features(mem)
    best = max(itertools.permutations(range(F)), key=lambda p: sum(a[i] @ b[p[i]] for i in range(F)))
    assert align_neurons(dom, mem).tolist() == list(best)
    aligned = permute_neurons(mem, align_neurons(dom, mem))
    assert np.abs(aligned["gate"] - dom["gate"]).max() < 0.5  # the near-copy is put back in place


def test_merge_is_the_frequency_weighted_average_and_alignment_makes_it_order_free():
    rng = np.random.default_rng(6)
    H, F = 4, 6
    experts = [{"gate": rng.normal(size=(H, F)), "up": rng.normal(size=(H, F)), "down": rng.normal(size=(F, H))}
               for _ in range(3)]
    freq = [6, 3, 1]
    merged = merge_cluster(experts, freq)
    for k in ("gate", "up", "down"):
        np.testing.assert_allclose(merged[k], (6 * experts[0][k] + 3 * experts[1][k] + experts[2][k]) / 10)
    for k, v in merge_cluster(experts[:1], [0]).items():  # a singleton is itself, routed or not
        np.testing.assert_array_equal(v, experts[0][k])
    np.testing.assert_allclose(merge_cluster(experts, [0, 0, 0])["up"], sum(e["up"] for e in experts) / 3)
    # M-SMoE: permuting a member's neurons (same function) does not change the aligned merge
    shuffled = [experts[0]] + [permute_neurons(e, rng.permutation(F)) for e in experts[1:]]
    a, b = merge_cluster(experts, freq, align=True), merge_cluster(shuffled, freq, align=True)
    for k in a:
        np.testing.assert_allclose(a[k], b[k], atol=1e-12)


def test_bad_requests_are_refused():
    x = np.zeros((4, 2))
    with pytest.raises(ConfigError, match=r"keep=5: expected a number of clusters in \[1, 4\]"):
        hc_smoe_clusters(x, 5)
    with pytest.raises(ConfigError, match="NaN or infinity"):
        hc_smoe_clusters(np.full((4, 2), np.nan), 2)
    with pytest.raises(ConfigError, match="keep=0"):
        m_smoe_groups(np.ones((3, 4)), np.ones(4), 0)


# --- a whole layer at once: align_layer and merge_weights -------------------------------------------------

def best_perm(dom, mem):
    """The best permutation by brute force over all of them (the definition of the alignment)."""
    a, b = features(dom).astype(np.float64), features(mem).astype(np.float64)
    F = len(a)
    return list(max(itertools.permutations(range(F)), key=lambda p: sum(a[i] @ b[p[i]] for i in range(F))))


def layer_of(experts):
    return {k: np.stack([e[k] for e in experts]) for k in experts[0]}


def near_copies(rng, H, F, labels, leaders, dtype=np.float64, kind="swiglu"):
    """Experts whose cluster members are noisy, neuron-shuffled copies of the cluster's leader
    (SwiGLU's, or gpt-oss's clamped SwiGLU with its biases: kind="clamped_swiglu")."""
    from moejax.moe.dispatch import EXPERT_SHAPES

    base = {int(l): {k: rng.normal(size=s) for k, s in EXPERT_SHAPES[kind](H, F).items()} for l in leaders}
    experts = []
    for j, c in enumerate(labels):
        e = base[int(leaders[c])]
        if j != leaders[c]:
            e = permute_neurons({k: v + 0.3 * rng.normal(size=v.shape) for k, v in e.items()}, rng.permutation(F))
        experts.append({k: v.astype(dtype) for k, v in e.items()})
    return experts


LABELS = np.array([0, 1, 0, 2, 1, 1, 3, 0])   # clusters {0, 2, 7}, {1, 4, 5}, {3}, {6}
LEADERS = np.array([2, 1, 3, 6])               # a leader need not be its cluster's lowest member


def test_align_layer_is_the_best_permutation_of_every_member_onto_its_leader():
    rng = np.random.default_rng(7)
    experts = near_copies(rng, 4, 5, LABELS, LEADERS)
    perms = align_layer(layer_of(experts), LABELS, LEADERS)
    assert sorted(perms) == [0, 4, 5, 7]        # every expert but the leaders
    for j, perm in perms.items():
        assert perm.tolist() == best_perm(experts[LEADERS[LABELS[j]]], experts[j]), j
    # float32 weights: the float32 similarity picks the same permutations here
    experts32 = [{k: v.astype(np.float32) for k, v in e.items()} for e in experts]
    perms32 = align_layer(layer_of(experts32), LABELS, LEADERS)
    assert all(np.array_equal(perms32[j], perms[j]) for j in perms)
    # bfloat16 weights (XLA's similarity of the neuron-first blocks): the best permutations of the
    # bfloat16 experts themselves, found by brute force in float64
    experts16 = [{k: v.astype(ml_dtypes.bfloat16) for k, v in e.items()} for e in experts]
    perms16 = align_layer(layer_of(experts16), LABELS, LEADERS)
    assert sorted(perms16) == sorted(perms)
    for j, perm in perms16.items():
        assert perm.tolist() == best_perm(experts16[LEADERS[LABELS[j]]], experts16[j]), j


def test_align_layer_threads_and_inline_give_the_same_permutations(monkeypatch):
    """Wide experts are aligned with the assignments on two threads, narrow ones on the calling
    thread (`INLINE_BELOW`): both give every member the brute-force best permutation, in order."""
    from moejax.merging import average

    rng = np.random.default_rng(9)
    experts = near_copies(rng, 4, 5, LABELS, LEADERS)
    inline = align_layer(layer_of(experts), LABELS, LEADERS)
    monkeypatch.setattr(average, "INLINE_BELOW", 0)   # every layer through the thread pool
    threaded = align_layer(layer_of(experts), LABELS, LEADERS)
    assert list(threaded) == list(inline) and sorted(inline) == [0, 4, 5, 7]
    for j, perm in threaded.items():
        assert perm.tolist() == inline[j].tolist() == best_perm(experts[LEADERS[LABELS[j]]], experts[j]), j


def test_align_layer_memo_across_keeps_aligns_each_pair_once(monkeypatch):
    """The carried pass merges a layer at several keeps with one memo: a (leader, member) pair seen
    at the first keep is read back at the next (no similarity computed for it), pairs new to the
    second are computed and added, and every permutation is the one computed without the memo."""
    from moejax.merging import average

    rng = np.random.default_rng(8)
    experts = near_copies(rng, 4, 5, LABELS, LEADERS)
    weights = layer_of(experts)
    fewer = np.array([0, 1, 0, 0, 1, 1, 0, 0])   # a second keep: {0, 2, 3, 6, 7} led by 2, {1, 4, 5} led by 1
    fewer_leaders = np.array([2, 1])
    memo = {}
    first = align_layer(weights, LABELS, LEADERS, memo)
    assert set(memo) == {(2, 0), (2, 7), (1, 4), (1, 5)}
    computed = []
    real = average._similarity
    monkeypatch.setattr(average, "_similarity", lambda a, b: computed.append(1) or real(a, b))
    second = align_layer(weights, fewer, fewer_leaders, memo)
    assert len(computed) == 2 and set(memo) - {(2, 0), (2, 7), (1, 4), (1, 5)} == {(2, 3), (2, 6)}
    alone = align_layer(weights, fewer, fewer_leaders)
    assert sorted(second) == sorted(alone) == [0, 3, 4, 5, 6, 7]
    assert all(np.array_equal(second[j], alone[j]) for j in alone)
    assert all(np.array_equal(first[j], memo[LEADERS[LABELS[j]], j]) for j in first)

def merge_reference(experts, labels, freq, leaders=None):
    """W_c = sum_{j in c} freq_j P_j(W_j) / sum_{j in c} freq_j (uniform if the cluster's freq sums
    to 0), P_j the brute-force best permutation onto the leader (identity without leaders)."""
    out = {k: [] for k in experts[0]}
    for c in range(max(labels) + 1):
        members = [j for j in range(len(labels)) if labels[j] == c]
        f = np.array([float(freq[j]) for j in members])
        share = f / f.sum() if f.sum() > 0 else np.full(len(members), 1 / len(members))
        for k in out:
            terms = []
            for s, j in zip(share, members):
                w = np.asarray(experts[j][k], np.float64)
                if leaders is not None and j != leaders[c]:
                    perm = best_perm(experts[leaders[c]], experts[j])
                    w = w[:, perm] if k in ("gate", "up") else w[perm]
                terms.append(s * w)
            out[k].append(sum(terms))
    return {k: np.stack(v) for k, v in out.items()}


@pytest.mark.parametrize("align", [False, True])
def test_merge_weights_from_the_definition(align):
    rng = np.random.default_rng(8)
    experts = near_copies(rng, 4, 5, LABELS, LEADERS)
    freq = np.array([3, 0, 1, 5, 0, 0, 2, 4])   # cluster {1, 4, 5} never routed: uniform weights
    merged = merge_weights(layer_of(experts), LABELS, freq, align=align, leaders=LEADERS if align else None)
    want = merge_reference(experts, LABELS, freq, LEADERS if align else None)
    assert set(merged) == {"gate", "up", "down"}
    for k in merged:
        assert merged[k].dtype == np.float64 and merged[k].shape == (4, *experts[0][k].shape)
        np.testing.assert_allclose(merged[k], want[k], rtol=1e-12, atol=1e-12)
    # a cluster of neuron-shuffled near-copies merges back near its leader only when aligned
    gap = np.abs(merged["gate"][0] - experts[2]["gate"]).max()
    assert gap < 0.5 if align else gap > 0.5


def test_merge_weights_precision_singletons_and_the_toy_layout():
    rng = np.random.default_rng(9)
    experts = near_copies(rng, 4, 5, LABELS, LEADERS, dtype=np.float32)
    freq = np.arange(8.0)
    for dtype, want in ((np.float32, np.float32), (ml_dtypes.bfloat16, np.float32), (np.float64, np.float64)):
        layer = {k: v.astype(dtype) for k, v in layer_of(experts).items()}
        merged = merge_weights(layer, LABELS, freq, align=True, leaders=LEADERS)
        assert all(m.dtype == want for m in merged.values()), dtype
        for c, j in ((2, 3), (3, 6)):           # singletons: the expert exactly
            np.testing.assert_array_equal(merged["down"][c], layer["down"][j].astype(want))
        # every expert its own cluster: the layer exactly
        alone = merge_weights(layer, np.arange(8), freq, align=True, leaders=np.arange(8))
        for k in layer:
            np.testing.assert_array_equal(alone[k], layer[k].astype(want))
        # rounded into the layer's dtype a cluster at a time: the float32 result rounded, bitwise
        narrow = merge_weights(layer, LABELS, freq, align=True, leaders=LEADERS, out_dtype=dtype)
        for k in layer:
            assert narrow[k].dtype == dtype
            np.testing.assert_array_equal(narrow[k].view(np.uint8), merged[k].astype(dtype).view(np.uint8))
    np.testing.assert_allclose(merge_weights(layer_of(experts), LABELS, freq)["up"],
                               merge_reference(experts, LABELS, freq)["up"], rtol=1e-6, atol=1e-6)
    toy = {"w1": rng.normal(size=(3, 4, 6)), "w2": rng.normal(size=(3, 6, 4))}   # relu_mlp: w1 [d, F], w2 [F, d]
    toy["w1"][2], toy["w2"][2] = toy["w1"][0][:, ::-1], toy["w2"][0][::-1]       # expert 2: expert 0 reversed
    merged = merge_weights(toy, np.array([0, 1, 0]), np.array([1.0, 1.0, 1.0]), align=True, leaders=np.array([0, 1]))
    np.testing.assert_allclose(merged["w1"][0], toy["w1"][0])   # aligned, the two are one expert
    np.testing.assert_allclose(merged["w2"][1], toy["w2"][1])


def test_averaged_rows_are_merge_weights_rows_bitwise():
    """The carried pass's merged rows made when read (`averaged_rows`, JAX) equal the host merge
    (`merge_weights`, numpy) bit for bit, the same shares, permutations, order of terms and rounding:
    float32 and bfloat16 layers, aligned (M-SMoE's permutations) and not, a cluster whose counts are
    all zero (uniform shares); clusters in any order, rows past them zero; gpt-oss's layout too
    (neurons as interleaved pairs, a bias with no neuron axis). (Under XLA's optimisations,
    as CI runs, a product fused into its sum as one multiply-add breaks it: seen.)"""
    import jax

    from moejax.merging.average import averaged_rows
    from moejax.merging.method import Averaging

    rng = np.random.default_rng(12)
    freq = rng.integers(0, 50, 8).astype(np.float64)
    freq[[1, 4, 5]] = 0                                     # cluster 1: no routing decisions
    experts = near_copies(rng, 256, 192, LABELS, LEADERS, dtype=np.float32)   # wide: XLA fuses (CI optimises)
    gpt_oss = near_copies(rng, 64, 48, LABELS, LEADERS, np.float32, "clamped_swiglu")   # neurons in pairs, biases
    for dtype, experts in ((np.float32, experts), (ml_dtypes.bfloat16, experts), (np.float32, gpt_oss)):
        layer = {k: v.astype(dtype) for k, v in layer_of(experts).items()}
        for align in (False, True):
            perms = align_layer(layer, LABELS, LEADERS) if align else {}
            want = merge_weights(layer, LABELS, freq, perms=perms, out_dtype=dtype)
            rows = averaged_rows(layer, LABELS, Averaging(freq, perms), [1, 0, 3], 5)
            made = jax.jit(lambda rows, own: rows.materialize(own))(rows, {k: jax.numpy.asarray(v) for k, v in layer.items()})
            for k in layer:
                got = np.asarray(made[k])
                assert got.dtype == dtype and got.shape == (5,) + layer[k].shape[1:]
                np.testing.assert_array_equal(got[:3].view(np.uint8), want[k][[1, 0, 3]].view(np.uint8))
                np.testing.assert_array_equal(got[3:], 0)
    with pytest.raises(ConfigError, match="do not fit"):
        averaged_rows(layer, LABELS, Averaging(freq, {}), [0, 1, 2], 2)


def test_merge_weights_refuses_bad_requests():
    rng = np.random.default_rng(10)
    layer = layer_of(near_copies(rng, 4, 5, LABELS, LEADERS))
    freq = np.ones(8)
    with pytest.raises(ConfigError, match="number the clusters 0, 1, ..., C - 1"):
        merge_weights(layer, np.array([0, 1, 0, 3, 1, 1, 3, 0]), freq)          # cluster 2 missing
    with pytest.raises(ConfigError, match="needs each cluster's leader"):
        merge_weights(layer, LABELS, freq, align=True)
    with pytest.raises(ConfigError, match=r"leaders\[c\] an expert of cluster c"):
        merge_weights(layer, LABELS, freq, align=True, leaders=np.array([2, 1, 6, 3]))
    with pytest.raises(ConfigError, match="finite and non-negative"):
        merge_weights(layer, LABELS, -freq)
    with pytest.raises(ConfigError, match="match no layout"):
        merge_weights({"gate": layer["gate"], "up": layer["up"]}, LABELS, freq)


# --- each cluster's leader: moejax.merging.clusters.cluster_leaders -----------------------------------------

def leaders_reference(labels, counts):
    """From the definition (SPEC section 8, `shrunk`): each cluster's most frequent member, ties to
    the lower expert index; clusters in label order 0, 1, ..., C - 1."""
    labels, counts = [int(c) for c in labels], [float(n) for n in counts]
    return [min((e for e in range(len(labels)) if labels[e] == c), key=lambda e: (-counts[e], e))
            for c in range(max(labels) + 1)]


def test_cluster_leaders_from_the_definition_with_ties():
    from moejax.merging.clusters import cluster_leaders

    # {0, 2, 7} tie at the top (4, 4): the lower, 0; {1, 4, 5} tie (5, 5) above its lowest member: 4;
    # {3} alone; {6} never routed; a leader is neither the lowest member nor the first listed
    labels = np.array([0, 1, 0, 2, 1, 1, 3, 0])
    counts = np.array([4, 2, 4, 1, 5, 5, 0, 1])
    assert cluster_leaders(labels, counts).tolist() == leaders_reference(labels, counts) == [0, 4, 3, 6]
    assert cluster_leaders(labels, np.zeros(8)).tolist() == [0, 1, 3, 6]   # never routed: the lowest member
    assert cluster_leaders(labels, np.arange(8.0)).tolist() == [7, 5, 3, 6]  # no ties: the most frequent
    assert cluster_leaders(np.zeros(5, np.int64), [2.0, 7.5, 7.5, 7.49999, 0]).tolist() == [1]
    rng = np.random.default_rng(11)
    for _ in range(200):  # small integer counts: ties everywhere; float counts as merge_stats gives them
        E = int(rng.integers(1, 13))
        labels = canonical_labels(rng.integers(0, int(rng.integers(1, E + 1)), size=E))
        counts = rng.integers(0, 3, size=E).astype(np.float64)
        got = cluster_leaders(labels, counts)
        assert got.dtype == np.int64 and got.tolist() == leaders_reference(labels, counts), (labels, counts)


@pytest.mark.parametrize("method", ["hc_smoe", "m_smoe"])
def test_a_layer_merge_and_a_merge_plan_lead_each_cluster_by_its_most_frequent_member(method):
    """LayerMerge.leaders, its `shrunk` router slots and `moejax merge`'s plan hold the leaders of
    the definition; for M-SMoE each leader is its cluster's dominant expert (ties at the cut)."""
    from moejax.merging.calibration import MergeStats
    from moejax.merging.layer import merge_layer
    from moejax.merging.method import MergeContext, parse
    from moejax.surgery.merge import plan_merge

    rng = np.random.default_rng(12)
    E, H, F = 10, 4, 3
    counts = np.array([5, 9, 9, 1, 7, 0, 9, 3, 2, 7], np.float64)   # ties at the M-SMoE cut: 9, 9, 9 then 7, 7
    logits = rng.normal(size=(40, E))
    stats = MergeStats(counts_E=counts, output_sum_EH=rng.normal(size=(E, H)) * 40, logit_gram_EE=logits.T @ logits,
                       n_tokens=40)
    weights = {"gate": rng.normal(size=(E, H, F)), "up": rng.normal(size=(E, H, F)), "down": rng.normal(size=(E, F, H))}
    merge = parse(method)
    for keep in (2, 4, 5):
        lm = merge_layer(merge, keep, MergeContext.of(stats), weights)
        want = leaders_reference(lm.labels_E, counts)
        assert lm.leaders.tolist() == want and np.flatnonzero(lm.kept_E("shrunk")).tolist() == sorted(want)
        assert [c[0] for c in lm.clusters()] == want
        if method == "m_smoe":
            dominant = sorted(sorted(range(E), key=lambda e: (-counts[e], e))[:keep])
            assert sorted(want) == dominant, keep
        plan = plan_merge({3: stats}, merge, keep, top_k=1)
        assert plan.leaders[3].tolist() == want and plan.labels[3].tolist() == lm.labels_E.tolist()


def test_gpt_oss_neurons_are_interleaved_pairs_and_merge_as_functions():
    """gpt-oss's clamped SwiGLU (`NEURON_LAYOUTS["clamped_swiglu"]`): neuron i owns gate_up columns
    2i and 2i+1, gate_up_bias entries 2i and 2i+1 and down row i; down_bias has no neuron axis.
    Permuting neurons leaves the model's expert function (`ClampedSwiglu`, JAX) unchanged; the
    numpy hidden activations REAM compares feed it exactly; M-SMoE's alignment recovers a shuffled
    copy (so the aligned merge of an expert and its shuffled copy is the expert); the frequency
    average covers the biases, down_bias included. (Entries moved one at a time instead of in
    pairs, any of these fails.)"""
    import jax.numpy as jnp

    from moejax.moe.neurons import hidden_activations
    from moejax.moe.dispatch import ClampedSwiglu

    rng = np.random.default_rng(21)
    H, F, N = 6, 7, 11
    fn = ClampedSwiglu(alpha=1.702, limit=1.5)   # a limit inside the activations' range: clamps bite

    def expert():
        return {"gate_up": rng.normal(size=(H, 2 * F)), "gate_up_bias": rng.normal(size=2 * F),
                "down": rng.normal(size=(F, H)), "down_bias": rng.normal(size=H)}

    def run(w, x):   # the model's expert on tokens x [N, H] (JAX, float32)
        return np.asarray(fn(lambda x, w, b=None: x @ w + (0 if b is None else b),
                             {k: jnp.asarray(v, jnp.float32) for k, v in w.items()}, jnp.asarray(x, jnp.float32)))

    e, x = expert(), rng.normal(size=(N, H)) * 2
    h = hidden_activations(e, x, fn)
    assert (np.abs(e["gate_up"].T @ x.T + e["gate_up_bias"][:, None]).max() > fn.limit)   # the clamp is reached
    np.testing.assert_allclose(h @ e["down"] + e["down_bias"], run(e, x), rtol=2e-5, atol=2e-5)
    perm = rng.permutation(F)
    shuffled = permute_neurons(e, perm)
    assert not np.array_equal(shuffled["gate_up"], e["gate_up"])
    np.testing.assert_array_equal(shuffled["down_bias"], e["down_bias"])
    np.testing.assert_allclose(run(shuffled, x), run(e, x), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(hidden_activations(shuffled, x, fn), h[:, perm], rtol=1e-12)
    back = align_neurons(e, shuffled)
    for k in e:
        np.testing.assert_array_equal(permute_neurons(shuffled, back)[k], e[k])
    for k, v in merge_cluster([e, shuffled], [3, 1], align=True).items():
        np.testing.assert_allclose(v, e[k], rtol=1e-12, atol=1e-12)
    other = expert()
    merged = merge_cluster([e, other], [3, 1])
    for k in e:
        np.testing.assert_allclose(merged[k], (3 * e[k] + other[k]) / 4, rtol=1e-12)
    with pytest.raises(ConfigError, match="ClampedSwiglu"):
        hidden_activations(e, x)    # no alpha or limit: refused, not guessed

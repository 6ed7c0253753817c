"""Merging's math (moejax.merging) against numpy written here from the definitions: HC-SMoE's
average-linkage clusters, M-SMoE's dominant-expert groups, the Hungarian neuron alignment (against
brute force over every permutation) and the frequency-weighted average."""

import itertools

import numpy as np
import pytest

from moejax.errors import ConfigError
from moejax.merging.average import align_neurons, merge_cluster, neuron_features, permute_neurons
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


def test_alignment_is_the_best_permutation():
    rng = np.random.default_rng(5)
    H, F = 6, 5
    dom = {"gate": rng.normal(size=(H, F)), "up": rng.normal(size=(H, F)), "down": rng.normal(size=(F, H))}
    mem = {k: v + 0.1 * rng.normal(size=v.shape) for k, v in dom.items()}
    mem = permute_neurons(mem, rng.permutation(F))
    a, b = neuron_features(dom), neuron_features(mem)
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

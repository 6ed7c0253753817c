"""The allocations (`moejax.allocation`): how many experts each MoE layer keeps under one total,
each against its definition written out here."""

import numpy as np
import pytest

from moejax.allocation import ALLOCATIONS, layer_counts
from moejax.errors import ConfigError


def global_counts(scores, keep, top_k):
    return layer_counts(scores, keep, top_k, "global")


# --- global: one threshold (moejax.allocation.threshold) ---------------------------------------------

def global_reference(scores, keep, top_k):
    """From the definition, one place at a time: shares s_norm = (s - m) / sum(s - m) with
    m = min(min(s), 0) (uniform if that sum is 0); each layer's top_k floor; then, keep x L - top_k x L
    times, the largest share not yet taken (ties: lower layer, then lower expert)."""
    shares = {}
    for layer, s in scores.items():
        m = min(min(s), 0)
        total = sum(float(x) - m for x in s)
        shares[layer] = [(float(x) - m) / total if total > 0 else 1 / len(s) for x in s]
    taken = set()
    for layer, sh in shares.items():
        taken |= {(layer, e) for e in sorted(range(len(sh)), key=lambda e: (-sh[e], e))[:top_k]}
    for _ in range((keep - top_k) * len(scores)):
        taken.add(min(((layer, e) for layer, sh in shares.items() for e in range(len(sh)) if (layer, e) not in taken),
                      key=lambda le: (-shares[le[0]][le[1]], le[0], le[1])))
    return {layer: sum(1 for l_, _ in taken if l_ == layer) for layer in scores}


@pytest.mark.parametrize("seed", range(6))
def test_global_counts_from_the_definition(seed):
    rng = np.random.default_rng(seed)
    E, top_k = 8, 2
    scores = {l: rng.integers(0, 4, size=E).astype(float) for l in (1, 2, 3, 5)}   # many ties
    scores[2] = scores[1].copy()                     # equal shares across layers: lower layer first
    scores[3] = scores[3] - 2                        # signed: shifted by its minimum
    scores[5] = scores[5] + 1                        # positive: s / sum(s), not shifted
    if seed % 2:
        scores[5] = np.full(E, -1.5)                 # shifted sum 0: uniform shares
    for keep in range(top_k, E + 1):
        counts = global_counts(scores, keep, top_k)
        assert counts == global_reference(scores, keep, top_k), keep
        assert sum(counts.values()) == keep * len(scores)
        assert all(top_k <= n <= E for n in counts.values())
        assert layer_counts(scores, keep, top_k, "global") == counts
        assert layer_counts(scores, keep, top_k, "uniform") == dict.fromkeys(scores, keep)


def test_global_counts_follow_the_routing_mass():
    flat = np.full(8, 10.0)                          # every expert 1/8 of the layer's routing
    skewed = np.array([80.0] * 6 + [10.0, 10.0])     # six experts 0.16 each, two 0.02
    counts = global_counts({0: flat, 1: skewed}, 4, 1)
    assert counts == {0: 2, 1: 6}                    # the skewed layer keeps more than keep=4
    # frequencies are used as shares: scaling a layer changes nothing
    assert global_counts({0: 7 * flat, 1: skewed / 3}, 4, 1) == counts
    # identical layers of distinct scores: uniform; of tied scores: the ties go to the lower layer
    distinct = np.arange(1.0, 9.0)
    assert global_counts({0: distinct, 1: distinct.copy()}, 4, 1) == {0: 4, 1: 4}
    assert global_counts({0: skewed, 1: skewed.copy()}, 4, 1) == {0: 6, 1: 2}
    assert global_counts({0: flat, 1: skewed}, 8, 1) == {0: 8, 1: 8}   # keep = E: everything
    assert global_counts({0: flat, 1: skewed}, 2, 2) == {0: 2, 1: 2}   # keep = top_k: the floor


def test_allocation_refuses_bad_requests():
    scores = {0: np.arange(8.0), 1: np.ones(8)}
    with pytest.raises(ConfigError, match=r"keep=1 per layer must lie in \[top_k, E\] = \[2, 8\]"):
        global_counts(scores, 1, 2)
    with pytest.raises(ConfigError, match=r"keep=9 per layer must lie in \[top_k, E\] = \[2, 8\]"):
        layer_counts(scores, 9, 2, "uniform")
    with pytest.raises(ConfigError, match="must be a per-layer count"):
        global_counts(scores, 0.5, 2)
    with pytest.raises(ConfigError, match="NaN or infinity"):
        global_counts({0: np.array([1.0, np.nan, 2.0])}, 2, 1)
    with pytest.raises(ConfigError, match=r"unknown allocation 'local'; valid: \['uniform', 'global'"):
        layer_counts(scores, 4, 2, "local")
    with pytest.raises(ConfigError, match=r"allocation global: layer 1's statistic must be a vector \[E\] = \[8\]"):
        layer_counts({0: np.arange(8.0), 1: np.ones(7)}, 4, 2, "global", {0: 8, 1: 8})


# --- shape: SHAPE's Shapley values and coverage (moejax.scoring.scores.shapley, moejax.allocation.shape) ---

def shape_loop(data: dict) -> dict:
    """SHAPE's `analysis/calc_shapley.py` loop as its authors wrote it (Alizen-1009/Shapley-Moe),
    without its constant weight: data {sorted coalition tuple: tokens}."""
    sub = {}
    for coalition, freq in data.items():
        members = list(coalition)
        for i in range(len(members)):
            key = tuple(members[:i] + members[i + 1:])
            sub[key] = sub.get(key, 0) + freq
    out = {}
    for e in {e for c in data for e in c}:
        combos, min_ratio = [], float("inf")
        for coalition, v in data.items():
            if e in coalition:
                n = sub.get(tuple(sorted(x for x in coalition if x != e)), 0)
                combos.append((v, n))
                min_ratio = min(min_ratio, v / n)
        out[e] = sum(v - min_ratio * n for v, n in combos)
    return out


@pytest.mark.parametrize("E,K", [(7, 3), (6, 2), (8, 4)])
def test_shapley_equals_brute_force_and_the_authors_loop(E, K):
    """The pass's coalition counts (two batches, padding left out) give `shapley` equal to the
    brute-force sum over every (K-1)-coalition and to SHAPE's own loop; an expert no token chose, and
    one in a single coalition, get 0."""
    from hf_fixtures import shapley_reference
    from moejax.scoring.scores import StatsAccumulator, compute_scores

    rng = np.random.default_rng(E * K)
    p = np.arange(1.0, E + 1) ** 2
    p[-1] = 0                                            # expert E-1: never chosen
    rows = np.stack([rng.choice(E, K, replace=False, p=p / p.sum()) for _ in range(240)])
    rows[0] = [E - 1 if j == 0 else j - 1 for j in range(K)]   # padding: this row is masked out below
    acc = StatsAccumulator(E, 4)
    mask = np.ones(240, bool)
    mask[0] = False
    for half in (slice(0, 120), slice(120, 240)):
        acc.add(rows[half], np.ones((len(rows[half]), K)), np.ones((len(rows[half]), K)), token_mask_T=mask[half])
    stats = acc.stats(np.zeros((E, 4)), None)
    got = compute_scores(stats, ["shapley"])["shapley"]
    real = rows[mask]
    np.testing.assert_allclose(got, shapley_reference(real, E), rtol=1e-12, atol=1e-9)
    data = {}
    for row in real.tolist():
        data[tuple(sorted(row))] = data.get(tuple(sorted(row)), 0) + 1
    loop = shape_loop(data)
    np.testing.assert_allclose(got, [loop.get(e, 0.0) for e in range(E)], rtol=1e-12, atol=1e-9)
    assert got[E - 1] == 0 and (got >= -1e-9).all() and got.max() > 0


def coverage_reference(phi: dict, keep: int, top_k: int) -> dict:
    """SHAPE's coverage from the definition, by brute force over alpha: every cumulative share
    (sum of a layer's c largest shares) is where one layer steps; the counts at alpha are, per
    layer, the smallest prefix reaching alpha (at least 1), floored at top_k, capped at E. Scan the
    breakpoints upward for the first alpha whose total reaches keep x L; where it jumps past (equal
    breakpoints), the layers stepping there take the places left, the lower layer first."""
    def shares_of(s):
        return sorted((x / sum(s) if sum(s) > 0 else 1 / len(s) for x in s), reverse=True)

    def counts_at(alpha):
        out = {}
        for layer, s in phi.items():
            shares = shares_of(s)
            c, total = 0, 0.0
            while True:
                total += shares[c]
                c += 1
                if total >= alpha or c == len(s):
                    break
            out[layer] = min(len(s), max(top_k, c))
        return out

    target = keep * len(phi)
    alphas = sorted({0.0} | {float(np.nextafter(b, 2)) for s in phi.values() for b in np.cumsum(shares_of(s))})
    before = counts_at(0.0)
    for alpha in alphas:
        now = counts_at(alpha)
        if sum(now.values()) >= target:
            left = target - sum(before.values())
            out = dict(before)
            for layer in sorted(phi):
                step = min(left, now[layer] - before[layer])
                out[layer] += step
                left -= step
            return out
        before = now
    return before


@pytest.mark.parametrize("seed", range(4))
def test_shape_coverage_hits_the_total_exactly(seed):
    """shape's counts equal the coverage rule by brute force over alpha, sum exactly to keep x L
    for every keep (ties of cumulative shares across layers included), each in [top_k, E]."""
    rng = np.random.default_rng(seed)
    E, top_k = 8, 2
    phi = {l: rng.gamma(0.7, size=E) for l in (0, 1, 3, 4)}
    phi[1] = phi[0].copy()                               # equal cumulative shares: the layers step together
    phi[4][:3] = 0.0                                     # experts of no Shapley mass
    if seed % 2:
        phi[3] = np.zeros(E)                             # a layer of no mass: uniform shares
    for keep in range(top_k, E + 1):
        counts = layer_counts(phi, keep, top_k, "shape")
        assert sum(counts.values()) == keep * len(phi), keep
        assert all(top_k <= c <= E for c in counts.values())
        assert counts == coverage_reference(phi, keep, top_k), keep


def test_shape_keeps_more_where_the_mass_is_spread():
    """A layer whose Shapley mass sits on two experts covers it with fewer than one whose mass is
    spread over all eight."""
    spread, peaked = np.full(8, 1.0), np.array([10.0, 10.0, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1])
    counts = layer_counts({0: spread, 1: peaked}, 4, 1, "shape")
    assert counts[0] > counts[1] and sum(counts.values()) == 8

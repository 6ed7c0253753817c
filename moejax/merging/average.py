"""How a cluster's experts become one: M-SMoE's neuron alignment and the frequency-weighted average
of an expert's matrices, for one cluster or for a whole layer.

An expert is a dict of matrices that share one axis of intermediate neurons (F); where each matrix
keeps it, per expert kind, is `moejax.moe.neurons.NEURON_LAYOUTS` (SwiGLU's gate and up columns
and down row; gpt-oss's interleaved gate_up columns, its biases and down row; the toy's w1, w2). A
permutation of the neurons moves them together and leaves the expert's function unchanged. A layer
is the same dict with a leading expert axis: gate [E, H, F], ...

Precision: everything is computed, and returned, in float64 when any input matrix is float64, and
in float32 otherwise (bfloat16 checkpoints: a product of two bfloat16 numbers is exact in float32,
only the accumulation rounds). The inputs are cast one expert at a time, never a whole layer.
`align_layer` on a bfloat16 layer computes its similarities from the bfloat16 matrices with float32
accumulation (XLA's bfloat16 matmul: 1.6 TFLOP/s on a CPU with AMX, 5x numpy's float32): the same
exact products, summed in another order (agreement to float32 rounding). Each expert is first laid
out neuron-first, [F, 3H], by numpy (3 ms a matrix; XLA's bfloat16 transposes, or a dot contracted
over its first axis, are 5x slower), so that every similarity is one [F, K] x [K, F] product.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import ThreadPoolExecutor

import ml_dtypes
import numpy as np

from moejax.errors import ConfigError
from moejax.host_memory import aligned_empty
from moejax.moe.neurons import layout_of, n_neurons, neuron_blocks, permute


def _compute_dtype(matrices) -> type:
    """float64 if any of the matrices (numpy or jax arrays) is float64, else float32."""
    return np.float64 if any(np.dtype(m.dtype) == np.float64 for m in matrices) else np.float32


def _similarity(dominant_blocks: list, member_blocks: list) -> np.ndarray:
    """S [F, F], S[i, j] = <features_dominant[i], features_member[j]>, a neuron's features being its
    weights in every matrix side by side (SwiGLU: its gate column, up column and down row), computed
    as sum_k A_k @ B_k.T over the matrices (no concatenated copy); blocks from `moejax.moe.neurons.neuron_blocks`."""
    return sum(a @ b.T for a, b in zip(dominant_blocks, member_blocks))


def _assign(similarity) -> np.ndarray:
    """perm [F] maximising sum_i similarity[i, perm[i]] (`scipy.optimize.linear_sum_assignment`,
    the Hungarian assignment; among equally good permutations, scipy's choice, deterministic for a
    given matrix)."""
    from scipy.optimize import linear_sum_assignment

    rows, cols = linear_sum_assignment(np.asarray(similarity), maximize=True)
    perm = np.empty(len(rows), np.int64)
    perm[rows] = cols
    return perm


def align_neurons(dominant: dict, member: dict) -> np.ndarray:
    """perm [F]: the member's neuron perm[i] goes to the dominant expert's position i, maximising
    sum_i <features_dominant[i], features_member[perm[i]]> (equivalently minimising the summed
    squared distance), in the precision of the module docstring."""
    dtype = _compute_dtype([*dominant.values(), *member.values()])
    return _assign(_similarity(neuron_blocks(dominant, dtype), neuron_blocks(member, dtype)))


def _shares(freq) -> np.ndarray:
    """Each member's share of the cluster's routing decisions, freq_j / sum_i freq_i (uniform when
    none was routed)."""
    freq = np.asarray(freq, np.float64)
    return freq / freq.sum() if freq.sum() > 0 else np.full(len(freq), 1.0 / len(freq))


def _average_into(out: dict, experts: list[dict], freq, perms: list) -> dict:
    """out[k] = sum_j share_j * P_j(W_j[k]) for every matrix k, P_j the permutation perms[j] of
    expert j's neurons (None: as it is), written into the arrays of `out` (their dtype); one member's
    matrix cast at a time, into a scratch array (no allocation per member)."""
    layout = layout_of(experts[0])
    shares = _shares(freq).tolist()  # Python floats: no promotion of float32
    for k, acc in out.items():
        cast, moved = np.empty_like(acc), np.empty_like(acc)
        for i, (share, e, perm) in enumerate(zip(shares, experts, perms)):
            np.copyto(cast, np.asarray(e[k]))
            m = cast if perm is None else permute(cast, perm, layout[k], out=moved)
            if i == 0:
                np.multiply(m, share, out=acc)
            else:
                acc += np.multiply(m, share, out=m)
    return out


def merge_cluster(experts: list[dict], freq, align: bool = False) -> dict:
    """One expert from a cluster: each matrix the average of the members', weighted by their share
    of the cluster's routing decisions, W = sum_j freq_j W_j / sum_j freq_j (uniform when none was
    routed). align: first permute every member's neurons onto the first member's (M-SMoE; pass the
    dominant expert first). float32 unless an input is float64."""
    perms = [None] + [align_neurons(experts[0], m) for m in experts[1:]] if align else [None] * len(experts)
    dtype = _compute_dtype([m for e in experts for m in e.values()])
    return _average_into({k: np.empty(np.shape(w), dtype) for k, w in experts[0].items()}, experts, freq, perms)


def layer_dtype(weights: dict):
    """The dtype a layer's merged experts are held in: its matrices' dtype when they share one (a
    bfloat16 layer's, as `moejax merge` writes them), else the compute dtype (`_compute_dtype`)."""
    dtypes = {np.dtype(w.dtype) for w in weights.values()}
    return dtypes.pop() if len(dtypes) == 1 else _compute_dtype(weights.values())


def _check_labels(weights: dict, labels_E) -> np.ndarray:
    layout_of(weights)
    sizes = {k: np.shape(w)[0] for k, w in weights.items()}
    if len(set(sizes.values())) != 1:
        raise ConfigError(f"merge: the matrices' expert axes (axis 0) differ: {sizes}")
    E = next(iter(sizes.values()))
    labels = np.asarray(labels_E)
    if labels.shape != (E,):
        raise ConfigError(f"merge: labels {labels.shape} must be [E] = ({E},)")
    if labels.dtype.kind not in "iu" or not np.array_equal(np.unique(labels), np.arange(labels.max() + 1)):
        raise ConfigError(f"merge: labels {labels.tolist()} must number the clusters 0, 1, ..., C - 1, every one used")
    return labels


def _check_leaders(labels: np.ndarray, leaders) -> np.ndarray:
    leaders = np.asarray(leaders)
    n_clusters = labels.max() + 1
    if leaders.shape != (n_clusters,) or leaders.dtype.kind not in "iu" or \
            not np.array_equal(labels[np.clip(leaders, 0, len(labels) - 1)], np.arange(n_clusters)):
        raise ConfigError(f"merge: leaders {leaders.tolist()} must be int [C] = ({n_clusters},), "
                          f"leaders[c] an expert of cluster c")
    return leaders


def align_layer(weights: dict, labels_E, leaders, alignments: dict | None = None) -> dict[int, np.ndarray]:
    """{expert: perm [F]} for every expert that is not its cluster's leader: `align_neurons` of the
    expert onto its cluster's leader (M-SMoE's dominant expert), for a whole layer.

    weights: a layer ({"gate": [E, H, F], ...}); labels_E: int [E], each expert's cluster, numbered
    0..C-1; leaders: int [C], the leader of each cluster. Each leader is cast once; the
    assignment (scipy releases the GIL) runs in a second thread while the next similarity is
    computed, with at most two similarities waiting (experts narrower than `INLINE_BELOW` neurons:
    all on the calling thread). alignments: {(leader, member): perm}, read and
    filled, for several clusterings of the same weights (one layer at several keeps: a pair aligned
    at one keep is not aligned again at the next; the caller keeps it to one layer's weights)."""
    labels = _check_labels(weights, labels_E)
    leaders = _check_leaders(labels, leaders)
    bf16 = all(np.dtype(w.dtype) == ml_dtypes.bfloat16 for w in weights.values())
    dtype = _compute_dtype(weights.values())

    if bf16:   # XLA's float32-accumulated bfloat16 products (JAX: imported only for a bfloat16 layer)
        from moejax.merging.bf16_align import bf16_neuron_block as _bf16_neuron_block
        from moejax.merging.bf16_align import bf16_similarity as _bf16_similarity

    def blocks(j):
        if bf16:  # the expert neuron-first, [F, K] bfloat16: `_bf16_similarity` accumulates in float32
            return _bf16_neuron_block({k: w[j] for k, w in weights.items()}, layout_of(weights))
        return neuron_blocks({k: w[j] for k, w in weights.items()}, dtype)

    def similarity(a, b):  # bfloat16: dispatched to XLA and not waited for (the assignment thread waits)
        return _bf16_similarity(a, b) if bf16 else _similarity(a, b)

    memo = {} if alignments is None else alignments
    perms, waiting = {}, deque()
    # small experts (the toy's 64 neurons: an assignment in ~0.1 ms) inline: two threads' start,
    # hand-offs and waits cost more than the assignments
    with ThreadPoolExecutor(2) if n_neurons(weights, expert_axis=True) >= INLINE_BELOW else _Inline() as pool:
        for c, lead in enumerate(leaders.tolist()):
            others = [j for j in np.flatnonzero(labels == c).tolist() if j != lead]
            perms.update((j, memo[lead, j]) for j in others if (lead, j) in memo)
            others = [j for j in others if (lead, j) not in memo]
            lead_blocks = blocks(lead) if others else None
            for j in others:  # two assignments beside the next similarities
                waiting.append(((lead, j), pool.submit(_assign, similarity(lead_blocks, blocks(j)))))
                if len(waiting) > 3:
                    pair, job = waiting.popleft()
                    perms[pair[1]] = memo[pair] = job.result()
        for pair, job in waiting:
            perms[pair[1]] = memo[pair] = job.result()
    return perms


INLINE_BELOW = 256   # neurons: experts this narrow are aligned on the calling thread


class _Inline:
    """`ThreadPoolExecutor`'s submit/result, run on the calling thread."""

    class _Done:
        def __init__(self, value):
            self.value = value

        def result(self):
            return self.value

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def submit(self, fn, *args):
        return self._Done(fn(*args))


def merge_weights(weights: dict, labels_E, freq_E, align: bool = False, leaders=None, perms=None,
                  alignments: dict | None = None, out_dtype=None) -> dict:
    """A layer's clusters merged: {"gate": [C, H, F], ...}, row c the merged expert of the cluster
    labelled c (labels_E: int [E] numbering the C clusters 0..C-1; `canonical_labels` numbers them by
    lowest member, as the clusterings do):

        W_c = sum_{j in c} freq_j P_j(W_j) / sum_{j in c} freq_j   (uniform when freq sums to 0)

    P_j the identity for HC-SMoE (align=False), and for M-SMoE (align=True) the permutation of
    expert j's neurons onto its cluster's leader (`align_layer`; the leader's own is the identity).
    leaders: int [C], leaders[c] the expert leading cluster c (M-SMoE's dominant expert); needed
    for align=True only. perms: {expert: perm [F]} computed elsewhere (REAM's alignment,
    `moejax.merging.ream.ream_align`), used as given instead of `align_layer` (an expert not in it
    is averaged as it is); alignments: `align_layer`'s memo, for align=True. A singleton cluster is
    its expert exactly. One cluster at a time, one member's matrix cast at a time; float32 unless an
    input is float64. out_dtype: the merged experts' dtype (a bfloat16 layer's: what `moejax merge`
    writes), each cluster computed as above and rounded into its row, so no float32 [C, ...] copy is
    ever held (None: the compute dtype)."""
    labels = _check_labels(weights, labels_E)
    freq = np.asarray(freq_E, np.float64)
    if freq.shape != labels.shape or not (np.isfinite(freq).all() and (freq >= 0).all()):
        raise ConfigError(f"merge: freq must be [E] = {labels.shape}, finite and non-negative")
    if align and leaders is None:
        raise ConfigError("merge: align=True (M-SMoE) needs each cluster's leader (leaders) to align onto")
    if perms is not None and align:
        raise ConfigError("merge: pass either align=True (M-SMoE's alignment) or perms, not both")
    if perms is None:
        perms = align_layer(weights, labels, leaders, alignments) if align else {}
    dtype = _compute_dtype(weights.values())
    n_clusters = labels.max() + 1
    out_dtype = dtype if out_dtype is None else out_dtype
    out = {k: aligned_empty((n_clusters, *np.shape(w)[1:]), out_dtype) for k, w in weights.items()}  # JAX uses in place
    # one cluster's scratch in the compute dtype when the rows are narrower (else the row itself)
    scratch = None if np.dtype(out_dtype) == np.dtype(dtype) else {k: np.empty(np.shape(w)[1:], dtype)
                                                                  for k, w in weights.items()}
    for row in range(n_clusters):
        members = np.flatnonzero(labels == row).tolist()
        acc = {k: out[k][row] for k in out} if scratch is None else scratch
        _average_into(acc, [{k: w[j] for k, w in weights.items()} for j in members],
                      freq[members], [perms.get(j) for j in members])
        if scratch is not None:
            for k in out:
                out[k][row] = scratch[k]
    return out


def averaged_rows(weights: dict, labels_E, averaging, clusters, n_rows: int):
    """The merged experts of `clusters` as table rows made when read (`moejax.moe.averaged_rows`),
    over the layer's experts `weights` ({name: [E, ...]}): row i the merged expert of clusters[i]
    under `averaging` (a `moejax.merging.method.Averaging`), bit for bit `merge_weights`' row
    (the same shares, permutations, order of terms and rounding into the layer's dtype); rows from
    len(clusters) to n_rows are zero (padding, so merges share one compiled shape). Holds index
    arrays and one share per expert: no expert is copied."""
    import jax.numpy as jnp

    from moejax.moe.averaged_rows import AveragedRows

    labels = _check_labels(weights, labels_E)
    E, layout = len(labels), layout_of(weights)
    if len(clusters) > n_rows:
        raise ConfigError(f"averaged_rows: {len(clusters)} clusters do not fit in {n_rows} rows")
    dtype = _compute_dtype(weights.values())
    members, counts = np.zeros((n_rows, E), np.int32), np.zeros(n_rows, np.int32)
    shares, perms = np.zeros(E, dtype), np.tile(np.arange(n_neurons(weights, expert_axis=True), dtype=np.int32), (E, 1))
    weights_E = np.asarray(averaging.weights_E, np.float64)
    for i, c in enumerate(clusters):
        m = np.flatnonzero(labels == c)
        members[i, :len(m)], counts[i] = m, len(m)
        shares[m] = _shares(weights_E[m])   # as `_average_into` rounds them
    for j, perm in averaging.perms.items():
        perms[j] = perm
    return AveragedRows(jnp.asarray(members), jnp.asarray(counts), jnp.asarray(shares), jnp.asarray(perms),
                        tuple(sorted(layout.items())), layer_dtype(weights))

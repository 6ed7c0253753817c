"""REAM, Router-weighted Expert Activation Merging (Jha et al. 2026, arXiv 2604.04356; code
SamsungSAILMontreal/ream, read at 84a3030 / b8d2393): the `keep` most salient experts are
centroids, every other expert joins a centroid by pseudo-pruning, and each group becomes one expert
by the saliency-weighted average of its members' neuron-aligned weights. Each rule below is the
public code's default (`merge.py`: `--saliency reap --grouping ream --merging logits+weights
--group_size 16`, gate outputs and `gated_sim` on), file and function named; where moejax differs,
the docstring says so.

Notation (one MoE layer): x a calibration token, l(x) [E] its raw router logits (no balance bias),
p(x) = softmax(l(x)) over all E experts, f_j(x) [H] expert j's output, h_j(x) [F] its
intermediate activation (SwiGLU: silu(x W_gate) * (x W_up); the toy's relu(x W1)), s_j the
expert's score (saliency; REAP by default, any float64 [E] score that is >= 0, higher = keep).

Pure numpy/scipy; `moejax.merging.calibration.merge_stats(..., ream=True)` gathers what it reads.
"""

from __future__ import annotations

import numpy as np

from moejax.errors import ConfigError
from moejax.merging.average import _assign, _check_labels, _check_leaders, merge_weights
from moejax.moe.neurons import hidden_activations, neuron_blocks
from moejax.merging.clusters import _check_keep, canonical_labels
from moejax.merging.method import Averaging, MergeContext, MergeMethod, register
from moejax.scoring.scores import ALL_SCORES

PCA_DIM = 64             # REAM's `Merger.pca_dim` ("heuristic")
PCA_OVERSAMPLE = 10      # randomised PCA: extra sketch columns beyond PCA_DIM
PCA_POWER_ITERATIONS = 2  # as torch.pca_lowrank's default niter
EXACT_PCA_MAX = 1 << 24  # entries of the stacked neuron rows [E*F, P] up to which the PCA is an exact SVD

# Scores REAM can weight an average by: non-negative by definition. (REAM's own: `reap`, `freq`.)
# Signed scores (w_mean, signed, bias, aimer) would give negative weights, so they are refused.
REAM_SCORES = ("reap", "frequency", "reap_code", "ean", "man", "msan", "max_act", "l1", "random")


def check_ream_score(score: str, where: str = "--score") -> None:
    """An unknown name is refused as unknown; a known score outside REAM_SCORES as one that can be
    negative (REAM ranks centroids by the score and weights each group's average by it)."""
    if score in REAM_SCORES:
        return
    if score not in ALL_SCORES:
        raise ConfigError(f"{where} {score!r}: unknown score; REAM takes one of {list(REAM_SCORES)}")
    raise ConfigError(f"{where} {score!r}: can be negative, and REAM ranks centroids by the score and weights each "
                      f"group's average by it, so it needs a non-negative one: one of {list(REAM_SCORES)}")


def check_group_size(group_size, keep: int | None = None, n_experts: int | None = None) -> int:
    """group_size: an int >= 0 (0: M-SMoE's rule). With keep and n_experts: refused when C > 0 and
    keep * C < E, the settings under which pseudo-pruning leaves experts unassigned (REAM's
    `pseudo_group` asserts that every expert is assigned; its own pre-check, keep >= E // C, is
    this one when C divides E)."""
    if isinstance(group_size, bool) or not isinstance(group_size, (int, np.integer)) or group_size < 0:
        raise ConfigError(f"group_size={group_size!r} (--group-size): expected an integer >= 0 "
                          "(REAM's C, the most experts a group holds, its centroid included; 0: M-SMoE's rule)")
    if keep is not None and n_experts is not None and 0 < group_size and keep * group_size < n_experts:
        raise ConfigError(f"REAM with keep={keep} and group_size={group_size}: {keep} groups of at most {group_size} "
                          f"experts cannot hold all {n_experts}, and REAM merges every expert (its code asserts "
                          f"so: none is dropped); use keep * group_size >= {n_experts}, or group_size=0")
    return int(group_size)


def _scores(scores_E, n_experts: int | None = None) -> np.ndarray:
    s = np.asarray(scores_E, np.float64)
    if s.ndim != 1 or (n_experts is not None and s.shape != (n_experts,)):
        raise ConfigError(f"ream: scores {s.shape} must be [E]" + (f" = ({n_experts},)" if n_experts else ""))
    if not (np.isfinite(s).all() and (s >= 0).all()):
        raise ConfigError(f"ream: scores must be finite and non-negative (they weight the average); got experts "
                          f"{np.flatnonzero(~(np.isfinite(s) & (s >= 0))).tolist()[:16]} outside")
    return s


def saliency_weights(scores_E) -> np.ndarray:
    """The weights of REAM's average (`merger.py`, `Merger.fit`): w_j = s_j, except that a zero
    s_j becomes min(0.5, min_{i: s_i > 0} s_i), "to allow unused experts be merged" (a zero weight
    would drop the expert from its group's average). All zero: refused (REAM asserts)."""
    s = _scores(scores_E).copy()
    zero = s == 0
    if zero.all():
        raise ConfigError("ream: every score of the layer is 0; no weighted average exists")
    if zero.any():
        s[zero] = min(0.5, s[~zero].min())
    return s


def _unit_rows(m: np.ndarray) -> np.ndarray:
    """Rows scaled to unit Euclidean norm; an all-zero row stays zero (REAM's `normalize_rows`
    adds 1e-8 to the norm instead)."""
    n = np.linalg.norm(m, axis=-1, keepdims=True)
    return np.divide(m, n, out=np.zeros_like(m), where=n > 0)


def output_similarity(gated_output_sum_EH) -> np.ndarray:
    """S_out [E, E], S_out_ij = (1 + cos(m_i, m_j)) / 2, m_j = sum_x p_j(x) f_j(x): the cosine of
    two experts' router-weighted outputs summed over every calibration token, mapped to [0, 1]
    (`ream.py: expert_similarity` on `Merger._forward_pass`'s `final`: `run_all_experts` runs every
    expert on every token and, with `gated_sim` on (the default), multiplies f_j(x) by p_j(x),
    then the outputs are averaged over the tokens before the cosine; a sum has the same cosine).
    An expert whose m_j is zero has cosine 0 with every other."""
    m = _unit_rows(np.asarray(gated_output_sum_EH, np.float64))
    sim = (1.0 + m @ m.T) / 2.0
    np.fill_diagonal(sim, 1.0)
    return sim


def router_similarity(logit_gram_EE) -> np.ndarray:
    """S_gate [E, E] = 1 - D / max(D), D_ij = ||u_i - u_j||_2 = sqrt(2 - 2 cos(l_i, l_j)), u_j the
    unit-normalised column of raw router logits of expert j over the calibration tokens (no softmax:
    `gated_sim` weights the expert outputs, not these), from the Gram matrix G = sum_x l(x) l(x)^T
    (cos(l_i, l_j) = G_ij / sqrt(G_ii G_jj)) (`ream.py: pseudo_group`: `normalize_rows`, `torch.cdist`,
    `utils.py: dist2sim`). Every column equal (max D = 0): S_gate = 1."""
    g = np.asarray(logit_gram_EE, np.float64)
    norms = np.sqrt(np.maximum(np.diag(g), 0.0))
    denom = norms[:, None] * norms[None]
    cos = np.divide(g, denom, out=np.zeros_like(g), where=denom > 0)
    d = np.sqrt(np.maximum(2.0 - 2.0 * cos, 0.0))
    np.fill_diagonal(d, 0.0)
    top = d.max()
    return np.ones_like(d) if top == 0 else 1.0 - d / top


def ream_similarity(gated_output_sum_EH, logit_gram_EE) -> np.ndarray:
    """S [E, E] = (S_out + S_gate) / 2 (`ream.py: pseudo_group`, gate outputs on, the default), the
    similarity pseudo-pruning groups by (REAM's distance is 1 - S): `output_similarity` of the
    router-weighted output sums, `router_similarity` of the router-logit Gram. Diagonal 1."""
    s = (output_similarity(gated_output_sum_EH) + router_similarity(logit_gram_EE)) / 2.0
    if not np.isfinite(s).all():
        raise ConfigError("ream: the similarity holds NaN or infinity (non-finite calibration statistics)")
    return s


def ream_centroids(scores_E, keep: int) -> np.ndarray:
    """int [keep]: the `keep` highest-scoring experts, most salient first (ties to the lower index,
    as `moejax.scoring.select.select_kept`; REAM: `np.argsort(saliency)[::-1][:k]`). Ranked on the
    scores as given; REAM ranks after raising zero scores (`saliency_weights`), which differs only
    among experts tied at that floor."""
    s = _scores(scores_E)
    _check_keep(keep, len(s))
    return np.argsort(-s, kind="stable")[:keep]


def ream_groups(scores_E, similarity_EE, keep: int, group_size: int) -> np.ndarray:
    """labels [E] (numbered by lowest member, `canonical_labels`) of REAM's pseudo-pruning groups
    (`ream.py: pseudo_group`):

        centroids c_1, ..., c_keep = `ream_centroids` (descending score)
        C > 0: for c = c_1, c_2, ...: G_c = {c} + the min(C - 1, #left) experts j, not centroids and
               not yet in a group, with the highest S_cj (ties to the lower index), until none is left
               (a group holds at most C experts, its centroid included: REAM's loop stops at
               len(group) >= group_size)
        C = 0: every non-centroid j joins argmax_c S_cj (M-SMoE's rule, on REAM's similarity; ties
               to the more salient centroid, as REAM's argmin over its centroid order)

    No expert is ever dropped: keep * C < E is refused (`check_group_size`). Each group holds
    exactly one centroid (`centroid_leaders`)."""
    s = _scores(scores_E)
    E = len(s)
    sim = np.asarray(similarity_EE, np.float64)
    if sim.shape != (E, E) or not np.isfinite(sim).all():
        raise ConfigError(f"ream: similarity {sim.shape} must be [E, E] = ({E}, {E}) and finite")
    centroids = ream_centroids(s, keep)
    C = check_group_size(group_size, keep, E)
    owner = np.full(E, -1, np.int64)
    owner[centroids] = centroids
    if C == 0:
        others = np.flatnonzero(owner < 0)
        if len(others):
            owner[others] = centroids[np.argmax(sim[np.ix_(centroids, others)], axis=0)]  # first max: most salient
    else:
        for c in centroids:
            if (owner >= 0).all():
                break
            order = np.argsort(-sim[c], kind="stable")   # most similar first, ties to the lower index
            free = order[owner[order] < 0][:C - 1]
            owner[free] = c
    return canonical_labels(owner)


def centroid_leaders(labels_E, scores_E) -> np.ndarray:
    """int [K]: the centroid of each group (leaders[c] in group c), the K = max label + 1 highest
    scores (`ream_centroids`); refused unless each group holds exactly one."""
    labels = np.asarray(labels_E)
    n_clusters = int(labels.max()) + 1
    centroids = ream_centroids(scores_E, n_clusters)
    leaders = np.full(n_clusters, -1, np.int64)
    leaders[labels[centroids]] = centroids
    if (leaders < 0).any():
        raise ConfigError(f"ream: groups {labels.tolist()} do not each hold one of the {n_clusters} highest-scoring "
                          f"experts {sorted(centroids.tolist())} (REAM's centroids)")
    return leaders


def neuron_activations(expert: dict, x_NH, expert_fn=None) -> np.ndarray:
    """A [F, N]: each neuron's activations over the N tokens, unit-normalised (REAM's
    `normalize_rows` over the token axis, `merger.py: Merger._merge`; not when N = 1, as REAM)."""
    a = hidden_activations(expert, x_NH, expert_fn).T
    return a if a.shape[1] <= 1 else _unit_rows(a)


def _neuron_rows(weights: dict, e: int) -> np.ndarray:
    """Expert e's neurons as unit rows [F, P] in float64, a neuron's weights in every matrix side by
    side (SwiGLU: its gate column, up column and down row; REAM's `ffn_weight_matrix`, then
    `normalize_rows`)."""
    return _unit_rows(np.concatenate(neuron_blocks({k: w[e] for k, w in weights.items()}, np.float64), axis=1))


def _qr(a):
    return np.linalg.qr(a)[0]


def weight_features(weights: dict, dim: int = PCA_DIM, seed: int = 0, exact_max: int = EXACT_PCA_MAX) -> np.ndarray:
    """Y [E, F, k], k = min(dim, E*F, P): every expert's neurons described by their weights, as
    REAM's default `--merging logits+weights` does (`merger.py: Merger.fit` and `_merge`,
    `weight_utils.py: ffn_weight_matrix, pca_reduce`):

        X     = the unit neuron rows of all E experts stacked, [E*F, P]; Xc = X - mean of the rows
        V, S  = Xc's top-k right singular vectors and singular values
        Y     = unit rows of Xc V diag(S)          (REAM's projection `x @ (p * s)`, then normalize_rows)

    The SVD is exact (numpy) while E*F*P <= exact_max; beyond, a randomised range finder with
    k + PCA_OVERSAMPLE columns and PCA_POWER_ITERATIONS power iterations, seeded by `seed`, the
    products taken one expert at a time (REAM: torch.pca_lowrank, q = k, no oversampling). Signs
    and rotations within equal singular values leave every distance between rows unchanged."""
    E = next(iter(weights.values())).shape[0]
    F, P = _neuron_rows(weights, 0).shape
    m = E * F
    k = min(dim, m, P)
    if m * P <= exact_max:
        X = np.concatenate([_neuron_rows(weights, e) for e in range(E)])
        mu = X.mean(axis=0)
        _, S, Vt = np.linalg.svd(X - mu, full_matrices=False)
        proj = Vt[:k].T * S[:k]
        return _unit_rows(((X - mu) @ proj).reshape(E, F, k))
    mu = sum(_neuron_rows(weights, e).sum(axis=0) for e in range(E)) / m

    def times(M):  # Xc @ M, [m, l]
        return np.concatenate([_neuron_rows(weights, e) @ M for e in range(E)]) - mu @ M

    def t_times(Q):  # Xc^T @ Q, [P, l]
        return sum(_neuron_rows(weights, e).T @ Q[e * F:(e + 1) * F] for e in range(E)) - np.outer(mu, Q.sum(axis=0))

    width = min(k + PCA_OVERSAMPLE, m, P)
    Q = _qr(times(np.random.default_rng(seed).standard_normal((P, width))))
    for _ in range(PCA_POWER_ITERATIONS):
        Q = _qr(times(_qr(t_times(Q))))
    _, S, Vt = np.linalg.svd(t_times(Q).T, full_matrices=False)
    proj = Vt[:k].T * S[:k]
    return np.stack([_unit_rows((_neuron_rows(weights, e) - mu) @ proj) for e in range(E)])


def alignment_cost(act_lead_FN, act_member_FN, feat_lead_Fk, feat_member_Fk) -> np.ndarray:
    """cost [F, F], cost_ab = ||A_lead[a] - A_member[b]||_2 + ||Y_lead[a] - Y_member[b]||_2: the
    distances between the centroid's neuron a and the member's neuron b by their (unit)
    activations over the sampled tokens (`neuron_activations`) plus by their (unit) PCA weight
    rows (`weight_features`) (REAM `Merger._merge`: two `torch.cdist`, summed)."""
    from scipy.spatial.distance import cdist

    return cdist(act_lead_FN, act_member_FN) + cdist(feat_lead_Fk, feat_member_Fk)


def ream_align(weights: dict, labels_E, leaders, x_NH, pca_dim: int = PCA_DIM, seed: int = 0, expert_fn=None
               ) -> dict[int, np.ndarray]:
    """{expert: perm [F]} for every expert that is not its group's centroid: the member's neuron
    perm[a] goes to the centroid's position a, perm minimising sum_a cost[a, perm[a]]
    (`alignment_cost`; the Hungarian assignment, REAM's `linear_sum_assignment(cost)` and
    `apply_perm_to_ffn`). x_NH: the router inputs of the sampled calibration tokens
    (`MergeStats.act_inputs_NH`), the same tokens for every expert. (REAM's `run_all_experts` draws
    a separate random sample of tokens for each expert, so its activation rows compare different
    tokens across experts; here all experts are compared on one sample.) Float64 throughout."""
    labels = _check_labels(weights, labels_E)
    leaders = _check_leaders(labels, leaders)
    groups = [(int(lead), [j for j in np.flatnonzero(labels == c).tolist() if j != lead])
              for c, lead in enumerate(leaders.tolist())]
    if not any(others for _, others in groups):
        return {}
    x = np.asarray(x_NH, np.float64) if x_NH is not None else None
    if x is None or x.ndim != 2 or x.shape[0] < 1:
        raise ConfigError("ream: aligning neurons needs the router inputs of sampled calibration tokens [N, H], "
                          "N >= 1 (merge_stats(..., ream=True))")
    feats = weight_features(weights, pca_dim, seed)

    def acts(e):
        return neuron_activations({k: w[e] for k, w in weights.items()}, x, expert_fn)

    perms = {}
    for lead, others in groups:
        if others:
            a_lead = acts(lead)
            for j in others:
                perms[j] = _assign(-alignment_cost(a_lead, acts(j), feats[lead], feats[j]))  # the least total cost
    return perms


def ream_averaging(weights: dict, labels_E, leaders, scores_E, x_NH, pca_dim: int = PCA_DIM, seed: int = 0,
                   expert_fn=None) -> Averaging:
    """How REAM's groups become one expert each (`Averaging`):

        W_c = sum_{j in c} w_j P_j(W_j) / sum_{j in c} w_j,   w = `saliency_weights`(scores)

    for every matrix separately (`merger.py: Merger._merge`: "use sorted saliency as weights"), P_j
    the `ream_align` permutation of member j onto its centroid (the identity for the centroid).
    leaders: the centroid of each group (`centroid_leaders`)."""
    labels = _check_labels(weights, labels_E)
    return Averaging(saliency_weights(_scores(scores_E, len(labels))),
                     ream_align(weights, labels, leaders, x_NH, pca_dim, seed, expert_fn))


def ream_merge(weights: dict, labels_E, leaders, scores_E, x_NH, pca_dim: int = PCA_DIM, seed: int = 0,
               out_dtype=None, expert_fn=None) -> dict:
    """A layer's REAM groups merged, {"gate": [K, H, F], ...}, row c group c's `ream_averaging`.
    Precision as `moejax.merging.average.merge_weights` (float32 unless an input is float64; REAM
    accumulates in the checkpoint's dtype member by member)."""
    a = ream_averaging(weights, labels_E, leaders, scores_E, x_NH, pca_dim, seed, expert_fn)
    return merge_weights(weights, labels_E, a.weights_E, leaders=leaders, perms=a.perms, out_dtype=out_dtype)


def _needs_scores(ctx: MergeContext) -> np.ndarray:
    if ctx.scores_E is None:
        raise ConfigError("merge method 'ream' needs each layer's expert scores (scores_E, float64 [E], higher = "
                          "keep; REAP by default): they choose the centroids and weight the average")
    return np.asarray(ctx.scores_E, np.float64)


@register("ream")
class Ream(MergeMethod):
    """REAM: centroids by `score`, pseudo-pruning groups of at most `group_size` (`ream_groups` on
    `ream_similarity`), members aligned on `tokens` sampled calibration tokens plus PCA weight rows
    (`ream_align`), averaged with the score weights (`ream_averaging`)."""

    score: str = "reap"      # ranks the centroids and weights the average (`merge.py --saliency`); non-negative
    group_size: int = 16     # C, the most experts a group holds, its centroid included (`--group_size`); 0: M-SMoE's rule
    tokens: int = 2048       # N, calibration tokens whose router inputs the neuron alignment compares, per layer
    reads = ("gated_output_sum_EH", "logit_gram_EE", "act_inputs_NH")
    seed_use = ("it draws REAM's sample of --ream-tokens calibration tokens for the neuron alignment, and the "
                "randomised PCA of large layers")

    def check_settings(self) -> None:
        check_ream_score(self.score, "ream: score (--score, merge.ream.score)")
        check_group_size(self.group_size)
        if isinstance(self.tokens, bool) or not isinstance(self.tokens, (int, np.integer)) or self.tokens < 1:
            raise ConfigError(f"ream_tokens={self.tokens!r} (--ream-tokens, merge.ream.tokens): expected an integer "
                              ">= 1 (calibration tokens whose activations REAM's neuron alignment compares)")

    def check(self, keep: int | None, n_experts: int) -> None:
        check_group_size(self.group_size, keep, n_experts)

    @property
    def scores(self) -> tuple:
        return (self.score,)

    @property
    def sampled_tokens(self) -> int:
        return self.tokens

    def stats_options(self) -> dict:
        return {"ream": True, "ream_tokens": self.tokens}

    def clusters(self, keep: int, ctx: MergeContext) -> np.ndarray:
        st = ctx.stats
        if not st.has_ream:
            raise ConfigError("merge method 'ream' needs REAM's calibration statistics (router-weighted output sums, "
                              "sampled router inputs): gather them with merge_stats(..., ream=True)")
        return ream_groups(_needs_scores(ctx), ream_similarity(st.gated_output_sum_EH, st.logit_gram_EE), keep,
                           self.group_size)

    def leaders(self, labels_E, ctx: MergeContext) -> np.ndarray:
        return centroid_leaders(labels_E, _needs_scores(ctx))

    def averaging(self, weights, labels_E, leaders, ctx: MergeContext) -> Averaging:
        return ream_averaging(weights, labels_E, leaders, _needs_scores(ctx), ctx.act_inputs_NH, seed=ctx.seed,
                              expert_fn=ctx.expert_fn)

"""Expert scores, one small function each, beside the equation it implements (SPEC sections 2 and 11).

Every score reads a `LayerStats` (the per-layer sums of one calibration pass, kept in float64 so
rankings do not depend on summation order) and returns float64 [E]. Higher = keep.

To add a score: write `def my_score(st: LayerStats) -> np.ndarray` here, decorate it with
`@register("my_score")` (`data_free=True` if it reads only weights, so `moejax prune` and `moejax
score` without text can compute it without a calibration pass; `reads_experts=True` as well when
those weights include the routed experts' own matrices, which the data-free path then reads one
layer at a time, while the router-only scores stay a header-and-router read), and it is available
to every experiment and command by name. `ALL_SCORES`, `DATA_FREE_SCORES` and `EXPERT_WEIGHT_SCORES`
are the one list of scores, read off the registry.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from moejax.errors import ConfigError


@dataclasses.dataclass
class LayerStats:
    """Sufficient statistics of one MoE layer from one calibration pass.

    counts_E:         |X_j|, tokens whose chosen experts contain j
    gate_norm_sum_E:  sum_{x in X_j} g_j(x) * ||f_j(x)||_2   (model's real gate)
    norm_sum_E:       sum_{x in X_j} ||f_j(x)||_2
    mean_input_D:     mu, the mean router input over calibration tokens
    router_ED:        W_router (float64 copy)
    bias_E:           e_score_correction_bias (None: the family's router has no balance bias)
    seed, layer:      what `random` is seeded by
    code_counts_E, code_gate_norm_sum_E: the same two sums under the public REAP code's routing
                      (top-K of raw logits, softmax gates renormalised over the K); None when the
                      pass did not compute them (the toy)
    norm_sq_sum_E:    sum_{x in X_j} ||f_j(x)||_2^2                 (None: not computed)
    norm_max_E:       max_{x in X_j} ||f_j(x)||_2, 0 if X_j is empty (None: not computed)
    weight_abs_sum_E, weight_sq_sum_E: sum |w| and sum w^2 over every entry w of routed expert j's
                      own weight matrices (gate, up, down; the toy's w1, w2), decoded from their
                      stored format; None when the weights were not read (router-only data-free path)
    weight_count:     the number of those entries per expert (the same for every expert)
    gate_sum_E:       sum_{x in X_j} g_j(x)   (None: not computed)
    n_tokens:         T, the calibration tokens of the pass (padding excluded), every one routed
    output_sum_EH:    sum_{x in X_j} f_j(x), float64 [E, H]   (None: not computed)
    output_sq_sum_EH: sum_{x in X_j} f_j(x)^2 (elementwise), float64 [E, H]   (None: not computed)
    loo_sq_sum_E:     sum_{x in X_j} ||y^(-j)(x) - y(x)||_2^2: the routed output with j removed and its
                      tokens rerouted, against the unpruned one (`moejax.scoring.interventions`)
    loo_cos_sum_E:    sum_{x in X_j} (1 - cos(y^(-j)(x), y(x)))
    router_order_TE:  each calibration token's experts by descending router logit, int [T, E]
    top_k:            K, the experts each token chose
    (the last four None / 0: not computed)
    coalition_sets_MK, coalition_counts_M: the distinct sets of experts the calibration tokens chose
                      (each sorted ascending, int [M, K], in lexicographic order) and how many tokens
                      chose each, c(A) (None: not recorded)
    """

    counts_E: np.ndarray
    gate_norm_sum_E: np.ndarray
    norm_sum_E: np.ndarray
    mean_input_D: np.ndarray
    router_ED: np.ndarray
    bias_E: np.ndarray | None
    seed: int = 0
    layer: int = 0
    code_counts_E: np.ndarray | None = None
    code_gate_norm_sum_E: np.ndarray | None = None
    norm_sq_sum_E: np.ndarray | None = None
    norm_max_E: np.ndarray | None = None
    weight_abs_sum_E: np.ndarray | None = None
    weight_sq_sum_E: np.ndarray | None = None
    weight_count: int = 0
    gate_sum_E: np.ndarray | None = None
    n_tokens: int = 0
    output_sum_EH: np.ndarray | None = None
    output_sq_sum_EH: np.ndarray | None = None
    loo_sq_sum_E: np.ndarray | None = None
    loo_cos_sum_E: np.ndarray | None = None
    router_order_TE: np.ndarray | None = None
    top_k: int = 0
    coalition_sets_MK: np.ndarray | None = None
    coalition_counts_M: np.ndarray | None = None

    @property
    def n_experts(self) -> int:
        return self.router_ED.shape[0]

    @property
    def mean_output_EH(self) -> np.ndarray:
        """(1/|X_j|) sum_{x in X_j} f_j(x), float64 [E, H]: expert j's mean output over the tokens
        routed to it (MoNE's novice constant, its unbiased estimate of the expert's output); 0 for
        an expert no token chose."""
        total = _need(self, "output_sum_EH", "mean_output_EH", "the sums of the experts' outputs")
        return _per_routed_token(total, self.counts_E[:, None])


class StatsAccumulator:
    """Float64 running sums of one MoE layer over calibration batches (np.bincount sums in
    float64, so rankings of near-equal experts do not depend on batching or summation order).
    Padding tokens (token_mask False) are left out of every sum (and of the maximum)."""

    OUTPUT_COLUMNS = 512  # output sums: [pairs, this many columns] in float64 at a time (bounded memory)

    def __init__(self, n_experts: int, hidden: int):
        self.n_experts = n_experts
        self.counts = np.zeros(n_experts)
        self.gate_norm = np.zeros(n_experts)
        self.norm = np.zeros(n_experts)
        self.norm_sq = np.zeros(n_experts)
        self.norm_max = np.zeros(n_experts)  # norms are >= 0: an expert no token chose keeps 0
        self.weight_sums = None  # (abs_sum_E, sq_sum_E, count) of the experts' weights: `add_weight_sums`
        self.code_counts = np.zeros(n_experts)
        self.code_gate_norm = np.zeros(n_experts)
        self.input_sum = np.zeros(hidden)
        self.n_tokens = 0   # router inputs summed (for the mean input)
        self.tokens = 0     # calibration tokens seen (padding excluded), with or without inputs
        self.gate_sum = np.zeros(n_experts)
        self.output_sum = self.output_sq_sum = None  # [E, H] once outputs are given (`add(out_TKH=...)`)
        self.has_code = False
        self.loo_sq = self.loo_cos = None   # [E] once interventions are given (`add_interventions`)
        self.orders = []                    # each batch's preference orders [T, E] of its real tokens
        self.top_k = 0
        self.coalitions = []                # each batch's distinct chosen sets and their token counts

    def _sums(self, idx_TK, gate_TK, norm_TK, keep_T):
        flat = np.asarray(idx_TK)[keep_T].ravel()
        gate = np.asarray(gate_TK, np.float64)[keep_T].ravel()
        norm = np.asarray(norm_TK, np.float64)[keep_T].ravel()
        E = self.n_experts
        return (np.bincount(flat, minlength=E), np.bincount(flat, weights=gate * norm, minlength=E),
                np.bincount(flat, weights=norm, minlength=E), np.bincount(flat, weights=norm * norm, minlength=E),
                flat, norm)

    def add(self, expert_idx_TK, gate_TK, out_norm_TK, x_TD=None, token_mask_T=None,
            code_idx_TK=None, code_gate_TK=None, code_norm_TK=None, out_TKH=None) -> None:
        """One batch: the real routing's pairs (experts [T, K], gates, output norms ||f||), the
        router inputs (for w_mean), the REAP-code routing's pairs, and the pairs' outputs f [T, K, H]
        themselves (for `mone`: their sums and sums of squares per expert)."""
        idx = np.asarray(expert_idx_TK)
        keep = np.ones(idx.shape[0], bool) if token_mask_T is None else np.asarray(token_mask_T, bool)
        c, gn, n, n2, flat, norm = self._sums(idx, gate_TK, out_norm_TK, keep)
        self.tokens += int(keep.sum())
        self.coalitions.append(coalition_counts(idx[keep]))
        self.gate_sum += np.bincount(flat, weights=np.asarray(gate_TK, np.float64)[keep].ravel(),
                                     minlength=self.n_experts)
        if out_TKH is not None:
            self._add_outputs(flat, np.asarray(out_TKH)[keep])
        self.counts += c
        self.gate_norm += gn
        self.norm += n
        self.norm_sq += n2
        np.maximum.at(self.norm_max, flat, norm)
        if code_idx_TK is not None:
            c, gn, *_ = self._sums(code_idx_TK, code_gate_TK, code_norm_TK, keep)
            self.code_counts += c
            self.code_gate_norm += gn
            self.has_code = True
        if x_TD is not None:  # the router inputs, for w_mean
            self.input_sum += np.asarray(x_TD, np.float64)[keep].sum(axis=0)
            self.n_tokens += int(keep.sum())

    def add_interventions(self, expert_idx_TK, loo_sq_TK, loo_cos_TK, order_TE, token_mask_T=None) -> None:
        """One batch's leave-one-out errors and cosines per (token, chosen slot) and its tokens'
        preference orders (`moejax.scoring.interventions`); padding tokens left out."""
        idx = np.asarray(expert_idx_TK)
        keep = np.ones(idx.shape[0], bool) if token_mask_T is None else np.asarray(token_mask_T, bool)
        flat = idx[keep].ravel()
        if self.loo_sq is None:
            self.loo_sq, self.loo_cos = np.zeros(self.n_experts), np.zeros(self.n_experts)
        self.loo_sq += np.bincount(flat, weights=np.asarray(loo_sq_TK, np.float64)[keep].ravel(),
                                   minlength=self.n_experts)
        self.loo_cos += np.bincount(flat, weights=1.0 - np.asarray(loo_cos_TK, np.float64)[keep].ravel(),
                                    minlength=self.n_experts)
        self.orders.append(np.asarray(order_TE)[keep].astype(np.int32))
        self.top_k = idx.shape[1]

    def _add_outputs(self, flat_P, out_TKH) -> None:
        """sum f and sum f^2 per expert over the pairs (flattened experts `flat_P`, outputs [T, K, H]
        in any float dtype), in float64: pairs sorted by expert (stable), then each expert's run of
        pairs summed in order, a block of columns at a time."""
        out_PH = out_TKH.reshape(len(flat_P), -1)
        H = out_PH.shape[1]
        if self.output_sum is None:
            self.output_sum, self.output_sq_sum = np.zeros((self.n_experts, H)), np.zeros((self.n_experts, H))
        if not len(flat_P):
            return
        order = np.argsort(flat_P, kind="stable")
        sorted_P = flat_P[order]
        starts = np.flatnonzero(np.concatenate([[True], sorted_P[1:] != sorted_P[:-1]]))
        experts = sorted_P[starts]
        for h in range(0, H, self.OUTPUT_COLUMNS):
            block = out_PH[order, h:h + self.OUTPUT_COLUMNS].astype(np.float64)
            self.output_sum[experts, h:h + block.shape[1]] += np.add.reduceat(block, starts, axis=0)
            self.output_sq_sum[experts, h:h + block.shape[1]] += np.add.reduceat(block * block, starts, axis=0)

    def add_weight_sums(self, abs_sum_E, sq_sum_E, count: int) -> None:
        """The layer's expert-weight sums (`weight_sums`, or the device pass's partial sums summed
        in float64): sum |w| and sum w^2 per routed expert over `count` entries each."""
        self.weight_sums = (np.asarray(abs_sum_E, np.float64), np.asarray(sq_sum_E, np.float64), int(count))

    def stats(self, router_ED, bias_E, seed=0, layer=0) -> LayerStats:
        w_abs, w_sq, w_count = self.weight_sums or (None, None, 0)
        return LayerStats(
            counts_E=self.counts.copy(), gate_norm_sum_E=self.gate_norm.copy(), norm_sum_E=self.norm.copy(),
            mean_input_D=self.input_sum / max(self.n_tokens, 1), router_ED=np.asarray(router_ED, np.float64),
            bias_E=None if bias_E is None else np.asarray(bias_E, np.float64), seed=int(seed), layer=int(layer),
            code_counts_E=self.code_counts.copy() if self.has_code else None,
            code_gate_norm_sum_E=self.code_gate_norm.copy() if self.has_code else None,
            norm_sq_sum_E=self.norm_sq.copy(), norm_max_E=self.norm_max.copy(),
            weight_abs_sum_E=None if w_abs is None else w_abs.copy(),
            weight_sq_sum_E=None if w_sq is None else w_sq.copy(), weight_count=w_count,
            gate_sum_E=self.gate_sum.copy(), n_tokens=self.tokens,
            output_sum_EH=None if self.output_sum is None else self.output_sum.copy(),
            output_sq_sum_EH=None if self.output_sq_sum is None else self.output_sq_sum.copy(),
            loo_sq_sum_E=None if self.loo_sq is None else self.loo_sq.copy(),
            loo_cos_sum_E=None if self.loo_cos is None else self.loo_cos.copy(),
            router_order_TE=np.concatenate(self.orders) if self.orders else None, top_k=self.top_k,
            **dict(zip(("coalition_sets_MK", "coalition_counts_M"), _merged_coalitions(self.coalitions))))


def coalition_counts(expert_idx_TK) -> tuple[np.ndarray, np.ndarray]:
    """(distinct sets [M, K], each sorted ascending, in lexicographic order; tokens per set [M]) of
    one batch's chosen experts (real tokens only)."""
    idx = np.sort(np.asarray(expert_idx_TK, np.int64), axis=1)
    if not len(idx):
        return idx, np.zeros(0, np.int64)
    sets, counts = np.unique(idx, axis=0, return_counts=True)
    return sets, counts.astype(np.int64)


def _merged_coalitions(batches: list) -> tuple:
    """The batches' coalition counts summed per set (None, None: none recorded)."""
    if not batches:
        return None, None
    sets = np.concatenate([b[0] for b in batches])
    if not len(sets):
        return sets, np.zeros(0, np.int64)
    merged, inverse = np.unique(sets, axis=0, return_inverse=True)
    return merged, np.bincount(inverse.ravel(), weights=np.concatenate([b[1] for b in batches]),
                               minlength=len(merged)).astype(np.int64)


def weight_sums(expert_weights) -> tuple[np.ndarray, np.ndarray, int]:
    """(sum |w| [E], sum w^2 [E], entries per expert) over every array of `expert_weights` (a dict
    or list of stacked [E, ...] expert matrices), in float64: what `aimer` reads."""
    arrays = [np.asarray(w) for w in (expert_weights.values() if isinstance(expert_weights, dict) else expert_weights)]
    E = arrays[0].shape[0]
    abs_sum, sq_sum = np.zeros(E), np.zeros(E)
    for w in arrays:
        w = w.reshape(E, -1).astype(np.float64)
        abs_sum += np.abs(w).sum(axis=1)
        sq_sum += np.square(w).sum(axis=1)
    return abs_sum, sq_sum, sum(w[0].size for w in arrays)


def stats_from_pairs(expert_idx_TK, gate_TK, out_norm_TK, mean_input_D, router_ED, bias_E, seed=0, layer=0,
                     token_mask_T=None, expert_weights=None, out_TKH=None) -> LayerStats:
    """`LayerStats` of a single routed pass whose mean router input is already known;
    expert_weights: the layer's stacked expert matrices ({name: [E, ...]}), for `aimer`; out_TKH:
    the pairs' outputs [T, K, H], for `mone`."""
    acc = StatsAccumulator(np.asarray(router_ED).shape[0], np.asarray(mean_input_D).shape[0])
    acc.add(expert_idx_TK, gate_TK, out_norm_TK, token_mask_T=token_mask_T, out_TKH=out_TKH)
    if expert_weights is not None:
        acc.add_weight_sums(*weight_sums(expert_weights))
    st = acc.stats(router_ED, bias_E, seed, layer)
    st.mean_input_D = np.asarray(mean_input_D, np.float64)
    return st


SCORES: dict[str, Callable[[LayerStats], np.ndarray]] = {}
_DATA_FREE: set[str] = set()
_READS_EXPERTS: set[str] = set()
_READS_OUTPUTS: set[str] = set()
_INTERVENES: set[str] = set()


def register(name: str, *, data_free: bool = False, reads_experts: bool = False, reads_outputs: bool = False,
             intervenes: bool = False):
    """reads_experts: a data-free score that reads the routed experts' weight matrices (not only the
    router), so the data-free path must read them (`LayerStats.weight_*`). reads_outputs: a score
    that reads the sums of the routed outputs (`LayerStats.output_sum_EH`, ...), which bring every
    routed pair's output to the host: a pass gathers them only for such a score. intervenes: a
    score that reads the leave-one-out sums or the preference orders (`LayerStats.loo_*`,
    `router_order_TE`), which a pass computes only for such a score."""
    def deco(fn):
        SCORES[name] = fn
        for flag, names in ((data_free, _DATA_FREE), (reads_experts, _READS_EXPERTS),
                            (reads_outputs, _READS_OUTPUTS), (intervenes, _INTERVENES)):
            if flag:
                names.add(name)
        return fn
    return deco


def _per_routed_token(sum_E: np.ndarray, counts_E: np.ndarray) -> np.ndarray:
    """sum_E / |X_j|, 0 where X_j is empty (an expert no token chose has no mean to measure)."""
    return np.divide(sum_E, counts_E, out=np.zeros_like(sum_E), where=counts_E > 0)


def _need(st: LayerStats, field: str, name: str, why: str):
    value = getattr(st, field)
    if value is None:
        raise ConfigError(f"layer {st.layer}: score {name!r} needs {why}, which this pass did not compute")
    return value


@register("frequency")
def frequency(st: LayerStats) -> np.ndarray:
    """|X_j|"""
    return st.counts_E.copy()


@register("reap")
def reap(st: LayerStats) -> np.ndarray:
    """(1/|X_j|) sum_{x in X_j} g_j(x) ||f_j(x)||_2   (REAP, arXiv 2510.13999 Eq. 9); 0 if X_j is empty."""
    return np.divide(st.gate_norm_sum_E, st.counts_E, out=np.zeros_like(st.gate_norm_sum_E),
                     where=st.counts_E > 0)


@register("reap_code")
def reap_code(st: LayerStats) -> np.ndarray:
    """REAP as the public REAP code computes it: routing = top-K of the raw logits (no bias, no
    groups), gate = softmax(logits) over all E renormalised over the K, no scaling factor;
    (1/|X_j|) sum g_j ||f_j||, 0 if empty."""
    if st.code_counts_E is None:
        raise ConfigError("reap_code needs the calibration pass to compute the REAP-code routing "
                          "(the toy experiment does not)")
    return np.divide(st.code_gate_norm_sum_E, st.code_counts_E, out=np.zeros_like(st.code_gate_norm_sum_E),
                     where=st.code_counts_E > 0)


@register("ean")
def ean(st: LayerStats) -> np.ndarray:
    """sum_{x in X_j} ||f_j(x)||_2   (expert activation norm, no gate)"""
    return st.norm_sum_E.copy()


@register("man")
def man(st: LayerStats) -> np.ndarray:
    """(1/|X_j|) sum_{x in X_j} ||f_j(x)||_2   (MAN, mean activation norm: routed tokens, no gate;
    arXiv 2606.15716). 0 if X_j is empty, as for `reap`."""
    return _per_routed_token(st.norm_sum_E, st.counts_E)


@register("msan")
def msan(st: LayerStats) -> np.ndarray:
    """(1/|X_j|) sum_{x in X_j} ||f_j(x)||_2^2   (MSAN, mean squared activation norm: routed tokens,
    no gate; arXiv 2606.15716). 0 if X_j is empty, as for `reap`."""
    return _per_routed_token(_need(st, "norm_sq_sum_E", "msan", "the sum of squared output norms"), st.counts_E)


@register("max_act")
def max_act(st: LayerStats) -> np.ndarray:
    """max_{x in X_j} ||f_j(x)||_2   (max activation, "super experts": the largest output norm over
    the tokens routed to j, SPEC section 11). 0 if X_j is empty. (The public REAP code's
    `max_activations` is the signed maximum over tokens and output coordinates, max_{x, d} f_j(x)[d],
    not this norm.)"""
    return _need(st, "norm_max_E", "max_act", "the maximum output norm").copy()


@register("mone", reads_outputs=True)
def mone(st: LayerStats) -> np.ndarray:
    """||sqrt(var_j)||_2 * rs_j   (MoNE, arXiv 2507.00390: routing score times output fluctuation;
    its code zxgx/mode-pd, `expert_prune_by_mone`, metric `fusion`), where
        var_j[h] = (1/|X_j|) sum_{x in X_j} f_j(x)[h]^2 - mean_j[h]^2, mean_j = (1/|X_j|) sum_{x in X_j} f_j(x)
    is the per-dimension (population) variance of expert j's output over the tokens routed to it
    (0 if X_j is empty), and rs_j = (1/T) sum_{x in X_j} g_j(x) its mean gate over all T calibration
    tokens (g_j = 0 where j was not chosen). A removed expert is then substituted by the constant
    mean_j (`LayerStats.mean_output_EH`), so an expert that varies little or is rarely weighted is
    the cheapest to replace. Differences from mode-pd, none changing a layer's ranking but the last:
    mode-pd divides the gate sum by the number of sequences (its gate hook's batch size), not tokens
    (a constant factor per layer); it multiplies by w(1 - w) (`fusion_io_weight`, a constant); its
    streaming variance skips each expert's first batch and mixes 1/(n-1) and 1/n normalisations,
    where this is the exact variance from float64 sums."""
    _need(st, "output_sum_EH", "mone", "the sums of the experts' outputs")   # named as mone's need, not the mean's
    squares = _need(st, "output_sq_sum_EH", "mone", "the sums of the experts' squared outputs")
    gate_sum = _need(st, "gate_sum_E", "mone", "the sums of the experts' gates")
    var_EH = np.maximum(_per_routed_token(squares, st.counts_E[:, None]) - np.square(st.mean_output_EH), 0.0)
    return np.sqrt(var_EH.sum(axis=1)) * gate_sum / max(st.n_tokens, 1)


@register("w_mean")
def w_mean(st: LayerStats) -> np.ndarray:
    """W_router[j] . mu   (the expected logit)"""
    return st.router_ED @ st.mean_input_D


@register("bias", data_free=True)
def bias(st: LayerStats) -> np.ndarray:
    """-e_score_correction_bias[j]   (lowest bias = busiest in training = keep)"""
    if st.bias_E is None:
        raise ConfigError(f"layer {st.layer}: score 'bias' needs a balance bias (e_score_correction_bias), and this "
                          "model's router has none (softmax routers: use signed, l1, w_mean or a calibration score)")
    return -st.bias_E


@register("signed", data_free=True)
def signed(st: LayerStats) -> np.ndarray:
    """sum_d W_router[j, d]   (signed row sum)"""
    return st.router_ED.sum(axis=1)


@register("l1", data_free=True)
def l1(st: LayerStats) -> np.ndarray:
    """sum_d |W_router[j, d]|   (compressed-tensors MagnitudeExpertPruner default)"""
    return np.abs(st.router_ED).sum(axis=1)


@register("random", data_free=True)
def random(st: LayerStats) -> np.ndarray:
    """Uniform random, seeded per (seed, layer)."""
    return np.random.default_rng([st.seed, st.layer]).random(st.n_experts)


@register("aimer", data_free=True, reads_experts=True)
def aimer(st: LayerStats) -> np.ndarray:
    """-(mean_w |w|) / sqrt(mean_w w^2), w over every entry of routed expert j's weight matrices
    (gate, up and down pooled; the toy's w1, w2), as stored (quantised weights decoded).

    AIMER (arXiv 2603.18492, "Absolute mean over root mean square IMportance for Expert Ranking";
    code ZongfangLiu/AIMER): the ratio is what its name says; pooling the three matrices into one
    set of entries is our reading (the paper's equation was not available here). Its code prunes
    the experts with the HIGHEST ratio (its README: "Higher AIMER scores are treated as more
    removable"), so the registry's value is the negated ratio (higher = keep, as every score here).
    The ratio lies in (0, 1]; an all-zero expert gets -1 (most removable)."""
    abs_sum = _need(st, "weight_abs_sum_E", "aimer", "the routed experts' weights")
    sq_sum = st.weight_sq_sum_E
    n = st.weight_count
    ratio = np.divide(abs_sum / n, np.sqrt(sq_sum / n), out=np.ones_like(abs_sum), where=sq_sum > 0)
    return -ratio


@register("loo_reroute", intervenes=True)
def loo_reroute(st: LayerStats) -> np.ndarray:
    """(1/(T H)) sum_{x in X_j} ||y^(-j)(x) - y(x)||_2^2   (leave one out with rerouting: NVIDIA
    ModelOpt's `RemoveExpertsIndependentHook`, its `mse`), where y is the layer's routed output
    (shared experts excluded) and y^(-j) the same with expert j removed: its router slot masked, the
    top-k taken again over the others and the gates recomputed, as the family routes a pruned
    checkpoint. Tokens that did not choose j are unchanged (0). T: calibration tokens, H: width.
    ModelOpt sums per batch the mean over the displaced tokens times their share of the batch and
    divides by the number of batches, the same for batches of equal size; this sums over tokens."""
    sq = _need(st, "loo_sq_sum_E", "loo_reroute", "the leave-one-out errors")
    return sq / (max(st.n_tokens, 1) * st.mean_input_D.shape[0])


@register("loo_reroute_cos", intervenes=True)
def loo_reroute_cos(st: LayerStats) -> np.ndarray:
    """(1/T) sum_{x in X_j} (1 - cos(y^(-j)(x), y(x)))   (leave one out with rerouting, by direction).
    ModelOpt accumulates -cos over the displaced tokens, which ranks an expert no token chose (0)
    above one whose removal changes its tokens' outputs little (about -|X_j| / T); 1 - cos is 0 for
    an unchanged output and for an unchosen expert alike, so a larger value is always more damage."""
    return _need(st, "loo_cos_sum_E", "loo_reroute_cos", "the leave-one-out cosines") / max(st.n_tokens, 1)


@register("ranked_vote", intervenes=True)
def ranked_vote(st: LayerStats) -> np.ndarray:
    """The round in which expert j is voted out (0 = first; higher = keep) by ranked-choice voting
    over the calibration tokens (router only, no expert compute; NVIDIA ModelOpt's
    `RankedChoiceVotingHook`): each token votes for its top K among the experts still in, by its
    router logits (`router_order_TE`); the expert with the fewest votes leaves (ties: the lowest
    index) and its voters move to their next choice; repeated until none is left. Later counts thus
    include the rerouting earlier removals cause. ModelOpt counts only the experts that have votes
    (`unique`), so an expert no token ranks in its top K is never voted out while others are, and
    ends as the most important; here it has 0 votes and leaves first, as in ranked-choice voting."""
    order = _need(st, "router_order_TE", "ranked_vote", "the tokens' preference orders")
    return vote_out_rounds(order, st.n_experts, st.top_k)


def vote_out_rounds(order_TE: np.ndarray, n_experts: int, top_k: int) -> np.ndarray:
    """`ranked_vote`'s rounds, float64 [E], in O(T E) work: each token's ballot is the first top_k
    experts still in of its order (a pointer past them); only the voters of the expert voted out
    move on, to the next experts of their order still in."""
    T = order_TE.shape[0]
    votes = np.zeros((T, n_experts), bool)
    rows = np.arange(T)
    k = min(top_k, n_experts)
    votes[rows[:, None], order_TE[:, :k]] = True
    pointer = np.full(T, k)
    counts = votes.sum(axis=0).astype(np.float64)
    out = np.empty(n_experts)
    for r in range(n_experts):
        loser = int(np.argmin(counts))   # voted out experts hold +inf; ties to the lowest index
        out[loser] = r
        counts[loser] = np.inf
        voters = np.flatnonzero(votes[:, loser])
        votes[voters, loser] = False
        while len(voters):   # each voter's next expert still in, if any is left
            voters = voters[pointer[voters] < n_experts]
            nxt = order_TE[voters, np.minimum(pointer[voters], n_experts - 1)]
            pointer[voters] += 1
            took = np.isfinite(counts[nxt])
            votes[voters[took], nxt[took]] = True
            np.add.at(counts, nxt[took], 1)
            voters = voters[~took]
    return out


@register("shapley")
def shapley(st: LayerStats) -> np.ndarray:
    """SHAPE's Shapley value of expert i (arXiv 2606.09886, code Alizen-1009/Shapley-Moe,
    `analysis/calc_shapley.py`), from the coalitions the calibration tokens chose: with c(A) the
    tokens whose chosen set is exactly A (|A| = K) and m(S) = sum_{A superset of S} c(A) the tokens
    whose chosen set contains the (K-1)-set S,

        alpha_i = min_{A containing i, c(A) > 0} c(A) / m(A minus i)
        phi_i   = sum_{A containing i, c(A) > 0} [c(A) - alpha_i m(A minus i)]

    the marginal contribution of i to each observed coalition, its sub-coalition's value estimated
    as alpha_i m(A minus i) (the lowest rate at which i completes one of its contexts); phi_i >= 0.
    SHAPE scales every phi by (K-1)!(E-K)!/E! x 1e4 (the Shapley weight of a (K-1)-coalition),
    which changes no ranking or share and is left out. It is not the exact Shapley value of a
    game: only the size-K coalitions and their (K-1)-subsets enter. Each calibration token counts
    once (SHAPE's collection re-counts the prompt at every generated step). An expert in a single
    observed coalition, or chosen by no token, gets 0; with K = 1 every phi is 0."""
    sets = _need(st, "coalition_sets_MK", "shapley", "the chosen sets of the calibration tokens")
    return coalition_shapley(sets, st.coalition_counts_M, st.n_experts)


def coalition_shapley(sets_MK: np.ndarray, counts_M: np.ndarray, n_experts: int) -> np.ndarray:
    """`shapley`'s phi, float64 [E], over the (set, count) pairs: every (A, i in A) pair once."""
    sets = np.asarray(sets_MK, np.int64)
    c = np.asarray(counts_M, np.float64)
    phi = np.zeros(n_experts)
    if not len(sets):
        return phi
    M, K = sets.shape
    pairs_A = np.repeat(np.arange(M), K)                 # pair (A, j): set A, its j-th member i
    expert = sets.ravel()
    if K == 1:   # m(empty set) = T and alpha_i = c({i}) / T: every marginal contribution is 0
        return phi
    subs = np.stack([np.delete(sets, j, axis=1) for j in range(K)], axis=1).reshape(M * K, K - 1)  # A minus member j
    _, sub_id = np.unique(subs, axis=0, return_inverse=True)
    sub_id = sub_id.ravel()
    m = np.bincount(sub_id, weights=c[pairs_A])           # m(S): tokens whose set contains S
    m_pair = m[sub_id]
    ratio = c[pairs_A] / m_pair
    alpha = np.full(n_experts, np.inf)
    np.minimum.at(alpha, expert, ratio)
    np.add.at(phi, expert, c[pairs_A] - alpha[expert] * m_pair)
    return phi


ALL_SCORES = tuple(SCORES)                                          # every score, in this file's order
DATA_FREE_SCORES = tuple(n for n in SCORES if n in _DATA_FREE)     # bias, signed, l1, random, aimer
EXPERT_WEIGHT_SCORES = tuple(n for n in SCORES if n in _READS_EXPERTS)  # aimer: data-free, reads the experts
OUTPUT_SCORES = tuple(n for n in SCORES if n in _READS_OUTPUTS)    # mone: reads the routed outputs' sums
INTERVENTION_SCORES = tuple(n for n in SCORES if n in _INTERVENES)  # loo_reroute(_cos), ranked_vote


def pass_needs(names) -> dict:
    """What a calibration pass must gather for the scores `names`, as the keywords of
    `moejax.scoring.observe.accumulate_layer` and `calibrate_streamed`: the routed outputs' sums
    (`OUTPUT_SCORES`) and the interventions (`INTERVENTION_SCORES`), each only when a score reads it."""
    names = set(names)
    return {"outputs": bool(names & set(OUTPUT_SCORES)), "interventions": bool(names & set(INTERVENTION_SCORES))}


def rank_correlation(a, b) -> float:
    """Spearman's rank correlation of two scores over the same experts (average ranks for ties);
    NaN when either is constant (no ranking to correlate)."""
    from scipy.stats import spearmanr

    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if np.ptp(a) == 0 or np.ptp(b) == 0:
        return float("nan")
    return float(spearmanr(a, b).statistic)


def check_score_names(names) -> list[str]:
    names = list(names)
    unknown = [n for n in names if n not in SCORES]
    if unknown:
        raise ConfigError(f"unknown score(s) {unknown}; valid scores: {', '.join(sorted(SCORES))}")
    if not names:
        raise ConfigError(f"no scores requested; valid scores: {', '.join(sorted(SCORES))}")
    return names


NEEDS_BALANCE_BIAS = ("bias",)  # scores that read e_score_correction_bias


def scores_for(names, has_balance_bias: bool, where: str = "scores") -> list[str]:
    """The scores to compute for a model whose routers have (or lack) a balance bias: names=None
    means every registered score the model supports; a named score it cannot compute is refused
    (before any pass), naming why."""
    if names is None:
        return [n for n in ALL_SCORES if has_balance_bias or n not in NEEDS_BALANCE_BIAS]
    names = check_score_names(names)
    missing = [n for n in names if n in NEEDS_BALANCE_BIAS and not has_balance_bias]
    if missing:
        raise ConfigError(f"{where}: score(s) {missing} need a balance bias (e_score_correction_bias), and this "
                          "model's routers have none (softmax routers); leave them out")
    return names


def compute_scores(st: LayerStats, names) -> dict[str, np.ndarray]:
    """{name: float64 [E]} for the requested scores."""
    return {n: np.asarray(SCORES[n](st), np.float64) for n in check_score_names(names)}

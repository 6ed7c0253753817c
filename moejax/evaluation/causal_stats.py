"""Does an observational score predict causal importance? The statistics that answer it, from the
tables of `moejax.evaluation.causal` and `moejax.scoring` (pure numpy and scipy on tidy tables).

- `score_agreement`: Spearman's rank correlation, per (model, layer, task, score), of the score's
  values over the layer's experts with the causal importance of removing each (nll_increase or
  exact_match_drop). A score that keeps the experts whose removal hurts should correlate positively.
- `paired_d`: the causal audit's statistic (arXiv 2606.10703, read from its code: the paired
  per-token comparison). At each token position t and layer l, among the K experts the unpruned model
  chose there, the one the score ranks highest (h) and lowest (b); with Delta_e(t) the loss change at t
  when expert e's output is zeroed in layer l (no re-routing; `causal.zeroing_deltas`),
      diff_t = Delta_h(t) - Delta_b(t),      d = mean_t diff_t / std_t diff_t   (ddof = 1)
  with the paired t-test's and the Wilcoxon signed-rank test's p-values. d > 0: the score ranks
  the experts that matter at a token above those that do not.
- `across_models`: mean, standard deviation and count over models of any per-model statistic.
- `gini`: the Gini coefficient of a layer's importance values (0: equal, toward 1: concentrated).
"""

from __future__ import annotations

import numpy as np

from moejax.scoring.scores import rank_correlation


def score_agreement(causal, scores, metrics=("nll_increase", "exact_match_drop")):
    """Spearman per (model, layer, task, metric, score): `causal` has columns model, layer, expert,
    task, metric, value (`causal.causal_importance` rows with a model column; the unpruned rows,
    layer -1, are ignored); `scores` has model, layer, expert, score, value and optionally task (a
    score measured on each task's own documents; without it one score serves every task)."""
    import pandas as pd

    rows = []
    effects = causal[(causal.layer >= 0) & causal.metric.isin(metrics)]
    by_task = "task" in scores
    for (model, layer, task, metric), eff in effects.groupby(["model", "layer", "task", "metric"]):
        eff = eff.set_index("expert").value.sort_index()
        here = scores[(scores.model == model) & (scores.layer == layer)]
        if by_task:
            here = here[here.task == task]
        for score, sc in here.groupby("score"):
            sc = sc.set_index("expert").value.reindex(eff.index)
            rows.append(dict(model=model, layer=layer, task=task, metric=metric, score=score,
                             spearman=rank_correlation(sc.to_numpy(float), eff.to_numpy(float))))
    return pd.DataFrame(rows)


def paired_d(deltas: dict, chosen_NSK: np.ndarray, score_E: np.ndarray, positions_NS: np.ndarray, layer: int) -> dict:
    """The causal audit's paired statistic at one layer (module docstring): deltas {(layer, expert):
    [N, S]}, chosen_NSK the unpruned model's chosen experts there, score_E the score over the
    layer's experts, positions_NS the token positions that count. Ties in the score go to the lower
    expert id for the highest and the higher id for the lowest; positions whose chosen experts all
    tie are skipped. Returns d, n, the mean difference and both p-values."""
    from scipy import stats

    n, s = np.nonzero(positions_NS)
    chosen = chosen_NSK[n, s]                                   # [P, K]
    values = np.asarray(score_E, float)[chosen]                 # [P, K]
    K, rows = chosen.shape[1], np.arange(len(chosen))
    high = chosen[rows, np.lexsort((chosen, -values), axis=-1)[:, 0]]   # highest score, ties: lower id
    low = chosen[rows, np.lexsort((-chosen, values), axis=-1)[:, 0]]    # lowest score, ties: higher id
    delta_ENS = np.stack([deltas[(layer, e)] for e in range(len(score_E))])
    distinct = values.max(1) > values.min(1)
    diff = (delta_ENS[high, n, s] - delta_ENS[low, n, s])[distinct]
    if len(diff) < 2 or K < 2:
        return dict(d=float("nan"), n=int(len(diff)), mean_diff=float("nan"), p_t=float("nan"), p_wilcoxon=float("nan"))
    sd = diff.std(ddof=1)
    d = float(diff.mean() / sd) if sd > 0 else float("nan")
    p_t = float(stats.ttest_1samp(diff, 0.0).pvalue)
    p_w = float(stats.wilcoxon(diff).pvalue) if np.any(diff != 0) else 1.0
    return dict(d=d, n=int(len(diff)), mean_diff=float(diff.mean()), p_t=p_t, p_wilcoxon=p_w)


def across_models(df, value: str, by: list) -> "object":
    """mean, std (ddof = 1; NaN for one model), n and each model's value, per group `by`, of the
    column `value` of a table with a model column."""
    import pandas as pd

    rows = []
    for key, g in df.groupby(by):
        key = key if isinstance(key, tuple) else (key,)
        v = g[value].to_numpy(float)
        v = v[np.isfinite(v)]
        rows.append({**dict(zip(by, key)), "mean": float(v.mean()) if len(v) else float("nan"),
                     "std": float(v.std(ddof=1)) if len(v) > 1 else float("nan"), "n": int(len(v)),
                     "per_model": dict(zip(g.model, g[value].round(4)))})
    return pd.DataFrame(rows)


def gini(values) -> float:
    """The Gini coefficient of non-negative values: sum_ij |x_i - x_j| / (2 n^2 mean); negative
    values (a removal that helped) count as zero. NaN when every value is zero."""
    x = np.clip(np.asarray(values, float), 0.0, None)
    if x.sum() == 0:
        return float("nan")
    return float(np.abs(x[:, None] - x[None, :]).sum() / (2 * len(x) ** 2 * x.mean()))

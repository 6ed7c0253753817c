"""The carried pass's tidy rows (`moejax.evaluation.carried`): what each metric means (`METRICS`), the
per-layer analyses of SPEC section 3 on the unpruned calibration statistics, the layer-local error
sums per variant, and a perplexity row.
"""

from __future__ import annotations

import numpy as np

from moejax.scoring.scores import rank_correlation
from moejax.scoring.select import select_kept
from moejax.variants import VariantSpec

METRICS = {
    "rel_error": "all-token relative error of the layer's routed output, sum ||y'-y||^2 / sum ||y||^2",
    "rel_error_median": "median over held-out tokens of ||y'-y||^2 / ||y||^2",
    "perplexity": "held-out perplexity with every MoE layer pruned (score empty: unpruned)",
    "esap": "mean over held-out positions of sum_v min(p_unpruned, p_variant): speculative decoding's expected "
            "acceptance of the variant drafting for the unpruned model (EvoESAP's fitness)",
    "kl": "mean over held-out positions of KL(p_unpruned || p_variant), nats",
    "top1_agreement": "share of held-out positions where the variant's most likely next token is the unpruned model's",
    "usage_top_quarter": "share of routing decisions taken by the E/4 most-used experts (calibration)",
    "cosine_mu_ones": "cosine between the mean router input and the all-ones vector",
    "energy_pos0": "share of the routed output's energy sum ||y_t||^2 at sequence position 0 (held-out)",
    "spearman_frequency": "Spearman rank correlation of the score with frequency",
    "overlap_frequency": "kept experts shared with the frequency kept set",
    "overlap_<score>": "kept experts shared with that score's kept set",
    "rare_large_expert": "an expert in the bottom quarter by frequency and the top quarter by reap (value: its index)",
    "experts": "experts the variant keeps at the layer (pruning) or clusters it merges them into (merging)",
}


def analysis_rows(layer, stats, scores, kept, keeps, energy_pos0):
    """Per-layer analyses of SPEC section 3 on the unpruned calibration statistics."""
    rows = []
    E = stats.counts_E.shape[0]
    usage = np.sort(stats.counts_E)[::-1]
    mu = stats.mean_input_D
    rows.append(dict(layer=layer, metric="usage_top_quarter", value=float(usage[: max(1, E // 4)].sum() / usage.sum())))
    rows.append(dict(layer=layer, metric="cosine_mu_ones",
                     value=float(mu.sum() / (np.linalg.norm(mu) * np.sqrt(mu.size) + 1e-30))))
    rows.append(dict(layer=layer, metric="energy_pos0", value=energy_pos0))
    freq = stats.counts_E
    for name, s in scores.items():
        rows.append(dict(layer=layer, method=name, metric="spearman_frequency", value=rank_correlation(s, freq)))
        for keep in keeps:
            for other in scores:
                if other != name:
                    rows.append(dict(layer=layer, method=name, keep=keep, metric=f"overlap_{other}",
                                     value=float(np.sum(kept[name, keep] & kept[other, keep]))))
            if "frequency" not in scores:
                rows.append(dict(layer=layer, method=name, keep=keep, metric="overlap_frequency",
                                 value=float(np.sum(kept[name, keep] & select_kept(freq, keep)))))
    if "reap" in scores:
        quarter = max(1, E // 4)
        rare = set(np.argsort(freq, kind="stable")[:quarter].tolist())
        large = set(np.argsort(-scores["reap"], kind="stable")[:quarter].tolist())
        rows += [dict(layer=layer, method="reap", metric="rare_large_expert", value=float(e)) for e in sorted(rare & large)]
    return rows


class ErrorSums:
    """Per variant and layer: sum ||y'-y||^2, sum ||y||^2, and per-token ratios (host, float64)."""

    def __init__(self):
        self.err, self.norm, self.per_token = {}, {}, {}

    def add(self, key, norm_BS, err_BS, valid_BS):
        norm, err = np.asarray(norm_BS, np.float64)[valid_BS], np.asarray(err_BS, np.float64)[valid_BS]
        self.err[key] = self.err.get(key, 0.0) + err.sum()
        self.norm[key] = self.norm.get(key, 0.0) + norm.sum()
        ok = norm > 0
        self.per_token.setdefault(key, []).append(err[ok] / norm[ok])

    def rows(self):
        out = []
        for (variant, layer), err in self.err.items():
            base = dict(variant.row(), layer=layer)
            out.append(dict(base, metric="rel_error", value=float(err / self.norm[variant, layer])))
            out.append(dict(base, metric="rel_error_median",
                            value=float(np.median(np.concatenate(self.per_token[variant, layer])))))
        return out


def ppl_row(v, text, nll_sum, count):
    base = (VariantSpec.unpruned() if v is None else v).row()
    return dict(base, text=text, metric="perplexity", value=float(np.exp(nll_sum / count)))

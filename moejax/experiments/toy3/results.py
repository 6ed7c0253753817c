"""toy3's results: the tidy rows, one value per (offset, load, seed, score, keep, metric), built per
batch of seeds from what the host step counted and what stage two measured; and the summary table
the runner prints.

  top16_share          the share of the calibration routing the 16 most used experts take (no score)
  overlap_frequency    how many of a pruning variant's kept experts frequency keeps as well
  rel_error            sum_t ||y'_t - y_t||^2 / sum_t ||y_t||^2 on the held-out tokens (SPEC section 3)
  rel_error_median     the median over the held-out tokens of ||y'_t - y_t||^2 / ||y_t||^2
  eq6_*                the Eq. 6 check of each merged pair, score "pair:i+j" (`eq6.eq6_metrics`)

Scores are the pruning scores' names, "method:shrunk" / "method:tied" for the merges and
"score:substituted" for MoNE's variants.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from moejax.experiments.toy3.config import Toy3Config
from moejax.experiments.toy3.eq6 import eq6_metrics
from moejax.experiments.toy3.host import BatchVariants
from moejax.experiments.toy3.variants import Layout, conditions

COLUMNS = ["offset", "load", "seed", "score", "keep", "metric", "value"]


class Measured(NamedTuple):
    """Stage two's results for a batch, on the host, per condition [Z, O, W, ...]."""

    rel_ZOWA: np.ndarray             # rel_error: the pruning variants, then the merges' shrunk and tied forms
    median_ZOWA: np.ndarray          # rel_error_median of the same variants
    merge_per_token_ZOWAT: np.ndarray | None  # the merges' variants' per-token relative errors (None: no merge)
    y_sq_ZOWT: np.ndarray | None     # ||y_t||^2 of the full layer
    idx_held_ZOWTK: np.ndarray | None   # the full layer's routing of the held-out tokens: experts
    gate_held_ZOWTK: np.ndarray | None  # and gates
    sub_rel_ZOWA: np.ndarray | None     # MoNE's variants' rel_error (None: no substitutes)
    sub_median_ZOWA: np.ndarray | None  # and rel_error_median
    merged_pairs: int = 0            # the (merged row, token) pairs stage two computed (`stage_merges`)


def host_rows(cfg: Toy3Config, lay: Layout, seeds, variants: BatchVariants) -> list[dict]:
    """Per condition: top16_share, then each pruning variant's overlap_frequency."""
    rows = []
    for (s, seed), (o, offset), (l_, load) in conditions(cfg, seeds):
        base = dict(offset=offset, load=load, seed=int(seed))
        rows.append({**base, "score": None, "keep": None, "metric": "top16_share",
                     "value": float(variants.top16_share_ZOW[s, o, l_])})
        for v, (name, keep) in enumerate(lay.pruned):
            rows.append({**base, "score": name, "keep": keep, "metric": "overlap_frequency",
                         "value": float(variants.overlap_ZOWA[s, o, l_, v])})
    return rows


def error_rows(cfg: Toy3Config, lay: Layout, seeds, pairs: dict, measured: Measured, f_held_ZOETD) -> list[dict]:
    """Per condition: every variant's rel_error and rel_error_median, each Eq. 6 pair's eq6_* values
    (f_held_ZOETD: the held-out table, read by Eq. 6's prediction), then MoNE's variants'."""
    m = measured
    n_pruned = len(lay.pruned)
    n_rel = lay.n_masked + len(lay.merged)  # variants reported by rel_error; the Eq. 6 pairs follow them
    rows = []
    for (s, seed), (o, offset), (l_, load) in conditions(cfg, seeds):
        at = (s, o, l_)
        for v, (name, keep) in enumerate(lay.labels(pairs[at])):
            base = dict(offset=offset, load=load, seed=int(seed), score=name, keep=keep)
            if v < n_rel:
                rows.append({**base, "metric": "rel_error", "value": float(m.rel_ZOWA[(*at, v)])})
                rows.append({**base, "metric": "rel_error_median", "value": float(m.median_ZOWA[(*at, v)])})
                continue
            err_sq_T = m.merge_per_token_ZOWAT[(*at, v - n_pruned)] * m.y_sq_ZOWT[at].astype(np.float64)
            for metric, value in eq6_metrics(pairs[at][v - n_rel], m.idx_held_ZOWTK[at], m.gate_held_ZOWTK[at],
                                             f_held_ZOETD[s, o], err_sq_T).items():
                rows.append({**base, "metric": metric, "value": value})
        for v, (name, keep) in enumerate(lay.substituted):
            base = dict(offset=offset, load=load, seed=int(seed), score=f"{name}:substituted", keep=keep)
            rows.append({**base, "metric": "rel_error", "value": float(m.sub_rel_ZOWA[(*at, v)])})
            rows.append({**base, "metric": "rel_error_median", "value": float(m.sub_median_ZOWA[(*at, v)])})
    return rows


def to_frame(rows: list[dict]):
    """The tidy table (pandas), keep as a nullable integer. (pandas imported here: the job imports it
    on a second thread while stage one runs, `job._import_in_background`, not before the job.)"""
    import pandas as pd

    df = pd.DataFrame(rows, columns=COLUMNS)
    df["keep"] = df["keep"].astype("Int64")
    return df


def summary_title(cfg: Toy3Config) -> str:
    merges = " (merges: method:router form)" if cfg.merges else ""
    return f"{cfg.router} router: mean rel_error over {cfg.seeds} seed(s) (± std), by keep{merges}:"


def summary_table(df):
    """Mean +- std over seeds of rel_error, rows (offset, load, score), one column per keep; within a
    condition the scores first, then the merges ("method:router form")."""
    err = df[df.metric == "rel_error"]
    agg = err.groupby(["offset", "load", "score", "keep"])["value"].agg(["mean", "std"]).reset_index()
    agg["cell"] = [f"{m:.3f} ± {0.0 if np.isnan(s) else s:.3f}" for m, s in zip(agg["mean"], agg["std"])]
    table = agg.pivot(index=["offset", "load", "score"], columns="keep", values="cell")
    table.columns = [f"keep={k}" for k in table.columns]
    return table.iloc[sorted(range(len(table)), key=lambda i: (*table.index[i][:2], ":" in table.index[i][2]))]

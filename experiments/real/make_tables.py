"""The tables of SPEC section 5 from one prune_real run, as markdown (what experiments/real/README.md shows).

    python experiments/real/make_tables.py outputs/DATE/TIME
"""

from __future__ import annotations

import sys

import pandas as pd

from moejax.results import load


def tables(df: pd.DataFrame) -> dict[str, pd.DataFrame]:
    out = {}
    ppl = df[df.metric == "perplexity"]
    unpruned = ppl[ppl["form"] == "none"].set_index("text").value
    wide = ppl[ppl["form"] != "none"].pivot_table(index=["form", "method"], columns=["keep", "text"], values="value")
    wide.columns = [f"keep={k} {t}" for k, t in wide.columns]
    wide.loc[("none", "unpruned"), :] = [unpruned[c.split(" ", 1)[1]] for c in wide.columns]
    out["held-out perplexity, every MoE layer pruned"] = wide.round(3)
    err = df[df.metric.isin(["rel_error", "rel_error_median"])]
    mean = err.pivot_table(index=["form", "method"], columns=["keep", "metric"], values="value", aggfunc="mean")
    mean.columns = [f"keep={k} {m}" for k, m in mean.columns]
    out["layer-local relative error of the routed output, mean over MoE layers (one-shot: on unpruned inputs; sequential: on its own pruned inputs)"] = mean.round(4)
    by_layer = err[(err.metric == "rel_error_median") & (err["form"] == "one_shot")].pivot_table(
        index=["keep", "method"], columns="layer", values="value")
    out["median per-token relative error by layer (one-shot)"] = by_layer.round(3)
    analyses = df[df.metric.isin(["usage_top_quarter", "cosine_mu_ones", "energy_pos0"])].pivot_table(
        index="layer", columns="metric", values="value")
    out["per-layer analyses (calibration / held-out, unpruned)"] = analyses.round(3)
    corr = df[df.metric == "spearman_frequency"].pivot_table(index="method", values="value", aggfunc="mean")
    overlap = df[df.metric == "overlap_frequency"].pivot_table(index="method", columns="keep", values="value", aggfunc="mean")
    overlap.columns = [f"overlap with frequency, keep={k}" for k in overlap.columns]
    out["agreement with frequency, mean over MoE layers"] = pd.concat(
        [corr.rename(columns={"value": "Spearman with frequency"}), overlap], axis=1).round(3)
    rare = df[df.metric == "rare_large_expert"].groupby("layer").value.apply(lambda v: ", ".join(str(int(x)) for x in v))
    out["rarely picked, large output (bottom quarter by frequency, top quarter by reap)"] = rare.to_frame("experts")
    return out


def markdown(table: pd.DataFrame) -> str:
    """A pipe table (pandas' to_markdown needs the tabulate package, which moejax does not use)."""
    index_names = [str(n or "") for n in table.index.names]
    header = "| " + " | ".join(index_names + [str(c) for c in table.columns]) + " |"
    lines = [header, "|" + "---|" * (len(index_names) + len(table.columns))]
    for key, row in table.iterrows():
        keys = key if isinstance(key, tuple) else (key,)
        cells = ["" if pd.isna(v) else (f"{v:.4g}" if isinstance(v, float) else str(v)) for v in row]
        lines.append("| " + " | ".join([str(k) for k in keys] + cells) + " |")
    return "\n".join(lines)


def main():
    df = load(sys.argv[1])
    for title, table in tables(df).items():
        print(f"\n**{title}**\n")
        print(markdown(table))


if __name__ == "__main__":
    main()

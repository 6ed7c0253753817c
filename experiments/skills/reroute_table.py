"""The per-skill recovery table of experiments/skills/README.md from one eval_skills run with
`prune.reroute=true`: for each variant, generation exact match per skill and held-out perplexity
before and after its routers are distilled (`moejax.training.reroute`).

    python experiments/skills/reroute_table.py outputs/DATE/TIME
"""

from __future__ import annotations

import sys

import numpy as np
import pandas as pd

from moejax.results import load

SKILLS = ("sort", "rev", "close", "up")   # the four skills the recipe B models learned
FORMS = {"one_shot": "", "tied": " (merged, tied)", "shrunk": " (merged, shrunk)", "substituted": " (substituted)"}


def recovery_table(df: pd.DataFrame) -> str:
    df = df.copy()
    df["rerouted"] = df["rerouted"].fillna(False).astype(bool)
    gen = df[df.task.isin([f"skills_{s}" for s in SKILLS]) & (df.metric == "exact_match")]
    ppl = df[(df.task == "heldout") & (df.metric == "perplexity")]
    base = {t.removeprefix("skills_"): v for t, v in gen[gen.form == "none"].set_index("task").value.items()}
    base_ppl = ppl[ppl.form == "none"].value.mean()

    def cell(before, after):
        return f"{before:.2f} -> **{after:.2f}**" if after > before + 1e-9 else f"{before:.2f} -> {after:.2f}"

    lines = ["| variant | keep | " + " | ".join(SKILLS) + " | perplexity | KL first -> last |",
             "|---|---:|" + "---|" * len(SKILLS) + "---|---|",
             f"| unpruned | 32 | " + " | ".join(f"{base[s]:.2f}" for s in SKILLS) + f" | {base_ppl:.3f} | |"]
    variants = gen[gen.form != "none"][["method", "form", "keep"]].drop_duplicates().sort_values(["keep", "form", "method"],
                                                                                                  ascending=[False, True, True])
    totals = {False: [], True: []}
    for method, form, keep in variants.itertuples(index=False):
        sel = (gen.method == method) & (gen.form == form) & (gen.keep == keep)
        by = {r: gen[sel & (gen.rerouted == r)].set_index("task").value for r in (False, True)}
        for r in (False, True):
            totals[r].append(np.mean([by[r][f"skills_{s}"] for s in SKILLS]))
        psel = (ppl.method == method) & (ppl.form == form) & (ppl.keep == keep)
        p = {r: ppl[psel & (ppl.rerouted == r)].value.mean() for r in (False, True)}
        kl = df[(df.method == method) & (df.form == form) & (df.keep == keep) & df.metric.str.startswith("reroute_kl_")]
        kl = kl.set_index("metric").value
        lines.append(f"| {method}{FORMS.get(form, f' ({form})')} | {keep} | "
                     + " | ".join(cell(by[False][f"skills_{s}"], by[True][f"skills_{s}"]) for s in SKILLS)
                     + f" | {p[False]:.3f} -> {p[True]:.3f} | {kl['reroute_kl_first']:.3f} -> {kl['reroute_kl_last']:.3f} |")
    lines.append(f"\nMean over the four skills and every variant: {np.mean(totals[False]):.3f} before, "
                 f"{np.mean(totals[True]):.3f} rerouted.")
    return "\n".join(lines)


if __name__ == "__main__":
    print(recovery_table(load(sys.argv[1])))

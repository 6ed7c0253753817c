"""The allocation table of experiments/skills/README.md (issue 45): one eval_skills run per
allocation (uniform, global, shape, evo_esap; `allocation=` in each run's resolved config), every
variant's mean greedy exact match and MC accuracy over the learned skills, its held-out ESAP and
perplexity (the carried pass's, on held-out code), and how each of ESAP and perplexity ranks the
variants against exact match (Spearman over every allocation x ranking x keep).

    python experiments/skills/allocation_table.py RUN_UNIFORM RUN_GLOBAL RUN_SHAPE RUN_EVO_ESAP
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pandas as pd
import yaml
from scipy.stats import spearmanr

from moejax.evaluation.skills_tasks import skill_of
from moejax.results import load

LEARNED = ("close", "rev", "sort", "up")   # the skills both models learn (experiments/skills/README.md)


def allocation_of(run) -> str:
    """The run's allocation, with the settings it changed from their defaults (e.g. a longer search)."""
    from moejax.allocation import ALLOCATIONS

    cfg = yaml.safe_load((Path(run) / "resolved_config.yaml").read_text())
    name = str(cfg.get("allocation", "uniform"))
    given = (cfg.get("allocations") or {}).get(name) or {}
    changed = {k: v for k, v in given.items() if ALLOCATIONS.defaults()[name].get(k) != v}
    return name + (f" ({', '.join(f'{k}={v}' for k, v in changed.items())})" if changed else "")


def variant_rows(run) -> pd.DataFrame:
    """One row per variant of a run: allocation, method, keep, exact match, MC, ESAP, KL, top-1, perplexity."""
    df = load(run)
    df = df.assign(method=df["method"].fillna("unpruned"))
    tasks = df[df.task.str.startswith("skills_") & (df.task != "skills_degen")].copy()
    tasks["skill"] = tasks.task.map(skill_of)
    tasks = tasks[tasks.skill.isin(LEARNED)]
    kind = tasks.task.map(lambda t: {"mc": "mc", "ll": "ll"}.get(t.split("_")[-1], "gen"))
    gen = tasks[(kind == "gen") & (tasks.metric == "exact_match")]
    mc = tasks[(kind == "mc") & (tasks.metric == "acc")]
    held = df[df.task == "heldout"]
    if "text" in held:   # the carried pass's rows per held-out text and over all of them ("all")
        held = held[held.text.fillna("all") == "all"]
    key = ["form", "method", "keep"]
    out = gen.groupby(key, dropna=False).value.mean().rename("exact match").to_frame()
    # the standard error of a mean of task means (lm-eval's per-task errors, independent documents)
    out["exact match se"] = gen.groupby(key, dropna=False).stderr.apply(lambda e: np.sqrt((e.fillna(0) ** 2).sum()) / len(e))
    out["MC"] = mc.groupby(key, dropna=False).value.mean()
    for metric in ("esap", "kl", "top1_agreement", "perplexity"):
        out[metric] = held[held.metric == metric].groupby(key, dropna=False).value.mean()
    return out.reset_index().assign(allocation=allocation_of(run))


def tables(runs) -> dict:
    rows = pd.concat([variant_rows(r) for r in runs], ignore_index=True)
    pruned = rows[rows["form"] != "none"]
    out = {"variants": pruned.set_index(["keep", "method", "allocation"]).sort_index(ascending=[False, True, True])
           [["exact match", "exact match se", "MC", "esap", "kl", "top1_agreement", "perplexity"]].round(3)}
    base = rows[rows["form"] == "none"].iloc[:1]
    out["unpruned"] = base[["exact match", "MC", "perplexity"]].round(3)
    ranks = {}
    for keep, g in [("all", pruned), *pruned.groupby("keep")]:
        ok = g.dropna(subset=["exact match", "esap", "perplexity"])
        if len(ok) > 2:
            ranks[keep] = {"variants": len(ok),
                           "spearman(ESAP, exact match)": round(spearmanr(ok.esap, ok["exact match"]).statistic, 3),
                           "spearman(-ppl, exact match)": round(spearmanr(-ok.perplexity, ok["exact match"]).statistic, 3),
                           "spearman(ESAP, MC)": round(spearmanr(ok.esap, ok.MC).statistic, 3)}
    out["rank agreement with exact match (over allocations x rankings)"] = pd.DataFrame(ranks).T
    gain = pruned.pivot_table(index=["keep", "method"], columns="allocation", values=["exact match", "MC"])
    out["exact match and MC by allocation"] = gain.round(3)
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    for title, table in tables(argv).items():
        print(f"\n**{title}**\n")
        print(table.to_markdown() if not table.empty else "(none)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

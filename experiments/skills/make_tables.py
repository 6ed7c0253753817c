"""The tables of experiments/skills/README.md from one eval_skills run (experiment=eval_tasks on the
skills tasks), as markdown.

    python experiments/skills/make_tables.py outputs/DATE/TIME
    python experiments/skills/make_tables.py --calibration RUN_CODE RUN_SKILLS RUN_UNIFORM   # calibration mixes

Standard errors (±) are lm-eval's: the standard error of a mean over documents.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pandas as pd

from moejax.results import load
from moejax.evaluation.skills_tasks import skill_of


def _fmt(v, se):
    return f"{v:.2f}" if not np.isfinite(se) else f"{v:.2f}±{se:.2f}"


def _tasks(df: pd.DataFrame):
    """(gen, mc, ll) rows of the skills tasks, with `method`, `skill` columns."""
    df = df.copy()
    df["method"] = df["method"].fillna("unpruned")
    tasks = df[df.task.str.startswith("skills_") & (df.task != "skills_degen")].copy()
    tasks["skill"] = tasks.task.map(skill_of)
    tasks["kind"] = tasks.task.map(lambda t: {"mc": "mc", "ll": "ll"}.get(t.split("_")[-1], "gen"))
    return (tasks[(tasks.kind == "gen") & (tasks.metric == "exact_match")],
            tasks[(tasks.kind == "mc") & (tasks.metric == "acc")], tasks[tasks.kind == "ll"])


def _cell(rows: pd.DataFrame) -> str:
    """mean ± standard error of a mean of several task means (independent documents)."""
    if rows.empty:
        return ""
    v = rows.value.mean()
    se = np.sqrt((rows.stderr.fillna(0) ** 2).sum()) / len(rows)
    return f"{v:.2f}±{se:.2f}"


def questions(df: pd.DataFrame, rare=("close", "up", "kv")) -> dict[str, pd.DataFrame]:
    """The tables that answer the README's questions."""
    gen, mc, _ = _tasks(df)
    out = {}
    keeps = sorted(gen.keep.dropna().unique(), reverse=True)
    # 1. rare skills under frequency, REAP and EAN (one-shot and sequential)
    rows = {}
    for (mode, method), g in gen[gen["form"].isin(["one_shot", "sequential"])].groupby(["form", "method"]):
        rows[(mode, method)] = {f"keep={k} {s}": _cell(g[(g.keep == k) & (g.skill == s)]) for k in keeps
                                for s in rare if s in set(gen.skill)}
    base = gen[gen["form"] == "none"]
    rows[("none", "unpruned")] = {f"keep={k} {s}": _cell(base[base.skill == s]) for k in keeps for s in rare
                                  if s in set(gen.skill)}
    out["rare skills: greedy exact match by pruning score"] = pd.DataFrame(rows).T
    # 2. pruning against merging: multiple choice against generation (mean over skills)
    rows = {}
    for (mode, method), g in gen.groupby(["form", "method"]):
        m = mc[(mc["form"] == mode) & (mc.method == method)]
        for k in (keeps if mode != "none" else [None]):
            gk = g if k is None else g[g.keep == k]
            mk = m if k is None else m[m.keep == k]
            rows[(mode, method, "" if k is None else int(k))] = {"generation (exact match)": _cell(gk),
                                                                  "multiple choice (acc)": _cell(mk)}
    out["generation against multiple choice, mean over skills"] = pd.DataFrame(rows).T
    # 4. does the held-out perplexity ranking of the scores agree with the task ranking?
    from scipy.stats import spearmanr

    ppl = df[(df.task == "heldout") & (df.metric == "perplexity")].assign(method=lambda d: d.method.fillna("unpruned"))
    rows = {}
    for mode in ("one_shot", "sequential"):
        for k in keeps:
            p = ppl[(ppl["form"] == mode) & (ppl.keep == k)].set_index("method").value
            g = gen[(gen["form"] == mode) & (gen.keep == k)].groupby("method").value.mean()
            m = mc[(mc["form"] == mode) & (mc.keep == k)].groupby("method").value.mean()
            common = p.index.intersection(g.index)
            if len(common) > 2:
                rows[(mode, int(k))] = {"scores": len(common),
                                        "spearman(-ppl, exact match)": round(spearmanr(-p[common], g[common]).statistic, 3),
                                        "spearman(-ppl, MC acc)": round(spearmanr(-p[common], m[common]).statistic, 3),
                                        "best by ppl": p[common].idxmin(), "best by exact match": g[common].idxmax()}
    out["perplexity ranking against task ranking (scores)"] = pd.DataFrame(rows).T
    return out


def calibration_table(runs: list) -> pd.DataFrame:
    """Mean exact match per skill by calibration mix (one run per mix), one-shot scores."""
    import yaml

    frames = []
    for run in runs:
        cal = yaml.safe_load((Path(run) / "resolved_config.yaml").read_text()).get("calibration", "code")
        gen, _, _ = _tasks(load(run))
        frames.append(gen[gen["form"] == "one_shot"].assign(calibration=cal))
    gen = pd.concat(frames)
    return gen.pivot_table(index=["keep", "method"], columns=["skill", "calibration"], values="value").round(2)


def tables(df: pd.DataFrame) -> dict[str, pd.DataFrame]:
    out = {}
    gen, mc, ll = _tasks(df)
    tasks = pd.concat([gen, mc, ll])
    df = df.assign(method=df["method"].fillna("unpruned"))
    base = gen[gen["form"] == "none"].set_index("skill")
    out["unpruned model: greedy exact match, MC acc, answer log-likelihood (nats) per skill"] = pd.DataFrame({
        "exact match": base.apply(lambda r: _fmt(r.value, r.stderr), axis=1),
        "MC acc": mc[mc["form"] == "none"].set_index("skill").apply(lambda r: _fmt(r.value, r.stderr), axis=1),
        "answer logprob": tasks[(tasks.kind == "ll") & (tasks.metric == "logprob") & (tasks["form"] == "none")]
        .set_index("skill").value.round(3)})
    for keep in sorted(gen.keep.dropna().unique(), reverse=True):
        g = gen[gen.keep == keep]
        wide = g.pivot_table(index=["form", "method"], columns="skill", values="value")
        wide["mean"] = wide.mean(axis=1)
        out[f"greedy exact match at keep={keep}"] = wide.sort_values("mean", ascending=False).round(2)
    for keep in sorted(mc.keep.dropna().unique(), reverse=True):
        wide = mc[mc.keep == keep].pivot_table(index=["form", "method"], columns="skill", values="value")
        wide["mean"] = wide.mean(axis=1)
        out[f"multiple choice acc at keep={keep}"] = wide.sort_values("mean", ascending=False).round(2)
    deg = df[df.task == "skills_degen"].assign(keep=lambda d: d.keep.fillna(0)).pivot_table(
        index=["form", "method", "keep"], columns="metric", values="value")
    out["degeneration (open prompts to 256 bytes): loop rate, terminated rate, distinct-n"] = deg.round(3)
    need = df[df.metric == "experts_for_90"].pivot_table(index="task", columns="layer", values="value")
    need.columns = [f"layer {int(c)}" for c in need.columns]
    out["experts carrying 90% of each text's routing decisions (unpruned)"] = need
    ppl = df[(df.task == "heldout") & (df.metric == "perplexity")].pivot_table(
        index=["form", "method"], columns="keep", values="value")
    out["held-out code perplexity (calibration pass)"] = ppl.round(3)
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[0] == "--calibration":
        print(calibration_table(argv[1:]).to_markdown())
        return 0
    df = load(argv[0])
    for title, table in {**tables(df), **questions(df)}.items():
        print(f"\n**{title}**\n")
        print(table.to_markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The tables of experiments/skills/README.md from one eval_skills run (experiment=eval_tasks on the
skills tasks), as markdown.

    python experiments/skills/make_tables.py outputs/DATE/TIME
    python experiments/skills/make_tables.py --calibration RUN [RUN ...]   # calibration mixes, one run per model and mix
    python experiments/skills/make_tables.py --causal DIR [DIR ...] [--figures OUT]   # causal.py's outputs
    python experiments/skills/make_tables.py --across RUN [RUN ...] [--figures OUT]   # one run per model
    python experiments/skills/make_tables.py --cliff RUN [RUN ...] [--gini DIR ...] [--figures OUT]

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
    """Exact match by calibration mix (each run's `calibration` setting), one-shot scores: the mean
    over the learned skills and each rare skill (close, up), a cell per (family, method, keep) and
    mix, mean±sd over the models (one run per model and mix; a single model gives its value)."""
    import yaml

    rows = []
    for run in runs:
        cal = yaml.safe_load((Path(run) / "resolved_config.yaml").read_text()).get("calibration", "code")
        model = model_of(run)
        gen, _, _ = _tasks(load(run))
        for (method, keep), part in gen[gen["form"] == "one_shot"].groupby(["method", "keep"]):
            rows.append(dict(family=model.split("/")[0], method=method, keep=int(keep), model=model, calibration=cal,
                             learned=part[part.skill.isin(LEARNED)].value.mean(),
                             close=part[part.skill == "close"].value.mean(), up=part[part.skill == "up"].value.mean()))
    table = pd.DataFrame(rows).groupby(["family", "method", "keep", "calibration"])[["learned", "close", "up"]].agg(
        _band).unstack("calibration")
    mixes = list(dict.fromkeys(r["calibration"] for r in rows))
    return table.reindex(columns=pd.MultiIndex.from_product([["learned", "close", "up"], mixes]))


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


LEARNED = ("close", "rev", "sort", "up")   # the four skills every skills model learns (README)


def model_of(run) -> str:
    """family/seed of the model a run evaluated (its resolved config's model.path)."""
    import yaml

    path = Path(yaml.safe_load((Path(run) / "resolved_config.yaml").read_text())["model"]["path"])
    return f"{path.parent.name.removeprefix('skills-')}/{path.name}"


def runs_table(runs) -> pd.DataFrame:
    """Every run's results with a model column (family/seed) and a family column."""
    frames = [load(run).assign(model=model_of(run)) for run in runs]
    df = pd.concat(frames, ignore_index=True)
    df["family"] = df.model.str.split("/").str[0]
    return df


def _band(values: pd.Series) -> str:
    v = values.dropna().to_numpy(float)
    if len(v) == 0:
        return ""
    return f"{v.mean():.2f}±{v.std(ddof=1):.2f}" if len(v) > 1 else f"{v.mean():.2f}"


def across_tables(runs) -> dict[str, pd.DataFrame]:
    """The README's questions with each cell the mean ± standard deviation over models (one run
    per model), and each model's own value beside it."""
    from scipy.stats import spearmanr

    df = runs_table(runs)
    out = {}
    gen, mc, _ = _tasks(df)   # (their model and family columns are the runs')
    for fam in sorted(df.family.unique()):
        g = gen[gen.model.str.startswith(fam + "/")]
        learned = g[g.skill.isin(LEARNED)].groupby(["form", "method", "keep", "model"], dropna=False).value.mean()
        cells = learned.groupby(level=["form", "method", "keep"], dropna=False).agg(_band).unstack("keep")
        cells = cells[sorted(cells.columns, key=lambda k: -1 if pd.isna(k) else -int(k))]   # unpruned, then 3/4 ...
        out[f"{fam}: mean exact match over the learned skills, mean±sd over models"] = cells
        per_model = learned.unstack("model").round(2)
        out[f"{fam}: the same, each model"] = per_model
        rare = g[g.skill.isin(("close", "up")) & g["form"].isin(["one_shot", "none"])]
        out[f"{fam}: rare skills (close, up), one-shot, mean±sd over models"] = rare.groupby(
            ["method", "keep", "skill"], dropna=False).value.agg(_band).unstack(["skill", "keep"])
        m = mc[mc.model.str.startswith(fam + "/")]
        both = pd.DataFrame({"generation": g.groupby(["form", "method", "keep", "model"], dropna=False).value.mean(),
                             "mc": m.groupby(["form", "method", "keep", "model"], dropna=False).value.mean()})
        out[f"{fam}: generation against multiple choice (mean over skills), mean±sd over models"] = both.groupby(
            level=["form", "method", "keep"], dropna=False).agg(_band)
        ppl = df[(df.task == "heldout") & (df.metric == "perplexity") & df.model.str.startswith(fam + "/")]
        rows = []
        for (model, mode, keep), p in ppl.groupby(["model", "form", "keep"]):
            p = p.set_index("method").value
            e = g[(g.model == model) & (g["form"] == mode) & (g.keep == keep)].groupby("method").value.mean()
            common = p.index.intersection(e.index)
            if len(common) > 2:
                rows.append(dict(model=model, form=mode, keep=keep,
                                 rho=spearmanr(-p[common], e[common]).statistic))
        if rows:
            rho = pd.DataFrame(rows)
            out[f"{fam}: Spearman(-perplexity, exact match) over scores, mean±sd over models"] = rho.groupby(
                ["form", "keep"]).rho.agg(_band).to_frame("spearman")
    return out


def across_figures(runs, out: Path) -> list[Path]:
    """Exact match against keep per skill (one-shot REAP, frequency and l1, bands of ±1 sd over models),
    and multiple choice against generation (every variant of every model), per family."""
    plt = _pyplot()
    df = runs_table(runs)
    gen, mc, _ = _tasks(df)   # (their model and family columns are the runs')
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for fam in sorted(df.family.unique()):
        g = gen[gen.model.str.startswith(fam + "/")]
        skills = sorted(g.skill.dropna().unique())
        fig, axes = plt.subplots(1, len(skills), figsize=(2.6 * len(skills), 2.8), sharey=True)
        for ax, skill in zip(np.atleast_1d(axes), skills):
            for method in ("reap", "frequency", "l1"):
                s = g[(g.skill == skill) & (g.method == method) & (g["form"] == "one_shot")]
                stat = s.groupby("keep").value.agg(["mean", "std"]).fillna(0).sort_index()
                ax.plot(stat.index, stat["mean"], marker="o", ms=3, label=method)
                ax.fill_between(stat.index, stat["mean"] - stat["std"], stat["mean"] + stat["std"], alpha=0.2)
            ax.set_title(skill)
            ax.set_xlabel("experts kept")
        np.atleast_1d(axes)[0].set_ylabel("greedy exact match")
        np.atleast_1d(axes)[-1].legend(fontsize=7)
        written += _save(fig, out / f"exact-match-vs-keep-{fam}")
        m = mc[mc.model.str.startswith(fam + "/")]
        keys = ["form", "method", "keep", "model"]
        both = pd.DataFrame({"generation": g.groupby(keys, dropna=False).value.mean(),
                             "mc": m.groupby(keys, dropna=False).value.mean()}).reset_index()
        fig, ax = plt.subplots(figsize=(4, 3.6))
        for form, part in both.groupby("form"):
            ax.scatter(part["mc"], part["generation"], s=10, alpha=0.6, label=form)
        ax.set_xlabel("multiple choice acc (mean over skills)")
        ax.set_ylabel("greedy exact match (mean over skills)")
        ax.legend(fontsize=7)
        written += _save(fig, out / f"mc-vs-generation-{fam}")
    return written


def _pyplot():
    """matplotlib's pyplot, drawing to files only (the `plots` extra)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, stem: Path) -> list[Path]:
    fig.tight_layout()
    paths = [stem.with_suffix(".png"), stem.with_suffix(".svg")]
    for path in paths:
        fig.savefig(path, dpi=120)
    _pyplot().close(fig)
    return paths


def cliff_of(curve: pd.Series, unpruned: float) -> float:
    """The cliff of one exact-match curve {keep: value}: walking down from the most experts kept,
    the last keep before the value first falls below half its unpruned value; the first keep plus
    its step when it falls at once (32 of 32 in the cliff preset); NaN for a skill the model never
    learned (unpruned 0.2 or less)."""
    if not unpruned > 0.2:
        return np.nan
    keeps = sorted(curve.index, reverse=True)
    held = None
    for k in keeps:
        if curve[k] < 0.5 * unpruned:
            break
        held = k
    if held is not None:
        return float(held)
    return float(keeps[0] + (keeps[0] - keeps[1] if len(keeps) > 1 else 0))


def cliff_tables(runs, gini_dirs=()) -> dict[str, pd.DataFrame]:
    """Exact match per skill against keep for each score (mean±sd over models), where each falls
    below half its unpruned value (the cliff, `cliff_of`), and with causal.py's folders each layer's
    Gini coefficient of causal (single-removal NLL increase) and observational (the score on the
    skill's own documents) importance, mean over layers, and whether it predicts the cliff: the
    Spearman correlation of Gini with cliff over every (model, skill) a family has."""
    df = runs_table(runs)
    gen, _, _ = _tasks(df)
    out = {}
    base = gen[gen["form"] == "none"].groupby(["model", "skill"]).value.mean()
    pruned = gen[gen["form"] == "one_shot"]
    cliffs = []
    for fam in sorted(gen.family.unique()):
        f = pruned[pruned.family == fam]
        by_keep = f.groupby(["skill", "method", "keep"]).value.agg(_band).unstack("keep")
        unpruned = base[base.index.get_level_values("model").isin(f.model.unique())].groupby("skill").agg(_band)
        by_keep["unpruned"] = by_keep.index.get_level_values("skill").map(unpruned)
        out[f"{fam}: exact match by keep, mean±sd over models"] = by_keep
        rows = []
        for (model, skill, method), part in f.groupby(["model", "skill", "method"]):
            b = base.get((model, skill), np.nan)
            rows.append(dict(family=fam, model=model, skill=skill, method=method, unpruned=b,
                             cliff=cliff_of(part.groupby("keep").value.mean(), b)))
        cliff = pd.DataFrame(rows)
        cliffs.append(cliff)
        out[f"{fam}: the cliff, fewest experts keeping half the unpruned exact match (mean±sd over models)"] = (
            cliff.groupby(["skill", "method"]).cliff.agg(_band).unstack("method"))
    if gini_dirs:
        from scipy.stats import spearmanr

        from moejax.evaluation.causal_stats import gini

        causal, scores, _ = _causal(gini_dirs)
        eff = causal[(causal.layer >= 0) & (causal.metric == "nll_increase")]
        g_causal = eff.groupby(["model", "task", "layer"]).value.agg(gini).groupby(["model", "task"]).mean()
        sc = scores[(scores.calibration == "task")]
        g_obs = sc.groupby(["model", "task", "score", "layer"]).value.agg(gini).groupby(["model", "task", "score"]).mean()
        out["Gini of importance per layer (mean over layers): causal, and each score on the skill's documents"] = (
            pd.concat([g_causal.rename("causal"), g_obs.unstack("score")], axis=1).round(3))
        every = pd.concat(cliffs, ignore_index=True)
        every["key"] = list(zip("skills-" + every.model, every.skill))
        every["gini_causal"] = every.key.map(g_causal).round(3)
        every["gini_own"] = [g_obs.get((m, s, method), np.nan) for (m, s), method in zip(every.key, every.method)]
        out["Each model's cliff per score beside its skill's causal Gini"] = every.pivot_table(
            index=["model", "skill", "gini_causal"], columns="method", values="cliff").round(2)
        rows = []
        for (fam, method), part in every.groupby(["family", "method"]):
            row = dict(family=fam, method=method)
            for col in ("gini_causal", "gini_own"):
                ok = part[np.isfinite(part.cliff) & np.isfinite(part[col])]
                row[f"rho({col}, cliff)"] = (round(float(spearmanr(ok[col], ok.cliff).statistic), 3)
                                             if len(ok) > 2 and ok[col].nunique() > 1 and ok.cliff.nunique() > 1
                                             else np.nan)
                row[f"pairs ({col})"] = len(ok)
            rows.append(row)
        out["Does the Gini predict the cliff? Spearman over (model, skill), per family and score"] = (
            pd.DataFrame(rows).set_index(["family", "method"]))
    return out


def cliff_figures(runs, out: Path) -> list[Path]:
    """Exact match against keep, one panel per skill, a line per score with a ±1 sd band over models."""
    plt = _pyplot()
    df = runs_table(runs)
    gen, _, _ = _tasks(df)
    written = []
    out.mkdir(parents=True, exist_ok=True)
    for fam in sorted(gen.family.unique()):
        g = gen[(gen.family == fam) & (gen["form"] == "one_shot")]
        skills = sorted(g.skill.unique())
        fig, axes = plt.subplots(1, len(skills), figsize=(2.6 * len(skills), 2.8), sharey=True)
        for ax, skill in zip(np.atleast_1d(axes), skills):
            for method, part in g[g.skill == skill].groupby("method"):
                stat = part.groupby("keep").value.agg(["mean", "std"]).fillna(0).sort_index()
                ax.plot(stat.index, stat["mean"], marker="o", ms=2, label=method)
                ax.fill_between(stat.index, stat["mean"] - stat["std"], stat["mean"] + stat["std"], alpha=0.15)
            ax.set_title(skill)
            ax.set_xlabel("experts kept (of 32)")
            ax.invert_xaxis()
        np.atleast_1d(axes)[0].set_ylabel("greedy exact match")
        np.atleast_1d(axes)[-1].legend(fontsize=6)
        written += _save(fig, out / f"cliff-{fam}")
    return written


def _causal(dirs) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """causal.py's tables of every folder, the model named family/seed."""
    read = lambda name: pd.concat([pd.read_parquet(Path(d) / f"{name}.parquet") for d in dirs],  # noqa: E731
                                  ignore_index=True)
    return read("causal"), read("scores"), read("paired_d")


HARMFUL = 0.1   # nats per document: a removal that costs more is one pruning must avoid


def _kept_harmful(eff: pd.DataFrame, scores: pd.DataFrame) -> pd.DataFrame:
    """One row per (model, task, layer, expert) whose removal costs more than HARMFUL nats, and per
    score whether the score ranks it in its layer's top half (kept at keep 1/2)."""
    harmful = eff[eff.value > HARMFUL][["model", "task", "layer", "expert"]]
    sc = scores.copy()
    sc["top_half"] = sc.groupby([c for c in ("model", "task", "score", "layer") if c in sc]).value.rank(
        ascending=False, method="first") <= sc.groupby([c for c in ("model", "task", "score", "layer")
                                                         if c in sc]).value.transform("size") / 2
    on = [c for c in ("model", "task", "layer", "expert") if c in sc]
    return harmful.merge(sc[on + ["score", "top_half"]], on=on).rename(columns={"top_half": "kept"})


def causal_tables(dirs) -> dict[str, pd.DataFrame]:
    """Does any observational score predict the causal importance (experiments/skills/causal.py)?"""
    from moejax.evaluation.causal_stats import across_models, gini, score_agreement

    causal, scores, d = _causal(dirs)
    family = lambda m: m.split("/")[0].removeprefix("skills-")  # noqa: E731
    out = {}
    full = causal[(causal.layer < 0)].pivot_table(index="model", columns=["task", "metric"], values="value")
    out["unpruned models: continuation NLL (nats per document) and exact match per task"] = full.round(3)
    eff = causal[(causal.layer >= 0) & (causal.metric == "nll_increase")]
    spread = eff.groupby(["model", "task", "layer"]).value.agg(
        top="max", median="median", harmful=lambda v: int((v > 0.05).sum()), gini=gini).reset_index()
    spread["family"] = spread.model.map(family)
    out["single removals: largest and median NLL increase, experts above 0.05 nats, Gini (mean over models)"] = (
        spread.groupby(["family", "task", "layer"])[["top", "median", "harmful", "gini"]].mean().round(3))
    for calibration in ("code", "task"):
        sc = scores[scores.calibration == calibration]
        if calibration == "code":
            sc = sc.drop(columns="task")
        agree = score_agreement(causal, sc)
        agree["family"] = agree.model.map(family)
        per_model = agree.groupby(["family", "model", "metric", "score"]).spearman.mean().reset_index()
        summary = across_models(per_model.rename(columns={"spearman": "rho"}), "rho", ["family", "metric", "score"])
        summary["cell"] = summary.apply(lambda r: f"{r['mean']:+.2f}±{r['std']:.2f} (n={r['n']})", axis=1)
        out[f"Spearman(score, causal importance), mean over layers and tasks; mean±sd over models; "
            f"scores on {calibration}"] = summary.pivot_table(index="score", columns=["family", "metric"],
                                                              values="cell", aggfunc="first")
        kept = _kept_harmful(eff, sc)
        kept["family"] = kept.model.map(family)
        out[f"of the experts whose removal costs a task > {HARMFUL} nats, the share each score keeps at "
            f"1/2 (its top half in the layer), mean±sd over models; scores on {calibration}"] = (
            kept.groupby(["family", "score", "model"]).kept.mean().groupby(["family", "score"]).agg(_band)
            .unstack("family"))
    d = d.assign(family=d.model.map(family))
    tests = d.groupby(["family", "model"]).size()
    d["alpha"] = d.apply(lambda r: 0.05 / tests[(r.family, r.model)], axis=1)
    d["significant"] = (d.p_t < d.alpha) & (d.p_wilcoxon < d.alpha) & (d.d > 0)
    out["the causal audit's paired d (zeroing, no re-routing): median and largest |d|, cells with d > 0 "
        "significant by both tests after Bonferroni"] = d.groupby(["family", "calibration", "score"]).agg(
        median_d=("d", "median"), max_abs_d=("d", lambda v: v.abs().max()), significant=("significant", "sum"),
        cells=("d", "size")).round(3)
    return out


def causal_figures(dirs, out: Path) -> list[Path]:
    """Causal against observational importance: per family, for frequency and REAP measured on
    each task's own documents, the rank of the score against the NLL increase of removing each
    expert, every model, layer and skill in one panel per score (PNG and SVG)."""
    plt = _pyplot()
    causal, scores, _ = _causal(dirs)
    eff = causal[(causal.layer >= 0) & (causal.metric == "nll_increase") & (causal.task != "code")]
    sc = scores[scores.calibration == "task"]
    written = []
    out.mkdir(parents=True, exist_ok=True)
    for fam in sorted({m.split("/")[0] for m in causal.model}):
        names = [n for n in ("frequency", "reap", "ean", "random") if n in set(sc.score)]
        fig, axes = plt.subplots(1, len(names), figsize=(3.2 * len(names), 3.2), sharey=True)
        for ax, name in zip(np.atleast_1d(axes), names):
            s = sc[(sc.score == name) & sc.model.str.startswith(fam)].copy()
            s["rank"] = s.groupby(["model", "task", "layer"]).value.rank(pct=True)
            m = eff[eff.model.str.startswith(fam)].merge(s[["model", "task", "layer", "expert", "rank"]],
                                                         on=["model", "task", "layer", "expert"])
            for task, g in m.groupby("task"):
                ax.scatter(g["rank"], g.value, s=6, alpha=0.5, label=task)
            ax.set_title(name)
            ax.set_xlabel("score rank in its layer (1 = kept first)")
            ax.set_yscale("symlog", linthresh=0.01)
        np.atleast_1d(axes)[0].set_ylabel("NLL increase when removed (nats/doc)")
        np.atleast_1d(axes)[-1].legend(fontsize=6, markerscale=2)
        fig.suptitle(f"{fam}: causal against observational importance", fontsize=9)
        written += _save(fig, out / f"causal-vs-score-{fam.removeprefix('skills-')}")
    return written


def _print(tables: dict) -> None:
    for title, table in tables.items():
        print(f"\n**{title}**\n")
        print(table.to_markdown())


def _split(argv: list, flag: str) -> tuple[list, list]:
    """(argv before `flag`, the values after it up to the next --flag)."""
    if flag not in argv:
        return argv, []
    i = argv.index(flag)
    rest = argv[i + 1:]
    end = next((j for j, a in enumerate(rest) if a.startswith("--")), len(rest))
    return argv[:i] + rest[end:], rest[:end]


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[0] in ("--causal", "--across", "--cliff"):
        mode = argv[0]
        rest, figures = _split(argv[1:], "--figures")
        rest, gini_dirs = _split(rest, "--gini")
        if mode == "--causal":
            _print(causal_tables(rest))
            drawn = causal_figures(rest, Path(figures[0])) if figures else []
        elif mode == "--across":
            _print(across_tables(rest))
            drawn = across_figures(rest, Path(figures[0])) if figures else []
        else:
            _print(cliff_tables(rest, gini_dirs))
            drawn = cliff_figures(rest, Path(figures[0])) if figures else []
        for path in drawn:
            print(path)
        return 0
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

"""The tables of experiments/skills/README.md from one eval_skills run (experiment=eval_tasks on the
skills tasks), as markdown.

    python experiments/skills/make_tables.py outputs/DATE/TIME
"""

from __future__ import annotations

import sys

import numpy as np
import pandas as pd

from moejax.results import load


def _skill(task: str) -> str:
    return task.split("_")[1]


def _fmt(v, se):
    return f"{v:.2f}" if not np.isfinite(se) else f"{v:.2f}±{se:.2f}"


def tables(df: pd.DataFrame) -> dict[str, pd.DataFrame]:
    out = {}
    df = df.copy()
    df["method"] = df["score"].fillna("unpruned")
    tasks = df[df.task.str.startswith("skills_") & (df.task != "skills_degen")].copy()
    tasks["skill"] = tasks.task.map(_skill)
    tasks["kind"] = tasks.task.map(lambda t: {"mc": "mc", "ll": "ll"}.get(t.split("_")[-1], "gen"))
    gen = tasks[(tasks.kind == "gen") & (tasks.metric == "exact_match")]
    mc = tasks[(tasks.kind == "mc") & (tasks.metric == "acc")]
    base = gen[gen["mode"] == "none"].set_index("skill")
    out["unpruned model: greedy exact match, MC acc, answer log-likelihood (nats) per skill"] = pd.DataFrame({
        "exact match": base.apply(lambda r: _fmt(r.value, r.stderr), axis=1),
        "MC acc": mc[mc["mode"] == "none"].set_index("skill").apply(lambda r: _fmt(r.value, r.stderr), axis=1),
        "answer logprob": tasks[(tasks.kind == "ll") & (tasks.metric == "logprob") & (tasks["mode"] == "none")]
        .set_index("skill").value.round(3)})
    for keep in sorted(gen.keep.dropna().unique(), reverse=True):
        g = gen[gen.keep == keep]
        wide = g.pivot_table(index=["mode", "method"], columns="skill", values="value")
        wide["mean"] = wide.mean(axis=1)
        out[f"greedy exact match at keep={keep}"] = wide.sort_values("mean", ascending=False).round(2)
    for keep in sorted(mc.keep.dropna().unique(), reverse=True):
        wide = mc[mc.keep == keep].pivot_table(index=["mode", "method"], columns="skill", values="value")
        wide["mean"] = wide.mean(axis=1)
        out[f"multiple choice acc at keep={keep}"] = wide.sort_values("mean", ascending=False).round(2)
    deg = df[df.task == "skills_degen"].pivot_table(index=["mode", "method", "keep"], columns="metric",
                                                     values="value", dropna=False)
    out["degeneration (open prompts to 256 bytes): loop rate, terminated rate, distinct-n"] = deg.round(3)
    need = df[df.metric == "experts_for_90"].pivot_table(index="task", columns="layer", values="value")
    need.columns = [f"layer {int(c)}" for c in need.columns]
    out["experts carrying 90% of each text's routing decisions (unpruned)"] = need
    ppl = df[(df.task == "heldout") & (df.metric == "perplexity")].pivot_table(
        index=["mode", "method"], columns="keep", values="value")
    out["held-out code perplexity (calibration pass)"] = ppl.round(3)
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    df = load(argv[0])
    for title, table in tables(df).items():
        print(f"\n**{title}**\n")
        print(table.to_markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())

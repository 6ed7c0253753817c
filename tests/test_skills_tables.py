"""experiments/skills/make_tables.py across models (one run per model) and the cliff, against numpy
on hand-made runs: each cell's mean and standard deviation over models, the cliff's keep, the
figures drawn."""

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
SKILLS = ("close", "rev", "sort", "up", "kv")
KEEPS = (24, 16, 8)


@pytest.fixture(scope="module")
def make_tables():
    spec = importlib.util.spec_from_file_location("skills_make_tables", ROOT / "experiments" / "skills" / "make_tables.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _run(root: Path, seed: int, rng) -> tuple[Path, dict]:
    """A run folder as eval_skills writes it (results.parquet, resolved_config.yaml, status.json)
    with random exact match, MC acc and perplexity; returns it and its exact match values."""
    run = root / f"run{seed}"
    run.mkdir()
    rows, em = [], {}
    variants = [("none", None, None)] + [("one_shot", m, k) for m in ("reap", "frequency", "random") for k in KEEPS]
    for form, method, keep in variants:
        for skill in SKILLS:
            v = float(np.round(rng.random(), 2)) if form != "none" else 0.9
            em[(form, method, keep, skill)] = v
            rows.append(dict(method=method, form=form, keep=keep, task=f"skills_{skill}", metric="exact_match",
                             value=v, stderr=0.03, layer=None, expert=None))
            rows.append(dict(method=method, form=form, keep=keep, task=f"skills_{skill}_mc", metric="acc",
                             value=float(rng.random()), stderr=0.05, layer=None, expert=None))
        rows.append(dict(method=method, form=form, keep=keep, task="heldout", metric="perplexity",
                         value=float(4 + rng.random()), stderr=np.nan, layer=None, expert=None))
    df = pd.DataFrame(rows)
    for col in ("keep", "layer", "expert"):
        df[col] = df[col].astype("Int64")
    df.to_parquet(run / "results.parquet")
    (run / "resolved_config.yaml").write_text(yaml.safe_dump(
        {"name": "eval_tasks", "model": {"path": f"/m/skills-deepseek_v3/seed-{seed}"}}))
    (run / "status.json").write_text('{"status": "completed"}')
    return run, em


def test_across_models_cells_are_mean_and_std_over_models(make_tables, tmp_path):
    from scipy.stats import spearmanr

    rng = np.random.default_rng(0)
    runs, ems = zip(*[_run(tmp_path, s, rng) for s in range(3)])
    tables = make_tables.across_tables(list(runs))
    ppl = {s: pd.read_parquet(run / "results.parquet").query("task == 'heldout'") for s, run in enumerate(runs)}
    cells = tables["deepseek_v3: mean exact match over the learned skills, mean±sd over models"]
    for method in ("reap", "frequency"):
        for keep in KEEPS:
            per_model = [np.mean([em[("one_shot", method, keep, s)] for s in make_tables.LEARNED]) for em in ems]
            assert cells.loc[("one_shot", method), keep] == f"{np.mean(per_model):.2f}±{np.std(per_model, ddof=1):.2f}"
    each = tables["deepseek_v3: the same, each model"]
    assert list(each.columns) == [f"deepseek_v3/seed-{s}" for s in range(3)]
    rho = tables["deepseek_v3: Spearman(-perplexity, exact match) over scores, mean±sd over models"]
    methods = ("reap", "frequency", "random")
    for keep in KEEPS:
        per_model = []
        for s, em in enumerate(ems):
            p = ppl[s][ppl[s].keep == keep].set_index("method").value[list(methods)]
            e = [np.mean([em[("one_shot", m, keep, k)] for k in SKILLS]) for m in methods]
            per_model.append(spearmanr(-p.to_numpy(), e).statistic)
        assert rho.loc[("one_shot", keep), "spearman"] == f"{np.mean(per_model):.2f}±{np.std(per_model, ddof=1):.2f}"
    drawn = make_tables.across_figures(list(runs), tmp_path / "fig")
    assert {p.name for p in drawn} >= {"exact-match-vs-keep-deepseek_v3.png", "mc-vs-generation-deepseek_v3.svg"}


def test_the_cliff_is_the_fewest_experts_keeping_half_the_unpruned_exact_match(make_tables, tmp_path):
    rng = np.random.default_rng(1)
    runs, ems = zip(*[_run(tmp_path, s, rng) for s in range(3)])
    tables = make_tables.cliff_tables(list(runs))
    cliff = tables["deepseek_v3: the cliff, fewest experts keeping half the unpruned exact match (mean±sd over models)"]
    for skill in SKILLS:
        for method in ("reap", "frequency"):
            per_model = []
            for em in ems:
                kept = [k for k in KEEPS if em[("one_shot", method, k, skill)] >= 0.5 * 0.9]
                per_model.append(min(kept) if kept else np.nan)
            v = np.array(per_model, float)
            v = v[np.isfinite(v)]
            want = "" if not len(v) else (f"{v.mean():.2f}±{v.std(ddof=1):.2f}" if len(v) > 1 else f"{v.mean():.2f}")
            assert cliff.loc[skill, method] == want, (skill, method)
    assert all(p.stat().st_size > 1000 for p in make_tables.cliff_figures(list(runs), tmp_path / "fig"))


def test_kept_harmful_is_the_share_of_costly_experts_in_each_scores_top_half(make_tables):
    eff = pd.DataFrame({"model": "m", "task": "t", "layer": 1, "expert": range(6), "metric": "nll_increase",
                        "value": [0.0, 0.5, 0.02, 2.0, 0.3, 0.0]})          # experts 1, 3, 4 cost > 0.1
    scores = pd.DataFrame({"model": "m", "layer": 1, "expert": range(6), "score": "s",
                           "value": [6.0, 5.0, 4.0, 3.0, 2.0, 1.0]})       # top half: experts 0, 1, 2
    kept = make_tables._kept_harmful(eff, scores)
    assert sorted(kept.expert) == [1, 3, 4]
    assert dict(zip(kept.expert, kept.kept)) == {1: True, 3: False, 4: False}

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


def _walk_down(values: dict, unpruned: float) -> float:
    """The cliff by hand: going down from the most experts kept, the last keep still at half the
    unpruned exact match; 32 when the first keep already falls below."""
    held = None
    for k in sorted(values, reverse=True):
        if values[k] < 0.5 * unpruned:
            break
        held = k
    return 32.0 if held is None else float(held)


def _causal_dir(root: Path, seed: int, rng) -> tuple[Path, dict]:
    """A folder as causal.py writes it, for one model: random single-removal NLL increases and
    task-calibrated scores at two layers of eight experts; returns it and the numpy Gini per skill
    (the mean over layers of sum|x_i - x_j| / (2 n^2 mean), negatives as zero)."""
    out = root / f"causal{seed}"
    out.mkdir()
    model = f"skills-deepseek_v3/seed-{seed}"
    causal, scores, ginis = [], [], {}

    def g(x):
        x = np.clip(x, 0, None)
        return np.abs(x[:, None] - x[None, :]).sum() / (2 * len(x) ** 2 * x.mean())

    for skill in SKILLS:
        per_layer = []
        for layer in (1, 2):
            cost = rng.gamma(0.5 + 2 * rng.random(), size=8) - 0.1
            per_layer.append(g(cost))
            causal += [dict(layer=layer, expert=e, task=skill, metric="nll_increase", value=float(v), model=model)
                       for e, v in enumerate(cost)]
            for score in ("reap", "frequency"):
                scores += [dict(layer=layer, expert=e, score=score, value=float(v), calibration="task", task=skill,
                                model=model) for e, v in enumerate(rng.random(8))]
        ginis[skill] = float(np.mean(per_layer))
    pd.DataFrame(causal).to_parquet(out / "causal.parquet")
    pd.DataFrame(scores).to_parquet(out / "scores.parquet")
    pd.DataFrame([dict(model=model)]).to_parquet(out / "paired_d.parquet")
    return out, ginis


def test_the_cliff_is_where_exact_match_first_falls_below_half_and_the_gini_is_set_beside_it(make_tables, tmp_path):
    from scipy.stats import spearmanr

    rng = np.random.default_rng(1)
    runs, ems = zip(*[_run(tmp_path, s, rng) for s in range(3)])
    dirs, ginis = zip(*[_causal_dir(tmp_path, s, rng) for s in range(3)])
    tables = make_tables.cliff_tables(list(runs), list(dirs))
    cliff = tables["deepseek_v3: the cliff, fewest experts keeping half the unpruned exact match (mean±sd over models)"]
    rho = tables["Does the Gini predict the cliff? Spearman over (model, skill), per family and score"]
    for method in ("reap", "frequency"):
        pairs = []
        for skill in SKILLS:
            v = np.array([_walk_down({k: em[("one_shot", method, k, skill)] for k in KEEPS}, 0.9) for em in ems])
            assert cliff.loc[skill, method] == f"{v.mean():.2f}±{v.std(ddof=1):.2f}", (skill, method)
            pairs += [(ginis[s][skill], c) for s, c in enumerate(v)]
        gx, cx = np.array(pairs).T
        assert rho.loc[("deepseek_v3", method), "rho(gini_causal, cliff)"] == round(float(spearmanr(gx, cx).statistic), 3)
        assert rho.loc[("deepseek_v3", method), "pairs (gini_causal)"] == len(SKILLS) * 3
    assert make_tables.cliff_of(pd.Series({30: 0.9, 20: 0.1, 10: 0.9}), 0.9) == 30   # not the 10 that recovers
    assert np.isnan(make_tables.cliff_of(pd.Series({30: 0.1}), 0.1))                 # never learned
    assert all(p.stat().st_size > 1000 for p in make_tables.cliff_figures(list(runs), tmp_path / "fig"))


def test_kept_harmful_is_the_share_of_costly_experts_in_each_scores_top_half(make_tables):
    eff = pd.DataFrame({"model": "m", "task": "t", "layer": 1, "expert": range(6), "metric": "nll_increase",
                        "value": [0.0, 0.5, 0.02, 2.0, 0.3, 0.0]})          # experts 1, 3, 4 cost > 0.1
    scores = pd.DataFrame({"model": "m", "layer": 1, "expert": range(6), "score": "s",
                           "value": [6.0, 5.0, 4.0, 3.0, 2.0, 1.0]})       # top half: experts 0, 1, 2
    kept = make_tables._kept_harmful(eff, scores)
    assert sorted(kept.expert) == [1, 3, 4]
    assert dict(zip(kept.expert, kept.kept)) == {1: True, 3: False, 4: False}


def test_calibration_table_is_mean_and_std_over_models_per_mix(make_tables, tmp_path):
    rng = np.random.default_rng(2)
    runs, ems = [], {}
    for cal in ("code", "skills"):
        (tmp_path / cal).mkdir()
        for s in range(3):
            run, em = _run(tmp_path / cal, s, rng)
            cfg = yaml.safe_load((run / "resolved_config.yaml").read_text())
            (run / "resolved_config.yaml").write_text(yaml.safe_dump({**cfg, "calibration": cal}))
            runs.append(run)
            ems[cal, s] = em
    table = make_tables.calibration_table(runs)
    assert list(table.columns) == [(c, m) for c in ("learned", "close", "up") for m in ("code", "skills")]
    for cal in ("code", "skills"):
        for method in ("reap", "frequency", "random"):
            for keep in KEEPS:
                learned = [np.mean([ems[cal, s][("one_shot", method, keep, k)] for k in make_tables.LEARNED]) for s in range(3)]
                up = [ems[cal, s][("one_shot", method, keep, "up")] for s in range(3)]
                for column, v in (("learned", learned), ("up", up)):
                    want = f"{np.mean(v):.2f}±{np.std(v, ddof=1):.2f}"
                    assert table.loc[("deepseek_v3", method, keep), (column, cal)] == want, (cal, method, keep, column)

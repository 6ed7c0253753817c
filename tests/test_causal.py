"""Causal expert importance (moejax.evaluation.causal) against references it does not share code
with: a single removal equals the checkpoint `moejax prune` writes without that expert, scored one
document at a time; zeroing an expert equals transformers' model with that expert's down_proj
zeroed (the causal audit's hook); the chosen experts equal transformers' router's. The statistics
(moejax.evaluation.causal_stats) against scipy and numpy on hand-made tables."""

import json

import numpy as np
import pytest
from family_fixtures import make_family_checkpoint, moe_blocks
from hf_fixtures import hook_router

from moejax.evaluation import causal, causal_stats

FAMILY = "qwen3_moe"


def _docs(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {task: [(bytes(rng.integers(1, 256, rng.integers(3, 12)).tolist()),
                    bytes(rng.integers(1, 256, rng.integers(2, 9)).tolist())) for _ in range(5)]
            for task in ("alpha", "beta")}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from moejax.hf.model_io import load_pretrained

    root = tmp_path_factory.mktemp("causal")
    hf = make_family_checkpoint(FAMILY, root / "ckpt", seed=5, vocab_size=256, max_position_embeddings=64)
    model = load_pretrained(root / "ckpt")
    docs = _docs(0)
    return root, hf, model, docs, causal.causal_importance(model, docs, batch_size=4)


def _nll_of_each(logits_SV: np.ndarray, whole: bytes, n_context: int) -> tuple[float, bool]:
    """(continuation NLL, greedy) of one unpadded document from its logits, in float64 numpy."""
    z = logits_SV.astype(np.float64)
    logp = z - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)) - z.max(-1, keepdims=True)
    ids = list(whole)
    nll = -sum(logp[j - 1, ids[j]] for j in range(n_context, len(ids)))
    return nll, all(logp[j - 1].argmax() == ids[j] for j in range(n_context, len(ids)))


def test_a_single_removal_equals_the_checkpoint_prune_writes_without_it(setup, tmp_path):
    from moejax.hf.model_io import load_pretrained
    from moejax.surgery.prune import prune_checkpoint

    root, _, model, docs, table = setup
    layer, expert = model.config.moe_layers[-1], 3
    profile = tmp_path / "riy.json"
    profile.write_text(json.dumps({"version": 1, "model": "x", "pruned_experts": [[layer, expert]]}))
    prune_checkpoint(root / "ckpt", tmp_path / "pruned", keep_map=profile, keep_map_format="riy")
    pruned = load_pretrained(tmp_path / "pruned")
    assert pruned.config.experts_in_layer(layer) == model.config.n_experts - 1
    for task, pairs in docs.items():
        scored = [_nll_of_each(np.asarray(pruned(np.array([list(c + x)], np.int32)).logits_BSV[0]), c + x, len(c))
                  for c, x in pairs]
        got = table[(table.layer == layer) & (table.expert == expert) & (table.task == task)].set_index("metric").value
        np.testing.assert_allclose(got["nll"], np.mean([s[0] for s in scored]), rtol=2e-5)
        assert got["exact_match"] == np.mean([s[1] for s in scored])
        full = table[(table.layer == -1) & (table.task == task)].set_index("metric").value
        np.testing.assert_allclose(got["nll_increase"], got["nll"] - full["nll"], rtol=1e-12)
    n_moe = len(model.config.moe_layers)
    assert len(table[table.layer >= 0]) == n_moe * model.config.n_experts * len(docs) * 4
    # removals matter: some change the NLL by more than float noise
    assert table[table.metric == "nll_increase"].value.abs().max() > 1e-2


def test_zeroing_an_expert_equals_transformers_with_its_down_proj_zeroed(setup):
    import copy

    import torch

    _, hf, model, docs, _ = setup
    batch = causal.DocBatch.of(docs)
    deltas = causal.zeroing_deltas(model, batch, batch_size=4)
    full_ref = None
    for layer, expert in [(model.config.moe_layers[0], 0), (model.config.moe_layers[-1], 5)]:
        silenced = copy.deepcopy(hf)
        experts = moe_blocks(silenced)[layer].experts
        with torch.no_grad():
            if isinstance(getattr(experts, "down_proj", None), torch.nn.Parameter):   # fused [E, H, F]
                experts.down_proj[expert].zero_()
            else:
                experts[expert].down_proj.weight.zero_()
        for i, (ids, mask) in enumerate(zip(batch.ids_NS, batch.targets_NS > -1)):
            n = int(batch.continuation_NS[i].nonzero()[0].max()) + 2      # the document's length
            with torch.no_grad():
                ref = silenced(torch.as_tensor(ids[None, :n], dtype=torch.long)).logits[0].double()
                base = hf(torch.as_tensor(ids[None, :n], dtype=torch.long)).logits[0].double()
            t = torch.as_tensor(batch.targets_NS[i, :n - 1], dtype=torch.long)
            nll = lambda z: -torch.log_softmax(z[:n - 1], -1).gather(1, t[:, None])[:, 0].numpy()  # noqa: E731
            np.testing.assert_allclose(deltas[(layer, expert)][i, :n - 1], nll(ref) - nll(base), atol=2e-4)
            full_ref = True
    assert full_ref and max(np.abs(d).max() for d in deltas.values()) > 1e-2


def test_chosen_experts_are_transformers_routers_choice(setup):
    _, hf, model, docs, _ = setup
    batch = causal.DocBatch.of(docs)
    chosen = causal.chosen_experts(model, batch, batch_size=4)
    _, seen = hook_router(hf, batch.ids_NS, np.ones_like(batch.ids_NS))
    for layer, idx in chosen.items():
        ref = seen[layer][-1].reshape(idx.shape).numpy()
        np.testing.assert_array_equal(np.sort(idx, -1), np.sort(ref, -1))


# --- statistics on hand-made tables --------------------------------------------------------------

def test_score_agreement_is_spearman_per_model_layer_task():
    import pandas as pd
    from scipy import stats

    rng = np.random.default_rng(1)
    rows, score_rows = [], []
    for model in ("m0", "m1"):
        for layer in (1, 2):
            eff = rng.normal(size=6)
            sc = np.round(rng.normal(size=6), 1)
            sc[2] = sc[4]   # a tie
            rows += [dict(model=model, layer=layer, expert=e, task="t", metric="nll_increase", value=eff[e])
                     for e in range(6)]
            score_rows += [dict(model=model, layer=layer, expert=e, score="s", value=sc[e]) for e in range(6)]
            expected = stats.spearmanr(sc, eff).statistic
            rows.append(dict(model=model, layer=-1, expert=-1, task="t", metric="nll", value=9.0))
            score_rows.append(dict(model=model, layer=layer, expert=99, score="s", value=1.0))   # not in causal: ignored
            table = causal_stats.score_agreement(pd.DataFrame(rows), pd.DataFrame(score_rows))
            got = table[(table.model == model) & (table.layer == layer)].spearman.item()
            np.testing.assert_allclose(got, expected, rtol=1e-12)


def test_paired_d_against_a_loop_and_scipys_paired_tests():
    from scipy import stats

    rng = np.random.default_rng(2)
    E, K, N, S, layer = 5, 2, 3, 6, 1
    deltas = {(layer, e): rng.normal(size=(N, S)) for e in range(E)}
    chosen = np.stack([rng.permutation(E)[:K] for _ in range(N * S)]).reshape(N, S, K)
    score = np.array([0.3, 0.9, 0.3, 0.1, 0.5])
    positions = rng.random((N, S)) < 0.8
    high, low = [], []
    for i in range(N):
        for j in range(S):
            if not positions[i, j]:
                continue
            pair = sorted(chosen[i, j], key=lambda e: (-score[e], e))
            if score[pair[0]] == score[pair[-1]]:
                continue
            lo = sorted(chosen[i, j], key=lambda e: (score[e], -e))[0]
            high.append(deltas[(layer, pair[0])][i, j])
            low.append(deltas[(layer, lo)][i, j])
    got = causal_stats.paired_d(deltas, chosen, score, positions, layer)
    diff = np.array(high) - np.array(low)
    assert got["n"] == len(diff)
    np.testing.assert_allclose(got["d"], diff.mean() / diff.std(ddof=1), rtol=1e-12)
    np.testing.assert_allclose(got["p_t"], stats.ttest_rel(high, low).pvalue, rtol=1e-10)
    np.testing.assert_allclose(got["p_wilcoxon"], stats.wilcoxon(high, low).pvalue, rtol=1e-10)


def test_across_models_and_gini_against_numpy():
    import pandas as pd

    df = pd.DataFrame({"model": ["a", "b", "c", "a", "b"], "g": [1, 1, 1, 2, 2], "v": [0.1, 0.4, 0.7, 2.0, np.nan]})
    out = causal_stats.across_models(df, "v", ["g"]).set_index("g")
    np.testing.assert_allclose(out.loc[1, "mean"], 0.4)
    np.testing.assert_allclose(out.loc[1, "std"], np.std([0.1, 0.4, 0.7], ddof=1))
    assert out.loc[2, "n"] == 1 and np.isnan(out.loc[2, "std"])
    x = np.array([0.0, 1.0, 3.0, 6.0])
    xs = np.sort(x)
    n = len(xs)
    by_ranks = (2 * np.sum(np.arange(1, n + 1) * xs)) / (n * xs.sum()) - (n + 1) / n
    np.testing.assert_allclose(causal_stats.gini(x), by_ranks, rtol=1e-12)
    assert causal_stats.gini([1, 1, 1]) == 0.0 and np.isnan(causal_stats.gini([0, -1]))


def test_the_skills_causal_run_and_its_tables_and_figures(tmp_path):
    """experiments/skills/causal.py on a byte-level checkpoint (two models: two seeds of the fixture),
    then make_tables --causal: every expert's removal per task, every score on both calibrations,
    the paired d per cell, the tables and a PNG and SVG figure per family."""
    import importlib.util
    import sys
    import sysconfig
    from pathlib import Path

    from moejax.data import write_byte_tokenizer

    root = Path(__file__).resolve().parents[1] / "experiments" / "skills"
    mods = {}
    for name in ("causal", "make_tables"):
        spec = importlib.util.spec_from_file_location(f"skills_{name}", root / f"{name}.py")
        mods[name] = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mods[name]
        spec.loader.exec_module(mods[name])
    models = []
    for seed in (1, 2):
        path = tmp_path / "skills-qwen3_moe" / f"seed-{seed}"
        make_family_checkpoint(FAMILY, path, seed=seed, vocab_size=256, max_position_embeddings=256,
                               eos_token_id=0, pad_token_id=0, bos_token_id=None)
        write_byte_tokenizer(path, 256)
        (path / "moejax_tiny.json").write_text(json.dumps({"stdlib_root": sysconfig.get_paths()["stdlib"],
                                                           "heldout": ["textwrap.py"]}))
        models.append(path)
    out = tmp_path / "out"
    from moejax.errors import MoejaxError

    with pytest.raises(MoejaxError, match="--out holds the input"):   # a folder holding a model it reads: refused, nothing written
        mods["causal"].main([*map(str, models), "--out", str(tmp_path), "--docs", "4"])
    assert not (tmp_path / "causal.parquet").exists()
    mods["causal"].main([*map(str, models), "--out", str(out), "--docs", "4"])
    import pandas as pd

    causal_df = pd.read_parquet(out / "causal.parquet")
    assert set(causal_df.task) == {"add", "sort", "rev", "kv", "close", "up", "code"}
    assert set(causal_df.model) == {"skills-qwen3_moe/seed-1", "skills-qwen3_moe/seed-2"}
    scores = pd.read_parquet(out / "scores.parquet")
    assert {"frequency", "reap", "ean", "random"} <= set(scores.score) and set(scores.calibration) == {"code", "task"}
    d = pd.read_parquet(out / "paired_d.parquet")
    assert np.isfinite(d.d).any() and set(d.task) == set(causal_df.task)
    tables = mods["make_tables"].causal_tables([out])
    assert any("Spearman" in title for title in tables) and all(len(t) for t in tables.values())
    figures = mods["make_tables"].causal_figures([out], tmp_path / "figures")
    assert {p.suffix for p in figures} == {".png", ".svg"} and all(p.stat().st_size > 1000 for p in figures)



def test_the_cliff_preset_is_eval_tasks_at_every_second_keep():
    from pathlib import Path

    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from moejax.experiments import eval_tasks

    import moejax.experiments.runner  # noqa: F401  (registers the experiments' defaults)

    conf = Path(__file__).resolve().parents[1] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = OmegaConf.to_container(compose("config", overrides=["experiment=cliff_skills"]), resolve=True)
    settings = eval_tasks.settings_from(cfg)
    assert cfg["name"] == "eval_tasks" and settings["keep"] == list(range(30, 2, -2))
    assert settings["merges"] == [] and settings["substitutes"] == [] and settings["sequential"] is False
    assert set(settings["tasks"]) == {f"skills_{s}" for s in ("add", "sort", "rev", "kv", "close", "up")}

"""prune_real (moejax.evaluation.carried): unpruned perplexity against transformers, keep=E reproduces the
unpruned numbers exactly, layer-local errors against numpy straight from SPEC sections 1 and 3."""

import numpy as np
import pandas as pd
import pytest

pytest.importorskip("transformers")

from hf_fixtures import make_checkpoint  # noqa: E402

from moejax.evaluation import carried as evaluate
from moejax.inference import stream  # noqa: E402
from moejax.evaluation.carried import evaluate_pruning  # noqa: E402
from moejax.hf.io.checkpoint_reader import CheckpointReader  # noqa: E402
from moejax.hf.model_io import open_checkpoint  # noqa: E402

E, K, SEQ = 16, 2, 24  # top-2 of 4 groups of 4, 2 chosen: every keep >= 4 routes each token to 2 kept experts


def carried_pass(path, seed: int, rows: tuple, scores: list, keeps: list, stream_tokens=None, **pass_kw):
    """A tiny DeepSeek-V3 checkpoint (make_checkpoint settings in pass_kw["checkpoint"]), random
    calibration ids and held-out texts "a", "b" (rows: their sequence counts), and the carried pass
    on them with the output head a vocabulary chunk at a time (100, 100, 56 rows: the running
    log-sum-exp across chunks; `stream_tokens`: held-out tokens per call). Returns (model, calib,
    heldout, rows as a DataFrame, info)."""
    model = make_checkpoint(path, seed=seed, vocab_size=256, num_experts_per_tok=K, **pass_kw.pop("checkpoint"))
    rng = np.random.default_rng(seed - 31)
    calib = rng.integers(0, 256, size=(rows[0], SEQ)).astype(np.int32)
    heldout = {t: rng.integers(0, 256, size=(n, SEQ)).astype(np.int32) for t, n in zip("ab", rows[1:])}
    with pytest.MonkeyPatch.context() as mp:
        if stream_tokens:
            mp.setattr(evaluate, "STREAM_TOKENS", stream_tokens)
        mp.setattr(stream, "VOCAB_CHUNK", 100)
        out, info = evaluate_pruning(open_checkpoint(path), calib, heldout, scores, keeps, batch_size=4, **pass_kw)
    return model, calib, heldout, pd.DataFrame(out), info


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    # 4 of the 31 held-out streams per call (the last call 3), so every test below checks the chunked paths
    path = tmp_path_factory.mktemp("real") / "src"
    model, calib, heldout, df, info = carried_pass(
        path, 31, (6, 4, 3), ["frequency", "reap", "l1", "signed", "random"], [E, 8, 0.25],
        stream_tokens=4 * 4 * SEQ, sequential=True, checkpoint=dict(n_routed_experts=E, n_group=4, topk_group=2))
    return path, model, calib, heldout, df, info


def test_unpruned_perplexity_matches_transformers(setup):
    import torch

    path, model, _, heldout, df, _ = setup
    for text, ids in heldout.items():
        with torch.no_grad():
            logits = model(torch.as_tensor(ids, dtype=torch.long)).logits.float()
        nll = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 256), torch.as_tensor(ids[:, 1:]).reshape(-1).long())
        got = df[(df["form"] == "none") & (df.text == text) & (df.metric == "perplexity")].value.item()
        assert got == pytest.approx(float(torch.exp(nll)), rel=1e-4)


def test_keep_all_experts_gives_the_unpruned_numbers_exactly(setup):
    *_, df, _ = setup
    ppl = df[df.metric == "perplexity"]
    unpruned = ppl[ppl["form"] == "none"].set_index("text").value
    full = ppl[ppl.keep == E]
    assert len(full) == 5 * 2 * 3  # 5 scores x 2 modes x (2 texts + all)
    for _, row in full.iterrows():
        assert row.value == unpruned[row.text]
    errors = df[df.metric.isin(["rel_error", "rel_error_median"]) & (df.keep == E)]
    assert len(errors) and (errors.value == 0).all()
    pruned = ppl[ppl.keep == 4]
    assert (pruned.value != pruned.text.map(unpruned)).all()  # pruning a quarter changes every perplexity


def numpy_chosen(z, w, b, mask, cfg):
    """SPEC section 1's choice in numpy: (sigmoid scores [T, E], chosen experts [T, K]) with the
    bias for the choice only and group-limited top-k."""
    s = 1 / (1 + np.exp(-(z @ w.T)))
    sel = np.where(mask, s + b, -np.inf)
    G = cfg["n_group"]
    grouped = np.sort(sel.reshape(len(z), G, -1), axis=-1)[..., -2:].sum(-1)
    best = np.argsort(-grouped, axis=-1, kind="stable")[:, :cfg["topk_group"]]
    allowed = np.zeros((len(z), G), bool)
    np.put_along_axis(allowed, best, True, axis=-1)
    sel = np.where(np.repeat(allowed, E // G, axis=-1), sel, -np.inf)
    return s, np.argsort(-sel, axis=-1, kind="stable")[:, :K]


def numpy_routed(z, w, b, experts, mask, cfg):
    """SPEC section 1 in numpy: sigmoid scores, bias for the choice only, group-limited top-k,
    renormalised gates times routed_scaling_factor; experts down(silu(gate x) * up x)."""
    s, idx = numpy_chosen(z, w, b, mask, cfg)
    gate = np.take_along_axis(s, idx, -1)
    gate = gate / gate.sum(-1, keepdims=True) * cfg["routed_scaling_factor"]
    y = np.zeros_like(z)
    for t in range(len(z)):
        for k in range(K):
            g, u, d = experts[idx[t, k]]
            h = z[t] @ g.T
            y[t] += gate[t, k] * (((h / (1 + np.exp(-h))) * (z[t] @ u.T)) @ d.T)
    return y


def test_layer_errors_match_numpy(setup):
    import torch

    path, model, _, heldout, df, info = setup
    layer = 2  # the second MoE layer: its input already passed through a pruned-free model
    r = CheckpointReader(path)
    cfg = r.config()
    pre = f"model.layers.{layer}.mlp."
    w = r.read(pre + "gate.weight").astype(np.float64)
    b = r.read(pre + "gate.e_score_correction_bias").astype(np.float64)
    experts = [tuple(r.read(f"{pre}experts.{e}.{p}_proj.weight").astype(np.float64) for p in ("gate", "up", "down"))
               for e in range(E)]
    z = []
    hook = model.model.layers[layer].post_attention_layernorm.register_forward_hook(
        lambda m, i, o: z.append(o.detach().double().numpy().reshape(-1, o.shape[-1])))
    with torch.no_grad():
        for text in ("a", "b"):
            model(torch.as_tensor(heldout[text], dtype=torch.long))
    hook.remove()
    z = np.concatenate(z)
    y = numpy_routed(z, w, b, experts, np.ones(E, bool), cfg)
    for key, keep in (("l1@8", 8), ("reap@4", 4)):
        mask = np.zeros(E, bool)
        mask[info["kept"][layer][key]] = True
        y_pruned = numpy_routed(z, w, b, experts, mask, cfg)
        err, norm = ((y_pruned - y) ** 2).sum(-1), (y ** 2).sum(-1)
        rows = df[(df["form"] == "one_shot") & (df.method == key.split("@")[0]) & (df.keep == keep) & (df.layer == layer)]
        assert rows[rows.metric == "rel_error"].value.item() == pytest.approx(err.sum() / norm.sum(), rel=1e-4)
        assert rows[rows.metric == "rel_error_median"].value.item() == pytest.approx(np.median(err / norm), rel=1e-4)


def test_kept_sets_and_analyses(setup):
    path, _, calib, _, df, info = setup
    r = CheckpointReader(path)
    for layer in (1, 2):
        w = r.read(f"model.layers.{layer}.mlp.gate.weight").astype(np.float64)
        assert info["kept"][layer]["l1@8"] == sorted(np.argsort(-np.abs(w).sum(1), kind="stable")[:8].tolist())
        a = df[(df.layer == layer) & (df["form"] == "one_shot")]
        usage = a[a.metric == "usage_top_quarter"].value.item()
        assert 4 / E <= usage <= 1
        assert -1 <= a[a.metric == "cosine_mu_ones"].value.item() <= 1
        assert 0 < a[a.metric == "energy_pos0"].value.item() < 1
        rho = a[(a.metric == "spearman_frequency")].set_index("method").value
        assert rho["frequency"] == pytest.approx(1.0)
        overlap = a[(a.metric == "overlap_frequency") & (a.keep == 8)].set_index("method").value
        want = len(set(info["kept"][layer]["reap@8"]) & set(info["kept"][layer]["frequency@8"]))
        assert overlap["reap"] == want
    # sequential = one-shot at the first MoE layer (nothing pruned before it), not after
    e = df[df.metric == "rel_error"].pivot_table(index=["method", "keep", "layer"], columns="form", values="value")
    first = e.xs(1, level="layer")
    assert np.allclose(first["one_shot"], first["sequential"])


def router_inputs(model, layer, ids_by_text):
    """transformers' router input (post_attention_layernorm output) at `layer`, float64 [T, H],
    tokens in (text, sequence, position) order."""
    import torch

    z = []
    hook = model.model.layers[layer].post_attention_layernorm.register_forward_hook(
        lambda m, i, o: z.append(o.detach().double().numpy().reshape(-1, o.shape[-1])))
    with torch.no_grad():
        for ids in ids_by_text:
            model(torch.as_tensor(ids, dtype=torch.long))
    hook.remove()
    return np.concatenate(z)


def test_published_analyses_match_numpy(setup):
    """Every per-layer analysis of SPEC section 3 recomputed from transformers' activations and
    numpy routing: usage concentration (top E/4 share of the calibration routing decisions),
    cos(mu, ones), energy at position 0 (held-out routed output), Spearman against frequency
    (scipy, ties averaged) and each pairwise overlap of kept sets (python sets)."""
    from scipy.stats import spearmanr

    path, model, calib, heldout, df, info = setup
    r = CheckpointReader(path)
    cfg = r.config()
    for layer in (1, 2):
        pre = f"model.layers.{layer}.mlp."
        w = r.read(pre + "gate.weight").astype(np.float64)
        b = r.read(pre + "gate.e_score_correction_bias").astype(np.float64)
        a = df[(df.layer == layer) & (df["form"] == "one_shot")]
        value = lambda metric, **by: a[(a.metric == metric) & np.logical_and.reduce(  # noqa: E731
            [a[k] == v for k, v in by.items()] or [True])].value.item()

        z = router_inputs(model, layer, [calib])
        _, idx = numpy_chosen(z, w, b, np.ones(E, bool), cfg)
        counts = np.bincount(idx.ravel(), minlength=E)
        assert counts.sum() == calib.size * K
        top = sorted(counts.tolist(), reverse=True)[:E // 4]
        assert value("usage_top_quarter") == pytest.approx(sum(top) / counts.sum(), abs=1e-12)
        mu = z.mean(axis=0)
        assert value("cosine_mu_ones") == pytest.approx(mu.sum() / np.sqrt((mu ** 2).sum() * mu.size), rel=1e-5)

        zh = router_inputs(model, layer, [heldout["a"], heldout["b"]])
        y = numpy_routed(zh, w, b, [tuple(r.read(f"{pre}experts.{e}.{p}_proj.weight").astype(np.float64)
                                          for p in ("gate", "up", "down")) for e in range(E)],
                         np.ones(E, bool), cfg)
        energy = (y ** 2).sum(-1)
        first = np.arange(len(zh)) % SEQ == 0              # sequence position 0 of every held-out row
        assert value("energy_pos0") == pytest.approx(energy[first].sum() / energy.sum(), rel=1e-4)

        weight_only = {"frequency": counts, "l1": np.abs(w).sum(1), "signed": w.sum(1)}
        for name, score in weight_only.items():
            want = spearmanr(score, counts).statistic
            assert value("spearman_frequency", method=name) == pytest.approx(want, abs=1e-9), name
        kept = info["kept"][layer]
        names = ["frequency", "reap", "l1", "signed", "random"]
        for keep in (8, 4):
            for x in names:
                for y_ in names:
                    if x != y_:
                        want = len(set(kept[f"{x}@{keep}"]) & set(kept[f"{y_}@{keep}"]))
                        assert value(f"overlap_{y_}", method=x, keep=keep) == want, (layer, keep, x, y_)
            # the frequency kept set itself: the `keep` most used experts, ties to the lower index
            assert kept[f"frequency@{keep}"] == sorted(sorted(range(E), key=lambda j: (-counts[j], j))[:keep])


def test_analysis_rows_against_python_on_ties():
    """`_analysis_rows` alone on a hand-made layer with tied counts and tied scores: every value
    against plain python / scipy."""
    from types import SimpleNamespace

    from scipy.stats import spearmanr

    from moejax.evaluation.carried_rows import analysis_rows as _analysis_rows

    counts = np.array([5, 9, 0, 9, 3, 12, 1, 9, 4, 9, 2, 7])             # E = 12: the top quarter is 3
    mu = np.array([0.3, -1.2, 0.5, 2.0, 0.1])
    scores = {"signed": np.array([1.0, -2, 1, 3, 3, 0, -1, 2, 2, 5, -3, 1]),
              "l1": np.array([4.0, 1, 1, 2, 7, 3, 3, 3, 0, 6, 5, 2])}
    kept = {("signed", 4): np.isin(np.arange(12), [3, 4, 7, 9]), ("l1", 4): np.isin(np.arange(12), [0, 1, 5, 9])}
    rows = _analysis_rows(3, SimpleNamespace(counts_E=counts, mean_input_D=mu), scores, kept, [4], 0.125)
    get = {(r["metric"], r.get("method")): r["value"] for r in rows}
    assert all(r["layer"] == 3 for r in rows)
    assert get["usage_top_quarter", None] == pytest.approx((12 + 9 + 9) / counts.sum())
    assert get["cosine_mu_ones", None] == pytest.approx(sum(mu) / (np.sqrt(sum(mu ** 2)) * np.sqrt(5)))
    assert get["energy_pos0", None] == 0.125
    for name in scores:
        assert get["spearman_frequency", name] == pytest.approx(spearmanr(scores[name], counts).statistic)
    signed, l1 = {3, 4, 7, 9}, {0, 1, 5, 9}
    # no frequency score given: its kept set is the 4 most used, the tie at 9 (experts 1, 3, 7, 9)
    # broken toward the lower index
    frequency = set(sorted(range(12), key=lambda j: (-counts[j], j))[:4])
    assert frequency == {1, 3, 5, 7}
    assert get["overlap_l1", "signed"] == get["overlap_signed", "l1"] == len(signed & l1) == 1
    assert get["overlap_frequency", "signed"] == len(signed & frequency) == 2
    assert get["overlap_frequency", "l1"] == len(l1 & frequency) == 2


def test_experiment_through_hydra_runner(tmp_path, setup):
    from moejax.experiments.runner import run_job
    from moejax.results import load

    path = setup[0]
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    cfg = {"name": "prune_real", "model": {"path": str(path)}, "keep": [0.5],
           "scores": ["frequency", "bias", "man", "msan", "max_act", "aimer"],
           "data": {"calib": [str(text)], "heldout": [str(text)], "seq_len": 32, "calib_tokens": 512,
                    "heldout_tokens": 256, "batch_size": 4}, "prune": {"sequential": False}, "dtype": "float32"}
    run_job(cfg, tmp_path / "out")
    df = load(tmp_path / "out")
    assert {"method", "form", "keep", "layer", "text", "metric", "value"} <= set(df.columns)
    assert set(df[df.metric == "perplexity"].text) == {"text.txt", "all"}
    assert set(df[df.metric == "perplexity"].method.dropna()) == {"frequency", "bias", "man", "msan", "max_act", "aimer"}
    # workers=2: the pass in two processes (each a share of the variants) gives the same rows
    run_job({**cfg, "workers": 2}, tmp_path / "two")
    two = load(tmp_path / "two")
    cols = ["method", "form", "keep", "layer", "text", "metric"]
    merged = df.fillna({"method": "", "text": ""}).merge(two.fillna({"method": "", "text": ""}), on=cols, how="outer",
                                                         indicator=True, suffixes=("", "_two"))
    assert (merged["_merge"] == "both").all() and len(two) == len(df)
    np.testing.assert_allclose(merged.value_two, merged.value, rtol=1e-5, atol=1e-7)
    import json

    assert json.loads((tmp_path / "two" / "timings.json").read_text())["pass_workers"] == 2
    from moejax.errors import ConfigError

    with pytest.raises(ConfigError, match="no config.json"):
        run_job({**cfg, "model": {"path": str(tmp_path / "nowhere")}}, tmp_path / "bad")


def test_notebook_code_runs_on_a_run(tmp_path, setup):
    import os
    import subprocess
    import sys
    from pathlib import Path

    import nbformat

    from moejax.experiments.runner import run_job

    root = Path(__file__).resolve().parents[1]
    text = tmp_path / "text.txt"
    text.write_text("Sphinx of black quartz, judge my vow. " * 60)
    run_job({"name": "prune_real", "model": {"path": str(setup[0])}, "keep": [8, 4], "scores": ["frequency", "l1"],
             "data": {"calib": [str(text)], "heldout": [str(text)], "seq_len": 32, "calib_tokens": 512,
                      "heldout_tokens": 256, "batch_size": 4}, "prune": {"sequential": True}}, tmp_path / "run")
    nb = nbformat.read(root / "experiments" / "real" / "real.ipynb", as_version=4)
    code = "\n\n".join(c.source for c in nb.cells if c.cell_type == "code")
    env = {**os.environ, "PYTHONPATH": str(root), "MPLBACKEND": "Agg", "MOEJAX_REAL_RESULTS": str(tmp_path / "run"),
           "MOEJAX_REAL_FIGURE": str(tmp_path / "heat.png"), "MOEJAX_REAL_PPL_FIGURE": str(tmp_path / "ppl.png")}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "heat.png").stat().st_size > 5_000 and (tmp_path / "ppl.png").stat().st_size > 5_000


def test_a_selection_leaving_a_token_short_of_top_k_kept_experts_is_refused(tmp_path):
    """Group-limited routing (4 groups of 4, 2 chosen, top-4): l1's 4 kept experts of the first MoE
    layer lie one per group, so a token is given 2 groups holding 2 kept experts and would be
    routed to 2 pruned ones at their full gates. The pass refuses it at that layer, by the rule of
    every variant (moejax.models.variant.check_routable), instead of reporting that model's numbers."""
    from moejax.errors import ConfigError

    path = tmp_path / "src"
    make_checkpoint(path, seed=31, vocab_size=256, n_routed_experts=E, n_group=4, topk_group=2, num_experts_per_tok=4)
    ids = np.random.default_rng(0).integers(0, 256, size=(2, SEQ)).astype(np.int32)
    with pytest.raises(ConfigError, match=r"l1@4: layer 1: keeps \[1, 1, 1, 1\] experts per routing group; "
                                          r"group-limited routing \(n_group=4, topk_group=2\) can give a token groups "
                                          r"holding only 2 kept experts, below num_experts_per_tok=4"):
        evaluate_pruning(open_checkpoint(path), ids, {"a": ids}, ["l1"], [E, 4], batch_size=2)


def numpy_agreement(p_logits, q_logits):
    """ESAP, KL(p || q) and top-1 agreement per position, float64 (moejax.inference.agreement's
    definitions)."""
    def logp(z):
        z = np.asarray(z, np.float64)
        return z - (np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)) + z.max(-1, keepdims=True))
    lp, lq = logp(p_logits), logp(q_logits)
    return (np.minimum(np.exp(lp), np.exp(lq)).sum(-1), (np.exp(lp) * (lp - lq)).sum(-1),
            np.argmax(p_logits, -1) == np.argmax(q_logits, -1))


def test_agreement_rows_match_transformers_on_the_pruned_checkpoint(tmp_path):
    """ESAP, KL and top-1 agreement of a one-shot variant, from the carried pass's chunked head (3
    vocabulary chunks), against numpy on transformers' logits of the source and of the checkpoint
    `moejax prune` writes with the same kept experts (its per-layer kept sets checked to be the
    pass's first; no routing groups, so the written checkpoint routes as the variant does)."""
    import torch
    from transformers import AutoModelForCausalLM

    from moejax.surgery.prune import prune_checkpoint

    path = tmp_path / "src"
    model, _, heldout, df, info = carried_pass(path, 32, (4, 3, 2), ["l1"], [4, 8],
                                               checkpoint=dict(n_routed_experts=8, n_group=1, topk_group=1))
    kept = {l: sorted(int(e) for e in by_name["l1@4"]) for l, by_name in info["kept"].items()}
    record = prune_checkpoint(path, tmp_path / "pruned", score="l1", keep=4)
    assert {int(l): v["kept"] for l, v in record["layers"].items()} == kept
    pruned = AutoModelForCausalLM.from_pretrained(tmp_path / "pruned", torch_dtype=torch.float32).eval()
    variant = df[(df["form"] == "one_shot") & (df.method == "l1") & (df.keep == 4)]
    totals = {"esap": [], "kl": [], "top1_agreement": []}
    for text, ids in heldout.items():
        with torch.no_grad():
            p = model(torch.as_tensor(ids, dtype=torch.long)).logits.float().numpy()[:, :-1]
            q = pruned(torch.as_tensor(ids, dtype=torch.long)).logits.float().numpy()[:, :-1]
        for metric, want in zip(totals, numpy_agreement(p, q)):
            totals[metric].append(want.ravel())
            got = variant[(variant.text == text) & (variant.metric == metric)].value.item()
            assert got == pytest.approx(float(want.mean()), abs=1e-4)
    for metric, values in totals.items():
        got = variant[(variant.text == "all") & (variant.metric == metric)].value.item()
        assert got == pytest.approx(float(np.concatenate(values).mean()), abs=1e-4)
    assert 0.05 < 1 - variant[(variant.text == "all") & (variant.metric == "esap")].value.item()   # it differs
    assert df[(df["form"] == "none") & df.metric.isin(list(totals))].empty   # the reference is not a variant
    full = df[(df.keep == 8) & df.metric.isin(["esap", "top1_agreement"])]
    assert len(full) == 6 and np.allclose(full.value, 1.0, atol=1e-5)   # every expert kept: the same distribution
    assert np.allclose(df[(df.keep == 8) & (df.metric == "kl")].value, 0.0, atol=1e-6)


def test_the_pass_in_shares_equals_the_whole_pass(setup):
    """evaluate_pruning(share=(i, 3)) for i = 0, 1, 2 (what `workers=3` runs, one share per process):
    every variant once, a one-shot merge's two router forms in one share (one clustering), and
    together the whole pass's rows (the rows every share computes alike, from share 0 only), its
    plans in its order, kept sets and clusters; each number within float32 reordering (a variant's
    held-out streams run in calls of other sizes). Pruning, substitution, merging, sequential
    pruning and merging: six units, two a share; the third share's sequential merge has no one-shot
    merge beside it (whose statistics the merges' routing counts were once read from)."""
    from moejax.evaluation.carried import share_of
    from moejax.experiments.prune_real import join_shares
    from moejax.merging.method import parse
    from moejax.variants import VariantSpec

    path, _, calib, heldout = setup[:4]
    kw = dict(merges=(parse("hc_smoe"),), substitutes=("mone",), sequential=True,
              sequential_merges=True, batch_size=4)
    whole, info = evaluate_pruning(open_checkpoint(path), calib, heldout, ["frequency"], [8], **kw)
    parts = [evaluate_pruning(open_checkpoint(path), calib, heldout, ["frequency"], [8],
                              share=(i, 3), **kw) for i in range(3)]
    at = [a for _, p in parts for a in p["at"]]
    assert sorted(at) == list(range(len(info["plans"])))   # every variant in one share
    for _, p in parts:   # one-shot merges: both forms where the clusters are made
        merges = {(v.spec.method, v.spec.keep) for v in p["plans"] if v.spec.merged and not v.spec.sequential}
        for other in parts:
            if other[1] is not p:
                assert not merges & {(v.spec.method, v.spec.keep) for v in other[1]["plans"]
                                     if v.spec.merged and not v.spec.sequential}
    split, joined, timings = join_shares([(pd.DataFrame(r), p, {"pass_s": p["seconds"]}) for r, p in parts], 1.0)
    assert timings["pass_workers"] == 3 and joined["variants"] == info["variants"]
    assert [p.spec for p in joined["plans"]] == [p.spec for p in info["plans"]]
    for mine, theirs in zip(joined["plans"], info["plans"]):
        for layer, lp in theirs.layers.items():
            np.testing.assert_array_equal(mine.layers[layer].routable_E, lp.routable_E)
    assert {l: sorted(d) for l, d in joined["kept"].items()} == {l: sorted(d) for l, d in info["kept"].items()}
    assert joined["clusters"] == info["clusters"]
    cols = ["method", "form", "keep", "layer", "text", "metric"]
    one = pd.DataFrame(whole).fillna({"method": "", "form": "", "text": ""})
    split = split.fillna({"method": "", "form": "", "text": ""})
    assert not split.duplicated(cols).any() and len(split) == len(one)
    merged = one.merge(split, on=cols, how="outer", indicator=True, suffixes=("", "_split"))
    assert (merged["_merge"] == "both").all()
    np.testing.assert_allclose(merged.value_split, merged.value, rtol=1e-5, atol=1e-7)
    assert share_of([VariantSpec("a", 4)], 1, 2) == []
    with pytest.raises(Exception, match=r"share=\(2, 2\); expected \(index, count\) with 0 <= index < count"):
        share_of([], 2, 2)

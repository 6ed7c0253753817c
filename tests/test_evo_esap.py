"""EvoESAP (`moejax.allocation.evo_esap`, `moejax.evaluation.esap_fitness`): the search keeps its
budget, is reproducible and finds the allocation an exhaustive search finds; its fitness of a
candidate equals ESAP computed from a separate forward of that candidate."""

import itertools

import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("transformers")

from hf_fixtures import make_checkpoint  # noqa: E402

from moejax.allocation import ALLOCATIONS, Budget, allocate  # noqa: E402
from moejax.allocation.evo_esap import PATTERNS, evolutionary_search  # noqa: E402
from moejax.errors import ConfigError  # noqa: E402


def test_every_candidate_keeps_the_budget_and_a_seed_repeats_the_search():
    """Over a search on a synthetic fitness every candidate of every generation keeps the total,
    each layer within [top_k, E]; the same seed gives the same history, another seed another."""
    E = {0: 8, 1: 8, 2: 6, 3: 8}
    budget = Budget.of(4, E, 2)
    target = np.array([7, 2, 3, 4])

    def fitness(kept_PL):
        assert kept_PL.shape[1] == 4
        assert (kept_PL.sum(axis=1) == budget.total).all()
        assert ((kept_PL >= 2) & (kept_PL <= np.array([8, 8, 6, 8]))).all()
        return -np.abs(kept_PL - target).sum(axis=1).astype(float)

    method = ALLOCATIONS.parse("evo_esap", generations=12, mutations=3, max_delta=3)
    run = method.search(budget, fitness)
    assert len(run["history"]) == 13 and all(len(h["candidates"]) == max(8, len(PATTERNS)) for h in run["history"])
    assert run == method.search(budget, fitness)
    other = ALLOCATIONS.parse("evo_esap", generations=12, mutations=3, max_delta=3, seed=7).search(budget, fitness)
    assert other["history"] != run["history"]
    counts = allocate(method, budget, None, fitness)
    assert counts == {0: 7, 1: 2, 2: 3, 3: 4}           # the synthetic optimum, reachable at the total 16
    # survivors pass on unchanged, and the best never gets worse
    best = [max(h["scores"]) for h in run["history"]]
    assert best == sorted(best)


def test_bad_settings_and_budgets_are_refused():
    with pytest.raises(ConfigError, match="population=0 must be >= 1"):
        ALLOCATIONS.parse("evo_esap", population=0)
    with pytest.raises(ConfigError, match="survivors=13 exceeds the population"):
        ALLOCATIONS.parse("evo_esap", survivors=13)
    with pytest.raises(ConfigError, match=r"keep=1 per layer must lie in \[top_k, E\] = \[2, 8\]"):
        Budget.of(1, {0: 8, 1: 8}, 2)
    with pytest.raises(ConfigError, match="fitness_sequences=8 holds apart every one of the 8"):
        ALLOCATIONS.parse("evo_esap").held_apart(8)
    with pytest.raises(ConfigError, match="needs a fitness"):
        allocate("evo_esap", Budget.of(4, {0: 8, 1: 8}, 2))
    with pytest.raises(ConfigError, match="unknown allocation 'evo'"):
        ALLOCATIONS.parse("evo")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """DeepSeek-V3 with three MoE layers of 8 experts (top 2, no groups) and fitness ids."""
    from moejax.hf.model_io import load_pretrained, open_checkpoint

    path = tmp_path_factory.mktemp("evo") / "dsv3"
    make_checkpoint(path, seed=11, n_group=1, topk_group=1, num_hidden_layers=4)
    ids = np.random.default_rng(3).integers(0, 96, size=(3, 24)).astype(np.int32)
    return open_checkpoint(path), load_pretrained(path), ids


_FORWARDS = {}


def separate_esap(model, ids, kept: dict) -> float:
    """ESAP of a candidate from the whole model's forward under its masks, float64 numpy."""
    from moejax.models.variant import maps_from_masks

    cfg = model.config
    masks = np.ones((cfg.num_hidden_layers, cfg.n_experts), bool)
    for layer, m in kept.items():
        masks[layer] = m
    forward = _FORWARDS.setdefault(id(model), (model, model.jitted()))[1]   # one compiled forward per model
    ref = np.asarray(forward(jnp.asarray(ids), None).logits_BSV, np.float64)[:, :-1]
    got = np.asarray(forward(jnp.asarray(ids), None, variant=maps_from_masks(masks, cfg)).logits_BSV,
                     np.float64)[:, :-1]
    p = np.exp(ref - ref.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    q = np.exp(got - got.max(-1, keepdims=True))
    q /= q.sum(-1, keepdims=True)
    return float(np.minimum(p, q).sum(-1).mean())


def test_fitness_equals_a_separate_forward_and_the_search_finds_the_exhaustive_best(tiny):
    """On three MoE layers of 8 experts at keep 4 (top 2), every allocation's ESAP from one walk
    equals ESAP from the whole model's forward under that candidate's masks; the search (seeded,
    a few generations) returns the allocation an exhaustive search ranks first."""
    from moejax.evaluation.esap_fitness import EsapFitness

    ckpt, model, ids = tiny
    layers = list(ckpt.config.moe_layers)
    assert layers == [1, 2, 3]
    rankings = {l: np.random.default_rng(l).permutation(8).astype(float) for l in layers}
    fitness = EsapFitness(ckpt, ids, rankings, layers, batch_size=2)
    every = np.asarray([c for c in itertools.product(range(2, 9), repeat=3) if sum(c) == 12])
    scores = fitness(every)
    assert fitness.evaluated == len(every) and np.isfinite(scores).all() and (scores <= 1 + 1e-6).all()
    for i in (0, int(np.argmax(scores)), int(np.argmin(scores)), len(every) // 2):
        kept = fitness.kept(every[i:i + 1])[0]
        np.testing.assert_allclose(scores[i], separate_esap(model, ids, kept), rtol=0, atol=2e-6)
    assert np.isclose(fitness(np.asarray([[8, 8, 8 - 4]]))[0], separate_esap(
        model, ids, fitness.kept(np.asarray([[8, 8, 4]]))[0]), atol=2e-6)
    best = every[int(np.argmax(scores))]
    assert np.sort(scores)[-1] - np.sort(scores)[-2] > 1e-6        # a unique best to find
    method = ALLOCATIONS.parse("evo_esap", generations=6, mutations=2, max_delta=3)
    counts = allocate(method, Budget.of(4, {l: 8 for l in layers}, 2), rankings, fitness)
    assert [counts[l] for l in layers] == best.tolist()


def test_carried_pass_searches_on_tokens_held_apart(tiny):
    """evaluate_pruning(allocation=evo_esap): the scores come from the calibration sequences before
    the held-apart ones, each (score, keep) searches with the ESAP of the last ones, and its counts
    equal the same search run directly on those statistics; the pruned variant keeps that many."""
    from moejax.evaluation.carried import evaluate_pruning
    from moejax.evaluation.esap_fitness import EsapFitness
    from moejax.scoring.observe import calibrate

    ckpt, model, ids = tiny
    calib = np.random.default_rng(8).integers(0, 96, size=(5, 24)).astype(np.int32)
    method = ALLOCATIONS.parse("evo_esap", generations=2, fitness_sequences=2)
    rows, info = evaluate_pruning(ckpt, calib, {"a": ids[:2]}, ["frequency"], [4], allocation=method, batch_size=2)
    stats = calibrate(model, [(calib[:3], None)])
    ranking = {l: st.counts_E for l, st in stats.items()}
    layers = sorted(ranking)
    want = allocate(method, Budget.of(4, {l: 8 for l in layers}, 2), ranking,
                    EsapFitness(ckpt, calib[3:], ranking, layers, batch_size=2))
    assert info["layer_counts"]["frequency@4"] == want
    assert info["allocation_search"]["frequency@4"]["candidates"] > 1
    kept = {l: len(k["frequency@4"]) for l, k in info["kept"].items()}
    assert kept == want and info["calib_tokens"] == calib[:3].size
    with pytest.raises(ConfigError, match="fitness_sequences=8 holds apart every one of the 5"):
        evaluate_pruning(ckpt, calib, {"a": ids[:2]}, ["frequency"], [4], allocation="evo_esap")


def test_moejax_prune_searches_and_the_output_computes_the_candidate(tiny, tmp_path, capsys):
    """`moejax prune --allocation evo_esap --tokens`: the counts are the search's on those tokens
    (the same search run directly), recorded with its fitness; the checkpoint (per-layer counts)
    loads in moejax and computes the candidate's masked forward; --text without evo_esap is refused."""
    from moejax.cli import main
    from moejax.evaluation.esap_fitness import EsapFitness
    from moejax.hf.model_io import load_pretrained

    ckpt, model, ids = tiny
    tokens = tmp_path / "fit.npy"
    np.save(tokens, ids)
    dst = tmp_path / "pruned"
    main(["prune", str(ckpt.path), str(dst), "--score", "l1", "--keep", "4", "--allocation", "evo_esap",
          "--allocation-setting", "generations=2", "--allocation-setting", "fitness_sequences=1", "--tokens", str(tokens),
          "--batch-size", "2"])
    import json
    record = json.loads((dst / "pruning.json").read_text())
    assert record["allocation"] == "evo_esap" and record["allocation_settings"]["generations"] == 2
    layers = [1, 2, 3]
    l1 = {l: np.abs(np.asarray(model.model.layers[l].mlp.router[...], np.float64)).sum(1) for l in layers}
    want = allocate(ALLOCATIONS.parse("evo_esap", generations=2, fitness_sequences=1), Budget.of(4, {l: 8 for l in layers}, 2),
                    l1, EsapFitness(ckpt, ids, l1, layers, batch_size=2))
    got = {int(l): len(v["kept"]) for l, v in record["layers"].items()}
    assert got == want and record["allocation_search"]["fitness"]["tokens"] == ids.size
    pruned = load_pretrained(dst)
    masks = np.ones((4, 8), bool)
    for l, v in record["layers"].items():
        masks[int(l)] = np.isin(np.arange(8), v["kept"])
    from moejax.models.variant import maps_from_masks
    np.testing.assert_allclose(np.asarray(pruned(jnp.asarray(ids)).logits_BSV),
                               np.asarray(model(jnp.asarray(ids), variant=maps_from_masks(masks, model.config)).logits_BSV),
                               rtol=1e-4, atol=1e-5)
    assert main(["prune", str(ckpt.path), str(tmp_path / "x"), "--score", "l1", "--keep", "4", "--tokens",
                 str(tokens)]) != 0
    assert "are read by `moejax prune --substitute` and --allocation evo_esap only" in capsys.readouterr().err
    assert main(["prune", str(ckpt.path), str(tmp_path / "x"), "--score", "l1", "--keep", "4", "--allocation",
                 "evo_esap"]) != 0
    assert "give them with --text or --tokens" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("name", ["shape", "evo_esap"])
def test_moejax_merge_allocates_by_shape_and_evo_esap(tiny, tmp_path, name):
    """`moejax merge --allocation shape|evo_esap`: the cluster counts equal the allocation run
    directly on the pass's statistics (shape: the Shapley values of the calibration tokens;
    evo_esap: frequency rankings on all but the held-apart sequences, ESAP on those)."""
    import json

    from moejax.evaluation.esap_fitness import EsapFitness
    from moejax.merging.method import parse
    from moejax.scoring.observe import calibrate
    from moejax.scoring.scores import compute_scores
    from moejax.surgery.merge import merge_checkpoint

    ckpt, model, _ = tiny
    calib = np.random.default_rng(9).integers(0, 96, size=(4, 24)).astype(np.int32)
    tokens = tmp_path / "calib.npy"
    np.save(tokens, calib)
    method = ALLOCATIONS.parse(name, **({"generations": 2, "fitness_sequences": 1} if name == "evo_esap" else {}))
    record = merge_checkpoint(ckpt.path, tmp_path / "merged", method=parse("m_smoe"), keep=4, tokens=tokens,
                              allocation=method, batch_size=2)
    got = {int(l): len(v["clusters"]) for l, v in record["layers"].items()}
    layers, E = [1, 2, 3], {1: 8, 2: 8, 3: 8}
    if name == "shape":
        stats = calibrate(model, [(calib, None)])
        want = allocate(method, Budget.of(4, E, 2), {l: compute_scores(stats[l], ["shapley"])["shapley"] for l in layers})
    else:
        stats = calibrate(model, [(calib[:3], None)])
        freq = {l: stats[l].counts_E for l in layers}
        want = allocate(method, Budget.of(4, E, 2), freq, EsapFitness(ckpt, calib[3:], freq, layers, batch_size=2))
        assert record["allocation_search"]["candidates"] > 1
    assert got == want and record["allocation"] == name
    assert json.loads((tmp_path / "merged" / "pruning.json").read_text())["allocation_settings"] == method.settings()


def test_the_experiments_take_an_allocation_with_its_settings():
    """`allocation=evo_esap allocations.evo_esap.generations=3` becomes the object; an unknown
    allocation or setting is refused naming it, before any work."""
    from moejax.experiments.prune_real import PruneRealConfig
    from moejax.experiments.settings import typed_settings

    got = typed_settings(PruneRealConfig, {"allocation": "evo_esap", "allocations": {
        "evo_esap": {"generations": 3}, "uniform": {}}}, "prune_real")["allocation"]
    assert got == ALLOCATIONS.parse("evo_esap", generations=3)
    with pytest.raises(ConfigError, match="prune_real: unknown allocation 'evo'"):
        typed_settings(PruneRealConfig, {"allocation": "evo"}, "prune_real")
    with pytest.raises(ConfigError, match="prune_real: allocation evo_esap: unknown setting"):
        typed_settings(PruneRealConfig, {"allocation": "evo_esap", "allocations": {"evo_esap": {"pop": 3}}}, "prune_real")


def test_moejax_prune_allocates_by_the_scores_files_shapley(tiny, tmp_path):
    """`moejax prune --score reap --scores-file S --allocation shape`: the counts are SHAPE's
    coverage of the file's `shapley` column (which `moejax score` writes), the ranking REAP's."""
    import json

    import pandas as pd

    from moejax.allocation import layer_counts
    from moejax.scoring.score_checkpoint import score_checkpoint
    from moejax.surgery.prune import prune_checkpoint

    ckpt, _, _ = tiny
    calib = tmp_path / "calib.npy"
    np.save(calib, np.random.default_rng(5).integers(0, 96, size=(4, 24)).astype(np.int32))
    score_checkpoint(ckpt.path, tokens=calib, out=tmp_path / "s.parquet", scores=["reap", "shapley"])
    df = pd.read_parquet(tmp_path / "s.parquet")
    phi = {int(l): g.sort_values("expert").value.to_numpy() for l, g in df[df.score == "shapley"].groupby("layer")}
    record = prune_checkpoint(ckpt.path, tmp_path / "p", score="reap", scores_file=tmp_path / "s.parquet", keep=4,
                              allocation="shape")
    got = {int(l): len(v["kept"]) for l, v in record["layers"].items()}
    assert got == layer_counts(phi, 4, 2, "shape") and sum(got.values()) == 12
    assert json.loads((tmp_path / "p" / "pruning.json").read_text())["allocation"] == "shape"


def test_a_search_whose_every_candidate_is_unroutable_is_refused():
    """`EvoEsap.searched`: when the fitness scores no candidate finitely (each unroutable under the
    routing groups), the search is refused rather than returning one of them; otherwise it returns
    the best counts and the fitness's candidates and seconds spent in this search."""
    class Fitness:
        evaluated, seconds = 5, 1.0

        def __init__(self, value):
            self.value = value

        def __call__(self, kept):
            self.evaluated += len(kept)
            return np.full(len(kept), self.value)

    method, budget = ALLOCATIONS.parse("evo_esap", generations=1), Budget.of(4, {0: 8, 1: 8}, 2)
    with pytest.raises(ConfigError, match="no candidate it scored keeps every token routable"):
        method.searched(budget, Fitness(-np.inf))
    counts, record = method.searched(budget, Fitness(0.5))
    assert sum(counts.values()) == 8 and record["best_esap"] == 0.5 and record["generations"] == 1
    assert record["candidates"] == len({tuple(c) for h in method.search(budget, Fitness(0.5))["history"]
                                        for c in h["candidates"]})

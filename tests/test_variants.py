"""moejax.variants: the spec (what was asked), the plan (what was decided) and its one conversion to
expert maps; old results tables (score/mode columns) still load."""

import json

import numpy as np
import pandas as pd
import pytest

from moejax.errors import ConfigError
from moejax.merging.layer import LayerMerge
from moejax.merging.method import parse
from moejax.variants import Kept, Merged, Substituted, VariantPlan, VariantSpec


def test_spec_names_forms_and_rows():
    assert VariantSpec("reap", 8).name == "reap@8"
    assert VariantSpec("reap", 8, "sequential").name == "sequential:reap@8"
    assert VariantSpec("hc_smoe", 4, "shrunk").merged and not VariantSpec("reap", 4).merged
    assert VariantSpec.unpruned().row() == dict(method=None, form="none", keep=None)
    assert VariantSpec("mone", 6, "substituted").row() == dict(method="mone", form="substituted", keep=6)
    with pytest.raises(ConfigError, match="form 'oneshot'"):
        VariantSpec("reap", 8, "oneshot")
    with pytest.raises(ConfigError, match="no method"):
        VariantSpec(None, 8, "one_shot")


def test_spec_from_rows():
    assert VariantSpec.from_row(dict(method="l1", form="tied", keep=4.0)) == VariantSpec("l1", 4, "tied")
    assert VariantSpec.from_row(pd.Series(dict(method=None, form="none", keep=np.nan))) == VariantSpec.unpruned()


def test_records_of_every_schema_read_back():
    """A checkpoint's record (pruning.json; reroute.json's variant) in each schema written before the
    spec (prune: `score`; merge: `method`, `router`, `sequential`; --substitute: `form` "substitute")
    and in today's (`VariantSpec.record`) names its spec; a dict that is none of them is refused."""
    import dataclasses

    old_prune = {"source": "/ckpt", "fingerprint": "abc", "score": "reap", "keep": 4, "kept": {"1": [0, 2, 5, 7]}}
    old_merge = {"source": "/ckpt", "method": "ream", "router": "shrunk", "sequential": False, "keep": 0.5,
                 "score": "reap", "group_size": 16, "ream_tokens": 2048, "seed": 0, "allocation": "uniform"}
    old_sequential_merge = {**old_merge, "method": "hc_smoe", "router": "tied", "sequential": True, "keep": 3,
                            "hc_method": "average"}
    old_substitute = {"source": "/ckpt", "method": "mone", "form": "substitute", "score": "mone", "keep": 3,
                      "format": 1}
    for record, want in ((old_prune, VariantSpec("reap", 4, "one_shot")),
                         (old_merge, VariantSpec("ream", 0.5, "shrunk")),
                         (old_sequential_merge, VariantSpec("hc_smoe", 3, "sequential_tied")),
                         (old_substitute, VariantSpec("mone", 3, "substituted"))):
        got = VariantSpec.from_record(record)
        assert got == want, record
        assert (got.method, got.keep, got.form, got.rerouted) == (want.method, want.keep, want.form, False), record
    ream = parse("ream", group_size=8)
    for spec, settings in ((VariantSpec("reap", 4, "one_shot"), {}),
                           (VariantSpec("ream", 0.5, "shrunk"), ream.settings()),
                           (VariantSpec("ream", 0.5, "sequential_shrunk"), ream.settings()),
                           (VariantSpec("hc_smoe", None, "shrunk"), parse("hc_smoe").settings()),
                           (VariantSpec("mone", 3, "substituted"), {}),
                           (VariantSpec("ream", 6, "shrunk", rerouted=True), ream.settings()),
                           (VariantSpec.unpruned(), {})):
        record = {"source": "/ckpt", "seed": 0, **spec.record(settings)}
        assert record["settings"] == settings and record["rerouted"] is spec.rerouted
        got = VariantSpec.from_record(json.loads(json.dumps(record)))   # as read back from pruning.json
        assert got == spec and (got.method, got.keep, got.form, got.rerouted) == (
            spec.method, spec.keep, spec.form, spec.rerouted), spec
    rerouted = dataclasses.replace(VariantSpec("ream", 0.5, "shrunk"), rerouted=True)
    assert VariantSpec.from_record(rerouted.record(ream.settings())).rerouted is True
    for bad in ({"keep": 4, "seed": 0}, {"method": "hc_smoe", "keep": 4}, {"method": "reap", "form": "pruned", "keep": 4},
                {}):
        with pytest.raises(ConfigError, match="not a moejax checkpoint record"):
            VariantSpec.from_record(bad)
    with pytest.raises(ConfigError, match="must be a JSON object"):
        VariantSpec.from_record(["reap", 4])


def test_plans_become_expert_maps_in_one_place():
    kept = np.array([True, False, True, True])
    labels, leaders = np.array([0, 0, 1, 2]), np.array([0, 2, 3])
    weights = {k: np.arange(3 * 2 * 2, dtype=np.float32).reshape(3, 2, 2) for k in ("gate", "up", "down")}
    merge = LayerMerge(parse("hc_smoe"), labels, leaders, weights)
    plan = VariantPlan(VariantSpec("x", 3, "one_shot"), {1: Kept(kept)})
    (em,) = plan.expert_maps().values()
    assert np.asarray(em.mask_E).tolist() == kept.tolist() and em.rows_E is None and em.weights is None
    assert plan.kept() == {1: [0, 2, 3]}
    tied, shrunk = Merged(merge, "tied"), Merged(merge, "shrunk")
    assert tied.routable_E.all() and shrunk.routable_E.tolist() == [True, False, True, True]
    em = VariantPlan(VariantSpec("hc_smoe", 3, "shrunk"), {2: shrunk}).expert_maps()[2]
    assert np.asarray(em.rows_E).tolist() == labels.tolist() and np.asarray(em.mask_E).tolist() == [1, 0, 1, 1]
    assert shrunk.experts() == [0, 2, 3]
    assert VariantPlan(VariantSpec.unpruned()).expert_maps() is None
    with pytest.raises(ConfigError, match="without its merged weights"):
        Merged(LayerMerge(parse("hc_smoe"), labels, leaders, None), "tied").expert_map()
    with pytest.raises(ConfigError, match="form"):
        Merged(merge, "one_shot")
    sub = Substituted(kept, np.ones((4, 2)))
    assert sub.routable_E.all() and sub.experts() == [0, 2, 3]


def test_old_results_tables_load_with_todays_columns(tmp_path):
    """A prune_real job folder written before the spec (columns mode, score) loads with form and
    method, beside a new one; a scores table (its own `score` column, no `mode`) is left alone."""
    from moejax.results import load

    old, new, scores = tmp_path / "sweep" / "0", tmp_path / "sweep" / "1", tmp_path / "scores"
    for d in (old, new, scores):
        d.mkdir(parents=True)
        (d / "status.json").write_text(json.dumps({"status": "completed"}))
    pd.DataFrame([dict(mode="none", score=None, keep=None, metric="perplexity", value=5.0),
                  dict(mode="one_shot", score="reap", keep=4, metric="perplexity", value=6.0)]
                 ).to_parquet(old / "results.parquet")
    pd.DataFrame([dict(method="l1", form="tied", keep=4, metric="perplexity", value=7.0)]
                 ).to_parquet(new / "results.parquet")
    df = load(tmp_path / "sweep")
    assert "mode" not in df.columns and "score" not in df.columns
    got = df.sort_values("value")
    assert got.form.tolist() == ["none", "one_shot", "tied"] and got.method.tolist()[1:] == ["reap", "l1"]
    assert got.method.isna().tolist() == [True, False, False]
    pd.DataFrame([dict(layer=1, expert=0, score="reap", value=1.0)]).to_parquet(scores / "results.parquet")
    assert "score" in load(scores).columns


def test_every_plan_of_the_carried_pass_reproduces_its_perplexity_in_the_forward(tmp_path):
    """The plans evaluate_pruning returns (pruned, merged tied and shrunk, substituted) are what the
    pass measured: the whole model's forward under `plan.expert_maps()` gives each variant's
    perplexity. A substitution keeping every expert is the unpruned model exactly; its constants
    are each expert's mean routed output of an independent whole-model calibration."""
    import jax.numpy as jnp
    from hf_fixtures import make_checkpoint

    from moejax.evaluation.carried import evaluate_pruning
    from moejax.inference.nll import next_token_nll
    from moejax.hf.model_io import load_pretrained, open_checkpoint
    from moejax.scoring.observe import calibrate

    path = tmp_path / "dsv3"
    make_checkpoint(path, seed=5, n_group=1, topk_group=1)
    model = load_pretrained(path)
    E = model.config.n_experts
    calib = np.random.default_rng(1).integers(0, 96, size=(4, 20)).astype(np.int32)
    ids = np.random.default_rng(4).integers(0, 96, size=(3, 20)).astype(np.int32)
    rows, info = evaluate_pruning(open_checkpoint(path), calib, {"a": ids}, ["frequency"], [E, 3],
                                  merges=(parse("hc_smoe"),), substitutes=("frequency",), batch_size=4,
                                  merged_weights=True)
    df = pd.DataFrame(rows)
    ppl = {VariantSpec.from_row(r): r.value for r in df[(df.metric == "perplexity") & (df.text == "a")].itertuples()}
    forward = model.jitted()
    specs = [p.spec for p in info["plans"]]
    assert VariantSpec("frequency", 3, "substituted") in specs and VariantSpec("hc_smoe", 3, "shrunk") in specs
    assert ppl[VariantSpec("frequency", E, "substituted")] == ppl[VariantSpec.unpruned()]
    for plan in info["plans"]:
        lg = forward(jnp.asarray(ids), None, plan.expert_maps()).logits_BSV
        want = float(np.exp(np.mean(np.asarray(next_token_nll(lg, jnp.asarray(ids))))))
        assert ppl[plan.spec] == pytest.approx(want, rel=1e-4), plan.spec
    stats = calibrate(model, [(calib, None)])
    sub = next(p for p in info["plans"] if p.spec == VariantSpec("frequency", 3, "substituted"))
    for layer, layer_plan in sub.layers.items():
        np.testing.assert_allclose(layer_plan.constants_EH, stats[layer].mean_output_EH, rtol=1e-4, atol=1e-6)
        assert sorted(layer_plan.experts()) == info["kept"][layer]["substituted:frequency@3"]
    assert ppl[VariantSpec("frequency", 3, "substituted")] != ppl[VariantSpec("frequency", 3, "one_shot")]


def test_the_one_check_keeps_and_checks_novices():
    """check_variant passes a substitution's novices and constants through (the forward would
    otherwise run it as a plain mask) and refuses malformed ones by layer."""
    import jax.numpy as jnp

    from moejax.models.deepseek_v3 import DeepseekV3Config
    from moejax.models.deepseek_v3.presets import TINY
    from moejax.moe.expert_map import ExpertMap
    from moejax.models.variant import check_variant

    cfg = DeepseekV3Config.from_dict(TINY)
    E, H, layer = cfg.n_experts, cfg.hidden_size, cfg.moe_layers[0]
    novice = np.zeros(E, bool)
    novice[:3] = True
    constants = np.random.default_rng(0).normal(size=(E, H)).astype(np.float32)
    em = ExpertMap(jnp.ones(E, bool), novice_E=novice, constants_EH=constants)
    got = check_variant({layer: em}, cfg)[layer]
    assert np.asarray(got.novice_E).tolist() == novice.tolist()
    np.testing.assert_array_equal(np.asarray(got.constants_EH), constants)
    with pytest.raises(ConfigError, match=f"layer {layer}: novice_E and constants_EH go together"):
        check_variant({layer: em._replace(constants_EH=None)}, cfg)
    with pytest.raises(ConfigError, match=r"constants_EH must be finite floats"):
        check_variant({layer: em._replace(constants_EH=np.full((E, H), np.nan, np.float32))}, cfg)
    with pytest.raises(ConfigError, match=r"novice_E must be bool"):
        check_variant({layer: em._replace(novice_E=novice.astype(int))}, cfg)


def test_new_methods_settings_are_refused_before_any_work(tmp_path):
    """prune_real / eval_tasks: unknown substitutes, REAM's signed centroid score and a group size
    that cannot hold every expert are refused by name from config.json alone."""
    from moejax.experiments.eval_tasks import EvalTasksConfig
    from moejax.experiments.prune_real import PruneRealConfig
    from moejax.models.deepseek_v3.presets import TINY

    (tmp_path / "config.json").write_text(json.dumps(TINY))   # E = 32, top 4
    ok = PruneRealConfig.from_mapping({"path": str(tmp_path), "keep": [8], "merges": ["ream"], "substitutes": "mone"})
    assert ok.substitutes == ("mone",) and ok.merges == (parse("ream"),) and ok.merges[0].group_size == 16
    cases = [({"substitutes": ["nope"]}, "unknown score"),
             ({"substitutes": ["mone", "mone"]}, "more than once"),
             ({"merges": ["ream"], "merge": {"ream": {"score": "signed"}}},
              r"score \(--score, merge\.ream\.score\) 'signed'"),
             ({"merges": ["ream"], "keep": [4], "merge": {"ream": {"group_size": 4}}}, "cannot hold all 32"),
             ({"merges": ["ream"], "merge": {"ream": {"group_size": -1}}}, "group_size=-1")]
    for over, match in cases:
        with pytest.raises(ConfigError, match=match):
            PruneRealConfig.from_mapping({"path": str(tmp_path), "keep": [8], **over})
    with pytest.raises(ConfigError, match="eval_tasks: .*cannot hold all 32"):
        EvalTasksConfig.from_mapping({"path": str(tmp_path), "keep": [4], "merges": ["ream"],
                                      "merge": {"ream": {"group_size": 4}}})


def test_sequential_merges_merge_each_layer_on_the_model_merged_up_to_it(tmp_path):
    """prune_real's sequential_merges (REAM's sequential mode): a sequential merge's layer l is
    clustered and merged on the router inputs of the whole model's forward with its merges of the
    layers before l applied (`return_moe_inputs`, an independent path), REAM's scores included;
    its plan reproduces its perplexity in the forward; at the first MoE layer it is the one-shot
    merge, and at the next it is not."""
    import jax.numpy as jnp
    from hf_fixtures import make_checkpoint

    from moejax.evaluation.carried import evaluate_pruning
    from moejax.inference.nll import next_token_nll
    from moejax.hf.model_io import load_pretrained, open_checkpoint
    from moejax.merging.calibration import merge_stats
    from moejax.merging.layer import merge_layer, merge_stats_options
    from moejax.merging.method import MergeContext
    from moejax.scoring.observe import accumulate_layer
    from moejax.scoring.scores import StatsAccumulator, compute_scores

    path = tmp_path / "dsv3"
    make_checkpoint(path, seed=9, n_group=1, topk_group=1)
    model = load_pretrained(path)
    calib = np.random.default_rng(2).integers(0, 96, size=(4, 20)).astype(np.int32)
    ids = np.random.default_rng(3).integers(0, 96, size=(3, 20)).astype(np.int32)
    with pytest.raises(ConfigError, match="merges is empty"):
        evaluate_pruning(open_checkpoint(path), calib, {"a": ids}, ["frequency"], [3], sequential_merges=True)
    rows, info = evaluate_pruning(open_checkpoint(path), calib, {"a": ids}, ["frequency"], [3],
                                  merges=(parse("ream"), parse("hc_smoe")), sequential_merges=True, batch_size=4,
                                  merged_weights=True)
    df = pd.DataFrame(rows)
    ppl = {VariantSpec.from_row(r): r.value for r in df[(df.metric == "perplexity") & (df.text == "a")].itertuples()}
    plans = {p.spec: p for p in info["plans"]}
    forward = model.jitted()
    first, second = model.config.moe_layers
    for method in ("ream", "hc_smoe"):
        for router in ("tied", "shrunk"):
            spec = VariantSpec(method, 3, f"sequential_{router}")
            plan = plans[spec]
            assert spec.sequential and spec.router == router and ppl[spec] != ppl[VariantSpec(method, 3, router)]
            for layer in (first, second):
                before = {l: em for l, em in plan.expert_maps().items() if l < layer}
                z = forward(jnp.asarray(calib), None, before or None, return_moe_inputs=True).moe_inputs[layer]
                moe = model.model.layers[layer].mlp
                acc = StatsAccumulator(moe.router.shape[0], moe.router.shape[1])
                accumulate_layer(moe, [z], [None], acc, outputs=False)
                reap = compute_scores(acc.stats(np.asarray(moe.router[...]), moe.balance_bias()), ["reap"])["reap"]
                m = parse(method)
                stats = merge_stats(moe, [z], [None], **merge_stats_options([m]))
                want = merge_layer(m, 3, MergeContext.of(stats, scores_E=reap), moe.expert_weights())
                got = plan.layers[layer].merge
                assert got.labels_E.tolist() == want.labels_E.tolist(), (spec, layer)
                for k in want.weights:
                    np.testing.assert_allclose(got.weights[k], want.weights[k], rtol=1e-4, atol=1e-6)
                one_shot = plans[VariantSpec(method, 3, router)].layers[layer].merge
                same = one_shot.labels_E.tolist() == got.labels_E.tolist() and all(
                    np.allclose(one_shot.weights[k], got.weights[k], rtol=1e-6) for k in got.weights)
                assert same == (layer == first), (spec, layer)
            assert info["clusters"][second][spec.name] == plan.layers[second].merge.clusters()
            lg = forward(jnp.asarray(ids), None, plan.expert_maps()).logits_BSV
            want_ppl = float(np.exp(np.mean(np.asarray(next_token_nll(lg, jnp.asarray(ids))))))
            assert ppl[spec] == pytest.approx(want_ppl, rel=1e-4), spec


def test_a_rerouted_spec_and_the_router_override_check():
    """A rerouted variant is its own spec (name, row column, read back; old rows without the column
    are not rerouted); the one check passes a variant's router weights through and refuses bad ones."""
    import jax.numpy as jnp

    from moejax.models.deepseek_v3 import DeepseekV3Config
    from moejax.models.deepseek_v3.presets import TINY
    from moejax.moe.expert_map import ExpertMap
    from moejax.models.variant import check_variant

    spec = VariantSpec("reap", 8, "one_shot", rerouted=True)
    assert spec.name == "reap@8+rerouted" and spec.row()["rerouted"] is True
    assert VariantSpec.from_row(spec.row()) == spec
    assert VariantSpec.from_row(dict(method="reap", form="one_shot", keep=8, rerouted=float("nan"))).rerouted is False
    assert "rerouted" not in VariantSpec("reap", 8).row()
    with pytest.raises(ConfigError, match="not rerouted"):
        VariantSpec(None, None, "none", rerouted=True)
    cfg = DeepseekV3Config.from_dict(TINY)
    E, H, layer = cfg.n_experts, cfg.hidden_size, cfg.moe_layers[0]
    router = np.random.default_rng(0).normal(size=(E, H)).astype(np.float32)
    got = check_variant({layer: ExpertMap(jnp.ones(E, bool), router_EH=router)}, cfg)[layer]
    np.testing.assert_array_equal(np.asarray(got.router_EH), router)
    for bad in (router[:, :-1], np.full((E, H), np.inf, np.float32)):
        with pytest.raises(ConfigError, match=f"layer {layer}: router_EH must be finite floats"):
            check_variant({layer: ExpertMap(jnp.ones(E, bool), router_EH=bad)}, cfg)

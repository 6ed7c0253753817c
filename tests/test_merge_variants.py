"""Merged variants (issue 18) through the forward, the carried evaluation and `moejax merge`:

- the `tied` form's logits equal a model whose experts are replaced in place by their cluster's
  merged expert; the `shrunk` form equals that model pruned to the cluster leaders;
- a merge with every cluster a singleton reproduces the unpruned model exactly;
- `evaluate_pruning(merges=...)`: perplexities equal the whole model's forward under the same
  variant; keep=E gives the unpruned numbers exactly;
- a `moejax merge` checkpoint loads in transformers and equals moejax's evaluation of the same
  variant on the source; everything not merged is the source's bytes.
"""

import json

import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("transformers")

from family_fixtures import make_family_checkpoint  # noqa: E402
from hf_fixtures import batch, make_checkpoint  # noqa: E402

from flax import nnx  # noqa: E402

from moejax.errors import ConfigError, MoejaxError  # noqa: E402
from moejax.hf.checkpoint_reader import CheckpointReader  # noqa: E402
from moejax.hf.model_io import load_pretrained, open_checkpoint  # noqa: E402
from moejax.merging.calibration import merge_stats  # noqa: E402
from moejax.merging.layer import merge_clusters, merge_layer  # noqa: E402
from moejax.nll import next_token_nll  # noqa: E402

E = 8


@pytest.fixture(scope="module")
def dsv3(tmp_path_factory):
    """DeepSeek-V3 (sigmoid router, balance bias, groups, shared experts), calibration ids."""
    path = tmp_path_factory.mktemp("merge") / "dsv3"
    make_checkpoint(path, seed=5, n_group=1, topk_group=1)
    model = load_pretrained(path)
    calib = np.random.default_rng(1).integers(0, 96, size=(4, 20)).astype(np.int32)
    return path, model, calib


def layer_merges(model, calib, method, keep):
    """{MoE layer: LayerMerge} from the unpruned model's router inputs on `calib` (in memory)."""
    out = model.jitted()(jnp.asarray(calib), None, return_moe_inputs=True)
    merges = {}
    for l, z in out.moe_inputs.items():
        moe = model.model.layers[l].mlp
        merges[l] = merge_layer(method, keep, merge_stats(moe, [z], [None]), moe.expert_weights())
    return merges


def replaced_in_place(model, merges):
    """A copy of the model whose expert e holds its cluster's merged expert (every slot pointing at it)."""
    other = nnx.clone(model)
    for l, lm in merges.items():
        moe = other.model.layers[l].mlp
        for key, attr in (("gate", "experts_gate"), ("up", "experts_up"), ("down", "experts_down")):
            getattr(moe, attr)[...] = jnp.asarray(lm.weights[key][lm.labels_E])
    return other


_JITTED = {}


def logits(model, ids, mask, variant=None):
    """The model's jitted forward (one per model, kept: each variant kind compiles once)."""
    forward = _JITTED.setdefault(id(model), (model, model.jitted()))[1]
    return np.asarray(forward(jnp.asarray(ids), jnp.asarray(mask), variant).logits_BSV)


@pytest.mark.slow  # the default run covers both forms against transformers (lm-eval backend test, moejax merge test)
@pytest.mark.parametrize("method", ["hc_smoe", "m_smoe"])
def test_tied_equals_experts_replaced_in_place_and_shrunk_equals_pruning_to_leaders(dsv3, method):
    _, model, calib = dsv3
    merges = layer_merges(model, calib, method, 3)
    ids, mask = batch(96, seed=2)
    in_place = replaced_in_place(model, merges)
    tied = logits(model, ids, mask, {l: lm.expert_map("tied") for l, lm in merges.items()})
    np.testing.assert_allclose(tied, logits(in_place, ids, mask), atol=2e-5, rtol=1e-5)
    unpruned = logits(model, ids, mask)
    assert np.abs(tied - unpruned).max() > 1e-3  # merging 8 experts into 3 changes the model
    masks = np.ones((model.config.num_hidden_layers, E), bool)
    for l, lm in merges.items():
        masks[l] = lm.kept_E("shrunk")
        assert sorted(lm.leaders.tolist()) == np.flatnonzero(masks[l]).tolist()
    shrunk = logits(model, ids, mask, {l: lm.expert_map("shrunk") for l, lm in merges.items()})
    np.testing.assert_allclose(shrunk, logits(in_place, ids, mask, jnp.asarray(masks)), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("method", ["hc_smoe", "m_smoe"])
def test_every_cluster_a_singleton_reproduces_the_unpruned_model_exactly(dsv3, method):
    _, model, calib = dsv3
    merges = layer_merges(model, calib, method, E)
    ids, mask = batch(96, seed=3)
    unpruned = logits(model, ids, mask)
    for form in ("tied", "shrunk"):
        got = logits(model, ids, mask, {l: lm.expert_map(form) for l, lm in merges.items()})
        np.testing.assert_array_equal(got, unpruned)


@pytest.fixture(scope="module")
def merged_qwen3(tmp_path_factory):
    root = tmp_path_factory.mktemp("merged")
    src = root / "src"
    hf = make_family_checkpoint("qwen3_moe", src, seed=9)
    tokens = root / "calib.npy"
    np.save(tokens, np.random.default_rng(6).integers(0, 96, size=(5, 24)).astype(np.int32))
    return root, src, hf, tokens


@pytest.mark.parametrize("method", [pytest.param("hc_smoe", marks=pytest.mark.slow), "m_smoe"])
def test_merged_checkpoint_loads_in_transformers_and_equals_the_shrunk_variant(merged_qwen3, method):
    import torch
    import transformers

    from moejax.cli import main

    root, src, _, tokens = merged_qwen3
    dst = root / f"merged_{method}"
    assert main(["merge", str(src), str(dst), "--method", method, "--keep", "4", "--tokens", str(tokens)]) == 0
    record = json.loads((dst / "pruning.json").read_text())
    config = json.loads((dst / "config.json").read_text())
    assert config.get("num_experts", config.get("num_local_experts")) == 4 and record["method"] == method and record["router"] == "shrunk"
    source = load_pretrained(src)
    # the clusters are the in-memory merge's (the streamed pass equals the in-memory one)
    calib = np.load(tokens)
    merges = layer_merges(source, calib, method, 4)
    variant = {}
    for l, lm in merges.items():
        layer = record["layers"][str(l)]
        assert layer["kept"] == sorted(lm.leaders.tolist())
        assert sorted(map(sorted, layer["clusters"])) == sorted(map(sorted, lm.clusters()))
        labels = np.empty(E, np.int64)
        for c, members in enumerate(layer["clusters"]):
            labels[members] = c
        np.testing.assert_array_equal(merge_clusters(method, labels, layer["counts"],
                                                     source.model.layers[l].mlp.expert_weights()).weights["gate"][
            np.argsort(np.argsort([m[0] for m in layer["clusters"]]))], np.asarray(lm.weights["gate"])[
            np.argsort(lm.leaders)])
        variant[l] = lm.expert_map("shrunk")
    ids, mask = batch(96, seed=7)
    want = logits(source, ids, mask, variant)
    hf = transformers.AutoModelForCausalLM.from_pretrained(dst, attn_implementation="eager").eval()
    with torch.no_grad():
        got = hf(torch.as_tensor(ids, dtype=torch.long), attention_mask=torch.as_tensor(mask)).logits.float().numpy()
    valid = mask.astype(bool)
    np.testing.assert_allclose(got[valid], want[valid], atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(logits(load_pretrained(dst), ids, mask)[valid], want[valid], atol=1e-5, rtol=1e-5)
    # bytes: untouched tensors, kept router rows and singleton clusters' experts are the source's
    a, b = CheckpointReader(src), CheckpointReader(dst)
    for l, layer in record["layers"].items():
        stem = f"model.layers.{l}.mlp."
        rows = [a.read(stem + "gate.weight")[e].tobytes() for e in layer["kept"]]
        assert [r.tobytes() for r in b.read(stem + "gate.weight")] == rows
        for new, cluster in enumerate(sorted(layer["clusters"], key=lambda c: c[0])):
            same = a.read_bytes(f"{stem}experts.{cluster[0]}.down_proj.weight") == \
                b.read_bytes(f"{stem}experts.{new}.down_proj.weight")
            assert same == (len(cluster) == 1)
    for name in ("model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight", "model.layers.1.self_attn.q_proj.weight"):
        assert a.read_bytes(name) == b.read_bytes(name)
    # moejax diff reads it as a pruning to the leaders; --hash names exactly the merged experts' tensors
    from moejax.surgery.diff import diff_checkpoints, failed_checks

    report = diff_checkpoints(src, dst, hash_tensors=True)
    assert {l: e["kept"] for l, e in report["layers"].items()} == {l: e["kept"] for l, e in record["layers"].items()}
    merged_names = {f"model.layers.{l}.mlp.experts.{new}.{p}_proj.weight" for l, layer in record["layers"].items()
                    for new, c in enumerate(sorted(layer["clusters"], key=lambda c: c[0])) if len(c) > 1
                    for p in ("gate", "up", "down")}
    assert set(report["tensors"]["bytes_differ"]) == merged_names and merged_names
    assert failed_checks(report) == ["other_tensors_identical"]


def test_merge_refuses_before_the_pass(merged_qwen3, tmp_path):
    from moejax.surgery.merge import merge_checkpoint

    _, src, _, tokens = merged_qwen3
    with pytest.raises(ConfigError, match="--method"):
        merge_checkpoint(src, tmp_path / "x", method="zipit", keep=4, tokens=tokens)
    with pytest.raises(ConfigError, match="below top_k"):
        merge_checkpoint(src, tmp_path / "x", method="hc_smoe", keep=1, tokens=tokens)
    with pytest.raises(ConfigError, match="allocation"):
        merge_checkpoint(src, tmp_path / "x", method="hc_smoe", keep=4, tokens=tokens, allocation="local")
    with pytest.raises(MoejaxError, match="exactly one"):
        merge_checkpoint(src, tmp_path / "x", method="hc_smoe", keep=4)
    assert not (tmp_path / "x").exists()


def test_carried_pass_with_merges_and_a_global_budget_equals_the_forward(dsv3, tmp_path):
    """evaluate_pruning(merges=..., allocation="global"): the per-layer counts are the allocation
    rule's on in-memory calibration statistics (normalised frequency; the same total as uniform, not
    uniform here); at keep=E every variant reproduces the unpruned numbers exactly; each pruned and
    merged variant's perplexity equals the whole model's forward under the same variant built from
    in-memory merges; `moejax prune --allocation global` keeps the same counts."""
    import pandas as pd

    from moejax.evaluate import evaluate_pruning
    from moejax.merging.allocation import global_counts
    from moejax.scoring.observe import calibrate
    from moejax.scoring.select import select_kept
    from moejax.surgery.prune import prune_checkpoint

    path, model, calib = dsv3
    stats = calibrate(model, [(calib, None)])
    want = global_counts({l: st.counts_E for l, st in stats.items()}, 3, model.config.num_experts_per_tok)
    assert sum(want.values()) == 3 * len(stats) and len(set(want.values())) > 1  # not uniform here
    heldout = {"a": np.random.default_rng(4).integers(0, 96, size=(3, 20)).astype(np.int32)}
    rows, info = evaluate_pruning(open_checkpoint(path), calib, heldout, ["frequency"], [E, 3],
                                  merges=("m_smoe",), allocation="global", batch_size=4)
    df = pd.DataFrame(rows)
    ppl = df[(df.metric == "perplexity") & (df.text == "a")]
    unpruned = ppl[ppl["mode"] == "none"].value.item()
    full = ppl[ppl.keep == E]
    assert len(full) == 1 + 2 and (full.value == unpruned).all()  # frequency; m_smoe tied and shrunk
    err = df[(df.keep == E) & (df.metric == "rel_error")]
    assert len(err) == 3 * 2 and (err.value == 0).all()  # 3 variants x 2 MoE layers
    for name in ("frequency@3", "m_smoe@3"):
        assert info["layer_counts"][name] == want
    got = df[(df.metric == "experts") & (df.score == "frequency") & (df.keep == 3)].set_index("layer").value
    assert {int(l): int(v) for l, v in got.items()} == want
    ids = heldout["a"]

    def perplexity(variant):
        lg = logits(model, ids, np.ones(ids.shape, np.int32), variant)
        return float(np.exp(np.mean(np.asarray(next_token_nll(jnp.asarray(lg), jnp.asarray(ids))))))

    masks = np.ones((model.config.num_hidden_layers, E), bool)
    for l, c in want.items():
        masks[l] = select_kept(stats[l].counts_E, c)
        assert np.flatnonzero(masks[l]).tolist() == info["kept"][l]["frequency@3"]
    row = ppl[(ppl["mode"] == "one_shot") & (ppl.keep == 3)]
    assert row.value.item() == pytest.approx(perplexity(jnp.asarray(masks)), rel=1e-4)
    out = model.jitted()(jnp.asarray(calib), None, return_moe_inputs=True)
    for method in ("m_smoe",):  # hc_smoe's variants: the lm-eval backend test and -m slow tests
        merges = {}
        for l, z in out.moe_inputs.items():
            moe = model.model.layers[l].mlp
            merges[l] = merge_layer(method, want[l], merge_stats(moe, [z], [None]), moe.expert_weights())
            assert info["clusters"][l][f"{method}@3"] == merges[l].clusters() and merges[l].n_clusters == want[l]
        for form in ("tied", "shrunk"):
            got = ppl[(ppl["mode"] == form) & (ppl.score == method) & (ppl.keep == 3)].value.item()
            assert got == pytest.approx(perplexity({l: m.expert_map(form) for l, m in merges.items()}), rel=1e-4)
            assert got != pytest.approx(unpruned, rel=1e-3)
    scores = pd.DataFrame([{"layer": l, "expert": e, "score": "frequency", "value": float(v)}
                           for l, st in stats.items() for e, v in enumerate(st.counts_E)])
    scores.to_parquet(tmp_path / "scores.parquet")
    record = prune_checkpoint(path, tmp_path / "pruned", score="frequency", keep=3,
                              scores_file=tmp_path / "scores.parquet", allocation="global")
    assert record["allocation"] == "global"
    assert {int(l): len(layer["kept"]) for l, layer in record["layers"].items()} == want


def test_merge_refuses_a_quantised_source_before_the_pass(dsv3, tmp_path):
    """Merged experts would need re-quantising, which moejax does not do: refused by name, nothing written."""
    from hf_fixtures import QUANT_CONFIGS, quantize, rewrite

    from moejax.errors import CheckpointError
    from moejax.surgery.merge import merge_checkpoint

    path, _, calib = dsv3
    src = rewrite(path, tmp_path / "fp8", quantize("fp8_block"), {"quantization_config": QUANT_CONFIGS["fp8_block"]})
    np.save(tmp_path / "calib.npy", calib)
    with pytest.raises(CheckpointError, match="quantised.*does not re-quantise"):
        merge_checkpoint(src, tmp_path / "out", method="m_smoe", keep=4, tokens=tmp_path / "calib.npy")
    assert not (tmp_path / "out").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["calib.npy", "fp8"]

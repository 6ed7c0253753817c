"""Checkpoints pruned to different expert counts per layer (`moejax prune --allocation global`,
`--layers-keep`; config.json: the largest count under the family's key and
`moe_sparsity_config.num_experts`): moejax loads them (each MoE layer built with its own count),
evaluates them (forward, generate, the lm-eval backend), scores them (each layer's scores as long as
its expert count) and prunes them again, uniformly or globally. Every number is checked against the
SOURCE checkpoint run with the same experts masked."""

import json
from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pandas as pd
import pytest

pytest.importorskip("transformers")

from family_fixtures import make_family_checkpoint  # noqa: E402
from hf_fixtures import batch, make_checkpoint, with_mtp_layer  # noqa: E402

from moejax import AutoModelForCausalLM, from_pretrained, save_pretrained  # noqa: E402
from moejax.cli import main  # noqa: E402
from moejax.errors import ConfigError  # noqa: E402
from moejax.inference.generate import generate  # noqa: E402
from moejax.hf.check import check_checkpoint  # noqa: E402
from moejax.models.deepseek_v3.config import DeepseekV3Config  # noqa: E402
from moejax.models.deepseek_v3.presets import PRESETS  # noqa: E402
from moejax.models.variant import check_variant  # noqa: E402
from moejax.surgery.prune import prune_checkpoint  # noqa: E402
from moejax.variants.check import masks_from_pruning_record  # noqa: E402

E = 8
# one global threshold over these shares keeps 5 experts in layer 1 and 3 in layer 2 (keep=4, top_k=2)
SKEW = {1: [8.0, 1.0, 7.0, 2.0, 6.0, 3.0, 5.0, 4.0], 2: [100.0, 90.0, 30.0, 1.0, 1.1, 1.2, 1.3, 1.4]}
SKEW_KEPT = {1: [0, 2, 4, 6, 7], 2: [0, 1, 2]}


def kept_of(dst):
    record = json.loads((dst / "pruning.json").read_text())
    return {int(l): v["kept"] for l, v in record["layers"].items()}


def compose(first, second):
    """Source expert indices kept by pruning twice: `second` indexes the experts `first` kept."""
    return {l: [first[l][e] for e in kept] for l, kept in second.items()}


def source_masks(kept, n_layers, n_experts):
    masks = np.zeros((n_layers, n_experts), bool)
    for layer, k in kept.items():
        masks[layer, k] = True
    return masks


def assert_logits_equal_masked_source(model, source, kept, seed=3):
    """The pruned model's logits equal the source's with every expert outside `kept` masked (and
    differ from the unmasked source's, so the comparison can fail)."""
    cfg = source.config
    ids, mask = batch(cfg.vocab_size, seed=seed)
    masks = jnp.asarray(source_masks(kept, cfg.num_hidden_layers, cfg.n_experts))
    want = np.asarray(source(jnp.asarray(ids), jnp.asarray(mask), variant=masks).logits_BSV)
    got = np.asarray(model(jnp.asarray(ids), jnp.asarray(mask)).logits_BSV)
    valid = mask.astype(bool)
    assert np.abs(got - want)[valid].max() < 2e-4 * max(1.0, np.abs(want).max())
    unmasked = np.asarray(source(jnp.asarray(ids), jnp.asarray(mask)).logits_BSV)
    assert np.abs(unmasked - got)[valid].max() > 1e-2


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """DeepSeek-V3 without routing groups (layer 0 dense, 8 experts, top-2), with a byte-level
    tokenizer for the lm-eval backend, and its global pruning to 5 and 3 experts."""
    from moejax.data import write_byte_tokenizer

    root = tmp_path_factory.mktemp("per_layer")
    src = root / "src"
    make_checkpoint(src, seed=11, n_group=1, topk_group=1, vocab_size=256, eos_token_id=0, pad_token_id=0,
                    bos_token_id=None)
    write_byte_tokenizer(src, 256)
    pd.DataFrame([{"layer": l, "expert": e, "score": "skew", "value": v} for l, vs in SKEW.items()
                  for e, v in enumerate(vs)]).to_parquet(root / "skew.parquet")
    dst = root / "global"
    prune_checkpoint(src, dst, score="skew", scores_file=root / "skew.parquet", keep=4, allocation="global")
    return src, dst, from_pretrained(src)


def test_global_pruning_is_loaded_with_each_layers_count(source):
    src, dst, src_model = source
    assert kept_of(dst) == SKEW_KEPT
    config = json.loads((dst / "config.json").read_text())
    assert config["n_routed_experts"] == 5
    assert config["moe_sparsity_config"] == {"method": "prune", "num_experts": [None, 5, 3]}
    model = from_pretrained(dst)
    assert [model.model.layers[l].mlp.router.shape for l in (1, 2)] == [(5, 64), (3, 64)]
    assert_logits_equal_masked_source(model, src_model, SKEW_KEPT)
    # generation: each greedy token is the masked source's argmax after the tokens before it
    prompt = np.random.default_rng(5).integers(1, 256, (2, 6))
    out = np.asarray(generate(model, jnp.asarray(prompt), max_new_tokens=4))
    logits = src_model(jnp.asarray(out[:, :-1]), variant=jnp.asarray(source_masks(SKEW_KEPT, 3, E))).logits_BSV
    np.testing.assert_array_equal(out[:, 6:], np.asarray(logits).argmax(-1)[:, 5:])
    # saved back by moejax: the same tensors and config
    save_pretrained(model, dst.parent / "saved")
    again = from_pretrained(dst.parent / "saved")
    assert again.config.layer_num_experts == (None, 5, 3)
    np.testing.assert_array_equal(np.asarray(again.model.layers[2].mlp.experts_down[...]),
                                  np.asarray(model.model.layers[2].mlp.experts_down[...]))


def test_variants_of_a_per_layer_model(source):
    src, dst, _ = source
    model = from_pretrained(dst)
    cfg = model.config
    masks = np.zeros((3, 5), bool)
    masks[1, [0, 3, 4]] = True
    masks[2, [0, 2]] = True
    ids, mask = batch(256, seed=7)
    got = np.asarray(model(jnp.asarray(ids), jnp.asarray(mask), variant=check_variant(masks, cfg)).logits_BSV)
    # the same pruning of the source: layer 1 keeps source experts [0, 6, 7], layer 2 [0, 2]
    want = np.asarray(from_pretrained(src)(
        jnp.asarray(ids), jnp.asarray(mask),
        variant=jnp.asarray(source_masks({1: [0, 6, 7], 2: [0, 2]}, 3, E))).logits_BSV)
    assert np.abs(got - want)[mask.astype(bool)].max() < 2e-4 * max(1.0, np.abs(want).max())
    beyond = masks.copy()
    beyond[2, 4] = True  # layer 2 holds 3 experts
    with pytest.raises(ConfigError, match=r"layer 2 holds 3 experts .* keeps experts \[4\]"):
        check_variant(beyond, cfg)
    # a scores file of the per-layer checkpoint, a keep ratio resolved against each layer's count
    from moejax.scoring.score_checkpoint import score_data_free
    from moejax.variants.check import masks_from_scores

    free = score_data_free(dst, scores=["l1"], out=dst.parent / "free_l1.parquet")
    masks = masks_from_scores(dst.parent / "free_l1.parquet", "l1", 0.6, cfg)
    for layer, n, keep in ((1, 5, 3), (2, 3, 2)):
        values = free[free.layer == layer].sort_values("expert").value.to_numpy()
        assert masks[layer].tolist() == [e in np.argsort(-values, kind="stable")[:keep] for e in range(5)]
        assert not masks[layer, n:].any()


def test_lm_eval_backend_reads_it(source):
    """The lm-eval backend on the pruned checkpoint equals the backend on the source under the
    pruning record written beside it."""
    from moejax.evaluation.lm_eval import MoejaxLM

    src, dst, _ = source
    texts = [SimpleNamespace(args=(t,)) for t in ("def f(x):\n    return x + 1\n", "import os\nprint(os.sep)\n")]
    pruned = MoejaxLM(pretrained=str(dst), batch_size=2).loglikelihood_rolling(texts, disable_tqdm=True)
    masked = MoejaxLM(pretrained=str(src), batch_size=2, pruning=str(dst)).loglikelihood_rolling(texts,
                                                                                               disable_tqdm=True)
    full = MoejaxLM(pretrained=str(src), batch_size=2).loglikelihood_rolling(texts, disable_tqdm=True)
    np.testing.assert_allclose(pruned, masked, rtol=1e-4)
    assert np.abs(np.subtract(pruned, full)).max() > 1e-2


def test_scores_have_each_layers_length(source, tmp_path, capsys):
    """Data-free and calibration scores of the pruned checkpoint: one row per expert of each layer;
    l1 equals the source's at the kept experts, and the calibration routing counts equal the
    source's under the same masks."""
    from moejax.scoring.score_checkpoint import score_checkpoint, score_data_free

    src, dst, src_model = source
    free = score_data_free(dst, scores=["l1"])
    source_free = score_data_free(src, scores=["l1"])
    for layer, kept in SKEW_KEPT.items():
        rows = free[free.layer == layer].sort_values("expert")
        assert rows.expert.tolist() == list(range(len(kept)))
        want = source_free[source_free.layer == layer].set_index("expert").value[kept]
        np.testing.assert_array_equal(rows.value.to_numpy(), want.to_numpy())
    assert main(["score", str(dst), "--scores", "l1", "--out", str(tmp_path / "free.parquet")]) == 0
    assert "2 MoE layers x [5, 3] experts x 1 data-free scores" in capsys.readouterr().out
    ids = np.random.default_rng(0).integers(1, 256, (2, 12))
    np.save(tmp_path / "ids.npy", ids)
    df = score_checkpoint(dst, tokens=tmp_path / "ids.npy", scores=["frequency", "reap"],
                          out=tmp_path / "scores.parquet", batch_size=2)
    routing = src_model(jnp.asarray(ids), variant=jnp.asarray(source_masks(SKEW_KEPT, 3, E)),
                        return_routing=True).routing
    sidecar = json.loads((tmp_path / "scores.json").read_text())
    for layer, kept in SKEW_KEPT.items():
        freq = df[(df.layer == layer) & (df.score == "frequency")].sort_values("expert")
        assert freq.expert.tolist() == list(range(len(kept)))
        counts = np.bincount(np.asarray(routing[layer].expert_idx_TK).ravel(), minlength=E)
        np.testing.assert_array_equal(sidecar["layers"][str(layer)]["counts"], counts[kept])
        assert counts.sum() == counts[kept].sum()  # the masked source routes to kept experts only


def test_pruned_again_uniform_and_global(source, tmp_path):
    """Re-pruning reads each layer's own count: a uniform keep gives a uniform checkpoint (the
    per-layer key dropped), a global one per-layer counts again; a scores file of the pruned
    checkpoint (each layer's length) drives it; each result computes what the source computes with
    the composed experts masked."""
    from moejax.scoring.score_checkpoint import score_data_free

    src, dst, src_model = source
    first = kept_of(dst)
    uniform = tmp_path / "uniform"
    record = prune_checkpoint(dst, uniform, score="l1", keep=3)
    assert {l: v["n_experts"] for l, v in record["layers"].items()} == {"1": 5, "2": 3}
    config = json.loads((uniform / "config.json").read_text())
    assert config["n_routed_experts"] == 3 and "moe_sparsity_config" not in config
    assert_logits_equal_masked_source(from_pretrained(uniform), src_model,
                                      compose(first, kept_of(uniform)))

    score_data_free(dst, scores=["l1", "signed"], out=tmp_path / "free.parquet")
    again = tmp_path / "again"
    prune_checkpoint(dst, again, score="signed", scores_file=tmp_path / "free.parquet", keep=0.7, allocation="global")
    counts = {l: len(k) for l, k in kept_of(again).items()}
    assert sum(counts.values()) == 3 + 2  # the ratio resolved per layer: 0.7 of 5 and of 3
    config = json.loads((again / "config.json").read_text())
    assert config.get("moe_sparsity_config", {"num_experts": [None, 3, 3]})["num_experts"] == [None, *counts.values()]
    model = from_pretrained(again)
    assert_logits_equal_masked_source(model, src_model, compose(first, kept_of(again)))
    # the record of the second pruning, applied to the per-layer checkpoint it was made from
    dst_model = from_pretrained(dst)
    masks = masks_from_pruning_record(again, dst_model.config)
    ids, mask = batch(256, seed=9)
    want = np.asarray(dst_model(jnp.asarray(ids), jnp.asarray(mask),
                                variant=check_variant(masks, dst_model.config)).logits_BSV)
    got = np.asarray(model(jnp.asarray(ids), jnp.asarray(mask)).logits_BSV)
    assert np.abs(got - want)[mask.astype(bool)].max() < 2e-4 * max(1.0, np.abs(want).max())


def test_grouped_per_layer_counts_keep_their_groups(tmp_path):
    """Routing groups (16 experts, 2 groups, top-4 from the best group): a pruning keeping 6 and 4
    experts per group in layers 1 and 2 is routed in groups of 6 and 4, exactly the source's groups
    with the other experts masked; pruned again to 4 per group, likewise."""
    src = tmp_path / "src"
    make_checkpoint(src, seed=12, n_routed_experts=16, n_group=2, topk_group=1, num_experts_per_tok=4)
    dst = tmp_path / "pruned"
    record = prune_checkpoint(src, dst, score="signed", keep=8, layers_keep={"1": 12}, group_aware=True)
    assert record["groups"] == "preserved"
    kept = kept_of(dst)
    assert [sum(e < 8 for e in kept[l]) for l in (1, 2)] == [6, 4]
    config = json.loads((dst / "config.json").read_text())
    assert (config["n_group"], config["n_routed_experts"]) == (2, 12)
    assert config["moe_sparsity_config"]["num_experts"] == [None, 12, 8]
    src_model = from_pretrained(src)
    assert_logits_equal_masked_source(from_pretrained(dst), src_model, kept, seed=4)
    again = tmp_path / "again"
    assert prune_checkpoint(dst, again, score="l1", keep=8, group_aware=True)["groups"] == "preserved"
    assert "moe_sparsity_config" not in json.loads((again / "config.json").read_text())
    assert_logits_equal_masked_source(from_pretrained(again), src_model,
                                      compose(kept, kept_of(again)), seed=4)
    # a global budget does not allocate whole groups: refused by name when groups are to be kept
    with pytest.raises(ConfigError, match="keep=7 is the count --allocation global gave layer 1; it does not "
                                          "allocate whole groups"):
        prune_checkpoint(src, tmp_path / "global", score="l1", keep=8, allocation="global", group_aware=True)


def test_a_gqa_family_per_layer(tmp_path):
    """Qwen3-MoE (softmax router over the kept experts, layer 0 dense): 6 and 3 experts."""
    src = tmp_path / "src"
    make_family_checkpoint("qwen3_moe", src, seed=5)
    dst = tmp_path / "pruned"
    prune_checkpoint(src, dst, score="l1", keep=6, layers_keep={"2": 3})
    config = json.loads((dst / "config.json").read_text())
    assert config["num_local_experts"] == 6 and config["moe_sparsity_config"]["num_experts"] == [None, 6, 3]
    model = AutoModelForCausalLM.from_pretrained(dst)
    assert model.model.layers[2].mlp.router.shape[0] == 3
    assert_logits_equal_masked_source(model, AutoModelForCausalLM.from_pretrained(src), kept_of(dst), seed=6)


def test_mtp_layer_counts_are_listed(source, tmp_path):
    """A global budget over the decoder and MTP layers: the MTP layer's own count is listed too, so
    the pruned checkpoint passes the loader's check (headers only)."""
    src = source[0]

    mtp = with_mtp_layer(src, tmp_path / "mtp")  # layer 3, as DeepSeek-V3 ships it
    pd.DataFrame([{"layer": l, "expert": e, "score": "skew", "value": v}
                  for l, vs in {**SKEW, 3: [1.0] * E}.items() for e, v in enumerate(vs)]).to_parquet(tmp_path / "s.pq")
    dst = tmp_path / "pruned"
    prune_checkpoint(mtp, dst, score="skew", scores_file=tmp_path / "s.pq", keep=3, allocation="global")
    counts = {l: len(k) for l, k in kept_of(dst).items()}
    assert counts[3] != max(counts.values())
    config = json.loads((dst / "config.json").read_text())
    assert config["moe_sparsity_config"]["num_experts"] == [None, counts[1], counts[2], counts[3]]
    checked = check_checkpoint(dst, uniform_experts=False)
    assert {l: ml.n_experts for l, ml in checked.layout.moe_layers.items()} == counts


def _small(**overrides) -> dict:
    return {**PRESETS["moonlight-16b-a3b"], "num_hidden_layers": 4, "first_k_dense_replace": 1,
            "n_routed_experts": 8, "num_experts_per_tok": 2, **overrides}


@pytest.mark.parametrize("overrides,counts,expected", [
    ({}, [None, 8, 1, 4], "num_experts[2]=1: fewer experts than num_experts_per_tok=2"),
    ({}, [None, 6, 4, 4], "gives at most 6 experts but n_routed_experts=8 (expected the largest count)"),
    ({"n_group": 2, "topk_group": 1}, [None, 8, 5, 4], "num_experts[2]=5: not divisible by n_group=2"),
    ({"n_group": 2, "topk_group": 1}, [None, 8, 2, 4], "num_experts[2]=2: 1 expert(s) per routing group"),
    ({"n_group": 2, "topk_group": 1, "num_experts_per_tok": 3}, [None, 8, 4, 8],
     "num_experts[2]=4: num_experts_per_tok=3 exceeds the experts of the chosen groups (topk_group=1 x 2)"),
])
def test_per_layer_counts_the_router_cannot_route_are_refused(overrides, counts, expected):
    with pytest.raises(ConfigError, match=expected.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        DeepseekV3Config.from_dict(_small(moe_sparsity_config={"num_experts": counts}, **overrides),
                                   uniform_experts=False)
    ok = DeepseekV3Config.from_dict(_small(n_group=2, topk_group=1, moe_sparsity_config={"num_experts": [None, 8, 6, 4]}),
                                    uniform_experts=False)
    assert [ok.experts_in_layer(l) for l in range(4)] == [0, 8, 6, 4] and ok.per_layer_experts


def test_tools_that_need_one_count_say_so(source, tmp_path):
    """`moejax merge` and the prune_real pass refuse a per-layer checkpoint by name."""
    from moejax.evaluation.carried import evaluate_pruning
    from moejax.hf.model_io import open_checkpoint
    from moejax.merging.method import parse
    from moejax.surgery.merge import merge_checkpoint

    _, dst, _ = source
    np.save(tmp_path / "ids.npy", np.ones((2, 8), np.int64))
    with pytest.raises(ConfigError, match="needs one expert count in every layer"):
        merge_checkpoint(dst, tmp_path / "merged", method=parse("m_smoe"), keep=3, tokens=tmp_path / "ids.npy")
    with pytest.raises(ConfigError, match="evaluate_pruning .* needs one count in every layer"):
        evaluate_pruning(open_checkpoint(dst), np.ones((2, 8), np.int64), {}, ["l1"], [3])

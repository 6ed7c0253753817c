"""`moejax prune`: pruned checkpoints that transformers loads and that compute what the source
computes with the same experts masked; survivors byte-identical; compressed-tensors' own
MagnitudeExpertPruner as the independent reference for `l1`; every refusal leaves nothing behind."""

import json

import jax.numpy as jnp
import numpy as np
import pandas as pd
import pytest

pytest.importorskip("transformers")

from hf_fixtures import QUANT_CONFIGS, batch, make_checkpoint, quantize, rewrite, with_mtp_layer  # noqa: E402

from moejax import from_pretrained  # noqa: E402
from moejax.cli import main  # noqa: E402
from moejax.errors import CheckpointError, ConfigError, MoejaxError  # noqa: E402
from moejax.hf.io.checkpoint_reader import CheckpointReader  # noqa: E402
from moejax.surgery import prune as prune_module  # noqa: E402
from moejax.surgery.prune import prune_checkpoint  # noqa: E402

E, K = 8, 2


@pytest.fixture(scope="module")
def flat(tmp_path_factory):
    """No routing groups, three layers (one dense), five shards."""
    path = tmp_path_factory.mktemp("flat") / "src"
    make_checkpoint(path, seed=11, n_group=1, topk_group=1, max_shard_size="200KB")
    return path


@pytest.fixture(scope="module")
def grouped(tmp_path_factory):
    """16 experts in 2 routing groups, top-4 from the best group."""
    path = tmp_path_factory.mktemp("grouped") / "src"
    make_checkpoint(path, seed=12, n_routed_experts=16, n_group=2, topk_group=1, num_experts_per_tok=4)
    return path


def tensors(path):
    r = CheckpointReader(path)
    return {name: (r.info(name).dtype, r.info(name).shape, r.read_bytes(name)) for name in r.keys()}


def expected_tensors(src, kept):
    """The pruned checkpoint as SPEC section 6 defines it, computed from the source's bytes:
    experts renumbered in ascending source order, router rows and bias entries sliced."""
    out = {}
    for name, (dtype, shape, data) in tensors(src).items():
        parts = name.split(".")
        layer = int(parts[2]) if parts[1] == "layers" else None
        if layer in kept and "experts" in parts:
            e = int(parts[parts.index("experts") + 1])
            if e in kept[layer]:
                parts[parts.index("experts") + 1] = str(kept[layer].index(e))
                out[".".join(parts)] = (dtype, shape, data)
        elif layer in kept and name.endswith(("mlp.gate.weight", "mlp.gate.e_score_correction_bias")):
            row = len(data) // shape[0]
            out[name] = (dtype, (len(kept[layer]),) + shape[1:], b"".join(data[i * row:(i + 1) * row] for i in kept[layer]))
        else:
            out[name] = (dtype, shape, data)
    return out


def kept_of(dst):
    record = json.loads((dst / "pruning.json").read_text())
    return {int(l): v["kept"] for l, v in record["layers"].items()}


def nothing_left(dst):
    return not dst.exists() and not list(dst.parent.glob(f".{dst.name}.*"))


@pytest.mark.parametrize("score", ["l1", "signed", "bias", "random", "aimer"])
def test_pruned_tensors_are_the_sources_bytes(flat, tmp_path, score):
    dst = tmp_path / "pruned"
    prune_checkpoint(flat, dst, score=score, keep=4)
    kept = kept_of(dst)
    assert all(len(k) == 4 for k in kept.values()) and kept.keys() == {1, 2}
    got = tensors(dst)
    assert got == expected_tensors(flat, kept)
    config = json.loads((dst / "config.json").read_text())
    source_config = json.loads((flat / "config.json").read_text())
    assert config == {**source_config, "n_routed_experts": 4}
    assert (dst / "generation_config.json").read_bytes() == (flat / "generation_config.json").read_bytes()
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(got)
    assert index["metadata"]["total_size"] == sum(len(v[2]) for v in got.values())


def test_selection_follows_the_score_with_ties_to_the_lower_index(flat, tmp_path):
    r = CheckpointReader(flat)
    for score, fn in {"l1": lambda w, b: np.abs(w).sum(1), "signed": lambda w, b: w.sum(1),
                      "bias": lambda w, b: -b}.items():
        dst = tmp_path / score
        prune_checkpoint(flat, dst, score=score, keep=0.5)
        for layer, kept in kept_of(dst).items():
            w = r.read(f"model.layers.{layer}.mlp.gate.weight").astype(np.float64)
            b = r.read(f"model.layers.{layer}.mlp.gate.e_score_correction_bias").astype(np.float64)
            assert kept == sorted(np.argsort(-fn(w, b), kind="stable")[:4].tolist()), (score, layer)


TIED_SCALES = {1: [1.0, 3.0, 2.0, 0.5, 2.0, 2.0, 4.0, 2.0],     # router row j = scale_j * v: identical
               2: [-3.0, 2.0, 2.0, -2.0, 2.0, 2.0, 2.5, 2.0]}  # rows, hence exactly tied scores
TIED_BIAS = {1: [0.1, -0.2, -0.3, -0.2, 0.3, -0.2, 0.0, -0.2],
             2: [0.0, 0.4, 0.0, -0.1, 0.0, 0.0, 0.2, 0.0]}


def test_exact_ties_at_the_cut_go_to_the_lower_index(flat, tmp_path):
    """Router rows and bias entries with genuine exact ties straddling the cut (SPEC section 2:
    ties break toward the lower expert index), against python's sort by (-score, index)."""
    def tie(name, reader):
        w = reader.read(name)
        parts = name.split(".")
        if name.endswith("mlp.gate.weight"):
            # layer 2: v of mixed signs with a positive sum, so l1 and signed tie different experts
            v = w[0] * np.sign(w[0].sum()) if parts[2] == "2" else np.abs(w[0])
            return [(name, (np.array(TIED_SCALES[int(parts[2])], np.float32)[:, None] * v).astype(w.dtype))]
        if name.endswith("mlp.gate.e_score_correction_bias"):
            return [(name, np.array(TIED_BIAS[int(parts[2])], w.dtype))]
        return [(name, w)]

    src = rewrite(flat, tmp_path / "tied", tie)
    r = CheckpointReader(src)
    for score, fn in {"l1": lambda w, b: np.abs(w).sum(1), "signed": lambda w, b: w.sum(1),
                      "bias": lambda w, b: -b}.items():
        prune_checkpoint(src, tmp_path / score, score=score, keep=4)
        for layer, kept in kept_of(tmp_path / score).items():
            w = r.read(f"model.layers.{layer}.mlp.gate.weight").astype(np.float64)
            value = fn(w, r.read(f"model.layers.{layer}.mlp.gate.e_score_correction_bias").astype(np.float64))
            order = sorted(range(E), key=lambda j: (-value[j], j))       # ties: the lower index first
            assert value[order[3]] == value[order[4]], (score, layer)      # a genuine tie at the cut
            assert kept == sorted(order[:4]), (score, layer, value.tolist())
    # the cases spelled out: layer 1, l1 ranks 6 > 1 > {2, 4, 5, 7} tied: keeps 2 and 4 of the four
    assert kept_of(tmp_path / "l1")[1] == [1, 2, 4, 6]
    assert kept_of(tmp_path / "bias")[1] == [1, 2, 3, 5]                 # -bias 0.3, then 0.2 x {1, 3, 5, 7}
    assert kept_of(tmp_path / "l1")[2] == [0, 1, 2, 6] and kept_of(tmp_path / "signed")[2] == [1, 2, 4, 6]


def test_transformers_loads_it_and_matches_the_masked_source(flat, tmp_path):
    import torch
    from transformers import DeepseekV3ForCausalLM as HFModel

    dst = tmp_path / "pruned"
    prune_checkpoint(flat, dst, score="l1", keep=4)
    kept = kept_of(dst)
    hf = HFModel.from_pretrained(dst, attn_implementation="eager", experts_implementation="eager").eval()
    ids, mask = batch(96, seed=3)
    with torch.no_grad():
        want = hf(torch.as_tensor(ids, dtype=torch.long), attention_mask=torch.as_tensor(mask)).logits.numpy()
    model = from_pretrained(flat, dtype=jnp.float32)
    masks = np.zeros((3, E), bool)
    for layer, k in kept.items():
        masks[layer, k] = True
    got = np.asarray(model(jnp.asarray(ids), jnp.asarray(mask), variant=jnp.asarray(masks)).logits_BSV)
    valid = mask.astype(bool)
    assert np.abs(got - want)[valid].max() < 2e-4 * max(1.0, np.abs(want).max())
    unmasked = np.asarray(model(jnp.asarray(ids), jnp.asarray(mask)).logits_BSV)
    assert np.abs(unmasked - want)[valid].max() > 1e-2  # pruning changed the logits: the test can fail


def test_group_aware_keeps_groups_and_matches_the_masked_source(grouped, tmp_path):
    import torch
    from transformers import DeepseekV3ForCausalLM as HFModel

    dst = tmp_path / "pruned"
    record = prune_checkpoint(grouped, dst, score="signed", keep=8, group_aware=True)
    assert record["groups"] == "preserved"
    kept = kept_of(dst)
    for k in kept.values():
        assert sum(e < 8 for e in k) == 4 and sum(e >= 8 for e in k) == 4
    config = json.loads((dst / "config.json").read_text())
    assert (config["n_group"], config["topk_group"], config["n_routed_experts"]) == (2, 1, 8)
    hf = HFModel.from_pretrained(dst, attn_implementation="eager", experts_implementation="eager").eval()
    ids, mask = batch(96, seed=4)
    with torch.no_grad():
        want = hf(torch.as_tensor(ids, dtype=torch.long), attention_mask=torch.as_tensor(mask)).logits.numpy()
    model = from_pretrained(grouped)
    masks = np.zeros((3, 16), bool)
    for layer, k in kept.items():
        masks[layer, k] = True
    got = np.asarray(model(jnp.asarray(ids), jnp.asarray(mask), variant=jnp.asarray(masks)).logits_BSV)
    assert np.abs(got - want)[mask.astype(bool)].max() < 2e-4 * max(1.0, np.abs(want).max())


def test_group_refusals_are_worded_for_the_command_that_prints_them(grouped, tmp_path):
    """prune suggests --group-aware; prune --group-aware (given) says how many per group it needs;
    merge (which takes no --group-aware) says its leaders fell unevenly and suggests what it takes."""
    from moejax.hf.check import check_checkpoint
    from moejax.surgery.prune_plan import plan_pruning

    with pytest.raises(ConfigError) as refused:   # top_k=4 from topk_group=1: 4 per group needed, 2 kept
        prune_checkpoint(grouped, tmp_path / "out", score="signed", keep=4, group_aware=True)
    assert str(refused.value).startswith("--group-aware keeps 2 experts in each of the 2 groups (layer 1)")
    assert "at least 4 per group" in str(refused.value) and "a --keep of at least 8" in str(refused.value)
    assert "Pass --group-aware" not in str(refused.value) and nothing_left(tmp_path / "out")
    checked = check_checkpoint(grouped)
    leaders = {l: (np.arange(16) < 8).astype(float) for l in (1, 2)}   # every leader in group 0
    with pytest.raises(ConfigError) as refused:
        plan_pruning(checked.reader, checked.layout, checked.config, score="hc_smoe cluster leaders",
                     layers_keep={1: 8, 2: 8}, layer_scores=leaders, leaders=True)
    message = str(refused.value)
    assert message.startswith("the merge's cluster leaders in layer 1 fall [8, 0] per routing group")
    assert "--collapse-groups" in message and "--group-aware" not in message


def test_uneven_groups_refused_unless_collapsed(grouped, tmp_path):
    dst = tmp_path / "pruned"
    scores = pd.DataFrame([{"layer": l, "expert": e, "score": "skewed", "value": float(e < 8) + e / 100}
                           for l in (1, 2) for e in range(16)])  # the top 8 all sit in group 0
    scores.to_parquet(tmp_path / "scores.parquet")
    with pytest.raises(ConfigError, match="--group-aware.*--collapse-groups"):
        prune_checkpoint(grouped, dst, score="skewed", scores_file=tmp_path / "scores.parquet", keep=8)
    assert nothing_left(dst)
    record = prune_checkpoint(grouped, dst, score="skewed", scores_file=tmp_path / "scores.parquet", keep=8,
                              collapse_groups=True)
    assert record["groups"] == "collapsed" and "n_group=1" in record["notes"][0]
    assert kept_of(dst) == {1: list(range(8)), 2: list(range(8))}
    config = json.loads((dst / "config.json").read_text())
    assert (config["n_group"], config["topk_group"]) == (1, 1)
    from_pretrained(dst)  # a well-defined routing the model accepts


def test_scores_file_and_per_layer_counts(flat, tmp_path):
    rng = np.random.default_rng(0)
    values = {l: rng.normal(size=E) for l in (1, 2)}
    pd.DataFrame([{"layer": l, "expert": e, "score": "reap", "value": v[e]} for l, v in values.items()
                  for e in range(E)]).to_parquet(tmp_path / "s.parquet")
    dst = tmp_path / "pruned"
    prune_checkpoint(flat, dst, score="reap", scores_file=tmp_path / "s.parquet", keep=6, layers_keep={"2": 3})
    kept = kept_of(dst)
    assert kept == {1: sorted(np.argsort(-values[1], kind="stable")[:6].tolist()),
                    2: sorted(np.argsort(-values[2], kind="stable")[:3].tolist())}
    config = json.loads((dst / "config.json").read_text())
    assert config["n_routed_experts"] == 6
    assert config["moe_sparsity_config"] == {"method": "prune", "num_experts": [None, 6, 3]}
    assert tensors(dst) == expected_tensors(flat, kept)
    model = from_pretrained(dst)  # each layer with its own count (test_per_layer_experts)
    assert [model.model.layers[l].mlp.router.shape[0] for l in (1, 2)] == [6, 3]


def test_l1_equals_compressed_tensors_magnitude_pruner(flat, tmp_path):
    from compressed_tensors.entrypoints.convert import convert_checkpoint
    from compressed_tensors.entrypoints.convert.converters.magnitude_expert_pruner import MagnitudeExpertPruner

    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    prune_checkpoint(flat, ours, score="l1", keep=0.625)  # keeps 5 of 8
    pruner = MagnitudeExpertPruner.from_pretrained(
        flat, router_pattern=r"mlp\.gate\.weight$", expert_pattern=r"mlp\.experts\.\d+\.", sparsity=0.375)
    convert_checkpoint(flat, theirs, converter=pruner, max_workers=1, device="cpu")
    assert tensors(ours) == tensors(theirs)
    assert json.loads((theirs / "config.json").read_text())["n_routed_experts"] == 5


@pytest.mark.parametrize("fmt", list(QUANT_CONFIGS))
def test_quantised_experts_travel_with_their_companions(flat, tmp_path, fmt):
    src = rewrite(flat, tmp_path / fmt, quantize(fmt), {"quantization_config": QUANT_CONFIGS[fmt]})
    dst = tmp_path / "pruned"
    prune_checkpoint(src, dst, score="l1", keep=4)
    kept = kept_of(dst)
    got = tensors(dst)
    assert got == expected_tensors(src, kept)
    companions = {"fp8_block": "weight_scale_inv", "int4_pack": "weight_shape", "mxfp4": "weight_scale"}[fmt]
    assert sum(n.endswith(companions) and ".experts." in n for n in got) == 2 * 4 * 3
    assert json.loads((dst / "config.json").read_text())["quantization_config"] == QUANT_CONFIGS[fmt]
    source = from_pretrained(src)
    pruned = from_pretrained(dst)
    ids, mask = batch(96, seed=5)
    masks = np.zeros((3, E), bool)
    for layer, k in kept.items():
        masks[layer, k] = True
    want = np.asarray(source(jnp.asarray(ids), jnp.asarray(mask), variant=jnp.asarray(masks)).logits_BSV)
    np.testing.assert_allclose(np.asarray(pruned(jnp.asarray(ids), jnp.asarray(mask)).logits_BSV), want, atol=1e-4, rtol=1e-4)


def test_mtp_layer_pruned_or_dropped(flat, tmp_path):
    src = with_mtp_layer(flat, tmp_path / "mtp")  # layer 3, as DeepSeek-V3 ships it
    dst = tmp_path / "pruned"
    prune_checkpoint(src, dst, score="l1", keep=4)
    assert kept_of(dst).keys() == {1, 2, 3} and tensors(dst) == expected_tensors(src, kept_of(dst))
    prune_checkpoint(src, tmp_path / "aimer", score="aimer", keep=4)  # reads the MTP layer's experts too
    kept = kept_of(tmp_path / "aimer")
    assert kept.keys() == {1, 2, 3} and kept[3] == kept[2] and kept[1] != kept[2]
    scores = pd.DataFrame([{"layer": l, "expert": e, "score": "ean", "value": float(e)}
                           for l in (1, 2) for e in range(E)])
    scores.to_parquet(tmp_path / "s.parquet")
    with pytest.raises(ConfigError, match="no rows for MoE layer 3"):
        prune_checkpoint(src, tmp_path / "x", score="ean", scores_file=tmp_path / "s.parquet", keep=4)
    record = prune_checkpoint(src, tmp_path / "dropped", score="ean", scores_file=tmp_path / "s.parquet", keep=4,
                              mtp="drop")
    assert record["dropped_layers"] == [3]
    names = CheckpointReader(tmp_path / "dropped").keys()
    assert names and not any(n.startswith("model.layers.3.") for n in names)
    assert json.loads((tmp_path / "dropped" / "config.json").read_text())["num_nextn_predict_layers"] == 0


def test_bad_requests_fail_before_writing(flat, tmp_path):
    dst = tmp_path / "pruned"
    cases = [
        (dict(score="l1", keep=1), "below top_k=2"),
        (dict(score="l1", keep=0.1), "below top_k=2"),
        (dict(score="l1", keep=9), "exceeds"),
        (dict(score="magnitude", keep=4), "unknown score 'magnitude'"),
        (dict(score="reap", keep=4), "needs a calibration pass"),
        (dict(score="l1", keep=4, layers_keep={"0": 4}), "layer '0', which is not a MoE layer"),
        (dict(score="l1"), "no keep"),
    ]
    for kwargs, message in cases:
        with pytest.raises(MoejaxError, match=message):
            prune_checkpoint(flat, dst, **kwargs)
        assert nothing_left(dst), kwargs
    with pytest.raises(CheckpointError, match="is inside the input"):
        prune_checkpoint(flat, flat / "inside", score="l1", keep=4)
    assert not (flat / "inside").exists()
    dst.mkdir()
    with pytest.raises(CheckpointError, match="already exists"):
        prune_checkpoint(flat, dst, score="l1", keep=4)
    prune_checkpoint(flat, dst, score="l1", keep=4, overwrite=True)
    assert kept_of(dst)


def test_broken_sources_are_named(flat, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(flat, broken)
    shard = sorted(broken.glob("*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"names shard '{shard.name}', which does not exist"):
        prune_checkpoint(broken, tmp_path / "a", score="l1", keep=4)
    shutil.copytree(flat, broken, dirs_exist_ok=True)
    first = sorted(broken.glob("*.safetensors"))[0]
    first.write_bytes(b"\xff" * 8 + first.read_bytes()[8:])
    with pytest.raises(CheckpointError, match=first.name):
        prune_checkpoint(broken, tmp_path / "b", score="l1", keep=4)
    assert nothing_left(tmp_path / "a") and nothing_left(tmp_path / "b")


def test_an_interrupted_run_leaves_no_destination(flat, tmp_path, monkeypatch):
    before = tensors(flat)
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    real = prune_module.write_safetensors_file
    monkeypatch.setattr(prune_module, "write_safetensors_file", failing)
    with pytest.raises(KeyboardInterrupt):
        prune_checkpoint(flat, tmp_path / "pruned", score="l1", keep=4)
    assert nothing_left(tmp_path / "pruned") and tensors(flat) == before


def test_cli(flat, tmp_path, capsys):
    (tmp_path / "layers.json").write_text('{"1": 4, "2": 0.75}')
    assert main(["prune", str(flat), str(tmp_path / "out"), "--score", "bias", "--keep", "0.5",
                 "--layers-keep", str(tmp_path / "layers.json")]) == 0
    assert {l: len(k) for l, k in kept_of(tmp_path / "out").items()} == {1: 4, 2: 6}
    assert "moe_sparsity_config" in capsys.readouterr().out
    assert main(["prune", str(flat), str(tmp_path / "bad"), "--score", "l1", "--keep", "half"]) == 2
    assert "--keep 'half'" in capsys.readouterr().err

"""Checkpoints with transformers 5's fused expert tensors (`save_pretrained(...,
save_original_format=False)`: `mlp.experts.gate_up_proj` [E, 2 Im, H] and `mlp.experts.down_proj`
[E, H, Im] per MoE layer, and `mlp.gate.weight` even for Mixtral, whose hub names differ):

- the header-only tools (inspect, plan, data-free score, the layout every command checks) see the
  same experts as in the same model saved per expert, with the same numbers;
- `moejax prune` and `moejax merge` slice the expert axis and write the source's spelling back
  (fused in, fused out: the same tensor names and dtypes), which transformers loads and which
  computes what moejax computes on the source with the same experts masked (or merged);
- `moejax diff` audits such a pruning or merge like a per-expert one.
"""

import json

import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("transformers")

from family_fixtures import make_family_checkpoint  # noqa: E402
from hf_fixtures import batch, make_checkpoint  # noqa: E402
from test_merge_variants import layer_merges, logits  # noqa: E402
from test_prune import kept_of  # noqa: E402

from moejax.hf.io.checkpoint_reader import CheckpointReader  # noqa: E402
from moejax.hf.model_io import load_pretrained  # noqa: E402

E = 8
FAMILIES = ["deepseek_v3", "mixtral"]  # Mixtral: hub names block_sparse_moe.experts.E.w1/w3/w2, fused names mlp.*
EXPERTS_KEY = {"deepseek_v3": "n_routed_experts", "mixtral": "num_local_experts"}
FUSED = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
ROWS = FUSED + ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")  # [E, ...] tensors sliced by expert


@pytest.fixture(scope="module")
def fused(tmp_path_factory):
    """Per family: a fused checkpoint (DeepSeek-V3 sharded, so fused tensors sit in several shards),
    the same model saved per expert, transformers' model, and moejax's model of the fused source."""
    out = {}
    for family in FAMILIES:
        root = tmp_path_factory.mktemp(family)
        if family == "deepseek_v3":
            hf = make_checkpoint(root / "fused", seed=31, n_group=1, topk_group=1, max_shard_size="200KB",
                                 save_original_format=False)
        else:
            hf = make_family_checkpoint(family, root / "fused", seed=32, save_original_format=False)
        hf.save_pretrained(root / "per_expert")
        out[family] = root, hf
    return out


def source(fused, family):
    root, hf = fused[family]
    names = CheckpointReader(root / "fused").keys()
    assert "model.layers.1.mlp.experts.gate_up_proj" in names and not any(".experts.0." in n for n in names)
    return root, hf


_MODELS = {}


def moejax_model(root):
    """moejax's model of the fused source (loaded once: its jitted forwards are kept by `logits`)."""
    if root not in _MODELS:
        _MODELS[root] = load_pretrained(root / "fused")
    return _MODELS[root]


@pytest.mark.parametrize("family", FAMILIES)
def test_header_tools_see_the_experts_of_the_same_model_saved_per_expert(fused, family):
    """inspect, plan and data-free score give the same numbers on a fused checkpoint as on the same
    model saved per expert (only the path and the stored tensor count differ)."""
    from moejax.hf.check import check_checkpoint
    from moejax.scoring.score_checkpoint import score_data_free
    from moejax.surgery.inspect import inspect_checkpoint
    from moejax.surgery.plan import plan_checkpoint

    root, _ = source(fused, family)
    a, b = root / "fused", root / "per_expert"
    want, got = inspect_checkpoint(b), inspect_checkpoint(a)
    assert want["moe_layers"] and want["routed_experts"] == {str(l): E for l in want["moe_layers"]}
    n_moe = len(want["moe_layers"])
    assert got.pop("tensors") == want.pop("tensors") - n_moe * (3 * E - 2)  # stored: 2 fused, not 3 E
    assert got.pop("checkpoint") != want.pop("checkpoint")
    assert got == want
    want, got = plan_checkpoint(b), plan_checkpoint(a)
    assert got.pop("checkpoint") != want.pop("checkpoint")
    assert got == want
    assert want["constraints"]["routed_experts"] == [E]
    names = ["l1", "signed", "aimer"] + (["bias"] if family == "deepseek_v3" else [])  # aimer reads the experts
    want, got = score_data_free(b, scores=names), score_data_free(a, scores=names)
    assert len(want) == n_moe * E * len(names)
    assert got.equals(want)
    la, lb = check_checkpoint(a).layout, check_checkpoint(b).layout
    assert {l: ml.n_experts for l, ml in la.moe_layers.items()} == {l: ml.n_experts for l, ml in lb.moe_layers.items()}
    assert {l: ml.rests() for l, ml in la.moe_layers.items()} == {l: ml.rests() for l, ml in lb.moe_layers.items()}
    assert (la.router_names(), la.decoder_layers, la.other) == (lb.router_names(), lb.decoder_layers, lb.other)


def hf_logits(path, ids, mask):
    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager",
                                                           experts_implementation="eager").eval()
    with torch.no_grad():
        return hf(torch.as_tensor(ids, dtype=torch.long), attention_mask=torch.as_tensor(mask)).logits.float().numpy()


def rows(reader, name, kept):
    """Rows `kept` of a [E, ...] tensor as the source's bytes, one per row."""
    data = reader.read_bytes(name)
    row = len(data) // reader.info(name).shape[0]
    return [data[i * row:(i + 1) * row] for i in kept]


def check_same_spelling(src, dst, kept, same_expert=lambda layer, new, old: True):
    """dst stores the source's tensors under the same names and dtypes; [E, ...] tensors of MoE
    layers (fused experts, router, bias) hold rows `kept` of the source's (expert slabs compared
    only where same_expert says they are copies), every other tensor is the source's bytes."""
    a, b = CheckpointReader(src), CheckpointReader(dst)
    assert b.keys() == a.keys()
    for name in a.keys():
        ia, ib = a.info(name), b.info(name)
        assert ia.dtype == ib.dtype, name
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else None
        if layer in kept and name.endswith(ROWS):
            assert tuple(ib.shape) == (len(kept[layer]),) + tuple(ia.shape[1:]), name
            got = rows(b, name, range(len(kept[layer])))
            for new, (old, want) in enumerate(zip(kept[layer], rows(a, name, kept[layer]))):
                if not name.endswith(FUSED) or same_expert(layer, new, old):
                    assert got[new] == want, (name, new, old)
        else:
            assert a.read_bytes(name) == b.read_bytes(name), name


@pytest.mark.parametrize("family", FAMILIES)
def test_pruned_fused_checkpoint_stays_fused_and_equals_the_masked_source(fused, family, tmp_path):
    from moejax.surgery.diff import diff_checkpoints, failed_checks
    from moejax.surgery.prune import prune_checkpoint

    root, _ = source(fused, family)
    src, dst = root / "fused", tmp_path / "pruned"
    prune_checkpoint(src, dst, score="l1", keep=4)
    kept = kept_of(dst)
    assert kept and all(len(k) == 4 for k in kept.values())
    check_same_spelling(src, dst, kept)
    config = json.loads((dst / "config.json").read_text())
    assert config == {**json.loads((src / "config.json").read_text()), EXPERTS_KEY[family]: 4}
    ids, mask = batch(96, seed=5)
    model = moejax_model(root)
    masks = np.ones((model.config.num_hidden_layers, E), bool)
    for layer, k in kept.items():
        masks[layer] = np.isin(np.arange(E), k)
    want = logits(model, ids, mask, jnp.asarray(masks))
    valid = mask.astype(bool)
    got = hf_logits(dst, ids, mask)
    assert np.abs(got - want)[valid].max() < 2e-4 * max(1.0, np.abs(want).max())
    assert np.abs(logits(model, ids, mask) - want)[valid].max() > 1e-2  # pruning changed the logits
    report = diff_checkpoints(src, dst, hash_tensors=True)
    assert {int(l): e["kept"] for l, e in report["layers"].items()} == kept
    assert failed_checks(report) == [] and report["tensors"]["compared"] > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_merged_fused_checkpoint_stays_fused_and_equals_the_shrunk_variant(fused, family, tmp_path):
    from moejax.cli import main
    from moejax.surgery.diff import diff_checkpoints, failed_checks

    root, _ = source(fused, family)
    src, dst = root / "fused", tmp_path / "merged"
    tokens = tmp_path / "calib.npy"
    calib = np.random.default_rng(6).integers(0, 96, size=(4, 20)).astype(np.int32)
    np.save(tokens, calib)
    assert main(["merge", str(src), str(dst), "--method", "m_smoe", "--keep", "4", "--tokens", str(tokens)]) == 0
    record = json.loads((dst / "pruning.json").read_text())
    model = moejax_model(root)
    merges = layer_merges(model, calib, "m_smoe", 4)  # the in-memory merge (the streamed pass equals it)
    clusters = {}
    for l, lm in merges.items():
        assert record["layers"][str(l)]["kept"] == sorted(lm.leaders.tolist())
        clusters[l] = {c[0]: c for c in record["layers"][str(l)]["clusters"]}  # by leader
    kept = kept_of(dst)
    single = lambda layer, new, old: len(clusters[layer][old]) == 1  # noqa: E731
    check_same_spelling(src, dst, kept, single)
    b = CheckpointReader(dst)
    merged = 0
    for layer, k in kept.items():  # a merged cluster's slab is not its leader's
        for new, old in enumerate(k):
            if not single(layer, new, old):
                merged += 1
                assert rows(b, f"model.layers.{layer}.mlp.experts.down_proj", [new]) != \
                    rows(CheckpointReader(src), f"model.layers.{layer}.mlp.experts.down_proj", [old])
    assert merged
    ids, mask = batch(96, seed=7)
    want = logits(model, ids, mask, {l: lm.expert_map("shrunk") for l, lm in merges.items()})
    valid = mask.astype(bool)
    np.testing.assert_allclose(hf_logits(dst, ids, mask)[valid], want[valid], atol=1e-4, rtol=1e-4)
    report = diff_checkpoints(src, dst, hash_tensors=True)
    assert {int(l): e["kept"] for l, e in report["layers"].items()} == kept
    assert failed_checks(report) == ["other_tensors_identical"]
    assert len(report["tensors"]["bytes_differ"]) == 3 * merged  # gate, up and down of each merged expert


def test_a_fused_tensor_of_the_wrong_rank_is_refused_by_name(fused, tmp_path):
    """A fused expert tensor that is not [E, rows, cols] is not presented as experts: the check names
    it and the expert tensors it should hold (no traceback from slicing it)."""
    from hf_fixtures import rewrite

    from moejax.errors import CheckpointError
    from moejax.hf.check import check_checkpoint

    root, _ = source(fused, "mixtral")
    name = "model.layers.1.mlp.experts.gate_up_proj"
    bad = rewrite(root / "fused", tmp_path / "bad", lambda n, r: [(n, r.read(n).reshape(E, -1) if n == name else r.read(n))])
    with pytest.raises(CheckpointError, match=rf"{2 * E} tensor\(s\) missing.*layers\.1\.block_sparse_moe\.experts\.0\."
                                              rf"(?s:.*)unexpected tensor\(s\), e\.g\. \['{name}'\]"):
        check_checkpoint(bad)

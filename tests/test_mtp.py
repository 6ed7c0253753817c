"""MTP layers (DeepSeek-V3's `model.layers.{L}`, Qwen3.5-MoE's `mtp.*`): the calibration pass runs
them as transformers' MTP model (`transformers.modeling_layers.MtpModel`, what `generate(...,
use_mtp=True)` drafts with) does, their scores equal float64 numpy over that model's hooks, and
`--mtp prune|keep|drop` gives outputs transformers loads with the MTP weights present."""

import json
import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from family_fixtures import make_family_checkpoint  # noqa: E402
from hf_fixtures import assert_scores_match, make_checkpoint, reference_scores, rewrite, with_mtp  # noqa: E402

from moejax.cli import main  # noqa: E402
from moejax.hf.io.checkpoint_reader import CheckpointReader  # noqa: E402
from moejax.hf.model_io import open_checkpoint  # noqa: E402
from moejax.scoring.observe import calibrate_streamed  # noqa: E402

L = 3  # every fixture has three decoder layers: the MTP layer is layer 3
DSA = ("deepseek_v32", "glm_moe_dsa")
B, S = 3, 14


def _fused_mtp_experts(name, reader):
    """Qwen3.5's per-expert MTP experts as one fused pair, which transformers' MTP weight conversion
    reads (the same values; moejax reads the per-expert spelling the Hub ships)."""
    m = re.match(r"mtp\.layers\.0\.mlp\.experts\.(\d+)\.(\w+)\.weight$", name)
    if not m:
        return [(name, reader.read(name))]
    if m.group(1) != "0" or m.group(2) != "gate_proj":
        return []
    E = len([n for n in reader.keys() if re.match(r"mtp\.layers\.0\.mlp\.experts\.\d+\.down_proj\.weight$", n)])
    w = lambda e, p: reader.read(f"mtp.layers.0.mlp.experts.{e}.{p}.weight")  # noqa: E731
    return [("mtp.layers.0.mlp.experts.gate_up_proj",
             np.stack([np.concatenate([w(e, "gate_proj"), w(e, "up_proj")]) for e in range(E)])),
            ("mtp.layers.0.mlp.experts.down_proj", np.stack([w(e, "down_proj") for e in range(E)]))]


def load_reference(family, path):
    """(transformers' main model, its MTP model) of a checkpoint with one MTP layer. DeepSeek-V3's
    MTP weights are found by the model's `_keys_to_ignore_on_load_unexpected` pattern, written for
    the full-size layer 61: set to the tiny model's layer. Qwen3.5-MoE's config has no MTP fields
    (given here), and transformers picks the MTP norms' class as the last layer's first `norm`
    module (a DeltaNet layer's gated norm): the family's RMSNorm is put back with the loaded weights."""
    from transformers.modeling_layers import MtpModel

    if family == "deepseek_v3":
        from transformers import DeepseekV3ForCausalLM as cls

        patterns = [rf"model\.layers\.{L}.*"]
        config = None
    elif family in DSA:   # no MTP fields in their configs: one MTP layer, an indexer of its own (a "full" layer)
        from transformers import AutoConfig, AutoModelForCausalLM

        patterns = [rf"model\.layers\.{L}.*"]
        config = AutoConfig.from_pretrained(path)
        config.num_mtp_layers, config.mtp_layer_types, config.mtp_mlp_layer_types = 1, ["full_attention"], ["sparse"]
        if family == "glm_moe_dsa":
            config.indexer_types = [*config.indexer_types, "full"]
        cls = type(AutoModelForCausalLM.from_config(config))
    else:
        from transformers import AutoConfig
        from transformers import Qwen3_5MoeForConditionalGeneration as cls

        patterns = cls._keys_to_ignore_on_load_unexpected
        config = AutoConfig.from_pretrained(path)
        config.text_config.num_mtp_layers, config.text_config.mtp_layer_types = 1, ["full_attention"]
    saved = cls._keys_to_ignore_on_load_unexpected
    cls._keys_to_ignore_on_load_unexpected = patterns
    try:
        hf = cls.from_pretrained(path, **({"config": config} if config else {}), attn_implementation="eager",
                                 experts_implementation="eager").eval()
        mtp = MtpModel.from_pretrained(hf).eval()
    finally:
        cls._keys_to_ignore_on_load_unexpected = saved
    if family == "qwen3_5_moe":
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeRMSNorm

        for name in ("enorm", "hnorm", "post_norm"):
            old = getattr(mtp.layers[0], name)
            new = Qwen3_5MoeRMSNorm(old.weight.shape[0], eps=config.text_config.rms_norm_eps)
            new.weight.data.copy_(old.weight.data)
            setattr(mtp.layers[0], name, new)
    return hf, mtp


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{family: (moejax's checkpoint, the one transformers loads)}: DeepSeek-V3 and Qwen3.5-MoE, each
    with one MTP layer made to matter (`with_mtp`)."""
    root = tmp_path_factory.mktemp("mtp")
    make_checkpoint(root / "ds_plain", seed=31)
    make_family_checkpoint("qwen3_5_moe", root / "q_plain", seed=32)
    ds = with_mtp(root / "ds_plain", root / "deepseek_v3")
    q = with_mtp(root / "q_plain", root / "qwen3_5_moe")
    out = {"deepseek_v3": (ds, ds), "qwen3_5_moe": (q, rewrite(q, root / "q_fused", _fused_mtp_experts))}
    for i, family in enumerate(DSA):   # GLM-5 with GLM-5.2's shared layer 1
        make_family_checkpoint(family, root / f"{family}_plain", seed=33 + i,
                               **(dict(indexer_types=["full", "shared", "full"]) if family == "glm_moe_dsa" else {}))
        out[family] = (with_mtp(root / f"{family}_plain", root / family),) * 2
    return out


def reference_pass(family, path, ids, dtype=None):
    """transformers' MTP layer run as its drafting runs it, teacher-forced: the trunk's last hidden
    state (`hidden_states[-1]`, after the final norm) at positions 0..S-2 beside the tokens 1..S-1
    at their positions; returns (what its router saw and chose, per `hook_router`'s record; its
    block; the drafted logits [B, S-1, V]). dtype: both models cast to it (torch.float64: the
    float32 run's own rounding measured)."""
    hf, mtp = load_reference(family, path)
    if dtype is not None:
        hf, mtp = hf.to(dtype), mtp.to(dtype)
    layer = mtp.layers[0]
    seen = {}
    hook = layer.mtp_block.mlp.gate.register_forward_hook(
        lambda mod, inp, out: seen.__setitem__(L, (inp[0].reshape(-1, inp[0].shape[-1]), *out)))
    with torch.no_grad():
        t = torch.as_tensor(ids, dtype=torch.long)
        last = hf(t, output_hidden_states=True).hidden_states[-1]
        positions = torch.arange(1, ids.shape[1])[None].expand(ids.shape[0], -1)
        try:
            state = mtp.forward_layer(0, last[:, :-1], positions, None, input_ids=t[:, 1:])
            logits = mtp._project_to_logits(state).numpy()
        except AttributeError:   # GLM-5's decoder layer returns (hidden states, selection), which
            if family != "glm_moe_dsa":   # MtpModel's post_norm does not expect: the block (and its
                raise                      # router's hook) ran; no drafted logits
            logits = None
    hook.remove()
    return seen, layer.mtp_block.mlp, logits


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_5_moe", *DSA])
def test_mtp_pass_and_scores_equal_transformers_mtp_model(checkpoints, family):
    """The streamed pass runs the MTP layer on what transformers' MTP model computes (router inputs
    within float32 rounding), and every score of the MTP layer equals float64 numpy over that
    model's hooks; the trunk's layers are scored as before. The DSA families' MTP layer runs an
    indexer of its own (14 tokens, index_topk 4: its selection decides the block's output)."""
    ours, theirs = checkpoints[family]
    ids = np.random.default_rng(5).integers(0, 96, size=(B, S))
    seen, block, _ = reference_pass(family, theirs, ids)
    mask = np.ones((B, S), np.int64)
    mask[2, -4:] = 0   # right padding, which changes no real token: the MTP rows of tokens 1..S-1 it masks are left out
    want = reference_scores(None, seen, mask[:, 1:], blocks={L: block})[L]
    from moejax.inference.stream import stream_layers

    ckpt = open_checkpoint(ours)
    assert ckpt.mtp_layers() == [L]
    routed = {l: np.concatenate([np.asarray(r) for r in ri]) for l, _, ri in stream_layers(ckpt, [(ids, None)], mtp=True)}
    x = seen[L][0].numpy()
    if family != "qwen3_5_moe":
        np.testing.assert_allclose(routed[L], x, rtol=0, atol=1e-5 * np.abs(x).max())
    else:   # DeltaNet layers: float32's own rounding reaches 1e-5 of the largest entry here (transformers'
        # 5.0e-5 at 4.4 against its float64 run): within 3x transformers' own error against float64
        exact = reference_pass(family, theirs, ids, torch.float64)[0][L][0].numpy()
        assert np.abs(routed[L] - exact).max() <= 3 * np.abs(x - exact).max()
    stats = calibrate_streamed(ckpt, [(ids[:2], mask[:2]), (ids[2:], mask[2:])], progress=False, interventions=True)
    assert max(stats) == L and L - 1 in stats
    assert_scores_match(stats[L], want, f"{family} MTP layer", rtol=1e-4, atol_scale=1e-5)


@pytest.fixture(scope="module")
def calibration(checkpoints, tmp_path_factory):
    """Calibration tokens and each family's `moejax score` table (its MTP layer included)."""
    root = tmp_path_factory.mktemp("mtp_scores")
    np.save(root / "calib.npy", np.random.default_rng(9).integers(0, 96, size=(4, 20)).astype(np.int32))
    for family, (src, _) in checkpoints.items():
        assert main(["score", str(src), "--tokens", str(root / "calib.npy"), "--out", str(root / f"{family}.parquet")]) == 0
    return root


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_5_moe"])
def test_mtp_prune_keeps_the_mtp_layers_own_best_and_loads_in_transformers_mtp_model(checkpoints, calibration,
                                                                                    family, tmp_path):
    """--mtp prune (the default): the MTP layer keeps the trunk's count, its own top experts by its own
    scores; transformers' MTP model loads the output with no MTP weight missing and computes what
    moejax's pass computes on it."""
    import pandas as pd

    src, _ = checkpoints[family]
    table = pd.read_parquet(calibration / f"{family}.parquet")
    assert L in set(table.layer)
    dst = tmp_path / "pruned"
    groups = ["--collapse-groups"] if family == "deepseek_v3" else []  # the fixture routes by 4 groups
    assert main(["prune", str(src), str(dst), "--score", "reap", "--scores-file", str(calibration / f"{family}.parquet"),
                 "--keep", "4", *groups]) == 0
    record = json.loads((dst / "pruning.json").read_text())
    reap = table[(table.layer == L) & (table.score == "reap")].sort_values("expert").value.to_numpy()
    assert record["mtp"] == "prune" and record["layers"][str(L)]["kept"] == sorted(np.argsort(-reap, kind="stable")[:4])
    theirs = dst if family == "deepseek_v3" else rewrite(dst, tmp_path / "fused", _fused_mtp_experts)
    ids = np.random.default_rng(2).integers(0, 96, size=(2, 12))
    seen, _, _ = reference_pass(family, theirs, ids)  # raises on any MTP weight missing
    from moejax.inference.stream import stream_layers

    routed = {l: np.concatenate([np.asarray(r) for r in ri]) for l, _, ri in stream_layers(str(dst), [(ids, None)], mtp=True)}
    x = seen[L][0].numpy()
    if family != "qwen3_5_moe":
        np.testing.assert_allclose(routed[L], x, rtol=0, atol=1e-5 * np.abs(x).max())
    else:   # DeltaNet layers: float32's own rounding reaches 1e-5 of the largest entry here (transformers'
        # 5.0e-5 at 4.4 against its float64 run): within 3x transformers' own error against float64
        exact = reference_pass(family, theirs, ids, torch.float64)[0][L][0].numpy()
        assert np.abs(routed[L] - exact).max() <= 3 * np.abs(x - exact).max()


def test_mtp_keep_and_drop(checkpoints, tmp_path):
    """--mtp keep: the MTP layer's tensors are the source's bytes, its count listed per layer
    (moejax reads it; transformers' main model loads the trunk); --mtp drop: no MTP tensor left,
    num_nextn_predict_layers 0, and transformers loads it with no key unexpected."""
    src, _ = checkpoints["deepseek_v3"]
    assert main(["prune", str(src), str(tmp_path / "keep"), "--score", "l1", "--keep", "4", "--mtp", "keep",
                 "--collapse-groups"]) == 0
    a, b = CheckpointReader(src), CheckpointReader(tmp_path / "keep")
    mtp_names = [n for n in a.keys() if n.startswith(f"model.layers.{L}.")]
    assert all(a.read_bytes(n) == b.read_bytes(n) for n in mtp_names)
    config = json.loads((tmp_path / "keep" / "config.json").read_text())
    assert config["n_routed_experts"] == 4 and config["moe_sparsity_config"]["num_experts"] == [None, 4, 4, 8]
    assert open_checkpoint(tmp_path / "keep").mtp_layers() == [L]
    transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "keep")  # the trunk loads
    assert main(["prune", str(src), str(tmp_path / "drop"), "--score", "l1", "--keep", "4", "--mtp", "drop",
                 "--collapse-groups"]) == 0
    assert not any(n.startswith(f"model.layers.{L}.") for n in CheckpointReader(tmp_path / "drop").keys())
    assert json.loads((tmp_path / "drop" / "config.json").read_text())["num_nextn_predict_layers"] == 0
    _, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "drop", output_loading_info=True)
    assert not info["unexpected_keys"] and not info["missing_keys"]


def test_merge_merges_the_mtp_layer_and_loads_in_transformers_mtp_model(checkpoints, calibration, tmp_path):
    """merge --mtp prune: the MTP layer merged to the trunk's count on its own statistics; transformers'
    MTP model loads it."""
    src, _ = checkpoints["deepseek_v3"]
    dst = tmp_path / "merged"
    assert main(["merge", str(src), str(dst), "--method", "hc_smoe", "--keep", "4", "--collapse-groups",
                 "--tokens", str(calibration / "calib.npy")]) == 0
    record = json.loads((dst / "pruning.json").read_text())
    assert len(record["layers"][str(L)]["clusters"]) == 4
    _, mtp = load_reference("deepseek_v3", dst)
    assert mtp.layers[0].mtp_block.mlp.gate.weight.shape[0] == 4


def test_substitute_follows_the_mtp_policy(checkpoints, calibration, tmp_path):
    """prune --substitute: --mtp prune substitutes the MTP layer's experts by their own constants
    (named under its layer); --mtp drop removes it (num_nextn_predict_layers 0, no tensor left)."""
    src, _ = checkpoints["deepseek_v3"]
    common = ["--substitute", "--score", "mone", "--keep", "4", "--tokens", str(calibration / "calib.npy")]
    assert main(["prune", str(src), str(tmp_path / "sub"), *common]) == 0
    record = json.loads((tmp_path / "sub" / "pruning.json").read_text())
    assert len(record["layers"][str(L)]["substituted"]) == 4
    names = CheckpointReader(tmp_path / "sub").keys()
    assert sum(n.startswith(f"model.layers.{L}.mlp.experts.") and n.endswith(".approx_value") for n in names) == 4
    assert main(["prune", str(src), str(tmp_path / "drop"), *common, "--mtp", "drop"]) == 0
    assert not any(n.startswith(f"model.layers.{L}.") for n in CheckpointReader(tmp_path / "drop").keys())
    assert json.loads((tmp_path / "drop" / "config.json").read_text())["num_nextn_predict_layers"] == 0


def test_substitute_refuses_an_mtp_block_its_format_cannot_name(checkpoints, calibration, tmp_path, monkeypatch, capsys):
    """Qwen3.5-MoE's MTP block is stored apart (`mtp.layers.0.mlp.experts`), and constant-v1 reads a
    target's decoder layer from the one integer in its path (layer 0 here): --mtp prune is refused
    naming it, before the calibration pass and with nothing written (it wrote a folder no reader
    could parse); --mtp keep substitutes the trunk, writes the MTP block whole and reads back."""
    import moejax.inference.stream as stream
    from moejax.surgery.substitute import load_substituted

    src, _ = checkpoints["qwen3_5_moe"]
    common = ["--substitute", "--score", "mone", "--keep", "4", "--tokens", str(calibration / "calib.npy")]
    with monkeypatch.context() as m:
        m.setattr(stream, "stream_layers", lambda *a, **k: pytest.fail("the calibration pass ran"))
        assert main(["prune", str(src), str(tmp_path / "sub"), *common]) == 2
    assert "mtp.layers.0.mlp.experts" in capsys.readouterr().err and not (tmp_path / "sub").exists()
    assert main(["prune", str(src), str(tmp_path / "keep"), *common, "--mtp", "keep"]) == 0
    reader = CheckpointReader(tmp_path / "keep")
    assert all(reader.read_bytes(n) == CheckpointReader(src).read_bytes(n) for n in reader.keys() if n.startswith("mtp."))
    _, maps = load_substituted(tmp_path / "keep")
    assert sorted(maps) == [0, 1, 2]

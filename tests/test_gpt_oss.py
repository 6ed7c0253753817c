"""gpt-oss beyond the shared family tests (tests/test_families.py runs every registered family,
gpt-oss included): generation past the sliding window, the sinks and the window being what makes
moejax equal transformers (each removed, it differs), its config refusals, and merging its experts
(neurons as interleaved gate/up pairs) against transformers."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from family_fixtures import make_family_checkpoint  # noqa: E402
from hf_fixtures import batch, hook_router, padded_logits_equal  # noqa: E402

from moejax import AutoModelForCausalLM  # noqa: E402
from moejax.errors import ConfigError  # noqa: E402
from moejax.inference.generate import generate  # noqa: E402
from moejax.models.gpt_oss.presets import TEST  # noqa: E402
from moejax.models.registry import config_from_dict  # noqa: E402


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt_oss") / "ckpt"
    hf = make_family_checkpoint("gpt_oss", path, seed=41)
    return path, hf, AutoModelForCausalLM.from_pretrained(path, dtype=jnp.float32)


def test_greedy_generation_past_the_window_equals_transformers(gpt_oss):
    """Prompts of 12 and 9 real tokens against a window of 8, left padded, 8 new tokens: the
    sliding layers' cache must forget exactly what transformers' forgets."""
    _, hf, model = gpt_oss
    assert TEST["sliding_window"] == 8
    ids = np.random.default_rng(3).integers(2, 96, size=(2, 12))
    mask = np.ones_like(ids)
    mask[1, :3] = 0
    with torch.no_grad():
        want = hf.generate(input_ids=torch.as_tensor(ids), attention_mask=torch.as_tensor(mask), max_new_tokens=8,
                           do_sample=False, eos_token_id=None, pad_token_id=0).numpy()
    np.testing.assert_array_equal(np.asarray(generate(model, ids, mask, max_new_tokens=8)), want)


@pytest.mark.parametrize("removed", ["sinks", "window"])
def test_sinks_and_window_are_what_makes_it_exact(gpt_oss, removed):
    """The forward equals transformers (test_families); with the sinks at -inf (no sink) or the
    window opened (full attention everywhere) it does not: both are exercised by the fixture."""
    _, hf, model = gpt_oss
    ids, mask = batch(96, seed=5, S=20)
    want, _ = hook_router(hf, ids, mask)
    m = mask.astype(bool)
    exact = np.asarray(model(jnp.asarray(ids), jnp.asarray(mask)).logits_BSV)
    assert np.abs(exact[m] - want[m]).max() < 1e-4
    for layer in model.model.layers:
        if removed == "sinks":
            layer.self_attn.sinks[...] = jnp.full_like(layer.self_attn.sinks[...], -1e9)
        else:
            layer.self_attn.window = None
    try:
        changed = np.asarray(model(jnp.asarray(ids), jnp.asarray(mask)).logits_BSV)
    finally:  # the fixture's model is shared: put it back
        fresh = AutoModelForCausalLM.from_pretrained(gpt_oss[0], dtype=jnp.float32)
        for layer, good in zip(model.model.layers, fresh.model.layers):
            layer.self_attn.sinks[...] = good.self_attn.sinks[...]
            layer.self_attn.window = good.self_attn.window
    assert np.abs(changed[m] - want[m]).max() > 1e-2


def test_layer_types_default_alternate_and_are_checked():
    base = {"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], **TEST}
    base.pop("rope_parameters")
    cfg = config_from_dict(base)
    assert [cfg.attention_window(l) for l in range(3)] == [8, None, 8]  # transformers: even layers slide
    with pytest.raises(ConfigError, match="layer_types.*2 entries, expected num_hidden_layers=3"):
        config_from_dict({**base, "layer_types": ["full_attention", "sliding_attention"]})
    with pytest.raises(ConfigError, match="layer_types=.*expected a list of 'sliding_attention' or 'full_attention'"):
        config_from_dict({**base, "layer_types": ["full_attention", "linear_attention", "full_attention"]})
    with pytest.raises(ConfigError, match="rope_type='longrope'"):
        config_from_dict({**base, "rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}})


def write_mxfp4(src, dst) -> None:
    """The float checkpoint `src` as gpt-oss ships its experts (`quant_method: mxfp4`): each MoE
    layer's gate_up_proj and down_proj as *_blocks uint8 [E, out, in/32, 16] and *_scales uint8
    [E, out, in/32] (moejax's encoder; what transformers decodes is the reference), every other
    tensor as it is."""
    from safetensors.numpy import load_file, save_file

    from moejax.hf.quant.encode import quantize_mxfp4

    dst.mkdir()
    out = {}
    for name, value in load_file(src / "model.safetensors").items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            packed = [quantize_mxfp4(np.ascontiguousarray(w.T)) for w in value]   # per expert [out, in]
            out[name + "_blocks"] = np.stack([p.reshape(p.shape[0], -1, 16) for p, _ in packed])
            out[name + "_scales"] = np.stack([sc for _, sc in packed])
        else:
            out[name] = value
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (dst / "config.json").write_text(json.dumps(config))


def transformers_mxfp4(path):
    """transformers' own reading of a gpt-oss MXFP4 checkpoint on CPU: dequantised, float32."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        path, quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.float32,
        attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def gpt_oss_mxfp4(gpt_oss, tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt_oss_mxfp4") / "ckpt"
    write_mxfp4(gpt_oss[0], path)
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=jnp.float32)


def test_mxfp4_checkpoint_equals_transformers_and_saves_back_its_bytes(gpt_oss_mxfp4, tmp_path):
    """gpt-oss's own MXFP4 layout is read through the per-expert view (each expert's slab of the
    fused *_blocks / *_scales) and the MXFP4 decoder: every decoded expert matrix equals
    transformers' dequantisation exactly, the logits on a padded batch equal transformers' model,
    inspect counts the packed values, and load-then-save gives back every tensor's bytes."""
    from moejax.cli import main
    from moejax.hf.io.checkpoint_reader import CheckpointReader
    from moejax.hf.model_io import save_pretrained

    path, model = gpt_oss_mxfp4
    hf = transformers_mxfp4(path)
    for l, layer in enumerate(model.model.layers):
        ex = hf.model.layers[l].mlp.experts
        np.testing.assert_array_equal(np.asarray(layer.mlp.experts_gate_up[...]), ex.gate_up_proj.detach().numpy())
        np.testing.assert_array_equal(np.asarray(layer.mlp.experts_down[...]), ex.down_proj.detach().numpy())
    padded_logits_equal(model, hf, 96, seed=5)
    assert main(["inspect", str(path)]) == 0
    save_pretrained(model, tmp_path / "saved")
    a, b = CheckpointReader(path), CheckpointReader(tmp_path / "saved")
    assert a.keys() == b.keys() and any(n.endswith("_blocks") for n in a.keys())
    assert all(a.read_bytes(n) == b.read_bytes(n) for n in a.keys())


def test_mxfp4_prune_writes_the_kept_experts_bytes_and_loads_in_transformers(gpt_oss_mxfp4, tmp_path, capsys):
    """`moejax prune` on gpt-oss MXFP4: the kept experts' blocks and scales are the source's bytes
    (not re-quantised), transformers loads the output and equals moejax's masked source; `merge`,
    which averages float weights, refuses it by name before any pass, and a *_blocks tensor of the
    wrong shape is refused by the one check, naming it."""
    from moejax.cli import main
    from moejax.hf.io.checkpoint_reader import CheckpointReader

    path, model = gpt_oss_mxfp4
    dst = tmp_path / "pruned"
    assert main(["prune", str(path), str(dst), "--score", "l1", "--keep", "4"]) == 0
    layers = json.loads((dst / "pruning.json").read_text())["layers"]
    a, b = CheckpointReader(path), CheckpointReader(dst)
    for l, layer in layers.items():
        for part in ("gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks", "down_proj_scales"):
            name = f"model.layers.{l}.mlp.experts.{part}"
            assert b.read(name).tobytes() == a.read(name)[layer["kept"]].tobytes()
    masks = np.zeros((len(model.model.layers), 8), bool)
    for l, layer in layers.items():
        masks[int(l), layer["kept"]] = True
    ids, mask = batch(96, seed=6, S=20)
    with torch.no_grad():
        got = transformers_mxfp4(dst)(torch.as_tensor(ids), attention_mask=torch.as_tensor(mask)).logits.numpy()
    want = np.asarray(model(jnp.asarray(ids), jnp.asarray(mask), variant=masks).logits_BSV)
    valid = mask.astype(bool)
    np.testing.assert_allclose(got[valid], want[valid], atol=1e-4, rtol=1e-4)
    np.save(tmp_path / "ids.npy", ids.astype(np.int32))
    assert main(["merge", str(path), str(tmp_path / "m"), "--method", "hc_smoe", "--keep", "4",
                 "--tokens", str(tmp_path / "ids.npy")]) == 2
    assert "quantised (gpt_oss_mxfp4)" in capsys.readouterr().err and not (tmp_path / "m").exists()
    from safetensors.numpy import load_file, save_file

    bad = tmp_path / "bad"
    bad.mkdir()
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.1.mlp.experts.down_proj_blocks"] = tensors["model.layers.1.mlp.experts.down_proj_blocks"][:, :32]
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    (bad / "config.json").write_bytes((path / "config.json").read_bytes())
    with pytest.raises(Exception, match=r"model\.layers\.1\.mlp\.experts\.down_proj_blocks.*shape \[32, 1, 16\]"):
        AutoModelForCausalLM.from_pretrained(bad)


def _experts_of(hf, layer: int) -> dict:
    """transformers' experts of a layer as moejax's clamped-SwiGLU layer {name: [E, ...]} ([in, out])."""
    ex = hf.model.layers[layer].mlp.experts
    return {k: getattr(ex, name).detach().float().numpy().astype(np.float64) for k, name in
            (("gate_up", "gate_up_proj"), ("gate_up_bias", "gate_up_proj_bias"), ("down", "down_proj"),
             ("down_bias", "down_proj_bias"))}


def _aligned(leader: dict, member: dict) -> dict:
    """M-SMoE's alignment from the definition, written here on gpt-oss's tensors: neuron i's
    features are gate_up columns 2i (gate) and 2i + 1 (up), the same two bias entries and down row
    i; scipy's Hungarian assignment maximises the summed inner products of the leader's neurons and
    the member's; the member's neurons (gate/up pairs, bias pairs, down rows) move to their places,
    down_bias as it is."""
    from scipy.optimize import linear_sum_assignment

    def features(e):
        gu, b = e["gate_up"], e["gate_up_bias"]
        return np.concatenate([gu[:, 0::2].T, gu[:, 1::2].T, b[0::2, None], b[1::2, None], e["down"]], axis=1)

    rows, cols = linear_sum_assignment(features(leader) @ features(member).T, maximize=True)
    perm = np.empty(len(rows), np.int64)
    perm[rows] = cols
    pairs = np.stack([2 * perm, 2 * perm + 1], axis=1).reshape(-1)
    return {"gate_up": member["gate_up"][:, pairs], "gate_up_bias": member["gate_up_bias"][pairs],
            "down": member["down"][perm], "down_bias": member["down_bias"]}


@pytest.mark.parametrize("method", ["hc_smoe", "m_smoe", "ream"])
def test_merged_checkpoint_loads_in_transformers_and_equals_the_definitions(gpt_oss, method, tmp_path):
    """`moejax merge` on gpt-oss (neurons as interleaved gate/up pairs, biased, clamped; fused
    tensors): transformers loads the output with no missing, unexpected or mismatched key, and its
    logits on a padded batch equal moejax's of the same checkpoint; every merged expert equals the
    definition over transformers' own source tensors, written here (HC-SMoE the frequency-weighted
    average, M-SMoE the same after aligning each member's neuron pairs onto its leader by scipy's
    assignment, `_aligned`; REAM, whose
    alignment reads the clamped experts' hidden activations, merged and loaded alike); a singleton
    cluster is its source expert exactly, and the merge changed the model."""
    import transformers

    from moejax.cli import main
    path, hf, source = gpt_oss
    tokens = tmp_path / "ids.npy"
    np.save(tokens, np.random.default_rng(8).integers(2, 96, size=(4, 24)).astype(np.int32))
    dst = tmp_path / method
    assert main(["merge", str(path), str(dst), "--method", method, "--keep", "4", "--tokens", str(tokens)]) == 0
    record = json.loads((dst / "pruning.json").read_text())
    merged, info = transformers.AutoModelForCausalLM.from_pretrained(dst, output_loading_info=True,
                                                                     attn_implementation="eager")
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert merged.config.num_local_experts == 4
    n_merged = 0
    for l, layer in record["layers"].items():
        src, out = _experts_of(hf, int(l)), _experts_of(merged, int(l))
        for new, cluster in enumerate(sorted(layer["clusters"], key=lambda c: c[0])):   # leader first
            experts = [{k: v[j] for k, v in src.items()} for j in cluster]
            if len(cluster) == 1:
                for k in src:
                    np.testing.assert_array_equal(out[k][new], src[k][cluster[0]])
                continue
            n_merged += 1
            if method != "ream":
                if method == "m_smoe":   # each member's neurons onto the leader's (cluster[0])
                    experts = [experts[0]] + [_aligned(experts[0], e) for e in experts[1:]]
                freq = np.array([layer["counts"][j] for j in cluster], np.float64)
                share = freq / freq.sum() if freq.sum() > 0 else np.full(len(freq), 1 / len(freq))
                want = {k: sum(w * e[k] for w, e in zip(share, experts)) for k in src}
                for k in src:
                    np.testing.assert_allclose(out[k][new], want[k], rtol=1e-5, atol=1e-6, err_msg=f"{l} {k}")
    assert n_merged > 0
    ids, mask = batch(96, seed=7, S=20)
    valid = mask.astype(bool)
    with torch.no_grad():
        got = merged(torch.as_tensor(ids, dtype=torch.long), attention_mask=torch.as_tensor(mask)).logits.numpy()
    ours = np.asarray(AutoModelForCausalLM.from_pretrained(dst, dtype=jnp.float32)(jnp.asarray(ids), jnp.asarray(mask))
                      .logits_BSV)
    np.testing.assert_allclose(got[valid], ours[valid], atol=1e-4, rtol=1e-4)
    unmerged = np.asarray(source(jnp.asarray(ids), jnp.asarray(mask)).logits_BSV)
    assert np.abs(ours[valid] - unmerged[valid]).max() > 1e-3


def test_carried_merges_equal_the_merged_checkpoint_in_transformers(gpt_oss, tmp_path):
    """The carried pass's M-SMoE variant of gpt-oss (its rows made when read, gpt-oss's neuron
    pairs permuted in JAX) has the held-out perplexity transformers computes on `moejax merge`'s
    checkpoint of the same calibration tokens."""
    import pandas as pd
    import transformers

    from moejax.cli import main
    from moejax.evaluation.carried import evaluate_pruning
    from moejax.hf.model_io import open_checkpoint
    from moejax.merging.method import parse

    path = gpt_oss[0]
    calib = np.random.default_rng(8).integers(2, 96, size=(4, 24)).astype(np.int32)
    heldout = np.random.default_rng(9).integers(2, 96, size=(3, 20)).astype(np.int32)
    np.save(tmp_path / "ids.npy", calib)
    assert main(["merge", str(path), str(tmp_path / "m"), "--method", "m_smoe", "--keep", "4",
                 "--tokens", str(tmp_path / "ids.npy")]) == 0
    rows, _ = evaluate_pruning(open_checkpoint(path), calib, {"a": heldout}, ["frequency"], [4],
                               merges=(parse("m_smoe"),))
    df = pd.DataFrame(rows)
    got = df[(df.metric == "perplexity") & (df.method == "m_smoe") & (df["form"] == "shrunk")
             & (df.text == "a")].value.item()
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m", attn_implementation="eager")
    with torch.no_grad():
        lg = hf(torch.as_tensor(heldout, dtype=torch.long)).logits
        nll = torch.nn.functional.cross_entropy(lg[:, :-1].reshape(-1, lg.shape[-1]),
                                                torch.as_tensor(heldout[:, 1:], dtype=torch.long).reshape(-1))
    assert got == pytest.approx(float(torch.exp(nll)), rel=1e-4)


def test_substitution_keeps_the_fused_layout_compact_and_reads_back_exactly(gpt_oss, tmp_path):
    """`moejax prune --substitute` on gpt-oss (experts stored only fused): each fused tensor holds
    the retained experts' slabs, the source's bytes, in ascending order (constant-v1's
    compact_retained_experts), each substituted expert its float32 constant; `load_substituted`
    presents the rows under their logical indices, and its logits equal the source model's under
    the same substitution computed in memory."""
    from moejax.cli import main
    from moejax.hf.io.checkpoint_reader import CheckpointReader
    from moejax.scoring.observe import calibrate_streamed
    from moejax.surgery.substitute import load_substituted, plan_substitution, substitution_maps

    path, _, source = gpt_oss
    ids = np.random.default_rng(8).integers(2, 96, size=(6, 20)).astype(np.int32)
    np.save(tmp_path / "calib.npy", ids)
    dst = tmp_path / "sub"
    assert main(["prune", str(path), str(dst), "--substitute", "--score", "mone", "--keep", "4",
                 "--tokens", str(tmp_path / "calib.npy"), "--batch-size", "4"]) == 0
    stats = calibrate_streamed(path, [(ids[:4], None), (ids[4:], None)], progress=False)
    kept = plan_substitution(stats, "mone", 4, TEST["num_experts_per_tok"])
    a, b = CheckpointReader(path), CheckpointReader(dst)
    for l, k in kept.items():
        retained = sorted(k)
        for part in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
            name = f"model.layers.{l}.mlp.experts.{part}"
            assert b.read(name).tobytes() == a.read(name)[retained].tobytes()
        for e in set(range(8)) - set(retained):
            assert b.info(f"model.layers.{l}.mlp.experts.{e}.approx_value").dtype == "F32"
    model, maps = load_substituted(dst)
    expected = substitution_maps(stats, kept)
    for layer, em in maps.items():
        assert np.array_equal(em.novice_E, expected[layer].novice_E)
        np.testing.assert_array_equal(em.constants_EH, expected[layer].constants_EH)
    test_ids, mask = batch(96, seed=9)
    got = np.asarray(model(jnp.asarray(test_ids), jnp.asarray(mask), variant=maps).logits_BSV)
    want = np.asarray(source(jnp.asarray(test_ids), jnp.asarray(mask), variant=expected).logits_BSV)
    np.testing.assert_array_equal(got, want)
    assert np.abs(want - np.asarray(source(jnp.asarray(test_ids), jnp.asarray(mask)).logits_BSV)).max() > 1e-3

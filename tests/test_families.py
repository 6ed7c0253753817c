"""Every registered family with a test config (presets.TEST: Qwen3-MoE, Mixtral, OLMoE, GLM-4.5,
Qwen2-MoE) against transformers 5 (torch), on tiny random checkpoints transformers itself writes
(tests/family_fixtures.py): chosen experts and logits on a padded batch, expert masks against
transformers running the pruned checkpoint, load-then-save bytes, every score against numpy from
transformers' hooks, `moejax prune` (and compressed-tensors' pruner for `l1`), every command,
generation, full-size shapes, hub spellings and refusals."""

import itertools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from family_fixtures import FAMILIES, hf_classes, make_family_checkpoint, moe_blocks  # noqa: E402
from hf_fixtures import assert_scores_match, batch, hook_router, reference_scores  # noqa: E402

from moejax import AutoModelForCausalLM, from_pretrained, save_pretrained  # noqa: E402
from moejax.errors import ConfigError  # noqa: E402
from moejax.inference.generate import generate  # noqa: E402
from moejax.hf.io.checkpoint_reader import CheckpointReader  # noqa: E402
from moejax.models.registry import FAMILIES as REGISTRY  # noqa: E402
from moejax.models.registry import config_from_dict, family_for  # noqa: E402

NAMES = list(FAMILIES)


class _Checkpoints(dict):
    """{family: (path, transformers model, moejax model)}, each made when first asked for (a -k
    selection of one family makes one checkpoint), with the seed of its place in NAMES."""

    def __init__(self, root):
        super().__init__()
        self.root = root

    def __missing__(self, name):
        path = self.root / name
        hf = make_family_checkpoint(name, path, seed=20 + NAMES.index(name))
        self[name] = (path, hf, AutoModelForCausalLM.from_pretrained(path, dtype=jnp.float32))
        return self[name]


@pytest.fixture(scope="session")
def family_checkpoints(tmp_path_factory):
    return _Checkpoints(tmp_path_factory.mktemp("families"))


# Families whose checkpoint passes (scoring, pruning, merging, the streamed executors, generation) are
# not implemented yet (`MoeConfig.PASSES_NOT_IMPLEMENTED`: DeepSeek-V4): each test of such a pass
# checks the refusal, by the family's name, instead
NO_PASSES = [f for f in NAMES if REGISTRY[f].config_class.PASSES_NOT_IMPLEMENTED]


def refused(family, what):
    """pytest.raises for `family`'s refusal of the pass `what` (`MoeConfig.require_passes`)."""
    return pytest.raises(ConfigError, match=rf"{re.escape(REGISTRY[family].title)}: {re.escape(what)}.* is not implemented")


hf_forward = hook_router


_FORWARDS = {}  # one jitted forward per model (a fresh `jitted()` compiles again; the weights do not change)


def run(model, ids, mask, masks=None):
    forward = _FORWARDS.setdefault(id(model), (model, model.jitted()))[1]
    out = forward(jnp.asarray(ids), jnp.asarray(mask), variant=masks, return_routing=True)
    return np.asarray(out.logits_BSV), {l: np.asarray(r.expert_idx_TK) for l, r in out.routing.items()}


@pytest.mark.parametrize("family", NAMES)
def test_routing_and_logits_match_transformers(family_checkpoints, family):
    path, hf, model = family_checkpoints[family]
    assert type(model).__name__ == FAMILIES[family][0]  # the registry chose the family (its Hub architecture)
    ids, mask = batch(96, seed=1)
    want, seen = hf_forward(hf, ids, mask)
    logits, chosen = run(model, ids, mask)
    valid = mask.reshape(-1).astype(bool)
    assert sorted(chosen) == sorted(seen) and chosen
    for layer, (_, _, _, idx) in seen.items():  # routing first: a flipped expert explains everything else
        np.testing.assert_array_equal(np.sort(chosen[layer][valid], 1), np.sort(idx.numpy()[valid], 1),
                                      err_msg=f"layer {layer}")
    m = mask.astype(bool)
    err = np.abs(logits[m] - want[m]).max()
    if err >= 1e-4:  # transformers' own float32 rounding can reach 1e-4 (the DeltaNet families' chunked rule):
        ours, own = float32_errors(model, hf, ids)  # then both float32 runs against transformers' float64 one
        assert ours < 3 * own, f"{err:.2e} from transformers; {ours:.2e} from its float64 run, its own {own:.2e}"
    assert np.abs(want).max() > 0.5


def float32_errors(model, hf, ids):
    """(moejax's, transformers' float32) logits' largest difference from transformers' float64 run, on
    `ids` unpadded (float64 under a padding mask gives NaN: masked rows' 0 x NaN reaches real positions).
    The bound is the MTP test's, 3x transformers' own error: on Qwen3.5's test model (jax 0.10.2) moejax sits
    8.2e-5 from float64 and transformers 3.6e-5, at logits up to 4.6, and the two runs 1.15e-4 apart."""
    import copy

    t = torch.as_tensor(ids, dtype=torch.long)
    with torch.no_grad():
        exact = copy.deepcopy(hf).double()(t).logits.numpy()
        theirs = hf(t).logits.double().numpy()
    ours, _ = run(model, ids, np.ones_like(ids))
    return float(np.abs(ours - exact).max()), float(np.abs(theirs - exact).max())


def _prune(family, src, dst, keep, groups="aware"):
    """`moejax prune --score l1`; a family with routing groups keeps them (group-aware) or, with
    groups="collapse", routes over all kept experts (what a pruner that ignores groups gives)."""
    from moejax.surgery.prune import prune_checkpoint

    grouped = REGISTRY[family].config_class.from_json_file(src / "config.json").n_group > 1
    return prune_checkpoint(src, dst, score="l1", keep=keep, group_aware=grouped and groups == "aware",
                            collapse_groups=grouped and groups == "collapse")


@pytest.mark.parametrize("family", NAMES)
def test_pruned_checkpoint_in_transformers_equals_the_masked_source(family_checkpoints, family, tmp_path):
    """`moejax prune` writes a checkpoint transformers loads (expert-count key updated, in the
    source's spelling); transformers running it equals moejax's expert masks on the source, and
    moejax loading it equals both."""
    path, hf, model = family_checkpoints[family]
    dst = tmp_path / "pruned"
    record = _prune(family, path, dst, keep=6)
    fixed = [l for l in model.config.moe_layers if model.config.is_kept_whole(l)]  # DeepSeek-V4's hash layers
    src_cfg, cfg = (json.loads((p / "config.json").read_text()) for p in (path, dst))
    text = REGISTRY[family].config_class.TEXT_CONFIG  # a wrapper's language model settings (Qwen3.5-MoE)
    if text:
        assert {k for k in cfg if cfg[k] != src_cfg[k]} == {text}  # vision_config and the rest untouched
        src_cfg, cfg = src_cfg[text], cfg[text]
    key = REGISTRY[family].config_class.from_json_file(path / "config.json").experts_key
    if fixed:  # kept whole; the other layers' dropped experts written as unreachable slots (docs/families.md)
        assert cfg == src_cfg and all(record["layers"][str(l)]["kept"] == list(range(8)) for l in model.config.moe_layers)
        assert all("unreachable" not in record["layers"][str(l)] for l in fixed)
        assert all(len(record["layers"][str(l)]["unreachable"]) == 2 for l in model.config.scored_layers)
    else:
        assert src_cfg[key] == 8 and cfg[key] == 6 and {k for k in cfg if cfg[k] != src_cfg[k]} == {key}
    hf_pruned = hf_classes(family)[1].from_pretrained(dst, attn_implementation="eager",
                                                      experts_implementation="eager").eval()
    ids, mask = batch(96, seed=2)
    want, _ = hf_forward(hf_pruned, ids, mask)
    E, L = 8, model.config.num_hidden_layers
    masks = np.ones((L, E), bool)
    for layer, entry in record["layers"].items():
        masks[int(layer)] = np.isin(np.arange(E), entry["kept"]) & ~np.isin(np.arange(E), entry.get("unreachable", []))
    got, chosen = run(model, ids, mask, jnp.asarray(masks))
    m = mask.astype(bool)
    assert np.abs(got[m] - want[m]).max() < 1e-4 * max(1.0, np.abs(want).max())
    for layer, idx in chosen.items():
        assert masks[layer][idx[m.reshape(-1)]].all()  # only kept experts are chosen
    unmasked, _ = run(model, ids, mask)
    assert np.abs(unmasked[m] - want[m]).max() > 1e-2  # pruning changed the logits: the test can fail
    reloaded, _ = run(AutoModelForCausalLM.from_pretrained(dst), ids, mask)
    assert np.abs(reloaded[m] - want[m]).max() < 1e-4 * max(1.0, np.abs(want).max())


def test_expert_masks_equal_unreachable_experts_under_a_sigmoid_router(family_checkpoints):
    """GLM-4.5's router has a balance bias: experts with bias -1e4 never win in transformers."""
    path, hf, model = family_checkpoints["glm4_moe"]
    pruned = [1, 6]
    saved = {l: b.gate.e_score_correction_bias.clone() for l, b in moe_blocks(hf).items()}
    ids, mask = batch(96, seed=3)
    with torch.no_grad():
        for b in moe_blocks(hf).values():
            b.gate.e_score_correction_bias[pruned] = -1e4
        want, _ = hf_forward(hf, ids, mask)
        for l, b in moe_blocks(hf).items():
            b.gate.e_score_correction_bias.copy_(saved[l])
    keep = np.ones((3, 8), bool)
    keep[:, pruned] = False
    got, _ = run(model, ids, mask, jnp.asarray(keep))
    m = mask.astype(bool)
    assert np.abs(got[m] - want[m]).max() < 1e-4


@pytest.mark.parametrize("family", NAMES)
def test_load_then_save_gives_back_every_tensor(family_checkpoints, family, tmp_path):
    path, _, model = family_checkpoints[family]
    out = save_pretrained(model, tmp_path / "out")
    a, b = CheckpointReader(path), CheckpointReader(out)
    assert a.keys() == b.keys()
    for name in a.keys():
        assert (a.info(name).dtype, tuple(a.info(name).shape)) == (b.info(name).dtype, tuple(b.info(name).shape))
        assert a.read_bytes(name) == b.read_bytes(name), name
    assert json.loads((path / "config.json").read_text()) == json.loads((out / "config.json").read_text())
    hf_classes(family)[1].from_pretrained(out)  # transformers loads what moejax wrote


@pytest.mark.parametrize("family", NAMES)
def test_scores_match_definitions_on_transformers_model(family_checkpoints, family):
    from moejax.scoring.observe import calibrate
    from moejax.scoring.scores import compute_scores

    path, hf, model = family_checkpoints[family]
    ids, mask = batch(96, seed=4, B=3, S=16)
    _, seen = hf_forward(hf, ids, mask)
    # a layer kept whole (DeepSeek-V4's hash layers, docs/families.md) is not scored
    want = reference_scores(hf, {l: r for l, r in seen.items() if not model.config.is_kept_whole(l)}, mask)
    stats = calibrate(model, [(ids[:2], mask[:2]), (ids[2:], mask[2:])])  # accumulated over two batches
    assert sorted(stats) == sorted(want)
    for layer, ref in want.items():
        assert_scores_match(stats[layer], ref, f"layer {layer}", ranking=True)
    if not REGISTRY[family].config_class.HAS_BALANCE_BIAS:  # softmax routers: no bias to rank by
        with pytest.raises(ConfigError, match="score 'bias' needs a balance bias"):
            compute_scores(stats[max(stats)], ["bias"])


@pytest.mark.parametrize("family", NAMES)
def test_l1_equals_compressed_tensors_magnitude_pruner(family_checkpoints, family, tmp_path):
    from compressed_tensors.entrypoints.convert import convert_checkpoint
    from compressed_tensors.entrypoints.convert.converters.magnitude_expert_pruner import MagnitudeExpertPruner

    path = family_checkpoints[family][0]
    fam = REGISTRY[family]
    if REGISTRY[family].config_class.from_json_file(path / "config.json").scored_layers != \
            REGISTRY[family].config_class.from_json_file(path / "config.json").moe_layers:
        pytest.skip("compressed-tensors' pruner prunes every layer; moejax keeps DeepSeek-V4's hash layers whole")
    router = re.escape(fam.rule("router").hf.split("{l}.", 1)[1]) + "$"  # "mlp\.gate\.weight$"
    experts = rf"{fam.moe_block}\.experts\." + ("" if fam.stores_fused else r"\d+\.")  # stacked [E, ...] or per expert
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    _prune(family, path, ours, keep=5, groups="collapse")  # compressed-tensors does not keep groups
    pruner = MagnitudeExpertPruner.from_pretrained(path, router_pattern=router, expert_pattern=experts, sparsity=0.375)
    convert_checkpoint(path, theirs, converter=pruner, max_workers=1, device="cpu")
    a, b = CheckpointReader(ours), CheckpointReader(theirs)
    assert a.keys() == b.keys() and all(a.read_bytes(n) == b.read_bytes(n) for n in a.keys())


@pytest.mark.parametrize("family", NAMES)
def test_every_command_runs(family_checkpoints, family, tmp_path, capsys):
    """score (calibration, CLI) -> prune with its scores file -> diff passes its checks; inspect
    and plan read the checkpoint; the streamed scoring pass equals the in-memory one."""
    import pandas as pd

    from moejax.cli import main
    from moejax.scoring.observe import calibrate, calibrate_streamed
    from moejax.scoring.scores import compute_scores

    path, _, model = family_checkpoints[family]
    ids = np.random.default_rng(5).integers(0, 96, size=(4, 12))
    np.save(tmp_path / "ids.npy", ids)
    scores = tmp_path / "scores.parquet"
    assert main(["score", str(path), "--tokens", str(tmp_path / "ids.npy"), "--batch-size", "2",
                 "--out", str(scores)]) == 0
    df = pd.read_parquet(scores)
    has_bias = REGISTRY[family].config_class.HAS_BALANCE_BIAS
    assert ("bias" in set(df.score)) == has_bias
    pruned = tmp_path / "pruned"
    grouped = ["--group-aware"] if model.config.n_group > 1 else []
    assert main(["prune", str(path), str(pruned), "--score", "reap", "--scores-file", str(scores), "--keep", "4",
                 *grouped]) == 0
    assert main(["diff", str(path), str(pruned)]) == 0
    assert main(["inspect", str(path)]) == 0 and main(["plan", str(path)]) == 0
    out = capsys.readouterr().out
    assert "routed" in out
    batches = [(ids[:2], None), (ids[2:], None)]
    streamed, in_memory = calibrate_streamed(path, batches, progress=False), calibrate(model, batches)
    for layer in in_memory:
        for name in ("reap", "frequency"):
            np.testing.assert_allclose(compute_scores(streamed[layer], [name])[name],
                                       compute_scores(in_memory[layer], [name])[name], rtol=1e-6)


# The GQA cache paths differ by q/k norm (per head: Qwen3-MoE; whole projection: OLMoE) and partial
# rope (GLM-4.5); Mixtral and Qwen2-MoE add nothing to them and run with -m slow. DeepSeek-V4 (its
# window ring and compressor caches; tests/test_deepseek_v4.py for longer runs) always runs.
@pytest.mark.parametrize("family", [f if f in ("qwen3_moe", "olmoe", "glm4_moe", "deepseek_v4") else pytest.param(f, marks=pytest.mark.slow)
                                    for f in NAMES])
def test_greedy_generation_equals_transformers(family_checkpoints, family):
    path, hf, model = family_checkpoints[family]
    rng = np.random.default_rng(6)
    ids = rng.integers(2, 96, size=(2, 7))
    mask = np.ones_like(ids)
    mask[1, :2] = 0  # left padding, as generation batches are laid out
    with torch.no_grad():
        want = hf.generate(input_ids=torch.as_tensor(ids), attention_mask=torch.as_tensor(mask), max_new_tokens=6,
                           do_sample=False, eos_token_id=None, pad_token_id=0).numpy()
    got = np.asarray(generate(model, ids, mask, max_new_tokens=6))
    np.testing.assert_array_equal(got, want)


def test_a_family_config_without_its_hooks_is_refused_when_defined():
    """`family_config` checks the hooks the reader calls (`FAMILY_HOOKS`) when the class is made,
    naming what is missing, instead of failing at the first config.json read."""
    from moejax.models.config_base import family_config
    from moejax.models.gqa_config import EveryLayerMoe, GqaMoeConfig, SoftmaxRouter

    class NoRouter(EveryLayerMoe, GqaMoeConfig):
        pass

    with pytest.raises(TypeError, match=r"NoRouter: a family config defines \['router_settings'\]"):
        family_config("X", ("x",), "XForCausalLM")(NoRouter)
    made = family_config("X", ("x",), "XForCausalLM")(type("Complete", (SoftmaxRouter, NoRouter), {}))
    assert made.TITLE == "X" and callable(made._read_rest)


@pytest.mark.parametrize("family", list(REGISTRY))
def test_a_registry_line_is_a_tested_family(family):
    """What a family's folder and registry line give: a config class stating every default (one
    built in code names its family), presets, tiny preset and test config read as that class, the
    model class named by ARCHITECTURE; and a test config (presets.TEST) for every family but
    DeepSeek-V3 (whose transformers checkpoints are hf_fixtures.py's), so the tests here run on it."""
    fam = REGISTRY[family]
    cls = fam.config_class
    assert family_for(cls().default_dict()) is fam
    for name, d in [*fam.presets.items(), ("tiny", fam.tiny)]:
        assert type(config_from_dict(d, name)) is cls, name
    assert (fam.test_config is None) == (family == "deepseek_v3") and (family in NAMES) == (family != "deepseek_v3")
    if fam.test_config is not None:
        assert type(config_from_dict(hf_classes(family)[0](**fam.test_config).to_dict(), family)) is cls
    assert fam.causal_lm().__name__ == fam.architecture and fam.causal_lm().config_class is cls


def _preset_cases():
    """Every full-size preset at its published widths; the default run keeps the first dense and
    MoE layers (every layer of a family has the same shapes), `-m slow` every layer."""
    for family in REGISTRY:
        for name in REGISTRY[family].presets:
            yield pytest.param(family, name, True, id=f"{name}-4-layers")
            yield pytest.param(family, name, False, id=f"{name}-all-layers", marks=pytest.mark.slow)


@pytest.mark.parametrize("family,preset,few_layers", list(_preset_cases()))
def test_full_size_presets_match_the_name_table(family, preset, few_layers):
    """jax.eval_shape of every full-size preset: each parameter's shape is the HF tensors' the
    config implies (transposed where HF stores [out, in], stacked over experts), and the parameter
    count equals the sum over HF tensors."""
    from moejax.hf.mapping import param_shapes, tensor_specs
    from flax import nnx

    fam = REGISTRY[family]
    for name, d in [(preset, fam.presets[preset])]:
        if few_layers:  # a per-layer list (gpt-oss's layer_types) is cut with the layers; a wrapper's in text_config
            text = fam.config_class.TEXT_CONFIG
            inner = d[text] if text else d
            inner = {**inner, "num_hidden_layers": 4,
                     **({"layer_types": inner["layer_types"][:4]} if "layer_types" in inner else {})}
            d = {**d, text: inner} if text else inner
        cfg = fam.config_class.from_dict(d, source=name)
        model = nnx.eval_shape(lambda: fam.causal_lm()(cfg, jnp.bfloat16))
        shapes = param_shapes(model)
        specs = tensor_specs(cfg)
        by_param = {}
        for s in specs:
            hf = tuple(reversed(s.hf_shape)) if s.transpose else s.hf_shape
            by_param.setdefault(s.param, []).append((s.expert, hf))
        assert set(by_param) == set(shapes), name
        for param, entries in by_param.items():
            if entries[0][0] is None:
                assert shapes[param] == entries[0][1], (name, param)
            else:
                assert shapes[param] == (len(entries),) + entries[0][1], (name, param)
        assert sum(int(np.prod(s)) for s in shapes.values()) == sum(int(np.prod(s.hf_shape)) for s in specs)


def test_hub_and_transformers_5_spellings_read_alike(tmp_path):
    """Qwen3-MoE's expert count (`num_experts` on the hub, `num_local_experts` from transformers 5)
    and GLM-4.5's partial_rotary_factor (top level on the hub, in rope_parameters in transformers 5)
    read as the same config; two spellings that disagree are refused by name."""
    qwen = REGISTRY["qwen3_moe"].config_class
    base = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 64,
            "num_attention_heads": 4, "num_key_value_heads": 2}
    hub, tf5 = qwen.from_dict({**base, "num_experts": 16}), qwen.from_dict({**base, "num_local_experts": 16})
    assert hub.n_experts == tf5.n_experts == 16 and (hub.experts_key, tf5.experts_key) == ("num_experts",
                                                                                          "num_local_experts")
    with pytest.raises(ConfigError, match="num_local_experts=8 .* disagrees with num_experts=16"):
        qwen.from_dict({**base, "num_experts": 16, "num_local_experts": 8})
    glm = REGISTRY["glm4_moe"].config_class
    gbase = {"model_type": "glm4_moe", "architectures": ["Glm4MoeForCausalLM"], "hidden_size": 64,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
    a = glm.from_dict({**gbase, "partial_rotary_factor": 0.5, "rope_theta": 1e6})
    b = glm.from_dict({**gbase, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6,
                                                    "partial_rotary_factor": 0.5}})
    assert (a.rotary_dim, a.rope_theta) == (b.rotary_dim, b.rope_theta) == (8, 1e6)


@pytest.mark.parametrize("family,update,expected", [
    ("qwen3_moe", {"use_sliding_window": True}, "use_sliding_window=true (bool) (sliding-window attention"),
    ("qwen3_moe", {"num_experts": "8"}, 'num_experts="8" (str), expected a positive integer'),
    ("qwen3_moe", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}},
     "rope_parameters.rope_type='yarn'"),
    ("mixtral", {"sliding_window": 4096}, "sliding_window=4096 (int) (sliding-window attention"),
    ("mixtral", {"num_local_experts": 1, "num_experts_per_tok": 2}, "num_experts_per_tok=2 exceeds num_local_experts=1"),
    ("olmoe", {"clip_qkv": 8.0}, "clip_qkv=8.0 (float) (clipping q/k/v is not implemented"),
    ("olmoe", {"hidden_act": "gelu"}, "hidden_act=\"gelu\" (str) (only 'silu'"),
    ("glm4_moe", {"n_group": 3}, "n_routed_experts=8 is not divisible by n_group=3"),
    ("glm4_moe", {"num_key_value_heads": 3}, "num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
])
def test_settings_not_implemented_or_wrong_are_refused_by_name(family_checkpoints, family, update, expected):
    path = family_checkpoints[family][0]
    d = {**json.loads((path / "config.json").read_text()), **update}
    with pytest.raises(ConfigError, match=expected.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        REGISTRY[family].config_class.from_dict(d)


def test_a_family_class_refuses_another_familys_checkpoint(family_checkpoints):
    from moejax import MixtralForCausalLM

    with pytest.raises(ConfigError, match=r"a Qwen3-MoE checkpoint .*model_class=MixtralForCausalLM\) cannot"):
        from_pretrained(family_checkpoints["qwen3_moe"][0], model_class=MixtralForCausalLM)


NEWER = ["gpt_oss", "qwen3_next", "qwen3_5_moe"]  # families whose attention or experts differ from the first six


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "qwen3_next", "qwen3_5_moe", "deepseek_v4"])
def test_expert_parallel_softmax_family_identical_across_meshes(family_checkpoints, family):
    """Softmax-routed families on the 8 simulated devices (Qwen3-MoE; gpt-oss's biased experts; the
    hybrid DeltaNet stacks Qwen3-Next and Qwen3.5-MoE) and DeepSeek-V4 (sqrtsoftplus and hash-routed
    layers, hyper-connection streams, compressed attention): experts split over the mesh's expert
    axis (V4's first layer checked is a hash layer), logits equal to one device's. The DeltaNet's
    chunked rule solves its triangular system in plain
    XLA ops on CPU: LAPACK's trsm custom call blocked XLA:CPU's thread pool, which the devices'
    collectives also block, and the (2, 4) forward stalled."""
    from moejax.parallel import MeshConfig, make_mesh

    path, _, model = family_checkpoints[family]
    ids, mask = (jnp.asarray(a) for a in batch(96, seed=7))
    want = np.asarray(model.jitted()(ids, mask).logits_BSV)
    for shape in [(1, 8), (2, 4)]:
        mesh = make_mesh(MeshConfig(*shape))
        sharded = AutoModelForCausalLM.from_pretrained(path, mesh=mesh)
        moe = sharded.model.layers[sharded.config.moe_layers[0]].mlp
        for name in moe.expert_names:
            assert getattr(moe, "experts_" + name)[...].sharding.spec == jax.sharding.PartitionSpec("expert")
        with jax.set_mesh(mesh):
            got = np.asarray(sharded.jitted()(ids, mask).logits_BSV)
        assert np.abs(got - want).max() <= 1e-5 * max(1.0, np.abs(want).max()), shape


@pytest.mark.parametrize("family", ["qwen3_moe", *NEWER, "deepseek_v4"])
def test_prune_real_on_a_softmax_family_agrees_with_transformers(family_checkpoints, family, tmp_path):
    """The carried pass (prune_real) on Qwen3-MoE, the newer families and DeepSeek-V4 (its
    hyper-connection streams carried, its hash layers handed the token ids and kept whole): the
    unpruned perplexity is transformers'; keep=E reproduces it exactly; `l1` at keep 4 gives the
    perplexity transformers computes on the checkpoint `moejax prune --score l1 --keep 4` writes,
    and the one moejax's own forward computes under the pass's masks."""
    from moejax.evaluation.carried import evaluate_pruning
    from moejax.hf.model_io import open_checkpoint
    import pandas as pd

    path, hf, model = family_checkpoints[family]
    rng = np.random.default_rng(8)
    calib = rng.integers(0, 96, size=(4, 16)).astype(np.int32)
    held = rng.integers(0, 96, size=(3, 16)).astype(np.int32)
    rows, info = evaluate_pruning(open_checkpoint(path), calib, {"t": held}, ["frequency", "reap", "l1"], [8, 4],
                                  batch_size=2)
    df = pd.DataFrame(rows)
    ppl = df[(df.metric == "perplexity") & (df.text == "t")]

    def hf_ppl(model):
        with torch.no_grad():
            logits = model(torch.as_tensor(held, dtype=torch.long)).logits.float()
        nll = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 96), torch.as_tensor(held[:, 1:]).reshape(-1).long())
        return float(torch.exp(nll))

    unpruned = ppl[ppl["form"] == "none"].value.item()
    assert unpruned == pytest.approx(hf_ppl(hf), rel=1e-4)
    assert (ppl[ppl.keep == 8].value == unpruned).all()
    cfg = model.config
    assert sorted(info["kept"]) == cfg.scored_layers   # a layer kept whole (V4's hash layers) decides nothing
    dst = tmp_path / "l1"
    record = _prune(family, path, dst, keep=4)
    # the kept experts (V4: those not written unreachable)
    written = {int(l): sorted(set(e["kept"]) - set(e.get("unreachable", []))) for l, e in record["layers"].items()}
    assert {l: written[l] for l in cfg.scored_layers} == {l: k["l1@4"] for l, k in info["kept"].items()}
    assert all(written[l] == list(range(8)) for l in cfg.moe_layers if cfg.is_kept_whole(l))
    masks = np.ones((cfg.num_hidden_layers, 8), bool)   # moejax's own forward under the pass's kept sets
    for l, k in info["kept"].items():
        masks[l] = np.isin(np.arange(8), k["l1@4"])
    logits = np.asarray(model(jnp.asarray(held), variant=jnp.asarray(masks)).logits_BSV, np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    ours = float(np.exp(-np.take_along_axis(logp[:, :-1], held[:, 1:, None], -1).mean()))
    pruned = hf_classes(family)[1].from_pretrained(dst, attn_implementation="eager",
                                                   experts_implementation="eager").eval()
    got = ppl[(ppl.method == "l1") & (ppl.keep == 4)].value.item()
    assert got == pytest.approx(hf_ppl(pruned), rel=1e-4) and got != pytest.approx(unpruned, rel=1e-3)
    assert got == pytest.approx(ours, rel=1e-5)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_fused_expert_names_of_transformers_5_load_too(family_checkpoints, family, tmp_path):
    """`save_pretrained(save_original_format=False)` writes transformers' own module names (fused
    `mlp.experts.gate_up_proj` / `down_proj`, and `mlp.gate.weight` even for Mixtral, whose hub
    names are `block_sparse_moe.experts.E.w1/w3/w2`): moejax loads them as the family's names and
    saves the family's names back."""
    path, hf, model = family_checkpoints[family]
    fused = tmp_path / "fused"
    hf.save_pretrained(fused, save_original_format=False)
    assert "model.layers.1.mlp.experts.gate_up_proj" in CheckpointReader(fused).keys()
    ids, mask = batch(96, seed=10)
    want, _ = hf_forward(hf, ids, mask)
    loaded = AutoModelForCausalLM.from_pretrained(fused)
    got, _ = run(loaded, ids, mask)
    m = mask.astype(bool)
    assert np.abs(got[m] - want[m]).max() < 1e-4
    out, canonical = CheckpointReader(save_pretrained(loaded, tmp_path / "out")), CheckpointReader(path)
    assert out.keys() == canonical.keys()
    assert all(out.read_bytes(n) == canonical.read_bytes(n) for n in canonical.keys())


@pytest.mark.parametrize("family", NAMES)
def test_esap_fitness_equals_the_masked_forward(family_checkpoints, family, tmp_path):
    """EvoESAP's fitness (`moejax.evaluation.esap_fitness`) of two candidate allocations, from one
    walk over the checkpoint's layers (the family's attention carries included), equals the ESAP of
    the whole model's forward under each candidate's masks against the unpruned forward (float64)."""
    from moejax.evaluation.esap_fitness import EsapFitness
    from moejax.hf.model_io import open_checkpoint
    from moejax.models.variant import check_routable, maps_from_masks

    path, _, model = family_checkpoints[family]
    cfg = model.config
    layers = list(cfg.scored_layers)   # DeepSeek-V4's hash layers are kept whole: no candidate chooses them
    rng = np.random.default_rng(3)
    ids = rng.integers(0, cfg.vocab_size, size=(2, 24)).astype(np.int32)
    if layers != cfg.moe_layers:
        with pytest.raises(ConfigError, match=r"ESAP fitness: layers \[0, 1\] are kept whole"):
            EsapFitness(open_checkpoint(path), ids, {l: np.zeros(8) for l in cfg.moe_layers}, cfg.moe_layers)
    ranking = {l: rng.standard_normal(cfg.experts_in_layer(l)) for l in layers}
    E, k = [cfg.experts_in_layer(l) for l in layers], cfg.num_experts_per_tok
    counts = np.asarray([[max(k, e // 2) for e in E], [k + (i % 2) * (e - k) for i, e in enumerate(E)]])
    fitness = EsapFitness(open_checkpoint(path), ids, ranking, layers, batch_size=2)
    got = fitness(counts)
    ref = np.asarray(model(jnp.asarray(ids)).logits_BSV, np.float64)[:, :-1]
    p = np.exp(ref - ref.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    for row, kept in zip(got, fitness.kept(counts)):
        masks = np.ones((cfg.num_hidden_layers, max(E)), bool)
        for l, m in kept.items():
            masks[l, :len(m)] = m
        runs = model
        try:
            for l, m in kept.items():
                check_routable(m, l, cfg, "candidate")
        except ConfigError:   # its kept sets break the routing groups: as --collapse-groups writes it
            runs = collapsed(path, tmp_path)
        out = np.asarray(runs(jnp.asarray(ids), variant=maps_from_masks(masks, runs.config)).logits_BSV,
                         np.float64)[:, :-1]
        q = np.exp(out - out.max(-1, keepdims=True))
        q /= q.sum(-1, keepdims=True)
        assert row == pytest.approx(np.minimum(p, q).sum(-1).mean(), abs=5e-6), family
    assert got.min() < 1 - 1e-4   # the candidates change the model
    # the carried pass's fitness (groups kept, masks under the model's own routing): an unroutable
    # candidate scores -inf, a routable one as above
    kept_routing = EsapFitness(open_checkpoint(path), ids, ranking, layers, batch_size=2, collapse=False)(counts)
    routable = [fitness._routable(k) for k in fitness.kept(counts)]
    np.testing.assert_allclose(kept_routing[routable], got[routable], rtol=0, atol=1e-6)
    assert np.isneginf(kept_routing[~np.asarray(routable)]).all()


def collapsed(path, tmp_path):
    """The checkpoint at `path` loaded with its routing groups collapsed (n_group = topk_group = 1 in
    config.json, or in its text_config), as `moejax prune --collapse-groups` writes the config."""
    import json
    import shutil

    out = tmp_path / "collapsed"
    shutil.copytree(path, out)
    cfg = json.loads((out / "config.json").read_text())
    inner = cfg.get("text_config", cfg)
    inner.update(n_group=1, topk_group=1)
    (out / "config.json").write_text(json.dumps(cfg))
    return AutoModelForCausalLM.from_pretrained(out, dtype=jnp.float32)


@pytest.mark.parametrize("method", ["m_smoe", pytest.param("hc_smoe", marks=pytest.mark.slow)])
def test_merged_checkpoint_with_layers_kept_whole_loads_in_transformers(family_checkpoints, method, tmp_path):
    """`moejax merge` on DeepSeek-V4 (docs/families.md): the hash layers stay whole and bytewise the
    source's; in each learned layer every slot is written, a merged cluster's leader slot holding the
    merged expert and its other members unreachable (balance bias -1e4), so config.json is the
    source's and transformers loads it. transformers on it equals moejax's source under the merge's
    shrunk variant (the in-memory merge on the same tokens) and moejax loading it, within 1e-4."""
    import torch

    from moejax.hf.model_io import load_pretrained
    from moejax.merging.calibration import merge_stats
    from moejax.merging.layer import merge_layer
    from moejax.merging.method import MergeContext, parse
    from moejax.surgery.merge import merge_checkpoint
    from moejax.surgery.prune_plan import UNREACHABLE_BIAS

    path, _, model = family_checkpoints["deepseek_v4"]
    cfg = model.config
    calib = np.random.default_rng(6).integers(0, 96, size=(4, 24)).astype(np.int32)
    np.save(tmp_path / "calib.npy", calib)
    dst = tmp_path / "merged"
    record = merge_checkpoint(path, dst, method=parse(method), keep=4, tokens=tmp_path / "calib.npy")
    assert json.loads((dst / "config.json").read_text()) == json.loads((path / "config.json").read_text())
    assert sorted(int(l) for l in record["layers"]) == cfg.scored_layers   # the hash layers: no clusters
    moe_inputs = model.jitted()(jnp.asarray(calib), None, return_moe_inputs=True).moe_inputs
    variant, a, b = {}, CheckpointReader(path), CheckpointReader(dst)
    for l in cfg.scored_layers:
        moe = model.model.layers[l].mlp
        lm = merge_layer(parse(method), 4, MergeContext.of(merge_stats(moe, [moe_inputs[l]], [None])),
                         moe.expert_weights())
        variant[l] = lm.expert_map("shrunk")
        entry = record["layers"][str(l)]
        leaders = sorted(lm.leaders.tolist())   # every slot written; the other members unreachable
        assert entry["kept"] == list(range(8)) and entry["unreachable"] == sorted(set(range(8)) - set(leaders))
        assert sorted(map(sorted, entry["clusters"])) == sorted(map(sorted, lm.clusters()))
        bias = f"layers.{l}.ffn.gate.bias"
        written = b.read(bias)
        assert (written[entry["unreachable"]] == UNREACHABLE_BIAS).all()
        assert (written[leaders] == a.read(bias)[leaders]).all()
    for name in a.keys():   # the hash layers and everything outside the learned layers' experts and biases
        if not any(name.startswith(f"layers.{l}.ffn.") for l in cfg.scored_layers):
            assert a.read_bytes(name) == b.read_bytes(name), name
    ids, mask = batch(96, seed=7)
    want = np.asarray(model.jitted()(jnp.asarray(ids), jnp.asarray(mask), variant).logits_BSV)
    hf = hf_classes("deepseek_v4")[1].from_pretrained(dst, attn_implementation="eager",
                                                       experts_implementation="eager").eval()
    with torch.no_grad():
        got = hf(torch.as_tensor(ids, dtype=torch.long), attention_mask=torch.as_tensor(mask)).logits.float().numpy()
    m = mask.astype(bool)
    assert np.abs(got[m] - want[m]).max() < 1e-4 * max(1.0, np.abs(want).max())
    ours = np.asarray(load_pretrained(dst).jitted()(jnp.asarray(ids), jnp.asarray(mask)).logits_BSV)
    assert np.abs(ours[m] - want[m]).max() < 1e-4 * max(1.0, np.abs(want).max())
    unmerged = np.asarray(model.jitted()(jnp.asarray(ids), jnp.asarray(mask)).logits_BSV)
    assert np.abs(unmerged[m] - want[m]).max() > 1e-2   # the merge changed the model: the test can fail


@pytest.mark.parametrize("method", ["m_smoe", "ream"])
def test_the_carried_pass_merges_deepseek_v4_as_the_checkpoint_computes(family_checkpoints, method, tmp_path):
    """The carried pass's merge variants (prune_real's `merges`, no score asked) on DeepSeek-V4: the
    learned layers merged, the hash layers run whole; the shrunk variant's clusters are those
    `moejax merge` writes from the same calibration tokens, its perplexity is moejax's forward of
    that checkpoint, and transformers computes the same logits on it (REAM here; M-SMoE and HC-SMoE
    against the in-memory merge above)."""
    import torch
    import pandas as pd

    from moejax.evaluation.carried import evaluate_pruning
    from moejax.hf.model_io import load_pretrained, open_checkpoint
    from moejax.inference.nll import next_token_nll
    from moejax.merging.method import parse
    from moejax.surgery.merge import merge_checkpoint
    from moejax.variants import VariantSpec

    path, _, model = family_checkpoints["deepseek_v4"]
    cfg = model.config
    rng = np.random.default_rng(6)
    calib = rng.integers(0, 96, size=(4, 24)).astype(np.int32)
    held = rng.integers(0, 96, size=(3, 20)).astype(np.int32)
    np.save(tmp_path / "calib.npy", calib)
    record = merge_checkpoint(path, tmp_path / "merged", method=parse(method), keep=4, tokens=tmp_path / "calib.npy")
    rows, info = evaluate_pruning(open_checkpoint(path), calib, {"t": held}, [], [4], merges=(parse(method),),
                                  batch_size=4)
    plan = next(p for p in info["plans"] if p.spec == VariantSpec(method, 4, "shrunk"))
    assert sorted(plan.layers) == cfg.scored_layers
    clusters = {l: sorted(map(sorted, c[f"{method}@4"])) for l, c in info["clusters"].items()}
    assert clusters == {int(l): sorted(map(sorted, e["clusters"])) for l, e in record["layers"].items()}
    df = pd.DataFrame(rows)
    got = df[(df.metric == "perplexity") & (df.text == "t") & (df.method == method) & (df.form == "shrunk")]
    logits = np.asarray(load_pretrained(tmp_path / "merged").jitted()(jnp.asarray(held)).logits_BSV)
    want = float(np.exp(np.mean(np.asarray(next_token_nll(jnp.asarray(logits), jnp.asarray(held))))))
    assert got.value.item() == pytest.approx(want, rel=1e-4)
    unmerged = df[(df.form == "none") & (df.metric == "perplexity") & (df.text == "t")].value.item()
    assert got.value.item() != pytest.approx(unmerged, rel=1e-3)   # the merge changed the model: the test can fail
    hf = hf_classes("deepseek_v4")[1].from_pretrained(tmp_path / "merged", attn_implementation="eager",
                                                       experts_implementation="eager").eval()
    with torch.no_grad():
        theirs = hf(torch.as_tensor(held, dtype=torch.long)).logits.float().numpy()
    assert np.abs(theirs - logits).max() < 1e-4 * max(1.0, np.abs(logits).max())


def test_diff_recovers_deepseek_v4_unreachable_slots(family_checkpoints, tmp_path):
    """`moejax diff` on a DeepSeek-V4 prune: every slot is the source's row, the learned layers'
    unreachable slots (bias -1e4) are the ones pruning.json records and the hash layers have none;
    a kept slot's bias changed is caught."""
    from safetensors.numpy import load_file, save_file

    from moejax.surgery.diff import diff_checkpoints
    from moejax.surgery.prune import prune_checkpoint

    path, _, model = family_checkpoints["deepseek_v4"]
    cfg = model.config
    dst = tmp_path / "l1"
    record = prune_checkpoint(path, dst, score="l1", keep=4)
    report = diff_checkpoints(path, dst, hash_tensors=True)
    for l in cfg.moe_layers:
        entry = report["layers"][str(l)]
        assert entry["kept"] == list(range(8)) and entry["rows_identical"] and entry["bias_identical"] is not False
        assert entry.get("unreachable", []) == record["layers"][str(l)].get("unreachable", [])
        assert bool(entry.get("unreachable")) == (l in cfg.scored_layers)
    assert report["summary"]["other_tensors_identical"] and report["tensors"]["bytes_differ"] == []
    (shard,) = dst.glob("*.safetensors")
    tensors = load_file(shard)
    l = cfg.scored_layers[0]
    kept = next(e for e in range(8) if e not in record["layers"][str(l)]["unreachable"])
    tensors[f"layers.{l}.ffn.gate.bias"][kept] += 0.5
    save_file(tensors, shard, metadata={"format": "pt"})
    assert diff_checkpoints(path, dst)["layers"][str(l)]["bias_identical"] is False


def test_what_deepseek_v4_does_not_implement_is_refused_by_name(family_checkpoints, tmp_path):
    """`prune --keep-map` (a map names every MoE layer's kept experts; V4's hash layers are kept
    whole) is refused by the family's name before anything is written. (Training from scratch:
    tests/test_train_tiny.py.)"""
    from moejax.surgery.prune import prune_checkpoint

    path = family_checkpoints["deepseek_v4"][0]
    prune_checkpoint(path, tmp_path / "l1", score="l1", keep=4)
    with pytest.raises(ConfigError, match=r"DeepSeek-V4: --keep-map is not implemented for a family with layers kept"):
        prune_checkpoint(path, tmp_path / "mapped", keep_map=tmp_path / "l1" / "keep_map.json")
    assert not (tmp_path / "mapped").exists()


def test_deepseek_v4_mtp_block_is_kept_or_dropped_and_prune_refused(family_checkpoints, tmp_path):
    """DeepSeek-V4's MTP block (`mtp.*`), which transformers does not instantiate and moejax does not
    run: --mtp prune (the default) is refused by name by score, prune and merge before any pass;
    --mtp keep writes its bytes unchanged (and config.json's num_nextn_predict_layers); --mtp drop
    removes every `mtp.*` tensor and sets num_nextn_predict_layers 0. Both outputs load in
    transformers (the block is ignored there) and compute the pruned trunk alike."""
    import shutil
    from unittest.mock import patch

    import torch
    from safetensors.numpy import load_file, save_file

    from moejax.merging.method import parse
    from moejax.scoring.score_checkpoint import score_checkpoint
    from moejax.surgery.merge import merge_checkpoint
    from moejax.surgery.prune import prune_checkpoint
    from moejax.surgery.substitute import substitute_checkpoint

    src = tmp_path / "src"
    shutil.copytree(family_checkpoints["deepseek_v4"][0], src)
    (shard,) = src.glob("*.safetensors")
    tensors = load_file(shard)
    rng = np.random.default_rng(3)
    mtp = {"mtp.0.enorm.weight": rng.standard_normal(32).astype(np.float32),
           "mtp.0.ffn.gate.weight": rng.standard_normal((8, 32)).astype(np.float32),
           "mtp.0.ffn.experts.0.w1.weight": rng.standard_normal((16, 32)).astype(np.float32)}
    save_file({**tensors, **mtp}, shard, metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (src / "config.json").write_text(json.dumps(config))
    calib = np.random.default_rng(6).integers(0, 96, size=(2, 16)).astype(np.int32)
    np.save(tmp_path / "calib.npy", calib)
    no_prune = pytest.raises(ConfigError, match=r"--mtp prune: DeepSeek-V4's MTP block \(`mtp\.\*`\) is not run")
    with no_prune:
        prune_checkpoint(src, tmp_path / "p", score="l1", keep=4)
    with no_prune:
        score_checkpoint(src, tokens=tmp_path / "calib.npy", scores=["frequency"])
    with no_prune, patch("moejax.inference.stream.stream_layers", side_effect=AssertionError("a pass ran")):
        merge_checkpoint(src, tmp_path / "m", method=parse("m_smoe"), keep=4, tokens=tmp_path / "calib.npy")
    with no_prune, patch("moejax.inference.stream.stream_layers", side_effect=AssertionError("a pass ran")):
        substitute_checkpoint(src, tmp_path / "s", score="mone", keep=4, tokens=tmp_path / "calib.npy")
    assert not any((tmp_path / d).exists() for d in ("p", "m", "s"))
    outs = {}
    run = {"prune": lambda dst, policy: prune_checkpoint(src, dst, score="l1", keep=4, mtp=policy),
           # substitution follows --mtp alike (constant-v1: the trunk's substituted experts cut)
           "substitute": lambda dst, policy: substitute_checkpoint(src, dst, score="mone", keep=4,
                                                                   tokens=tmp_path / "calib.npy", mtp=policy)}
    for (command, write), policy in itertools.product(run.items(), ("keep", "drop")):
        dst = tmp_path / (policy if command == "prune" else f"sub-{policy}")
        record = write(dst, policy)
        assert record["mtp"] == policy
        written = {}
        for f in dst.glob("*.safetensors"):
            written.update(load_file(f))
        got = json.loads((dst / "config.json").read_text())
        if policy == "keep":
            assert all((written[n] == v).all() for n, v in mtp.items()) and got["num_nextn_predict_layers"] == 1
        else:
            assert not any(n.startswith("mtp.") for n in written) and got["num_nextn_predict_layers"] == 0
            assert any("mtp.*" in n for n in record["notes"])
        if command == "prune":
            assert {n for n in written if not n.startswith("mtp.")} == set(tensors)
        outs[command, policy] = {n: v for n, v in written.items() if not n.startswith("mtp.")}
    for command in run:   # the trunk written alike under either policy
        keep, drop = outs[command, "keep"], outs[command, "drop"]
        assert keep.keys() == drop.keys() and all((keep[n] == v).all() for n, v in drop.items())
    ids, mask = batch(96, seed=7)
    hf = hf_classes("deepseek_v4")[1].from_pretrained(tmp_path / "drop", attn_implementation="eager",
                                                       experts_implementation="eager").eval()
    with torch.no_grad():
        hf(torch.as_tensor(ids, dtype=torch.long), attention_mask=torch.as_tensor(mask))

"""The DeepSeek-sparse-attention families (DeepSeek-V3.2 `deepseek_v32`, GLM-5 `glm_moe_dsa`)
against transformers 5 beyond the shared family tests (tests/test_families.py, which run on their
TEST configs): each row of a left- and right-padded batch exact against transformers running that
sequence alone; greedy generation from prompts longer than index_topk equal to transformers'
`generate`, and every decode step's logits equal to the full forward's (the decode path selects as
the full path does); planted bugs (no selection; a shared layer without its borrowed selection) that
transformers catches; GLM-5 with two shared layers in a row; the settings refused by name before
any tensor is read; and GLM-5.2's shared layers in the per-layer (streamed and carried) passes, whose
scores and perplexities equal transformers'."""

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from family_fixtures import make_family_checkpoint  # noqa: E402
from hf_fixtures import assert_scores_match, hook_router, reference_scores  # noqa: E402

from moejax import AutoModelForCausalLM  # noqa: E402
from moejax.errors import ConfigError  # noqa: E402
from moejax.inference.generate import generate  # noqa: E402
from moejax.models.registry import FAMILIES  # noqa: E402

# (family, seed, config overrides): the TEST configs (GLM-5's with layer 1 "shared", as GLM-5.2's
# schedule has them; its TEST config, which the streamed shared tests use, runs every indexer), and
# GLM-5 with two shared layers in a row (layers 1 and 2 attend with layer 0's selection, layer 3
# selects again)
CASES = {
    "deepseek_v32": ("deepseek_v32", 50, {}),
    "glm_moe_dsa": ("glm_moe_dsa", 51, dict(indexer_types=["full", "shared", "full"])),
    "glm_moe_dsa_fssf": ("glm_moe_dsa", 52, dict(num_hidden_layers=4, indexer_types=["full", "shared", "shared",
                                                                                         "full"])),
    # (32 indexer heads: a key's score is exactly 0 only when ReLU zeroes every head, so the top-k cut
    # never falls on a tie that torch and XLA break differently, over the many tokens of the passes)
    "glm_moe_dsa_fsfs": ("glm_moe_dsa", 54, dict(num_hidden_layers=4, n_group=1, topk_group=1, index_n_heads=32,
                                                 indexer_types=["full", "shared", "full", "shared"])),
}
FORWARD_CASES = ["deepseek_v32", "glm_moe_dsa", "glm_moe_dsa_fssf"]   # (fsfs: the streamed passes' case)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("dsa")
    out = {}
    for name, (family, seed, overrides) in CASES.items():
        hf = make_family_checkpoint(family, root / name, seed=seed, **overrides)
        out[name] = (root / name, hf, AutoModelForCausalLM.from_pretrained(root / name, dtype=jnp.float32))
    return out


def positions_of(mask):
    """Per-row positions as generation lays them out: the count of real tokens before each one."""
    return np.maximum(np.cumsum(mask, -1) - 1, 0).astype(np.int32)


def padded_batch(seed=0, S=20):
    """Rows: whole; left-padded by 4; left-padded by 9; right-padded by 5."""
    ids = np.random.default_rng(seed).integers(0, 96, size=(4, S)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[1, :4] = 0
    mask[2, :9] = 0
    mask[3, -5:] = 0
    return ids, mask


def hf_alone(hf, ids_row):
    with torch.no_grad():
        return hf(torch.as_tensor(ids_row[None], dtype=torch.long)).logits.float().numpy()[0]


def ours(model, ids, mask, positions=None):
    out = model.jitted()(jnp.asarray(ids), jnp.asarray(mask), positions=None if positions is None else
                         jnp.asarray(positions))
    return np.asarray(out.logits_BSV)


@pytest.mark.parametrize("case", FORWARD_CASES)
def test_each_row_of_a_padded_batch_equals_transformers_alone(checkpoints, case):
    """With per-row positions (as generation uses), each sequence of a left/right padded batch of
    20 tokens (index_topk 4 or 5: every query past the first few selects) gives transformers'
    logits for that sequence run alone."""
    _, hf, model = checkpoints[case]
    ids, mask = padded_batch(seed=1)
    got = ours(model, ids, mask, positions_of(mask))
    for b in range(len(ids)):
        real = mask[b].astype(bool)
        want = hf_alone(hf, ids[b][real])
        assert np.abs(got[b][real] - want).max() < 1e-4, (case, b)
        assert np.abs(want).max() > 0.5


@pytest.mark.parametrize("case", FORWARD_CASES)
def test_selection_matters(checkpoints, case, monkeypatch):
    """Planted bugs transformers catches: attending with the causal mask alone (no selection), and
    (GLM-5) a shared layer attending without the selection it borrows."""
    import moejax.models.sparse_mla as sparse_mla

    _, hf, model = checkpoints[case]
    ids, mask = padded_batch(seed=2)
    with torch.no_grad():
        want = hf(torch.as_tensor(ids, dtype=torch.long), attention_mask=torch.as_tensor(mask)).logits.float().numpy()
    m = mask.astype(bool)
    assert np.abs(ours(model, ids, mask)[m] - want[m]).max() < 1e-4
    with monkeypatch.context() as p:
        p.setattr(sparse_mla, "sparse_allowed", lambda allowed, selected: allowed)
        assert np.abs(ours(model, ids, mask)[m] - want[m]).max() > 1e-2
    if model.config.shares_selections:
        with monkeypatch.context() as p:
            p.setattr(sparse_mla.SparseMLA, "_borrowed", lambda self, selected: jnp.ones_like(selected))
            assert np.abs(ours(model, ids, mask)[m] - want[m]).max() > 1e-2


@pytest.mark.parametrize("case", FORWARD_CASES)
def test_generation_from_prompts_longer_than_index_topk(checkpoints, case):
    """Greedy generation from 12-token prompts (one left-padded by 3) equals transformers'
    `generate`; each decode step's logits (the indexer selecting among the cached keys) equal the
    full forward's on the generated sequence."""
    _, hf, model = checkpoints[case]
    P, n = 12, 8
    assert P - 3 > model.config.index_topk
    ids = np.random.default_rng(3).integers(2, 96, size=(2, P)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[1, :3] = 0
    with torch.no_grad():
        want = hf.generate(input_ids=torch.as_tensor(ids, dtype=torch.long), attention_mask=torch.as_tensor(mask),
                           max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0).numpy()
    got = np.asarray(generate(model, ids, mask, max_new_tokens=n))
    np.testing.assert_array_equal(got, want)

    full_mask = np.concatenate([mask, np.ones((2, n), np.int32)], 1)
    positions = positions_of(full_mask)
    full = ours(model, got, full_mask, positions)
    cache = model.init_cache(2, P + n)
    out = model.prefill(jnp.asarray(ids), jnp.asarray(positions[:, :P]), jnp.asarray(mask), cache, last_only=False)
    np.testing.assert_allclose(np.asarray(out.logits_BSV)[mask.astype(bool)], full[:, :P][mask.astype(bool)],
                               atol=1e-4, rtol=0)
    cache = out.cache
    for i in range(n - 1):
        t = P + i
        out = model.decode_step(jnp.asarray(got[:, t:t + 1]), jnp.asarray(positions[:, t:t + 1]), cache, t)
        cache = out.cache
        np.testing.assert_allclose(np.asarray(out.logits_BSV)[:, 0], full[:, t], atol=1e-4, rtol=0,
                                   err_msg=f"decode step {i}")


def test_shared_layers_hold_no_indexer(checkpoints):
    """A GLM-5 "shared" layer has no indexer tensors in transformers' checkpoint and no indexer in
    moejax's model; full layers have both; DeepSeek-V3.2 runs an indexer on every layer."""
    from moejax.hf.io.checkpoint_reader import CheckpointReader

    for case, full in [("deepseek_v32", [0, 1, 2]), ("glm_moe_dsa", [0, 2]), ("glm_moe_dsa_fssf", [0, 3])]:
        path, _, model = checkpoints[case]
        keys = CheckpointReader(path).keys()
        with_indexer = sorted({int(k.split(".")[2]) for k in keys if ".self_attn.indexer." in k})
        assert with_indexer == full, case
        assert [l for l, layer in enumerate(model.model.layers) if layer.self_attn.indexer is not None] == full
        assert [model.config.selection_source(l) for l in range(model.config.num_hidden_layers)] == \
            {"deepseek_v32": [0, 1, 2], "glm_moe_dsa": [0, 0, 2], "glm_moe_dsa_fssf": [0, 0, 0, 3]}[case]


def _ppl(hf, held):
    with torch.no_grad():
        logits = hf(torch.as_tensor(held, dtype=torch.long)).logits.float()
    V = logits.shape[-1]
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, V), torch.as_tensor(held[:, 1:]).reshape(-1).long())
    return float(torch.exp(nll))


def test_streamed_passes_thread_the_shared_selection(checkpoints, tmp_path):
    """GLM-5.2's shared layers in the passes that run one decoder layer at a time: the selection a
    full layer makes is the carry `DecoderLayer.attend` hands on. Every score of the streamed
    calibration pass equals float64 numpy over transformers' hooks; the carried pass's (prune_real)
    perplexities of the unpruned model and of `l1` at keep 4, one-shot and sequential, equal
    transformers' on the checkpoints `moejax prune` writes. In "fsfs" layer 3 borrows layer 2's
    selection, which differs per variant (MoE layer 1 runs before it): a pass that handed every
    stream the unpruned stream's selection fails the pruned perplexities. (One routing group: the
    carried pass's variants are masks on the source's router, which a pruned checkpoint with
    uneven groups cannot reproduce.)"""
    import pandas as pd

    from transformers import AutoModelForCausalLM as AutoModelForCausalLM_hf

    from moejax.evaluation.carried import evaluate_pruning
    from moejax.hf.model_io import open_checkpoint
    from moejax.scoring.observe import calibrate_streamed
    from moejax.surgery.prune import prune_checkpoint

    path, hf, _ = checkpoints["glm_moe_dsa_fsfs"]
    ids = np.random.default_rng(4).integers(0, 96, size=(4, 16)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[3, -5:] = 0   # right padding: transformers is exact on it
    _, seen = hook_router(hf, ids, mask)
    want = reference_scores(hf, seen, mask)
    got = calibrate_streamed(path, [(ids[:2], mask[:2]), (ids[2:], mask[2:])], progress=False, interventions=True)
    assert sorted(got) == sorted(want)
    for layer, ref in want.items():
        assert_scores_match(got[layer], ref, f"layer {layer}")

    rng = np.random.default_rng(8)
    calib, held = rng.integers(0, 96, size=(4, 16)).astype(np.int32), rng.integers(0, 96, size=(3, 16)).astype(np.int32)
    rows, info = evaluate_pruning(open_checkpoint(path), calib, {"t": held}, ["l1", "reap"], [8, 4], batch_size=2,
                                  sequential=True)
    df = pd.DataFrame(rows)
    ppl = df[(df.metric == "perplexity") & (df.text == "t")]
    unpruned = ppl[ppl["form"] == "none"].value.item()
    assert unpruned == pytest.approx(_ppl(hf, held), rel=1e-4)
    assert (ppl[ppl.keep == 8].value == unpruned).all()
    n_experts = hf.config.n_routed_experts

    def pruned_to(kept: dict, name: str):
        """transformers on `moejax prune`'s checkpoint keeping `kept` {layer: experts}."""
        scores = tmp_path / f"{name}.parquet"   # the kept experts as a score `moejax prune` keeps by
        pd.DataFrame([dict(layer=l, expert=e, score="kept", value=float(e in k)) for l, k in kept.items()
                      for e in range(n_experts)]).to_parquet(scores)
        with pytest.warns(UserWarning, match="records neither its source"):
            record = prune_checkpoint(path, tmp_path / name, score="kept", keep=4, scores_file=scores)
        assert {int(l): e["kept"] for l, e in record["layers"].items()} == kept
        return AutoModelForCausalLM_hf.from_pretrained(tmp_path / name, attn_implementation="eager").eval()

    for form, method, key in (("one_shot", "l1", "l1@4"), ("sequential", "reap", "sequential:reap@4")):
        kept = {l: sorted(map(int, k[key])) for l, k in info["kept"].items()}
        got_ppl = ppl[(ppl.method == method) & (ppl.keep == 4) & (ppl["form"] == form)].value.item()
        assert got_ppl == pytest.approx(_ppl(pruned_to(kept, form), held), rel=1e-4)
        assert got_ppl != pytest.approx(unpruned, rel=1e-3)
    # the sequential variant's choice at each layer: REAP's top 4 on transformers running the model
    # pruned up to the layer before (its calibration stream, with that stream's own selections; the
    # pruned experts unreachable by a balance bias of -1e4, as a pruned checkpoint routes)
    layers, ones = sorted(kept), np.ones_like(calib)
    for before, layer in zip(layers, layers[1:]):
        saved = {l: hf.model.layers[l].mlp.gate.e_score_correction_bias.clone() for l in layers}
        with torch.no_grad():
            for l in layers[:layers.index(before) + 1]:
                hf.model.layers[l].mlp.gate.e_score_correction_bias[[e for e in range(n_experts) if e not in kept[l]]] = -1e4
        try:
            _, seen = hook_router(hf, calib, ones)
            reap = reference_scores(hf, seen, ones)[layer]["reap"]
        finally:
            with torch.no_grad():
                for l, bias in saved.items():
                    hf.model.layers[l].mlp.gate.e_score_correction_bias.copy_(bias)
        assert sorted(np.argsort(-reap, kind="stable")[:4].tolist()) == kept[layer], layer


REFUSED = [  # (family, config.json update (a value ... removes the key), what the refusal says)
    ("deepseek_v32", {"q_lora_rank": None}, "q_lora_rank=null (NoneType) (DSA needs MLA's q LoRA"),
    ("glm_moe_dsa", {"rope_interleave": False}, "rope_interleave=false (bool) (transformers' DSA attention always"),
    ("deepseek_v32", {"mlp_layer_types": ["dense", "dense", "sparse"]},
     "mlp_layer_types=[\"dense\", \"dense\", \"sparse\"] (list) (only the first_k_dense_replace=1 schedule"),
    ("glm_moe_dsa", {"layer_types": ["indexed_attention", "full_attention", "indexed_attention"]},
     "(only 'indexed_attention' layers are implemented)"),
    ("deepseek_v32", {"indexer_rope_interleave": True}, "indexer_rope_interleave=true (bool) (transformers ignores it"),
    ("glm_moe_dsa", {"indexer_rope_interleave": False}, "rotates GLM-5's indexer interleaved"),
    ("deepseek_v32", {"index_topk_freq": 2}, "index_topk_freq=2 (int) (index sharing: transformers' "
                                             "DeepseekV32ForCausalLM runs every layer's indexer"),
    ("deepseek_v32", {"num_experts": 8}, "num_experts=8 (int) (transformers' backward-compatible spelling"),
    ("deepseek_v32", {"hidden_act": "gelu"}, "hidden_act='gelu' (only 'silu' is implemented)"),
    ("glm_moe_dsa", {"indexer_types": ["shared", "full", "full"]}, "layer 0 is 'shared'"),
    ("glm_moe_dsa", {"indexer_types": ["full", "shared"]}, "indexer_types=[\"full\", \"shared\"] (list) has 2 "
                                                          "entries, expected num_hidden_layers=3"),
    ("glm_moe_dsa", {"indexer_types": ..., "index_topk_pattern": "FSX"}, "index_topk_pattern=\"FSX\" (str), expected"),
    ("glm_moe_dsa", {"index_head_dim": 6}, "qk_rope_head_dim=8 exceeds index_head_dim=6"),
    ("glm_moe_dsa", {"index_topk": 0}, "index_topk=0 (int), expected a positive integer"),
]


@pytest.mark.parametrize("family,update,expected", REFUSED)
def test_settings_refused_by_name_before_any_tensor_is_read(checkpoints, family, update, expected, tmp_path, capsys,
                                                            monkeypatch):
    from moejax.cli import main
    from moejax.hf.io.checkpoint_reader import CheckpointReader

    src = checkpoints[family][0]
    d = {k: v for k, v in {**json.loads((src / "config.json").read_text()), **update}.items() if v is not ...}
    with pytest.raises(ConfigError) as caught:
        FAMILIES[family].config_class.from_dict(d)
    assert expected in str(caught.value), str(caught.value)
    edited = shutil.copytree(src, tmp_path / "edited")
    (edited / "config.json").write_text(json.dumps(d))
    monkeypatch.setattr(CheckpointReader, "read", lambda *a, **k: pytest.fail("a tensor was read"))
    assert main(["inspect", str(edited)]) == 2 and expected in capsys.readouterr().err


def test_settings_transformers_overrides_or_ignores_are_read():
    """head_dim (GLM-5.2 writes 192; transformers sets it to qk_rope_head_dim) and the first-k
    mlp_layer_types are accepted; GLM-5.2's schedule gives 21 full layers; a pattern string and the
    freq/offset schedule resolve as transformers' GlmMoeDsaConfig does."""
    from transformers import GlmMoeDsaConfig

    glm = FAMILIES["glm_moe_dsa"]
    cfg = glm.config_class.from_dict(glm.presets["glm-5.2"])
    assert cfg.layer_indexers.count("full") == 21 and cfg.layer_indexers[:7] == ("full",) * 3 + ("shared",) * 3 + \
        ("full",)
    assert not glm.config_class.from_dict(glm.presets["glm-5"]).shares_selections
    for kw in (dict(index_topk_pattern="FSSF"), dict(index_topk_freq=2, index_skip_topk_offset=1),
               dict(indexer_types=["full", "full", "shared", "full"])):
        hf = GlmMoeDsaConfig(num_hidden_layers=4, **kw)
        ours = glm.config_class.from_dict({**hf.to_dict(), "architectures": ["GlmMoeDsaForCausalLM"]})
        assert ours.layer_indexers == tuple(hf.indexer_types), kw
    v32 = FAMILIES["deepseek_v32"].config_class
    assert v32.from_dict({**FAMILIES["deepseek_v32"].tiny, "head_dim": 999, "index_topk_freq": 1}).index_topk == 64

"""DeepSeek-V4 (`deepseek_v4`) against transformers 5.24 beyond the shared family tests
(tests/test_families.py, which run on its TEST config at 14 tokens): on a hardened checkpoint
transformers writes (every attention kind: sliding, CSA with its indexer, HCA; both MoE kinds: hash
and routed; random norms, hyper-connection bases and scales, position biases and sinks, a decisive
router, random partly negative balance biases, random tid2eid tables) and a padded batch of 40
tokens (longer than the window, with more compressed entries than the indexer keeps), the experts
each layer chooses and the float32 logits equal transformers'; planted bugs (Sinkhorn cut to one
normalisation, the compressed branches rotated with the sliding layers' base, no indexer
selection) fail that comparison; the router's sqrtsoftplus and given (hash) choice against their
formulas; greedy generation with V4's caches (the window's ring, the compressors' entries, pending
window and overlap, the indexer's keys) equal to transformers' `generate` token for token on a
padded batch, its decode steps' logits equal to transformers' and to the full forward's, and
planted cache bugs failing that; the refusals of what this phase does not implement."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from family_fixtures import make_family_checkpoint  # noqa: E402
from hf_fixtures import batch, hook_router  # noqa: E402

from flax import nnx  # noqa: E402

from moejax import AutoModelForCausalLM  # noqa: E402
from moejax.inference.generate import generate  # noqa: E402
from moejax.errors import ConfigError  # noqa: E402
from moejax.models.deepseek_v4 import attention, hyper  # noqa: E402
from moejax.moe.routing import RouterConfig, route  # noqa: E402

S = 40  # > sliding_window (8); CSA: 10 entries, index_topk 2; HCA: 5 entries


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    path = tmp_path_factory.mktemp("v4") / "ckpt"
    hf = make_family_checkpoint("deepseek_v4", path, seed=40)
    ids, mask = batch(96, seed=41, S=S)
    want, seen = hook_router(hf, ids, mask)
    return path, hf, AutoModelForCausalLM.from_pretrained(path, dtype=jnp.float32), ids, mask, want, seen


def compare(model, ids, mask, want, seen):
    """(largest logits difference on real tokens, {layer: tokens whose chosen experts differ})."""
    out = model(jnp.asarray(ids), jnp.asarray(mask), return_routing=True)
    valid = mask.reshape(-1).astype(bool)
    flips = {l: int((np.sort(np.asarray(out.routing[l].expert_idx_TK)[valid], 1)
                     != np.sort(idx.numpy()[valid], 1)).any(1).sum()) for l, (_, _, _, idx) in seen.items()}
    m = mask.astype(bool)
    return float(np.abs(np.asarray(out.logits_BSV)[m] - want[m]).max()), flips


def test_the_checkpoint_exercises_every_part(v4):
    """The comparison below means something: each attention kind and MoE kind is present, the
    window is shorter than the sequence, the indexer keeps fewer entries than late queries see, the
    hash tables are random (transformers initialises them to zeros) and the hash layers route by them."""
    path, hf, model, ids, mask, _, seen = v4
    cfg = model.config
    assert set(cfg.attention_types) == {"sliding_attention", "compressed_sparse_attention",
                                        "heavily_compressed_attention"}
    assert {True, False} == set(cfg.hash_layers) and cfg.sliding_window < S
    assert S // cfg.rates[0] > cfg.index_topk and S // cfg.rates[1] >= 2
    for l, hashed in enumerate(cfg.hash_layers):
        block = hf.model.layers[l].mlp
        if hashed:
            table = block.gate.tid2eid.numpy()
            assert len(np.unique(table, axis=0)) > 10
            np.testing.assert_array_equal(seen[l][3].numpy(), table[ids.reshape(-1)])
            np.testing.assert_array_equal(np.asarray(model.model.layers[l].mlp.tid2eid[...]), table)
        else:
            bias = block.gate.e_score_correction_bias.numpy()
            assert (bias < 0).any() and (bias > 0).any()


def test_chosen_experts_and_logits_equal_transformers_on_a_padded_batch(v4):
    _, _, model, ids, mask, want, seen = v4
    err, flips = compare(model, ids, mask, want, seen)
    assert flips == {l: 0 for l in seen}, flips   # routing first: a flipped expert explains everything else
    assert err < 1e-4, err
    assert np.abs(want).max() > 0.5


@pytest.mark.parametrize("bug", ["sinkhorn_once", "compress_rope_base", "no_selection"])
def test_a_planted_bug_fails_the_comparison(v4, monkeypatch, bug):
    """The comparison catches each of these (planted in the module functions the model calls)."""
    _, _, model, ids, mask, want, seen = v4
    if bug == "sinkhorn_once":
        sinkhorn = hyper.sinkhorn
        monkeypatch.setattr(hyper, "sinkhorn", lambda comb, iters, eps: sinkhorn(comb, 1, eps))
    elif bug == "compress_rope_base":
        angles = attention.rope_angles
        monkeypatch.setattr(attention, "rope_angles", lambda cfg, which, *a: angles(cfg, "main", *a))
    else:
        monkeypatch.setattr(attention, "select_entries", lambda scores, visible, k: np.broadcast_to(
            visible, scores.shape))
    err, flips = compare(model, ids, mask, want, seen)
    assert err > 1e-3 or any(flips.values()), (bug, err)


def test_sqrtsoftplus_routing_and_a_given_choice_follow_their_formulas():
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 3, size=(32, 8)).astype(np.float32)
    bias = rng.normal(0, 0.3, size=8).astype(np.float32)
    cfg = RouterConfig(top_k=2, scoring_func="sqrtsoftplus", routed_scaling_factor=1.5)
    r = route(jnp.asarray(logits), cfg, jnp.asarray(bias))
    scores = np.sqrt(np.log1p(np.exp(logits.astype(np.float64))))
    idx = np.argsort(-(scores + bias), axis=1, kind="stable")[:, :2]
    np.testing.assert_array_equal(np.sort(np.asarray(r.expert_idx_TK), 1), np.sort(idx, 1))
    g = np.take_along_axis(scores, np.asarray(r.expert_idx_TK), 1)
    np.testing.assert_allclose(np.asarray(r.gate_TK), g / g.sum(1, keepdims=True) * 1.5, rtol=1e-6)
    chosen = rng.integers(0, 8, size=(32, 2))
    given = route(jnp.asarray(logits), cfg, jnp.asarray(bias), chosen_TK=jnp.asarray(chosen))
    np.testing.assert_array_equal(np.asarray(given.expert_idx_TK), chosen)
    g = np.take_along_axis(scores, chosen, 1)
    np.testing.assert_allclose(np.asarray(given.gate_TK), g / g.sum(1, keepdims=True) * 1.5, rtol=1e-6)
    with pytest.raises(ConfigError, match="hash-routed MoE layer .* pruning, merging or masking"):
        route(jnp.asarray(logits), cfg, None, jnp.ones(8, bool), jnp.asarray(chosen))


def test_what_this_phase_does_not_implement_is_refused_by_name(v4):
    _, _, model, ids, mask, _, _ = v4
    hashed = model.config.hash_layers.index(True)
    z = jnp.zeros((1, 3, model.config.hidden_size))
    with pytest.raises(ConfigError, match="hash-routed MoE layer .* did not hand it the tokens' ids"):
        model.model.layers[hashed].mlp(z)
    masks = np.ones((model.config.num_hidden_layers, model.config.n_experts), bool)
    masks[hashed, 0] = False   # a hash layer is kept whole: a mask may not drop its experts
    with pytest.raises(ConfigError, match=f"layer {hashed} is a DeepSeek-V4 layer kept whole"):
        model(jnp.asarray(ids), jnp.asarray(mask), variant=jnp.asarray(masks))
    with pytest.raises(ConfigError, match="DeepSeek-V4: rope positions"):
        model(jnp.asarray(ids), positions_BS=jnp.zeros(ids.shape, jnp.int32))


# Generation: a prompt of 20 columns then 20 new tokens. The prompt is longer than the window (8),
# and while decoding the window wraps (20 steps > 8), CSA (rate 4) closes 5 windows and HCA (rate 8)
# 3 (columns 23, 31, 39), each pooled from the pending window (and CSA's from the prior Ca); row 2's
# 9 columns of padding put its positions a whole HCA window behind its columns, so the entries its
# queries see by position (prefill, the indexer) differ from the entries emitted by column.
P, N_NEW = 20, 20


@pytest.fixture(scope="module")
def generated(v4):
    """(prompt ids, mask, transformers' sequences [B, P + N_NEW], its logits of each new token [N, B, V])."""
    _, hf, model, *_ = v4
    cfg = model.config
    assert P > cfg.sliding_window and N_NEW > cfg.sliding_window
    assert [((P + N_NEW) // r) - (P // r) for r in cfg.rates] == [5, 3]
    rng = np.random.default_rng(7)
    ids = rng.integers(2, 96, size=(3, P))
    mask = np.ones_like(ids)
    mask[1, :3] = 0
    mask[2, :9] = 0
    with torch.no_grad():
        out = hf.generate(input_ids=torch.as_tensor(ids), attention_mask=torch.as_tensor(mask), max_new_tokens=N_NEW,
                          do_sample=False, eos_token_id=None, pad_token_id=0, output_logits=True,
                          return_dict_in_generate=True)
    return ids, mask, out.sequences.numpy(), np.stack([l.float().numpy() for l in out.logits])


def stepped_logits(model, ids, mask, sequences):
    """Logits [N_NEW, B, V] of moejax's prefill on the prompt, then its decode steps fed `sequences`'
    continuation (teacher-forced), positions as generate numbers them."""
    graphdef, state = nnx.split(model)
    prefill = jax.jit(lambda state, *a: nnx.merge(graphdef, state).prefill(*a))
    decode = jax.jit(lambda state, *a: nnx.merge(graphdef, state).decode_step(*a))
    full = np.concatenate([mask, np.ones((mask.shape[0], N_NEW), mask.dtype)], axis=1)
    positions = np.maximum(np.cumsum(full, axis=1) - 1, 0).astype(np.int32)
    out = prefill(state, jnp.asarray(ids), jnp.asarray(positions[:, :P]), jnp.asarray(mask),
                  model.init_cache(ids.shape[0], P + N_NEW))
    logits, cache = [out.logits_BSV[:, -1]], out.cache
    for t in range(P, P + N_NEW - 1):
        out = decode(state, jnp.asarray(sequences[:, t:t + 1]), jnp.asarray(positions[:, t:t + 1]), cache, t)
        logits.append(out.logits_BSV[:, 0])
        cache = out.cache
    return np.asarray(jnp.stack(logits))


def test_greedy_generation_with_the_caches_equals_transformers(v4, generated):
    """moejax's generation (prefill, then the compiled decode loop) on the padded batch gives
    transformers' `generate(do_sample=False)` token for token, and every step's logits (teacher-
    forced on its tokens) are within 1e-4 of transformers'."""
    _, _, model, *_ = v4
    ids, mask, want, want_logits = generated
    got = np.asarray(generate(model, ids, mask, max_new_tokens=N_NEW))
    np.testing.assert_array_equal(got, want)
    assert len({tuple(row) for row in want[:, P:]}) == 3   # the rows generate different continuations
    err = np.abs(stepped_logits(model, ids, mask, want) - want_logits).max()
    assert err < 1e-4, err


def test_decode_steps_equal_the_full_forward(v4, generated):
    """Without padding (positions = columns), each decode step's logits equal the whole-sequence
    forward's at that position (the forward is causal: entries of later windows are unseen)."""
    _, _, model, *_ = v4
    ids, _, want, _ = generated
    ones = np.ones_like(ids)
    seq = want.copy()
    seq[:, :P] = ids
    forward = np.asarray(model(jnp.asarray(seq), jnp.asarray(np.ones_like(seq))).logits_BSV)
    err = np.abs(stepped_logits(model, ids, ones, seq) - np.moveaxis(forward[:, P - 1:-1], 1, 0)).max()
    assert err < 1e-4, err


@pytest.mark.parametrize("bug", ["pending_dropped", "overlap_dropped"])
def test_a_planted_cache_bug_fails_generation(v4, generated, monkeypatch, bug):
    """The comparison catches a compressor that forgets its pending window between steps (only the
    closing token pooled) or the previous window's Ca (CSA's overlap)."""
    _, _, model, *_ = v4
    ids, mask, want, want_logits = generated
    step = attention.Compressor.step
    if bug == "pending_dropped":
        def planted(self, x, column, cache, cfg):
            return step(self, x, column, cache._replace(kv_BMJ=jnp.zeros_like(cache.kv_BMJ),
                                                        gate_BMJ=jnp.full_like(cache.gate_BMJ, -1e9)), cfg)
    else:
        def planted(self, x, column, cache, cfg):
            if cache.prior_kv_BMQ is not None:
                cache = cache._replace(prior_gate_BMQ=jnp.full_like(cache.prior_gate_BMQ, -jnp.inf))
            return step(self, x, column, cache, cfg)
    monkeypatch.setattr(attention.Compressor, "step", planted)
    err = np.abs(stepped_logits(model, ids, mask, want) - want_logits).max()
    assert err > 1e-3, (bug, err)


# The published counts (DeepSeek's model cards: V4-Flash 284B total / 13B active, V4-Pro 1.6T / 49B)
# and the published configs' attention schedules (their weight listings: the layers with a
# compressor, and those of them with an indexer)
PUBLISHED = {"deepseek-v4-flash": dict(total=284e9, digits=9, active=13e9, sliding=[0, 1],
                                       csa=list(range(2, 43, 2)), hca=list(range(3, 42, 2))),
             "deepseek-v4-pro": dict(total=1.6e12, digits=11, active=49e9, sliding=[],
                                     csa=list(range(2, 61, 2)), hca=[0, 1, *range(3, 60, 2)])}


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_full_size_presets_have_the_published_counts_and_schedule(preset):
    """jax.eval_shape of V4-Flash and V4-Pro at full size: the parameter count rounds to the
    published total (284B, 1.6T; moejax builds no MTP block), and the active count (the shared
    parts, top_k of the routed experts, the output head; not the input embedding, which is a
    lookup) to the published active one (13B, 49B); each layer's attention kind is the published
    checkpoint's, and the first 3 layers are hash-routed. The preset's FP4 experts read as such."""
    from moejax.hf.mapping import param_shapes
    from moejax.models.registry import FAMILIES

    fam, want = FAMILIES["deepseek_v4"], PUBLISHED[preset]
    cfg = fam.config_class.from_dict(fam.presets[preset], source=preset)
    shapes = param_shapes(nnx.eval_shape(lambda: fam.causal_lm()(cfg, jnp.bfloat16)))
    size = {name: int(np.prod(s)) for name, s in shapes.items()}
    total = sum(size.values())
    routed = sum(v for name, v in size.items() if ".mlp.experts_" in name)
    active = total - routed + routed * cfg.num_experts_per_tok // cfg.n_experts - size["model.embed_tokens"]
    assert round(total, -want["digits"]) == want["total"], total
    assert round(active, -9) == want["active"], active
    kinds = {kind: [l for l, t in enumerate(cfg.attention_types) if t == kind] for kind in set(cfg.attention_types)}
    assert kinds.get("sliding_attention", []) == want["sliding"]
    assert kinds["compressed_sparse_attention"] == want["csa"] and kinds["heavily_compressed_attention"] == want["hca"]
    assert [l for l, h in enumerate(cfg.hash_layers) if h] == [0, 1, 2]
    assert cfg.quantization_config["expert_dtype"] == "fp4"


@pytest.mark.parametrize("bad", [-1, "E"])
def test_a_hash_table_id_outside_the_experts_is_refused_naming_the_tensor(v4, tmp_path, bad):
    """tid2eid sends each token id to experts; an id outside [0, E) (which JAX's indexing would
    clamp to the last expert) is refused on load, naming the tensor and the file."""
    import json
    import shutil

    from safetensors.numpy import load_file, save_file

    from moejax.errors import CheckpointError

    path = v4[0]
    copy = tmp_path / "ckpt"
    shutil.copytree(path, copy)
    n_experts = json.loads((copy / "config.json").read_text())["n_routed_experts"]
    shard = next(p for p in sorted(copy.glob("*.safetensors")) if any("tid2eid" in k for k in load_file(p)))
    tensors = load_file(shard)
    name = next(k for k in tensors if "tid2eid" in k)
    tensors[name] = tensors[name].copy()
    tensors[name][3, 1] = n_experts if bad == "E" else bad
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"^{name} in {shard.name}: 1 id\(s\) outside \[0, {n_experts}\)"):
        AutoModelForCausalLM.from_pretrained(copy, dtype=jnp.float32)

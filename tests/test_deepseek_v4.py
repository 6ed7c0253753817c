"""DeepSeek-V4 (`deepseek_v4`) against transformers 5.24 beyond the shared family tests
(tests/test_families.py, which run on its TEST config at 14 tokens): on a hardened checkpoint
transformers writes (every attention kind: sliding, CSA with its indexer, HCA; both MoE kinds: hash
and routed; random norms, hyper-connection bases and scales, position biases and sinks, a decisive
router, random partly negative balance biases, random tid2eid tables) and a padded batch of 40
tokens (longer than the window, with more compressed entries than the indexer keeps), the experts
each layer chooses and the float32 logits equal transformers'; planted bugs (Sinkhorn cut to one
normalisation, the compressed branches rotated with the sliding layers' base, no indexer
selection) fail that comparison; the router's sqrtsoftplus and given (hash) choice against their
formulas; the refusals of what this phase does not implement."""

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from family_fixtures import make_family_checkpoint  # noqa: E402
from hf_fixtures import batch, hook_router  # noqa: E402

from moejax import AutoModelForCausalLM  # noqa: E402
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
    with pytest.raises(ConfigError, match=r"DeepSeek-V4: generation \(a KV cache\) is not implemented"):
        model.init_cache(1, 8)

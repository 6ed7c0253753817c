"""DSA's lightning indexer (moejax.models.dsa_indexer) against transformers' DeepseekV32Indexer and
GlmMoeDsaIndexer (torch, float32): index scores, the selected keys per query (exactly where the
top-k boundary is not a score tie; tie rows checked as ties), left-padded rows against each row
alone, the decode cache against the full form, the GLM-5 per-layer schedule, and the attention
mask transformers' MLA builds from the selection."""

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402
from transformers import DeepseekV32Config, GlmMoeDsaConfig  # noqa: E402
from transformers.models.deepseek_v32 import modeling_deepseek_v32 as hf_ds  # noqa: E402
from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as hf_glm  # noqa: E402

from moejax.models import dsa_indexer as dsa  # noqa: E402

TOPK = 8
S = 40
SMALL = dict(hidden_size=64, q_lora_rank=24, qk_rope_head_dim=8, index_n_heads=4, index_head_dim=16,
             index_topk=TOPK, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
             qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=256,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
FAMILIES = {
    "deepseek_v32": (DeepseekV32Config, hf_ds, hf_ds.DeepseekV32Indexer, hf_ds.DeepseekV32RotaryEmbedding,
                     hf_ds.DeepseekV32Attention),
    "glm_moe_dsa": (GlmMoeDsaConfig, hf_glm, hf_glm.GlmMoeDsaIndexer, hf_glm.GlmMoeDsaRotaryEmbedding,
                    hf_glm.GlmMoeDsaAttention),
}


def randomise(module, seed):
    """Every parameter matters: linears ~ N(0, 1/fan_in), LayerNorm weight around 1, bias nonzero."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * r)
            elif name.endswith("norm.bias"):
                p.copy_(0.3 * r)
            else:
                p.copy_(r / p.shape[-1] ** 0.5)
    return module


def copy_indexer(hf_ix, cfg):
    """transformers' indexer weights into a LightningIndexer: Linear weights transposed to [in, out]."""
    sd = {k: v.detach().numpy() for k, v in hf_ix.state_dict().items()}
    assert sorted(sd) == ["k_norm.bias", "k_norm.weight", "weights_proj.weight", "wk.weight", "wq_b.weight"]
    m = dsa.LightningIndexer(cfg, jnp.float32, nnx.Rngs(0))
    m.wq_b[...] = jnp.asarray(sd["wq_b.weight"].T)
    m.wk[...] = jnp.asarray(sd["wk.weight"].T)
    m.weights_proj[...] = jnp.asarray(sd["weights_proj.weight"].T)
    m.k_norm.weight[...] = jnp.asarray(sd["k_norm.weight"])
    m.k_norm.bias[...] = jnp.asarray(sd["k_norm.bias"])
    return m


class CaptureTopk(TorchFunctionMode):
    """The index scores transformers' indexer hands to `Tensor.topk` (masked with -inf)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.topk:
            self.scores = args[0].detach().clone()
        return func(*args, **(kwargs or {}))


def hf_select(hf_ix, x, qr, cos, sin, allowed):
    """(selected bool [B, S, T] = transformers' top-k indices scattered, intersected with allowed;
    float32 scores [B, S, T])."""
    cap = CaptureTopk()
    with cap, torch.no_grad():
        idx = hf_ix(x, qr, (cos, sin), torch.as_tensor(allowed), None)
    sel = np.zeros(allowed.shape, bool)
    np.put_along_axis(sel, idx.long().numpy(), True, axis=-1)
    return sel & allowed, cap.scores.numpy()


def ours_select(m, x, qr, cos, sin, allowed):
    j = lambda t: jnp.asarray(t.numpy() if isinstance(t, torch.Tensor) else t)  # noqa: E731
    return np.asarray(m(j(x), j(qr), j(cos), j(sin), j(allowed)))


def compare_selection(ours, want, scores, allowed, topk=TOPK):
    """Per query: at most topk allowed keys -> exactly those; otherwise, where the topk-th and the
    next allowed score differ by more than 1e-5 of the row's largest, the sets are equal; at a tie
    both hold every key above the tie, only keys of the tie, and topk keys. Returns (exact, tie)
    row counts; most rows must be compared exactly."""
    exact = ties = 0
    for b, s in np.ndindex(*allowed.shape[:2]):
        a = allowed[b, s]
        if a.sum() <= topk:
            assert (ours[b, s] == a).all() and (want[b, s] == a).all(), (b, s)
            continue
        v = np.sort(scores[b, s][a])[::-1]
        tol = 1e-5 * np.abs(v).max() + 1e-30
        if v[topk - 1] - v[topk] > tol:
            np.testing.assert_array_equal(ours[b, s], want[b, s], err_msg=f"query {b}, {s}")
            exact += 1
        else:
            sure, cand = a & (scores[b, s] > v[topk - 1] + tol), a & (scores[b, s] >= v[topk - 1] - tol)
            for sel in (ours[b, s], want[b, s]):
                assert sel.sum() == topk and (sel >= sure).all() and (sel <= cand).all(), (b, s)
            ties += 1
    assert exact >= 10 and exact >= 4 * ties, (exact, ties)
    return exact, ties


def positions_and_allowed(key_mask):
    """Per-row positions (generation's cumsum - 1) and the causal & padding mask."""
    B, n = key_mask.shape
    pos = np.maximum(np.cumsum(key_mask, -1) - 1, 0)
    allowed = np.tril(np.ones((n, n), bool))[None] & key_mask[:, None, :].astype(bool)
    return torch.as_tensor(pos), allowed


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    name = request.param
    Cfg, _, Indexer, Rope, _ = FAMILIES[name]
    cfg = Cfg(**SMALL)
    hf_ix = randomise(Indexer(cfg, 0).eval(), seed=len(name))
    rope = Rope(cfg)
    g = torch.Generator().manual_seed(7)
    x, qr = torch.randn(2, S, 64, generator=g), torch.randn(2, S, 24, generator=g)
    return dict(name=name, cfg=cfg, hf=hf_ix, ours=copy_indexer(hf_ix, cfg), rope=rope, x=x, qr=qr)


def test_config_and_rope_form(family):
    c = dsa.IndexerConfig.of(family["cfg"])
    assert (c.index_n_heads, c.index_head_dim, c.index_topk, c.q_lora_rank) == (4, 16, TOPK, 24)
    assert c.rope_interleave == (family["name"] == "glm_moe_dsa")  # V3.2's indexer: half-split
    assert dsa.IndexerConfig.of({**family["cfg"].to_dict(), "indexer_rope_interleave": True}).rope_interleave


def test_scores_and_selection_match_transformers(family):
    x, qr, m = family["x"], family["qr"], family["ours"]
    pos = torch.arange(S)[None].expand(2, S)
    cos, sin = family["rope"](x, pos)
    allowed = np.broadcast_to(np.tril(np.ones((S, S), bool)), (2, S, S)).copy()
    want, want_scores = hf_select(family["hf"], x, qr, cos, sin, allowed)
    j = lambda t: jnp.asarray(t.numpy())  # noqa: E731
    scores = np.asarray(m.scores(j(x), j(qr), j(cos), j(sin)))
    scale = np.abs(np.where(allowed, want_scores, 0)).max(-1, keepdims=True)
    err = np.where(allowed, np.abs(scores - want_scores), 0) / scale
    assert err.max() < 1e-5, err.max()
    assert np.median(scale) > 0.1  # not trivially small
    compare_selection(ours_select(m, x, qr, cos, sin, allowed), want, want_scores, allowed)
    # the rope form matters at these sizes: the other family's form gives other scores
    other = dsa.LightningIndexer(dataclasses.replace(m.cfg, rope_interleave=not m.cfg.rope_interleave),
                                 jnp.float32, nnx.Rngs(0))
    nnx.update(other, nnx.state(m))
    wrong = np.asarray(other.scores(j(x), j(qr), j(cos), j(sin)))
    assert (np.where(allowed, np.abs(wrong - want_scores), 0) / scale).max() > 1e-2


def test_left_padded_rows_match_transformers_alone(family):
    x, qr, m = family["x"], family["qr"], family["ours"]
    pads = (5, 13)
    key_mask = np.ones((2, S), np.int32)
    for b, p in enumerate(pads):
        key_mask[b, :p] = 0
    pos, allowed = positions_and_allowed(key_mask)
    cos, sin = family["rope"](x, pos)
    ours = ours_select(m, x, qr, cos, sin, allowed)
    assert not (ours & ~allowed).any()  # padding (and the future) never selected
    for b, p in enumerate(pads):
        assert not ours[b, :, :p].any() and not ours[b, :p].any()
        n = S - p
        xb, qb = x[b:b + 1, p:], qr[b:b + 1, p:]
        cb, sb = family["rope"](xb, torch.arange(n)[None])
        alone = np.tril(np.ones((n, n), bool))[None]
        want, want_scores = hf_select(family["hf"], xb, qb, cb, sb, alone)
        compare_selection(ours[b:b + 1, p:, p:], want, want_scores, alone)
        # ties included, a row of the padded batch selects exactly what it selects alone
        np.testing.assert_array_equal(ours[b:b + 1, p:, p:], ours_select(m, xb, qb, cb, sb, alone))


def test_decode_cache_matches_full_form(family):
    x, qr, m = family["x"], family["qr"], family["ours"]
    key_mask = np.ones((2, S), np.int32)
    key_mask[1, :9] = 0
    pos, allowed = positions_and_allowed(key_mask)
    cos, sin = (jnp.asarray(t.numpy()) for t in family["rope"](x, pos))
    xj, qj = jnp.asarray(x.numpy()), jnp.asarray(qr.numpy())
    full = ours_select(m, xj, qj, cos, sin, allowed)
    P, C = 12, S + 4  # prompt length; cache columns, 4 never written
    allowed_C = np.zeros((2, S, C), bool)
    allowed_C[:, :, :S] = allowed
    cache = dsa.LightningIndexer.empty_cache(m.cfg, 2, C, jnp.float32)
    sel, cache = m.prefill(xj[:, :P], qj[:, :P], cos[:, :P], sin[:, :P], jnp.asarray(allowed[:, :P, :P]), cache)
    np.testing.assert_array_equal(np.asarray(sel), full[:, :P, :P])
    step = nnx.jit(lambda mod, *a: mod.decode(*a))
    for t in range(P, S):
        sel, cache = step(m, xj[:, t:t + 1], qj[:, t:t + 1], cos[:, t:t + 1], sin[:, t:t + 1], cache, t,
                          jnp.asarray(allowed_C[:, t:t + 1]))
        sel = np.asarray(sel)[:, 0]
        assert not sel[:, S:].any()
        np.testing.assert_array_equal(sel[:, :S], full[:, t], err_msg=f"step {t}")
    np.testing.assert_allclose(np.asarray(cache.keys_BCD[:, :S]), np.asarray(m.keys(xj, cos, sin)), rtol=1e-6, atol=1e-6)
    assert (full.sum(-1) == np.minimum(allowed.sum(-1), TOPK)).all()


def test_selection_ties_padding_and_signed_zero():
    """Ties go to the lowest column, whatever the left padding; -0.0 ties +0.0; a query with at
    most topk allowed keys keeps them all; disallowed columns are never chosen."""
    row = np.array([3.0, -0.0, 0.0, 2.0, 0.0, -1.0, 0.0, 5.0], np.float32)
    allowed = np.ones((1, 1, 8), bool)
    sel = np.asarray(dsa.topk_selection(jnp.asarray(row)[None, None], jnp.asarray(allowed), 4))[0, 0]
    assert sel.tolist() == [True, True, False, True, False, False, False, True]  # the -0.0 at column 1 wins
    for pad in (1, 5):
        padded = np.concatenate([np.full(pad, 9.0, np.float32), row])[None, None]
        allowed_p = np.concatenate([np.zeros(pad, bool), np.ones(8, bool)])[None, None]
        got = np.asarray(dsa.topk_selection(jnp.asarray(padded), jnp.asarray(allowed_p), 4))[0, 0]
        assert not got[:pad].any() and (got[pad:] == sel).all()
    few = np.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0], np.float32)[None, None]
    mask = np.array([0, 0, 1, 0, 1, 1, 0, 0], bool)[None, None]
    assert (np.asarray(dsa.topk_selection(jnp.asarray(few), jnp.asarray(mask), 4)) == mask).all()
    assert (np.asarray(dsa.topk_selection(jnp.asarray(few), jnp.asarray(mask), 9)) == mask).all()


def test_glm_layer_schedule_matches_transformers():
    for kw in ({}, dict(index_topk_freq=4, index_skip_topk_offset=3), dict(index_topk_freq=3),
               dict(index_topk_pattern="FFSSFS")):
        hf = GlmMoeDsaConfig(num_hidden_layers=6 if "index_topk_pattern" in kw else 14, **kw)
        mine = dsa.indexer_types({"model_type": "glm_moe_dsa", "num_hidden_layers": hf.num_hidden_layers, **kw})
        assert list(mine) == list(hf.indexer_types), kw
        assert dsa.indexer_types(hf) == mine
    types = dsa.indexer_types({"model_type": "glm_moe_dsa", "num_hidden_layers": 14, "index_topk_freq": 4,
                               "index_skip_topk_offset": 3})
    assert [i for i, t in enumerate(types) if t == "full"] == [0, 1, 2, 6, 10]
    assert dsa.selection_sources(types) == (0, 1, 2, 2, 2, 2, 6, 6, 6, 6, 10, 10, 10, 10)
    glm52 = dsa.indexer_types({"model_type": "glm_moe_dsa", "num_hidden_layers": 78, "index_topk_freq": 4,
                               "index_skip_topk_offset": 3})
    assert types.count("full") == 5 and glm52.count("full") == 21
    assert dsa.indexer_types(DeepseekV32Config(num_hidden_layers=5)) == ("full",) * 5
    with pytest.raises(ValueError, match="none precedes"):
        dsa.selection_sources(("shared", "full"))


@pytest.mark.parametrize("name", list(FAMILIES))
@pytest.mark.parametrize("additive", [False, True])
def test_mla_attention_mask_is_allowed_and_selected(name, additive, monkeypatch):
    """transformers' MLA (eager) attends with exactly `sparse_allowed(allowed, selected)`, the
    selection scattered from its indexer's top-k (or, on a GLM-5 shared layer, the one passed in)."""
    Cfg, module, _, Rope, Attention = FAMILIES[name]
    extra = dict(indexer_types=["full", "shared"]) if name == "glm_moe_dsa" else {}
    cfg = Cfg(**SMALL, **extra, attn_implementation="eager")
    seen = {}

    def spy(mod, q, k, v, attention_mask, **kw):
        seen["mask"] = attention_mask.detach().clone()
        return real(mod, q, k, v, attention_mask, **kw)

    real = module.eager_attention_forward
    monkeypatch.setattr(module, "eager_attention_forward", spy)
    key_mask = np.ones((2, S), np.int32)
    key_mask[0, :6] = 0
    pos, allowed = positions_and_allowed(key_mask)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, S, 64, generator=g)
    cos, sin = Rope(cfg)(x, pos)
    if additive:
        mask4 = torch.where(torch.as_tensor(allowed), 0.0, torch.finfo(torch.float32).min)[:, None]
    else:
        mask4 = torch.as_tensor(allowed)[:, None]
    attn = randomise(Attention(cfg, 0).eval(), seed=11)
    idx = {}
    attn.indexer.register_forward_hook(lambda mod, a, out: idx.__setitem__("i", out))
    with torch.no_grad():
        out = attn(x, (cos, sin), mask4, position_ids=pos)
    if name == "glm_moe_dsa":
        assert torch.equal(out[2], idx["i"])  # the selection handed to the next (shared) layer
    sel = np.zeros(allowed.shape, bool)
    np.put_along_axis(sel, idx["i"].long().numpy(), True, axis=-1)
    got = seen["mask"][:, 0].numpy()
    got = got if got.dtype == bool else got == 0
    expected = np.asarray(dsa.sparse_allowed(jnp.asarray(allowed), jnp.asarray(sel & allowed)))
    np.testing.assert_array_equal(got, expected)
    assert (expected.sum(-1) < allowed.sum(-1)).any()  # the selection removes keys
    if name == "glm_moe_dsa":
        shared = randomise(Attention(cfg, 1).eval(), seed=12)
        assert shared.indexer is None
        prev = torch.as_tensor(np.argsort(-np.random.default_rng(0).random((2, S, S)), -1)[..., :TOPK]).int()
        with torch.no_grad():
            shared(x, (cos, sin), mask4, position_ids=pos, prev_topk_indices=prev)
        sel = np.zeros(allowed.shape, bool)
        np.put_along_axis(sel, prev.long().numpy(), True, axis=-1)
        got = seen["mask"][:, 0].numpy()
        np.testing.assert_array_equal(got if got.dtype == bool else got == 0, allowed & sel)

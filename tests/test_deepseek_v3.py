"""DeepSeek-V3 in NNX against transformers' eager DeepseekV3ForCausalLM (torch), on tiny random
checkpoints transformers itself writes: chosen experts per layer, logits, expert masks, round trips."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hf_fixtures import DEFAULT_ROPE, batch, make_checkpoint, reference, unreachable  # noqa: E402

from moejax import from_pretrained, save_pretrained  # noqa: E402
from moejax.hf.io.checkpoint_reader import CheckpointReader  # noqa: E402

CASES = {
    # q LoRA, group-limited routing (topk_group < n_group), YaRN, untied head, one dense layer
    "qlora-groups-yarn": {},
    # plain q_proj (Moonlight), default rope, tied head, two dense layers, no groups
    "plain-q-default-rope-tied": dict(q_lora_rank=None, rope_parameters=DEFAULT_ROPE, tie_word_embeddings=True,
                                      first_k_dense_replace=2, n_group=1, topk_group=1, num_hidden_layers=4),
    # attention biases, rms_norm_eps 1e-5 (latent norms stay 1e-6), no renormalisation, half-split rope
    "bias-eps-nonorm-halfsplit": dict(attention_bias=True, rms_norm_eps=1e-5, norm_topk_prob=False,
                                      rope_interleave=False, n_group=2, topk_group=1, num_experts_per_tok=3),
}


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("dsv3")
    out = {}
    for i, (name, kw) in enumerate(CASES.items()):
        path = root / name
        out[name] = (path, make_checkpoint(path, seed=i, **kw))
    return out


def run(model, ids, mask, **kw):
    logits, routing, _ = model.jitted()(jnp.asarray(ids), jnp.asarray(mask), return_routing=True,
                                     variant=kw.get("variant"))
    return np.asarray(logits), {l: np.asarray(r.expert_idx_TK) for l, r in routing.items()}


@pytest.mark.parametrize("case", list(CASES))
def test_routing_and_logits_match_transformers(checkpoints, case):
    path, hf = checkpoints[case]
    ids, mask = batch(hf.config.vocab_size)
    want_logits, want_chosen = reference(hf, ids, mask)
    model = from_pretrained(path, dtype=jnp.float32)
    logits, chosen = run(model, ids, mask)
    valid = mask.reshape(-1).astype(bool)
    assert sorted(chosen) == sorted(want_chosen) and chosen
    for layer in want_chosen:  # compare routing before logits: a flipped expert explains everything else
        np.testing.assert_array_equal(np.sort(chosen[layer][valid], 1), np.sort(want_chosen[layer][valid], 1),
                                      err_msg=f"layer {layer}")
    assert np.abs(logits[mask.astype(bool)] - want_logits[mask.astype(bool)]).max() < 1e-4
    assert np.abs(want_logits).max() > 0.5  # the logits are not trivially small


def test_bfloat16_within_stated_tolerance(checkpoints):
    from transformers import DeepseekV3ForCausalLM as HF

    path, _ = checkpoints["qlora-groups-yarn"]
    hf = HF.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="eager",
                            experts_implementation="eager").eval()
    assert hf.model.layers[1].mlp.gate.weight.dtype == torch.float32  # transformers keeps the router in f32
    ids, mask = batch(hf.config.vocab_size)
    want, want_chosen = reference(hf, ids, mask)
    logits, chosen = run(from_pretrained(path, dtype=jnp.bfloat16), ids, mask)
    # In bfloat16 a near-tie can route a token differently from transformers (rounding differs
    # between XLA and torch), and that token's logits then differ by O(1). The stated tolerance:
    # at least 90% of tokens route identically in every layer, and every such token's logits are
    # within 3% of the largest logit. (float32 transformers vs bfloat16 transformers differ by ~35%.)
    same = np.ones(ids.size, bool)
    for layer in want_chosen:
        same &= (np.sort(chosen[layer], 1) == np.sort(want_chosen[layer], 1)).all(1)
    valid = mask.reshape(-1).astype(bool)
    assert same[valid].mean() >= 0.9
    diff = np.abs(logits.astype(np.float32) - want).reshape(ids.size, -1)
    assert diff[valid & same].max() < 0.03 * np.abs(want).max()

def test_expert_mask_equals_unreachable_experts_in_transformers(checkpoints):
    path, hf = checkpoints["plain-q-default-rope-tied"]
    ids, mask = batch(hf.config.vocab_size, seed=1)
    pruned = [1, 5, 6]
    model = from_pretrained(path)
    keep = np.ones((hf.config.num_hidden_layers, hf.config.n_routed_experts), bool)
    keep[:, pruned] = False
    logits, chosen = run(model, ids, mask, variant=jnp.asarray(keep))
    with unreachable(hf, pruned):
        want, want_chosen = reference(hf, ids, mask)
    assert not np.isin(np.concatenate(list(chosen.values())), pruned).any()
    m = mask.astype(bool)
    assert np.abs(logits[m] - want[m]).max() < 1e-4
    unmasked, _ = run(model, ids, mask)
    assert np.abs(unmasked[m] - want[m]).max() > 1e-2  # the mask changed something


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_load_then_save_gives_back_every_tensor(tmp_path, dtype):
    src = tmp_path / "src"
    make_checkpoint(src, seed=3, dtype=dtype)
    model = from_pretrained(src, dtype=jnp.float32)
    out = save_pretrained(model, tmp_path / "out")
    a, b = CheckpointReader(src), CheckpointReader(out)
    assert a.keys() == b.keys()
    for name in a.keys():
        ia, ib = a.info(name), b.info(name)
        assert (ia.dtype, tuple(ia.shape)) == (ib.dtype, tuple(ib.shape)), name
        assert a.read_bytes(name) == b.read_bytes(name), name
    assert json.loads((src / "config.json").read_text()) == json.loads((out / "config.json").read_text())
    from transformers import DeepseekV3ForCausalLM as HF

    HF.from_pretrained(out)  # transformers loads what moejax wrote


def test_fused_expert_names_of_transformers_5_load_too(checkpoints, tmp_path):
    path, hf = checkpoints["qlora-groups-yarn"]
    fused = tmp_path / "fused"
    hf.save_pretrained(fused, save_original_format=False)
    names = CheckpointReader(fused).keys()
    assert "model.layers.1.mlp.experts.gate_up_proj" in names
    assert not any(".experts.0." in n for n in names)
    ids, mask = batch(hf.config.vocab_size)
    want, _ = reference(hf, ids, mask)
    logits, _ = run(from_pretrained(fused), ids, mask)
    assert np.abs(logits[mask.astype(bool)] - want[mask.astype(bool)]).max() < 1e-4
    # saved back under the canonical per-expert names, values unchanged
    out = CheckpointReader(save_pretrained(from_pretrained(fused), tmp_path / "out"))
    canonical = CheckpointReader(path)
    assert out.keys() == canonical.keys()
    assert out.read_bytes("model.layers.2.mlp.experts.5.up_proj.weight") == \
        canonical.read_bytes("model.layers.2.mlp.experts.5.up_proj.weight")


@pytest.mark.parametrize("block_rows", [8, 16, 37])
def test_causal_attention_in_blocks_equals_full_softmax_attention(block_rows):
    """The query-block attention (each block sees keys up to its last query) against numpy's
    softmax over the whole masked [S, S] scores, with right and left padding and uneven blocks."""
    from moejax.models.layers import causal_attention

    B, S, N, D, C = 3, 37, 2, 5, 4
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((2, B, S, N, D)).astype(np.float32)
    v = rng.standard_normal((B, S, N, C)).astype(np.float32)
    pad = np.ones((B, S), bool)
    pad[1, -6:] = False
    pad[2, :4] = False
    allowed = np.tril(np.ones((S, S), bool))[None] & pad[:, None, :]
    got = np.asarray(causal_attention(*map(jnp.asarray, (q, k, v, allowed)), 0.3, block_rows=block_rows))

    scores = np.einsum("bqnd,bknd->bnqk", q, k).astype(np.float64) * 0.3
    scores = np.where(allowed[:, None], scores, -np.inf)
    w = np.exp(scores - scores.max(-1, keepdims=True))
    want = np.einsum("bnqk,bknc->bqnc", w / w.sum(-1, keepdims=True), v)
    rows = allowed.any(-1)  # queries with at least one key to attend to
    assert np.abs(got[rows] - want[rows]).max() < 1e-5
    assert not rows.all()  # the left-padded rows exist (and are padding output, not compared)

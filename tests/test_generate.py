"""Generation with the latent KV cache (moejax.inference.generate) against transformers' `generate`, the
full forward, and sampling against the distribution straight from its definition."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hf_fixtures import DEFAULT_ROPE, make_checkpoint, unreachable  # noqa: E402

from moejax import from_pretrained  # noqa: E402
from moejax.errors import ConfigError  # noqa: E402
from moejax.inference.generate import Generator, Sampling, filtered_logits, generate, next_tokens  # noqa: E402

CASES = {  # the parity tests' hardened checkpoints (tests/test_deepseek_v3.py)
    "qlora-groups-yarn": {},
    "plain-q-default-rope-tied": dict(q_lora_rank=None, rope_parameters=DEFAULT_ROPE, tie_word_embeddings=True,
                                      first_k_dense_replace=2, n_group=1, topk_group=1, num_hidden_layers=4),
}
STOP, PAD = 7, 0


N = 10  # new tokens in every test: one compiled shape per checkpoint


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (transformers model, moejax model, its Generator: compiled once, shared by the tests)."""
    root = tmp_path_factory.mktemp("gen")
    out = {}
    for i, (name, kw) in enumerate(CASES.items()):
        hf = make_checkpoint(root / name, seed=10 + i, **kw)
        model = from_pretrained(root / name)
        out[name] = (hf, model, Generator(model))
    return out


def prompts(vocab, seed=0, B=4, P=9):
    """Left-padded prompts: rows 1 and 3 padded by 3 and 5."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, vocab, size=(B, P)).astype(np.int32)
    mask = np.ones((B, P), np.int32)
    mask[1, :3] = 0
    mask[3, :5] = 0
    ids[mask == 0] = PAD
    return ids, mask


def hf_generate(hf, ids, mask, n, **kw):
    with torch.no_grad():
        out = hf.generate(input_ids=torch.as_tensor(ids, dtype=torch.long), attention_mask=torch.as_tensor(mask),
                          max_new_tokens=n, do_sample=False, pad_token_id=PAD, **kw)
    out = out.numpy()
    full = np.full((ids.shape[0], ids.shape[1] + n), PAD, np.int64)  # transformers stops early when all rows do
    full[:, :out.shape[1]] = out
    return full


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_generate_equals_transformers(checkpoints, case):
    hf, model, gen = checkpoints[case]
    ids, mask = prompts(hf.config.vocab_size)
    got = gen(ids, mask, max_new_tokens=N, stop_token_ids=[STOP], pad_token_id=PAD)
    want = hf_generate(hf, ids, mask, N, eos_token_id=STOP)
    assert got.dtype == np.int32 and got.shape == (4, 9 + N)
    np.testing.assert_array_equal(got, want)
    assert len(np.unique(got[:, 9:])) > 3  # not a degenerate continuation


def test_generation_stops_and_pads_like_transformers(checkpoints):
    hf, model, gen = checkpoints["qlora-groups-yarn"]
    ids, mask = prompts(hf.config.vocab_size, seed=3)
    free = gen(ids, mask, max_new_tokens=N)
    stop = int(free[0, 9 + 2])  # the token row 0 emits third: stopping on it must end row 0 there
    got = gen(ids, mask, max_new_tokens=N, stop_token_ids=[stop], pad_token_id=PAD)
    np.testing.assert_array_equal(got, hf_generate(hf, ids, mask, N, eos_token_id=stop))
    assert got[0, 9 + 2] == stop and (got[0, 9 + 3:] == PAD).all()


def test_decode_steps_equal_the_full_forward(checkpoints):
    """Teacher-forced: prefill a left-padded prompt, then feed a fixed continuation one token at a
    time; each step's logits equal the full forward's (with generate's positions) at that token."""
    hf, model, _ = checkpoints["qlora-groups-yarn"]
    ids, mask = prompts(hf.config.vocab_size, seed=1)
    cont = np.random.default_rng(2).integers(0, hf.config.vocab_size, size=(4, 6)).astype(np.int32)
    full_ids = np.concatenate([ids, cont], 1)
    full_mask = np.concatenate([mask, np.ones_like(cont)], 1)
    positions = np.maximum(np.cumsum(full_mask, 1) - 1, 0)
    want = np.asarray(model.jitted()(jnp.asarray(full_ids), jnp.asarray(full_mask), positions=jnp.asarray(positions)).logits_BSV)
    with torch.no_grad():  # the full forward with these positions is transformers' too
        hf_logits = hf(torch.as_tensor(full_ids, dtype=torch.long), attention_mask=torch.as_tensor(full_mask),
                       position_ids=torch.as_tensor(positions, dtype=torch.long)).logits.numpy()
    real = full_mask.astype(bool)
    assert np.abs(want[real] - hf_logits[real]).max() < 1e-4

    T = full_ids.shape[1]
    graphdef, state = nnx.split(model)

    prefill = jax.jit(lambda state, *a: nnx.merge(graphdef, state).prefill(*a, last_only=False))
    decode_step = jax.jit(lambda state, *a: nnx.merge(graphdef, state).decode_step(*a))
    out = prefill(state, jnp.asarray(ids), jnp.asarray(positions[:, :9]), jnp.asarray(mask), model.init_cache(4, T))
    assert np.abs(np.asarray(out.logits_BSV)[mask.astype(bool)] - want[:, :9][mask.astype(bool)]).max() < 1e-4
    cache = out.cache
    for i in range(6):
        out = decode_step(state, jnp.asarray(cont[:, i:i + 1]), jnp.asarray(positions[:, 9 + i:10 + i]), cache, 9 + i)
        cache = out.cache
        assert np.abs(np.asarray(out.logits_BSV)[:, 0] - want[:, 9 + i]).max() < 1e-4, i
    assert cache.layers[0].latent_BCR.shape == (4, T, hf.config.kv_lora_rank)  # the latent, not per-head k/v


def test_expert_masks_generate_as_transformers_with_unreachable_experts(checkpoints):
    hf, model, gen = checkpoints["plain-q-default-rope-tied"]
    pruned = [1, 5, 6]
    keep = np.ones((hf.config.num_hidden_layers, hf.config.n_routed_experts), bool)
    keep[:, pruned] = False
    ids, mask = prompts(hf.config.vocab_size, seed=4)
    got = gen(ids, mask, max_new_tokens=N, variant=keep)
    with unreachable(hf, pruned):
        want = hf_generate(hf, ids, mask, N, eos_token_id=None)
    np.testing.assert_array_equal(got, want)
    assert (got != gen(ids, mask, max_new_tokens=N)).any()  # the masks changed the text


def test_prompt_past_the_context_limit_is_refused_before_compute(checkpoints):
    hf, model, _ = checkpoints["qlora-groups-yarn"]
    ids = np.ones((1, 250), np.int32)
    with pytest.raises(ConfigError, match=r"250 tokens.*max_new_tokens=7 = 257 > max_position_embeddings=256"):
        generate(model, ids, max_new_tokens=7)
    with pytest.raises(ConfigError, match="padded on the left"):
        generate(model, ids[:, :5], np.array([[1, 1, 1, 1, 0]]), max_new_tokens=2)
    with pytest.raises(ConfigError, match="top_p"):
        generate(model, ids[:, :5], max_new_tokens=2, temperature=1.0, top_p=1.5)


def test_variants_below_top_k_are_refused_by_the_forward_and_generate(checkpoints):
    """One rule (moejax.models.variant.check_variant) for every form of variant and every entry point:
    a MoE layer keeping fewer than num_experts_per_tok=2 experts, none, or 2 that group-limited
    routing (4 groups of 2, 2 chosen) cannot always reach (experts 0 and 7: a token is given
    groups 0 and 1 and routed to expert 1, pruned) is refused before any compute. A dense layer's
    row is ignored."""
    from moejax.moe.expert_map import ExpertMap

    hf, model, gen = checkpoints["qlora-groups-yarn"]
    ids, mask = prompts(hf.config.vocab_size)
    L, E = hf.config.num_hidden_layers, hf.config.n_routed_experts

    def masks(layer, kept):
        m = np.ones((L, E), bool)
        m[0] = False  # layer 0 is dense: ignored
        m[layer] = np.isin(np.arange(E), kept)
        return m

    cases = [(masks(2, [3]), r"expert masks: layer 2: keeps 1 experts, below num_experts_per_tok=2"),
             (masks(1, []), r"expert masks: layer 1: keeps 0 experts"),
             (masks(1, [0, 7]), r"expert masks: layer 1: keeps \[1, 0, 0, 1\] experts per routing group"),
             ({2: ExpertMap(np.isin(np.arange(E), [0, 7]))}, r"variant: layer 2: keeps \[1, 0, 0, 1\] experts per "),
             ({1: ExpertMap(np.isin(np.arange(E), [5]))}, r"variant: layer 1: keeps 1 experts")]
    forward = model.jitted()
    for variant, match in cases:
        with pytest.raises(ConfigError, match=match):
            model(jnp.asarray(ids), jnp.asarray(mask), variant)
        with pytest.raises(ConfigError, match=match):
            forward(jnp.asarray(ids), jnp.asarray(mask), variant)
        with pytest.raises(ConfigError, match=match):
            gen(ids, mask, max_new_tokens=N, variant=variant)
        with pytest.raises(ConfigError, match=match):
            generate(model, ids, mask, max_new_tokens=N, variant=variant)
    assert gen(ids, mask, max_new_tokens=N, variant=masks(1, [6, 7])).shape == (4, 9 + N)  # one full group routes


def test_generate_settings_are_refused_by_name_before_compute(checkpoints, monkeypatch):
    import moejax.hf.model_io
    from moejax import AutoModelForCausalLM

    hf, model, gen = checkpoints["qlora-groups-yarn"]
    ids, mask = prompts(hf.config.vocab_size)
    V = hf.config.vocab_size
    for kw, match in [(dict(input_ids=np.zeros((0, 9), np.int32), attention_mask=None),
                       r"input_ids: expected integer token ids \[batch >= 1, prompt_len >= 1\], got int32 \[0, 9\]"),
                      (dict(stop_token_ids=[2 ** 40]), rf"stop_token_ids=\[1099511627776\]; expected token ids "
                                                       rf"\(integers\) in \[0, vocab_size={V}\)"),
                      (dict(stop_token_ids=["a"]), r"stop_token_ids=\['a'\]; expected token ids"),
                      (dict(stop_token_ids="a"), r"stop_token_ids='a'; expected token ids"),
                      (dict(pad_token_id=V), rf"pad_token_id={V}; expected token ids"),
                      (dict(temperature="hot"), r"temperature='hot'; expected a finite number >= 0"),
                      (dict(temperature=True), r"temperature=True; expected a finite number"),
                      (dict(seed=2 ** 70), r"seed=1180591620717411303424; expected an integer in \[0, 2\*\*32\)"),
                      (dict(seed=2 ** 32), r"seed=4294967296; expected an integer in \[0, 2\*\*32\)"),
                      (dict(seed=-1), r"seed=-1; expected")]:
        call = dict(input_ids=ids, attention_mask=mask, max_new_tokens=N) | kw
        with pytest.raises(ConfigError, match=match):
            gen(**call)
    assert gen(ids, mask, max_new_tokens=2, stop_token_ids=np.int64(STOP), seed=2 ** 32 - 1).shape == (4, 11)
    # a dtype no model computes in: refused at load, before the checkpoint is read
    path = model.hf_source.path
    monkeypatch.setattr(moejax.hf.model_io, "open_checkpoint", lambda *a: pytest.fail("read the checkpoint"))
    for dtype, shown in [(jnp.int8, "int8"), ("hot", "'hot'"), (jnp.float64, "float64")]:
        with pytest.raises(ConfigError, match=rf"dtype={shown}; expected a floating dtype the model computes in: "
                                              "float32, bfloat16, float16"):
            from_pretrained(path, dtype=dtype)
        with pytest.raises(ConfigError, match="expected a floating dtype"):
            AutoModelForCausalLM.from_pretrained(path, dtype=dtype)


def test_sampling_is_reproducible_and_seeded(checkpoints):
    hf, model, gen = checkpoints["qlora-groups-yarn"]
    ids, mask = prompts(hf.config.vocab_size)
    kw = dict(max_new_tokens=N, temperature=1.5, top_k=20, top_p=0.95)
    a = generate(model, ids, mask, seed=3, **kw)  # one call: a fresh Generator
    np.testing.assert_array_equal(a, gen(ids, mask, seed=3, **kw))
    assert (a != gen(ids, mask, seed=4, **kw)).any()


def numpy_kept_probs(logits, T, top_k, top_p):
    """softmax(logits / T) restricted to what top-k then top-p keep, renormalised: transformers'
    warpers written out in numpy (float64)."""
    x = logits.astype(np.float64) / T
    if top_k is not None:
        x = np.where(x < np.sort(x)[-top_k], -np.inf, x)
    p = np.exp(x - x.max())
    p /= p.sum()
    if top_p is not None:
        order = np.argsort(p)  # ascending
        drop = np.cumsum(p[order]) <= 1 - top_p
        drop[-1] = False
        p[order[drop]] = 0
        p /= p.sum()
    return p


@pytest.mark.parametrize("T,top_k,top_p", [(1.0, None, None), (0.7, 5, None), (1.3, None, 0.8), (2.0, 6, 0.7)])
def test_sampled_frequencies_match_the_filtered_softmax(T, top_k, top_p):
    """Chi-square goodness of fit over 40,000 draws on a 10-token vocabulary."""
    from scipy.stats import chisquare

    logits = np.array([2.0, 1.5, 1.2, 0.3, 0.0, -0.4, -1.0, 0.9, 0.6, -2.0], np.float32)
    n = 40_000
    draws = next_tokens(jnp.broadcast_to(jnp.asarray(logits), (n, 10)), jax.random.PRNGKey(0),
                        Sampling(T, top_k, top_p))
    counts = np.bincount(np.asarray(draws), minlength=10)
    p = numpy_kept_probs(logits, T, top_k, top_p)
    assert (counts[p == 0] == 0).all()  # nothing outside the kept set
    kept = p > 0
    assert kept.sum() < 10 or (top_k is None and top_p is None)
    stat = chisquare(counts[kept], n * p[kept])
    assert stat.pvalue > 1e-3, (counts, n * p)
    # the filter itself equals the numpy definition (not only in distribution)
    f = np.asarray(filtered_logits(jnp.asarray(logits)[None], Sampling(T, top_k, top_p)))[0]
    np.testing.assert_array_equal(np.isfinite(f), kept)

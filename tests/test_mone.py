"""MoNE expert substitution (arXiv 2507.00390; moejax.moe.expert_map, moejax.surgery.substitute):

- the forward: a novice slot returns its gate times its constant and its expert is not used, in
  every family's MoE block (plain-numpy dense oracle of SPEC sections 1 and 7 written here), under
  a pruning mask and merged rows too; a map without novices is today's forward bit for bit;
  the carried pass's many-columns version (`routed_columns`) gives each column its own novices;
- the statistics: output sums, squares, gate sums and the `mone` score from their definitions;
- the checkpoint: `moejax prune --substitute` writes vLLM's constant-v1 form (survivors byte-identical
  under their own names, every router row kept, the constants the in-memory pass's means), refuses
  bad settings before the pass, and reads back (`load_substituted`) as a model whose logits equal
  the source's under the same substitution computed in memory; other commands refuse it by name.
"""

import hashlib
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

pytest.importorskip("transformers")

from family_fixtures import FAMILIES, hf_classes, make_family_checkpoint  # noqa: E402
from hf_fixtures import QUANT_CONFIGS, batch, full_config, make_checkpoint, quantize, rewrite  # noqa: E402

from moejax.errors import CheckpointError, ConfigError  # noqa: E402
from moejax.hf import substitution as fmt  # noqa: E402
from moejax.models.moe_block import MoE  # noqa: E402
from moejax.models.registry import config_from_dict  # noqa: E402
from moejax.moe.columns import routed_columns  # noqa: E402
from moejax.moe.expert_map import ExpertMap  # noqa: E402
from moejax.scoring.scores import LayerStats, StatsAccumulator, compute_scores  # noqa: E402

NAMES = ["deepseek_v3", *FAMILIES]


# --- the forward -------------------------------------------------------------------------------

def family_config(name):
    if name == "deepseek_v3":  # sigmoid router, balance bias, 4 groups (top 2), scaling 2.5
        return config_from_dict(full_config(), name)
    return config_from_dict(hf_classes(name)[0](**FAMILIES[name][1]).to_dict(), name)


def moe_block(name, seed=0):
    """The family's MoE block of its first MoE layer, weights drawn so that routing is decisive and
    every expert's output matters; its balance bias (if any) random and partly negative."""
    cfg = family_config(name)
    E = cfg.experts_in_layer(cfg.moe_layers[0])
    block = MoE(cfg, jnp.float32, nnx.Rngs(seed), "sorted", E)
    rng = np.random.default_rng(seed)
    H = cfg.hidden_size
    block.router[...] = jnp.asarray(rng.normal(0, 0.4, (E, H)), jnp.float32)
    if block.bias is not None:
        block.bias[...] = jnp.asarray(rng.normal(0, 0.3, E), jnp.float32)
    if block.router_bias is not None:
        block.router_bias[...] = jnp.asarray(rng.normal(0, 0.3, E), jnp.float32)
    for name in block.expert_names:  # matrices [E, in, out] at 1 / sqrt(in); biases (gpt-oss) at 0.1
        shape = getattr(block, "experts_" + name)[...].shape
        std = shape[1] ** -0.5 if len(shape) == 3 else 0.1
        getattr(block, "experts_" + name)[...] = jnp.asarray(rng.normal(0, std, shape), jnp.float32)
    return block


def np_expert(block, w, r, x):
    """Expert row r of the table w (float64) on one token x: SwiGLU, or gpt-oss's biased clamped
    SwiGLU (`ClampedSwiglu`: interleaved gate/up columns, limit, alpha, (up + 1))."""
    if "gate" in w:
        h, u = x @ w["gate"][r], x @ w["up"][r]
        limit = getattr(block.expert_fn, "limit", None)
        if limit is not None:   # DeepSeek-V4's `LimitedSwiglu`: gate clamped above, up to [-limit, limit]
            h, u = np.minimum(h, limit), np.clip(u, -limit, limit)
        return (h / (1 + np.exp(-h)) * u) @ w["down"][r]
    alpha, limit = block.expert_fn.alpha, block.expert_fn.limit
    h = x @ w["gate_up"][r] + w["gate_up_bias"][r]
    gate, up = np.minimum(h[0::2], limit), np.clip(h[1::2], -limit, limit)
    return ((up + 1) * gate / (1 + np.exp(-alpha * gate))) @ w["down"][r] + w["down_bias"][r]


def np_route(block, x, mask):
    """SPEC sections 1 and 7 in float64 numpy: (chosen slots [T, K], gates [T, K])."""
    rc = block.router_cfg
    logits = x.astype(np.float64) @ np.asarray(block.router[...], np.float64).T
    if block.router_bias is not None:  # gpt-oss: a bias on the logits
        logits = logits + np.asarray(block.router_bias[...], np.float64)
    if rc.scoring_func == "sigmoid":
        s = 1 / (1 + np.exp(-logits))
    elif rc.scoring_func == "sqrtsoftplus":   # DeepSeek-V4: sqrt(log(1 + e^x))
        s = np.sqrt(np.logaddexp(0.0, logits))
    else:
        z = np.where(mask, logits, -np.inf)
        s = np.exp(z - z.max(1, keepdims=True))
        s /= s.sum(1, keepdims=True)
    sel = s + (0 if block.bias is None else np.asarray(block.bias[...], np.float64))
    sel = np.where(mask, sel, -np.inf)
    if rc.n_group > 1:
        grouped = sel.reshape(len(x), rc.n_group, -1)
        score = np.sort(grouped, axis=-1)[..., -2:].sum(-1)
        best = np.argsort(-score, axis=1, kind="stable")[:, :rc.topk_group]
        chosen = np.zeros(score.shape, bool)
        np.put_along_axis(chosen, best, True, axis=1)
        sel = np.where(chosen[..., None], grouped, -np.inf).reshape(sel.shape)
    idx = np.argsort(-sel, axis=1, kind="stable")[:, :rc.top_k]
    g = np.take_along_axis(s, idx, 1)
    if rc.norm_topk_prob:
        g = g / (g.sum(1, keepdims=True) + 1e-20)
    return idx, g * rc.routed_scaling_factor


def np_routed(block, x, mask, novice=None, constants=None, rows=None, table=None):
    """The routed output y_t = sum_k g_tk (c_{slot} if the slot is a novice else f_{row(slot)}(x_t)),
    every expert evaluated densely in float64; (y [T, H], chosen slots)."""
    idx, g = np_route(block, x, mask)
    w = {k: np.asarray(v, np.float64) for k, v in (table or block.expert_weights()).items()}
    y = np.zeros(x.shape)
    for t, k in np.ndindex(*idx.shape):
        e = idx[t, k]
        if novice is not None and novice[e]:
            y[t] += g[t, k] * constants[e]
        else:
            y[t] += g[t, k] * np_expert(block, w, e if rows is None else rows[e], x[t])
    return y, idx


def slots_and_mask(block):
    """(a routable mask: one expert pruned where routing has no groups, all kept with groups;
    novice slots: three of the kept experts)."""
    E = block.router.shape[0]
    mask = np.ones(E, bool)
    if block.router_cfg.n_group == 1:
        mask[2] = False
    novice = np.zeros(E, bool)
    novice[[1, 4, E - 1]] = True
    return mask, novice


@pytest.mark.parametrize("name", NAMES)
def test_a_novice_slot_returns_its_gate_times_its_constant(name):
    block = moe_block(name)
    E, H = block.router.shape
    rng = np.random.default_rng(1)
    x = rng.normal(size=(48, H)).astype(np.float32)
    mask, novice = slots_and_mask(block)
    constants = rng.normal(size=(E, H)).astype(np.float32)
    want, idx = np_routed(block, x, mask, novice, constants)
    chosen_novice = novice[idx]
    assert chosen_novice.any() and (~chosen_novice).any() and mask[idx].all()  # both kinds of pair are tested
    em = ExpertMap(jnp.asarray(mask), novice_E=jnp.asarray(novice), constants_EH=jnp.asarray(constants))
    for forward_only in (False, True):
        y, r = block.routed_variant(jnp.asarray(x), em, forward_only)
        np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-5, err_msg=f"forward_only={forward_only}")
        assert np.array_equal(np.asarray(r.expert_idx_TK), idx)  # routing unchanged: a novice stays routable
    # the experts of novice slots are not used (a forward-only dispatch does not compute their pairs)
    for name in block.expert_names:
        attr = "experts_" + name
        getattr(block, attr)[...] = getattr(block, attr)[...].at[jnp.asarray(novice)].set(jnp.nan)
    y, _ = block.routed_variant(jnp.asarray(x), em, forward_only=True)
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-5)


def test_novices_of_merged_rows_and_per_token_novices():
    """With merged rows (slot e computes with row rows[e] of a table), a novice slot still returns
    its own constant; novices given per token [T, E] apply token by token."""
    block = moe_block("deepseek_v3", seed=3)
    E, H = block.router.shape
    rng = np.random.default_rng(2)
    x = rng.normal(size=(40, H)).astype(np.float32)
    rows = np.array([0, 0, 1, 2, 2, 3, 1, 0])
    table = {k: jnp.asarray(rng.normal(0, 0.2, (4,) + v.shape[1:]), jnp.float32)
             for k, v in block.expert_weights().items()}
    mask, novice = np.ones(E, bool), np.zeros(E, bool)
    novice[[0, 5]] = True
    constants = rng.normal(size=(E, H)).astype(np.float32)
    want, _ = np_routed(block, x, mask, novice, constants, rows, table)
    em = ExpertMap(jnp.asarray(mask), jnp.asarray(rows, jnp.int32), table, jnp.asarray(novice), jnp.asarray(constants))
    for forward_only in (False, True):
        np.testing.assert_allclose(np.asarray(block.routed_variant(jnp.asarray(x), em, forward_only)[0]), want,
                                   rtol=1e-5, atol=1e-5)
    per_token = np.zeros((len(x), E), bool)
    per_token[::2] = novice  # even tokens substitute, odd ones compute every expert
    plain, _ = np_routed(block, x, mask, None, None, rows, table)
    em = em._replace(novice_E=jnp.asarray(per_token))
    y = np.asarray(block.routed_variant(jnp.asarray(x), em, True)[0])
    np.testing.assert_allclose(y[::2], want[::2], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(y[1::2], plain[1::2], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["deepseek_v3", "qwen3_moe"])
def test_without_novices_the_forward_is_unchanged_bit_for_bit(name):
    block = moe_block(name)
    E, H = block.router.shape
    x = jnp.asarray(np.random.default_rng(4).normal(size=(32, H)), jnp.float32)
    mask, _ = slots_and_mask(block)
    constants = jnp.ones((E, H), jnp.float32)
    for forward_only in (False, True):
        today = block.routed(x, block.route(x, jnp.asarray(mask)), forward_only)  # the dispatch of the router's choice
        plain, _ = block.routed_variant(x, ExpertMap(jnp.asarray(mask)), forward_only)
        no_novice, _ = block.routed_variant(x, ExpertMap(jnp.asarray(mask), novice_E=jnp.zeros(E, bool),
                                                         constants_EH=constants), forward_only)
        assert np.array_equal(np.asarray(plain), np.asarray(today))
        assert np.array_equal(np.asarray(no_novice), np.asarray(today))
    with pytest.raises(ValueError, match="both or neither"):
        block.routed_variant(x, ExpertMap(jnp.asarray(mask), novice_E=jnp.zeros(E, bool)))


@pytest.mark.parametrize("name", ["deepseek_v3", "qwen3_moe"])
def test_columns_carry_their_own_novices(name):
    block = moe_block(name, seed=5)
    E, H = block.router.shape
    rng = np.random.default_rng(6)
    x = rng.normal(size=(36, H)).astype(np.float32)
    mask, novice = slots_and_mask(block)
    other = np.zeros(E, bool)
    other[[0, 3]] = True
    mask_CE = np.stack([np.ones(E, bool), mask, np.ones(E, bool)])
    novice_CE = np.stack([np.zeros(E, bool), novice, other])
    constants = rng.normal(size=(E, H)).astype(np.float32)
    args = (jnp.asarray(x), block.router_logits(jnp.asarray(x)), block.router_cfg, block.balance_bias(),
            jnp.asarray(mask_CE), None, block.expert_weights(), block.expert_fn)
    y = np.asarray(routed_columns(*args, jnp.asarray(novice_CE), jnp.asarray(constants)))
    for c in range(3):
        want, _ = np_routed(block, x, mask_CE[c], novice_CE[c], constants)
        np.testing.assert_allclose(y[:, c], want, rtol=1e-5, atol=1e-5, err_msg=f"column {c}")
    plain = np.asarray(routed_columns(*args))  # without novices: column 0 (no novice) is the same bits
    assert np.array_equal(y[:, 0], plain[:, 0])
    np.testing.assert_allclose(plain[:, 2], np_routed(block, x, mask_CE[2])[0], rtol=1e-5, atol=1e-5)


# --- the statistics and the score ----------------------------------------------------------------

def test_output_sums_and_mone_from_the_definitions(monkeypatch):
    monkeypatch.setattr(StatsAccumulator, "OUTPUT_COLUMNS", 2)  # several column blocks
    rng = np.random.default_rng(7)
    E, K, H = 6, 2, 5
    acc, pairs, n_tokens = StatsAccumulator(E, H), [], 0
    for T in (9, 7):
        idx = np.stack([rng.choice(5, K, replace=False) for _ in range(T)])  # expert 5 is never chosen
        gate = rng.uniform(0.1, 1, (T, K))
        out = rng.normal(size=(T, K, H)).astype(np.float32) + np.arange(E)[idx][..., None]
        keep = rng.uniform(size=T) > 0.3
        acc.add(idx, gate, np.linalg.norm(out, axis=-1), token_mask_T=keep, out_TKH=out)
        pairs += [(idx[t, k], gate[t, k], out[t, k].astype(np.float64)) for t in np.flatnonzero(keep) for k in range(K)]
        n_tokens += int(keep.sum())
    st = acc.stats(np.zeros((E, 3)), None)
    assert st.n_tokens == n_tokens
    score, mean = np.zeros(E), np.zeros((E, H))
    for j in range(E):
        f = np.array([o for e, _, o in pairs if e == j]).reshape(-1, H)
        g = sum(gt for e, gt, _ in pairs if e == j)
        np.testing.assert_allclose(st.output_sum_EH[j], f.sum(0), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(st.output_sq_sum_EH[j], (f ** 2).sum(0), rtol=1e-12)
        np.testing.assert_allclose(st.gate_sum_E[j], g, rtol=1e-12, atol=1e-15)
        if len(f):
            mean[j], score[j] = f.mean(0), np.linalg.norm(np.sqrt(f.var(0))) * g / n_tokens
    np.testing.assert_allclose(st.mean_output_EH, mean, rtol=1e-12, atol=1e-12)
    assert not st.mean_output_EH[5].any() and compute_scores(st, ["mone"])["mone"][5] == 0
    np.testing.assert_allclose(compute_scores(st, ["mone"])["mone"], score, rtol=1e-10)
    bare = LayerStats(st.counts_E, st.gate_norm_sum_E, st.norm_sum_E, st.mean_input_D, st.router_ED, None)
    with pytest.raises(ConfigError, match="'mone' needs the sums of the experts' outputs"):
        compute_scores(bare, ["mone"])


# --- the checkpoint ------------------------------------------------------------------------------

def file_hashes(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.fixture(scope="module", params=["deepseek_v3", "mixtral", "deepseek_v4"])
def substituted(request, tmp_path_factory):
    """(source, substituted folder, calibration ids, record, source file hashes before) of
    `moejax prune SRC DST --substitute --score mone --keep 4 --tokens calib.npy`."""
    from moejax.cli import main

    root = tmp_path_factory.mktemp(f"mone_{request.param}")
    src, dst = root / "src", root / "dst"
    if request.param == "deepseek_v3":
        make_checkpoint(src, seed=11, max_shard_size="200KB")  # several shards, an index
    else:
        make_family_checkpoint(request.param, src, seed=11)
    ids = np.random.default_rng(8).integers(0, 96, size=(6, 20)).astype(np.int32)
    np.save(root / "calib.npy", ids)
    before = file_hashes(src)
    assert main(["prune", str(src), str(dst), "--substitute", "--score", "mone", "--keep", "4",
                 "--tokens", str(root / "calib.npy"), "--batch-size", "4"]) == 0
    return src, dst, ids, json.loads((dst / "pruning.json").read_text()), before


def in_memory(src, ids):
    """The same calibration pass in memory: ({layer: LayerStats}, kept)."""
    from moejax.scoring.observe import calibrate_streamed
    from moejax.surgery.substitute import plan_substitution

    stats = calibrate_streamed(src, [(ids[:4], None), (ids[4:], None)], progress=False)
    config = json.loads((src / "config.json").read_text())
    return stats, plan_substitution(stats, "mone", 4, config["num_experts_per_tok"])


EXPERTS_PREFIX = {"deepseek_v3": ".mlp.experts", "mixtral": ".block_sparse_moe.experts", "deepseek_v4": ".ffn.experts"}


def test_the_checkpoint_is_constant_v1_with_byte_identical_survivors(substituted):
    """constant-v1 as the format states it; DeepSeek-V4's hash layers (kept whole) are not
    substituted, their tensors the source's bytes with every other survivor's."""
    from moejax.hf.io.checkpoint_reader import CheckpointReader

    src, dst, ids, record, before = substituted
    assert file_hashes(src) == before  # the source is never modified
    stats, kept = in_memory(src, ids)
    assert record["method"] == "mone" and record["format"] == fmt.FORMAT and record["form"] == "substituted"
    assert record["keep"] == 4 and record["settings"] == {} and record["rerouted"] is False
    assert {int(l): v["kept"] for l, v in record["layers"].items()} == kept
    a, b = CheckpointReader(src), CheckpointReader(dst)
    source_config, config = json.loads((src / "config.json").read_text()), json.loads((dst / "config.json").read_text())
    spec = fmt.parse_substitution(config)
    assert {k: v for k, v in config.items() if k != "compression_config"} == source_config  # expert counts unchanged
    dropped, constants = set(), set()
    for layer, values in spec.values.items():
        entry = record["layers"][str(layer)]
        assert sorted(values) == entry["substituted"] == sorted(set(range(8)) - set(entry["kept"]))
        prefix = spec.prefixes[layer]
        assert prefix.endswith(EXPERTS_PREFIX[config["model_type"]])
        for e, name in values.items():
            assert name == f"{prefix}.{e}.approx_value" and b.info(name).dtype == "F32"
            want = stats[layer].mean_output_EH[e].astype(np.float32)
            assert np.array_equal(b.read(name), want) and (want.any() or stats[layer].counts_E[e] == 0)
            dropped |= {n for n in a.keys() if n.startswith(f"{prefix}.{e}.")}
            constants.add(name)
    assert dropped and set(b.keys()) == (set(a.keys()) - dropped) | constants
    for name in set(b.keys()) - constants:  # every router row and bias entry included
        assert a.read_bytes(name) == b.read_bytes(name), name


def forward_logits(model, ids, mask, variant):
    """The model's forward under `variant` traced inside jit (`moejax.models.variant.check_variant`,
    which the model's own checked entry points run, rebuilds ExpertMaps without their novice fields)."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def run(state, ids, mask, variant):
        return nnx.merge(graphdef, state)(ids, mask, variant, forward_only=True).logits_BSV

    return np.asarray(run(state, jnp.asarray(ids), jnp.asarray(mask), variant))


def test_read_back_equals_the_source_under_the_substitution_in_memory(substituted):
    from moejax.hf.model_io import load_pretrained
    from moejax.surgery.substitute import load_substituted, substitution_maps

    src, dst, ids, _, _ = substituted
    stats, kept = in_memory(src, ids)
    expected = substitution_maps(stats, kept)
    model, maps = load_substituted(dst)
    assert sorted(maps) == sorted(expected)
    for layer, em in maps.items():
        assert np.array_equal(em.novice_E, expected[layer].novice_E) and np.asarray(em.mask_E).all()
        assert np.array_equal(em.constants_EH, expected[layer].constants_EH)
        for w in model.model.layers[layer].mlp.expert_weights().values():  # a substituted expert has no weights
            assert not np.asarray(w)[np.asarray(em.novice_E)].any() and np.asarray(w)[~np.asarray(em.novice_E)].all()
    source = load_pretrained(src)
    test_ids, mask = batch(96, seed=9)
    got = forward_logits(model, test_ids, mask, maps)
    want = forward_logits(source, test_ids, mask, expected)
    np.testing.assert_array_equal(got, want)
    assert np.abs(want - forward_logits(source, test_ids, mask, None)).max() > 1e-3  # substitution changes the model


def test_the_carried_pass_substitutes_as_the_checkpoint_computes(substituted):
    """The carried pass (prune_real's `substitutes`) substitutes what `moejax prune --substitute`
    writes: the same kept experts per layer (DeepSeek-V4: its learned layers only, its hash layers
    run whole) and the read-back checkpoint's perplexity (V4's hash layers handed the ids)."""
    import pandas as pd

    from moejax.evaluation.carried import evaluate_pruning
    from moejax.hf.model_io import open_checkpoint
    from moejax.inference.nll import next_token_nll
    from moejax.surgery.substitute import load_substituted
    from moejax.variants import VariantSpec

    src, dst, ids, record, _ = substituted
    held = np.random.default_rng(10).integers(0, 96, size=(3, 20)).astype(np.int32)
    rows, info = evaluate_pruning(open_checkpoint(src), ids, {"t": held}, [], [4], substitutes=("mone",),
                                  batch_size=4)
    spec = VariantSpec("mone", 4, "substituted")
    plan = next(p for p in info["plans"] if p.spec == spec)
    assert sorted(plan.layers) == sorted(map(int, record["layers"]))   # (V4: the learned layers only)
    for layer, lp in plan.layers.items():
        assert sorted(lp.experts()) == record["layers"][str(layer)]["kept"]
    df = pd.DataFrame(rows)
    got = df[(df.metric == "perplexity") & (df.text == "t") & (df.form == "substituted")].value.item()
    model, maps = load_substituted(dst)
    logits = forward_logits(model, held, np.ones_like(held), maps)
    want = float(np.exp(np.mean(np.asarray(next_token_nll(jnp.asarray(logits), jnp.asarray(held))))))
    assert got == pytest.approx(want, rel=1e-4)


def test_other_commands_refuse_the_folder_by_name(substituted, capsys):
    from moejax.cli import main
    from moejax.hf.check import check_checkpoint
    from moejax.hf.model_io import load_pretrained
    from moejax.surgery.substitute import load_substituted

    src, dst, _, _, _ = substituted
    assert main(["inspect", str(dst)]) == 2
    assert "expert-substitution checkpoint" in capsys.readouterr().err
    for call in (lambda: check_checkpoint(dst), lambda: load_pretrained(dst)):
        with pytest.raises(CheckpointError, match="constant-v1.*load_substituted"):
            call()
    with pytest.raises(CheckpointError, match="declares no expert substitution"):
        load_substituted(src)


def test_what_transformers_does_with_a_substituted_checkpoint(substituted):
    """docs/merging.md states it: transformers 5.24 refuses the folder (the retained experts' fused
    tensors are smaller than the config's), and with ignore_mismatched_sizes=True it loads with
    every routed expert of a substituted layer re-initialised at random, the retained ones too."""
    import torch
    import transformers

    src, dst, _, record, _ = substituted
    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):
        transformers.AutoModelForCausalLM.from_pretrained(dst)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(dst, ignore_mismatched_sizes=True)
    source = transformers.AutoModelForCausalLM.from_pretrained(src)
    layer = min(map(int, record["layers"]))   # the first substituted layer (DeepSeek-V4: its first learned one)
    got, want = loaded.model.layers[layer].mlp.experts.down_proj, source.model.layers[layer].mlp.experts.down_proj
    assert got.shape == want.shape and not any(torch.equal(got[e], want[e]) for e in range(want.shape[0]))


@pytest.fixture
def no_pass(monkeypatch):
    from moejax.scoring import observe

    monkeypatch.setattr(observe, "calibrate_streamed", lambda *a, **k: pytest.fail("the calibration pass ran"))


def test_bad_settings_are_refused_before_the_pass(substituted, tmp_path, no_pass, capsys):
    from moejax.cli import main

    src, dst, ids, _, _ = substituted
    tokens = tmp_path / "calib.npy"
    np.save(tokens, ids)
    out = tmp_path / "out"
    base = ["prune", str(src), str(out), "--substitute", "--keep", "4", "--tokens", str(tokens)]
    cases = [
        (["--score", "mone", "--keep", "1"], "below"),                      # top_k is 2
        (["--score", "nope"], "unknown score"),
        (["--score", "mone", "--scores-file", "x.parquet"], "takes no --scores-file"),
        (["--score", "mone", "--group-aware"], "takes no --group-aware"),
    ]
    for extra, message in cases:
        assert main(base + extra) == 2, extra
        assert message in capsys.readouterr().err, extra
    assert main(["prune", str(src), str(out), "--substitute", "--score", "mone", "--keep", "4"]) == 2
    assert "needs calibration data" in capsys.readouterr().err
    assert main(["prune", str(src), str(out), "--score", "l1", "--keep", "4", "--tokens", str(tokens)]) == 2
    assert "read by `moejax prune --substitute` and --allocation evo_esap only" in capsys.readouterr().err
    assert main(["prune", str(dst), str(out), "--substitute", "--score", "mone", "--keep", "4",
                 "--tokens", str(tokens)]) == 2  # an already substituted source
    assert "constant-v1" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("score", ["l1", "aimer"])
def test_substitution_ranks_by_a_data_free_score_as_the_experiments_do(substituted, tmp_path, score):
    """One rule everywhere (toy3, the experiments' `substitutes`, `moejax prune --substitute`): any
    score ranks, data-free ones too; the kept experts are the top `keep` of the score computed in
    numpy from the source's tensors (ties to the lower index)."""
    from moejax.cli import main
    from moejax.hf.check import check_checkpoint

    src, _, ids, _, _ = substituted
    np.save(tmp_path / "calib.npy", ids)
    assert main(["prune", str(src), str(tmp_path / "out"), "--substitute", "--score", score, "--keep", "4",
                 "--tokens", str(tmp_path / "calib.npy")]) == 0
    record = json.loads((tmp_path / "out" / "pruning.json").read_text())
    checked = check_checkpoint(src)
    for layer, ml in checked.layout.moe_layers.items():
        if checked.config.is_kept_whole(layer):   # DeepSeek-V4's hash layers: never substituted
            assert str(layer) not in record["layers"]
            continue
        if score == "l1":
            value = np.abs(checked.reader.read(ml.router).astype(np.float64)).sum(axis=1)
        else:
            w = [np.concatenate([checked.reader.read(name).astype(np.float64).ravel() for name in ml.experts[e]])
                 for e in range(ml.n_experts)]
            value = np.array([-np.abs(x).mean() / np.sqrt((x * x).mean()) for x in w])
        want = sorted(np.argsort(-value, kind="stable")[:4].tolist())
        assert record["layers"][str(layer)]["kept"] == want, (layer, value)


def test_quantised_and_fused_sources_are_refused_before_the_pass(tmp_path, no_pass):
    from moejax.surgery.substitute import substitute_checkpoint

    src = tmp_path / "src"
    make_checkpoint(src, seed=12, save_original_format=False)  # transformers 5's fused expert tensors
    np.save(tmp_path / "calib.npy", np.zeros((2, 8), np.int32))
    with pytest.raises(CheckpointError, match="fused form"):
        substitute_checkpoint(src, tmp_path / "out", keep=4, tokens=tmp_path / "calib.npy")
    per_expert = tmp_path / "per_expert"
    make_checkpoint(per_expert, seed=12)
    fp8 = rewrite(per_expert, tmp_path / "fp8", quantize("fp8_block"), {"quantization_config": QUANT_CONFIGS["fp8_block"]})
    with pytest.raises(CheckpointError, match="quantised"):
        substitute_checkpoint(fp8, tmp_path / "out", keep=4, tokens=tmp_path / "calib.npy")
    assert not (tmp_path / "out").exists()


# --- the format ----------------------------------------------------------------------------------

def test_the_declaration_is_what_vllm_parses_and_bad_metadata_is_refused():
    entry = fmt.declaration({3: [5, 1], 4: []}, {3: "model.layers.3.mlp.experts", 4: "model.layers.4.mlp.experts"},
                            {3: 8, 4: 8})
    # vLLM PR #50415's test builds the same structure (version, router semantics, targets)
    assert entry == {"version": 1, "router_semantics": {"preserve_logical_expert_ids": True,
                                                        "preserve_router_weights": True,
                                                        "renormalize_after_substitution": False},
                     "targets": {"model.layers.3.mlp.experts": {
                         "num_logical_experts": 8, "weight_layout": "compact_retained_experts",
                         "replacements": {e: {"format": "constant-v1",
                                              "tensors": {"value": f"model.layers.3.mlp.experts.{e}.approx_value"}}
                                          for e in ("1", "5")}}}}
    config = fmt.with_declaration({"model_type": "x", "compression_config": {"format": "dense"}}, entry)
    assert config["compression_config"]["format"] == "dense"
    spec = fmt.parse_substitution(config)
    assert spec.values == {3: {1: "model.layers.3.mlp.experts.1.approx_value",
                               5: "model.layers.3.mlp.experts.5.approx_value"}} and spec.n_experts == {3: 8}
    assert fmt.parse_substitution({"model_type": "x"}) is None
    target = "model.layers.3.mlp.experts"
    mutations = [
        (lambda d: d.update(version=2), "version"),
        (lambda d: d["router_semantics"].update(renormalize_after_substitution=True), "router_semantics"),
        (lambda d: d["targets"].update({"mlp.experts": d["targets"][target]}), "one decoder layer"),
        (lambda d: d["targets"][target].update(weight_layout="dense"), "weight_layout"),
        (lambda d: d["targets"][target]["replacements"]["1"].update(format="linear-v1"), "constant-v1"),
        (lambda d: d["targets"][target]["replacements"]["1"].pop("tensors"), "tensors.value"),
        (lambda d: d["targets"][target]["replacements"].update({"8": d["targets"][target]["replacements"]["1"]}),
         r"\[0, 8\)"),
        # vLLM's decoder_layer_index: a target path names its layer by its ONLY integer component
        (lambda d: d["targets"].update({f"{target}.5": d["targets"].pop(target)}), "one decoder layer"),
        (lambda d: d["targets"].update({"model.layers.3.mlp.0.experts": d["targets"].pop(target)}),
         "one decoder layer"),
        # a layer keeps at least one expert with weights
        (lambda d: d["targets"][target]["replacements"].update(
            {str(e): {"format": "constant-v1", "tensors": {"value": f"{target}.{e}.approx_value"}} for e in range(8)}),
         "substitutes all 8 experts; a layer must retain at least one"),
    ]
    for mutate, message in mutations:
        raw = json.loads(json.dumps(entry))
        mutate(raw)
        with pytest.raises(CheckpointError, match=message):
            fmt.parse_substitution(fmt.with_declaration({}, raw))
    with pytest.raises(CheckpointError, match="approximate_experts"):
        fmt.parse_substitution({"approximate_experts": {"3": [1]}})
    raw = json.loads(json.dumps(entry))
    raw["targets"][f"{target}.5"] = raw["targets"].pop(target)
    with pytest.raises(CheckpointError, match=r"^/ckpt/config\.json: invalid compression_config\.transform_config\."
                                              r"expert_substitution \(constant-v1\): target 'model\.layers\.3\.mlp\."
                                              r"experts\.5' must name one decoder layer"):
        fmt.parse_substitution(fmt.with_declaration({}, raw), "/ckpt/config.json")

"""Router distillation (`moejax reroute`, moejax.training.reroute): the loss against numpy, one step
against a hand-written AdamW step, only the routers move, the unpruned model rerouted against itself
stays put, and the written checkpoint is COMPRESSED's bytes but for its routers, loads in
transformers and computes what moejax's student computes, for every family and compression kind."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moejax.errors import CheckpointError, ConfigError
from moejax.training.reroute import RerouteSettings, kl_loss, reroute, router_filter, teacher_log_probs


def np_kl(t_logits, s_logits, valid):
    t = t_logits - np.log(np.exp(t_logits - t_logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - t_logits.max(-1, keepdims=True)
    s = s_logits - np.log(np.exp(s_logits - s_logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - s_logits.max(-1, keepdims=True)
    kl = (np.exp(t) * (t - s)).sum(-1)
    return (kl * valid).sum() / valid.sum()


def test_kl_from_the_definition():
    rng = np.random.default_rng(0)
    t, s = rng.normal(size=(2, 5, 7)) * 3, rng.normal(size=(2, 5, 7)) * 3
    valid = rng.random((2, 5)) > 0.3
    got = kl_loss(jax.nn.log_softmax(jnp.asarray(t, jnp.float32)), jnp.asarray(s, jnp.float32), jnp.asarray(valid))
    np.testing.assert_allclose(float(got), np_kl(t, s, valid), rtol=1e-5)
    assert float(kl_loss(jax.nn.log_softmax(jnp.asarray(t, jnp.float32)), jnp.asarray(t, jnp.float32),
                         jnp.ones((2, 5), bool))) == pytest.approx(0.0, abs=1e-6)


def test_settings_are_refused_by_name():
    for kw, match in ((dict(steps=0), "steps=0"), (dict(lr=0.0), "lr=0.0"), (dict(lr=-1e-3), "lr=-0.001"),
                      (dict(warmup=5, steps=5), "warmup=5 must be below"), (dict(batch_size=0), "batch_size=0"),
                      (dict(final_lr_fraction=2.0), "final_lr_fraction=2.0"), (dict(weight_decay=-1.0), "weight_decay")):
        with pytest.raises(ConfigError, match=match):
            RerouteSettings(**kw).check()


@pytest.fixture(scope="module")
def dsv3(tmp_path_factory):
    """A tiny DeepSeek-V3 (one routing group), its l1-pruned copy (4 of 8 experts), calibration ids."""
    from hf_fixtures import make_checkpoint
    from moejax.cli import main

    root = tmp_path_factory.mktemp("reroute")
    make_checkpoint(root / "src", seed=31, n_group=1, topk_group=1)
    assert main(["prune", str(root / "src"), str(root / "pruned"), "--score", "l1", "--keep", "4"]) == 0
    ids = np.random.default_rng(5).integers(0, 96, size=(8, 16)).astype(np.int32)
    np.save(root / "calib.npy", ids)
    return root, ids


def _models(root):
    from moejax.hf.model_io import load_pretrained

    return load_pretrained(root / "src"), load_pretrained(root / "pruned")


def test_only_the_routers_move(dsv3):
    root, ids = dsv3
    teacher, student = _models(root)
    batches = [(ids[:4], None), (ids[4:], None)]
    before = {k: np.array(v[...]) for k, v in nnx.to_flat_state(nnx.state(student))}
    result = reroute(student, teacher_log_probs(teacher, batches), batches, RerouteSettings(steps=6, lr=1e-2, warmup=0))
    after = {k: np.array(v[...]) for k, v in nnx.to_flat_state(nnx.state(student))}
    routers = {k for k in before if k[-1] == "router"}
    assert routers and {".".join(map(str, k)) for k in routers} == set(result.trained)
    for k in before:
        if k in routers:
            assert not np.array_equal(before[k], after[k]), k
        else:
            assert np.array_equal(before[k], after[k]), k     # the balance bias and every weight: bitwise


def test_one_step_equals_a_hand_written_adamw_step(dsv3):
    """Step 1 of AdamW (no warmup: the cosine's first rate is lr) is theta - lr (g / (|g| + eps) + wd theta),
    g the gradient of the numpy-defined KL computed through a second path (the whole parameter state
    differentiated, the routers picked out)."""
    root, ids = dsv3
    teacher, student = _models(root)
    batches = [(ids[:4], None)]
    t_logp = teacher_log_probs(teacher, batches)
    graphdef, state = nnx.split(student)

    def loss(state):
        logits = nnx.merge(graphdef, state)(jnp.asarray(ids[:4])).logits_BSV.astype(jnp.float32)
        q = jax.nn.softmax(logits, axis=-1)
        p = jnp.exp(jnp.asarray(t_logp[0]))
        return jnp.mean(jnp.sum(p * (jnp.log(p) - jnp.log(q)), axis=-1))

    grads = dict(nnx.to_flat_state(jax.grad(loss)(state)))
    theta = {k: np.asarray(v[...]) for k, v in nnx.to_flat_state(state) if k[-1] == "router"}
    lr, wd = 3e-3, 0.01
    want = {k: theta[k] - lr * (np.asarray(grads[k][...]) / (np.abs(np.asarray(grads[k][...])) + 1e-8) + wd * theta[k])
            for k in theta}
    reroute(student, t_logp, batches, RerouteSettings(steps=1, lr=lr, warmup=0, weight_decay=wd))
    got = {k: np.asarray(v[...]) for k, v in nnx.to_flat_state(nnx.state(student)) if k[-1] == "router"}
    for k in theta:
        # An entry whose gradient is near Adam's eps moves by g / (|g| + eps), whose slope in g is
        # eps / (|g| + eps)^2: the two paths' gradients differ by float32 rounding (bounded here by
        # 1e-6 of the tensor's largest gradient), which such an entry amplifies up to 1 / (4 eps).
        # Each entry is allowed that much on top of 1e-2 lr; a wrong step is off by ~lr.
        g = np.abs(np.asarray(grads[k][...], np.float64))
        amplified = lr * 1e-8 / (g + 1e-8) ** 2 * 1e-6 * g.max()
        assert np.all(np.abs(got[k] - want[k]) <= 1e-2 * lr + amplified + 1e-6 * np.abs(want[k])), k
        assert not np.allclose(got[k], theta[k])


def test_the_unpruned_model_rerouted_against_itself_stays(dsv3):
    """Teacher = student: the loss is 0 to float rounding, and so is the gradient: Adam's first
    steps then move no router by more than rounding does."""
    from moejax.hf.model_io import load_pretrained

    root, ids = dsv3
    teacher, student = load_pretrained(root / "src"), load_pretrained(root / "src")
    batches = [(ids, None)]
    before = {k: np.asarray(v[...]) for k, v in nnx.to_flat_state(nnx.state(student, router_filter))}
    graphdef, state = nnx.split(student)
    t_logp = teacher_log_probs(teacher, batches)
    grad = jax.grad(lambda s: kl_loss(jnp.asarray(t_logp[0]), nnx.merge(graphdef, s)(jnp.asarray(ids)).logits_BSV,
                                      jnp.ones(ids.shape, bool)))(state)
    assert max(float(jnp.abs(g[...]).max()) for k, g in nnx.to_flat_state(grad) if k[-1] == "router") < 1e-6
    result = reroute(student, t_logp, batches, RerouteSettings(steps=2, lr=1e-6, warmup=0))
    assert max(result.losses) < 1e-6
    for k, v in nnx.to_flat_state(nnx.state(student, router_filter)):
        np.testing.assert_allclose(np.asarray(v[...]), before[k], atol=3e-6)


def _same_but_routers(a_dir, b_dir, routers):
    from moejax.hf.io.checkpoint_reader import CheckpointReader

    a, b = CheckpointReader(a_dir), CheckpointReader(b_dir)
    assert sorted(a.keys()) == sorted(b.keys())
    changed = [n for n in a.keys() if a.read_bytes(n) != b.read_bytes(n)]
    assert sorted(changed) == sorted(routers) and routers


def test_reroute_checkpoint_is_compressed_but_its_routers_and_loads_in_transformers(dsv3, tmp_path):
    import torch
    import transformers

    from moejax.cli import main
    from moejax.hf.model_io import load_pretrained

    root, ids = dsv3
    dst = tmp_path / "rerouted"
    assert main(["reroute", str(root / "src"), str(root / "pruned"), str(dst), "--tokens", str(root / "calib.npy"),
                 "--steps", "5", "--batch-size", "4", "--lr", "1e-2", "--warmup", "0"]) == 0
    record = json.loads((dst / "reroute.json").read_text())
    assert len(record["losses"]) == 5 and record["settings"]["lr"] == 1e-2
    _same_but_routers(root / "pruned", dst, record["trained"])
    for name in ("config.json", "pruning.json"):
        assert (dst / name).read_bytes() == (root / "pruned" / name).read_bytes()
    # the same training in the library gives the routers written
    teacher, student = _models(root)
    batches = [(ids[:4], None), (ids[4:], None)]
    reroute(student, teacher_log_probs(teacher, batches), batches, RerouteSettings(steps=5, lr=1e-2, warmup=0))
    written = load_pretrained(dst)
    for l in written.config.moe_layers:
        np.testing.assert_array_equal(np.asarray(written.model.layers[l].mlp.router[...]),
                                      np.asarray(student.model.layers[l].mlp.router[...]))
    hf = transformers.AutoModelForCausalLM.from_pretrained(dst, attn_implementation="eager",
                                                           experts_implementation="eager").eval()
    with torch.no_grad():
        want = hf(torch.tensor(ids[:2], dtype=torch.long)).logits.float().numpy()
    got = np.asarray(written.jitted()(jnp.asarray(ids[:2])).logits_BSV)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_reroute_refuses_before_any_work(dsv3, tmp_path, monkeypatch):
    """Bad settings, a COMPRESSED not made from SRC, a folder without a record: refused by name,
    before the teacher runs; nothing written."""
    import moejax.training.reroute as rr
    from hf_fixtures import make_checkpoint
    from moejax.surgery.reroute import reroute_checkpoint

    root, _ = dsv3
    make_checkpoint(tmp_path / "other", seed=32, n_group=1, topk_group=1)
    monkeypatch.setattr(rr, "teacher_log_probs", lambda *a, **k: (_ for _ in ()).throw(AssertionError("ran")))
    tokens = str(root / "calib.npy")
    cases = [(dict(src=root / "src", compressed=root / "pruned", steps=0), ConfigError, "steps=0"),
             (dict(src=tmp_path / "other", compressed=root / "pruned"), CheckpointError, "not SRC"),
             (dict(src=root / "src", compressed=tmp_path / "other"), CheckpointError, "no pruning.json")]
    for kw, error, match in cases:
        with pytest.raises(error, match=match):
            reroute_checkpoint(dst=tmp_path / "out", tokens=tokens, **kw)
        assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind", ["merged", "substituted"])
def test_reroute_merged_and_substituted_checkpoints(dsv3, tmp_path, kind):
    """A merged (shrunk) and a substituted checkpoint: every tensor but the routers (the constants
    included) is COMPRESSED's, and the written folder computes what the trained student computes."""
    from moejax.cli import main
    from moejax.hf.model_io import load_pretrained
    from moejax.surgery.substitute import load_substituted

    root, ids = dsv3
    tokens, comp, dst = str(root / "calib.npy"), tmp_path / kind, tmp_path / "rerouted"
    args = (["merge", str(root / "src"), str(comp), "--method", "hc_smoe", "--keep", "4", "--tokens", tokens]
            if kind == "merged" else
            ["prune", str(root / "src"), str(comp), "--substitute", "--score", "mone", "--keep", "4", "--tokens", tokens])
    assert main(args) == 0
    assert main(["reroute", str(root / "src"), str(comp), str(dst), "--tokens", tokens, "--steps", "3",
                 "--batch", "4", "--lr", "1e-2", "--warmup", "0"]) == 0   # the spelling of --batch-size
    record = json.loads((dst / "reroute.json").read_text())
    assert record["settings"]["batch_size"] == 4
    _same_but_routers(comp, dst, record["trained"])
    load = load_substituted if kind == "substituted" else (lambda p: (load_pretrained(p), None))
    (teacher, _), (student, variant) = (load_pretrained(root / "src"), None), load(comp)
    batches = [(ids[:4], None), (ids[4:], None)]
    result = reroute(student, teacher_log_probs(teacher, batches), batches,
                     RerouteSettings(steps=3, lr=1e-2, warmup=0), variant)
    assert result.losses == pytest.approx(record["losses"], rel=1e-6)
    written, maps = load(dst)
    got = written.jitted()(jnp.asarray(ids[:2]), None, maps).logits_BSV
    want = student.jitted()(jnp.asarray(ids[:2]), None, variant).logits_BSV
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "olmoe", "glm4_moe", "qwen2_moe"])
def test_reroute_every_family_loads_in_transformers(family, tmp_path):
    """A pruned checkpoint of each GQA family rerouted: only its routers change, the loss falls, and
    transformers computes what moejax computes from the written folder."""
    import torch
    import transformers
    from family_fixtures import make_family_checkpoint

    from moejax.cli import main
    from moejax.hf.model_io import load_pretrained

    make_family_checkpoint(family, tmp_path / "src", seed=3)
    prune = ["prune", str(tmp_path / "src"), str(tmp_path / "pruned"), "--score", "l1", "--keep", "4"]
    assert main(prune + (["--group-aware"] if family == "glm4_moe" else [])) == 0
    ids = np.random.default_rng(6).integers(2, 96, size=(4, 12)).astype(np.int32)
    np.save(tmp_path / "calib.npy", ids)
    dst = tmp_path / "rerouted"
    assert main(["reroute", str(tmp_path / "src"), str(tmp_path / "pruned"), str(dst), "--tokens",
                 str(tmp_path / "calib.npy"), "--steps", "4", "--batch-size", "4", "--lr", "2e-2", "--warmup", "0"]) == 0
    record = json.loads((dst / "reroute.json").read_text())
    assert record["losses"][-1] < record["losses"][0]
    _same_but_routers(tmp_path / "pruned", dst, record["trained"])
    hf = transformers.AutoModelForCausalLM.from_pretrained(dst, attn_implementation="eager",
                                                           experts_implementation="eager").eval()
    with torch.no_grad():
        want = hf(torch.tensor(ids[:2], dtype=torch.long)).logits.float().numpy()
    got = np.asarray(load_pretrained(dst).jitted()(jnp.asarray(ids[:2])).logits_BSV)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_reroute_in_prune_real_every_variant_before_and_after(tmp_path, monkeypatch):
    """prune_real with reroute=true: every variant (pruned, merged, substituted) gets a rerouted row
    beside its own; its routers are trained (the KL falls); its perplexity is the forward of the
    model whose router weights are replaced by the trained ones (an independent path to the expert
    map's router override); the summary keeps the two apart."""
    from hf_fixtures import make_checkpoint

    from moejax.evaluation.nll import next_token_nll
    from moejax.experiments import prune_real
    from moejax.hf.model_io import load_pretrained
    from moejax.variants import VariantSpec

    path = tmp_path / "src"
    make_checkpoint(path, seed=33, vocab_size=256, n_group=1, topk_group=1)
    text = tmp_path / "text.txt"
    text.write_text("def f(x):\n    return [y * 2 for y in x if y]\n" * 60)
    cfg = prune_real.PruneRealConfig.from_mapping(dict(
        path=str(path), keep=[4], scores=["frequency"], merges=["hc_smoe"], substitutes=["frequency"],
        calib=[str(text)], heldout=[str(text)], seq_len=32, calib_tokens=256, heldout_tokens=128, batch_size=4,
        reroute=True, reroute_steps=4, reroute_lr=5e-3))
    seen = {}
    real = prune_real.rerouted_variants

    def spy(cfg, calib, heldout, plans):
        seen["heldout"] = heldout
        return real(cfg, calib, heldout, plans)

    monkeypatch.setattr(prune_real, "rerouted_variants", spy)
    df, info, timings = prune_real.evaluate(cfg)
    rr = df[df.rerouted.astype(str) == "True"]
    specs = {VariantSpec.from_row(r) for r in rr.itertuples()}
    assert specs == {VariantSpec(m, 4, f, True) for m, f in (("frequency", "one_shot"), ("hc_smoe", "tied"),
                                                             ("hc_smoe", "shrunk"), ("frequency", "substituted"))}
    assert set(info["rerouted"]) == specs and timings["reroute_s"] > 0
    for spec in specs:   # (whether the KL falls on this random, deliberately decisive router is luck: top-k flips
        #                   the gates' gradient cannot see; on trained models it does, README)
        kl = rr[rr.metric.str.startswith("reroute_kl_") & (rr.method == spec.method) & (rr.form == spec.form)]
        assert len(kl) == 2 and np.isfinite(kl.value).all() and (kl.value > 0).all(), spec
    with pytest.raises(ConfigError, match="reroute_steps=0"):
        prune_real.PruneRealConfig.from_mapping(dict(path=str(path), reroute=True, reroute_steps=0))
    # the router override against a model whose router weights are the trained ones
    ids = np.stack([np.frombuffer(text.read_bytes()[:32 * 4], np.uint8)[i * 32:(i + 1) * 32] for i in range(4)])
    plans = {p.spec: p for p in info["plans"]}
    for spec, maps in info["rerouted"].items():
        model = load_pretrained(path)
        for layer, em in maps.items():
            model.model.layers[layer].mlp.router[...] = em.router_EH
        own = plans[VariantSpec(spec.method, spec.keep, spec.form)].expert_maps()
        want = model.jitted()(jnp.asarray(ids, jnp.int32), None, own).logits_BSV
        got = load_pretrained(path).jitted()(jnp.asarray(ids, jnp.int32), None, maps).logits_BSV
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
        before = load_pretrained(path).jitted()(jnp.asarray(ids, jnp.int32), None, own).logits_BSV
        assert not np.allclose(np.asarray(before), np.asarray(got))
    # the rerouted rows' perplexity path (the whole forward) on each plan as built: the carried pass's rows
    forward = load_pretrained(path).jitted()
    plain = df[(df.rerouted.astype(str) != "True") & (df.metric == "perplexity")]
    for spec, plan in plans.items():
        got = prune_real.forward_perplexity_rows(forward, seen["heldout"], plan.expert_maps(), 4, spec.row())
        want = plain[(plain.method == spec.method) & (plain.form == spec.form) & (plain.keep == spec.keep)]
        assert len(got) == len(want) == 2, spec
        for row in got:
            np.testing.assert_allclose(row["value"], want[want.text == row["text"]].value.item(), rtol=2e-5)
    table = prune_real.summary_table(df)
    assert ("one_shot+rerouted", "frequency") in table.index and ("one_shot", "frequency") in table.index


def test_reroute_on_a_mesh_equals_one_device(dsv3, tmp_path):
    """The student (and teacher) expert-parallel over 4 of conftest's simulated devices, tokens split
    over 2: the same losses and written routers as on one device, to float rounding."""
    import jax

    from moejax.hf.io.checkpoint_reader import CheckpointReader
    from moejax.parallel import MeshConfig
    from moejax.surgery.reroute import reroute_checkpoint

    if jax.device_count() < 8:
        pytest.skip("needs conftest's 8 simulated CPU devices")
    root, _ = dsv3
    kw = dict(tokens=root / "calib.npy", steps=3, batch_size=4, lr=1e-2, warmup=0)
    one = reroute_checkpoint(root / "src", root / "pruned", tmp_path / "one", **kw)
    many = reroute_checkpoint(root / "src", root / "pruned", tmp_path / "mesh", mesh=MeshConfig(data=2, expert=4), **kw)
    assert many["mesh"] == {"data": 2, "expert": 4}
    np.testing.assert_allclose(many["losses"], one["losses"], rtol=1e-5)
    a, b = CheckpointReader(tmp_path / "one"), CheckpointReader(tmp_path / "mesh")
    for name in one["trained"]:   # (Adam moves an entry by ~lr = 1e-2; one whose gradient is near eps by less,
        #                             sensitive to rounding: hence 1e-4)
        np.testing.assert_allclose(b.read(name), a.read(name), rtol=1e-5, atol=1e-4)
        assert not np.allclose(b.read(name), CheckpointReader(root / "pruned").read(name), atol=1e-3)
    with pytest.raises(ConfigError, match="expert"):
        reroute_checkpoint(root / "src", root / "pruned", tmp_path / "bad", mesh=MeshConfig(expert=3), **kw)

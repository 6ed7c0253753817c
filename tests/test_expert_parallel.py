"""Expert parallelism on the 8 simulated CPU devices of conftest: the "ep" backend against the
dense oracle (forward, gradients, empty and masked experts), the tiny DeepSeek-V3 across mesh
shapes, expert-sharded loading, toy3 and scores identical to one device, and a sharding snapshot."""

import json
import logging
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.moe import dispatch as d
from moejax.moe import expert_parallel as ep
from moejax.moe.routing import RouterConfig, route
from moejax.parallel import MeshConfig, make_mesh, partition_specs, shard_model

MESHES = [(1, 1), (1, 2), (1, 4), (1, 8), (2, 4)]
SNAPSHOTS = Path(__file__).parent / "snapshots"


def problem(T=37, D=16, F=24, E=8, K=3, seed=0):
    """Routed pairs from the real routing function with experts 2 and 5 pruned (masked), so
    those two get no tokens; wide, partly negative router rows and biases."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(T, D)), jnp.float32)
    w = {k: jnp.asarray(rng.normal(size=s) * 0.3, jnp.float32)
         for k, s in (("gate", (E, D, F)), ("up", (E, D, F)), ("down", (E, F, D)))}
    logits = jnp.asarray(rng.normal(size=(T, E)) * 3, jnp.float32)
    mask = jnp.asarray([e not in (2, 5) for e in range(E)])
    r = route(logits, RouterConfig(top_k=K, scoring_func="sigmoid", n_group=1, topk_group=1),
              jnp.asarray(rng.normal(size=E) * 0.5, jnp.float32), mask)
    assert not np.isin(np.asarray(r.expert_idx_TK), [2, 5]).any()
    return x, w, r.expert_idx_TK, r.gate_TK


def close(a, b, tol=1e-5):
    """Within tol of the larger magnitude (gradients can be large)."""
    a, b = np.asarray(a), np.asarray(b)
    return np.abs(a - b).max() <= tol * max(1.0, np.abs(b).max())


@pytest.mark.parametrize("shape", MESHES)
@pytest.mark.parametrize("path", ["collective", "a2a"])
def test_ep_equals_the_dense_oracle_with_gradients(shape, path):
    x, w, idx, gate = problem()
    want = d.dense_pair_outputs(x, idx, w, d.swiglu)

    def loss(backend, w, x):
        f = (ep.ep_pair_outputs(x, idx, w, d.swiglu, path=path) if backend == "ep"
             else d.pair_outputs(x, idx, w, d.swiglu, "dense"))
        return jnp.sum(jnp.sin(d.combine(gate, f)))

    grads_want = jax.grad(lambda w, x: loss("dense", w, x), argnums=(0, 1))(w, x)
    with jax.set_mesh(make_mesh(MeshConfig(*shape))):
        got = jax.jit(lambda x, w: ep.ep_pair_outputs(x, idx, w, d.swiglu, path=path))(x, w)
        grads = jax.jit(jax.grad(lambda w, x: loss("ep", w, x), argnums=(0, 1)))(w, x)
    assert close(got, want)
    for g, g_want in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_want)):
        assert close(g, g_want)
    assert np.abs(np.asarray(grads[0]["gate"])[[2, 5]]).max() == 0  # pruned experts get no gradient


@pytest.mark.parametrize("path", ["collective", "a2a"])
def test_absent_pairs_forward_only(path):
    x, w, idx, _ = problem(seed=1)
    absent = jnp.where(idx == 3, 8, idx)
    want = jnp.where((idx == 3)[..., None], 0, d.dense_pair_outputs(x, idx, w, d.swiglu))
    with jax.set_mesh(make_mesh(MeshConfig(data=2, expert=4))):
        got = jax.jit(lambda x, w: ep.ep_pair_outputs(x, absent, w, d.swiglu, forward_only=True, path=path))(x, w)
    assert close(got, want)


def test_ep_backend_through_dispatch_and_its_errors(caplog):
    x, w, idx, gate = problem(seed=2)
    with pytest.raises(ValueError, match="needs a mesh with an 'expert' axis"):
        d.dispatch(x, idx, gate, w, d.swiglu, "ep")
    ep._logged.clear()
    with caplog.at_level(logging.INFO, logger="moejax.moe.expert_parallel"):
        with jax.set_mesh(make_mesh(MeshConfig(expert=8))):
            y = jax.jit(lambda x: d.dispatch(x, idx, gate, w, d.swiglu, "ep"))(x)
            jax.jit(lambda x: d.dispatch(x, idx, gate, w, d.swiglu, "ep"))(x)
    assert caplog.text.count("using the collective path") == 1
    assert close(y, d.dispatch(x, idx, gate, w, d.swiglu, "dense"))
    with jax.set_mesh(make_mesh(MeshConfig(expert=8))), pytest.raises(ValueError, match="do not split"):
        ep.ep_pair_outputs(x, idx, {k: v[:6] for k, v in w.items()}, d.swiglu)


def test_mesh_config_errors():
    from moejax.errors import ConfigError

    with pytest.raises(ConfigError, match="mesh.expert=0"):
        MeshConfig(expert=0)
    with pytest.raises(ConfigError, match="needs 16 devices, JAX sees 8"):
        make_mesh(MeshConfig(data=2, expert=8))
    with pytest.raises(ConfigError, match="unknown key"):
        MeshConfig.from_dict({"experts": 8})


# --- the tiny DeepSeek-V3 -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    pytest.importorskip("transformers")
    from hf_fixtures import make_checkpoint

    path = tmp_path_factory.mktemp("ep") / "src"
    make_checkpoint(path, seed=8)
    return path


@pytest.mark.slow  # 24 s; by default tests/test_multiprocess.py checks these logits on 8 devices (2 processes
# against 1, bitwise) and the dispatch-level tests here check expert parallelism against the oracle
def test_deepseek_logits_identical_across_meshes(ckpt):
    from hf_fixtures import batch

    from moejax import from_pretrained

    ids, mask = (jnp.asarray(a) for a in batch(96, seed=9))
    want = np.asarray(from_pretrained(ckpt).jitted()(ids, mask).logits_BSV)
    for shape in MESHES:
        mesh = make_mesh(MeshConfig(*shape))
        model = from_pretrained(ckpt, mesh=mesh)
        gate = model.model.layers[1].mlp.experts_gate[...]
        assert gate.sharding.spec == jax.sharding.PartitionSpec("expert")
        assert gate.addressable_shards[0].data.shape[0] == 8 // shape[1]
        with jax.set_mesh(mesh):
            got = np.asarray(model.jitted()(ids, mask).logits_BSV)
        assert close(got, want), shape


def test_each_device_block_is_read_from_its_own_experts(ckpt, monkeypatch):
    from moejax import from_pretrained
    from moejax.hf import model_io

    reads, calls = [], []
    real_read, real_make = model_io.OpenCheckpoint.read_param_tensor, jax.make_array_from_callback

    def read(self, spec, dtype):
        reads.append(spec)
        return real_read(self, spec, dtype)

    def make(shape, sharding, callback):
        def logged(index):
            before = len(reads)
            out = callback(index)
            calls.append((range(*index[0].indices(shape[0])), [s.expert for s in reads[before:]]))
            return out
        return real_make(shape, sharding, logged)

    monkeypatch.setattr(model_io.OpenCheckpoint, "read_param_tensor", read)
    monkeypatch.setattr(model_io.jax, "make_array_from_callback", make)
    from_pretrained(ckpt, mesh=make_mesh(MeshConfig(data=2, expert=4)))
    assert len(calls) == 2 * 3 * 8  # 2 MoE layers x 3 expert stacks x 8 devices
    for experts, read_now in calls:
        assert read_now in ([], list(experts))  # its own experts, or nothing (a data-axis replica)
    per_expert = [s for s in reads if s.expert is not None]
    assert len(per_expert) == len({s.hf_name for s in per_expert}) == 2 * 3 * 8  # each expert tensor once


@pytest.mark.slow  # 18 s; the expert-parallel forward and toy3 stay in the default run
def test_scores_identical_on_a_mesh(ckpt, tmp_path):
    from moejax.scoring.score_checkpoint import score_checkpoint
    from moejax.scoring.select import select_kept

    np.save(tmp_path / "ids.npy", np.random.default_rng(3).integers(0, 96, size=(6, 16)))
    one = score_checkpoint(ckpt, tokens=tmp_path / "ids.npy", batch_size=2)
    for shape in [(1, 8), (2, 4)]:
        many = score_checkpoint(ckpt, tokens=tmp_path / "ids.npy", batch_size=2, mesh=MeshConfig(*shape))
        assert (many[["layer", "expert", "score"]].values == one[["layer", "expert", "score"]].values).all()
        np.testing.assert_allclose(many.value, one.value, rtol=1e-5, atol=1e-6)
        for (layer, score), g in one.groupby(["layer", "score"]):
            h = many[(many.layer == layer) & (many.score == score)]
            assert (select_kept(g.value.to_numpy(), 4) == select_kept(h.value.to_numpy(), 4)).all()


@pytest.mark.slow  # 22 s; by default tests/test_multiprocess.py runs toy3 on 8 expert shards (2 processes against 1)
def test_toy3_identical_on_eight_expert_shards():
    from moejax.experiments import toy3

    small = dict(seeds=2, n_calib=400, n_heldout=400, balance_steps=20, keep=(8, 16), merges=(), eq6_pairs=0)
    one, _ = toy3.run(toy3.Toy3Config(**small))
    eight, _ = toy3.run(toy3.Toy3Config(**small, backend="ep", mesh_expert=8))
    keys = ["offset", "load", "seed", "score", "keep", "metric"]
    merged = one.merge(eight, on=keys, suffixes=("_1", "_8"))
    assert len(merged) == len(one) == len(eight)
    overlap = merged[merged.metric == "overlap_frequency"]
    assert (overlap.value_1 == overlap.value_8).all()  # the same kept sets
    assert np.abs(merged.value_1 - merged.value_8).max() <= 1e-5


# --- sharding snapshot --------------------------------------------------------------------------

def sharding_snapshot(preset: str) -> tuple[dict, dict, MeshConfig]:
    """Every parameter of a tiny model under a mesh preset: its partition spec and the shape of
    one device's shard; also each parameter's full shape, and the preset's mesh."""
    import yaml
    from flax import nnx

    from moejax.models.deepseek_v3 import DeepseekV3Config
    from moejax.models.deepseek_v3.model import DeepseekV3ForCausalLM

    root = Path(__file__).resolve().parents[1]
    mesh_cfg = MeshConfig.from_dict(yaml.safe_load((root / "conf" / "mesh" / f"{preset}.yaml").read_text()))
    mesh = make_mesh(mesh_cfg)
    cfg = DeepseekV3Config.from_dict({"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"],
                                      "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
                                      "moe_intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
                                      "num_key_value_heads": 2, "q_lora_rank": 8, "kv_lora_rank": 8,
                                      "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8,
                                      "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
                                      "first_k_dense_replace": 1})
    model = shard_model(DeepseekV3ForCausalLM(cfg, rngs=nnx.Rngs(0)), mesh)
    specs = partition_specs(model)
    out, shapes = {}, {}
    for path, var in nnx.to_flat_state(nnx.state(model)):
        name = ".".join(str(p) for p in path)
        value = var.get_value()
        out[name] = {"spec": str(specs[name]), "shard_shape": list(value.sharding.shard_shape(value.shape))}
        shapes[name] = list(value.shape)
    return out, shapes, mesh_cfg


def expected_sharding(shapes: dict, mesh_cfg: MeshConfig) -> dict:
    """The rule as README states it, independent of the rule table: a routed-expert stack
    (`...mlp.experts_{gate,up,down}`, [E, ...]) is split over the expert axis (E / expert per
    device), everything else is replicated (one device holds all of it)."""
    out = {}
    for name, shape in shapes.items():
        if name.split(".")[-1] in ("experts_gate", "experts_up", "experts_down") and ".mlp." in name:
            assert shape[0] == 8 and shape[0] % mesh_cfg.expert == 0
            out[name] = {"spec": "P('expert',)", "shard_shape": [shape[0] // mesh_cfg.expert, *shape[1:]]}
        else:
            out[name] = {"spec": "P()", "shard_shape": list(shape)}
    return out


@pytest.mark.parametrize("preset", sorted(p.stem for p in (Path(__file__).resolve().parents[1] / "conf" / "mesh").glob("*.yaml")))
def test_sharding_snapshot(preset):
    """A change of sharding must show up in review: update with MOEJAX_UPDATE_SNAPSHOTS=1 (which
    rewrites the file and then skips, so an update run never passes by comparing with itself)."""
    got, shapes, mesh_cfg = sharding_snapshot(preset)
    assert got == expected_sharding(shapes, mesh_cfg)   # checked in update runs too
    assert sum(v["spec"] != "P()" for v in got.values()) == 3   # the one MoE layer's three stacks
    path = SNAPSHOTS / f"sharding_{preset}.json"
    if os.environ.get("MOEJAX_UPDATE_SNAPSHOTS"):
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
        pytest.skip(f"MOEJAX_UPDATE_SNAPSHOTS is set: rewrote {path}; review its diff and rerun without it")
    assert got == json.loads(path.read_text())

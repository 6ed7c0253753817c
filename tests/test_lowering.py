"""The accelerator paths lowered for CUDA and TPU on this CPU machine (`jax.export`), without a GPU
or TPU: the forward with the "ragged" and "ep" backends (an 8-device mesh), the scoring pass's
layer step, generation's prefill and decode loop, and a train_tiny step.

What this proves: every primitive these programs use has a lowering on both platforms (an export
that meets one without fails here), the programs carry no host callback or CPU-only custom call,
and a path chosen by platform is chosen by the platform lowered for (the expert-parallel backend's
all-to-all, `jax.lax.platform_dependent`), not by the CPU that traced it. What it does not prove:
that XLA compiles them for the device (compilation happens there) or how fast they run.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import export

from moejax.hf.auto import AutoModelForCausalLM
from moejax.models.registry import config_from_dict
from moejax.training.config import ArchConfig

PLATFORMS = ("cuda", "tpu")
VOCAB = 256


def tiny_config(family_name: str = "deepseek_v3"):
    """The family's train_tiny model (byte-level vocabulary) at two layers (one dense, one MoE
    where the family's first layer is dense): lowering needs shapes, not size."""
    return config_from_dict(ArchConfig.from_mapping({"family": family_name, "num_hidden_layers": 2}).hf_dict())


def lowered(fn, *args, platforms=PLATFORMS) -> set:
    """`fn` (a jax.jit) exported for `platforms`: the operations of its StableHLO (names such as
    "chlo.ragged_dot"; the text's locations, which name this file's functions, are not searched),
    checked to hold no host callback and no CPU-only custom call."""
    exp = export.export(fn, platforms=platforms)(*args)
    assert exp.platforms == tuple(platforms)
    text = exp.mlir_module()
    targets = set(re.findall(r"custom_call @(\w+)", text)) | set(re.findall(r'call_target_name = "([^"]+)"', text))
    assert not {t for t in targets if re.search("cpu|lapack|callback|host", t, re.I)}, targets
    return set(re.findall(r"\b((?:stablehlo|chlo|mhlo)\.\w+)", text))


RAGGED, A2A, GATHER, SCATTER = "chlo.ragged_dot", "stablehlo.all_to_all", "stablehlo.all_gather", "stablehlo.reduce_scatter"


def forward_fn(model):
    graphdef, state = nnx.split(model)
    fn = jax.jit(lambda state, ids: nnx.merge(graphdef, state)(ids, forward_only=True).logits_BSV)
    return fn, state


def ids(B=2, S=8, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, VOCAB, size=(B, S)), jnp.int32)


@pytest.mark.parametrize("family_name", ["deepseek_v3", "qwen3_moe"])
def test_forward_with_the_ragged_backend_lowers_with_ragged_dot(family_name):
    """The ragged backend keeps `ragged_dot` (native on GPU/TPU) in the program for both platforms;
    lowered for CPU it is expanded into dense matmuls (why "sorted" is the CPU default)."""
    model = AutoModelForCausalLM.from_config(tiny_config(family_name), rngs=nnx.Rngs(0), backend="ragged")
    fn, state = forward_fn(model)
    assert RAGGED in lowered(fn, state, ids())
    assert RAGGED not in lowered(fn, state, ids(), platforms=("cpu",))


def test_forward_with_the_ep_backend_lowers_all_to_all_on_a_mesh():
    """On a 2 x 4 (data x expert) mesh of the simulated devices, the "ep" forward exported for CUDA
    and TPU holds the all-to-all path; the same program exported for CPU holds the collective path
    (all-gather and reduce-scatter), which is what runs here (its results: test_expert_parallel)."""
    from moejax.parallel import MeshConfig, make_mesh

    mesh = make_mesh(MeshConfig(data=2, expert=4))
    model = AutoModelForCausalLM.from_config(tiny_config(), rngs=nnx.Rngs(0), backend="ep")
    fn, state = forward_fn(model)
    with jax.set_mesh(mesh):
        accel = lowered(fn, state, ids(B=4))
        cpu = lowered(fn, state, ids(B=4), platforms=("cpu",))
    assert A2A in accel and GATHER not in accel and SCATTER not in accel
    assert A2A not in cpu and GATHER in cpu and SCATTER in cpu


def test_the_scoring_pass_layer_step_lowers():
    """What `moejax score` runs per layer and batch (`moejax.inference.stream` and
    `moejax.scoring.observe`): the decoder layer's forward, then the MoE layer's per-pair
    quantities for every score, with the ragged backend."""
    from moejax.inference.stream import _layer_forward
    from moejax.models.layers import causal_allowed
    from moejax.scoring.observe import _pairs

    cfg = tiny_config()
    model = AutoModelForCausalLM.from_config(cfg, rngs=nnx.Rngs(0), backend="ragged")
    layer = model.model.layers[cfg.moe_layers[0]]
    B, S = 2, 8
    x = jnp.asarray(np.random.default_rng(1).normal(size=(B, S, cfg.hidden_size)), jnp.float32)
    cos, sin = type(model).rope_tables(cfg, jnp.arange(S), jnp.float32)
    graphdef, state = nnx.split(layer)
    assert RAGGED in lowered(_layer_forward, graphdef, state, x, cos, sin, causal_allowed(None, B, S), None, None)
    graphdef, state = nnx.split(layer.mlp)
    assert RAGGED in lowered(_pairs, graphdef, state, x.reshape(B * S, -1), True)


def test_generation_prefill_and_decode_lower():
    """The KV-cached generator's compiled prefill and decode loop (sampling on: top-k, top-p)."""
    from moejax.inference.generate import Generator, Sampling

    model = AutoModelForCausalLM.from_config(tiny_config(), rngs=nnx.Rngs(0), backend="ragged")
    gen = Generator(model)
    B, P, N = 2, 6, 4
    prompt = ids(B, P)
    positions = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
    mask = jnp.ones((B, P), jnp.int32)
    assert RAGGED in lowered(gen._prefill, P + N, gen.state, prompt, positions, mask, None)
    logits, cache = gen._prefill(P + N, gen.state, prompt, positions, mask, None)
    sampling = Sampling(0.7, 5, 0.9).checked()
    ops = lowered(gen._decode, sampling, gen.state, cache, logits, jnp.zeros((B, N), jnp.int32),
                   jnp.zeros((B,), bool), 0, N, P, positions[:, -1] + 1, None, jax.random.PRNGKey(0),
                   jnp.asarray([-1], jnp.int32), 0)
    assert "stablehlo.while" in ops and RAGGED in ops


def test_a_train_tiny_step_lowers():
    """train_tiny's compiled step: forward, balance loss, gradients, AdamW, the balance bias update."""
    from moejax.experiments import train_tiny as tt
    from moejax.training.trainer import Trainer

    cfg = tt.Config.from_mapping({"path": "unused", "arch": {"num_hidden_layers": 2},
                                  "train": {"batch_size": 2}, "data": {"seq_len": 16}})
    trainer = Trainer(cfg)
    batch = jnp.asarray(np.random.default_rng(2).integers(0, 256, size=(2, 16)), jnp.int32)
    ops = lowered(trainer.step, trainer.state, batch)
    assert RAGGED not in ops and "stablehlo.dot_general" in ops   # train_tiny's sorted backend: plain matmuls

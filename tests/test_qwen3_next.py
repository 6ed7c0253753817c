"""Qwen3-Next beyond the shared family tests (tests/test_families.py runs it with the others):
padded batches long enough for several DeltaNet chunks, exact per sequence against transformers
in float64; generation from a prompt longer than a chunk; merging (HC-SMoE, M-SMoE, REAM) written
as checkpoints transformers loads; the layer schedule and its refusals."""

import copy
import json

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from family_fixtures import make_family_checkpoint  # noqa: E402

from moejax import AutoModelForCausalLM  # noqa: E402
from moejax.errors import ConfigError  # noqa: E402
from moejax.inference.generate import generate  # noqa: E402
from moejax.models.qwen3_next.presets import TEST  # noqa: E402
from moejax.models.registry import config_from_dict  # noqa: E402


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_next")
    hf = make_family_checkpoint("qwen3_next", root / "src", seed=43)
    return root, hf, AutoModelForCausalLM.from_pretrained(root / "src", dtype=jnp.float32)


def test_long_padded_batch_is_exact_per_sequence(qwen3_next):
    """150 columns (three DeltaNet chunks of 64), rows left-padded by 0, 70 and 9 and one
    right-padded by 5: each row's logits equal moejax on that row alone (padding changes nothing
    but float32 summation order), and against transformers on the row alone in float64 they are
    within a few times transformers' own float32 error (float32 over 150 steps of the recurrence is
    1e-4 to 5e-4 from the truth either way, each computation in its own order: neither is the
    other's reference; a planted bug in the padding or the chunking is off by whole units)."""
    _, hf, model = qwen3_next
    rng = np.random.default_rng(1)
    ids = rng.integers(2, 96, size=(4, 150)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[1, :70], mask[2, :9], mask[3, -5:] = 0, 0, 0
    forward = model.jitted()
    got = np.asarray(forward(jnp.asarray(ids), jnp.asarray(mask)).logits_BSV)
    hf64 = copy.deepcopy(hf).double()
    for b in range(len(ids)):
        real = mask[b].astype(bool)
        alone = np.asarray(forward(jnp.asarray(ids[b:b + 1, real])).logits_BSV)[0]
        assert np.abs(got[b, real] - alone).max() < 1e-4, b
        row = torch.as_tensor(ids[b:b + 1, real], dtype=torch.long)
        with torch.no_grad():
            truth, f32 = hf64(row).logits.numpy()[0], hf(row).logits.numpy()[0]
        ours, theirs = np.abs(got[b, real] - truth).max(), np.abs(f32 - truth).max()
        assert ours < 5 * theirs + 1e-5, (b, ours, theirs)
    assert np.abs(truth).max() > 1.0


def test_greedy_generation_from_a_prompt_longer_than_a_chunk_equals_transformers(qwen3_next):
    """A 70-token prompt (prefill through the chunked rule) and one left-padded by 5, then the
    recurrent decode: token for token transformers' greedy `generate`."""
    _, hf, model = qwen3_next
    ids = np.random.default_rng(2).integers(2, 96, size=(2, 70))
    mask = np.ones_like(ids)
    mask[1, :5] = 0
    with torch.no_grad():
        want = hf.generate(input_ids=torch.as_tensor(ids), attention_mask=torch.as_tensor(mask), max_new_tokens=6,
                           do_sample=False, eos_token_id=None, pad_token_id=0).numpy()
    np.testing.assert_array_equal(np.asarray(generate(model, ids, mask, max_new_tokens=6)), want)


@pytest.mark.parametrize("method", ["hc_smoe", "m_smoe", "ream"])
def test_merged_checkpoint_loads_in_transformers(qwen3_next, method):
    """`moejax merge` on the hybrid stack: transformers loads the folder (6 experts a layer) and
    computes what moejax computes from it; the merge changed the model."""
    from moejax.cli import main

    root, hf, model = qwen3_next
    tokens = root / "calib.npy"
    np.save(tokens, np.random.default_rng(6).integers(0, 96, size=(4, 24)).astype(np.int32))
    dst = root / method
    assert main(["merge", str(root / "src"), str(dst), "--method", method, "--keep", "6", "--tokens", str(tokens)]) == 0
    assert json.loads((dst / "config.json").read_text())["num_experts"] == 6
    ids = np.random.default_rng(7).integers(2, 96, size=(2, 20))
    merged = transformers.AutoModelForCausalLM.from_pretrained(dst, attn_implementation="eager",
                                                               experts_implementation="eager").eval()
    with torch.no_grad():
        want = merged(torch.as_tensor(ids)).logits.numpy()
        before = hf(torch.as_tensor(ids)).logits.numpy()
    got = np.asarray(AutoModelForCausalLM.from_pretrained(dst).jitted()(jnp.asarray(ids)).logits_BSV)
    assert np.abs(got - want).max() < 1e-4 and np.abs(want - before).max() > 1e-2


def test_layer_schedule_defaults_and_refusals():
    base = {"model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"], **TEST,
            "num_hidden_layers": 8}
    base.pop("layer_types")
    cfg = config_from_dict(base)
    assert [cfg.is_linear_attention(l) for l in range(8)] == [True, True, True, False] * 2
    assert not config_from_dict({**base, "full_attention_interval": 2}).is_linear_attention(1)
    with pytest.raises(ConfigError, match="layer_types.*3 entries, expected num_hidden_layers=8"):
        config_from_dict({**base, "layer_types": ["full_attention"] * 3})
    with pytest.raises(ConfigError, match="expected a list of 'linear_attention' or 'full_attention'"):
        config_from_dict({**base, "layer_types": ["sliding_attention"] * 8})
    with pytest.raises(ConfigError, match="linear_num_value_heads=3 is not a multiple of linear_num_key_heads=2"):
        config_from_dict({**base, "linear_num_value_heads": 3})

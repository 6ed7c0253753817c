"""Every config.json key that changes which layers are MoE, or which modules a layer or the head
holds, set away from the fixtures' values, per family, against transformers 5 (the reference we
did not write): the MoE layers moejax routes are the ones transformers routes, with the same
chosen experts, and the logits agree on a padded batch.

    qwen3_moe, qwen2_moe  decoder_sparse_step (a MoE layer where (layer + 1) % step == 0),
                          mlp_only_layers (several, and one the step would have made MoE)
    deepseek_v3, glm4_moe first_k_dense_replace (0: every layer MoE; 2), n_shared_experts (1, 2)
    every family          tie_word_embeddings and the attention biases / q-k norms it offers

(DeepSeek-V3's `moe_layer_freq` other than 1 is refused by name: tests/test_deepseek_v3_config.py;
transformers 5 ignores the key. n_shared_experts=0 is not a case here: transformers then writes
zero-width shared-expert tensors, which moejax's checkpoint check refuses by name.) Each case is
a tiny checkpoint of 2-4 layers, run eagerly (no whole-model compile per case); the fixtures' own
settings are compared in tests/test_families.py and tests/test_deepseek_v3.py."""

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from family_fixtures import make_family_checkpoint  # noqa: E402
from hf_fixtures import batch, hook_router, make_checkpoint  # noqa: E402

from moejax import AutoModelForCausalLM  # noqa: E402

# (family, config overrides, the MoE layers transformers builds from them)
CASES = {
    # a model ignoring the step makes {0, 1, 2} MoE; one ignoring mlp_only_layers {1, 3}; the rule
    # read as layer % step == 0 gives {0, 2}
    "qwen3-step2-mlponly3": ("qwen3_moe", dict(num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3]), [1]),
    "qwen3-step3": ("qwen3_moe", dict(decoder_sparse_step=3, mlp_only_layers=[]), [2]),
    # two dense layers by name around a MoE one; q/k/v/o biases and a tied head
    "qwen3-mlponly02-bias-tied": ("qwen3_moe", dict(mlp_only_layers=[0, 2], attention_bias=True,
                                                    tie_word_embeddings=True), [1]),
    "qwen2-step2-mlponly3": ("qwen2_moe", dict(num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3]), [1]),
    # no q/k/v biases, tied head
    "qwen2-mlponly02-nobias-tied": ("qwen2_moe", dict(mlp_only_layers=[0, 2], qkv_bias=False,
                                                      tie_word_embeddings=True), [1]),
    "glm4-dense0-shared2-plain": ("glm4_moe", dict(num_hidden_layers=2, first_k_dense_replace=0, n_shared_experts=2,
                                                   use_qk_norm=False, attention_bias=False), [0, 1]),
    "glm4-dense2-tied": ("glm4_moe", dict(first_k_dense_replace=2, tie_word_embeddings=True), [2]),
    "dsv3-dense0-shared1": ("deepseek_v3", dict(num_hidden_layers=2, first_k_dense_replace=0, n_shared_experts=1),
                            [0, 1]),
    "mixtral-tied": ("mixtral", dict(tie_word_embeddings=True), [0, 1]),
    "olmoe-nobias-untied": ("olmoe", dict(attention_bias=False, tie_word_embeddings=False), [0, 1]),
}


def build(family, path, overrides, seed):
    if family == "deepseek_v3":
        return make_checkpoint(path, seed=seed, **overrides)
    return make_family_checkpoint(family, path, seed=seed, **overrides)


@pytest.mark.parametrize("case", list(CASES))
def test_layer_structure_keys_match_transformers(case, tmp_path):
    family, overrides, moe_layers = CASES[case]
    hf = build(family, tmp_path / case, overrides, seed=40 + list(CASES).index(case))
    assert [l for l, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "gate")] == moe_layers
    model = AutoModelForCausalLM.from_pretrained(tmp_path / case, dtype=jnp.float32)
    assert [l for l in range(model.config.num_hidden_layers) if model.config.is_moe_layer(l)] == moe_layers
    ids, mask = batch(96, seed=11, B=3, S=10)
    want, seen = hook_router(hf, ids, mask)
    out = model(jnp.asarray(ids), jnp.asarray(mask), return_routing=True)  # eager: no whole-model compile per case
    logits, routing = np.asarray(out.logits_BSV), out.routing
    assert sorted(routing) == sorted(seen) == moe_layers
    valid = mask.reshape(-1).astype(bool)
    for layer, (_, _, _, idx) in seen.items():  # routing first: a flipped expert explains everything else
        np.testing.assert_array_equal(np.sort(np.asarray(routing[layer].expert_idx_TK)[valid], 1),
                                      np.sort(idx.numpy()[valid], 1), err_msg=f"{case}: layer {layer}")
    m = mask.astype(bool)
    assert np.abs(logits[m] - want[m]).max() < 1e-4 * max(1.0, np.abs(want[m]).max()), case
    assert np.abs(want[m]).max() > 0.5

"""Config reading, rope constants and full-size shapes (no weights, no memory)."""

import math

import numpy as np
import pytest
from flax import nnx

from moejax.errors import ConfigError
from moejax.hf.mapping import param_shapes, tensor_specs
from moejax.models.deepseek_v3 import DeepseekV3Config, DeepseekV3ForCausalLM
from moejax.models.deepseek_v3.presets import PRESETS
from moejax.models.deepseek_v3.rope import inv_freq_and_attention_factor


def test_deepseek_v3_yarn_constants_match_reference_values():
    cfg = DeepseekV3Config.from_dict(PRESETS["deepseek-v3"])
    inv_freq, factor = inv_freq_and_attention_factor(cfg)
    np.testing.assert_allclose(inv_freq[[0, 1, 2, 10, 11, 22, 23, 31]],
                               [1.0, 0.7498942, 0.5623413, 0.05623413, 0.03900693, 1.7782794e-4, 3.3338034e-5,
                                3.3338035e-6], rtol=1e-6)
    assert factor == 1.0
    assert cfg.softmax_scale() == pytest.approx(0.1352338, rel=1e-6)
    kimi = DeepseekV3Config.from_dict(PRESETS["kimi-k2"])
    assert kimi.softmax_scale() == pytest.approx(0.1308608, rel=1e-6)
    moon = DeepseekV3Config.from_dict(PRESETS["moonlight-16b-a3b"])
    assert moon.softmax_scale() == pytest.approx(192 ** -0.5) and moon.rope.rope_type == "default"


def test_both_rope_forms_give_the_same_config():
    legacy = DeepseekV3Config.from_dict(PRESETS["deepseek-v3"])
    d = {k: v for k, v in PRESETS["deepseek-v3"].items() if k not in ("rope_scaling", "rope_theta")}
    d["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40, "beta_fast": 32,
                            "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
                            "original_max_position_embeddings": 4096}
    assert DeepseekV3Config.from_dict(d).rope == legacy.rope
    # rope_scaling wins over rope_parameters; a theta inside the dict wins over the top level
    both = {**d, "rope_scaling": {"type": "yarn", "factor": 8.0, "rope_theta": 123.0}, "rope_theta": 99.0}
    cfg = DeepseekV3Config.from_dict(both)
    assert (cfg.rope.factor, cfg.rope.theta) == (8.0, 123.0)


def test_kimi_k2_model_type_is_accepted_and_others_refused():
    assert DeepseekV3Config.from_dict(PRESETS["kimi-k2"]).n_routed_experts == 384
    with pytest.raises(ConfigError, match="model_type='llama'"):
        DeepseekV3Config.from_dict({**PRESETS["kimi-k2"], "model_type": "llama"})


@pytest.mark.parametrize("key,value,match", [
    ("scoring_func", "softmax", "scoring_func='softmax'"),
    ("topk_method", "greedy", "topk_method='greedy'"),
    ("moe_layer_freq", 2, "moe_layer_freq=2"),
    ("num_key_value_heads", 1, "num_key_value_heads=1"),
    ("head_dim", 128, "head_dim=128"),
    ("n_group", 3, "not divisible by n_group=3"),
])
def test_unimplemented_settings_are_refused(key, value, match):
    with pytest.raises(ConfigError, match=match):
        DeepseekV3Config.from_dict({**PRESETS["deepseek-v3"], key: value})


def test_all_refusals_reported_together():
    with pytest.raises(ConfigError, match="scoring_func.*topk_method"):
        DeepseekV3Config.from_dict({**PRESETS["deepseek-v3"], "scoring_func": "softmax", "topk_method": "greedy"})


def hf_shapes_from_config(d: dict) -> dict:
    """The tensors a checkpoint of this config holds, written straight from the HF naming table
    (reference/deepseek-v3-hf.md section 3.1), independently of moejax's mapping."""
    H, V, L = d["hidden_size"], d["vocab_size"], d["num_hidden_layers"]
    nh, dn, dr, dv = d["num_attention_heads"], d["qk_nope_head_dim"], d["qk_rope_head_dim"], d["v_head_dim"]
    rq, rkv, I, Im = d["q_lora_rank"], d["kv_lora_rank"], d["intermediate_size"], d["moe_intermediate_size"]
    E, Ns, k0 = d["n_routed_experts"], d["n_shared_experts"], d["first_k_dense_replace"]
    out = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,), "lm_head.weight": (V, H)}
    for l in range(L):
        p = f"model.layers.{l}."
        out[p + "input_layernorm.weight"] = out[p + "post_attention_layernorm.weight"] = (H,)
        if rq is None:
            out[p + "self_attn.q_proj.weight"] = (nh * (dn + dr), H)
        else:
            out[p + "self_attn.q_a_proj.weight"] = (rq, H)
            out[p + "self_attn.q_a_layernorm.weight"] = (rq,)
            out[p + "self_attn.q_b_proj.weight"] = (nh * (dn + dr), rq)
        out[p + "self_attn.kv_a_proj_with_mqa.weight"] = (rkv + dr, H)
        out[p + "self_attn.kv_a_layernorm.weight"] = (rkv,)
        out[p + "self_attn.kv_b_proj.weight"] = (nh * (dn + dv), rkv)
        out[p + "self_attn.o_proj.weight"] = (H, nh * dv)
        if l < k0:
            out[p + "mlp.gate_proj.weight"] = out[p + "mlp.up_proj.weight"] = (I, H)
            out[p + "mlp.down_proj.weight"] = (H, I)
            continue
        out[p + "mlp.gate.weight"] = (E, H)
        out[p + "mlp.gate.e_score_correction_bias"] = (E,)
        for e in range(E):
            out[p + f"mlp.experts.{e}.gate_proj.weight"] = out[p + f"mlp.experts.{e}.up_proj.weight"] = (Im, H)
            out[p + f"mlp.experts.{e}.down_proj.weight"] = (H, Im)
        out[p + "mlp.shared_experts.gate_proj.weight"] = out[p + "mlp.shared_experts.up_proj.weight"] = (Im * Ns, H)
        out[p + "mlp.shared_experts.down_proj.weight"] = (H, Im * Ns)
    return out


@pytest.mark.parametrize("name,billions", [("moonlight-16b-a3b", 15.96), ("kimi-k2", 1026.4),
                                           ("deepseek-v3", 671.0)])
def test_full_size_parameter_count_without_memory(name, billions):
    cfg = DeepseekV3Config.from_dict(PRESETS[name])
    abstract = nnx.eval_shape(lambda: DeepseekV3ForCausalLM(cfg))
    shapes = param_shapes(abstract)
    n_model = sum(math.prod(s) for s in shapes.values())
    want = hf_shapes_from_config(PRESETS[name])
    assert n_model == sum(math.prod(s) for s in want.values())
    assert n_model / 1e9 == pytest.approx(billions, abs=0.05)
    specs = tensor_specs(cfg, shapes)
    assert {s.hf_name: tuple(s.hf_shape) for s in specs} == want

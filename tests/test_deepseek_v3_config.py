"""Config reading, rope constants and full-size shapes (no weights, no memory)."""

import dataclasses
import json
import math
import re

import numpy as np
import pytest
from flax import nnx

from moejax.errors import ConfigError
from moejax.hf.mapping import param_shapes, tensor_specs
from moejax.models.deepseek_v3 import DeepseekV3Config
from moejax.models.deepseek_v3.model import DeepseekV3ForCausalLM
from moejax.models.deepseek_v3.config import ARCHITECTURE
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


@pytest.mark.parametrize("name,billions", [
    ("moonlight-16b-a3b", 15.96),
    # at full depth in `-m slow`; their layers' shapes are checked at 4 layers by tests/test_families.py
    pytest.param("kimi-k2", 1026.4, marks=pytest.mark.slow),
    pytest.param("deepseek-v3", 671.0, marks=pytest.mark.slow)])
def test_full_size_parameter_count_without_memory(name, billions):
    cfg = DeepseekV3Config.from_dict(PRESETS[name])
    abstract = nnx.eval_shape(lambda: DeepseekV3ForCausalLM(cfg))
    shapes = param_shapes(abstract)
    n_model = sum(math.prod(s) for s in shapes.values())
    want = hf_shapes_from_config(PRESETS[name])
    assert n_model == sum(math.prod(s) for s in want.values())
    assert n_model / 1e9 == pytest.approx(billions, abs=0.05)
    specs = tensor_specs(cfg)
    assert {s.hf_name: tuple(s.hf_shape) for s in specs} == want
    for s in specs:  # the shapes the config implies are the NNX parameters' shapes
        shape = tuple(shapes[s.param])[1:] if s.expert is not None else tuple(shapes[s.param])
        assert tuple(s.hf_shape) == (shape[::-1] if s.transpose else shape), s.hf_name


# --- types and ranges: never a silent wrong value ----------------------------------------------

_YARN = PRESETS["deepseek-v3"]["rope_scaling"]


@pytest.mark.parametrize("overrides,expected", [
    ({"n_routed_experts": "8"}, 'n_routed_experts="8" (str), expected a positive integer'),
    ({"n_routed_experts": 8.0}, "n_routed_experts=8.0 (float), expected a positive integer"),
    ({"n_routed_experts": -8}, "n_routed_experts=-8 (int), expected a positive integer"),
    ({"num_hidden_layers": True}, "num_hidden_layers=true (bool), expected a positive integer"),
    ({"hidden_size": 0}, "hidden_size=0 (int), expected a positive integer"),
    ({"vocab_size": None}, "vocab_size=null (NoneType), expected a positive integer"),
    ({"intermediate_size": [18432]}, "intermediate_size=[18432] (list), expected a positive integer"),
    ({"moe_intermediate_size": "2048"}, 'moe_intermediate_size="2048" (str)'),
    ({"num_attention_heads": 128.5}, "num_attention_heads=128.5 (float)"),
    ({"kv_lora_rank": False}, "kv_lora_rank=false (bool), expected a positive integer"),
    ({"qk_rope_head_dim": -64}, "qk_rope_head_dim=-64 (int)"),
    ({"qk_nope_head_dim": "128"}, 'qk_nope_head_dim="128" (str)'),
    ({"v_head_dim": 0}, "v_head_dim=0 (int)"),
    ({"n_group": True}, "n_group=true (bool), expected a positive integer"),
    ({"topk_group": 4.0}, "topk_group=4.0 (float)"),
    ({"num_experts_per_tok": 0}, "num_experts_per_tok=0 (int), expected a positive integer"),
    ({"num_experts_per_tok": 300}, "num_experts_per_tok=300 exceeds n_routed_experts=256"),
    ({"max_position_embeddings": 163840.0}, "max_position_embeddings=163840.0 (float)"),
    ({"n_shared_experts": -1}, "n_shared_experts=-1 (int), expected a non-negative integer"),
    ({"n_shared_experts": None}, "n_shared_experts=null (NoneType), expected a non-negative integer"),
    ({"first_k_dense_replace": 1.5}, "first_k_dense_replace=1.5 (float), expected a non-negative integer"),
    ({"num_nextn_predict_layers": "1"}, 'num_nextn_predict_layers="1" (str), expected a non-negative integer'),
    ({"q_lora_rank": 0}, "q_lora_rank=0 (int), expected a positive integer or null"),
    ({"q_lora_rank": "1536"}, 'q_lora_rank="1536" (str), expected a positive integer or null'),
    ({"rms_norm_eps": "1e-6"}, 'rms_norm_eps="1e-6" (str), expected a positive finite number'),
    ({"rms_norm_eps": 0}, "rms_norm_eps=0 (int), expected a positive finite number"),
    ({"rms_norm_eps": float("nan")}, "rms_norm_eps=NaN (float), expected a positive finite number"),
    ({"routed_scaling_factor": True}, "routed_scaling_factor=true (bool), expected a positive finite number"),
    ({"routed_scaling_factor": -2.5}, "routed_scaling_factor=-2.5 (float)"),
    ({"norm_topk_prob": 1}, "norm_topk_prob=1 (int), expected true or false"),
    ({"tie_word_embeddings": "false"}, 'tie_word_embeddings="false" (str), expected true or false'),
    ({"rope_interleave": 0}, "rope_interleave=0 (int), expected true or false"),
    ({"attention_bias": None}, "attention_bias=null (NoneType), expected true or false"),
    ({"rope_theta": "10000"}, 'rope_theta="10000" (str), expected a positive finite number'),
    ({"rope_theta": float("inf")}, "rope_theta=Infinity (float), expected a positive finite number"),
    ({"rope_scaling": "yarn"}, 'rope_scaling="yarn" (str), expected an object'),
    ({"rope_scaling": {**_YARN, "factor": "40"}}, 'rope_scaling.factor="40" (str), expected a positive'),
    ({"rope_scaling": {**_YARN, "factor": 0}}, "rope_scaling.factor=0 (int), expected a positive"),
    ({"rope_scaling": {**_YARN, "factor": True}}, "rope_scaling.factor=true (bool)"),
    ({"rope_scaling": {**_YARN, "rope_theta": -1.0}}, "rope_scaling.rope_theta=-1.0 (float)"),
    ({"rope_scaling": {**_YARN, "original_max_position_embeddings": 4096.0}},
     "rope_scaling.original_max_position_embeddings=4096.0 (float), expected a positive integer or null"),
    ({"rope_scaling": {**_YARN, "beta_fast": "32"}}, 'rope_scaling.beta_fast="32" (str)'),
    ({"rope_scaling": {**_YARN, "mscale_all_dim": -1}}, "rope_scaling.mscale_all_dim=-1 (int)"),
    ({"rope_scaling": {**_YARN, "truncate": "yes"}}, 'rope_scaling.truncate="yes" (str), expected true or false'),
    ({"rope_scaling": {**_YARN, "type": 3}}, "rope_scaling.type=3 (int), expected a string"),
    ({"rope_scaling": None, "rope_parameters": {"rope_type": "default", "rope_theta": 0}},
     "rope_parameters.rope_theta=0 (int), expected a positive finite number"),
    ({"rope_scaling": None, "rope_parameters": ["yarn"]}, 'rope_parameters=["yarn"] (list), expected an object'),
    ({"original_max_position_embeddings": "4096"}, 'original_max_position_embeddings="4096" (str)'),
    ({"moe_layer_freq": True}, "moe_layer_freq=true (bool), expected a positive integer"),
    ({"num_key_value_heads": "128"}, 'num_key_value_heads="128" (str), expected a positive integer'),
    ({"qk_head_dim": 128}, "qk_head_dim=128 differs from qk_nope_head_dim + qk_rope_head_dim = 128 + 64"),
    ({"architectures": ARCHITECTURE}, 'architectures="DeepseekV3ForCausalLM" (str), expected a list'),
    ({"moe_sparsity_config": "prune"}, 'moe_sparsity_config="prune" (str), expected an object'),
])
def test_bad_values_are_refused_naming_the_key(overrides, expected):
    with pytest.raises(ConfigError, match=re.escape(expected)) as e:
        DeepseekV3Config.from_dict({**PRESETS["deepseek-v3"], **overrides}, source="x/config.json")
    assert str(e.value).startswith("x/config.json: ")


_CHECKED_FIELDS = [f.name for f in dataclasses.fields(DeepseekV3Config)
                   if f.name not in ("rope", "raw", "layer_num_experts")]


@pytest.mark.parametrize("key", _CHECKED_FIELDS)
def test_every_field_is_checked(key):
    """A string where the field wants a number or a boolean is refused, naming the key."""
    with pytest.raises(ConfigError, match=re.escape(f'{key}="x" (str), expected ')):
        DeepseekV3Config.from_dict({**PRESETS["deepseek-v3"], key: "x"})
    with pytest.raises(ConfigError, match=re.escape(f'{key}="x" (str), expected ')):
        DeepseekV3Config(**{key: "x"}).validate()


def test_several_problems_reported_together(tmp_path):
    d = {**PRESETS["deepseek-v3"], "n_routed_experts": "8", "rms_norm_eps": -1, "norm_topk_prob": "yes",
         "num_nextn_predict_layers": 1.0, "topk_group": 9, "scoring_func": "softmax",
         "rope_scaling": {**_YARN, "factor": "40"}}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(d))
    with pytest.raises(ConfigError) as e:
        DeepseekV3Config.from_json_file(path)
    message = str(e.value)
    assert message.startswith(f"{path}: ")
    for part in ('n_routed_experts="8" (str), expected a positive integer',
                 "rms_norm_eps=-1 (int), expected a positive finite number",
                 'norm_topk_prob="yes" (str), expected true or false',
                 "num_nextn_predict_layers=1.0 (float), expected a non-negative integer",
                 "topk_group=9 must lie in [1, n_group=8]",
                 'rope_scaling.factor="40" (str)',
                 "not implemented: scoring_func='softmax'"):
        assert part in message
    assert "\n" not in message and message.count(str(path)) == 1


def test_top_level_json_list_is_refused(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps([PRESETS["deepseek-v3"]]))
    with pytest.raises(ConfigError, match=re.escape(f"{path}: expected a JSON object")):
        DeepseekV3Config.from_json_file(path)
    with pytest.raises(ConfigError, match="expected a JSON object"):
        DeepseekV3Config.from_dict("deepseek_v3")


def test_unreadable_config_files_are_refused_naming_the_path(tmp_path):
    path = tmp_path / "config.json"
    path.write_bytes(json.dumps(PRESETS["deepseek-v3"]).encode()[:-1] + b', "name": "caf\xe9"}')
    with pytest.raises(ConfigError, match=re.escape(f"{path}: not UTF-8")):
        DeepseekV3Config.from_json_file(path)
    folder = tmp_path / "folder.json"
    folder.mkdir()
    with pytest.raises(ConfigError, match=re.escape(f"{folder}: cannot read")):
        DeepseekV3Config.from_json_file(folder)
    path.write_text(json.dumps(PRESETS["deepseek-v3"])[:-1] + ', "n_routed_experts": 8}')
    with pytest.raises(ConfigError, match=re.escape(f"{path}: key(s) ['n_routed_experts'] given more than once")):
        DeepseekV3Config.from_json_file(path)


def test_num_nextn_predict_layers_is_read():
    assert DeepseekV3Config.from_dict(PRESETS["deepseek-v3"]).num_nextn_predict_layers == 1
    assert DeepseekV3Config.from_dict(PRESETS["kimi-k2"]).num_nextn_predict_layers == 0
    d = {k: v for k, v in PRESETS["deepseek-v3"].items() if k != "num_nextn_predict_layers"}
    assert DeepseekV3Config.from_dict(d).num_nextn_predict_layers == 0
    assert DeepseekV3Config.from_dict({**d, "num_nextn_predict_layers": 2}).num_nextn_predict_layers == 2
    with pytest.raises(ConfigError, match=re.escape("num_nextn_predict_layers=-1 (int)")):
        DeepseekV3Config.from_dict({**d, "num_nextn_predict_layers": -1})
    cfg = DeepseekV3Config.from_dict(PRESETS["deepseek-v3"])
    assert cfg.experts_in_layer(61) == 256   # the MTP layer
    with pytest.raises(ConfigError, match=re.escape("layer=62; expected an integer in [0, 62)")):
        cfg.experts_in_layer(62)


def _small(**overrides) -> dict:
    """A 4-layer config (layer 0 dense), optionally with one MTP layer."""
    return {**PRESETS["moonlight-16b-a3b"], "num_hidden_layers": 4, "first_k_dense_replace": 1,
            "n_routed_experts": 8, "num_experts_per_tok": 2, **overrides}


def test_experts_in_layer_with_a_per_layer_pruned_config(tmp_path):
    d = _small(moe_sparsity_config={"method": "prune", "num_experts": [None, 8, 6, 4]})
    with pytest.raises(ConfigError, match=re.escape("moe_sparsity_config.num_experts gives layers different "
                                                    "expert counts [4, 6, 8]")):
        DeepseekV3Config.from_dict(d)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(d))
    with pytest.raises(ConfigError, match="not implemented: moe_sparsity_config"):
        DeepseekV3Config.from_json_file(path)
    for cfg in (DeepseekV3Config.from_dict(d, uniform_experts=False),
                DeepseekV3Config.from_json_file(path, uniform_experts=False)):
        assert [cfg.experts_in_layer(l) for l in range(4)] == [0, 8, 6, 4]
        assert cfg.n_routed_experts == 8 and cfg.layer_num_experts == (None, 8, 6, 4)
        with pytest.raises(ConfigError, match="expected an integer in"):
            cfg.experts_in_layer(4)
        assert DeepseekV3Config.from_dict(cfg.to_dict(), uniform_experts=False) == cfg
        written = dataclasses.replace(cfg, raw={}).to_dict()  # written from the fields
        assert DeepseekV3Config.from_dict(written, uniform_experts=False) == cfg
    # the MTP layer: listed, or not listed (n_routed_experts)
    listed = DeepseekV3Config.from_dict(
        _small(num_nextn_predict_layers=1, moe_sparsity_config={"num_experts": [None, 8, 6, 4, 5]}),
        uniform_experts=False)
    assert [listed.experts_in_layer(l) for l in range(5)] == [0, 8, 6, 4, 5]
    unlisted = DeepseekV3Config.from_dict({**d, "num_nextn_predict_layers": 1}, uniform_experts=False)
    assert unlisted.experts_in_layer(4) == 8
    # no per-layer counts: every MoE layer has n_routed_experts; a uniform list equal to it is accepted
    plain = DeepseekV3Config.from_dict(_small())
    assert [plain.experts_in_layer(l) for l in range(4)] == [0, 8, 8, 8] and plain.layer_num_experts is None
    uniform = DeepseekV3Config.from_dict(_small(moe_sparsity_config={"num_experts": [None, 8, 8, 8]}))
    assert [uniform.experts_in_layer(l) for l in range(4)] == [0, 8, 8, 8]


@pytest.mark.parametrize("counts,expected", [
    ([None, 8, 6], "moe_sparsity_config.num_experts has 3 entries, expected 4"),
    ([None, 8, 6, 4, 4], "moe_sparsity_config.num_experts has 5 entries, expected 4"),
    ([None, 8, None, 4], "moe_sparsity_config.num_experts[2]=null, but layer 2 is a MoE layer"),
    ([8, 8, 6, 4], "moe_sparsity_config.num_experts[0]=8, but layer 0 is dense"),
    ([None, 8, 9, 4], "moe_sparsity_config.num_experts[2]=9 exceeds n_routed_experts=8"),
    ([None, 8, "6", 4], 'moe_sparsity_config.num_experts[2]="6" (str), expected a positive integer'),
    ([None, 8, 6.0, 4], "moe_sparsity_config.num_experts[2]=6.0 (float)"),
    ([None, 8, 0, 4], "moe_sparsity_config.num_experts[2]=0 (int)"),
    ([None, 8, True, 4], "moe_sparsity_config.num_experts[2]=true (bool)"),
    ({"1": 8}, 'moe_sparsity_config.num_experts={"1": 8} (dict), expected a list'),
])
def test_bad_per_layer_expert_counts_are_refused(counts, expected):
    with pytest.raises(ConfigError, match=re.escape(expected)):
        DeepseekV3Config.from_dict(_small(moe_sparsity_config={"num_experts": counts}), uniform_experts=False)


def test_uniform_per_layer_counts_must_match_n_routed_experts():
    with pytest.raises(ConfigError, match=re.escape("gives every MoE layer 6 experts but n_routed_experts=8")):
        DeepseekV3Config.from_dict(_small(moe_sparsity_config={"num_experts": [None, 6, 6, 6]}))


def test_validate_reports_every_problem_of_a_constructed_config():
    with pytest.raises(ConfigError) as e:
        DeepseekV3Config(n_routed_experts="8", norm_topk_prob=None, n_group=3, topk_group=0).validate("made")
    message = str(e.value)
    assert message.startswith("made: ")
    for part in ('n_routed_experts="8" (str)', "norm_topk_prob=null (NoneType)", "topk_group=0 (int)"):
        assert part in message

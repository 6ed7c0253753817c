"""The one table between Hugging Face tensor names and moejax parameters, used in both directions.

Each rule says: this HF tensor (name template) is that parameter (attribute path in the NNX
module tree), stored transposed or not, one slice of a stacked [E, ...] parameter or whole, and
in which layers it exists. `tensor_specs(cfg, shapes)` expands the rules into one `TensorSpec` per
HF tensor, which loading, saving, shape checks and parameter counting all walk.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from moejax.models.deepseek_v3.config import DeepseekV3Config


@dataclasses.dataclass(frozen=True)
class Rule:
    hf: str                       # "model.layers.{l}.mlp.experts.{e}.gate_proj.weight"
    param: str                    # "model.layers.{l}.mlp.experts_gate"
    transpose: bool               # HF stores torch Linear weights [out, in]; moejax [in, out]
    when: Callable[[DeepseekV3Config, int], bool] = lambda cfg, layer: True
    per_expert: bool = False      # HF has one tensor per expert; the parameter stacks them on axis 0


def _q_lora(cfg, l):
    return cfg.q_lora_rank is not None


def _dense(cfg, l):
    return not cfg.is_moe_layer(l)


def _moe(cfg, l):
    return cfg.is_moe_layer(l)


def _bias(pred=lambda cfg, l: True):
    return lambda cfg, l: cfg.attention_bias and pred(cfg, l)


GLOBAL_RULES = (
    Rule("model.embed_tokens.weight", "model.embed_tokens", False),
    Rule("model.norm.weight", "model.norm.weight", False),
    Rule("lm_head.weight", "lm_head", True, when=lambda cfg, l: not cfg.tie_word_embeddings),
)

_L = "model.layers.{l}."
LAYER_RULES = (
    Rule(_L + "input_layernorm.weight", _L + "input_layernorm.weight", False),
    Rule(_L + "post_attention_layernorm.weight", _L + "post_attention_layernorm.weight", False),
    Rule(_L + "self_attn.q_proj.weight", _L + "self_attn.q_proj", True, when=lambda cfg, l: not _q_lora(cfg, l)),
    Rule(_L + "self_attn.q_a_proj.weight", _L + "self_attn.q_a_proj", True, when=_q_lora),
    Rule(_L + "self_attn.q_a_proj.bias", _L + "self_attn.q_a_proj_bias", False, when=_bias(_q_lora)),
    Rule(_L + "self_attn.q_a_layernorm.weight", _L + "self_attn.q_a_layernorm.weight", False, when=_q_lora),
    Rule(_L + "self_attn.q_b_proj.weight", _L + "self_attn.q_b_proj", True, when=_q_lora),
    Rule(_L + "self_attn.kv_a_proj_with_mqa.weight", _L + "self_attn.kv_a_proj_with_mqa", True),
    Rule(_L + "self_attn.kv_a_proj_with_mqa.bias", _L + "self_attn.kv_a_proj_with_mqa_bias", False, when=_bias()),
    Rule(_L + "self_attn.kv_a_layernorm.weight", _L + "self_attn.kv_a_layernorm.weight", False),
    Rule(_L + "self_attn.kv_b_proj.weight", _L + "self_attn.kv_b_proj", True),
    Rule(_L + "self_attn.o_proj.weight", _L + "self_attn.o_proj", True),
    Rule(_L + "self_attn.o_proj.bias", _L + "self_attn.o_proj_bias", False, when=_bias()),
    Rule(_L + "mlp.gate_proj.weight", _L + "mlp.gate_proj", True, when=_dense),
    Rule(_L + "mlp.up_proj.weight", _L + "mlp.up_proj", True, when=_dense),
    Rule(_L + "mlp.down_proj.weight", _L + "mlp.down_proj", True, when=_dense),
    Rule(_L + "mlp.gate.weight", _L + "mlp.router", False, when=_moe),
    Rule(_L + "mlp.gate.e_score_correction_bias", _L + "mlp.bias", False, when=_moe),
    Rule(_L + "mlp.experts.{e}.gate_proj.weight", _L + "mlp.experts_gate", True, when=_moe, per_expert=True),
    Rule(_L + "mlp.experts.{e}.up_proj.weight", _L + "mlp.experts_up", True, when=_moe, per_expert=True),
    Rule(_L + "mlp.experts.{e}.down_proj.weight", _L + "mlp.experts_down", True, when=_moe, per_expert=True),
    Rule(_L + "mlp.shared_experts.gate_proj.weight", _L + "mlp.shared_experts.gate_proj", True,
         when=lambda cfg, l: _moe(cfg, l) and cfg.n_shared_experts > 0),
    Rule(_L + "mlp.shared_experts.up_proj.weight", _L + "mlp.shared_experts.up_proj", True,
         when=lambda cfg, l: _moe(cfg, l) and cfg.n_shared_experts > 0),
    Rule(_L + "mlp.shared_experts.down_proj.weight", _L + "mlp.shared_experts.down_proj", True,
         when=lambda cfg, l: _moe(cfg, l) and cfg.n_shared_experts > 0),
)


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    hf_name: str
    param: str                    # dotted attribute path
    transpose: bool
    expert: int | None            # index into the stacked parameter, or None
    hf_shape: tuple               # the shape the HF tensor must have


def tensor_specs(cfg: DeepseekV3Config, param_shapes: dict[str, tuple]) -> list[TensorSpec]:
    """Every HF tensor of a checkpoint of `cfg`, in file order (layers ascending).

    param_shapes: dotted parameter path -> shape (from `param_shapes(model)`)."""
    specs = []

    def add(rule: Rule, layer: int | None, expert: int | None):
        fmt = {"l": layer, "e": expert}
        path = rule.param.format(**fmt)
        shape = tuple(param_shapes[path])
        if rule.per_expert:
            shape = shape[1:]
        hf_shape = shape[::-1] if rule.transpose else shape
        specs.append(TensorSpec(rule.hf.format(**fmt), path, rule.transpose, expert, hf_shape))

    for rule in GLOBAL_RULES[:2]:
        add(rule, None, None)
    for layer in range(cfg.num_hidden_layers):
        for rule in LAYER_RULES:
            if not rule.when(cfg, layer):
                continue
            for expert in (range(cfg.n_routed_experts) if rule.per_expert else [None]):
                add(rule, layer, expert)
    if GLOBAL_RULES[2].when(cfg, 0):
        add(GLOBAL_RULES[2], None, None)
    return specs


def param_shapes(module) -> dict[str, tuple]:
    """Dotted path -> shape of every nnx.Param / Variable array in the module tree."""
    from flax import nnx

    out = {}
    for path, var in nnx.to_flat_state(nnx.state(module)):
        out[".".join(str(p) for p in path)] = tuple(var.shape if hasattr(var, "shape") else var.value.shape)
    return out


def get_path(module, path: str):
    """The Variable at a dotted path (integers index lists)."""
    obj = module
    for part in path.split("."):
        obj = obj[int(part)] if part.isdigit() else getattr(obj, part)
    return obj

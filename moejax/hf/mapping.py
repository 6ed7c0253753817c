"""The one table between Hugging Face tensor names and moejax parameters, used in both directions.

Each rule says: this HF tensor (name template) is that parameter (attribute path in the NNX
module tree), stored transposed or not, one slice of a stacked [E, ...] parameter or whole, and
in which layers it exists. `tensor_specs(cfg)` expands the rules into one `TensorSpec` per
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
    shape: Callable[[DeepseekV3Config], tuple]  # the HF tensor's shape ([out, in] for a Linear weight)
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


def _heads(width):
    return lambda cfg: cfg.num_attention_heads * width(cfg)


_H = lambda cfg: cfg.hidden_size  # noqa: E731
_Q_HEADS = _heads(lambda cfg: cfg.qk_head_dim)
_KV_A = lambda cfg: cfg.kv_lora_rank + cfg.qk_rope_head_dim  # noqa: E731
_SHARED = lambda cfg: cfg.moe_intermediate_size * cfg.n_shared_experts  # noqa: E731


def _shared(cfg, l):
    return _moe(cfg, l) and cfg.n_shared_experts > 0


GLOBAL_RULES = (
    Rule("model.embed_tokens.weight", "model.embed_tokens", False, lambda cfg: (cfg.vocab_size, _H(cfg))),
    Rule("model.norm.weight", "model.norm.weight", False, lambda cfg: (_H(cfg),)),
    Rule("lm_head.weight", "lm_head", True, lambda cfg: (cfg.vocab_size, _H(cfg)),
         when=lambda cfg, l: not cfg.tie_word_embeddings),
)

_L = "model.layers.{l}."
LAYER_RULES = (
    Rule(_L + "input_layernorm.weight", _L + "input_layernorm.weight", False, lambda cfg: (_H(cfg),)),
    Rule(_L + "post_attention_layernorm.weight", _L + "post_attention_layernorm.weight", False,
         lambda cfg: (_H(cfg),)),
    Rule(_L + "self_attn.q_proj.weight", _L + "self_attn.q_proj", True, lambda cfg: (_Q_HEADS(cfg), _H(cfg)),
         when=lambda cfg, l: not _q_lora(cfg, l)),
    Rule(_L + "self_attn.q_a_proj.weight", _L + "self_attn.q_a_proj", True, lambda cfg: (cfg.q_lora_rank, _H(cfg)),
         when=_q_lora),
    Rule(_L + "self_attn.q_a_proj.bias", _L + "self_attn.q_a_proj_bias", False, lambda cfg: (cfg.q_lora_rank,),
         when=_bias(_q_lora)),
    Rule(_L + "self_attn.q_a_layernorm.weight", _L + "self_attn.q_a_layernorm.weight", False,
         lambda cfg: (cfg.q_lora_rank,), when=_q_lora),
    Rule(_L + "self_attn.q_b_proj.weight", _L + "self_attn.q_b_proj", True,
         lambda cfg: (_Q_HEADS(cfg), cfg.q_lora_rank), when=_q_lora),
    Rule(_L + "self_attn.kv_a_proj_with_mqa.weight", _L + "self_attn.kv_a_proj_with_mqa", True,
         lambda cfg: (_KV_A(cfg), _H(cfg))),
    Rule(_L + "self_attn.kv_a_proj_with_mqa.bias", _L + "self_attn.kv_a_proj_with_mqa_bias", False,
         lambda cfg: (_KV_A(cfg),), when=_bias()),
    Rule(_L + "self_attn.kv_a_layernorm.weight", _L + "self_attn.kv_a_layernorm.weight", False,
         lambda cfg: (cfg.kv_lora_rank,)),
    Rule(_L + "self_attn.kv_b_proj.weight", _L + "self_attn.kv_b_proj", True,
         lambda cfg: (_heads(lambda c: c.qk_nope_head_dim + c.v_head_dim)(cfg), cfg.kv_lora_rank)),
    Rule(_L + "self_attn.o_proj.weight", _L + "self_attn.o_proj", True,
         lambda cfg: (_H(cfg), _heads(lambda c: c.v_head_dim)(cfg))),
    Rule(_L + "self_attn.o_proj.bias", _L + "self_attn.o_proj_bias", False, lambda cfg: (_H(cfg),), when=_bias()),
    Rule(_L + "mlp.gate_proj.weight", _L + "mlp.gate_proj", True, lambda cfg: (cfg.intermediate_size, _H(cfg)),
         when=_dense),
    Rule(_L + "mlp.up_proj.weight", _L + "mlp.up_proj", True, lambda cfg: (cfg.intermediate_size, _H(cfg)),
         when=_dense),
    Rule(_L + "mlp.down_proj.weight", _L + "mlp.down_proj", True, lambda cfg: (_H(cfg), cfg.intermediate_size),
         when=_dense),
    # Router rows and bias entries: one per routed expert of the layer (filled in by tensor_specs).
    Rule(_L + "mlp.gate.weight", _L + "mlp.router", False, lambda cfg: (None, _H(cfg)), when=_moe),
    Rule(_L + "mlp.gate.e_score_correction_bias", _L + "mlp.bias", False, lambda cfg: (None,), when=_moe),
    Rule(_L + "mlp.experts.{e}.gate_proj.weight", _L + "mlp.experts_gate", True,
         lambda cfg: (cfg.moe_intermediate_size, _H(cfg)), when=_moe, per_expert=True),
    Rule(_L + "mlp.experts.{e}.up_proj.weight", _L + "mlp.experts_up", True,
         lambda cfg: (cfg.moe_intermediate_size, _H(cfg)), when=_moe, per_expert=True),
    Rule(_L + "mlp.experts.{e}.down_proj.weight", _L + "mlp.experts_down", True,
         lambda cfg: (_H(cfg), cfg.moe_intermediate_size), when=_moe, per_expert=True),
    Rule(_L + "mlp.shared_experts.gate_proj.weight", _L + "mlp.shared_experts.gate_proj", True,
         lambda cfg: (_SHARED(cfg), _H(cfg)), when=_shared),
    Rule(_L + "mlp.shared_experts.up_proj.weight", _L + "mlp.shared_experts.up_proj", True,
         lambda cfg: (_SHARED(cfg), _H(cfg)), when=_shared),
    Rule(_L + "mlp.shared_experts.down_proj.weight", _L + "mlp.shared_experts.down_proj", True,
         lambda cfg: (_H(cfg), _SHARED(cfg)), when=_shared),
)


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    hf_name: str
    param: str                    # dotted attribute path
    transpose: bool
    expert: int | None            # index into the stacked parameter, or None
    hf_shape: tuple               # the shape the HF tensor must have


def tensor_specs(cfg: DeepseekV3Config) -> list[TensorSpec]:
    """Every HF tensor of a checkpoint of `cfg`, in file order (layers ascending), with the shape
    the config implies. Needs no model (so checkpoint tools stay free of JAX); a test checks these
    shapes against the NNX model's parameters. A per-layer expert count (a checkpoint pruned per
    layer, `cfg.experts_in_layer`) gives that layer's router, bias and expert tensors."""
    specs = []

    def add(rule: Rule):  # a global tensor: no layer, no expert
        specs.append(TensorSpec(rule.hf, rule.param, rule.transpose, None, tuple(rule.shape(cfg))))

    for rule in GLOBAL_RULES[:2]:
        add(rule)
    for layer in range(cfg.num_hidden_layers):
        specs += layer_specs(cfg, layer)
    if GLOBAL_RULES[2].when(cfg, 0):
        add(GLOBAL_RULES[2])
    return specs


def layer_specs(cfg: DeepseekV3Config, layer: int) -> list[TensorSpec]:
    """The decoder-layer tensors of layer `layer` (an MTP layer's decoder block included)."""
    specs = []
    for rule in LAYER_RULES:
        if not rule.when(cfg, layer):
            continue
        for expert in (range(cfg.experts_in_layer(layer)) if rule.per_expert else [None]):
            fmt = {"l": layer, "e": expert}
            shape = tuple(cfg.experts_in_layer(layer) if dim is None else dim for dim in rule.shape(cfg))
            specs.append(TensorSpec(rule.hf.format(**fmt), rule.param.format(**fmt), rule.transpose, expert, shape))
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

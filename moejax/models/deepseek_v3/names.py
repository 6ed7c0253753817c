"""DeepSeek-V3's HF name table: MLA attention (with or without a q LoRA, optional biases), dense
first layers, sigmoid router with balance bias, routed and shared experts."""

from __future__ import annotations

from moejax.models.names import (L, Rule, check_table, dense_mlp_rules, embedding_rules, moe_rules, mtp_rules,
                                 norm_rules)


def _q_lora(cfg, layer):
    return cfg.q_lora_rank is not None


def _bias(pred=lambda cfg, layer: True):
    return lambda cfg, layer: cfg.attention_bias and pred(cfg, layer)


def _heads(width):
    return lambda cfg: cfg.num_attention_heads * width(cfg)


_H = lambda cfg: cfg.hidden_size  # noqa: E731
_Q_HEADS = _heads(lambda cfg: cfg.qk_head_dim)
_KV_A = lambda cfg: cfg.kv_lora_rank + cfg.qk_rope_head_dim  # noqa: E731
_A = L + "self_attn."

_ATTENTION = (
    Rule("q_proj", _A + "q_proj.weight", _A + "q_proj", True, lambda cfg: (_Q_HEADS(cfg), _H(cfg)),
         when=lambda cfg, l: not _q_lora(cfg, l)),
    Rule("q_a_proj", _A + "q_a_proj.weight", _A + "q_a_proj", True, lambda cfg: (cfg.q_lora_rank, _H(cfg)),
         when=_q_lora),
    Rule("q_a_proj_bias", _A + "q_a_proj.bias", _A + "q_a_proj_bias", False, lambda cfg: (cfg.q_lora_rank,),
         when=_bias(_q_lora)),
    Rule("q_a_layernorm", _A + "q_a_layernorm.weight", _A + "q_a_layernorm.weight", False,
         lambda cfg: (cfg.q_lora_rank,), when=_q_lora),
    Rule("q_b_proj", _A + "q_b_proj.weight", _A + "q_b_proj", True, lambda cfg: (_Q_HEADS(cfg), cfg.q_lora_rank),
         when=_q_lora),
    Rule("kv_a_proj_with_mqa", _A + "kv_a_proj_with_mqa.weight", _A + "kv_a_proj_with_mqa", True,
         lambda cfg: (_KV_A(cfg), _H(cfg))),
    Rule("kv_a_proj_with_mqa_bias", _A + "kv_a_proj_with_mqa.bias", _A + "kv_a_proj_with_mqa_bias", False,
         lambda cfg: (_KV_A(cfg),), when=_bias()),
    Rule("kv_a_layernorm", _A + "kv_a_layernorm.weight", _A + "kv_a_layernorm.weight", False,
         lambda cfg: (cfg.kv_lora_rank,)),
    Rule("kv_b_proj", _A + "kv_b_proj.weight", _A + "kv_b_proj", True,
         lambda cfg: (_heads(lambda c: c.qk_nope_head_dim + c.v_head_dim)(cfg), cfg.kv_lora_rank)),
    Rule("o_proj", _A + "o_proj.weight", _A + "o_proj", True, lambda cfg: (_H(cfg), _heads(lambda c: c.v_head_dim)(cfg))),
    Rule("o_proj_bias", _A + "o_proj.bias", _A + "o_proj_bias", False, lambda cfg: (_H(cfg),), when=_bias()),
)

RULES = check_table(
    embedding_rules() + norm_rules() + _ATTENTION + dense_mlp_rules()
    + moe_rules(balance_bias=True, shared=lambda cfg: cfg.moe_intermediate_size * cfg.n_shared_experts) + mtp_rules())

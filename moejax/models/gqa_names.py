"""HF names of grouped-query attention (q/k/v/o projections, optional biases and q/k norms), shared
by the GQA families' name tables."""

from __future__ import annotations

from moejax.models.names import L, Rule

_A = L + "self_attn."


def _q(cfg):
    return cfg.num_attention_heads * cfg.resolved_head_dim


def _kv(cfg):
    return cfg.num_key_value_heads * cfg.resolved_head_dim


def _norm_width(full, per_head):
    return lambda cfg: (full(cfg),) if cfg.qk_norm == "full" else (per_head(cfg),)


def _q_proj(cfg):  # with an output gate (Qwen3-Next) q_proj gives each head's query and gate
    return _q(cfg) * (2 if cfg.attention_output_gate else 1)


def gqa_rules(when=lambda cfg, layer: True) -> tuple:
    """when(cfg, layer): the layers with this attention (a hybrid family's full-attention layers)."""
    qkv_bias = lambda cfg, layer: when(cfg, layer) and cfg.qkv_bias  # noqa: E731
    qk_norm = lambda cfg, layer: when(cfg, layer) and cfg.qk_norm is not None  # noqa: E731
    return (
        Rule("q_proj", _A + "q_proj.weight", _A + "q_proj", True, lambda cfg: (_q_proj(cfg), cfg.hidden_size),
             when=when),
        Rule("q_proj_bias", _A + "q_proj.bias", _A + "q_proj_bias", False, lambda cfg: (_q_proj(cfg),),
             when=qkv_bias),
        Rule("k_proj", _A + "k_proj.weight", _A + "k_proj", True, lambda cfg: (_kv(cfg), cfg.hidden_size), when=when),
        Rule("k_proj_bias", _A + "k_proj.bias", _A + "k_proj_bias", False, lambda cfg: (_kv(cfg),), when=qkv_bias),
        Rule("v_proj", _A + "v_proj.weight", _A + "v_proj", True, lambda cfg: (_kv(cfg), cfg.hidden_size), when=when),
        Rule("v_proj_bias", _A + "v_proj.bias", _A + "v_proj_bias", False, lambda cfg: (_kv(cfg),), when=qkv_bias),
        Rule("o_proj", _A + "o_proj.weight", _A + "o_proj", True, lambda cfg: (cfg.hidden_size, _q(cfg)), when=when),
        Rule("o_proj_bias", _A + "o_proj.bias", _A + "o_proj_bias", False, lambda cfg: (cfg.hidden_size,),
             when=lambda cfg, layer: when(cfg, layer) and cfg.o_bias),
        Rule("q_norm", _A + "q_norm.weight", _A + "q_norm.weight", False,
             _norm_width(_q, lambda cfg: cfg.resolved_head_dim), when=qk_norm),
        Rule("k_norm", _A + "k_norm.weight", _A + "k_norm.weight", False,
             _norm_width(_kv, lambda cfg: cfg.resolved_head_dim), when=qk_norm),
    )

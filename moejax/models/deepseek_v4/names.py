"""DeepSeek-V4's HF name table, in the Hub's spelling (DeepSeek's own names, which transformers 5.24
renames on load through its `conversion_mapping` "deepseek_v4" entry and writes back with
`save_original_format`; the Hub's have no `model.` prefix):

    embed.weight, norm.weight, head.weight, hc_head_{fn,base,scale}
    layers.{l}.attn_norm.weight, ffn_norm.weight                  the two RMSNorms
    layers.{l}.hc_{attn,ffn}_{fn,base,scale}                      the two hyper-connections
    layers.{l}.attn.{wq_a, q_norm, wq_b, wkv, norm, wo_a, wo_b, attn_sink}
    layers.{l}.attn.compressor.{wkv, wgate, ape, norm}            CSA and HCA layers
    layers.{l}.attn.indexer.{wq_b, weights_proj}, attn.indexer.compressor.{wkv, wgate, ape, norm}   CSA
    layers.{l}.ffn.gate.weight, ffn.gate.bias (the balance bias; `moe` layers), ffn.gate.tid2eid
    (`hash_moe` layers, int64 [vocab, top_k]), ffn.experts.{e}.{w1,w3,w2}, ffn.shared_experts.{w1,w3,w2}

Linear weights are stored [out, in] and transposed to moejax's [in, out]. The MTP block (`mtp.*`) is
carried (`DeepseekV4Config.CARRIED_PREFIXES`)."""

from __future__ import annotations

from moejax.models.names import Rule, check_table, swiglu_rules

L = "layers.{l}."
P = "model.layers.{l}."
_A, _PA = L + "attn.", P + "self_attn."


def _kind(*kinds):
    return lambda cfg, layer: cfg.attention_type(layer) in kinds


_COMPRESSED = _kind("compressed_sparse_attention", "heavily_compressed_attention")
_CSA = _kind("compressed_sparse_attention")


def _hashed(cfg, layer):
    return cfg.is_hash_layer(layer)


def _routed(cfg, layer):
    return not cfg.is_hash_layer(layer)


def _hc_rules(which: str) -> tuple:
    """A hyper-connection's mapping: fn [(2 + n) n, n H] (transposed), base [(2 + n) n], scale [3]."""
    width = lambda cfg: (2 + cfg.hc_mult) * cfg.hc_mult  # noqa: E731
    return (
        Rule(f"hc_{which}_fn", L + f"hc_{which}_fn", P + f"{which}_hc.fn", True,
             lambda cfg: (width(cfg), cfg.hc_mult * cfg.hidden_size)),
        Rule(f"hc_{which}_base", L + f"hc_{which}_base", P + f"{which}_hc.base", False, lambda cfg: (width(cfg),)),
        Rule(f"hc_{which}_scale", L + f"hc_{which}_scale", P + f"{which}_hc.scale", False, lambda cfg: (3,)),
    )


def _compressor_rules(prefix: str, hf: str, param: str, width, when) -> tuple:
    """A compressor's kv and gate projections [series * width, H], its position bias [m, series *
    width] and RMSNorm [width] (the outer compressor at head_dim, the indexer's at index_head_dim)."""
    return (
        Rule(prefix + "wkv", hf + "wkv.weight", param + "kv_proj", True,
             lambda cfg: (2 * width(cfg), cfg.hidden_size), when=when),
        Rule(prefix + "wgate", hf + "wgate.weight", param + "gate_proj", True,
             lambda cfg: (2 * width(cfg), cfg.hidden_size), when=when),
        Rule(prefix + "ape", hf + "ape", param + "position_bias", False,
             lambda cfg: (cfg.rates[0], 2 * width(cfg)), when=when),
        Rule(prefix + "norm", hf + "norm.weight", param + "kv_norm.weight", False, lambda cfg: (width(cfg),),
             when=when),
    )


def _hca_compressor_rules() -> tuple:
    """HCA's compressor: one series ([head_dim, H] projections, [m', head_dim] position bias)."""
    hf, param, when = _A + "compressor.", _PA + "compressor.", _kind("heavily_compressed_attention")
    return (
        Rule("hca_wkv", hf + "wkv.weight", param + "kv_proj", True, lambda cfg: (cfg.head_dim, cfg.hidden_size),
             when=when),
        Rule("hca_wgate", hf + "wgate.weight", param + "gate_proj", True, lambda cfg: (cfg.head_dim, cfg.hidden_size),
             when=when),
        Rule("hca_ape", hf + "ape", param + "position_bias", False, lambda cfg: (cfg.rates[1], cfg.head_dim),
             when=when),
        Rule("hca_norm", hf + "norm.weight", param + "kv_norm.weight", False, lambda cfg: (cfg.head_dim,), when=when),
    )


_HEADS = lambda cfg: cfg.num_attention_heads * cfg.head_dim  # noqa: E731
_O = lambda cfg: cfg.o_groups * cfg.o_lora_rank  # noqa: E731
_H = lambda cfg: cfg.hidden_size  # noqa: E731

_ATTENTION = (
    Rule("q_a_proj", _A + "wq_a.weight", _PA + "q_a_proj", True, lambda cfg: (cfg.q_lora_rank, _H(cfg))),
    Rule("q_a_norm", _A + "q_norm.weight", _PA + "q_a_norm.weight", False, lambda cfg: (cfg.q_lora_rank,)),
    Rule("q_b_proj", _A + "wq_b.weight", _PA + "q_b_proj", True, lambda cfg: (_HEADS(cfg), cfg.q_lora_rank)),
    Rule("kv_proj", _A + "wkv.weight", _PA + "kv_proj", True, lambda cfg: (cfg.head_dim, _H(cfg))),
    Rule("kv_norm", _A + "norm.weight", _PA + "kv_norm.weight", False, lambda cfg: (cfg.head_dim,)),
    Rule("o_a_proj", _A + "wo_a.weight", _PA + "o_a_proj", True, lambda cfg: (_O(cfg), _HEADS(cfg) // cfg.o_groups)),
    Rule("o_b_proj", _A + "wo_b.weight", _PA + "o_b_proj", True, lambda cfg: (_H(cfg), _O(cfg))),
    Rule("sinks", _A + "attn_sink", _PA + "sinks", False, lambda cfg: (cfg.num_attention_heads,)),
) + _compressor_rules("csa_", _A + "compressor.", _PA + "compressor.", lambda cfg: cfg.head_dim, _CSA) \
  + _hca_compressor_rules() \
  + _compressor_rules("indexer_", _A + "indexer.compressor.", _PA + "indexer.", lambda cfg: cfg.index_head_dim, _CSA) + (
    Rule("indexer_wq_b", _A + "indexer.wq_b.weight", _PA + "indexer.q_b_proj", True,
         lambda cfg: (cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank), when=_CSA),
    Rule("indexer_weights_proj", _A + "indexer.weights_proj.weight", _PA + "indexer.weights_proj", True,
         lambda cfg: (cfg.index_n_heads, _H(cfg)), when=_CSA),
)

_M, _PM = L + "ffn.", P + "mlp."

_MOE = (
    Rule("router", _M + "gate.weight", _PM + "router", False, lambda cfg: (None, _H(cfg))),
    Rule("balance_bias", _M + "gate.bias", _PM + "bias", False, lambda cfg: (None,), when=_routed),
    Rule("tid2eid", _M + "gate.tid2eid", _PM + "tid2eid", False, lambda cfg: (cfg.vocab_size, cfg.num_experts_per_tok),
         when=_hashed, index=True),
) + swiglu_rules("expert_", _M + "experts.{e}.", _PM + "experts_", lambda cfg: cfg.moe_intermediate_size,
                 lambda cfg, layer: True, ("w1", "w3", "w2"), per_expert=True) \
  + swiglu_rules("shared_", _M + "shared_experts.", _PM + "shared_experts.", lambda cfg: cfg.shared_intermediate_size,
                 lambda cfg, layer: cfg.shared_intermediate_size > 0, ("w1", "w3", "w2"))

RULES = check_table((
    Rule("embed_tokens", "embed.weight", "model.embed_tokens", False, lambda cfg: (cfg.vocab_size, _H(cfg)),
         place="head"),
    Rule("final_norm", "norm.weight", "model.norm.weight", False, lambda cfg: (_H(cfg),), place="head"),
    Rule("hc_head_fn", "hc_head_fn", "model.hc_head.fn", True, lambda cfg: (cfg.hc_mult, cfg.hc_mult * _H(cfg)),
         place="head"),
    Rule("hc_head_base", "hc_head_base", "model.hc_head.base", False, lambda cfg: (cfg.hc_mult,), place="head"),
    Rule("hc_head_scale", "hc_head_scale", "model.hc_head.scale", False, lambda cfg: (1,), place="head"),
    Rule("input_layernorm", L + "attn_norm.weight", P + "input_layernorm.weight", False, lambda cfg: (_H(cfg),)),
    Rule("post_attention_layernorm", L + "ffn_norm.weight", P + "post_attention_layernorm.weight", False,
         lambda cfg: (_H(cfg),)),
) + _hc_rules("attn") + _hc_rules("ffn") + _ATTENTION + _MOE + (
    Rule("lm_head", "head.weight", "lm_head", True, lambda cfg: (cfg.vocab_size, _H(cfg)),
         when=lambda cfg, layer: not cfg.tie_word_embeddings, place="tail"),
))

"""The HF name table of the DSA families (DeepSeek-V3.2, GLM-5): DeepSeek-V3's (MLA, dense first
layers, sigmoid router with balance bias, routed and shared experts) plus, on each layer that runs
an indexer (`cfg.has_indexer`: every DeepSeek-V3.2 layer; GLM-5's "full" layers, not its "shared"
ones; the MTP layers), the lightning indexer's five tensors (`moejax.models.dsa_indexer`):

    self_attn.indexer.wq_b.weight          [index_n_heads * index_head_dim, q_lora_rank]  (transposed)
    self_attn.indexer.wk.weight            [index_head_dim, hidden_size]                  (transposed)
    self_attn.indexer.k_norm.weight        [index_head_dim]       (a LayerNorm with a bias)
    self_attn.indexer.k_norm.bias          [index_head_dim]
    self_attn.indexer.weights_proj.weight  [index_n_heads, hidden_size]                   (transposed)
"""

from __future__ import annotations

from moejax.models.deepseek_v3.names import RULES as DEEPSEEK_V3_RULES
from moejax.models.names import L, Rule, check_table

_I = L + "self_attn.indexer."


def _indexer(cfg, layer):
    return cfg.has_indexer(layer)


INDEXER_RULES = (
    Rule("indexer_wq_b", _I + "wq_b.weight", _I + "wq_b", True,
         lambda cfg: (cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank), when=_indexer),
    Rule("indexer_wk", _I + "wk.weight", _I + "wk", True, lambda cfg: (cfg.index_head_dim, cfg.hidden_size),
         when=_indexer),
    Rule("indexer_k_norm", _I + "k_norm.weight", _I + "k_norm.weight", False, lambda cfg: (cfg.index_head_dim,),
         when=_indexer),
    Rule("indexer_k_norm_bias", _I + "k_norm.bias", _I + "k_norm.bias", False, lambda cfg: (cfg.index_head_dim,),
         when=_indexer),
    Rule("indexer_weights_proj", _I + "weights_proj.weight", _I + "weights_proj", True,
         lambda cfg: (cfg.index_n_heads, cfg.hidden_size), when=_indexer),
)

RULES = check_table(DEEPSEEK_V3_RULES + INDEXER_RULES)

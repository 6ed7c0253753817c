"""Qwen3-MoE configuration (Qwen3-30B-A3B, Qwen3-235B-A22B): softmax router, top-k,
`norm_topk_prob`; grouped-query attention with RMSNorm on each query/key head; MoE layers chosen by
`decoder_sparse_step` and `mlp_only_layers`, the others dense. The expert count is `num_experts`
in the hub's files and `num_local_experts` in what transformers 5 writes: both are read."""

from __future__ import annotations

from moejax.models.config_base import BOOL, POS_INT, family_config, key
from moejax.models.gqa_config import FULL_ATTENTION_ONLY, GqaMoeConfig, SoftmaxRouter, SparseStepLayers


@family_config("Qwen3-MoE", ("qwen3_moe",), "Qwen3MoeForCausalLM")
class Qwen3MoeConfig(SparseStepLayers, SoftmaxRouter, GqaMoeConfig):
    QK_NORM = "head"
    UNIMPLEMENTED = {**GqaMoeConfig.UNIMPLEMENTED, **FULL_ATTENTION_ONLY}
    DEFAULTS = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                    num_attention_heads=32, num_key_value_heads=4, num_experts_per_tok=8, rms_norm_eps=1e-6,
                    max_position_embeddings=32768)

    moe_intermediate_size: int = key(POS_INT, 768)
    num_experts: int = key(POS_INT, 128, aliases=("num_local_experts",), experts=True)
    attention_bias: bool = key(BOOL, False)

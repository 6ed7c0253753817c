"""OLMoE configuration (OLMoE-1B-7B): every layer MoE, softmax router, top-k without
renormalisation (`norm_topk_prob` false in the released models), grouped-query attention with
RMSNorm over the whole q and k projections (not per head). The expert inner width is
`intermediate_size`. `clip_qkv` is not implemented (null in the released models)."""

from __future__ import annotations

import dataclasses

from moejax.models.config_base import BOOL, POS_INT, family_config, key
from moejax.models.gqa_config import NULL_ONLY, EveryLayerMoe, GqaMoeConfig, SoftmaxRouter


@family_config("OLMoE", ("olmoe",), "OlmoeForCausalLM")
class OlmoeConfig(EveryLayerMoe, SoftmaxRouter, GqaMoeConfig):
    QK_NORM = "full"
    UNIMPLEMENTED = {**GqaMoeConfig.UNIMPLEMENTED,
                     "clip_qkv": (NULL_ONLY[0], "clipping q/k/v is not implemented: only null")}
    DEFAULTS = dict(vocab_size=50304, hidden_size=2048, intermediate_size=1024, num_hidden_layers=16,
                    num_attention_heads=16, num_key_value_heads=16, num_experts_per_tok=8, rms_norm_eps=1e-5,
                    max_position_embeddings=4096)

    num_experts: int = key(POS_INT, 64, aliases=("num_local_experts",), experts=True)
    attention_bias: bool = key(BOOL, False)
    # OLMoE reads no head_dim: a head is hidden_size / num_attention_heads wide
    head_dim: None = dataclasses.field(default=None, init=False, repr=False, compare=False)

"""OLMoE configuration (OLMoE-1B-7B): every layer MoE, softmax router, top-k without
renormalisation (`norm_topk_prob` false in the released models), grouped-query attention with
RMSNorm over the whole q and k projections (not per head). The expert inner width is
`intermediate_size`. `clip_qkv` is not implemented (null in the released models)."""

from __future__ import annotations

import dataclasses

from moejax.models.config_base import BOOL, POS_INT, POS_NUMBER
from moejax.models.gqa_config import NULL_ONLY, SILU_ONLY, EveryLayerMoe, GqaMoeConfig


@dataclasses.dataclass(frozen=True)
class OlmoeConfig(EveryLayerMoe, GqaMoeConfig):
    vocab_size: int = 50304
    hidden_size: int = 2048
    intermediate_size: int = 1024
    num_hidden_layers: int = 16
    num_attention_heads: int = 16
    num_key_value_heads: int = 16
    num_experts: int = 64
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = False
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 1.0
    layer_num_experts: tuple | None = None
    raw: dict = dataclasses.field(default_factory=dict, compare=False, hash=False, repr=False)

    TITLE = "OLMoE"
    MODEL_TYPES = ("olmoe",)
    ARCHITECTURE = "OlmoeForCausalLM"
    EXPERTS_FIELD = "num_experts"
    EXPERTS_KEYS = ("num_experts", "num_local_experts")
    ALIASES = {"num_local_experts": "num_experts"}  # transformers' OlmoeConfig.attribute_map
    QK_NORM = "full"
    FIELD_RULES = {
        "vocab_size": POS_INT, "hidden_size": POS_INT, "intermediate_size": POS_INT, "num_hidden_layers": POS_INT,
        "num_attention_heads": POS_INT, "num_key_value_heads": POS_INT, "num_experts": POS_INT,
        "num_experts_per_tok": POS_INT, "norm_topk_prob": BOOL, "rms_norm_eps": POS_NUMBER,
        "max_position_embeddings": POS_INT, "tie_word_embeddings": BOOL, "attention_bias": BOOL,
    }
    UNIMPLEMENTED = {"hidden_act": SILU_ONLY, "clip_qkv": (NULL_ONLY[0], "clipping q/k/v is not implemented: only null")}

    def router_settings(self) -> dict:
        return dict(top_k=self.num_experts_per_tok, scoring_func="softmax", norm_topk_prob=self.norm_topk_prob)

"""Mixtral configuration (Mixtral-8x7B, 8x22B): every layer MoE, softmax router renormalised over
the chosen top-k (transformers: softmax over all E, top-k, divide by their sum: the same as a
softmax over the top-k logits), grouped-query attention without biases or q/k norms. The expert
inner width is `intermediate_size`; experts are `block_sparse_moe.experts.{e}.w1/w3/w2` on disk."""

from __future__ import annotations

import dataclasses

from moejax.models.config_base import BOOL, NONNEG_NUMBER_OR_NULL, POS_INT, POS_INT_OR_NULL, POS_NUMBER
from moejax.models.gqa_config import NULL_ONLY, SILU_ONLY, EveryLayerMoe, GqaMoeConfig


@dataclasses.dataclass(frozen=True)
class MixtralConfig(EveryLayerMoe, GqaMoeConfig):
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 14336
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int | None = None
    num_local_experts: int = 8
    num_experts_per_tok: int = 2
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 131072
    tie_word_embeddings: bool = False
    router_jitter_noise: float | None = 0.0  # training only: ignored in inference
    rope_theta: float = 1e6
    partial_rotary_factor: float = 1.0
    layer_num_experts: tuple | None = None
    raw: dict = dataclasses.field(default_factory=dict, compare=False, hash=False, repr=False)

    TITLE = "Mixtral"
    MODEL_TYPES = ("mixtral",)
    ARCHITECTURE = "MixtralForCausalLM"
    EXPERTS_FIELD = "num_local_experts"
    EXPERTS_KEYS = ("num_local_experts", "num_experts")
    ALIASES = {"num_experts": "num_local_experts"}  # transformers' MixtralConfig.attribute_map
    FIELD_RULES = {
        "vocab_size": POS_INT, "hidden_size": POS_INT, "intermediate_size": POS_INT, "num_hidden_layers": POS_INT,
        "num_attention_heads": POS_INT, "num_key_value_heads": POS_INT, "head_dim": POS_INT_OR_NULL,
        "num_local_experts": POS_INT, "num_experts_per_tok": POS_INT, "rms_norm_eps": POS_NUMBER,
        "max_position_embeddings": POS_INT, "tie_word_embeddings": BOOL, "router_jitter_noise": NONNEG_NUMBER_OR_NULL,
    }
    UNIMPLEMENTED = {"hidden_act": SILU_ONLY,
                     "sliding_window": (NULL_ONLY[0], "sliding-window attention is not implemented: only null")}

    def router_settings(self) -> dict:
        return dict(top_k=self.num_experts_per_tok, scoring_func="softmax", norm_topk_prob=True)

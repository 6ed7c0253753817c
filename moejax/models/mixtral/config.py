"""Mixtral configuration (Mixtral-8x7B, 8x22B): every layer MoE, softmax router renormalised over
the chosen top-k (transformers: softmax over all E, top-k, divide by their sum: the same as a
softmax over the top-k logits), grouped-query attention without biases or q/k norms. The expert
inner width is `intermediate_size`; experts are `block_sparse_moe.experts.{e}.w1/w3/w2` on disk."""

from __future__ import annotations

from moejax.models.config_base import NONNEG_NUMBER_OR_NULL, POS_INT, family_config, key
from moejax.models.gqa_config import NULL_ONLY, EveryLayerMoe, GqaMoeConfig


@family_config("Mixtral", ("mixtral",), "MixtralForCausalLM")
class MixtralConfig(EveryLayerMoe, GqaMoeConfig):
    UNIMPLEMENTED = {**GqaMoeConfig.UNIMPLEMENTED,
                     "sliding_window": (NULL_ONLY[0], "sliding-window attention is not implemented: only null")}
    DEFAULTS = dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, num_experts_per_tok=2, rms_norm_eps=1e-5,
                    max_position_embeddings=131072, rope_theta=1e6)

    num_local_experts: int = key(POS_INT, 8, aliases=("num_experts",), experts=True)
    router_jitter_noise: float | None = key(NONNEG_NUMBER_OR_NULL, 0.0)  # training only: ignored in inference

    def router_settings(self) -> dict:
        return dict(top_k=self.num_experts_per_tok, scoring_func="softmax", norm_topk_prob=True)

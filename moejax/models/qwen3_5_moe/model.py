"""Qwen3.5-MoE's language model in Flax NNX: Qwen3-Next's hybrid stack (`hybrid_attention` builds
each layer's Gated DeltaNet, in Qwen3.5's projection layout, or gated attention)."""

from moejax.models.causal_lm import CausalLM
from moejax.models.gqa_attention import rope_tables
from moejax.models.qwen3_5_moe.config import Qwen3_5MoeConfig
from moejax.models.qwen3_next.model import hybrid_attention


class Qwen3_5MoeForConditionalGeneration(CausalLM):
    config_class = Qwen3_5MoeConfig
    attention_class = staticmethod(hybrid_attention)
    rope_tables = staticmethod(rope_tables)

"""Qwen2-MoE in Flax NNX: the shared decoder stack with grouped-query attention."""

from moejax.models.causal_lm import CausalLM
from moejax.models.gqa_attention import GQAttention, rope_tables
from moejax.models.qwen2_moe.config import Qwen2MoeConfig


class Qwen2MoeForCausalLM(CausalLM):
    config_class = Qwen2MoeConfig
    attention_class = GQAttention
    rope_tables = staticmethod(rope_tables)

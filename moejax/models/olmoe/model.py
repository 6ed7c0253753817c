"""OLMoE in Flax NNX: the shared decoder stack with grouped-query attention."""

from moejax.models.causal_lm import CausalLM
from moejax.models.gqa_attention import GQAttention, rope_tables
from moejax.models.olmoe.config import OlmoeConfig


class OlmoeForCausalLM(CausalLM):
    config_class = OlmoeConfig
    attention_class = GQAttention
    rope_tables = staticmethod(rope_tables)

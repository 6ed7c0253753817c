"""GLM-4.5 in Flax NNX: the shared decoder stack with grouped-query attention and partial rope."""

from moejax.models.causal_lm import CausalLM
from moejax.models.glm4_moe.config import Glm4MoeConfig
from moejax.models.gqa_attention import GQAttention, rope_tables


class Glm4MoeForCausalLM(CausalLM):
    config_class = Glm4MoeConfig
    attention_class = GQAttention
    rope_tables = staticmethod(rope_tables)

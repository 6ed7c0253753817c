"""Kimi-K2.5's language model in Flax NNX: DeepSeek-V3's (MLA, sigmoid router with balance bias,
shared expert), read from the wrapper's config and names."""

from moejax.models.deepseek_v3.model import DeepseekV3ForCausalLM
from moejax.models.kimi_k25.config import KimiK25Config


class KimiK25ForConditionalGeneration(DeepseekV3ForCausalLM):
    config_class = KimiK25Config

"""DeepSeek-V3 family (DeepSeek-V3/R1, Kimi-K2, Moonlight) in Flax NNX."""

from moejax.models.deepseek_v3.config import DeepseekV3Config
from moejax.models.deepseek_v3.model import DeepseekV3ForCausalLM

__all__ = ["DeepseekV3Config", "DeepseekV3ForCausalLM"]

"""DeepSeek-V3 family (DeepSeek-V3/R1, Kimi-K2, Moonlight) in Flax NNX.

The model is imported lazily, so the config (read by JAX-free checkpoint tools such as `moejax
inspect`) does not pull in JAX."""

from moejax.models.deepseek_v3.config import DeepseekV3Config
from moejax.models.deepseek_v3.names import RULES
from moejax.models.deepseek_v3.presets import PRESETS, TINY
from moejax.models.family import Family

FAMILY = Family("deepseek_v3", "DeepSeek-V3", DeepseekV3Config, RULES,
                "moejax.models.deepseek_v3.model:DeepseekV3ForCausalLM", presets=PRESETS, tiny=TINY)

__all__ = ["DeepseekV3Config", "DeepseekV3ForCausalLM", "FAMILY"]


def __getattr__(name):
    if name == "DeepseekV3ForCausalLM":
        from moejax.models.deepseek_v3.model import DeepseekV3ForCausalLM

        return DeepseekV3ForCausalLM
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""DeepSeek-V3 family (DeepSeek-V3/R1, Kimi-K2, Moonlight) in Flax NNX. The model
(`moejax.models.deepseek_v3.model`, JAX) is reached through the registry (`moejax.DeepseekV3ForCausalLM`,
`FAMILY.causal_lm()`), never imported here: the config is read by JAX-free checkpoint tools such as
`moejax inspect`, and the package stays below the model in the import graph."""

from moejax.models.deepseek_v3.config import DeepseekV3Config
from moejax.models.deepseek_v3.names import RULES
from moejax.models.deepseek_v3.presets import PRESETS, TINY
from moejax.models.family import Family

FAMILY = Family("deepseek_v3", DeepseekV3Config, RULES, presets=PRESETS, tiny=TINY)

__all__ = ["DeepseekV3Config", "FAMILY"]

"""DeepSeek-V3.2 family (DeepSeek-V3.2-Exp): DeepSeek-V3 with DeepSeek sparse attention. The model
(`moejax.models.deepseek_v32.model`, JAX) is reached through the registry, never imported here."""

from moejax.models.deepseek_v32.config import DeepseekV32Config
from moejax.models.deepseek_v32.names import RULES
from moejax.models.deepseek_v32.presets import PRESETS, TEST, TINY
from moejax.models.family import Family

FAMILY = Family("deepseek_v32", DeepseekV32Config, RULES, presets=PRESETS, tiny=TINY, test_config=TEST)

__all__ = ["DeepseekV32Config", "FAMILY"]

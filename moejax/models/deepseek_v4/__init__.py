"""DeepSeek-V4 family (DeepSeek-V4-Flash, DeepSeek-V4-Pro): hyper-connection streams, sliding-window +
compressed (CSA with a lightning indexer, HCA) shared-KV attention, sqrtsoftplus routing and hash-routed
first layers. The model (`moejax.models.deepseek_v4.model`, JAX) is reached through the registry."""

from moejax.models.deepseek_v4.config import DeepseekV4Config
from moejax.models.deepseek_v4.names import RULES
from moejax.models.deepseek_v4.presets import PRESETS, TEST, TINY
from moejax.models.family import Family

FAMILY = Family("deepseek_v4", DeepseekV4Config, RULES, moe_block="ffn", presets=PRESETS, tiny=TINY,
                test_config=TEST)

__all__ = ["DeepseekV4Config", "FAMILY"]

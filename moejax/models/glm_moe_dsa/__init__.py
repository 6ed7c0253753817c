"""GLM-5 family (GLM-5, GLM-5.1, GLM-5.2): DeepSeek-V3.2's sparse MLA with GLM-5's sizes, an
interleaved indexer rope and index sharing. The model is imported lazily (JAX)."""

from moejax.models.family import Family
from moejax.models.glm_moe_dsa.config import GlmMoeDsaConfig
from moejax.models.glm_moe_dsa.names import RULES
from moejax.models.glm_moe_dsa.presets import PRESETS, TEST, TINY

FAMILY = Family("glm_moe_dsa", GlmMoeDsaConfig, RULES, presets=PRESETS, tiny=TINY, test_config=TEST)

"""GLM-4.5 family (GLM-4.5, GLM-4.5-Air). The model is imported lazily (JAX)."""

from moejax.models.family import Family
from moejax.models.glm4_moe.config import Glm4MoeConfig
from moejax.models.glm4_moe.names import RULES
from moejax.models.glm4_moe.presets import PRESETS, TEST, TINY

FAMILY = Family("glm4_moe", Glm4MoeConfig, RULES, presets=PRESETS, tiny=TINY, test_config=TEST)

"""GLM-4.5 family (GLM-4.5, GLM-4.5-Air). The model is imported lazily (JAX)."""

from moejax.models.family import Family
from moejax.models.glm4_moe.config import Glm4MoeConfig
from moejax.models.glm4_moe.names import RULES
from moejax.models.glm4_moe.presets import PRESETS, TINY

FAMILY = Family("glm4_moe", "GLM-4.5", Glm4MoeConfig, RULES, "moejax.models.glm4_moe.model:Glm4MoeForCausalLM",
                presets=PRESETS, tiny=TINY)

"""OLMoE family (OLMoE-1B-7B). The model is imported lazily (JAX)."""

from moejax.models.family import Family
from moejax.models.olmoe.config import OlmoeConfig
from moejax.models.olmoe.names import RULES
from moejax.models.olmoe.presets import PRESETS, TEST, TINY

FAMILY = Family("olmoe", OlmoeConfig, RULES, presets=PRESETS, tiny=TINY, test_config=TEST)

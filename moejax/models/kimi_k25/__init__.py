"""Kimi-K2.5 family (the multimodal wrapper's language model, DeepSeek-V3's; vision tower and
projector carried). The model is imported lazily (JAX)."""

from moejax.models.family import Family
from moejax.models.kimi_k25.config import KimiK25Config
from moejax.models.kimi_k25.names import RULES
from moejax.models.kimi_k25.presets import PRESETS, TEST, TINY

FAMILY = Family("kimi_k25", KimiK25Config, RULES, presets=PRESETS, tiny=TINY, test_config=TEST)

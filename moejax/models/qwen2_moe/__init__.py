"""Qwen2-MoE family (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B). The model is imported lazily (JAX)."""

from moejax.models.family import Family
from moejax.models.qwen2_moe.config import Qwen2MoeConfig
from moejax.models.qwen2_moe.names import RULES
from moejax.models.qwen2_moe.presets import PRESETS, TEST, TINY

FAMILY = Family("qwen2_moe", Qwen2MoeConfig, RULES, presets=PRESETS, tiny=TINY, test_config=TEST)

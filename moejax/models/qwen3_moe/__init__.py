"""Qwen3-MoE family (Qwen3-30B-A3B, Qwen3-235B-A22B). The model is imported lazily (JAX)."""

from moejax.models.family import Family
from moejax.models.qwen3_moe.config import Qwen3MoeConfig
from moejax.models.qwen3_moe.names import RULES
from moejax.models.qwen3_moe.presets import PRESETS, TEST, TINY

FAMILY = Family("qwen3_moe", Qwen3MoeConfig, RULES, presets=PRESETS, tiny=TINY, test_config=TEST)

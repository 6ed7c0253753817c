"""Qwen3.5-MoE family (the multimodal wrapper's language model; vision tower and MTP block carried).
The model is imported lazily (JAX)."""

from moejax.models.family import Family
from moejax.models.qwen3_5_moe.config import Qwen3_5MoeConfig
from moejax.models.qwen3_5_moe.names import RULES
from moejax.models.qwen3_5_moe.presets import PRESETS, TEST, TINY

FAMILY = Family("qwen3_5_moe", Qwen3_5MoeConfig, RULES, presets=PRESETS, tiny=TINY, test_config=TEST)

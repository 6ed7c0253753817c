"""Qwen3-Next family (Qwen3-Next-80B-A3B): hybrid Gated DeltaNet / gated attention. The model is
imported lazily (JAX)."""

from moejax.models.family import Family
from moejax.models.qwen3_next.config import Qwen3NextConfig
from moejax.models.qwen3_next.names import RULES
from moejax.models.qwen3_next.presets import PRESETS, TEST, TINY

FAMILY = Family("qwen3_next", Qwen3NextConfig, RULES, presets=PRESETS, tiny=TINY, test_config=TEST)

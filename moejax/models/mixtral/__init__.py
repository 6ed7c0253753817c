"""Mixtral family (Mixtral-8x7B, 8x22B). The model is imported lazily (JAX)."""

from moejax.models.family import Family
from moejax.models.mixtral.config import MixtralConfig
from moejax.models.mixtral.names import RULES
from moejax.models.mixtral.presets import PRESETS, TEST, TINY

FAMILY = Family("mixtral", MixtralConfig, RULES, moe_block="block_sparse_moe", presets=PRESETS, tiny=TINY,
                test_config=TEST)

"""gpt-oss family (gpt-oss-20b, gpt-oss-120b). The model is imported lazily (JAX)."""

from moejax.models.family import Family
from moejax.models.gpt_oss.config import GptOssConfig
from moejax.models.gpt_oss.names import FUSED, RULES
from moejax.models.gpt_oss.presets import PRESETS, TEST, TINY

FAMILY = Family("gpt_oss", GptOssConfig, RULES, presets=PRESETS, tiny=TINY, test_config=TEST, fused=FUSED)

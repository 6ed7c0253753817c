"""Kimi-K2.5's HF name table: DeepSeek-V3's under the wrapper's `language_model.model.`, its output
head `language_model.lm_head.weight`."""

from moejax.models.deepseek_v3.names import RULES as DEEPSEEK_V3_RULES
from moejax.models.names import check_table, prefixed

RULES = check_table(prefixed(DEEPSEEK_V3_RULES, "language_model.model.", head="language_model.lm_head.weight"))

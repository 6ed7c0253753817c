"""GLM-5's HF name table: DeepSeek-V3.2's (`moejax.models.deepseek_v32.names`), whose indexer
tensors exist on the "full" layers of GLM-5's schedule only."""

from moejax.models.deepseek_v32.names import RULES

__all__ = ["RULES"]

"""OLMoE's HF name table: GQA with q/k norms over the whole projection, the MoE block at `mlp.`."""

from moejax.models.gqa_names import gqa_rules
from moejax.models.names import check_table, embedding_rules, moe_rules, norm_rules

RULES = check_table(embedding_rules() + norm_rules() + gqa_rules() + moe_rules())

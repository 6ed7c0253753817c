"""GLM-4.5's HF name table: GQA (q/k/v biases, optional per-head q/k norms), dense first layers,
the MoE block at `mlp.` with the balance bias and shared experts (DeepSeek-V3's names)."""

from moejax.models.gqa_names import gqa_rules
from moejax.models.names import check_table, dense_mlp_rules, embedding_rules, moe_rules, mtp_rules, norm_rules

RULES = check_table(embedding_rules() + norm_rules() + gqa_rules() + dense_mlp_rules()
                    + moe_rules(balance_bias=True, shared=lambda cfg: cfg.shared_intermediate_size) + mtp_rules())

"""Qwen3.5-MoE's HF name table: Qwen3-Next's (with the Gated DeltaNet's separate projections and no
dense layers) under the wrapper's `model.language_model.` (`lm_head.weight` stays at the top)."""

from moejax.models.gqa_names import gqa_rules
from moejax.models.names import check_table, embedding_rules, moe_rules, mtp_rules, norm_rules, prefixed
from moejax.models.qwen3_next.names import deltanet_rules, full_attention

RULES = check_table(prefixed(
    embedding_rules() + norm_rules() + gqa_rules(when=full_attention) + deltanet_rules("qwen3_5")
    + moe_rules(shared=lambda cfg: cfg.shared_intermediate_size, shared_name="shared_expert", shared_gate=True)
    + mtp_rules(),
    "model.language_model."))

"""Qwen2-MoE's HF name table: GQA with q/k/v biases, dense MLP in `mlp_only_layers`, the MoE block
at `mlp.` with one gated shared expert (`mlp.shared_expert.*`, `mlp.shared_expert_gate.weight`)."""

from moejax.models.gqa_names import gqa_rules
from moejax.models.names import check_table, dense_mlp_rules, embedding_rules, moe_rules, norm_rules

RULES = check_table(embedding_rules() + norm_rules() + gqa_rules() + dense_mlp_rules()
                    + moe_rules(shared=lambda cfg: cfg.shared_intermediate_size, shared_name="shared_expert",
                                shared_gate=True))

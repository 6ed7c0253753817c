"""Qwen3-MoE's HF name table: GQA with per-head q/k norms, dense MLP in `mlp_only_layers`, the
MoE block at `mlp.` (router `mlp.gate.weight`, experts `mlp.experts.{e}.{gate,up,down}_proj`)."""

from moejax.models.gqa_names import gqa_rules
from moejax.models.names import check_table, dense_mlp_rules, embedding_rules, moe_rules, norm_rules

RULES = check_table(embedding_rules() + norm_rules() + gqa_rules() + dense_mlp_rules() + moe_rules())

"""Mixtral's HF name table: GQA, and the MoE block at `block_sparse_moe.` with experts named
w1 (gate), w3 (up), w2 (down), as hub checkpoints and transformers 5 both write them."""

from moejax.models.gqa_names import gqa_rules
from moejax.models.names import check_table, embedding_rules, moe_rules, norm_rules

RULES = check_table(embedding_rules() + norm_rules() + gqa_rules()
                    + moe_rules(block="block_sparse_moe", expert_names=("w1", "w3", "w2")))

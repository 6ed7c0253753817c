"""Qwen3-MoE configuration (Qwen3-30B-A3B, Qwen3-235B-A22B): softmax router, top-k,
`norm_topk_prob`; grouped-query attention with RMSNorm on each query/key head; MoE layers chosen by
`decoder_sparse_step` and `mlp_only_layers`, the others dense. The expert count is `num_experts`
in the hub's files and `num_local_experts` in what transformers 5 writes: both are read."""

from __future__ import annotations

import dataclasses

from moejax.models.config_base import BOOL, INT_LIST, POS_INT, POS_INT_OR_NULL, POS_NUMBER
from moejax.models.gqa_config import SILU_ONLY, GqaMoeConfig, SparseStepLayers, bool_is


@dataclasses.dataclass(frozen=True)
class Qwen3MoeConfig(SparseStepLayers, GqaMoeConfig):
    vocab_size: int = 151936
    hidden_size: int = 2048
    intermediate_size: int = 6144
    moe_intermediate_size: int = 768
    num_hidden_layers: int = 48
    num_attention_heads: int = 32
    num_key_value_heads: int = 4
    head_dim: int | None = None
    num_experts: int = 128
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple = ()
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 1.0
    layer_num_experts: tuple | None = None
    raw: dict = dataclasses.field(default_factory=dict, compare=False, hash=False, repr=False)

    TITLE = "Qwen3-MoE"
    MODEL_TYPES = ("qwen3_moe",)
    ARCHITECTURE = "Qwen3MoeForCausalLM"
    EXPERTS_FIELD = "num_experts"
    EXPERTS_KEYS = ("num_experts", "num_local_experts")
    QK_NORM = "head"
    ALIASES = {"num_local_experts": "num_experts"}
    FIELD_RULES = {
        "vocab_size": POS_INT, "hidden_size": POS_INT, "intermediate_size": POS_INT,
        "moe_intermediate_size": POS_INT, "num_hidden_layers": POS_INT, "num_attention_heads": POS_INT,
        "num_key_value_heads": POS_INT, "head_dim": POS_INT_OR_NULL, "num_experts": POS_INT,
        "num_experts_per_tok": POS_INT, "norm_topk_prob": BOOL, "decoder_sparse_step": POS_INT,
        "mlp_only_layers": INT_LIST, "rms_norm_eps": POS_NUMBER, "max_position_embeddings": POS_INT,
        "tie_word_embeddings": BOOL, "attention_bias": BOOL,
    }
    UNIMPLEMENTED = {
        "hidden_act": SILU_ONLY,
        "use_sliding_window": bool_is(False, "sliding-window attention is not implemented"),
        "layer_types": (lambda v: v is None or all(t == "full_attention" for t in v),
                        "only full attention is implemented"),
    }

    def router_settings(self) -> dict:
        return dict(top_k=self.num_experts_per_tok, scoring_func="softmax", norm_topk_prob=self.norm_topk_prob)

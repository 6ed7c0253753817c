"""Qwen2-MoE configuration (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): softmax router, top-k,
`norm_topk_prob` (false in the released models); one shared expert of
`shared_expert_intermediate_size` whose output is gated by sigmoid(x . w_gate) (the MoE block's
`shared_gate`); grouped-query attention with q/k/v biases (`qkv_bias`) and no q/k norm; MoE layers
by `decoder_sparse_step` and `mlp_only_layers` as in Qwen3-MoE."""

from __future__ import annotations

import dataclasses

from moejax.models.config_base import BOOL, INT_LIST, NONNEG_INT, POS_INT, POS_INT_OR_NULL, POS_NUMBER
from moejax.models.gqa_config import SILU_ONLY, GqaMoeConfig, SparseStepLayers, bool_is


@dataclasses.dataclass(frozen=True)
class Qwen2MoeConfig(SparseStepLayers, GqaMoeConfig):
    vocab_size: int = 151936
    hidden_size: int = 2048
    intermediate_size: int = 5632
    moe_intermediate_size: int = 1408
    shared_expert_intermediate_size: int = 5632
    num_hidden_layers: int = 24
    num_attention_heads: int = 16
    num_key_value_heads: int = 16
    head_dim: int | None = None
    num_experts: int = 60
    num_experts_per_tok: int = 4
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple = ()
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    qkv_bias: bool = True                 # biases on q, k, v (never on o)
    rope_theta: float = 1e6
    partial_rotary_factor: float = 1.0
    layer_num_experts: tuple | None = None
    raw: dict = dataclasses.field(default_factory=dict, compare=False, hash=False, repr=False)

    TITLE = "Qwen2-MoE"
    MODEL_TYPES = ("qwen2_moe",)
    ARCHITECTURE = "Qwen2MoeForCausalLM"
    EXPERTS_FIELD = "num_experts"
    EXPERTS_KEYS = ("num_experts",)
    O_BIAS_FOLLOWS_ATTENTION_BIAS = False
    FIELD_RULES = {
        "vocab_size": POS_INT, "hidden_size": POS_INT, "intermediate_size": POS_INT,
        "moe_intermediate_size": POS_INT, "shared_expert_intermediate_size": NONNEG_INT,
        "num_hidden_layers": POS_INT, "num_attention_heads": POS_INT, "num_key_value_heads": POS_INT,
        "head_dim": POS_INT_OR_NULL, "num_experts": POS_INT, "num_experts_per_tok": POS_INT, "norm_topk_prob": BOOL,
        "decoder_sparse_step": POS_INT, "mlp_only_layers": INT_LIST, "rms_norm_eps": POS_NUMBER,
        "max_position_embeddings": POS_INT, "tie_word_embeddings": BOOL, "qkv_bias": BOOL,
    }
    UNIMPLEMENTED = {
        "hidden_act": SILU_ONLY,
        "use_sliding_window": bool_is(False, "sliding-window attention is not implemented"),
        "layer_types": (lambda v: v is None or all(t == "full_attention" for t in v),
                        "only full attention is implemented"),
    }

    shared_expert_gate = True  # the shared expert's output is gated: sigmoid(x . shared_gate) * shared(x)

    @property
    def shared_intermediate_size(self) -> int:
        return self.shared_expert_intermediate_size

    def router_settings(self) -> dict:
        return dict(top_k=self.num_experts_per_tok, scoring_func="softmax", norm_topk_prob=self.norm_topk_prob)

"""Qwen2-MoE configuration (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): softmax router, top-k,
`norm_topk_prob` (false in the released models); one shared expert of
`shared_expert_intermediate_size` whose output is gated by sigmoid(x . w_gate) (the MoE block's
`shared_gate`); grouped-query attention with q/k/v biases (`qkv_bias`) and no q/k norm; MoE layers
by `decoder_sparse_step` and `mlp_only_layers` as in Qwen3-MoE."""

from __future__ import annotations

from moejax.models.config_base import BOOL, NONNEG_INT, POS_INT, family_config, key
from moejax.models.gqa_config import FULL_ATTENTION_ONLY, GqaMoeConfig, SoftmaxRouter, SparseStepLayers


@family_config("Qwen2-MoE", ("qwen2_moe",), "Qwen2MoeForCausalLM")
class Qwen2MoeConfig(SparseStepLayers, SoftmaxRouter, GqaMoeConfig):
    O_BIAS_FOLLOWS_ATTENTION_BIAS = False
    UNIMPLEMENTED = {**GqaMoeConfig.UNIMPLEMENTED, **FULL_ATTENTION_ONLY}
    DEFAULTS = dict(vocab_size=151936, hidden_size=2048, intermediate_size=5632, num_hidden_layers=24,
                    num_attention_heads=16, num_key_value_heads=16, num_experts_per_tok=4, rms_norm_eps=1e-6,
                    max_position_embeddings=8192, rope_theta=1e6)

    moe_intermediate_size: int = key(POS_INT, 1408)
    shared_expert_intermediate_size: int = key(NONNEG_INT, 5632)
    num_experts: int = key(POS_INT, 60, experts=True)
    qkv_bias: bool = key(BOOL, True)      # biases on q, k, v (never on o)

    shared_expert_gate = True  # the shared expert's output is gated: sigmoid(x . shared_gate) * shared(x)

    @property
    def shared_intermediate_size(self) -> int:
        return self.shared_expert_intermediate_size

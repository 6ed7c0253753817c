"""GLM-4.5 configuration (GLM-4.5, GLM-4.5-Air): DeepSeek-V3's router (sigmoid scores, balance bias
`e_score_correction_bias`, group-limited top-k, `norm_topk_prob`, `routed_scaling_factor`) and
shared experts, dense first layers (`first_k_dense_replace`), but grouped-query attention (biases on
q/k/v only, optional per-head q/k norm `use_qk_norm`) with the default rope on a part of each head
(`partial_rotary_factor`, top level on the hub, inside `rope_parameters` in transformers 5). MTP
layers (`num_nextn_predict_layers`) are carried like DeepSeek-V3's."""

from __future__ import annotations

import dataclasses

from moejax.models.config_base import BOOL, NONNEG_INT, POS_INT, POS_INT_OR_NULL, POS_NUMBER, SigmoidGroupRouter
from moejax.models.gqa_config import SILU_ONLY, GqaMoeConfig


@dataclasses.dataclass(frozen=True)
class Glm4MoeConfig(SigmoidGroupRouter, GqaMoeConfig):
    vocab_size: int = 151552
    hidden_size: int = 4096
    intermediate_size: int = 10944
    moe_intermediate_size: int = 1408
    num_hidden_layers: int = 46
    num_attention_heads: int = 96
    num_key_value_heads: int = 8
    head_dim: int | None = None
    n_routed_experts: int = 128
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8
    n_group: int = 1
    topk_group: int = 1
    first_k_dense_replace: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    use_qk_norm: bool = False
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 131072
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    num_nextn_predict_layers: int = 0
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.5
    layer_num_experts: tuple | None = None
    raw: dict = dataclasses.field(default_factory=dict, compare=False, hash=False, repr=False)

    TITLE = "GLM-4.5"
    MODEL_TYPES = ("glm4_moe",)
    ARCHITECTURE = "Glm4MoeForCausalLM"
    EXPERTS_FIELD = "n_routed_experts"
    EXPERTS_KEYS = ("n_routed_experts", "num_local_experts")
    O_BIAS_FOLLOWS_ATTENTION_BIAS = False  # o_proj never has a bias
    ALIASES = {"num_local_experts": "n_routed_experts", "num_mtp_layers": "num_nextn_predict_layers"}  # attribute_map
    FIELD_RULES = {
        "vocab_size": POS_INT, "hidden_size": POS_INT, "intermediate_size": POS_INT,
        "moe_intermediate_size": POS_INT, "num_hidden_layers": POS_INT, "num_attention_heads": POS_INT,
        "num_key_value_heads": POS_INT, "head_dim": POS_INT_OR_NULL, "n_routed_experts": POS_INT,
        "n_shared_experts": NONNEG_INT, "num_experts_per_tok": POS_INT, "n_group": POS_INT, "topk_group": POS_INT,
        "first_k_dense_replace": NONNEG_INT, "routed_scaling_factor": POS_NUMBER, "norm_topk_prob": BOOL,
        "use_qk_norm": BOOL, "rms_norm_eps": POS_NUMBER, "max_position_embeddings": POS_INT,
        "tie_word_embeddings": BOOL, "attention_bias": BOOL, "num_nextn_predict_layers": NONNEG_INT,
    }
    UNIMPLEMENTED = {"hidden_act": SILU_ONLY}

    @property
    def qk_norm(self) -> str | None:
        return "head" if self.use_qk_norm else None


    @classmethod
    def _relations(cls, v: dict, partial: float) -> list[str]:
        out = super()._relations(v, partial)
        E, G, k, tg = (v.get(n) for n in ("n_routed_experts", "n_group", "num_experts_per_tok", "topk_group"))
        if E is not None and G is not None and E % G:
            out.append(f"n_routed_experts={E} is not divisible by n_group={G}")
        elif None not in (E, G, k, tg) and not 1 <= tg <= G:
            out.append(f"topk_group={tg} must lie in [1, n_group={G}]")
        elif None not in (E, G, k, tg) and G > 1 and k > tg * (E // G):
            out.append(f"num_experts_per_tok={k} exceeds the experts of the chosen groups (topk_group={tg} x {E // G})")
        return out

"""GLM-4.5 configuration (GLM-4.5, GLM-4.5-Air): DeepSeek-V3's router (sigmoid scores, balance bias
`e_score_correction_bias`, group-limited top-k, `norm_topk_prob`, `routed_scaling_factor`) and
shared experts, dense first layers (`first_k_dense_replace`), but grouped-query attention (biases on
q/k/v only, optional per-head q/k norm `use_qk_norm`) with the default rope on a part of each head
(`partial_rotary_factor`, top level on the hub, inside `rope_parameters` in transformers 5). MTP
layers (`num_nextn_predict_layers`) are carried like DeepSeek-V3's."""

from __future__ import annotations

from moejax.models.config_base import BOOL, SigmoidGroupRouter, family_config, key
from moejax.models.gqa_config import GqaMoeConfig


@family_config("GLM-4.5", ("glm4_moe",), "Glm4MoeForCausalLM")
class Glm4MoeConfig(SigmoidGroupRouter, GqaMoeConfig):
    O_BIAS_FOLLOWS_ATTENTION_BIAS = False  # o_proj never has a bias
    DEFAULTS = dict(vocab_size=151552, hidden_size=4096, intermediate_size=10944, num_hidden_layers=46,
                    num_attention_heads=96, num_key_value_heads=8, num_experts_per_tok=8, rms_norm_eps=1e-5,
                    max_position_embeddings=131072, partial_rotary_factor=0.5, moe_intermediate_size=1408,
                    n_routed_experts=128, routed_scaling_factor=1.0, n_group=1, topk_group=1, first_k_dense_replace=1)

    use_qk_norm: bool = key(BOOL, False)
    attention_bias: bool = key(BOOL, False)

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

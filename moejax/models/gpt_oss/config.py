"""gpt-oss configuration (gpt-oss-20b, gpt-oss-120b): every layer MoE; a router with a logit bias
whose top-k logits are softmaxed (the same gates as a softmax renormalised over the top k); experts
with biases and a clamped SwiGLU (`swiglu_alpha`, `swiglu_limit`), stored fused
(`experts.gate_up_proj` [E, H, 2F], gate and up columns interleaved); grouped-query attention with
biases, a learned sink logit per head, and a sliding window on the layers `layer_types` names
`sliding_attention` (by default every even layer); YaRN rope (`rope_parameters`, read as
transformers resolves it); RMSNorm scaling in float32 before the cast back."""

from __future__ import annotations

from moejax.models.config_base import BOOL, POS_INT, POS_INT_OR_NULL, POS_NUMBER, family_config, key
from moejax.models.gqa_config import EveryLayerMoe, GqaMoeConfig
from moejax.models.rope_settings import RopeConfig, rope_from_dict

LAYER_TYPES = ("sliding_attention", "full_attention")
LAYER_TYPE_LIST = (lambda v: isinstance(v, list) and all(t in LAYER_TYPES for t in v),
                   f"a list of {' or '.join(repr(t) for t in LAYER_TYPES)}")


@family_config("gpt-oss", ("gpt_oss",), "GptOssForCausalLM")
class GptOssConfig(EveryLayerMoe, GqaMoeConfig):
    UNIMPLEMENTED = {}  # hidden_act is not read: the experts' activation is the clamped SwiGLU whatever it says
    HAS_ROUTER_BIAS = True
    ATTENTION_SINKS = True
    NORM_SCALES_IN_FLOAT32 = True
    EXPERT_KIND = "clamped_swiglu"
    DEFAULTS = dict(vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=36,
                    num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_experts_per_tok=4,
                    rms_norm_eps=1e-5, max_position_embeddings=131072)

    num_local_experts: int = key(POS_INT, 128, aliases=("num_experts",), experts=True)
    attention_bias: bool = key(BOOL, True)
    sliding_window: int | None = key(POS_INT_OR_NULL, 128)
    layer_types: tuple | None = key(LAYER_TYPE_LIST, None)
    swiglu_alpha: float = key(POS_NUMBER, 1.702)
    swiglu_limit: float = key(POS_NUMBER, 7.0)
    rope: RopeConfig = RopeConfig()

    def __post_init__(self):
        if self.layer_types is not None:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))

    def router_settings(self) -> dict:
        # softmax over the top-k logits == softmax over all, renormalised over the top k
        return dict(top_k=self.num_experts_per_tok, scoring_func="softmax", norm_topk_prob=True)

    def layer_type(self, layer: int) -> str:
        if self.layer_types is not None:
            return self.layer_types[layer]
        return "sliding_attention" if (layer + 1) % 2 else "full_attention"  # transformers' default

    def attention_window(self, layer: int) -> int | None:
        return self.sliding_window if self.layer_type(layer) == "sliding_attention" else None

    def expert_fn(self):
        from moejax.moe.dispatch import ClampedSwiglu

        return ClampedSwiglu(self.swiglu_alpha, self.swiglu_limit)

    @classmethod
    def _read_rope(cls, d, merged, problems, unimplemented) -> dict:
        return dict(rope=rope_from_dict(d, merged, problems, unimplemented))

    @classmethod
    def _relations(cls, v: dict, partial: float) -> list[str]:
        out = super()._relations(v, partial)
        types = v.get("layer_types")
        if v.get("sliding_window") is None and types and "sliding_attention" in types:
            out.append("sliding_window=null, but layer_types names sliding_attention layers")
        return out

    def _written(self) -> dict:
        rp = {"rope_type": self.rope.rope_type, "rope_theta": self.rope.theta}
        if self.rope.rope_type == "yarn":
            rp.update({k: getattr(self.rope, k) for k in ("factor", "original_max_position_embeddings", "beta_fast",
                                                         "beta_slow", "truncate")})
        return dict(hidden_act="silu", rope_parameters=rp,
                    layer_types=[self.layer_type(l) for l in range(self.num_hidden_layers)])



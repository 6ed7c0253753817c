"""Qwen3-Next configuration (Qwen3-Next-80B-A3B): a hybrid stack whose `layer_types` are
`linear_attention` (Gated DeltaNet, `moejax.models.gated_deltanet`) or `full_attention` (grouped-query
attention with a sigmoid output gate from q_proj, per-head q/k RMSNorm and partial rope); by default
every fourth layer is full (`full_attention_interval`). The MoE block is Qwen2-MoE's (softmax top-k
with `norm_topk_prob`, one shared expert gated by sigmoid(x . w)), 512 experts in the released model;
MoE layers by `decoder_sparse_step` / `mlp_only_layers`. Every RMSNorm but DeltaNet's gated one
scales by 1 + weight in float32. `HybridDeltaNetConfig` holds what Qwen3.5-MoE shares."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from moejax.models.config_base import BOOL, POS_INT, family_config, key
from moejax.models.gqa_config import SILU_ONLY, GqaMoeConfig, SoftmaxRouter, SparseStepLayers

LAYER_TYPES = ("linear_attention", "full_attention")
LAYER_TYPE_LIST = (lambda v: isinstance(v, list) and all(t in LAYER_TYPES for t in v),
                   f"a list of {' or '.join(repr(t) for t in LAYER_TYPES)}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class HybridDeltaNetConfig(GqaMoeConfig):
    """Qwen3-Next's and Qwen3.5-MoE's shared settings: the Gated DeltaNet's sizes, the layer
    schedule, the gated attention, the zero-centred norms and the gated shared expert."""

    UNIMPLEMENTED: ClassVar[dict] = {"hidden_act": SILU_ONLY}
    QK_NORM: ClassVar[str] = "head"
    ATTENTION_OUTPUT_GATE: ClassVar[bool] = True
    NORM_SCALES_IN_FLOAT32: ClassVar[bool] = True
    NORM_PLUS_ONE: ClassVar[bool] = True
    DELTANET_LAYOUT: ClassVar[str] = "qwen3_next"  # moejax.models.gated_deltanet's projection layout

    moe_intermediate_size: int = key(POS_INT, 512)
    shared_expert_intermediate_size: int = key(POS_INT, 512)
    num_experts: int = key(POS_INT, 512, aliases=("num_local_experts",), experts=True)
    attention_bias: bool = key(BOOL, False)
    linear_conv_kernel_dim: int = key(POS_INT, 4)
    linear_key_head_dim: int = key(POS_INT, 128)
    linear_value_head_dim: int = key(POS_INT, 128)
    linear_num_key_heads: int = key(POS_INT, 16)
    linear_num_value_heads: int = key(POS_INT, 32)
    layer_types: tuple | None = key(LAYER_TYPE_LIST, None)
    full_attention_interval: int = key(POS_INT, 4)  # the schedule when layer_types is not given

    shared_expert_gate = True  # the shared expert's output is gated: sigmoid(x . shared_gate) * shared(x)

    def __post_init__(self):
        if hasattr(super(), "__post_init__"):
            super().__post_init__()
        if self.layer_types is not None:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))

    @property
    def shared_intermediate_size(self) -> int:
        return self.shared_expert_intermediate_size

    @property
    def hidden_act(self) -> str:
        return "silu"

    def layer_type(self, layer: int) -> str:
        if layer >= self.num_hidden_layers:  # an MTP layer: full attention (vLLM's Qwen3-Next / Qwen3.5 MTP)
            return "full_attention"
        if self.layer_types is not None:
            return self.layer_types[layer]
        return "linear_attention" if (layer + 1) % self.full_attention_interval else "full_attention"

    def is_linear_attention(self, layer: int) -> bool:
        return self.layer_type(layer) == "linear_attention"

    @classmethod
    def _relations(cls, v: dict, partial: float) -> list[str]:
        out = super()._relations(v, partial)
        heads, kv_heads = v.get("linear_num_value_heads"), v.get("linear_num_key_heads")
        if heads is not None and kv_heads is not None and heads % kv_heads:
            out.append(f"linear_num_value_heads={heads} is not a multiple of linear_num_key_heads={kv_heads}")
        return out

    def _written(self) -> dict:
        return {**super()._written(), "layer_types": [self.layer_type(l) for l in range(self.num_hidden_layers)]}


@family_config("Qwen3-Next", ("qwen3_next",), "Qwen3NextForCausalLM")
class Qwen3NextConfig(SparseStepLayers, SoftmaxRouter, HybridDeltaNetConfig):
    DEFAULTS = dict(vocab_size=151936, hidden_size=2048, intermediate_size=5632, num_hidden_layers=48,
                    num_attention_heads=16, num_key_value_heads=2, head_dim=256, num_experts_per_tok=10,
                    rms_norm_eps=1e-6, max_position_embeddings=32768, norm_topk_prob=True, partial_rotary_factor=0.25)

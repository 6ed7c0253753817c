"""Qwen3.5-MoE configuration (Qwen3.5-35B-A3B, Qwen3.5-122B-A10B, Qwen3.5-397B-A17B), as the Hub
ships it: the multimodal wrapper `Qwen3_5MoeForConditionalGeneration`, whose language model's
settings are `text_config` (read and rewritten there; `vision_config` and the wrapper's other keys
are kept as they are). The language model is Qwen3-Next's hybrid stack (`HybridDeltaNetConfig`) with
the Gated DeltaNet's separate projections (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`),
every layer MoE and the top-k gates always renormalised (transformers reads no `norm_topk_prob`,
`decoder_sparse_step` or `mlp_only_layers` for it). Its rope is MRoPE (`mrope_section`), which on text
(the same position on the three axes) is the partial rope moejax computes. The vision tower
(`model.visual.*`) is carried byte for byte into every output. The MTP block (`mtp.*`, which
transformers does not read; `mtp_num_hidden_layers` of them) is presented as layer
`num_hidden_layers` under DeepSeek-V3's MTP names (`moejax.hf.mtp_names`) and written back under its
own."""

from __future__ import annotations

from typing import ClassVar

from moejax.models.config_base import NONNEG_INT, family_config, key
from moejax.models.qwen3_next.config import HybridDeltaNetConfig


@family_config("Qwen3.5-MoE", ("qwen3_5_moe",), "Qwen3_5MoeForConditionalGeneration")
class Qwen3_5MoeConfig(HybridDeltaNetConfig):
    TEXT_CONFIG = "text_config"
    CARRIED_PREFIXES = ("model.visual.",)
    # the MTP block stored apart: its prefix, and its predictor's names -> DeepSeek-V3's (moejax.hf.mtp_names)
    MTP_STORED: ClassVar[tuple] = ("mtp.", {"fc.weight": "eh_proj.weight", "pre_fc_norm_embedding.weight": "enorm.weight",
                                            "pre_fc_norm_hidden.weight": "hnorm.weight",
                                            "norm.weight": "shared_head.norm.weight"})
    num_nextn_predict_layers: int = key(NONNEG_INT, 0, aliases=("mtp_num_hidden_layers",))
    DELTANET_LAYOUT = "qwen3_5"
    DEFAULTS = dict(vocab_size=248320, hidden_size=2048, intermediate_size=5632, num_hidden_layers=40,
                    num_attention_heads=16, num_key_value_heads=2, head_dim=256, num_experts_per_tok=8,
                    rms_norm_eps=1e-6, max_position_embeddings=32768, num_experts=256, partial_rotary_factor=0.25)

    def is_moe_layer(self, layer: int) -> bool:
        return True

    def router_settings(self) -> dict:
        return dict(top_k=self.num_experts_per_tok, scoring_func="softmax", norm_topk_prob=True)

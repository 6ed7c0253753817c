"""Kimi-K2.5 configuration (Kimi-K2.5 and the Kimi-K2.6/K2.7 checkpoints of the same wrapper), as the
Hub ships it: `KimiK25ForConditionalGeneration` (model_type `kimi_k25`), whose language model is
Kimi-K2's DeepSeek-V3 text model with its settings in `text_config` (read and rewritten there;
`vision_config` and the wrapper's other keys are kept as they are). Its tensors are the text model's
under `language_model.` (`language_model.model.layers.*`, `language_model.lm_head.weight`: the names
transformers' own conversion table for `kimi_k25` maps from), the vision tower's (`vision_tower.*`)
and the projector's (`mm_projector.*`), both carried byte for byte into every output."""

from __future__ import annotations

from moejax.models.config_base import family_config
from moejax.models.deepseek_v3.config import DeepseekV3Config


@family_config("Kimi-K2.5", ("kimi_k25",), "KimiK25ForConditionalGeneration")
class KimiK25Config(DeepseekV3Config):
    TEXT_CONFIG = "text_config"
    ARCHITECTURE_SPELLINGS = ("Kimi_K25ForConditionalGeneration",)   # transformers' class
    CARRIED_PREFIXES = ("vision_tower.", "mm_projector.")
    DEFAULTS = dict(vocab_size=163840, hidden_size=7168, intermediate_size=18432, num_hidden_layers=61,
                    num_attention_heads=64, num_experts_per_tok=8, rms_norm_eps=1e-5, max_position_embeddings=262144,
                    moe_intermediate_size=2048, n_routed_experts=384, routed_scaling_factor=2.827, n_group=1,
                    topk_group=1, first_k_dense_replace=1)

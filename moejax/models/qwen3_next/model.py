"""Qwen3-Next in Flax NNX: the shared decoder stack whose layers are Gated DeltaNet
(`linear_attention`) or gated grouped-query attention (`full_attention`), by `layer_types`."""

from moejax.models.causal_lm import CausalLM
from moejax.models.gated_deltanet import GatedDeltaNet
from moejax.models.gqa_attention import GQAttention, rope_tables
from moejax.models.qwen3_next.config import Qwen3NextConfig


def hybrid_attention(cfg, dtype, rngs, layer: int):
    """Layer `layer`'s attention half: the Gated DeltaNet or grouped-query attention."""
    if cfg.is_linear_attention(layer):
        return GatedDeltaNet(cfg, dtype, rngs, cfg.DELTANET_LAYOUT)
    return GQAttention(cfg, dtype, rngs, layer)


class Qwen3NextForCausalLM(CausalLM):
    config_class = Qwen3NextConfig
    attention_class = staticmethod(hybrid_attention)
    rope_tables = staticmethod(rope_tables)

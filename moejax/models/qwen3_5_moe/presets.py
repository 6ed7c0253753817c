"""Full-size Qwen3.5-MoE configs (the language model of the published config.json; the vision
config is left out, it is carried, not read), for shape work."""


def _qwen3_5(layers: int, hidden: int, experts: int, top_k: int, moe: int, heads: int, kv: int, lin_v: int) -> dict:
    return {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
            "tie_word_embeddings": False,
            "text_config": {"model_type": "qwen3_5_moe_text", "hidden_act": "silu", "vocab_size": 248320,
                            "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
                            "num_key_value_heads": kv, "head_dim": 256, "linear_conv_kernel_dim": 4,
                            "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_num_key_heads": 16,
                            "linear_num_value_heads": lin_v, "moe_intermediate_size": moe,
                            "shared_expert_intermediate_size": moe, "num_experts": experts,
                            "num_experts_per_tok": top_k, "full_attention_interval": 4, "rms_norm_eps": 1e-6,
                            "max_position_embeddings": 262144, "tie_word_embeddings": False,
                            "rope_parameters": {"rope_type": "default", "rope_theta": 10000000,
                                                "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
                                                "mrope_interleaved": True}}}


PRESETS = {"qwen3.5-35b-a3b": _qwen3_5(40, 2048, 256, 8, 512, 16, 2, 32),
           "qwen3.5-397b-a17b": _qwen3_5(60, 4096, 512, 10, 1024, 32, 2, 64)}

_VISION = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 128,
           "patch_size": 4, "temporal_patch_size": 2, "spatial_merge_size": 2, "in_channels": 3,
           "num_position_embeddings": 16}

# What `experiment=train_tiny arch.family=qwen3_5_moe` trains: Qwen3-Next's tiny budget, every layer
# MoE, in the wrapper (a one-block vision tower transformers builds at random: it is not trained)
TINY = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
        "tie_word_embeddings": False, "vision_config": _VISION,
        "text_config": {"model_type": "qwen3_5_moe_text", "hidden_act": "silu", "hidden_size": 128,
                        "intermediate_size": 256, "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64,
                        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
                        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 32,
                        "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4, "num_experts": 32,
                        "num_experts_per_tok": 4, "rms_norm_eps": 1e-6, "max_position_embeddings": 512,
                        "tie_word_embeddings": False,
                        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                            "partial_rotary_factor": 0.25}}}

# The random checkpoint the family's tests have transformers write (tests/family_fixtures.py): the
# wrapper with a one-block vision tower (carried), two DeltaNet layers and one full-attention layer.
TEST = dict(vision_config=_VISION, text_config=dict(
    vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
    linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
    num_experts=8, num_experts_per_tok=2, rms_norm_eps=1e-6, max_position_embeddings=256,
    layer_types=["linear_attention", "full_attention", "linear_attention"]))

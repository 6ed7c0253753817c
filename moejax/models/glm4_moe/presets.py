"""Full-size GLM-4.5 configs (values from the published config.json files), for shape work."""

_COMMON = {"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "hidden_act": "silu",
           "attention_bias": True, "head_dim": 128, "n_group": 1, "topk_group": 1, "n_shared_experts": 1,
           "norm_topk_prob": True, "num_experts_per_tok": 8, "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-5,
           "rope_theta": 1000000, "rope_scaling": None, "tie_word_embeddings": False, "vocab_size": 151552,
           "max_position_embeddings": 131072, "num_nextn_predict_layers": 1}

PRESETS = {
    "glm-4.5-air": {**_COMMON, "hidden_size": 4096, "intermediate_size": 10944, "moe_intermediate_size": 1408,
                    "num_hidden_layers": 46, "num_attention_heads": 96, "num_key_value_heads": 8,
                    "n_routed_experts": 128, "first_k_dense_replace": 1, "routed_scaling_factor": 1.0,
                    "use_qk_norm": False},
    "glm-4.5": {**_COMMON, "hidden_size": 5120, "intermediate_size": 12288, "moe_intermediate_size": 1536,
                "num_hidden_layers": 92, "num_attention_heads": 96, "num_key_value_heads": 8,
                "n_routed_experts": 160, "first_k_dense_replace": 3, "routed_scaling_factor": 2.5,
                "use_qk_norm": True},
}

# What `experiment=train_tiny arch.family=glm4_moe` trains: the DeepSeek-V3 tiny model's budget (4
# layers, the first dense, 32 experts top 4 in 4 groups, one shared expert, width 128) with GQA and
# partial rope.
TINY = {"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "hidden_act": "silu", "hidden_size": 128,
        "intermediate_size": 256, "moe_intermediate_size": 64, "num_hidden_layers": 4, "first_k_dense_replace": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "n_routed_experts": 32,
        "n_shared_experts": 1, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5,
        "norm_topk_prob": True, "use_qk_norm": True, "attention_bias": True, "partial_rotary_factor": 0.5,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 512, "tie_word_embeddings": False,
        "num_nextn_predict_layers": 0, "rope_theta": 10000.0}

# The random checkpoint the family's tests have transformers write (tests/family_fixtures.py): sigmoid
# router with balance bias and groups, shared experts, dense first layer, partial rope, per-head q/k
# norms, q/k/v biases.
TEST = dict(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=8, n_shared_experts=1,
            num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.0,
            norm_topk_prob=True, use_qk_norm=True, attention_bias=True, partial_rotary_factor=0.5, rms_norm_eps=1e-5,
            max_position_embeddings=256, num_nextn_predict_layers=0)

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

"""Full-size configs of the family (values from the published config.json files), for shape work
(`jax.eval_shape`, memory planning) without downloading anything.

    DeepseekV3Config.from_dict(PRESETS["moonlight-16b-a3b"])
"""

_YARN_DSV3 = {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
              "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}
_COMMON = {"architectures": ["DeepseekV3ForCausalLM"], "scoring_func": "sigmoid", "topk_method": "noaux_tc",
           "moe_layer_freq": 1, "hidden_act": "silu", "norm_topk_prob": True, "qk_nope_head_dim": 128,
           "qk_rope_head_dim": 64, "v_head_dim": 128, "kv_lora_rank": 512, "tie_word_embeddings": False}

PRESETS = {
    "deepseek-v3": {**_COMMON, "model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168,
                    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
                    "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536,
                    "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 8,
                    "topk_group": 4, "first_k_dense_replace": 3, "routed_scaling_factor": 2.5,
                    "rms_norm_eps": 1e-6, "rope_theta": 10000, "rope_scaling": _YARN_DSV3,
                    "max_position_embeddings": 163840, "num_nextn_predict_layers": 1},
    "kimi-k2": {**_COMMON, "model_type": "kimi_k2", "vocab_size": 163840, "hidden_size": 7168,
                "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
                "num_attention_heads": 64, "num_key_value_heads": 64, "q_lora_rank": 1536,
                "n_routed_experts": 384, "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 1,
                "topk_group": 1, "first_k_dense_replace": 1, "routed_scaling_factor": 2.827,
                "rms_norm_eps": 1e-6, "rope_theta": 50000.0,
                "rope_scaling": {**_YARN_DSV3, "factor": 32.0, "beta_fast": 1.0, "beta_slow": 1.0},
                "max_position_embeddings": 131072, "num_nextn_predict_layers": 0},
    "moonlight-16b-a3b": {**_COMMON, "model_type": "deepseek_v3", "vocab_size": 163840, "hidden_size": 2048,
                          "intermediate_size": 11264, "moe_intermediate_size": 1408, "num_hidden_layers": 27,
                          "num_attention_heads": 16, "num_key_value_heads": 16, "q_lora_rank": None,
                          "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6, "n_group": 1,
                          "topk_group": 1, "first_k_dense_replace": 1, "routed_scaling_factor": 2.446,
                          "rms_norm_eps": 1e-5, "rope_theta": 50000.0, "max_position_embeddings": 8192,
                          "num_nextn_predict_layers": 0},
}

# What `experiment=train_tiny` trains by default (~10 minutes on 2 CPU cores): 4 layers, the first
# dense, 32 experts top 4 in 4 groups, one shared expert.
TINY = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 128,
        "intermediate_size": 256, "moe_intermediate_size": 64, "num_hidden_layers": 4, "first_k_dense_replace": 1,
        "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 64, "kv_lora_rank": 32,
        "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32, "n_routed_experts": 32,
        "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2, "n_shared_experts": 1,
        "routed_scaling_factor": 2.5, "norm_topk_prob": True, "rms_norm_eps": 1e-6, "max_position_embeddings": 512,
        "hidden_act": "silu", "scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1,
        "tie_word_embeddings": False, "attention_bias": False, "rope_interleave": True,
        "num_nextn_predict_layers": 0, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}

"""Full-size Qwen2-MoE configs (values from the published config.json files), for shape work."""

PRESETS = {
    "qwen1.5-moe-a2.7b": {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "hidden_act": "silu",
                          "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632,
                          "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
                          "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16,
                          "num_experts": 60, "num_experts_per_tok": 4, "norm_topk_prob": False,
                          "decoder_sparse_step": 1, "rms_norm_eps": 1e-6, "max_position_embeddings": 8192,
                          "rope_theta": 1000000.0, "tie_word_embeddings": False, "use_sliding_window": False,
                          "sliding_window": 32768},
}

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

# What `experiment=train_tiny arch.family=qwen2_moe` trains: the DeepSeek-V3 tiny model's budget (4
# layers, the first dense, 32 experts top 4, one gated shared expert of width 64, width 128).
TINY = {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "hidden_act": "silu", "hidden_size": 128,
        "intermediate_size": 256, "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64,
        "num_hidden_layers": 4, "mlp_only_layers": [0], "decoder_sparse_step": 1, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_experts": 32, "num_experts_per_tok": 4, "norm_topk_prob": False,
        "qkv_bias": True, "rms_norm_eps": 1e-6, "max_position_embeddings": 512, "tie_word_embeddings": False,
        "use_sliding_window": False, "rope_theta": 10000.0}

# The random checkpoint the family's tests have transformers write (tests/family_fixtures.py): a shared
# expert gated by sigmoid(x . w), q/k/v biases, no renormalisation, layer 1 dense.
TEST = dict(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
            shared_expert_intermediate_size=48, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=[1], qkv_bias=True,
            rms_norm_eps=1e-6, max_position_embeddings=256)

"""Full-size Qwen3-Next configs (the published config.json), for shape work."""

PRESETS = {
    "qwen3-next-80b-a3b": {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "hidden_act": "silu",
                           "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5120,
                           "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2,
                           "head_dim": 256, "partial_rotary_factor": 0.25, "rope_theta": 10000000,
                           "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
                           "attention_bias": False, "full_attention_interval": 4, "linear_conv_kernel_dim": 4,
                           "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_num_key_heads": 16,
                           "linear_num_value_heads": 32, "decoder_sparse_step": 1, "mlp_only_layers": [],
                           "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
                           "num_experts": 512, "num_experts_per_tok": 10, "norm_topk_prob": True},
}

# What `experiment=train_tiny arch.family=qwen3_next` trains: the tiny models' budget (4 layers, the
# last full attention, 32 experts top 4 with a gated shared expert, width 128).
TINY = {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "hidden_act": "silu",
        "hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 32, "linear_value_head_dim": 32,
        "linear_conv_kernel_dim": 4, "num_experts": 32, "num_experts_per_tok": 4, "norm_topk_prob": True,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 512, "tie_word_embeddings": False, "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25}

# The random checkpoint the family's tests have transformers write (tests/family_fixtures.py): two
# DeltaNet layers and one full-attention layer (the schedule given by layer_types), layer 1 dense.
TEST = dict(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
            shared_expert_intermediate_size=48, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
            linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2,
            norm_topk_prob=True, mlp_only_layers=[1], rms_norm_eps=1e-6, max_position_embeddings=256,
            layer_types=["linear_attention", "full_attention", "linear_attention"])

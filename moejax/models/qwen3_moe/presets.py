"""Full-size Qwen3-MoE configs (values from the published config.json files), for shape work."""

_COMMON = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_act": "silu",
           "attention_bias": False, "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
           "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "use_sliding_window": False, "head_dim": 128,
           "vocab_size": 151936, "rope_theta": 1000000.0, "rope_scaling": None, "max_position_embeddings": 40960}

PRESETS = {
    "qwen3-30b-a3b": {**_COMMON, "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
                      "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
                      "num_experts": 128, "num_experts_per_tok": 8},
    "qwen3-235b-a22b": {**_COMMON, "hidden_size": 4096, "intermediate_size": 12288, "moe_intermediate_size": 1536,
                        "num_hidden_layers": 94, "num_attention_heads": 64, "num_key_value_heads": 4,
                        "num_experts": 128, "num_experts_per_tok": 8},
}

# What `experiment=train_tiny arch.family=qwen3_moe` trains: the DeepSeek-V3 tiny model's budget
# (4 layers, the first dense, 32 experts top 4, width 128) with Qwen3-MoE's softmax router and GQA.
TINY = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_act": "silu",
        "hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 64, "num_hidden_layers": 4,
        "mlp_only_layers": [0], "decoder_sparse_step": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "num_experts": 32, "num_experts_per_tok": 4, "norm_topk_prob": True, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 512, "tie_word_embeddings": False, "attention_bias": False,
        "use_sliding_window": False, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}

# The random checkpoint the family's tests have transformers write (tests/family_fixtures.py): an
# explicit head_dim (!= hidden / heads), layer 0 dense through mlp_only_layers, renormalised top-k.
TEST = dict(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=24, num_experts=8, num_experts_per_tok=2,
            norm_topk_prob=True, mlp_only_layers=[0], rms_norm_eps=1e-6, max_position_embeddings=256,
            rope_theta=10000.0)

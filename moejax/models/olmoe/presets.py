"""Full-size OLMoE config (allenai/OLMoE-1B-7B-0924's config.json), for shape work."""

PRESETS = {
    "olmoe-1b-7b": {"architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", "hidden_act": "silu",
                    "vocab_size": 50304, "hidden_size": 2048, "intermediate_size": 1024, "num_hidden_layers": 16,
                    "num_attention_heads": 16, "num_key_value_heads": 16, "num_experts": 64,
                    "num_experts_per_tok": 8, "norm_topk_prob": False, "rms_norm_eps": 1e-5,
                    "max_position_embeddings": 4096, "rope_theta": 10000.0, "tie_word_embeddings": False,
                    "attention_bias": False, "clip_qkv": None},
}

# What `experiment=train_tiny arch.family=olmoe` trains: the DeepSeek-V3 tiny model's budget (4 layers,
# 32 experts top 4, width 128; every OLMoE layer is MoE, experts of width 64).
TINY = {"architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", "hidden_act": "silu", "hidden_size": 128,
        "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4,
        "num_experts": 32, "num_experts_per_tok": 4, "norm_topk_prob": False, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 512, "tie_word_embeddings": False, "attention_bias": False, "clip_qkv": None,
        "rope_theta": 10000.0}

# The random checkpoint the family's tests have transformers write (tests/family_fixtures.py): q/k norms
# over the whole projection, top-k without renormalisation, attention biases, tied head.
TEST = dict(vocab_size=96, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, num_experts=8, num_experts_per_tok=3, norm_topk_prob=False, attention_bias=True,
            tie_word_embeddings=True, rms_norm_eps=1e-5, max_position_embeddings=256, pad_token_id=0, eos_token_id=1)

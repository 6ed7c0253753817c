"""Full-size Mixtral configs (values from the published config.json files), for shape work."""

_COMMON = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_act": "silu",
           "num_experts_per_tok": 2, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "sliding_window": None,
           "router_aux_loss_coef": 0.02}

PRESETS = {
    "mixtral-8x7b": {**_COMMON, "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
                     "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                     "num_local_experts": 8, "rope_theta": 1e6, "max_position_embeddings": 32768},
    "mixtral-8x22b": {**_COMMON, "vocab_size": 32768, "hidden_size": 6144, "intermediate_size": 16384,
                      "num_hidden_layers": 56, "num_attention_heads": 48, "num_key_value_heads": 8,
                      "num_local_experts": 8, "rope_theta": 1e6, "max_position_embeddings": 65536},
}

# What `experiment=train_tiny arch.family=mixtral` trains: the DeepSeek-V3 tiny model's budget (4
# layers, 32 experts top 4, width 128; every Mixtral layer is MoE, experts of width 64).
TINY = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_act": "silu", "hidden_size": 128,
        "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_local_experts": 32, "num_experts_per_tok": 4, "rms_norm_eps": 1e-6, "max_position_embeddings": 512,
        "tie_word_embeddings": False, "sliding_window": None, "rope_theta": 10000.0}

# The random checkpoint the family's tests have transformers write (tests/family_fixtures.py): every
# layer MoE, renormalised over the top-k, no biases or q/k norms.
TEST = dict(vocab_size=96, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, rms_norm_eps=1e-5,
            max_position_embeddings=256, rope_theta=1e6)

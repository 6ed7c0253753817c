"""Full-size gpt-oss configs (the published config.json files, quantization_config aside: the
released experts are MXFP4), for shape work."""

_LAYER_TYPES = lambda n: ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]  # noqa: E731


def _gpt_oss(layers: int, experts: int) -> dict:
    return {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True,
            "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
            "initial_context_length": 4096, "intermediate_size": 2880, "layer_types": _LAYER_TYPES(layers),
            "max_position_embeddings": 131072, "num_attention_heads": 64, "num_experts_per_tok": 4,
            "num_hidden_layers": layers, "num_key_value_heads": 8, "num_local_experts": experts,
            "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                                     "original_max_position_embeddings": 4096,
                                                     "rope_type": "yarn", "truncate": False},
            "rope_theta": 150000, "sliding_window": 128, "swiglu_limit": 7.0, "tie_word_embeddings": False,
            "vocab_size": 201088}


PRESETS = {"gpt-oss-20b": _gpt_oss(24, 32), "gpt-oss-120b": _gpt_oss(36, 128)}

# What `experiment=train_tiny arch.family=gpt_oss` trains: the tiny models' budget (4 layers, 32
# experts top 4, width 128), with a window shorter than the training sequences.
TINY = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 128, "intermediate_size": 64,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "num_local_experts": 32, "num_experts_per_tok": 4, "sliding_window": 64, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 512, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0,
                            "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 128}}

# The random checkpoint the family's tests have transformers write (tests/family_fixtures.py): YaRN,
# sinks, a window of 8 (shorter than the test sequences), a layer of each kind and one more sliding.
TEST = dict(vocab_size=96, hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=8,
            rms_norm_eps=1e-5, max_position_embeddings=256, swiglu_limit=1.5,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0,
                             "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64})

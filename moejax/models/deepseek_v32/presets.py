"""Full-size DeepSeek-V3.2 configs, for shape work (`jax.eval_shape`, memory planning).

deepseek-v3.2-exp: DeepSeek-V3's published shapes (`moejax.models.deepseek_v3.presets`: the same
MLA, router, experts and YaRN rope) with DeepSeek-V3.2-Exp's indexer (index_n_heads 64,
index_head_dim 128, index_topk 2048, as transformers' DeepseekV32Config defaults for
`deepseek-ai/DeepSeek-V3.2-Exp` and the published config.json give them) and 163,840 positions."""

from moejax.models.deepseek_v3.presets import PRESETS as DEEPSEEK_V3_PRESETS

_ARCH = {"architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32"}

PRESETS = {
    "deepseek-v3.2-exp": {**DEEPSEEK_V3_PRESETS["deepseek-v3"], **_ARCH, "index_n_heads": 64, "index_head_dim": 128,
                          "index_topk": 2048},
}

# What `experiment=train_tiny arch.family=deepseek_v32` trains: DeepSeek-V3's tiny model (4 layers,
# the first dense, 32 experts top 4 in 4 groups, one shared expert, width 128) with an indexer of 4
# heads of 32 selecting 64 keys (shorter than the training sequences).
TINY = {"architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32", "hidden_size": 128,
        "intermediate_size": 256, "moe_intermediate_size": 64, "num_hidden_layers": 4, "first_k_dense_replace": 1,
        "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 64, "kv_lora_rank": 32,
        "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32, "n_routed_experts": 32,
        "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2, "n_shared_experts": 1,
        "routed_scaling_factor": 2.5, "norm_topk_prob": True, "rms_norm_eps": 1e-6, "max_position_embeddings": 512,
        "hidden_act": "silu", "tie_word_embeddings": False, "attention_bias": False, "num_nextn_predict_layers": 0,
        "index_n_heads": 4, "index_head_dim": 32, "index_topk": 64,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}

# The random checkpoint the family's tests have transformers write (tests/family_fixtures.py):
# DeepSeek-V3's test shapes (hf_fixtures.BASE: q LoRA, v_head_dim != qk_nope_head_dim, 8 experts top
# 2, 2 shared experts, dense layer 0; 2 routing groups, as the shared tests prune to 6, 5 and 4
# experts) with YaRN (its attention factor scales the indexer's rope too) and an indexer of 8 heads
# of 16 keeping 5 keys: the test sequences (12 to 20 tokens) are longer, so the selection excludes
# keys in every layer.
TEST = dict(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16,
            qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=2,
            n_group=2, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
            rms_norm_eps=1e-6, max_position_embeddings=256, tie_word_embeddings=False, index_n_heads=8,
            index_head_dim=16, index_topk=5,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                             "mscale_all_dim": 1.0})

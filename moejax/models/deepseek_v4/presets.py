"""Full-size DeepSeek-V4 configs, for shape work (`jax.eval_shape`, memory planning).

Every shape field is the published config.json's (deepseek-ai/DeepSeek-V4-Flash, deepseek-ai/DeepSeek-V4-Pro;
`transformers_version` 4.57.1). The Hub itself is not reachable from here: both files were read in
verbatim copies kept in public GitHub repositories (model reports quoting
`.../DeepSeek-V4-Flash/config.json` and `.../deepseek-ai/DeepSeek-V4-Pro/config.json` whole, with
their safetensors weight listings), and agree with inference projects' fixtures transcribed from the
checkpoints (V4-Flash's 44-entry `compress_ratios`, V4-Pro's 62): V4-Flash hidden 4096, 43 layers, 64
heads of 512 (rope 64), q LoRA 1024, 256 experts top 6 of width 2048, one shared, routed scale 1.5,
8 output groups of rank 1024, an indexer of 64 heads of 128 keeping 512; V4-Pro hidden 7168, 61
layers, 128 heads, q LoRA 1536, 384 experts top 6 of width 3072, routed scale 2.5, 16 output groups
of rank 1024, indexer keeping 1024; both: window 128, 4 hyper-connection streams (20 Sinkhorn
iterations, eps 1e-6), the first 3 layers hash-routed, swiglu_limit 10, rope 10000 / compressed
160000 with YaRN x16 from 65,536, vocabulary 129,280, untied head, one MTP layer, FP8 (e4m3, ue8m0
scales) Linear weights with FP4 routed experts (int8-packed pairs with a ue8m0 scale per 32, as the
weight listings show: V4-Flash `layers.*.ffn.experts.*.w1.weight` I8 [2048, 2048] beside F8_E8M0
[2048, 128]). The attention schedules differ: V4-Flash's `compress_ratios` starts with 2 sliding
layers, V4-Pro's with 2 HCA layers (transformers' default), each then CSA / HCA alternating and a
last entry for the MTP block. `expert_dtype: "fp4"` is set as DeepSeek-V4-Flash-0731's config.json
spells it (transformers moves it into quantization_config; the first upload's config.json lacked it).

Parameter counts (moejax's instantiated model, no MTP block; tests/test_deepseek_v4.py checks them):
V4-Flash 284.3B total, 13.3B active without the input embedding (published: 284B / 13B); V4-Pro
1.573T total, 48.9B active likewise (published: 1.6T / 49B), as DeepSeek's model cards state them
(quoted by OpenRouter's and Venice's model pages)."""

_COMMON = {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "vocab_size": 129280,
           "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64, "n_shared_experts": 1,
           "num_experts_per_tok": 6, "scoring_func": "sqrtsoftplus", "norm_topk_prob": True, "hidden_act": "silu",
           "rope_theta": 10000.0, "compress_rope_theta": 160000.0, "max_position_embeddings": 1048576,
           "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                            "beta_fast": 32, "beta_slow": 1},
           "num_hash_layers": 3, "hc_mult": 4,
           "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "swiglu_limit": 10.0, "sliding_window": 128,
           "index_n_heads": 64, "index_head_dim": 128, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
           "num_nextn_predict_layers": 1, "expert_dtype": "fp4",
           "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                   "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}}

# config.json's `compress_ratios` (0 sliding, 4 CSA, 128 HCA), one entry per layer and a last one (0)
# for the MTP block, which transformers' reading cuts to num_hidden_layers
FLASH_RATIOS = [0, 0] + [4, 128] * 20 + [4, 0]      # 44 entries: 2 sliding, then CSA / HCA alternating
PRO_RATIOS = [128, 128] + [4, 128] * 29 + [4, 0]    # 62 entries: 2 HCA, then CSA / HCA alternating

PRESETS = {
    "deepseek-v4-flash": {**_COMMON, "compress_ratios": FLASH_RATIOS, "hidden_size": 4096, "num_hidden_layers": 43,
                          "num_attention_heads": 64,
                          "q_lora_rank": 1024, "n_routed_experts": 256, "moe_intermediate_size": 2048,
                          "routed_scaling_factor": 1.5, "o_groups": 8, "o_lora_rank": 1024, "index_topk": 512},
    "deepseek-v4-pro": {**_COMMON, "compress_ratios": PRO_RATIOS, "hidden_size": 7168, "num_hidden_layers": 61,
                        "num_attention_heads": 128,
                        "q_lora_rank": 1536, "n_routed_experts": 384, "moe_intermediate_size": 3072,
                        "routed_scaling_factor": 2.5, "o_groups": 16, "o_lora_rank": 1024, "index_topk": 1024},
}

# What `experiment=train_tiny arch.family=deepseek_v4` would train: the tiny models' budget (4 layers,
# 32 experts top 4, width 128), a layer of each attention kind, the first layer hash-routed.
TINY = {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "hidden_size": 128,
        "moe_intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 1,
        "head_dim": 32, "q_lora_rank": 64, "partial_rotary_factor": 0.5, "n_routed_experts": 32,
        "num_experts_per_tok": 4, "n_shared_experts": 1, "routed_scaling_factor": 1.5, "scoring_func": "sqrtsoftplus",
        "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                        "compressed_sparse_attention"],
        "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"],
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
        "sliding_window": 32, "o_groups": 2, "o_lora_rank": 32, "index_n_heads": 4, "index_head_dim": 32,
        "index_topk": 16, "hc_mult": 4, "rms_norm_eps": 1e-6, "max_position_embeddings": 512,
        "tie_word_embeddings": False, "hidden_act": "silu"}

# The random checkpoint the family's tests have transformers write (tests/family_fixtures.py): every
# attention kind (sliding; CSA with an indexer keeping 2 of the entries, fewer than the test
# sequences give; HCA) and both MoE kinds (2 hash layers, 2 routed), 3 hyper-connection streams,
# partial rope (8 of 16 channels) with YaRN on the compressed branches, a clamp the experts reach.
TEST = dict(vocab_size=96, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=4, num_attention_heads=4,
            head_dim=16, q_lora_rank=24, partial_rotary_factor=0.5, n_routed_experts=8, num_experts_per_tok=2,
            layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                         "compressed_sparse_attention"],
            mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
            compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
            hc_mult=3, sliding_window=8, o_groups=2, o_lora_rank=8, index_n_heads=8, index_head_dim=8,
            index_topk=2, swiglu_limit=0.8, rms_norm_eps=1e-6, max_position_embeddings=64,
            rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                             "beta_fast": 32.0, "beta_slow": 1.0})

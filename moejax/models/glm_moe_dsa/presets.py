"""Full-size GLM-5 configs, for shape work.

glm-5: the sizes of `zai-org/GLM-5` as transformers' GlmMoeDsaConfig defaults give them (78 layers,
3 dense, 256 experts top 8 + 1 shared, MLA q LoRA 2048 / kv LoRA 512, heads 64 of 192 + 64 / 256,
indexer 32 heads of 128 keeping 2048) and the GLM-5 technical report's table agrees; one MTP layer;
rope theta 1e6 (xLLM's GLM-5 model arguments, taken from the published config.json; transformers'
default is 1e4); every layer runs its indexer.
glm-5.2: GLM-5's shapes with GLM-5.2's index sharing (index_topk_freq 4, index_skip_topk_offset 3:
21 full layers, 0, 1, 2, 6, ..., 74), 1,048,576 positions, rope theta 8e6 and head_dim 192 (which
transformers overwrites), as its published config.json has them."""

_GLM5 = {"architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", "vocab_size": 154880,
         "hidden_size": 6144, "intermediate_size": 12288, "moe_intermediate_size": 2048, "num_hidden_layers": 78,
         "num_attention_heads": 64, "num_key_value_heads": 64, "q_lora_rank": 2048, "kv_lora_rank": 512,
         "qk_nope_head_dim": 192, "qk_rope_head_dim": 64, "v_head_dim": 256, "n_routed_experts": 256,
         "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 3,
         "routed_scaling_factor": 2.5, "norm_topk_prob": True, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
         "moe_layer_freq": 1, "hidden_act": "silu", "rms_norm_eps": 1e-5, "attention_bias": False,
         "tie_word_embeddings": False, "max_position_embeddings": 202752, "num_nextn_predict_layers": 1,
         "index_n_heads": 32, "index_head_dim": 128, "index_topk": 2048,
         "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}

PRESETS = {
    "glm-5": _GLM5,
    "glm-5.2": {**_GLM5, "max_position_embeddings": 1048576, "head_dim": 192, "index_topk_freq": 4,
                "index_skip_topk_offset": 3, "rope_parameters": {"rope_type": "default", "rope_theta": 8000000}},
}

# What `experiment=train_tiny arch.family=glm_moe_dsa` trains: the tiny models' budget (4 layers, the
# first dense, 32 experts top 4, one shared expert, width 128), an indexer of 4 heads of 32 keeping
# 64 keys, layer 2 sharing layer 1's selection.
TINY = {"architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", "hidden_size": 128,
        "intermediate_size": 256, "moe_intermediate_size": 64, "num_hidden_layers": 4, "first_k_dense_replace": 1,
        "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 64, "kv_lora_rank": 32,
        "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32, "n_routed_experts": 32,
        "num_experts_per_tok": 4, "n_group": 1, "topk_group": 1, "n_shared_experts": 1,
        "routed_scaling_factor": 2.5, "norm_topk_prob": True, "rms_norm_eps": 1e-5, "max_position_embeddings": 512,
        "hidden_act": "silu", "tie_word_embeddings": False, "attention_bias": False, "num_nextn_predict_layers": 0,
        "index_n_heads": 4, "index_head_dim": 32, "index_topk": 64,
        "indexer_types": ["full", "full", "shared", "full"],
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}

# The random checkpoint the family's tests have transformers write (tests/family_fixtures.py): MLA
# with v_head_dim != qk_nope_head_dim, 8 experts top 2 in 2 groups, one shared expert, dense layer 0,
# default rope, an indexer of 8 heads of 16 (interleaved rope) keeping 4 keys on every layer (GLM-5's
# schedule; tests/test_dsa_families.py adds GLM-5.2's "shared" layers).
TEST = dict(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16,
            qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
            n_group=2, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.0, norm_topk_prob=True,
            rms_norm_eps=1e-5, max_position_embeddings=256, tie_word_embeddings=False, index_n_heads=8,
            index_head_dim=16, index_topk=4, indexer_types=["full", "full", "full"],
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0})

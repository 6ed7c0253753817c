"""Tiny random checkpoints of the five GQA families (every family but DeepSeek-V3, whose fixtures are
in hf_fixtures.py), made by transformers 5 itself (the reference we did not write), hardened like the
DeepSeek-V3 fixtures: norms randomised, router rows wide so routing is decisive, attention biases and
balance biases random and partly negative.

FAMILIES[name] = (transformers class name, config kwargs): each exercises the family's particular
settings (explicit head_dim, dense layers, q/k norms over heads or whole projections, partial rope,
groups, shared experts, no renormalisation)."""

from __future__ import annotations

from hf_fixtures import harden

FAMILIES = {
    # explicit head_dim (!= hidden / heads), layer 0 dense through mlp_only_layers, renormalised top-k
    "qwen3_moe": ("Qwen3Moe", dict(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                                   num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                                   num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0],
                                   rms_norm_eps=1e-6, max_position_embeddings=256, rope_theta=10000.0)),
    # every layer MoE, renormalised over the top-k, no biases or q/k norms
    "mixtral": ("Mixtral", dict(vocab_size=96, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
                                num_experts_per_tok=2, rms_norm_eps=1e-5, max_position_embeddings=256,
                                rope_theta=1e6)),
    # q/k norms over the whole projection, top-k without renormalisation, attention biases, tied head
    "olmoe": ("Olmoe", dict(vocab_size=96, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=3,
                            norm_topk_prob=False, attention_bias=True, tie_word_embeddings=True,
                            rms_norm_eps=1e-5, max_position_embeddings=256, pad_token_id=0, eos_token_id=1)),
    # sigmoid router with balance bias and groups, shared experts, dense first layer, partial rope,
    # per-head q/k norms, q/k/v biases
    "glm4_moe": ("Glm4Moe", dict(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                                 num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                 n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2,
                                 topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.0,
                                 norm_topk_prob=True, use_qk_norm=True, attention_bias=True,
                                 partial_rotary_factor=0.5, rms_norm_eps=1e-5, max_position_embeddings=256,
                                 num_nextn_predict_layers=0)),
    # a shared expert gated by sigmoid(x . w), q/k/v biases, no renormalisation, layer 1 dense
    "qwen2_moe": ("Qwen2Moe", dict(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                                   shared_expert_intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                                   num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
                                   mlp_only_layers=[1], qkv_bias=True, rms_norm_eps=1e-6,
                                   max_position_embeddings=256)),
}


def hf_classes(family: str):
    import transformers

    prefix = FAMILIES[family][0]
    return getattr(transformers, prefix + "Config"), getattr(transformers, prefix + "ForCausalLM")


def make_family_checkpoint(family: str, path, seed=0, dtype="float32", save_original_format=True, **overrides):
    """Save a random transformers model of `family` to `path` (save_original_format=False:
    transformers 5's fused expert tensors, `mlp.experts.gate_up_proj` / `down_proj`); returns the
    torch model (eval)."""
    import torch

    config_cls, model_cls = hf_classes(family)
    torch.manual_seed(seed)
    kw = {**FAMILIES[family][1], "initializer_range": 0.15, **overrides}
    cfg = config_cls(**kw, attn_implementation="eager", experts_implementation="eager")
    model = harden(model_cls(cfg).eval())
    if dtype == "bfloat16":
        model = model.to(torch.bfloat16)
    model.save_pretrained(path, save_original_format=save_original_format)
    return model


def moe_blocks(hf) -> dict:
    """{layer: the transformers MoE block} of every MoE layer (the block has a router `gate`)."""
    return {l: layer.mlp for l, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "gate")}

"""Qwen3-Next's HF name table: on `linear_attention` layers the Gated DeltaNet
(`linear_attn.*`, `moejax.models.gated_deltanet`'s parameters, held as the layer's attention
`self_attn`), on `full_attention` layers grouped-query attention with per-head q/k norms and a q_proj
twice as wide (each head's query, then its output gate); the MoE block of Qwen2-MoE (router
`mlp.gate`, experts `mlp.experts.{e}.*`, one gated shared expert)."""

from moejax.models.gqa_names import gqa_rules
from moejax.models.names import L, Rule, check_table, dense_mlp_rules, embedding_rules, moe_rules, norm_rules


def full_attention(cfg, layer):
    return not cfg.is_linear_attention(layer)


def _linear(cfg, layer):
    return cfg.is_linear_attention(layer)


def deltanet_rules(layout: str) -> tuple:
    """The Gated DeltaNet's tensors (`linear_attn.*`) in its two projection layouts."""
    hf, param = L + "linear_attn.", L + "self_attn."

    def conv(cfg):  # q, k and v channels
        return 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + cfg.linear_num_value_heads * cfg.linear_value_head_dim

    def nv(cfg):
        return cfg.linear_num_value_heads * cfg.linear_value_head_dim

    def proj(name, width):
        return Rule("linear_" + name, hf + name + ".weight", param + name, True, lambda cfg: (width(cfg), cfg.hidden_size),
                    when=_linear)

    if layout == "qwen3_next":
        projections = (proj("in_proj_qkvz", lambda cfg: conv(cfg) + nv(cfg)),
                       proj("in_proj_ba", lambda cfg: 2 * cfg.linear_num_value_heads))
    else:
        projections = (proj("in_proj_qkv", conv), proj("in_proj_z", nv),
                       proj("in_proj_b", lambda cfg: cfg.linear_num_value_heads),
                       proj("in_proj_a", lambda cfg: cfg.linear_num_value_heads))
    return projections + (
        Rule("linear_conv1d", hf + "conv1d.weight", param + "conv1d", False,
             lambda cfg: (conv(cfg), 1, cfg.linear_conv_kernel_dim), when=_linear),
        Rule("linear_dt_bias", hf + "dt_bias", param + "dt_bias", False, lambda cfg: (cfg.linear_num_value_heads,),
             when=_linear),
        Rule("linear_A_log", hf + "A_log", param + "A_log", False, lambda cfg: (cfg.linear_num_value_heads,),
             when=_linear),
        Rule("linear_norm", hf + "norm.weight", param + "norm.weight", False, lambda cfg: (cfg.linear_value_head_dim,),
             when=_linear),
        Rule("linear_out_proj", hf + "out_proj.weight", param + "out_proj", True, lambda cfg: (cfg.hidden_size, nv(cfg)),
             when=_linear),
    )


RULES = check_table(embedding_rules() + norm_rules() + gqa_rules(when=full_attention) + deltanet_rules("qwen3_next")
                    + dense_mlp_rules()
                    + moe_rules(shared=lambda cfg: cfg.shared_intermediate_size, shared_name="shared_expert",
                                shared_gate=True))

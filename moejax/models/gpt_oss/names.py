"""gpt-oss's HF name table: GQA with biases on q/k/v/o and a sink logit per head
(`self_attn.sinks`), the router with its logit bias (`mlp.router.weight`, `mlp.router.bias`), and
the routed experts, which gpt-oss stores only fused:

    mlp.experts.gate_up_proj       [E, H, 2F]   x @ W: gate columns even, up odd
    mlp.experts.gate_up_proj_bias  [E, 2F]
    mlp.experts.down_proj          [E, F, H]
    mlp.experts.down_proj_bias     [E, H]

Expert e's slab of each is presented as `mlp.experts.{e}.<name>` (`moejax.hf.fused_experts`,
`FUSED`), the per-expert names every checkpoint tool reads; they are stored [in, out] already, so
nothing is transposed, and every output is written fused again."""

from moejax.models.gqa_names import gqa_rules
from moejax.models.names import L, Rule, check_table, embedding_rules, moe_layer, norm_rules

_M = L + "mlp."


def _expert(name: str, shape) -> Rule:
    return Rule("expert_" + name, _M + "experts.{e}." + name, _M + "experts_" + name.removesuffix("_proj")
                .replace("_proj_", "_"), False, shape, when=moe_layer, per_expert=True)


RULES = check_table(embedding_rules() + norm_rules() + gqa_rules() + (
    Rule("sinks", L + "self_attn.sinks", L + "self_attn.sinks", False, lambda cfg: (cfg.num_attention_heads,)),
    Rule("router", _M + "router.weight", _M + "router", False, lambda cfg: (None, cfg.hidden_size), when=moe_layer),
    Rule("router_bias", _M + "router.bias", _M + "router_bias", False, lambda cfg: (None,), when=moe_layer),
    _expert("gate_up_proj", lambda cfg: (cfg.hidden_size, 2 * cfg.moe_intermediate_size)),
    _expert("gate_up_proj_bias", lambda cfg: (2 * cfg.moe_intermediate_size,)),
    _expert("down_proj", lambda cfg: (cfg.moe_intermediate_size, cfg.hidden_size)),
    _expert("down_proj_bias", lambda cfg: (cfg.hidden_size,)),
))

# The fused tensors: stored name (after `mlp.experts.`) -> the per-expert rules its slab of expert e
# holds, in row order (each here the whole slab)
FUSED = {"gate_up_proj": ("expert_gate_up_proj",), "gate_up_proj_bias": ("expert_gate_up_proj_bias",),
         "down_proj": ("expert_down_proj",), "down_proj_bias": ("expert_down_proj_bias",)}

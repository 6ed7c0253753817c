"""DeepSeek-V3-family configuration (DeepSeek-V3/V3.1/R1, Kimi-K2, Moonlight): multi-head latent
attention's fields, the rope settings resolved the way transformers does (default or YaRN), the
checks between fields, and what moejax does not implement, refused. config.json is read by the
reader every family shares (`moejax.models.config_base.MoeConfig.from_dict`): every key moejax reads
is checked for its type and range before use, and every problem found is reported together in one
`ConfigError` that names the file, the key, the value given and what was expected.

`raw` keeps the file's dictionary untouched, so a checkpoint written back carries an equivalent
(indeed identical) config, quantization_config and unknown keys included.
"""

from __future__ import annotations


from moejax.errors import ConfigError
from moejax.models.config_base import (BOOL, POS_INT, POS_INT_OR_NULL, MoeConfig, SigmoidGroupRouter,
                                       check, check_fields, family_config, key, layer_num_experts, message)
from moejax.models.rope_settings import RopeConfig, rope_from_dict, yarn_mscale  # noqa: F401 (yarn_mscale: re-export)

MODEL_TYPES = ("deepseek_v3", "kimi_k2")
ARCHITECTURE = "DeepseekV3ForCausalLM"


@family_config("DeepSeek-V3", MODEL_TYPES, ARCHITECTURE)
class DeepseekV3Config(SigmoidGroupRouter, MoeConfig):
    DEFAULTS = dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432, num_hidden_layers=61,
                    num_attention_heads=128, num_experts_per_tok=8, rms_norm_eps=1e-6, max_position_embeddings=4096,
                    moe_intermediate_size=2048, n_routed_experts=256, routed_scaling_factor=2.5, n_group=8,
                    topk_group=4, first_k_dense_replace=3)

    # multi-head latent attention
    kv_lora_rank: int = key(POS_INT, 512)
    q_lora_rank: int | None = key(POS_INT_OR_NULL, 1536)
    qk_rope_head_dim: int = key(POS_INT, 64)
    v_head_dim: int = key(POS_INT, 128)
    qk_nope_head_dim: int = key(POS_INT, 128)
    rope_interleave: bool = key(BOOL, True)
    attention_bias: bool = key(BOOL, False)
    rope: RopeConfig = RopeConfig()

    # --- derived sizes -------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def softmax_scale(self) -> float:
        """qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 for YaRN (transformers)."""
        scale = self.qk_head_dim ** -0.5
        if self.rope.rope_type != "default" and self.rope.mscale_all_dim:
            scale *= yarn_mscale(self.rope.factor, self.rope.mscale_all_dim) ** 2
        return scale

    # --- reading (what the fields do not say) --------------------------------------------
    @classmethod
    def _read_rest(cls, d, valid, merged, problems, unimplemented, uniform_experts) -> dict:
        """MLA's keys that must agree with the fields, the settings moejax does not implement, the
        rope (default or YaRN), the per-layer expert counts and the group routing."""
        extra = {}  # keys checked but not kept: they must agree with the fields
        for name in ("num_key_value_heads", "head_dim", "qk_head_dim", "moe_layer_freq"):
            if d.get(name) is not None and check(name, d[name], POS_INT, problems):
                extra[name] = d[name]
        if d.get("scoring_func", "sigmoid") != "sigmoid":
            unimplemented.append(f"scoring_func={d['scoring_func']!r} (only 'sigmoid' is implemented)")
        if d.get("topk_method", "noaux_tc") != "noaux_tc":
            unimplemented.append(f"topk_method={d['topk_method']!r} (only 'noaux_tc' is implemented)")
        if extra.get("moe_layer_freq", 1) != 1:
            unimplemented.append(f"moe_layer_freq={d['moe_layer_freq']!r} (only 1 is implemented)")
        if d.get("hidden_act", "silu") != "silu":
            unimplemented.append(f"hidden_act={d['hidden_act']!r} (only 'silu' is implemented)")
        n_heads = merged.get("num_attention_heads")
        if n_heads is not None and extra.get("num_key_value_heads", n_heads) != n_heads:
            unimplemented.append(f"num_key_value_heads={d['num_key_value_heads']} differs from "
                                 f"num_attention_heads={n_heads} (MLA needs them equal)")
        rope_dim = merged.get("qk_rope_head_dim")
        if rope_dim is not None and extra.get("head_dim", rope_dim) != rope_dim:
            unimplemented.append(f"head_dim={d['head_dim']} differs from qk_rope_head_dim={rope_dim} "
                                 "(transformers would use head_dim as the rope dimension)")
        nope_dim = merged.get("qk_nope_head_dim")
        if None not in (rope_dim, nope_dim) and extra.get("qk_head_dim", rope_dim + nope_dim) != rope_dim + nope_dim:
            problems.append(f"qk_head_dim={d['qk_head_dim']} differs from qk_nope_head_dim + qk_rope_head_dim = "
                            f"{nope_dim} + {rope_dim}")
        rope = rope_from_dict(d, merged, problems, unimplemented)
        layer_counts = _layer_num_experts(d, merged, problems, unimplemented, uniform_experts)
        problems += _relations(merged)
        return dict(rope=rope, layer_num_experts=layer_counts)

    def validate(self, source: str = "config") -> None:
        """Check this config's fields (types, ranges, group routing): one ConfigError naming them all."""
        problems: list[str] = []
        valid = check_fields({name: getattr(self, name) for name in self.FIELD_RULES}, self.FIELD_RULES, problems)
        problems += _relations(valid)
        if problems:
            raise ConfigError(message(source, problems, []))

    def _written(self) -> dict:
        rp = {"rope_type": self.rope.rope_type, "rope_theta": self.rope.theta}
        if self.rope.rope_type == "yarn":
            rp.update({k: getattr(self.rope, k) for k in ("factor", "original_max_position_embeddings", "beta_fast",
                                                          "beta_slow", "mscale", "mscale_all_dim")})
        return dict(num_key_value_heads=self.num_attention_heads, scoring_func="sigmoid", topk_method="noaux_tc",
                    moe_layer_freq=1, hidden_act="silu", rope_parameters=rp)


# --- checking ------------------------------------------------------------------------------

def _relations(v: dict) -> list[str]:
    """Constraints between fields, over those that passed their own check (`v`)."""
    out = []
    E, G, k, tg = (v.get(n) for n in ("n_routed_experts", "n_group", "num_experts_per_tok", "topk_group"))
    if E is not None and k is not None and k > E:
        out.append(f"num_experts_per_tok={k} exceeds n_routed_experts={E}")
    if E is not None and G is not None:
        if E % G:
            out.append(f"n_routed_experts={E} is not divisible by n_group={G}")
        elif G > 1 and E // G < 2:
            out.append(f"group-limited routing needs at least 2 experts per group, got n_routed_experts={E} / "
                       f"n_group={G} = {E // G}")
        elif tg is not None and k is not None and 1 <= tg <= G and k <= E and k > tg * (E // G):
            out.append(f"num_experts_per_tok={k} exceeds the experts of the chosen groups "
                       f"(topk_group={tg} x {E // G})")
    if G is not None and tg is not None and not 1 <= tg <= G:
        out.append(f"topk_group={tg} must lie in [1, n_group={G}]")
    if v.get("qk_rope_head_dim") is not None and v["qk_rope_head_dim"] % 2:
        out.append(f"qk_rope_head_dim={v['qk_rope_head_dim']} must be even")
    return out


def _layer_num_experts(d: dict, v: dict, problems: list, unimplemented: list, uniform: bool) -> tuple | None:
    k0 = v.get("first_k_dense_replace")
    router = dict(top_k=v.get("num_experts_per_tok"), n_group=v.get("n_group"), topk_group=v.get("topk_group"))
    return layer_num_experts(d, v.get("num_hidden_layers"), v.get("num_nextn_predict_layers"),
                             v.get("n_routed_experts"), "n_routed_experts",
                             lambda layer: None if k0 is None else layer < k0, problems, unimplemented, uniform,
                             router=None if None in router.values() else router)

"""DeepSeek-V3-family configuration (DeepSeek-V3/V3.1/R1, Kimi-K2, Moonlight): read `config.json`,
resolve the rope settings the way transformers does, refuse what moejax does not implement.

Every key moejax reads is checked for its type and range before use (an integer size must be a
JSON integer, not `"8"`, `8.0` or `true`); every problem found is reported together in one
`ConfigError` that names the file, the key, the value given and what was expected.

`raw` keeps the file's dictionary untouched, so a checkpoint written back carries an equivalent
(indeed identical) config, quantization_config and unknown keys included.
"""

from __future__ import annotations

import dataclasses
import math

from moejax.errors import ConfigError
from moejax.models.config_base import (BOOL as _BOOL, NONNEG_INT as _NONNEG_INT, NONNEG_NUMBER_OR_NULL as
                                       _NONNEG_NUMBER_OR_NULL, POS_INT as _POS_INT, POS_INT_OR_NULL as _POS_INT_OR_NULL,
                                       POS_NUMBER as _POS_NUMBER, POS_NUMBER_OR_NULL as _POS_NUMBER_OR_NULL,
                                       STRING as _STRING, MoeConfig, SigmoidGroupRouter, check as _check, check_family, layer_num_experts,
                                       message as _message, show as _show)

MODEL_TYPES = ("deepseek_v3", "kimi_k2")
ARCHITECTURE = "DeepseekV3ForCausalLM"


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    rope_type: str = "default"          # "default" or "yarn"
    theta: float = 10000.0
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True


@dataclasses.dataclass(frozen=True)
class DeepseekV3Config(SigmoidGroupRouter, MoeConfig):
    MODEL_TYPES = MODEL_TYPES
    ARCHITECTURE = ARCHITECTURE
    EXPERTS_KEYS = ("n_routed_experts", "num_local_experts")
    ALIASES = {"num_local_experts": "n_routed_experts", "num_mtp_layers": "num_nextn_predict_layers"}  # attribute_map
    vocab_size: int = 129280
    hidden_size: int = 7168
    intermediate_size: int = 18432
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 61
    num_attention_heads: int = 128
    n_shared_experts: int = 1
    n_routed_experts: int = 256
    routed_scaling_factor: float = 2.5
    kv_lora_rank: int = 512
    q_lora_rank: int | None = 1536
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    qk_nope_head_dim: int = 128
    n_group: int = 8
    topk_group: int = 4
    num_experts_per_tok: int = 8
    first_k_dense_replace: int = 3
    norm_topk_prob: bool = True
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    rope_interleave: bool = True
    attention_bias: bool = False
    # multi-token-prediction layers on disk: indices num_hidden_layers .. num_hidden_layers + this - 1
    num_nextn_predict_layers: int = 0
    rope: RopeConfig = RopeConfig()
    # moe_sparsity_config.num_experts of a checkpoint pruned per layer (one entry a layer, None for
    # dense layers); None when the config has none. See `experts_in_layer`.
    layer_num_experts: tuple[int | None, ...] | None = None
    raw: dict = dataclasses.field(default_factory=dict, compare=False, hash=False, repr=False)

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

    # --- reading -------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict, source: str = "config", *, uniform_experts: bool = True) -> "DeepseekV3Config":
        """Read a config.json dictionary. Wrong types and ranges, inconsistent sizes and settings
        moejax does not implement are all collected and raised as one ConfigError.

        uniform_experts: refuse (the default) a moe_sparsity_config.num_experts that gives layers
        different expert counts, for a caller that needs one count in every layer. The loader, scoring
        and prune pass False and ask `experts_in_layer` (the model builds each layer with its count)."""
        check_family(d, source, MODEL_TYPES, ARCHITECTURE, "DeepSeek-V3")
        d = dict(d)
        problems: list[str] = []        # wrong types, ranges and inconsistencies
        unimplemented: list[str] = []   # valid settings moejax does not implement
        given = {k: d[k] for k in _FIELD_RULES if k in d}
        for alias, field in cls.ALIASES.items():  # transformers reads these spellings as the field
            if alias not in d:
                continue
            if field in given and d[alias] != given[field]:
                problems.append(f"{alias}={_show(d[alias])} disagrees with {field}={_show(given[field])} "
                                "(two spellings of one setting)")
            elif field not in given and _check(alias, d[alias], _FIELD_RULES[field], problems):
                given[field] = d[alias]
        valid = _check_fields(given, problems)
        for key in ("num_key_value_heads", "head_dim", "qk_head_dim", "moe_layer_freq"):
            if d.get(key) is not None and _check(key, d[key], _POS_INT, problems):
                valid[key] = d[key]

        if d.get("scoring_func", "sigmoid") != "sigmoid":
            unimplemented.append(f"scoring_func={d['scoring_func']!r} (only 'sigmoid' is implemented)")
        if d.get("topk_method", "noaux_tc") != "noaux_tc":
            unimplemented.append(f"topk_method={d['topk_method']!r} (only 'noaux_tc' is implemented)")
        if valid.get("moe_layer_freq", 1) != 1:
            unimplemented.append(f"moe_layer_freq={d['moe_layer_freq']!r} (only 1 is implemented)")
        if d.get("hidden_act", "silu") != "silu":
            unimplemented.append(f"hidden_act={d['hidden_act']!r} (only 'silu' is implemented)")
        merged = {**_DEFAULTS, **valid}
        for name in given:              # a key given with a bad value has no usable value
            if name not in valid:
                merged.pop(name, None)
        n_heads = merged.get("num_attention_heads")
        if n_heads is not None and valid.get("num_key_value_heads", n_heads) != n_heads:
            unimplemented.append(f"num_key_value_heads={d['num_key_value_heads']} differs from "
                                 f"num_attention_heads={n_heads} (MLA needs them equal)")
        rope_dim = merged.get("qk_rope_head_dim")
        if rope_dim is not None and valid.get("head_dim", rope_dim) != rope_dim:
            unimplemented.append(f"head_dim={d['head_dim']} differs from qk_rope_head_dim={rope_dim} "
                                 "(transformers would use head_dim as the rope dimension)")
        nope_dim = merged.get("qk_nope_head_dim")
        if None not in (rope_dim, nope_dim) and valid.get("qk_head_dim", rope_dim + nope_dim) != rope_dim + nope_dim:
            problems.append(f"qk_head_dim={d['qk_head_dim']} differs from qk_nope_head_dim + qk_rope_head_dim = "
                            f"{nope_dim} + {rope_dim}")
        rope = _rope_from_dict(d, merged, problems, unimplemented)
        layer_counts = _layer_num_experts(d, merged, problems, unimplemented, uniform_experts)
        problems += _relations(merged)
        if problems or unimplemented:
            raise ConfigError(_message(source, problems, unimplemented))
        return cls(**given, rope=rope, layer_num_experts=layer_counts, raw=d)

    def validate(self, source: str = "config") -> None:
        """Check this config's fields (types, ranges, group routing): one ConfigError naming them all."""
        problems: list[str] = []
        given = {name: getattr(self, name) for name in _FIELD_RULES}
        valid = _check_fields(given, problems)
        problems += _relations(valid)
        if problems:
            raise ConfigError(_message(source, problems, []))

    def default_dict(self) -> dict:
        """config.json written from the fields (a config built in code, without a source file)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
             if f.name not in ("rope", "raw", "layer_num_experts")}
        d.update(model_type="deepseek_v3", architectures=[ARCHITECTURE], num_key_value_heads=self.num_attention_heads,
                 scoring_func="sigmoid", topk_method="noaux_tc", moe_layer_freq=1, hidden_act="silu")
        if self.layer_num_experts is not None:
            d["moe_sparsity_config"] = {"method": "prune", "num_experts": list(self.layer_num_experts)}
        rp = {"rope_type": self.rope.rope_type, "rope_theta": self.rope.theta}
        if self.rope.rope_type == "yarn":
            rp.update({k: getattr(self.rope, k) for k in ("factor", "original_max_position_embeddings", "beta_fast",
                                                          "beta_slow", "mscale", "mscale_all_dim")})
        d["rope_parameters"] = rp
        return d


# --- checking ------------------------------------------------------------------------------

_FIELD_RULES = {
    "vocab_size": _POS_INT, "hidden_size": _POS_INT, "intermediate_size": _POS_INT,
    "moe_intermediate_size": _POS_INT, "num_hidden_layers": _POS_INT, "num_attention_heads": _POS_INT,
    "n_shared_experts": _NONNEG_INT, "n_routed_experts": _POS_INT, "routed_scaling_factor": _POS_NUMBER,
    "kv_lora_rank": _POS_INT, "q_lora_rank": _POS_INT_OR_NULL, "qk_rope_head_dim": _POS_INT,
    "v_head_dim": _POS_INT, "qk_nope_head_dim": _POS_INT, "n_group": _POS_INT, "topk_group": _POS_INT,
    "num_experts_per_tok": _POS_INT, "first_k_dense_replace": _NONNEG_INT, "norm_topk_prob": _BOOL,
    "rms_norm_eps": _POS_NUMBER, "max_position_embeddings": _POS_INT, "tie_word_embeddings": _BOOL,
    "rope_interleave": _BOOL, "attention_bias": _BOOL, "num_nextn_predict_layers": _NONNEG_INT,
}
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(DeepseekV3Config) if f.name in _FIELD_RULES}
assert set(_FIELD_RULES) == {f.name for f in dataclasses.fields(DeepseekV3Config)} - {
    "rope", "raw", "layer_num_experts"}, "every config field needs a rule"

_ROPE_RULES = {
    "rope_type": _STRING, "type": _STRING, "rope_theta": _POS_NUMBER, "factor": _POS_NUMBER_OR_NULL,
    "original_max_position_embeddings": _POS_INT_OR_NULL, "beta_fast": _POS_NUMBER_OR_NULL,
    "beta_slow": _POS_NUMBER_OR_NULL, "mscale": _NONNEG_NUMBER_OR_NULL, "mscale_all_dim": _NONNEG_NUMBER_OR_NULL,
    "attention_factor": _POS_NUMBER_OR_NULL, "truncate": _BOOL,
}


def _check_fields(given: dict, problems: list) -> dict:
    """The fields of `given` that pass their rule; a problem for each that does not."""
    return {k: v for k, v in given.items() if _check(k, v, _FIELD_RULES[k], problems)}


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


def _rope_from_dict(d: dict, v: dict, problems: list, unimplemented: list) -> RopeConfig:
    """transformers' resolution: `rope_scaling` wins over `rope_parameters`; a `rope_theta` inside the
    dict wins over the top-level one; `type` is the legacy key of `rope_type`. `v`: the top-level
    fields that passed their checks. Returns a placeholder when something is wrong (and noted)."""
    n_problems = len(problems)
    where, rp = None, {}
    for key in ("rope_scaling", "rope_parameters"):
        value = d.get(key)
        if value is not None and not isinstance(value, dict):
            problems.append(f"{key}={_show(value)}, expected an object (or null)")
        elif value and not rp:
            where, rp = key, dict(value)
    for name, rule in _ROPE_RULES.items():
        if name in rp:
            _check(f"{where}.{name}", rp[name], rule, problems)
    for name in ("rope_theta", "original_max_position_embeddings"):
        if d.get(name) is not None:
            _check(name, d[name], _ROPE_RULES[name], problems)
    theta_key = f"{where}.rope_theta" if "rope_theta" in rp else "rope_theta"
    theta = rp.get("rope_theta", d.get("rope_theta", 10000.0))
    if theta is None and "rope_theta" not in rp:
        problems.append(f"{theta_key}=null, expected {_POS_NUMBER[1]}")
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    if len(problems) > n_problems:
        return RopeConfig()
    if rope_type == "default":
        return RopeConfig(theta=float(theta))
    if rope_type != "yarn":
        unimplemented.append(f"rope_type={rope_type!r} (only 'default' and 'yarn' are implemented)")
        return RopeConfig()
    max_pos = v.get("max_position_embeddings")
    omp = d.get("original_max_position_embeddings") or rp.get("original_max_position_embeddings") or max_pos
    factor = rp.get("factor")
    if omp is None or (factor is None and max_pos is None):
        return RopeConfig()             # max_position_embeddings was wrong (and noted)
    if factor is None:
        factor = max_pos / omp
    optional = {k: None if rp.get(k) is None else float(rp[k]) for k in ("mscale", "mscale_all_dim",
                                                                          "attention_factor")}
    return RopeConfig(
        rope_type="yarn", theta=float(theta), factor=float(factor), original_max_position_embeddings=int(omp),
        beta_fast=float(rp.get("beta_fast") or 32), beta_slow=float(rp.get("beta_slow") or 1),
        truncate=rp.get("truncate", True), **optional)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

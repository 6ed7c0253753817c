"""Config reading shared by the grouped-query-attention MoE families (Qwen3-MoE, Qwen2-MoE, Mixtral,
OLMoE, GLM-4.5): each family's config is a frozen dataclass inheriting `GqaMoeConfig` and declaring

    FIELD_RULES    field (= its config.json key) -> (accepts, expected) type/range rule
    ALIASES        other config.json spellings -> field (Qwen3-MoE's expert count is `num_experts` on
                   the hub, `num_local_experts` from transformers 5)
    UNIMPLEMENTED  config.json key -> (accepts, what is implemented): a valid setting moejax refuses
    attention      qk_norm ("head", "full" or None), bias on q/k/v and on o

and the MoE questions (`is_moe_layer`, `router_settings`). Rope: the default rope only, its theta
and `partial_rotary_factor` read where transformers 5 writes them (`rope_parameters`) or where the
hub's files have them (top level, `rope_scaling`).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from moejax.errors import ConfigError
from moejax.models.config_base import (FRACTION, POS_NUMBER, STRING, MoeConfig, check, check_family,
                                       layer_num_experts, message, show)


class GqaMoeConfig(MoeConfig):
    TITLE: ClassVar[str]
    MODEL_TYPES: ClassVar[tuple]
    ARCHITECTURE: ClassVar[str]
    ALIASES: ClassVar[dict] = {}
    FIELD_RULES: ClassVar[dict]
    UNIMPLEMENTED: ClassVar[dict] = {}
    QK_NORM: ClassVar[str | None] = None     # "head": RMSNorm over each head; "full": over the whole projection
    O_BIAS_FOLLOWS_ATTENTION_BIAS: ClassVar[bool] = True

    # --- attention ----------------------------------------------------------------------------
    @property
    def resolved_head_dim(self) -> int:
        """Per-head width: config.json's head_dim when given, else hidden_size / num_attention_heads."""
        hd = getattr(self, "head_dim", None)
        return hd if hd is not None else self.hidden_size // self.num_attention_heads

    @property
    def rotary_dim(self) -> int:
        """Channels of each head that rotate (the first ones): head_dim * partial_rotary_factor."""
        return int(self.resolved_head_dim * self.partial_rotary_factor)

    @property
    def qkv_bias(self) -> bool:
        return bool(getattr(self, "attention_bias", False))

    @property
    def o_bias(self) -> bool:
        return self.qkv_bias and self.O_BIAS_FOLLOWS_ATTENTION_BIAS

    @property
    def qk_norm(self) -> str | None:
        return self.QK_NORM

    # --- reading ------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict, source: str = "config", *, uniform_experts: bool = True):
        """Read a config.json dictionary; wrong types and ranges, disagreeing spellings and settings
        moejax does not implement are collected and raised as one ConfigError."""
        check_family(d, source, cls.MODEL_TYPES, cls.ARCHITECTURE, cls.TITLE)
        d = dict(d)
        problems: list[str] = []
        unimplemented: list[str] = []
        given, spelled = {}, {}
        for key, field in cls.config_keys().items():
            if key not in d:
                continue
            if field in given and d[key] != given[field]:
                problems.append(f"{key}={show(d[key])} disagrees with {spelled[field]}={show(given[field])} "
                                "(two spellings of one setting)")
                continue
            given[field], spelled[field] = d[key], key
        valid = {f: v for f, v in given.items() if check(spelled[f], v, cls.FIELD_RULES[f], problems)}
        for key, (accepts, what) in cls.UNIMPLEMENTED.items():
            if key in d and not accepts(d[key]):
                unimplemented.append(f"{key}={show(d[key])} ({what})")
        theta, partial = _rope(d, problems, unimplemented, cls._field_default("partial_rotary_factor", 1.0))
        defaults = {f.name: f.default for f in dataclasses.fields(cls) if f.name in cls.FIELD_RULES}
        merged = {**defaults, **valid}
        for field in given:
            if field not in valid:
                merged.pop(field, None)
        problems += cls._relations(merged, partial)
        counts = None
        if not problems:
            probe = cls(**valid, rope_theta=theta, partial_rotary_factor=partial)
            counts = layer_num_experts(d, probe.num_hidden_layers, probe.num_nextn_predict_layers, probe.n_experts,
                                       probe.experts_key, lambda layer: not probe.is_moe_layer(layer), problems,
                                       unimplemented, uniform_experts, router=probe.router_settings())
        if problems or unimplemented:
            raise ConfigError(message(source, problems, unimplemented))
        return cls(**valid, rope_theta=theta, partial_rotary_factor=partial, layer_num_experts=counts, raw=d)

    @classmethod
    def _field_default(cls, name, fallback):
        fields = {f.name: f for f in dataclasses.fields(cls)}
        return fields[name].default if name in fields else fallback

    @classmethod
    def _relations(cls, v: dict, partial: float) -> list[str]:
        """Constraints between fields (over those that passed their own check)."""
        out = []
        heads, kv, E, k = (v.get(n) for n in ("num_attention_heads", "num_key_value_heads", cls.EXPERTS_FIELD,
                                               "num_experts_per_tok"))
        if heads is not None and kv is not None and heads % kv:
            out.append(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}")
        if E is not None and k is not None and k > E:
            out.append(f"num_experts_per_tok={k} exceeds {cls.EXPERTS_FIELD}={E}")
        hidden = v.get("hidden_size")
        head_dim = v.get("head_dim") or (hidden // heads if hidden and heads else None)
        if head_dim is not None and int(head_dim * partial) % 2:
            out.append(f"rotary width head_dim x partial_rotary_factor = {int(head_dim * partial)} must be even")
        return out

    def default_dict(self) -> dict:
        """config.json written from the fields (a config built in code, without a source file)."""
        d = {field: getattr(self, field) for field in self.FIELD_RULES}
        d.update(model_type=self.MODEL_TYPES[0], architectures=[self.ARCHITECTURE], hidden_act="silu",
                 rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta,
                                  **({"partial_rotary_factor": self.partial_rotary_factor}
                                     if self.partial_rotary_factor != 1.0 else {})})
        if self.layer_num_experts is not None:
            d["moe_sparsity_config"] = {"method": "prune", "num_experts": list(self.layer_num_experts)}
        return d

    @classmethod
    def config_keys(cls) -> dict:
        """config.json key -> field: every field under its own name, and the aliases."""
        return {**{f: f for f in cls.FIELD_RULES}, **cls.ALIASES}


class EveryLayerMoe:
    """Every decoder layer is MoE and the experts' inner width is `intermediate_size` (Mixtral, OLMoE)."""

    @property
    def moe_intermediate_size(self) -> int:
        return self.intermediate_size

    def is_moe_layer(self, layer: int) -> bool:
        return True


class SparseStepLayers:
    """Qwen-MoE's choice of MoE layers: not in `mlp_only_layers`, and (layer + 1) divisible by
    `decoder_sparse_step` (transformers' rule); the others dense. No MTP layers."""

    def __post_init__(self):
        object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))

    def is_moe_layer(self, layer: int) -> bool:
        return (layer not in self.mlp_only_layers and self.n_experts > 0
                and (layer + 1) % self.decoder_sparse_step == 0)


def _rope(d: dict, problems: list, unimplemented: list, default_partial: float) -> tuple[float, float]:
    """(rope_theta, partial_rotary_factor), as transformers 5 resolves them: `rope_scaling` or
    `rope_parameters` (the first given), a theta inside it over the top-level one; the partial
    factor inside it over the top-level one. Only rope_type "default" is implemented."""
    rp, where = {}, None
    for key in ("rope_scaling", "rope_parameters"):
        value = d.get(key)
        if value is not None and not isinstance(value, dict):
            problems.append(f"{key}={show(value)}, expected an object (or null)")
        elif value and not rp:
            rp, where = dict(value), key
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    if not check(f"{where}.rope_type", rope_type, STRING, problems):
        rope_type = "default"
    elif rope_type != "default":
        unimplemented.append(f"{where}.rope_type={rope_type!r} (only 'default' rope is implemented for this family)")
    theta_key = f"{where}.rope_theta" if "rope_theta" in rp else "rope_theta"
    theta = rp.get("rope_theta", d.get("rope_theta", 10000.0))
    if not check(theta_key, theta, POS_NUMBER, problems):
        theta = 10000.0
    partial_key = f"{where}.partial_rotary_factor" if "partial_rotary_factor" in rp else "partial_rotary_factor"
    partial = rp.get("partial_rotary_factor", d.get("partial_rotary_factor", default_partial))
    if not check(partial_key, partial, FRACTION, problems):
        partial = 1.0
    return float(theta), float(partial)


def bool_is(expected: bool, what: str):
    return (lambda v: v is expected, what)


NULL_ONLY = (lambda v: v is None, "only null is implemented")
SILU_ONLY = (lambda v: v == "silu", "only 'silu' is implemented")

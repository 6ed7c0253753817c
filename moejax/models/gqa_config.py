"""What the grouped-query-attention MoE families (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, GLM-4.5)
share: `GqaMoeConfig`, their base, adds to `MoeConfig` the attention fields (key/value heads, head
width), the default rope (its theta and `partial_rotary_factor` read where transformers 5 writes
them, `rope_parameters`, or where the hub's files have them, top level or `rope_scaling`), the checks
between fields, and the attention questions (qk_norm "head", "full" or None; bias on q/k/v and on o).
The mixins below hold what some of them share: the choice of MoE layers and the softmax router.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from moejax.models.config_base import (BOOL, FRACTION, INT_LIST, POS_INT, POS_INT_OR_NULL, POS_NUMBER, STRING,
                                       MoeConfig, check, key, layer_num_experts, show)


def bool_is(expected: bool, what: str):
    return (lambda v: v is expected, what)


NULL_ONLY = (lambda v: v is None, "only null is implemented")
SILU_ONLY = (lambda v: v == "silu", "only 'silu' is implemented")
# Qwen-MoE's attention settings other than full attention, refused
FULL_ATTENTION_ONLY = {
    "use_sliding_window": bool_is(False, "sliding-window attention is not implemented"),
    "layer_types": (lambda v: v is None or all(t == "full_attention" for t in v), "only full attention is implemented"),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class GqaMoeConfig(MoeConfig):
    UNIMPLEMENTED: ClassVar[dict] = {"hidden_act": SILU_ONLY}
    QK_NORM: ClassVar[str | None] = None     # "head": RMSNorm over each head; "full": over the whole projection
    O_BIAS_FOLLOWS_ATTENTION_BIAS: ClassVar[bool] = True

    num_key_value_heads: int = key(POS_INT)
    head_dim: int | None = key(POS_INT_OR_NULL, None)  # None: hidden_size / num_attention_heads
    # read by `_rope` (rope_parameters, rope_scaling or top level), not as fields
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 1.0

    # --- attention ----------------------------------------------------------------------------
    @property
    def resolved_head_dim(self) -> int:
        """Per-head width: config.json's head_dim when given, else hidden_size / num_attention_heads."""
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_attention_heads

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

    ATTENTION_SINKS: ClassVar[bool] = False  # a learned sink logit per head joins each softmax (gpt-oss)
    ATTENTION_OUTPUT_GATE: ClassVar[bool] = False  # q_proj also gives a sigmoid gate on each head's output (Qwen3-Next)

    @property
    def attention_output_gate(self) -> bool:
        return self.ATTENTION_OUTPUT_GATE

    @property
    def attention_sinks(self) -> bool:
        return self.ATTENTION_SINKS

    def attention_window(self, layer: int) -> int | None:
        """The sliding window of layer `layer`'s attention (keys within `window` columns of the
        query, itself included), None for full attention (every family but gpt-oss)."""
        return None

    # --- reading (what the fields do not say) -------------------------------------------------
    @classmethod
    def _read_rope(cls, d, merged, problems, unimplemented) -> dict:
        """The rope fields' values (the default rope: its theta and partial factor); a family with
        another rope reads its own here."""
        theta, partial = _rope(d, problems, unimplemented, cls.__dataclass_fields__["partial_rotary_factor"].default)
        return dict(rope_theta=theta, partial_rotary_factor=partial)

    @classmethod
    def _read_rest(cls, d, valid, merged, problems, unimplemented, uniform_experts) -> dict:
        rope = cls._read_rope(d, merged, problems, unimplemented)
        problems += cls._relations(merged, rope.get("partial_rotary_factor", 1.0))
        counts = None
        if not problems:
            probe = cls(**valid, **rope)
            counts = layer_num_experts(d, probe.num_hidden_layers, probe.num_nextn_predict_layers, probe.n_experts,
                                       probe.experts_key, lambda layer: not probe.is_moe_layer(layer), problems,
                                       unimplemented, uniform_experts, router=probe.router_settings())
        return dict(rope, layer_num_experts=counts)

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
        types, n = v.get("layer_types"), v.get("num_hidden_layers")  # a per-layer schedule (gpt-oss, Qwen3-Next)
        if types is not None and n is not None and len(types) != n:
            out.append(f"layer_types={show(types)} has {len(types)} entries, expected num_hidden_layers={n}")
        hidden = v.get("hidden_size")
        head_dim = v.get("head_dim") or (hidden // heads if hidden and heads else None)
        if head_dim is not None and int(head_dim * partial) % 2:
            out.append(f"rotary width head_dim x partial_rotary_factor = {int(head_dim * partial)} must be even")
        return out

    def _written(self) -> dict:
        return dict(hidden_act="silu", rope_parameters={
            "rope_type": "default", "rope_theta": self.rope_theta,
            **({"partial_rotary_factor": self.partial_rotary_factor} if self.partial_rotary_factor != 1.0 else {})})


class EveryLayerMoe:
    """Every decoder layer is MoE and the experts' inner width is `intermediate_size` (Mixtral, OLMoE)."""

    @property
    def moe_intermediate_size(self) -> int:
        return self.intermediate_size

    def is_moe_layer(self, layer: int) -> bool:
        return True


@dataclasses.dataclass(frozen=True, kw_only=True)
class SparseStepLayers:
    """Qwen-MoE's choice of MoE layers: not in `mlp_only_layers`, and (layer + 1) divisible by
    `decoder_sparse_step` (transformers' rule); the others dense. No MTP layers."""

    decoder_sparse_step: int = key(POS_INT, 1)
    mlp_only_layers: tuple = key(INT_LIST, ())

    def __post_init__(self):
        if hasattr(super(), "__post_init__"):  # the next class's (a hybrid family's layer_types)
            super().__post_init__()
        object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))

    def is_moe_layer(self, layer: int) -> bool:
        return (layer not in self.mlp_only_layers and self.n_experts > 0
                and (layer + 1) % self.decoder_sparse_step == 0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SoftmaxRouter:
    """A softmax router choosing the top k, renormalised over them when `norm_topk_prob` (Qwen-MoE,
    OLMoE; false in their released models)."""

    norm_topk_prob: bool = key(BOOL, False)

    def router_settings(self) -> dict:
        return dict(top_k=self.num_experts_per_tok, scoring_func="softmax", norm_topk_prob=self.norm_topk_prob)


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

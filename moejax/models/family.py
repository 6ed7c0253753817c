"""What a model family is to the rest of moejax: one folder `moejax/models/<name>/` whose
`__init__.py` defines `FAMILY = Family(...)`, listed once in `moejax.models.registry`.

    config_class   JAX-free config (reads and checks config.json; `moejax.models.config_base`); its
                   TITLE, MODEL_TYPES and ARCHITECTURE are the family's
    rules          the HF name table (`moejax.models.names`), used both ways
    moe_block      the HF name of a decoder layer's MoE block ("mlp"; Mixtral: "block_sparse_moe")
    presets        full-size config.json dictionaries for shape work
    tiny           the small config.json `experiment=train_tiny` trains (byte-level vocabulary added there)
    test_config    the tiny config (transformers' config arguments) of the random checkpoint the
                   family's tests have transformers write (tests/family_fixtures.py)
    fused          for a family whose experts exist only as fused tensors (gpt-oss): {stored name
                   after `mlp.experts.`: the per-expert rules its slab of expert e is cut into}; None
                   for the others, whose transformers-5 fused spelling is `SWIGLU_FUSED` and whose
                   own is per expert

Its NNX causal LM is the class named ARCHITECTURE in the folder's `model.py`, imported only when a
model is built.
"""

from __future__ import annotations

import dataclasses
import importlib

from moejax.models.names import expand, expand_layer

# transformers 5's fused SwiGLU experts, by rule: gate_up_proj [E, 2F, H] (gate rows, then up), down_proj
SWIGLU_FUSED = {"gate_up_proj": ("expert_gate", "expert_up"), "down_proj": ("expert_down",)}


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    config_class: type
    rules: tuple
    moe_block: str = "mlp"
    presets: dict = dataclasses.field(default_factory=dict, hash=False, compare=False)
    tiny: dict | None = dataclasses.field(default=None, hash=False, compare=False)
    test_config: dict | None = dataclasses.field(default=None, hash=False, compare=False)
    fused: dict | None = dataclasses.field(default=None, hash=False, compare=False)

    @property
    def title(self) -> str:
        return self.config_class.TITLE

    @property
    def model_types(self) -> tuple:
        return self.config_class.MODEL_TYPES

    @property
    def architecture(self) -> str:
        return self.config_class.ARCHITECTURE

    @property
    def model(self) -> str:
        """"module:Class" of its NNX causal LM: the class named ARCHITECTURE in the folder's model.py."""
        return f"{self.config_class.__module__.rpartition('.')[0]}.model:{self.architecture}"

    def causal_lm(self) -> type:
        """The family's NNX model class (imports JAX)."""
        module, cls = self.model.split(":")
        return getattr(importlib.import_module(module), cls)

    def tensor_specs(self, cfg) -> list:
        return expand(self.rules, cfg)

    def layer_specs(self, cfg, layer: int) -> list:
        return expand_layer(self.rules, cfg, layer)

    @property
    def stores_fused(self) -> bool:
        """True when the family's only spelling of its experts is fused (every writer writes it so)."""
        return self.fused is not None

    def fused_layout(self, cfg) -> dict:
        """{fused tensor name after `model.layers.{l}.mlp.experts.`: (the per-expert HF name templates
        its slab of each expert is cut into, in row order; the fused tensor's rank)}
        (`moejax.hf.fused_experts`)."""
        fused = self.fused or SWIGLU_FUSED
        return {stored: (tuple(self.rule(name).hf for name in rules), 1 + len(self.rule(rules[0]).shape(cfg)))
                for stored, rules in fused.items()}

    def expert_matrix_rules(self, cfg) -> list:
        """The per-expert rules of the routed experts' weight matrices (biases, 1-D, excluded), in
        table order: SwiGLU's gate, up, down; gpt-oss's gate_up and down."""
        return [r for r in self.rules if r.per_expert and len(r.shape(cfg)) >= 2]

    def rule(self, name: str):
        """The rule called `name` (e.g. "router"), or None when the family has none."""
        return next((r for r in self.rules if r.name == name), None)

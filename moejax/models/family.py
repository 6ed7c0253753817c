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

Its NNX causal LM is the class named ARCHITECTURE in the folder's `model.py`, imported only when a
model is built.
"""

from __future__ import annotations

import dataclasses
import importlib

from moejax.models.names import expand, expand_layer


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    config_class: type
    rules: tuple
    moe_block: str = "mlp"
    presets: dict = dataclasses.field(default_factory=dict, hash=False, compare=False)
    tiny: dict | None = dataclasses.field(default=None, hash=False, compare=False)
    test_config: dict | None = dataclasses.field(default=None, hash=False, compare=False)

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

    def rule(self, name: str):
        """The rule called `name` (e.g. "router"), or None when the family has none."""
        return next((r for r in self.rules if r.name == name), None)

"""DeepSeek-V3.2 configuration (`deepseek_v32`, DeepSeek-V3.2-Exp), and `DsaConfig`, the base of the
DeepSeek-sparse-attention families (DeepSeek-V3.2, GLM-5): DeepSeek-V3's multi-head latent
attention and MoE settings (the router of `SigmoidGroupRouter`; MLA's fields exactly as
`DeepseekV3Config` declares them, its reading, checks and softmax scale), plus the lightning
indexer's sizes (`index_n_heads`, `index_head_dim`, `index_topk`) and which layers run an indexer
(`indexer_types`: DeepSeek-V3.2 every layer; GLM-5 by its schedule, `moejax.models.glm_moe_dsa`).
JAX-free: the checkpoint tools read it without building a model.

How transformers 5.24 reads these configs, and what moejax does with each difference from
DeepSeek-V3's:

- MLA always has a q LoRA (`q_lora_rank: null` refused) and always rotates interleaved pairs
  (`rope_interleave: false` refused: transformers ignores the key and interleaves);
- `head_dim` is overwritten with `qk_rope_head_dim` (GLM-5.2 writes 192): read only for its type;
- `mlp_layer_types` ("dense"/"sparse" per layer) must be the first_k_dense_replace schedule (any
  other pattern refused), `layer_types` must be all "indexed_attention";
- the indexer's rope form is the model type's (`indexer_rope_interleave` of another value refused:
  transformers ignores the key);
- DeepSeek-V3.2 runs every layer's indexer: index sharing keys (`indexer_types`,
  `index_topk_pattern`, `index_topk_freq`, `index_skip_topk_offset`) that would share a selection
  are refused (transformers ignores them; vLLM's IndexCache reads them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import ClassVar

from moejax.models.config_base import (BOOL, POS_INT, MoeConfig, SigmoidGroupRouter, check, family_config, key,
                                       show)
from moejax.models.deepseek_v3.config import DeepseekV3Config

MODEL_TYPE = "deepseek_v32"
ARCHITECTURE = "DeepseekV32ForCausalLM"
INDEXER_TYPES = ("full", "shared")

# DeepSeek-V3's multi-head latent attention fields, declared once (in `DeepseekV3Config`): the same
# config.json keys, rules and defaults (a family gives its own defaults in DEFAULTS)
_MLA_FIELDS = ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim", "qk_nope_head_dim",
               "rope_interleave", "attention_bias", "rope")
MlaFields = dataclasses.make_dataclass(
    "MlaFields", [(f.name, f.type, dataclasses.field(default=f.default, metadata=f.metadata))
                  for f in dataclasses.fields(DeepseekV3Config) if f.name in _MLA_FIELDS],
    frozen=True, kw_only=True)
MlaFields.__doc__ = "DeepSeek-V3's MLA fields (`DeepseekV3Config`'s declarations)."


def _get(source, name, default=None):
    if isinstance(source, Mapping):
        return source.get(name, default)
    return getattr(source, name, default)


def indexer_types(config) -> tuple[str, ...]:
    """"full" or "shared" per decoder layer, as transformers derives it (GlmMoeDsaConfig): the
    config's `indexer_types`; else `index_topk_pattern` ("F"/"S" characters or a list); else layer
    i is full iff max(i - index_skip_topk_offset + 1, 0) % index_topk_freq == 0 (defaults 2 and 1:
    every layer full). DeepSeek-V3.2 (and any config without these keys) has every layer full.
    `config`: a config.json dictionary or an object with these attributes."""
    n = _get(config, "num_hidden_layers")
    types = _get(config, "indexer_types")
    if types is None and _get(config, "model_type") != MODEL_TYPE:
        pattern = _get(config, "index_topk_pattern")
        if pattern is not None:
            types = [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) else list(pattern)
        else:
            freq = max(_get(config, "index_topk_freq", 1) or 1, 1)
            offset = _get(config, "index_skip_topk_offset", 2)
            offset = 2 if offset is None else offset
            types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]
    types = tuple(types) if types is not None else ("full",) * n
    if len(types) != n or set(types) - set(INDEXER_TYPES):
        raise ValueError(f"indexer_types must be {n} of 'full'/'shared', got {list(types)}")
    return types


def selection_sources(types) -> tuple[int, ...]:
    """For each layer, the layer whose indexer selection it uses: itself when full, the nearest
    full layer below when shared (transformers passes the previous layer's top-k along)."""
    out, last = [], None
    for i, t in enumerate(types):
        if t == "full":
            last = i
        elif last is None:
            raise ValueError(f"layer {i} shares the top-k of a previous full indexer layer, but none precedes it")
        out.append(last)
    return tuple(out)


_SHARING_KEYS = ("indexer_types", "index_topk_pattern", "index_topk_freq", "index_skip_topk_offset")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DsaConfig(SigmoidGroupRouter, MlaFields, MoeConfig):
    """What the DSA families share: DeepSeek-V3's router, shared experts, dense first layers and
    MLA (borrowed from `DeepseekV3Config`: `qk_head_dim`, `softmax_scale`, its reading of rope,
    MLA's keys, expert counts and group routing), the indexer's sizes, and the settings
    transformers' DSA models do not read the way DeepSeek-V3 does (module docstring)."""

    INDEXER_ROPE_INTERLEAVE: ClassVar[bool]  # the indexer's rope form in transformers (a family's)
    UNIMPLEMENTED: ClassVar[dict] = {
        "q_lora_rank": (lambda v: v is not None, "DSA needs MLA's q LoRA: the lightning indexer reads it, and "
                                                 "transformers' DSA attention has no plain q_proj"),
        "rope_interleave": (lambda v: v is not False, "transformers' DSA attention always rotates MLA's rope "
                                                      "interleaved; the half-split form is not implemented"),
        "num_experts": (lambda v: False, "transformers' backward-compatible spelling of n_routed_experts, not "
                                         "read by moejax; spell it n_routed_experts"),
    }

    index_n_heads: int = key(POS_INT, 64)
    index_head_dim: int = key(POS_INT, 128)
    index_topk: int = key(POS_INT, 2048)

    qk_head_dim = DeepseekV3Config.qk_head_dim
    softmax_scale = DeepseekV3Config.softmax_scale
    validate = DeepseekV3Config.validate

    @property
    def model_type(self) -> str:
        """config.json's model_type (what `dsa_indexer.IndexerConfig.of` reads the rope form by)."""
        return self.MODEL_TYPES[0]

    @property
    def indexer_rope_interleave(self) -> bool:
        return self.INDEXER_ROPE_INTERLEAVE

    # --- which layers select ----------------------------------------------------------------
    @property
    def layer_indexers(self) -> tuple[str, ...]:
        """"full" (the layer runs its indexer) or "shared" (it uses the selection of the nearest
        full layer below) per decoder layer: every layer full (GLM-5: its schedule)."""
        return ("full",) * self.num_hidden_layers

    def has_indexer(self, layer: int) -> bool:
        """True for a layer that runs (and stores) its own indexer: a "full" decoder layer, and an
        MTP layer (beyond num_hidden_layers), which the released checkpoints ship with an indexer of
        its own (GLM-5.2's `model.layers.78.self_attn.indexer.*`: 22 indexers beside 21 "full"
        entries; DeepSeek-V3.2's layer 61 likewise)."""
        return layer >= self.num_hidden_layers or self.layer_indexers[layer] == "full"

    def selection_source(self, layer: int) -> int:
        """The layer whose indexer selects the keys layer `layer` attends to."""
        return selection_sources(self.layer_indexers)[layer]

    @property
    def shares_selections(self) -> bool:
        """True when some layer uses another layer's selection (GLM-5's "shared" layers)."""
        return "shared" in self.layer_indexers

    # --- reading ----------------------------------------------------------------------------
    @classmethod
    def _read_rest(cls, d, valid, merged, problems, unimplemented, uniform_experts) -> dict:
        """DeepSeek-V3's reading (rope, MLA's keys, expert counts, group routing) of config.json
        without `head_dim` (transformers' DSA configs overwrite it with qk_rope_head_dim), then the
        DSA families' own checks."""
        if d.get("head_dim") is not None:
            check("head_dim", d["head_dim"], POS_INT, problems)
        rest = DeepseekV3Config._read_rest.__func__(cls, {k: v for k, v in d.items() if k != "head_dim"}, valid,
                                                    merged, problems, unimplemented, uniform_experts)
        n, k0 = merged.get("num_hidden_layers"), merged.get("first_k_dense_replace")
        mlp_types = d.get("mlp_layer_types")
        if mlp_types is not None and None not in (n, k0):
            expected = ["dense"] * min(k0, n) + ["sparse"] * max(n - k0, 0)
            if not isinstance(mlp_types, list) or not all(t in ("dense", "sparse") for t in mlp_types):
                problems.append(f"mlp_layer_types={show(mlp_types)}, expected a list of 'dense' or 'sparse'")
            elif mlp_types != expected:
                unimplemented.append(f"mlp_layer_types={show(mlp_types)} (only the first_k_dense_replace={k0} "
                                     f"schedule, {k0} dense layer(s) then MoE layers, is implemented)")
        layer_types = d.get("layer_types")
        if layer_types is not None and (not isinstance(layer_types, list)
                                        or any(t != "indexed_attention" for t in layer_types)):
            unimplemented.append(f"layer_types={show(layer_types)} (only 'indexed_attention' layers are implemented)")
        if n is not None and isinstance(layer_types, list) and len(layer_types) != n:
            problems.append(f"layer_types has {len(layer_types)} entries, expected num_hidden_layers={n}")
        interleave = d.get("indexer_rope_interleave")
        if interleave is not None and check("indexer_rope_interleave", interleave, BOOL, problems) \
                and interleave is not cls.INDEXER_ROPE_INTERLEAVE:
            form = "interleaved" if cls.INDEXER_ROPE_INTERLEAVE else "half-split"
            unimplemented.append(f"indexer_rope_interleave={show(interleave)} (transformers ignores it and rotates "
                                 f"{cls.TITLE}'s indexer {form}; only that form is implemented)")
        dr, di = merged.get("qk_rope_head_dim"), merged.get("index_head_dim")
        if None not in (dr, di) and dr > di:
            problems.append(f"qk_rope_head_dim={dr} exceeds index_head_dim={di} (the indexer rotates its first "
                            "qk_rope_head_dim channels)")
        return {**rest, **cls._read_indexer_types(d, merged, problems, unimplemented)}

    @classmethod
    def _read_indexer_types(cls, d, merged, problems, unimplemented) -> dict:
        """DeepSeek-V3.2: every layer runs its indexer; keys that would share selections are refused."""
        given = {k: d[k] for k in _SHARING_KEYS if d.get(k) is not None}
        n = merged.get("num_hidden_layers")
        if given and n is not None:
            try:
                shared = "shared" in indexer_types({**given, "num_hidden_layers": n, "model_type": "glm_moe_dsa"})
            except (ValueError, KeyError, TypeError):
                shared = True
            if shared:
                unimplemented.append(f"{', '.join(f'{k}={show(v)}' for k, v in given.items())} (index sharing: "
                                     f"transformers' {cls.ARCHITECTURE} runs every layer's indexer and ignores these "
                                     "keys)")
        return {}

    def _written(self) -> dict:
        return {**DeepseekV3Config._written(self), "head_dim": self.qk_rope_head_dim}


@family_config("DeepSeek-V3.2", (MODEL_TYPE,), ARCHITECTURE)
class DeepseekV32Config(DsaConfig):
    INDEXER_ROPE_INTERLEAVE = False  # DeepseekV32Indexer: half-split (rotate_half), unlike its MLA
    DEFAULTS = dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432, num_hidden_layers=61,
                    num_attention_heads=128, num_experts_per_tok=8, rms_norm_eps=1e-6,
                    max_position_embeddings=163840, moe_intermediate_size=2048, n_routed_experts=256,
                    routed_scaling_factor=2.5, n_group=8, topk_group=4, first_k_dense_replace=3)

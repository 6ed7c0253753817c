"""GLM-5 configuration (`glm_moe_dsa`: GLM-5, GLM-5.1, and GLM-5.2's index sharing): DeepSeek-V3.2's
(`moejax.models.deepseek_v32.config.DsaConfig`: MLA with a q LoRA, the lightning indexer, DeepSeek-V3's
sigmoid router with balance bias, groups, shared experts and dense first layers) with GLM-5's
sizes, an indexer rotating interleaved pairs, and a per-layer indexer schedule: a "full" layer runs
its indexer, a "shared" layer (no indexer tensors) attends with the selection of the nearest full
layer below. The schedule is config.json's `indexer_types` ("full"/"shared" per layer); else
`index_topk_pattern` ("F"/"S" per layer, or a list); else `index_topk_freq` / `index_skip_topk_offset`
(layer i is full iff max(i - offset + 1, 0) % freq == 0; by default every layer), as transformers'
`GlmMoeDsaConfig` derives it. Layer 0 must be full."""

from __future__ import annotations

from moejax.models.config_base import NONNEG_INT, family_config, key, show
from moejax.models.deepseek_v32.config import INDEXER_TYPES, DsaConfig, indexer_types, selection_sources

_TYPE_LIST = (lambda v: v is None or (isinstance(v, (list, tuple)) and all(t in INDEXER_TYPES for t in v)),
              "a list of 'full' or 'shared' (one per layer), or null")
_PATTERN = (lambda v: v is None or (isinstance(v, str) and set(v) <= {"F", "S"})
            or (isinstance(v, (list, tuple)) and all(t in INDEXER_TYPES for t in v)),
            "a string of 'F'/'S' (one per layer), a list of 'full'/'shared', or null")


@family_config("GLM-5", ("glm_moe_dsa",), "GlmMoeDsaForCausalLM")
class GlmMoeDsaConfig(DsaConfig):
    INDEXER_ROPE_INTERLEAVE = True  # GlmMoeDsaIndexer: apply_rotary_pos_emb_interleave
    DEFAULTS = dict(vocab_size=154880, hidden_size=6144, intermediate_size=12288, num_hidden_layers=78,
                    num_attention_heads=64, num_experts_per_tok=8, rms_norm_eps=1e-5, max_position_embeddings=202752,
                    moe_intermediate_size=2048, n_routed_experts=256, routed_scaling_factor=2.5, n_group=1,
                    topk_group=1, first_k_dense_replace=3, q_lora_rank=2048, v_head_dim=256, qk_nope_head_dim=192,
                    index_n_heads=32)

    indexer_types: tuple | None = key(_TYPE_LIST, None)
    index_topk_pattern: str | tuple | None = key(_PATTERN, None)
    index_topk_freq: int = key(NONNEG_INT, 1)
    index_skip_topk_offset: int = key(NONNEG_INT, 2)

    def __post_init__(self):
        for name in ("indexer_types", "index_topk_pattern"):
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))

    @property
    def layer_indexers(self) -> tuple[str, ...]:
        return indexer_types(self)

    @classmethod
    def _read_indexer_types(cls, d, merged, problems, unimplemented) -> dict:
        """The schedule must resolve to one entry per layer, the first full (a shared layer needs a
        full one below it)."""
        n = merged.get("num_hidden_layers")
        if n is None or any(k in d and k not in merged for k in ("indexer_types", "index_topk_pattern",
                                                                  "index_topk_freq", "index_skip_topk_offset")):
            return {}  # a wrong value, already noted
        settings = {k: merged.get(k) for k in ("indexer_types", "index_topk_pattern", "index_topk_freq",
                                               "index_skip_topk_offset")}
        types = indexer_types({**settings, "num_hidden_layers": n, "model_type": "glm_moe_dsa"}) \
            if _lengths_agree(settings, n, problems) else None
        if types is not None:
            try:
                selection_sources(types)
            except ValueError:
                problems.append(f"indexer_types {show(list(types))}: layer 0 is 'shared', but a shared layer uses the "
                                "selection of a full layer below it")
        return {}

    def _written(self) -> dict:
        return {**super()._written(), "indexer_types": list(self.layer_indexers)}


def _lengths_agree(settings: dict, n: int, problems: list) -> bool:
    for name in ("indexer_types", "index_topk_pattern"):
        value = settings[name]
        if value is not None:
            if len(value) != n:
                problems.append(f"{name}={show(value)} has {len(value)} entries, expected num_hidden_layers={n}")
                return False
            return True  # the first given wins (transformers' order)
    return True

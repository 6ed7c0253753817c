"""Multi-head latent attention with DeepSeek sparse attention (DSA), and the decoder stack that
hands a selection from layer to layer: one implementation for DeepSeek-V3.2 (`deepseek_v32`) and
GLM-5 (`glm_moe_dsa`), exact against transformers' `DeepseekV32Attention` / `GlmMoeDsaAttention`.

`SparseMLA` is DeepSeek-V3's MLA (`moejax.models.deepseek_v3.model.MLA`: the same projections,
rope, softmax scale, expanded attention over a sequence and absorbed decode) whose attention mask
is `dsa_indexer.sparse_allowed(allowed, selected)`: the causal/padding mask intersected with the
keys the layer's selection keeps. The selection comes from

- the layer's own `LightningIndexer` (a "full" layer: every DeepSeek-V3.2 layer), which reads
  the layer's input x and MLA's normalised query LoRA `q_lora(x)` (computed once, for both);
- or, on a GLM-5 "shared" layer (no indexer, no indexer tensors), the selection of the nearest
  full layer below, handed over by the decoder stack as the layers' `carry` (`CausalLM`).

The three paths, as transformers runs them:

    full sequence  selected_BSS = indexer(x, q_lora, cos, sin, allowed_BSS)          (causal, padded)
    prefill        the same, the indexer keys written into cache columns 0..P-1 (`IndexerCache`)
    decode         each new token's key written at its column, the token selecting among the
                   cache's columns where allowed_B1C (`LightningIndexer.decode`); MLA attends
                   absorbed over the latent cache with the selected columns only

Each layer's cache is a `SparseCache`: MLA's latent cache and the indexer's key cache (None on a
shared layer). A shared layer called alone (`__call__`, `prefill`, `decode`: the per-layer paths
the streamed and carried passes drive, which carry no selection between layers) has no selection
to use and refuses by name; the model's own forward, prefill and decode hand it one.
"""

from __future__ import annotations

from typing import NamedTuple

from flax import nnx

from moejax.errors import ConfigError
from moejax.models.causal_lm import CausalLM
from moejax.models.deepseek_v3 import rope as rope_lib
from moejax.models.deepseek_v3.model import MLA, LatentCache, write_latents
from moejax.models.dsa_indexer import IndexerCache, LightningIndexer, sparse_allowed


class SparseCache(NamedTuple):
    """One DSA layer's cache: MLA's latents and rope keys, and the indexer's keys (None on a layer
    without an indexer)."""

    latents: LatentCache
    keys: IndexerCache | None


class SparseMLA(MLA):
    """MLA attending to the keys DSA selects (module docstring). `carrying`, `prefill_carrying` and
    `decode_carrying` take the selection of a shared layer and return the selection used (the
    carry `CausalLM`'s layers thread when `passes_carry`); the plain `__call__`, `prefill` and
    `decode` are those without one."""

    def __init__(self, cfg, dtype, rngs: nnx.Rngs, layer: int = 0):
        super().__init__(cfg, dtype, rngs, layer)
        self.layer = layer
        self.indexer = LightningIndexer(cfg, dtype, rngs) if cfg.has_indexer(layer) else None
        # the stack threads the selection from layer to layer only where a layer borrows one
        self.passes_carry = cfg.shares_selections

    def empty_cache(self, cfg, batch: int, length: int, dtype) -> SparseCache:
        keys = None if self.indexer is None else LightningIndexer.empty_cache(cfg, batch, length, dtype)
        return SparseCache(MLA.empty_cache(cfg, batch, length, dtype), keys)

    def _borrowed(self, selected):
        """A shared layer's selection: the one handed to it, which it must have."""
        if selected is None:
            source = self.cfg.selection_source(self.layer)
            raise ConfigError(
                f"{self.cfg.TITLE} layer {self.layer} is a 'shared' indexer layer (indexer_types): it attends with the "
                f"keys layer {source}'s indexer selects, which whatever runs the layers hands to it as the carry "
                "(`DecoderLayer.attend`); none was handed")
        return selected

    def carrying(self, x_BSH, cos, sin, allowed_BSS, selected_BSS=None):
        """(output, the selection it attended with [B, S, S]): this layer's indexer's, or on a
        shared layer `selected_BSS`."""
        q_lora = self.q_lora(x_BSH)
        if self.indexer is not None:
            selected_BSS = self.indexer(x_BSH, q_lora, cos, sin, allowed_BSS)
        else:
            selected_BSS = self._borrowed(selected_BSS)
        q_pass, q_rot, latent, k_rot = self._project(x_BSH, cos, sin, q_lora)
        out = self._expanded_attention(q_pass, q_rot, latent, k_rot, sparse_allowed(allowed_BSS, selected_BSS))
        return out, selected_BSS

    def __call__(self, x_BSH, cos, sin, allowed_BSS):
        return self.carrying(x_BSH, cos, sin, allowed_BSS)[0]

    def prefill_carrying(self, x_BSH, cos, sin, allowed_BSS, cache: SparseCache, selected_BSS=None):
        """`attend` on a prompt that also writes its latents (and indexer keys) into cache columns
        0..P-1: (output, cache, selection)."""
        q_lora = self.q_lora(x_BSH)
        keys = cache.keys
        if self.indexer is not None:
            selected_BSS, keys = self.indexer.prefill(x_BSH, q_lora, cos, sin, allowed_BSS, keys)
        else:
            selected_BSS = self._borrowed(selected_BSS)
        q_pass, q_rot, latent, k_rot = self._project(x_BSH, cos, sin, q_lora)
        out = self._expanded_attention(q_pass, q_rot, latent, k_rot, sparse_allowed(allowed_BSS, selected_BSS))
        return out, SparseCache(write_latents(cache.latents, latent, k_rot, 0), keys), selected_BSS

    def prefill(self, x_BSH, cos, sin, allowed_BSS, cache: SparseCache):
        return self.prefill_carrying(x_BSH, cos, sin, allowed_BSS, cache)[:2]

    def decode_carrying(self, x_B1H, cos, sin, cache: SparseCache, column, allowed_B1C, selected_B1C=None):
        """New tokens written into cache column `column` (and on), each selecting among the cache's
        columns where allowed_B1C (or, on a shared layer, attending with `selected_B1C`), attended
        by MLA's absorbed decode: (output, cache, selection [B, 1, C])."""
        q_lora = self.q_lora(x_B1H)
        keys = cache.keys
        if self.indexer is not None:
            selected_B1C, keys = self.indexer.decode(x_B1H, q_lora, cos, sin, keys, column, allowed_B1C)
        else:
            selected_B1C = self._borrowed(selected_B1C)
        q_pass, q_rot, latent, k_rot = self._project(x_B1H, cos, sin, q_lora)
        latents = write_latents(cache.latents, latent, k_rot, column)
        out = self._absorbed_attention(q_pass, q_rot, latents, sparse_allowed(allowed_B1C, selected_B1C))
        return out, SparseCache(latents, keys), selected_B1C

    def decode(self, x_B1H, cos, sin, cache: SparseCache, column, allowed_B1C):
        return self.decode_carrying(x_B1H, cos, sin, cache, column, allowed_B1C)[:2]


class SparseMlaCausalLM(CausalLM):
    """The shared decoder stack on `SparseMLA` (its forward, prefill and decode thread a GLM-5
    shared layer's selection as the layers' `carry`)."""

    attention_class = SparseMLA
    rope_tables = staticmethod(rope_lib.cos_sin)

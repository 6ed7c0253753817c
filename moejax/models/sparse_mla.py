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
  full layer below, handed over by the decoder stack (`SparseMlaCausalLM`).

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

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.errors import ConfigError
from moejax.models.causal_lm import CachedOutput, CausalLM, CausalLMOutput, KVCache, _checked
from moejax.models.deepseek_v3 import rope as rope_lib
from moejax.models.deepseek_v3.model import MLA, LatentCache, write_latents
from moejax.models.dsa_indexer import IndexerCache, LightningIndexer, sparse_allowed
from moejax.models.layers import causal_allowed


class SparseCache(NamedTuple):
    """One DSA layer's cache: MLA's latents and rope keys, and the indexer's keys (None on a layer
    without an indexer)."""

    latents: LatentCache
    keys: IndexerCache | None


class SparseMLA(MLA):
    """MLA attending to the keys DSA selects (module docstring). `attend`, `prefill_selecting` and
    `decode_selecting` take the selection of a shared layer and return the selection used; the
    plain `__call__`, `prefill` and `decode` (the attention interface of `CausalLM`) are those
    without one."""

    def __init__(self, cfg, dtype, rngs: nnx.Rngs, layer: int = 0):
        super().__init__(cfg, dtype, rngs, layer)
        self.layer = layer
        self.indexer = LightningIndexer(cfg, dtype, rngs) if cfg.has_indexer(layer) else None

    def empty_cache(self, cfg, batch: int, length: int, dtype) -> SparseCache:
        keys = None if self.indexer is None else LightningIndexer.empty_cache(cfg, batch, length, dtype)
        return SparseCache(MLA.empty_cache(cfg, batch, length, dtype), keys)

    def _borrowed(self, selected):
        """A shared layer's selection: the one handed to it, which it must have."""
        if selected is None:
            source = self.cfg.selection_source(self.layer)
            raise ConfigError(
                f"{self.cfg.TITLE} layer {self.layer} is a 'shared' indexer layer (indexer_types): it attends with the "
                f"keys layer {source}'s indexer selects, which the model's own forward, prefill and decode hand to "
                "it. Running decoder layers one at a time (the streamed calibration pass of `moejax score`, merge "
                "and substitute; the carried pass of prune_real) carries no selection between layers: not "
                "implemented for index sharing")
        return selected

    def attend(self, x_BSH, cos, sin, allowed_BSS, selected_BSS=None):
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
        return self.attend(x_BSH, cos, sin, allowed_BSS)[0]

    def prefill_selecting(self, x_BSH, cos, sin, allowed_BSS, cache: SparseCache, selected_BSS=None):
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
        return self.prefill_selecting(x_BSH, cos, sin, allowed_BSS, cache)[:2]

    def decode_selecting(self, x_B1H, cos, sin, cache: SparseCache, column, allowed_B1C, selected_B1C=None):
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
        return self.decode_selecting(x_B1H, cos, sin, cache, column, allowed_B1C)[:2]


class SparseMlaCausalLM(CausalLM):
    """The shared decoder stack on `SparseMLA`. When the config shares selections (GLM-5's
    "shared" layers), the forward, prefill and decode run the layers' two halves themselves,
    handing the last full layer's selection to each shared layer; otherwise (every layer runs
    its indexer) they are `CausalLM`'s."""

    attention_class = SparseMLA
    rope_tables = staticmethod(rope_lib.cos_sin)

    def __call__(self, input_ids_BS, attention_mask_BS=None, variant=None, return_routing: bool = False,
                 return_moe_inputs: bool = False, forward_only: bool = False, positions_BS=None):
        if not self.config.shares_selections:
            return super().__call__(input_ids_BS, attention_mask_BS, variant, return_routing, return_moe_inputs,
                                    forward_only, positions_BS)
        variant = _checked(variant, self.config)
        B, S = input_ids_BS.shape
        x = self.model.embed_tokens[...][input_ids_BS]
        cos, sin = self.rope_tables(self.config, jnp.arange(S) if positions_BS is None else positions_BS, x.dtype)
        allowed = causal_allowed(attention_mask_BS, B, S)
        routings, moe_inputs, selected = {}, {}, None
        for l, layer in enumerate(self.model.layers):
            a, selected = layer.self_attn.attend(layer.input_layernorm(x), cos, sin, allowed, selected)
            out = layer.feed(layer._residual(x, a), self._layer_variant(variant, l), forward_only)
            x = out.out_BSH
            if out.routing is not None:
                routings[l], moe_inputs[l] = out.routing, out.z_BSH.reshape(B * S, -1)
        return CausalLMOutput(self._logits(x), routings if return_routing else None,
                              moe_inputs if return_moe_inputs else None)

    def prefill(self, input_ids_BP, positions_BP, attention_mask_BP, cache: KVCache, variant=None,
                last_only: bool = True) -> CachedOutput:
        if not self.config.shares_selections:
            return super().prefill(input_ids_BP, positions_BP, attention_mask_BP, cache, variant, last_only)
        variant = _checked(variant, self.config)
        B, P = input_ids_BP.shape
        mask = attention_mask_BP.astype(bool)
        allowed_BPP = causal_allowed(mask, B, P)
        x = self.model.embed_tokens[...][input_ids_BP]
        cos, sin = self.rope_tables(self.config, positions_BP, x.dtype)
        layers, selected = [], None
        for l, layer in enumerate(self.model.layers):
            a, layer_cache, selected = layer.self_attn.prefill_selecting(layer.input_layernorm(x), cos, sin,
                                                                         allowed_BPP, cache.layers[l], selected)
            x = layer.feed(layer._residual(x, a), self._layer_variant(variant, l), True).out_BSH
            layers.append(layer_cache)
        logits = self._logits(x[:, -1:] if last_only else x).astype(jnp.float32)
        return CachedOutput(logits, KVCache(tuple(layers), jax.lax.dynamic_update_slice(cache.valid_BC, mask, (0, 0))))

    def decode_step(self, input_ids_B1, positions_B1, cache: KVCache, column, variant=None) -> CachedOutput:
        if not self.config.shares_selections:
            return super().decode_step(input_ids_B1, positions_B1, cache, column, variant)
        variant = _checked(variant, self.config)
        C = cache.valid_BC.shape[1]
        valid = jax.lax.dynamic_update_slice(cache.valid_BC, jnp.ones((input_ids_B1.shape[0], 1), bool), (0, column))
        allowed_B1C = (valid & (jnp.arange(C) <= column)[None])[:, None, :]
        x = self.model.embed_tokens[...][input_ids_B1]
        cos, sin = self.rope_tables(self.config, positions_B1, x.dtype)
        layers, selected = [], None
        for l, layer in enumerate(self.model.layers):
            a, layer_cache, selected = layer.self_attn.decode_selecting(layer.input_layernorm(x), cos, sin,
                                                                        cache.layers[l], column, allowed_B1C, selected)
            x = layer.feed(layer._residual(x, a), self._layer_variant(variant, l), True).out_BSH
            layers.append(layer_cache)
        return CachedOutput(self._logits(x).astype(jnp.float32), KVCache(tuple(layers), valid))

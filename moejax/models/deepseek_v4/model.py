"""DeepSeek-V4 in Flax NNX: the shared decoder stack (`moejax.models.causal_lm`) whose residual is
`hc_mult` hyper-connection streams [B, S, W, H] (`hyper.py`), with V4's attention (`attention.py`)
and the one MoE block (`moejax.models.moe_block.MoE`: sqrtsoftplus routing, or `tid2eid` in the
`hash_moe` layers; clamped SwiGLU experts, one shared expert).

The decoder layer keeps the halves every executor calls: `attend` gives (the streams after
attention [B, S, W, H], the MoE's input z [B, S, H]: post_attention_layernorm of the streams
collapsed by the ffn hyper-connection) and `feed` gives the streams after the MoE; the token ids
reach the hash layers through `feed(..., ids_BS=)`. The model copies the embedding into W streams
(`_embed`) and collapses them before the final norm (`_logits`).

Generation (`prefill`, `decode_step`) keeps per layer a `V4LayerCache`: the sliding window's keys
in a ring, and the compressors' and indexer's entries, pending window and overlap (`attention.py`).

Not implemented in this phase (refused by name, never computed wrongly): rope positions other than
the columns 0..S-1 in the forward (transformers' compressors number windows by column), pruning or
merging the experts of a hash layer (`moejax.moe.routing.route`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.errors import ConfigError
from moejax.models.causal_lm import (Attended, CachedOutput, CausalLM, KVCache, LayerOutput, _checked,
                                     decoder_norm)
from moejax.models.deepseek_v4.attention import DeepseekV4Attention, ring_allowed, rope_tables
from moejax.models.deepseek_v4.config import DeepseekV4Config
from moejax.models.deepseek_v4.hyper import hc_head, hc_mappings, hc_residual
from moejax.models.layers import causal_allowed, param
from moejax.models.moe_block import MoE

class HyperConnection(nnx.Module):
    """One block's mHC mapping: fn [W H, (2 + W) W], base [(2 + W) W], scale [3], float32."""

    def __init__(self, cfg, rngs: nnx.Rngs):
        W, H = cfg.hc_mult, cfg.hidden_size
        self.fn = param(rngs, (W * H, (2 + W) * W), jnp.float32)
        self.base = nnx.Param(jnp.zeros(((2 + W) * W,), jnp.float32))
        self.scale = nnx.Param(jnp.ones((3,), jnp.float32))
        self.iters, self.eps, self.rms_eps = cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps

    def __call__(self, x_BSWH):
        return hc_mappings(x_BSWH, self.fn[...], self.base[...], self.scale[...], self.iters, self.eps, self.rms_eps)


class HyperHead(nnx.Module):
    """The final collapse of the streams: fn [W H, W], base [W], scale [1], float32."""

    def __init__(self, cfg, rngs: nnx.Rngs):
        W, H = cfg.hc_mult, cfg.hidden_size
        self.fn = param(rngs, (W * H, W), jnp.float32)
        self.base = nnx.Param(jnp.zeros((W,), jnp.float32))
        self.scale = nnx.Param(jnp.ones((1,), jnp.float32))
        self.eps, self.rms_eps = cfg.hc_eps, cfg.rms_norm_eps

    def __call__(self, x_BSWH):
        return hc_head(x_BSWH, self.fn[...], self.base[...], self.scale[...], self.eps, self.rms_eps)


class HyperDecoderLayer(nnx.Module):
    """A V4 block (transformers' `DeepseekV4DecoderLayer`) in the two halves of
    `moejax.models.causal_lm.DecoderLayer`, on the streams x [B, S, W, H]:

        attend:  post, comb, c = attn_hc(x);  h = post * attn(input_layernorm(c)) + comb^T x
                 z = post_attention_layernorm(ffn_hc(h)'s collapse)       (the router's input)
        feed:    post, comb, _ = ffn_hc(h);   out = post * moe(z, ids) + comb^T h

    (feed recomputes ffn_hc's mappings from h rather than carrying them: a few matmuls, and the
    halves' `Attended(h, z)` stays what every executor passes.)"""

    is_moe = True
    passes_carry = False

    def __init__(self, cfg, layer: int, dtype, rngs: nnx.Rngs, backend: str):
        self.input_layernorm = decoder_norm(cfg, jnp.float32)
        self.self_attn = DeepseekV4Attention(cfg, dtype, rngs, layer)
        self.post_attention_layernorm = decoder_norm(cfg, jnp.float32)
        self.attn_hc = HyperConnection(cfg, rngs)
        self.ffn_hc = HyperConnection(cfg, rngs)
        self.mlp = MoE(cfg, dtype, rngs, backend, cfg.experts_in_layer(layer), hashed=cfg.is_hash_layer(layer))

    def __call__(self, x, cos, sin, allowed, variant=None, forward_only: bool = False, carry=None,
                 ids_BS=None) -> LayerOutput:
        return self.feed(self.attend(x, cos, sin, allowed, carry), variant, forward_only, ids_BS)

    def attend(self, x_BSWH, cos, sin, allowed, carry=None) -> Attended:
        post, comb, collapsed = self.attn_hc(x_BSWH)
        a = self.self_attn(self.input_layernorm(collapsed).astype(x_BSWH.dtype), cos, sin, allowed)
        h = hc_residual(x_BSWH, a, post, comb)
        _, _, collapsed = self.ffn_hc(h)
        return Attended(h, self.post_attention_layernorm(collapsed).astype(h.dtype), carry)

    def feed(self, attended: Attended, variant=None, forward_only: bool = False, ids_BS=None) -> LayerOutput:
        h, z, carry = attended
        post, comb, _ = self.ffn_hc(h)
        y, routing = self.mlp(z, variant, forward_only, ids_BS)
        return LayerOutput(hc_residual(h, y, post, comb), routing, z, carry)

    def prefill(self, x, cos, sin, allowed_BSS, positions_BS, cache, variant=None, ids_BS=None):
        """The layer on a prompt, its attention's cache filled: (output streams, cache)."""
        post, comb, collapsed = self.attn_hc(x)
        a, cache = self.self_attn.prefill(self.input_layernorm(collapsed).astype(x.dtype), cos, sin, allowed_BSS,
                                          positions_BS, cache)
        return self._after_attention(x, a, post, comb, variant, ids_BS), cache

    def decode(self, x, cos, sin, positions_B1, cache, column, ring_B1W, variant=None, ids_B1=None):
        """The layer on one new token per row against its cache: (output streams, cache)."""
        post, comb, collapsed = self.attn_hc(x)
        a, cache = self.self_attn.decode(self.input_layernorm(collapsed).astype(x.dtype), cos, sin, positions_B1,
                                         cache, column, ring_B1W)
        return self._after_attention(x, a, post, comb, variant, ids_B1), cache

    def _after_attention(self, x, a, post, comb, variant, ids_BS):
        h = hc_residual(x, a, post, comb)
        _, _, collapsed = self.ffn_hc(h)
        attended = Attended(h, self.post_attention_layernorm(collapsed).astype(h.dtype))
        return self.feed(attended, variant, True, ids_BS).out_BSH


class DeepseekV4ForCausalLM(CausalLM):
    config_class = DeepseekV4Config
    attention_class = DeepseekV4Attention
    rope_tables = staticmethod(rope_tables)

    @classmethod
    def decoder_layer(cls, cfg, layer: int, dtype, rngs: nnx.Rngs, backend: str = "sorted") -> HyperDecoderLayer:
        return HyperDecoderLayer(cfg, layer, dtype, rngs, backend)

    def __init__(self, cfg, dtype=jnp.float32, *, rngs: nnx.Rngs | None = None, backend: str = "sorted",
                 hf_source=None):
        rngs = rngs or nnx.Rngs(0)
        super().__init__(cfg, dtype, rngs=rngs, backend=backend, hf_source=hf_source)
        self.model.norm = decoder_norm(cfg, jnp.float32)
        self.model.hc_head = self.exit_block(cfg, rngs)

    def __call__(self, input_ids_BS, attention_mask_BS=None, variant=None, return_routing: bool = False,
                 return_moe_inputs: bool = False, forward_only: bool = False, positions_BS=None):
        if positions_BS is not None:
            raise ConfigError("DeepSeek-V4: rope positions other than the columns 0..S-1 (positions_BS) are not "
                              "implemented: transformers' compressors number their windows by column")
        return super().__call__(input_ids_BS, attention_mask_BS, variant, return_routing, return_moe_inputs,
                                forward_only)

    EXIT_NAME = "hc_head"

    @classmethod
    def entry(cls, cfg, x_BSH):
        """The embedding copied into the hc_mult streams [B, S, W, H]."""
        return jnp.broadcast_to(x_BSH[:, :, None, :], x_BSH.shape[:2] + (cfg.hc_mult,) + x_BSH.shape[2:])

    @classmethod
    def exit_block(cls, cfg, rngs: nnx.Rngs):
        return HyperHead(cfg, rngs)

    # --- generation: the layers' `V4LayerCache`s (sliding-window ring, compressors' and indexer's
    # states) in the shared `KVCache`, whose valid_BC marks the columns holding a real token ---

    def prefill(self, input_ids_BP, positions_BP, attention_mask_BP, cache: KVCache, variant=None,
                last_only: bool = True) -> CachedOutput:
        """The forward on a left-padded prompt (rope and the compressed entries' visibility by
        positions_BP, as transformers' `generate` passes them; the window and the compressors by
        column) that also fills each layer's cache."""
        variant = _checked(variant, self.config)
        B, P = input_ids_BP.shape
        mask = attention_mask_BP.astype(bool)
        x = self._embed(input_ids_BP)
        cos, sin = self.rope_tables(self.config, positions_BP, x.dtype)
        allowed = causal_allowed(mask, B, P)
        layers = []
        for l, layer in enumerate(self.model.layers):
            x, layer_cache = layer.prefill(x, cos, sin, allowed, positions_BP, cache.layers[l],
                                           self._layer_variant(variant, l), input_ids_BP)
            layers.append(layer_cache)
        logits = self._logits(x[:, -1:] if last_only else x).astype(jnp.float32)
        return CachedOutput(logits, KVCache(tuple(layers), jax.lax.dynamic_update_slice(cache.valid_BC, mask, (0, 0))))

    def decode_step(self, input_ids_B1, positions_B1, cache: KVCache, column, variant=None) -> CachedOutput:
        """One new token per row at cache column `column`: logits [B, 1, V] and the cache after it."""
        variant = _checked(variant, self.config)
        valid = jax.lax.dynamic_update_slice(cache.valid_BC, jnp.ones((input_ids_B1.shape[0], 1), bool), (0, column))
        ring = ring_allowed(valid, column, self.config.sliding_window)
        x = self._embed(input_ids_B1)
        cos, sin = self.rope_tables(self.config, positions_B1, x.dtype)
        layers = []
        for l, layer in enumerate(self.model.layers):
            x, layer_cache = layer.decode(x, cos, sin, positions_B1, cache.layers[l], column, ring,
                                          self._layer_variant(variant, l), input_ids_B1)
            layers.append(layer_cache)
        return CachedOutput(self._logits(x).astype(jnp.float32), KVCache(tuple(layers), valid))

"""The decoder stack every family shares: embedding, decoder layers (attention + dense MLP or the
MoE block), final norm and head; the forward and the cache steps generation drives.

A family supplies its attention module and rope tables by subclassing `CausalLM`:

    class Qwen3MoeForCausalLM(CausalLM):
        config_class = Qwen3MoeConfig
        attention_class = GQAttention            # (cfg, dtype, rngs, layer): __call__, prefill, decode, empty_cache
        rope_tables = staticmethod(gqa_rope)     # (cfg, positions, dtype) -> (cos, sin)

    logits_BSV = model(input_ids_BS, attention_mask_BS, variant).logits_BSV

Nothing here imports above `moejax.models` (tests/test_import_graph.py): a model is loaded and saved
by `moejax.hf.model_io` (`moejax.from_pretrained`, `moejax.save_pretrained`), and generates through
`moejax.inference.generate.generate(model, ...)`.
"""

from __future__ import annotations

import functools
from typing import Callable, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.models.layers import MLP, RMSNorm, causal_allowed, linear, param
from moejax.models.moe_block import MoE
from moejax.models.variant import check_variant, maps_from_masks


def _checked(variant, config):
    """{MoE layer: ExpertMap} or None: `check_variant` (masks converted) before any compute; a
    variant traced inside a caller's jit (the lm-eval scorer, the generator) was checked by that
    caller before tracing, and is only converted when it is still a mask array."""
    if any(isinstance(a, jax.core.Tracer) for a in jax.tree.leaves(variant)):
        return variant if isinstance(variant, dict) else maps_from_masks(variant, config)
    return check_variant(variant, config)


class CausalLMOutput(NamedTuple):
    """What the forward returns, whatever is asked for: always the logits; the routing and the
    router inputs of every MoE layer when requested (None otherwise)."""

    logits_BSV: jax.Array
    routing: dict | None = None     # {layer: Routing}, tokens flattened batch-major (return_routing)
    moe_inputs: dict | None = None  # {layer: router input [B*S, H]} (return_moe_inputs)


class KVCache(NamedTuple):
    """The model's cache: one attention cache per decoder layer (the family's own kind), and which
    columns hold a real token (False: not written yet, or left padding)."""

    layers: tuple
    valid_BC: jax.Array


class CachedOutput(NamedTuple):
    logits_BSV: jax.Array  # float32 logits of the requested positions
    cache: KVCache


class Attended(NamedTuple):
    """A decoder layer's first half: the residual after attention, the MLP's (router's) input, and
    what the attention hands to later layers."""

    h_BSH: jax.Array  # x + attn(input_layernorm(x))
    z_BSH: jax.Array  # post_attention_layernorm(h): what the MLP (and the router) read
    carry: object = None  # an attention that `passes_carry`: what later layers need from it (GLM-5.2's
    #                        indexer selection [B, S, S]); else the carry handed in, unchanged (None)


class LayerOutput(NamedTuple):
    """A decoder layer's second half: its output, the MoE routing (None for a dense layer) and the
    MLP's input it was computed from."""

    out_BSH: jax.Array  # h + mlp(z)
    routing: object     # Routing of a MoE layer's tokens (flattened); None for a dense layer
    z_BSH: jax.Array
    carry: object = None  # what the attention hands to later layers (`passes_carry`), else None


def decoder_norm(cfg, dtype) -> RMSNorm:
    """The decoder's RMSNorm (layer norms and the final one) in the family's order of operations."""
    return RMSNorm.of(cfg, cfg.hidden_size, dtype)


class DecoderLayer(nnx.Module):
    """Pre-norm residual layer in two named halves: `attend` (x + attn(norm(x)), and the MLP's
    input) then `feed` (h + mlp(z), the MoE block in MoE layers). The forward, prefill and decode,
    the streamed executor and the carried pass all go through them, so no caller repeats the
    residual wiring."""

    def __init__(self, cfg, layer: int, dtype, rngs: nnx.Rngs, backend: str, attention_class):
        self.input_layernorm = decoder_norm(cfg, dtype)
        self.self_attn = attention_class(cfg, dtype, rngs, layer)
        self.post_attention_layernorm = decoder_norm(cfg, dtype)
        self.is_moe = cfg.is_moe_layer(layer)
        self.mlp = MoE(cfg, dtype, rngs, backend, cfg.experts_in_layer(layer)) if self.is_moe else MLP(
            cfg.hidden_size, cfg.intermediate_size, dtype, rngs)

    def __call__(self, x, cos, sin, allowed, variant=None, forward_only: bool = False, carry=None,
                 ids_BS=None) -> LayerOutput:
        """The whole layer. carry: what an earlier layer's attention handed on (an attention that
        `passes_carry`, GLM-5.2's shared indexer selection; None for every other), returned updated.
        ids_BS: the tokens' ids, which a hash-routed MoE layer chooses its experts by (`feed`)."""
        return self.feed(self.attend(x, cos, sin, allowed, carry), variant, forward_only, ids_BS)

    @property
    def passes_carry(self) -> bool:
        """True when this layer's attention takes something from earlier layers or hands something
        to later ones (its `carrying`, `prefill_carrying`, `decode_carrying`). Every caller threads
        the carry from layer to layer: the model's forward, prefill and decode, and the per-layer
        passes (the streamed executor, the carried pass), through `attend` and `feed`."""
        return getattr(self.self_attn, "passes_carry", False)

    def attend(self, x, cos, sin, allowed, carry=None) -> Attended:
        """The first half on the whole sequence (no cache); carry: what the layers before handed on."""
        if not self.passes_carry:
            return self._residual(x, self.self_attn(self.input_layernorm(x), cos, sin, allowed), carry)
        a, carry = self.self_attn.carrying(self.input_layernorm(x), cos, sin, allowed, carry)
        return self._residual(x, a, carry)

    def feed(self, attended: Attended, variant=None, forward_only: bool = False, ids_BS=None) -> LayerOutput:
        """The second half: h + mlp(z); a MoE layer under `variant` (None, a mask [E] or an
        ExpertMap), which a dense layer ignores. The attention's carry passes on. ids_BS: the
        tokens' ids [B, S], read only by a hash-routed MoE layer (DeepSeek-V4's `hash_moe`, which
        refuses to run without them); every other layer ignores them, so a pass over the other
        families need not hand them in."""
        h, z, carry = attended
        if not self.is_moe:
            return LayerOutput(h + self.mlp(z), None, z, carry)
        y, routing = self.mlp(z, variant, forward_only, ids_BS)
        return LayerOutput(h + y, routing, z, carry)

    def prefill(self, x, cos, sin, allowed_BSS, cache, variant=None, carry=None):
        """The layer on a prompt, its keys (or latents) written into the cache: (output, cache, carry)."""
        if self.passes_carry:
            a, cache, carry = self.self_attn.prefill_carrying(self.input_layernorm(x), cos, sin, allowed_BSS, cache,
                                                              carry)
        else:
            a, cache = self.self_attn.prefill(self.input_layernorm(x), cos, sin, allowed_BSS, cache)
        return self.feed(self._residual(x, a), variant, True).out_BSH, cache, carry

    def decode(self, x, cos, sin, cache, column, allowed_B1C, variant=None, carry=None):
        """The layer on one new token per row against its cache: (output, cache, carry)."""
        if self.passes_carry:
            a, cache, carry = self.self_attn.decode_carrying(self.input_layernorm(x), cos, sin, cache, column,
                                                             allowed_B1C, carry)
        else:
            a, cache = self.self_attn.decode(self.input_layernorm(x), cos, sin, cache, column, allowed_B1C)
        return self.feed(self._residual(x, a), variant, True).out_BSH, cache, carry

    def _residual(self, x, attention_out, carry=None) -> Attended:
        h = x + attention_out
        return Attended(h, self.post_attention_layernorm(h), carry)


class Decoder(nnx.Module):
    def __init__(self, cfg, dtype, rngs: nnx.Rngs, backend: str, layer_factory):
        self.embed_tokens = param(rngs, (cfg.vocab_size, cfg.hidden_size), dtype)
        self.layers = nnx.List([layer_factory(cfg, l, dtype, rngs, backend) for l in range(cfg.num_hidden_layers)])
        self.norm = decoder_norm(cfg, dtype)


class CausalLM(nnx.Module):
    """`logits = model(input_ids).logits_BSV`; loaded and saved by `moejax.from_pretrained` /
    `moejax.save_pretrained` (`moejax.hf.model_io`)."""

    config_class: ClassVar[type]
    attention_class: ClassVar[type]
    rope_tables: ClassVar[Callable]  # staticmethod (cfg, positions [S] or [B, S], dtype) -> (cos, sin)

    @classmethod
    def decoder_layer(cls, cfg, layer: int, dtype, rngs: nnx.Rngs, backend: str = "sorted") -> DecoderLayer:
        """One decoder layer alone (the streamed executors build and fill one at a time)."""
        return DecoderLayer(cfg, layer, dtype, rngs, backend, cls.attention_class)

    def __init__(self, cfg, dtype=jnp.float32, *, rngs: nnx.Rngs | None = None, backend: str = "sorted",
                 hf_source=None):
        """backend: the MoE layers' dispatch backend (`moejax.moe.dispatch`; "ep" on a mesh).
        hf_source: where the weights came from (`moejax.hf.model_io.HFSource`, set by
        from_pretrained), so save_pretrained gives back the source's dtypes and carried tensors."""
        if not isinstance(cfg, self.config_class):
            raise TypeError(f"{type(self).__name__} needs a {self.config_class.__name__}, got {type(cfg).__name__}")
        rngs = rngs or nnx.Rngs(0)
        self.config = cfg
        self.dtype = dtype
        self.hf_source = hf_source
        self.model = Decoder(cfg, dtype, rngs, backend, self.decoder_layer)
        self.lm_head = None if cfg.tie_word_embeddings else param(rngs, (cfg.hidden_size, cfg.vocab_size), dtype)

    def __call__(self, input_ids_BS, attention_mask_BS=None, variant=None, return_routing: bool = False,
                 return_moe_inputs: bool = False, forward_only: bool = False, positions_BS=None):
        """`CausalLMOutput`: logits [B, S, V] (and what is asked for). attention_mask: 1 = token, 0 =
        padding (keys that are padding are not attended to; positions stay 0..S-1 as in
        transformers). variant: None (unpruned), a pruning as bool [num_hidden_layers, E] (True = expert
        kept; rows of dense layers are ignored), or {MoE layer: ExpertMap} (`moejax.moe.expert_map`:
        pruned or merged experts; layers not named are unchanged). return_routing: also return {layer: Routing} of every MoE layer
        (tokens flattened batch-major); return_moe_inputs: also return {layer: router input
        [B*S, H]} (what calibration statistics are taken on); forward_only: no gradients will be
        taken (the routed experts then skip block padding; `jitted()` sets it); positions_BS: rope
        positions per token (default 0..S-1 in every row; generation uses the count of real tokens
        before each one, as transformers' `generate`)."""
        variant = _checked(variant, self.config)
        B, S = input_ids_BS.shape
        x = self._embed(input_ids_BS)
        cos, sin = self.rope_tables(self.config, jnp.arange(S) if positions_BS is None else positions_BS, x.dtype)
        allowed = causal_allowed(attention_mask_BS, B, S)
        routings, moe_inputs, carry = {}, {}, None
        for l, layer in enumerate(self.model.layers):
            out = layer(x, cos, sin, allowed, self._layer_variant(variant, l), forward_only, carry, input_ids_BS)
            x, carry = out.out_BSH, out.carry
            if out.routing is not None:
                routings[l], moe_inputs[l] = out.routing, out.z_BSH.reshape(B * S, -1)
        return CausalLMOutput(self._logits(x), routings if return_routing else None,
                              moe_inputs if return_moe_inputs else None)

    def _embed(self, input_ids_BS):
        """The decoder's input: the embedding rows of the ids, as `entry` makes them the residual."""
        return self.entry(self.config, self.model.embed_tokens[...][input_ids_BS])

    def _logits(self, x):
        head = self.model.embed_tokens[...].T if self.lm_head is None else self.lm_head[...]
        exit_block = getattr(self.model, self.EXIT_NAME) if self.EXIT_NAME else None
        return linear(self.model.norm(x if exit_block is None else exit_block(x)), head)

    # --- the residual's two ends, which the layer-streamed executors call too (`moejax.inference.stream`) ---
    # The residual the decoder layers hand on is what `entry` makes of the embedding rows [B, S, H]
    # (the rows themselves; DeepSeek-V4: hc_mult hyper-connection streams [B, S, W, H]); before the
    # final norm the module `model.<EXIT_NAME>` (None: none) collapses it back to [B, S, H]. The
    # executors never look inside the residual: they pass it between these hooks and the halves.
    EXIT_NAME: ClassVar[str | None] = None

    @classmethod
    def entry(cls, cfg, x_BSH):
        """The decoder's input residual from the embedding rows x [B, S, H]."""
        return x_BSH

    @classmethod
    def exit_block(cls, cfg, rngs: nnx.Rngs):
        """The module `model.<EXIT_NAME>` that collapses the last layer's residual to [B, S, H]
        before the final norm (built alone: the streamed head reads only its tensors), or None."""
        return None

    # --- generation (moejax.inference.generate.generate drives these three) ---

    def init_cache(self, batch: int, length: int) -> KVCache:
        """An empty cache of `length` columns in the model's dtype (what each column holds is the
        attention's choice: keys and values, or MLA's latents)."""
        layers = tuple(layer.self_attn.empty_cache(self.config, batch, length, self.dtype)
                       for layer in self.model.layers)
        return KVCache(layers, jnp.zeros((batch, length), bool))

    def prefill(self, input_ids_BP, positions_BP, attention_mask_BP, cache: KVCache, variant=None,
                last_only: bool = True) -> CachedOutput:
        """The forward on a (left-padded) prompt that also fills cache columns 0..P-1. Logits of
        the last position only unless last_only=False."""
        variant = _checked(variant, self.config)
        B, P = input_ids_BP.shape
        mask = attention_mask_BP.astype(bool)
        allowed_BPP = causal_allowed(mask, B, P)
        x = self.model.embed_tokens[...][input_ids_BP]
        cos, sin = self.rope_tables(self.config, positions_BP, x.dtype)
        layers, carry = [], None
        for l, layer in enumerate(self.model.layers):
            x, layer_cache, carry = layer.prefill(x, cos, sin, allowed_BPP, cache.layers[l],
                                                  self._layer_variant(variant, l), carry)
            layers.append(layer_cache)
        logits = self._logits(x[:, -1:] if last_only else x).astype(jnp.float32)
        return CachedOutput(logits, KVCache(tuple(layers), jax.lax.dynamic_update_slice(cache.valid_BC, mask, (0, 0))))

    def decode_step(self, input_ids_B1, positions_B1, cache: KVCache, column, variant=None) -> CachedOutput:
        """One new token per row, written into cache column `column` (after the prompt and the
        tokens before it), attending to every valid column up to its own. Logits [B, 1, V]."""
        variant = _checked(variant, self.config)
        C = cache.valid_BC.shape[1]
        valid = jax.lax.dynamic_update_slice(cache.valid_BC, jnp.ones((input_ids_B1.shape[0], 1), bool), (0, column))
        allowed_B1C = (valid & (jnp.arange(C) <= column)[None])[:, None, :]
        x = self.model.embed_tokens[...][input_ids_B1]
        cos, sin = self.rope_tables(self.config, positions_B1, x.dtype)
        layers, carry = [], None
        for l, layer in enumerate(self.model.layers):
            x, layer_cache, carry = layer.decode(x, cos, sin, cache.layers[l], column, allowed_B1C,
                                                 self._layer_variant(variant, l), carry)
            layers.append(layer_cache)
        return CachedOutput(self._logits(x).astype(jnp.float32), KVCache(tuple(layers), valid))

    def _layer_variant(self, variant, layer: int):
        """Layer `layer`'s ExpertMap of a checked variant ({MoE layer: ExpertMap}), None when the
        layer is dense or not named."""
        if variant is None or not self.model.layers[layer].is_moe:
            return None
        return variant.get(layer)

    def jitted(self):
        """A jitted inference forward (no gradients through it) with the same arguments as calling
        the model. The weights are passed as arguments (not captured as constants, not
        re-synchronised after every call as `nnx.jit` does, which costs seconds per call for a
        model of several GB). It captures the weights as they are now: call it again after
        changing them."""
        graphdef, state = nnx.split(self)

        @functools.partial(jax.jit, static_argnames=("return_routing", "return_moe_inputs"))
        def forward(state, input_ids, attention_mask=None, variant=None, return_routing=False,
                    return_moe_inputs=False, positions=None):
            return nnx.merge(graphdef, state)(input_ids, attention_mask, variant, return_routing,
                                              return_moe_inputs, forward_only=True, positions_BS=positions)

        def checked(input_ids, attention_mask=None, variant=None, return_routing=False, return_moe_inputs=False,
                    positions=None):
            return forward(state, input_ids, attention_mask, _checked(variant, self.config),
                           return_routing=return_routing, return_moe_inputs=return_moe_inputs, positions=positions)

        return checked

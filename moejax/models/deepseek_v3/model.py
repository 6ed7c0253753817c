"""DeepSeek-V3 family in Flax NNX: MLA attention, dense first layers, MoE layers routed by
`moejax.moe.routing.route` and run through `moejax.moe.dispatch`, shared experts.

Weights are stored [in, out] (x @ W). Routed experts are stacked [E, ...]; the router weight and
the balance bias stay float32 whatever the model dtype (as transformers keeps them). The forward
follows transformers' eager implementation (ref: shared/reference/deepseek-v3-hf.md section 2).

    model = DeepseekV3ForCausalLM.from_pretrained(path, dtype=jnp.float32)
    logits_BSV = model(input_ids_BS, attention_mask_BS, expert_masks_LE).logits_BSV
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from moejax import generate as generate_lib
from moejax.models.deepseek_v3 import rope as rope_lib
from moejax.models.deepseek_v3.config import DeepseekV3Config
from moejax.models.toy import BalanceBias
from moejax.moe import dispatch as dispatch_lib
from moejax.moe.routing import RouterConfig, route

LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm use the class default, not rms_norm_eps
HIGHEST = jax.lax.Precision.HIGHEST


def _param(rngs: nnx.Rngs, shape, dtype, std=0.02):
    return nnx.Param(jax.random.normal(rngs.params(), shape, jnp.float32).astype(dtype) * std)


def _ones(shape, dtype):
    return nnx.Param(jnp.ones(shape, dtype))


def linear(x, w, b=None):
    y = jnp.matmul(x, w, precision=HIGHEST)
    return y if b is None else y + b


def rms_norm(x, w, eps):
    """transformers' RMSNorm: normalise in float32, cast back, then scale (order matters in bf16)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return w * xf.astype(x.dtype)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype):
        self.weight = _ones((dim,), dtype)
        self.eps = eps

    def __call__(self, x):
        return rms_norm(x, self.weight[...], self.eps)


class MLP(nnx.Module):
    """SwiGLU MLP: the dense layers and the shared experts."""

    def __init__(self, hidden: int, inner: int, dtype, rngs: nnx.Rngs):
        self.gate_proj = _param(rngs, (hidden, inner), dtype)
        self.up_proj = _param(rngs, (hidden, inner), dtype)
        self.down_proj = _param(rngs, (inner, hidden), dtype)

    def __call__(self, x):
        w = {"gate": self.gate_proj[...], "up": self.up_proj[...], "down": self.down_proj[...]}
        return dispatch_lib.swiglu(linear, w, x)


class MLA(nnx.Module):
    """Multi-head latent attention (with or without a q LoRA)."""

    def __init__(self, cfg: DeepseekV3Config, dtype, rngs: nnx.Rngs):
        H, nh = cfg.hidden_size, cfg.num_attention_heads
        self.cfg = cfg
        if cfg.q_lora_rank is None:
            self.q_proj = _param(rngs, (H, nh * cfg.qk_head_dim), dtype)
        else:
            self.q_a_proj = _param(rngs, (H, cfg.q_lora_rank), dtype)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS, dtype)
            self.q_b_proj = _param(rngs, (cfg.q_lora_rank, nh * cfg.qk_head_dim), dtype)
        self.kv_a_proj_with_mqa = _param(rngs, (H, cfg.kv_lora_rank + cfg.qk_rope_head_dim), dtype)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, LATENT_NORM_EPS, dtype)
        self.kv_b_proj = _param(rngs, (cfg.kv_lora_rank, nh * (cfg.qk_nope_head_dim + cfg.v_head_dim)), dtype)
        self.o_proj = _param(rngs, (nh * cfg.v_head_dim, H), dtype)
        if cfg.attention_bias:
            zeros = lambda n: nnx.Param(jnp.zeros((n,), dtype))  # noqa: E731
            if cfg.q_lora_rank is not None:
                self.q_a_proj_bias = zeros(cfg.q_lora_rank)
            self.kv_a_proj_with_mqa_bias = zeros(cfg.kv_lora_rank + cfg.qk_rope_head_dim)
            self.o_proj_bias = zeros(H)

    def _bias(self, name):
        b = getattr(self, name + "_bias", None)
        return None if b is None else b[...]

    def _project(self, x_BSH, cos, sin):
        """Queries split into their no-rope part [B, S, N, dn] and rotated rope part [B, S, N, dr],
        the normalised KV latent [B, S, R] and the rotated shared rope key [B, S, dr]: everything
        attention needs, and (latent, rope key) is all a cache must keep."""
        cfg = self.cfg
        B, S, _ = x_BSH.shape
        nh, dn, dr = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        if cfg.q_lora_rank is None:
            q = linear(x_BSH, self.q_proj[...])
        else:
            q = linear(self.q_a_layernorm(linear(x_BSH, self.q_a_proj[...], self._bias("q_a_proj"))),
                       self.q_b_proj[...])
        q = q.reshape(B, S, nh, dn + dr)                                # per head: [nope | rope]
        q_pass, q_rot = q[..., :dn], q[..., dn:]
        ckv = linear(x_BSH, self.kv_a_proj_with_mqa[...], self._bias("kv_a_proj_with_mqa"))
        kv_latent, k_rot = ckv[..., :cfg.kv_lora_rank], ckv[..., cfg.kv_lora_rank:]
        q_rot = rope_lib.apply_rope(q_rot, cos, sin, cfg.rope_interleave)
        k_rot = rope_lib.apply_rope(k_rot[:, :, None, :], cos, sin, cfg.rope_interleave)[:, :, 0]  # one shared head
        return q_pass, q_rot, self.kv_a_layernorm(kv_latent), k_rot

    def __call__(self, x_BSH, cos, sin, allowed_BSS):
        """Attention over the keys of the same sequence, each head's keys and values expanded from
        the latent (as transformers computes it). cos/sin [S, dr] or [B, S, dr]."""
        return self._expanded_attention(*self._project(x_BSH, cos, sin), allowed_BSS)

    def _expanded_attention(self, q_pass, q_rot, latent, k_rot, allowed_BSS):
        cfg = self.cfg
        B, S = latent.shape[:2]
        nh, dn, dr, dv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        kv = linear(latent, self.kv_b_proj[...]).reshape(B, S, nh, dn + dv)
        k_nope, v = kv[..., :dn], kv[..., dn:]                          # per head: [k_nope | v]
        q = jnp.concatenate([q_pass, q_rot], axis=-1)
        k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rot[:, :, None], (B, S, nh, dr))], axis=-1)
        o = causal_attention(q, k, v, allowed_BSS, cfg.softmax_scale()).reshape(B, S, nh * dv)
        return linear(o, self.o_proj[...], self._bias("o_proj"))

    def prefill(self, x_BSH, cos, sin, allowed_BSS, cache: "LatentCache"):
        """`__call__` on a prompt that also writes its latents into cache columns 0..S-1:
        (output, cache)."""
        q_pass, q_rot, latent, k_rot = self._project(x_BSH, cos, sin)
        cache = LatentCache(jax.lax.dynamic_update_slice(cache.latent_BCR, latent.astype(cache.latent_BCR.dtype),
                                                         (0, 0, 0)),
                            jax.lax.dynamic_update_slice(cache.rope_BCQ, k_rot.astype(cache.rope_BCQ.dtype), (0, 0, 0)))
        return self._expanded_attention(q_pass, q_rot, latent, k_rot, allowed_BSS), cache

    def decode(self, x_B1H, cos, sin, cache: "LatentCache", column, allowed_B1C):
        """One new token per row, written into cache column `column`, attending to the cache's C
        columns where allowed_B1C. "Absorbed" MLA, as DeepSeek's own inference decodes: the
        per-head key projection is folded into the query (q_nope W_uk: scores against the latent
        itself) and the value projection is applied after the weighted sum of latents, so only
        kv_lora_rank + qk_rope_head_dim numbers per token are cached and nothing is expanded.
        Equal to `__call__` up to float rounding. Returns (output, updated cache)."""
        cfg = self.cfg
        B, S, _ = x_B1H.shape
        nh, dn, dv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
        q_pass, q_rot, latent, k_rot = self._project(x_B1H, cos, sin)
        cache = LatentCache(jax.lax.dynamic_update_slice(cache.latent_BCR, latent.astype(cache.latent_BCR.dtype),
                                                         (0, column, 0)),
                            jax.lax.dynamic_update_slice(cache.rope_BCQ, k_rot.astype(cache.rope_BCQ.dtype),
                                                         (0, column, 0)))
        w_kv_b = self.kv_b_proj[...].reshape(cfg.kv_lora_rank, nh, dn + dv)  # [R, N, dn + dv]
        q_latent = jnp.einsum("bsnq,rnq->bnsr", q_pass, w_kv_b[..., :dn], precision=HIGHEST)
        scores = (jnp.einsum("bnsr,bcr->bnsc", q_latent, cache.latent_BCR, precision=HIGHEST)
                  + jnp.einsum("bsnq,bcq->bnsc", q_rot, cache.rope_BCQ, precision=HIGHEST)) * cfg.softmax_scale()
        scores = jnp.where(allowed_B1C[:, None], scores, jnp.finfo(scores.dtype).min)
        weights = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(x_B1H.dtype)
        o_latent = jnp.einsum("bnsc,bcr->bsnr", weights, cache.latent_BCR, precision=HIGHEST)
        o = jnp.einsum("bsnr,rnu->bsnu", o_latent, w_kv_b[..., dn:], precision=HIGHEST).reshape(B, S, nh * dv)
        return linear(o, self.o_proj[...], self._bias("o_proj")), cache


class LatentCache(NamedTuple):
    """One MLA layer's KV cache: the normalised KV latent [B, C, R] (R = kv_lora_rank) and the
    rotated shared rope key [B, C, dr] of every cached token (C columns, preallocated)."""

    latent_BCR: jax.Array
    rope_BCQ: jax.Array


class KVCache(NamedTuple):
    """The model's cache: one LatentCache per decoder layer, and which columns hold a real token
    (False: not written yet, or left padding)."""

    layers: tuple
    valid_BC: jax.Array


class CausalLMOutput(NamedTuple):
    """What the forward returns, whatever is asked for: always the logits; the routing and the
    router inputs of every MoE layer when requested (None otherwise)."""

    logits_BSV: jax.Array
    routing: dict | None = None     # {layer: Routing}, tokens flattened batch-major (return_routing)
    moe_inputs: dict | None = None  # {layer: router input [B*S, H]} (return_moe_inputs)


class CachedOutput(NamedTuple):
    logits_BSV: jax.Array  # float32 logits of the requested positions
    cache: KVCache


def causal_allowed(attention_mask_BS, B: int, S: int):
    """bool [B, S, S]: query s may attend to key s' <= s that is not padding (mask 0)."""
    allowed = jnp.tril(jnp.ones((S, S), bool))[None]
    if attention_mask_BS is not None:
        allowed = allowed & jnp.asarray(attention_mask_BS).astype(bool)[:, None, :]
    return jnp.broadcast_to(allowed, (B, S, S))


def causal_attention(q_BSNQ, k_BSNQ, v_BSNU, allowed_BSS, scale: float, block_rows: int = 256):
    """softmax(q k^T * scale, masked) v per head (N heads, Q query/key and U value channels), in
    transformers' order of operations (scores scaled after the matmul, softmax in float32, weights
    cast back before multiplying v).

    allowed_BSS: True where query s may attend to key s'. It must be causal (False above the
    diagonal, padding may remove more): queries run in blocks of `block_rows`, and each block
    computes scores only for the keys up to its last query, so the masked upper triangle is neither
    multiplied nor exponentiated (about half the work). The arrays are head-major inside, where
    XLA:CPU runs both matmuls fastest (0.19 s against 0.41 s for the whole [S, S] in sequence-major
    layout at 2,048 tokens, Moonlight's 16 heads). A query that may attend to no key (left padding)
    gets uniform weights over its block's keys instead of over all keys: padding output either way.
    """
    B, S = q_BSNQ.shape[:2]
    q, k, v = (jnp.swapaxes(a, 1, 2) for a in (q_BSNQ, k_BSNQ, v_BSNU))  # [B, heads, S, d]
    block_rows = max(block_rows, -(-S // 16))  # at most 16 blocks: each is compiled separately
    bounds = list(range(0, S, block_rows)) + [S]
    outs = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        scores = jnp.einsum("bnqd,bnkd->bnqk", q[:, :, lo:hi], k[:, :, :hi], precision=HIGHEST) * scale
        scores = jnp.where(allowed_BSS[:, None, lo:hi, :hi], scores, jnp.finfo(scores.dtype).min)
        weights = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(q.dtype)
        outs.append(jnp.einsum("bnqk,bnkc->bnqc", weights, v[:, :, :hi], precision=HIGHEST))
    return jnp.swapaxes(jnp.concatenate(outs, axis=2), 1, 2)


class MoE(nnx.Module):
    """Router (float32, balance bias, groups) + routed experts (fast dispatch) + shared experts."""

    def __init__(self, cfg: DeepseekV3Config, dtype, rngs: nnx.Rngs, backend: str = "sorted"):
        H, Im, E = cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts
        self.router_cfg = RouterConfig(top_k=cfg.num_experts_per_tok, scoring_func="sigmoid", n_group=cfg.n_group,
                                       topk_group=cfg.topk_group, norm_topk_prob=cfg.norm_topk_prob,
                                       routed_scaling_factor=cfg.routed_scaling_factor)
        self.router = _param(rngs, (E, H), jnp.float32)                # HF gate.weight layout, float32
        self.bias = BalanceBias(jnp.zeros((E,), jnp.float32))          # e_score_correction_bias
        self.experts_gate = _param(rngs, (E, H, Im), dtype)
        self.experts_up = _param(rngs, (E, H, Im), dtype)
        self.experts_down = _param(rngs, (E, Im, H), dtype)
        self.shared_experts = MLP(H, Im * cfg.n_shared_experts, dtype, rngs) if cfg.n_shared_experts else None
        self.backend = backend

    def router_logits(self, x_TH):
        """[T, E] in float32 (the router stays float32 whatever the model dtype)."""
        return jnp.matmul(x_TH.astype(jnp.float32), self.router[...].T, precision=HIGHEST)

    def route(self, x_TH, expert_mask_E=None):
        return route(self.router_logits(x_TH), self.router_cfg, self.bias[...], expert_mask_E)

    def expert_weights(self) -> dict:
        """The routed experts' stacked weights as `moejax.moe.dispatch.swiglu` reads them."""
        return {"gate": self.experts_gate[...], "up": self.experts_up[...], "down": self.experts_down[...]}

    def __call__(self, x_BSH, expert_mask_E=None, forward_only: bool = False):
        """(output [B, S, H], the routing of the B*S tokens). forward_only: no gradients will be
        taken, so the routed experts may take the faster exact path (moejax.moe.dispatch)."""
        B, S, H = x_BSH.shape
        x_TH = x_BSH.reshape(B * S, H)
        r = self.route(x_TH, expert_mask_E)
        experts = self.expert_weights()
        y = dispatch_lib.dispatch(x_TH, r.expert_idx_TK, r.gate_TK, experts, dispatch_lib.swiglu, self.backend,
                                  forward_only=forward_only)
        y = y.reshape(B, S, H)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x_BSH)
        return y, r


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: DeepseekV3Config, layer: int, dtype, rngs: nnx.Rngs, backend: str = "sorted"):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = MLA(cfg, dtype, rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.is_moe = cfg.is_moe_layer(layer)
        self.mlp = MoE(cfg, dtype, rngs, backend) if self.is_moe else MLP(cfg.hidden_size, cfg.intermediate_size, dtype, rngs)

    def __call__(self, x, cos, sin, allowed, expert_mask_E=None, forward_only: bool = False):
        """(output, routing or None for a dense layer, the MLP's input)."""
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, allowed)
        return self._mlp_block(h, expert_mask_E, forward_only)

    def prefill(self, x, cos, sin, allowed_BSS, cache: LatentCache, expert_mask_E=None):
        """The layer on a prompt, its latents written into the cache: (output, cache)."""
        a, cache = self.self_attn.prefill(self.input_layernorm(x), cos, sin, allowed_BSS, cache)
        return self._mlp_block(x + a, expert_mask_E, True)[0], cache

    def decode(self, x, cos, sin, cache: LatentCache, column, allowed_B1C, expert_mask_E=None):
        """The layer on one new token per row against its latent cache: (output, cache)."""
        a, cache = self.self_attn.decode(self.input_layernorm(x), cos, sin, cache, column, allowed_B1C)
        return self._mlp_block(x + a, expert_mask_E, True)[0], cache

    def _mlp_block(self, h, expert_mask_E, forward_only):
        z = self.post_attention_layernorm(h)
        if not self.is_moe:
            return h + self.mlp(z), None, z
        y, routing = self.mlp(z, expert_mask_E, forward_only)
        return h + y, routing, z


class DeepseekV3Model(nnx.Module):
    def __init__(self, cfg: DeepseekV3Config, dtype, rngs: nnx.Rngs, backend: str = "sorted"):
        self.embed_tokens = _param(rngs, (cfg.vocab_size, cfg.hidden_size), dtype)
        self.layers = nnx.List([DecoderLayer(cfg, l, dtype, rngs, backend) for l in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)


class DeepseekV3ForCausalLM(nnx.Module):
    """`logits = model(input_ids).logits_BSV`; from_pretrained / save_pretrained live in `moejax.hf.model_io`."""

    def __init__(self, cfg: DeepseekV3Config, dtype=jnp.float32, *, rngs: nnx.Rngs | None = None,
                 backend: str = "sorted", hf_source=None):
        """backend: the MoE layers' dispatch backend (`moejax.moe.dispatch`; "ep" on a mesh).
        hf_source: where the weights came from (`moejax.hf.model_io.HFSource`, set by
        from_pretrained), so save_pretrained gives back the source's dtypes and carried tensors."""
        rngs = rngs or nnx.Rngs(0)
        self.config = cfg
        self.dtype = dtype
        self.hf_source = hf_source
        self.model = DeepseekV3Model(cfg, dtype, rngs, backend)
        self.lm_head = None if cfg.tie_word_embeddings else _param(rngs, (cfg.hidden_size, cfg.vocab_size), dtype)

    def __call__(self, input_ids_BS, attention_mask_BS=None, expert_masks_LE=None, return_routing: bool = False,
                 return_moe_inputs: bool = False, forward_only: bool = False, positions_BS=None):
        """`CausalLMOutput`: logits [B, S, V] (and what is asked for). attention_mask: 1 = token, 0 = padding (keys that are padding are not
        attended to; positions stay 0..S-1 as in transformers). expert_masks: bool [num_hidden_layers, E],
        True = expert kept (rows of dense layers are ignored). return_routing: also return
        {layer: Routing} of every MoE layer (tokens flattened batch-major); return_moe_inputs:
        also return {layer: router input [B*S, H]} (what calibration statistics are taken on);
        forward_only: no gradients will be taken (the routed experts then skip block padding;
        `jitted()` sets it); positions_BS: rope positions per token (default 0..S-1 in every row;
        generation uses the count of real tokens before each one, as transformers' `generate`)."""
        cfg = self.config
        B, S = input_ids_BS.shape
        x = self.model.embed_tokens[...][input_ids_BS]
        cos, sin = rope_lib.cos_sin(cfg, jnp.arange(S) if positions_BS is None else positions_BS, x.dtype)
        allowed = causal_allowed(attention_mask_BS, B, S)
        routings, moe_inputs = {}, {}
        for l, layer in enumerate(self.model.layers):
            x, routing, z = layer(x, cos, sin, allowed, self._layer_mask(expert_masks_LE, l), forward_only)
            if routing is not None:
                routings[l], moe_inputs[l] = routing, z.reshape(B * S, -1)
        return CausalLMOutput(self._logits(x), routings if return_routing else None,
                              moe_inputs if return_moe_inputs else None)

    def _logits(self, x_BSH):
        head = self.model.embed_tokens[...].T if self.lm_head is None else self.lm_head[...]
        return linear(self.model.norm(x_BSH), head)

    # --- generation (moejax.generate drives these three; any model family with them can generate) ---

    def init_cache(self, batch: int, length: int) -> KVCache:
        """An empty cache of `length` columns: kv_lora_rank + qk_rope_head_dim numbers per token
        and layer, in the model's dtype."""
        cfg = self.config
        layer = lambda: LatentCache(jnp.zeros((batch, length, cfg.kv_lora_rank), self.dtype),  # noqa: E731
                                    jnp.zeros((batch, length, cfg.qk_rope_head_dim), self.dtype))
        return KVCache(tuple(layer() for _ in self.model.layers), jnp.zeros((batch, length), bool))

    def prefill(self, input_ids_BP, positions_BP, attention_mask_BP, cache: KVCache, expert_masks_LE=None,
                last_only: bool = True) -> CachedOutput:
        """The forward on a (left-padded) prompt that also fills cache columns 0..P-1: attention
        as `__call__` computes it (keys and values expanded, causal blocks), only the latents
        kept. Logits of the last position only unless last_only=False."""
        B, P = input_ids_BP.shape
        mask = attention_mask_BP.astype(bool)
        allowed_BPP = causal_allowed(mask, B, P)
        x = self.model.embed_tokens[...][input_ids_BP]
        cos, sin = rope_lib.cos_sin(self.config, positions_BP, x.dtype)
        layers = []
        for l, layer in enumerate(self.model.layers):
            x, layer_cache = layer.prefill(x, cos, sin, allowed_BPP, cache.layers[l], self._layer_mask(expert_masks_LE, l))
            layers.append(layer_cache)
        logits = self._logits(x[:, -1:] if last_only else x).astype(jnp.float32)
        return CachedOutput(logits, KVCache(tuple(layers), jax.lax.dynamic_update_slice(cache.valid_BC, mask, (0, 0))))

    def decode_step(self, input_ids_B1, positions_B1, cache: KVCache, column, expert_masks_LE=None) -> CachedOutput:
        """One new token per row, written into cache column `column` (after the prompt and the
        tokens before it), attending to every valid column up to its own. Logits [B, 1, V]."""
        C = cache.valid_BC.shape[1]
        valid = jax.lax.dynamic_update_slice(cache.valid_BC, jnp.ones((input_ids_B1.shape[0], 1), bool), (0, column))
        allowed_B1C = (valid & (jnp.arange(C) <= column)[None])[:, None, :]
        x = self.model.embed_tokens[...][input_ids_B1]
        cos, sin = rope_lib.cos_sin(self.config, positions_B1, x.dtype)
        layers = []
        for l, layer in enumerate(self.model.layers):
            x, layer_cache = layer.decode(x, cos, sin, cache.layers[l], column, allowed_B1C,
                                          self._layer_mask(expert_masks_LE, l))
            layers.append(layer_cache)
        return CachedOutput(self._logits(x).astype(jnp.float32), KVCache(tuple(layers), valid))

    def _layer_mask(self, expert_masks_LE, layer: int):
        return None if expert_masks_LE is None or not self.model.layers[layer].is_moe else expert_masks_LE[layer]

    def generate(self, input_ids, attention_mask=None, *, max_new_tokens: int, expert_masks=None,
                 temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None, seed: int = 0,
                 stop_token_ids=None, **kw):
        """Prompt then continuation, int32 [B, prompt + max_new_tokens], as transformers' `generate`
        lays it out (see moejax.generate.generate)."""
        return generate_lib.generate(self, input_ids, attention_mask, max_new_tokens=max_new_tokens, expert_masks=expert_masks,
                        temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                        stop_token_ids=stop_token_ids, **kw)

    def jitted(self):
        """A jitted inference forward (no gradients through it) with the same arguments as calling
        the model. The weights are passed as arguments (not captured as constants, not
        re-synchronised after every call as `nnx.jit` does, which costs seconds per call for a
        model of several GB). It captures the weights as they are now: call it again after
        changing them."""
        graphdef, state = nnx.split(self)

        @functools.partial(jax.jit, static_argnames=("return_routing", "return_moe_inputs"))
        def forward(state, input_ids, attention_mask=None, expert_masks=None, return_routing=False,
                    return_moe_inputs=False, positions=None):
            return nnx.merge(graphdef, state)(input_ids, attention_mask, expert_masks, return_routing,
                                              return_moe_inputs, forward_only=True, positions_BS=positions)

        return functools.partial(forward, state)

    # thin forwards to the checkpoint code, so the API is where researchers expect it
    @classmethod
    def from_pretrained(cls, path, dtype=jnp.float32, **kw) -> "DeepseekV3ForCausalLM":
        from moejax.hf.model_io import load_pretrained

        return load_pretrained(path, dtype=dtype, **kw)

    def save_pretrained(self, out_dir, **kw):
        from moejax.hf.model_io import save_pretrained

        return save_pretrained(self, out_dir, **kw)

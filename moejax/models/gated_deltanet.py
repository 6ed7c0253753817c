"""The Gated DeltaNet linear-attention layer of Qwen3-Next (`qwen3_next`) and Qwen3.5-MoE
(`qwen3_5_moe`), as transformers computes it (`Qwen3NextGatedDeltaNet`, `Qwen3_5MoeGatedDeltaNet`
with their torch fallbacks `torch_chunk_gated_delta_rule`, `torch_recurrent_gated_delta_rule`,
`causal_conv1d_fn`, `causal_conv1d_update`).

One layer: project the input to q, k, v (one "mixed" vector of C channels), z (the output gate), b
and a; a depthwise causal convolution of width K over the mixed channels, then silu; beta =
sigmoid(b) and the log-decay g = -exp(A_log) * softplus(a + dt_bias); the gated delta rule per value
head (q and k l2-normalised, q scaled by 1/sqrt(D), each key head serving N / G consecutive value
heads)

    S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - exp(g_t) S_{t-1}^T k_t)^T,   o_t = S_t^T q_t

(S [D, V] per head); then the gated RMSNorm over each head's V channels (normalise, scale by the
weight, multiply by silu(z)) and the output projection. No rope: `cos`/`sin` are ignored.

Shape letters: B batch, S sequence, H hidden, C conv channels (2·G·D + N·V: all q, then all k, then
all v), K conv kernel width, G key heads (linear_num_key_heads), N value heads
(linear_num_value_heads), D key head dim (linear_key_head_dim), V value head dim
(linear_value_head_dim).

Parameters (HF `model.layers.{l}.linear_attn.<name>` -> attribute; HF Linear weights are [out, in],
moejax stores [in, out], i.e. transposed; nothing is reshaped):
    layout "qwen3_next":
        in_proj_qkvz.weight [2GD+2NV, H]  -> in_proj_qkvz [H, 2GD+2NV]  transposed. Its columns are
                                             grouped per key head: for key head i, q_i (D), k_i (D),
                                             then v and z of its N/G value heads (N/G·V each).
        in_proj_ba.weight   [2N, H]       -> in_proj_ba [H, 2N]  transposed; per key head i: b then
                                             a of its N/G value heads.
    layout "qwen3_5":
        in_proj_qkv.weight  [C, H]        -> in_proj_qkv [H, C]  transposed (all q | all k | all v)
        in_proj_z.weight    [NV, H]       -> in_proj_z [H, NV]   transposed
        in_proj_b.weight    [N, H]        -> in_proj_b [H, N]    transposed
        in_proj_a.weight    [N, H]        -> in_proj_a [H, N]    transposed
    both:
        conv1d.weight       [C, 1, K]     -> conv1d [C, 1, K]    as is (torch's depthwise Conv1d
                                             layout, kept so the loader copies it unchanged; the
                                             pure `causal_conv1d` takes it squeezed, [C, K])
        dt_bias             [N]           -> dt_bias [N]         as is (no ".weight" in the name)
        A_log               [N]           -> A_log [N]           as is (no ".weight" in the name)
        norm.weight         [V]           -> norm.weight [V]     as is (gated RMSNorm, a plain
                                             weight: not 1 + weight like the decoder's norms)
        out_proj.weight     [H, NV]       -> out_proj [NV, H]    transposed

dtypes, as transformers: projections, the conv (accumulated in float32, rounded, silu in float32,
rounded) and beta (sigmoid in float32, rounded once) in the model dtype; g in float32 (A_log and a
cast up, dt_bias promoted); the delta rule entirely in float32 (its output cast back to the model
dtype, its state kept in float32), its in-chunk prefix sums of g correctly rounded as torch's
float64-accumulated cumsum gives them (`cumsum_f32`); the gated norm normalises in float32, casts
back, scales by the weight in the model dtype, multiplies by silu(z) in float32 and casts back. With
identical inputs every stage matches transformers' bfloat16 bit for bit except where float32 exp /
softplus differ in the last bit (XLA's and torch's transcendental functions).

Caches: the conv state holds the last K mixed inputs [B, C, K] in the model dtype (transformers keeps
K, not K - 1: a decode step convolves the last K - 1 of them and the new input, then shifts); the
recurrent state [B, N, D, V] is float32.

Padding is exact per sequence: padded positions' inputs are zeroed before the projections (so the
conv sees zeros before each sequence, as an unpadded run does), their decay g and beta are set to 0
and k, v zeroed (so they neither decay nor write the state), and the delta rule runs on each row
rotated so that its real tokens start at position 0: the chunks of 64 then start at each sequence's
first token as in an unpadded run, and the padding, moved to the end, leaves the state unchanged
(exp(0) = 1, k = 0). A row's real tokens must be consecutive (padding on the left, as generation
lays rows out, or on the right).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.models.layers import HIGHEST, linear, ones, param

LAYOUTS = ("qwen3_next", "qwen3_5")


class DeltaNetCache(NamedTuple):
    """One linear-attention layer's cache: the last K conv inputs [B, C, K] (model dtype) and the
    recurrent state [B, N, D, V] (float32)."""

    conv_BCK: jax.Array
    state_BNDV: jax.Array


def l2norm(x, eps: float = 1e-6):
    """x * rsqrt(sum(x^2) + eps) over the last axis (transformers' / FLA's l2norm)."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def _silu_f32(x):
    xf = x.astype(jnp.float32)
    return xf * jax.nn.sigmoid(xf)


def _softplus(x):
    """torch's softplus (beta 1, threshold 20): x above 20, log1p(exp(x)) below."""
    return jnp.where(x > 20.0, x, jnp.log1p(jnp.exp(jnp.minimum(x, 20.0))))


def _two_sum(a, b):
    """a + b rounded, and its rounding error exactly (Knuth's TwoSum)."""
    s = a + b
    bb = s - a
    return s, (a - (s - bb)) + (b - bb)


def cumsum_f32(x, axis: int = -1):
    """Prefix sums of float32 x, each correctly rounded, as torch's cumsum on CPU gives them (it
    accumulates in float64): a compensated (TwoSum) associative scan. jnp.cumsum's own rounding
    differs, and the chunked rule subtracts these sums (cum_i - cum_j), so with strong decays (|cum|
    in the hundreds) their last bit moves the output by ~1e-5."""
    def combine(left, right):
        s, err = _two_sum(left[0], right[0])
        return s, left[1] + right[1] + err

    s, e = jax.lax.associative_scan(combine, (x, jnp.zeros_like(x)), axis=axis)
    return s + e


def causal_conv1d(x_BSC, w_CK, state_BCK=None):
    """Depthwise causal convolution of width K, then silu: y[t] = silu(sum_j w[:, j] x[t - K + 1 + j]),
    the inputs before the first taken from `state_BCK` (the K inputs before x, oldest first; zeros
    when None). Accumulated in float32, rounded to x's dtype, silu in float32, rounded again
    (transformers' conv1d and silu on its dtype). Returns (y_BSC, the last K inputs [B, C, K])."""
    B, S, C = x_BSC.shape
    K = w_CK.shape[-1]
    if state_BCK is None:
        state_BCK = jnp.zeros((B, C, K), x_BSC.dtype)
    full = jnp.concatenate([jnp.swapaxes(state_BCK, 1, 2).astype(x_BSC.dtype), x_BSC], axis=1)  # [B, K+S, C]
    w = w_CK.astype(jnp.float32)
    acc = sum(full[:, 1 + j:1 + j + S].astype(jnp.float32) * w[:, j] for j in range(K))
    y = _silu_f32(acc.astype(x_BSC.dtype)).astype(x_BSC.dtype)
    return y, jnp.swapaxes(full[:, -K:], 1, 2)


def _prepare(q_BSGD, k_BSGD, v_BSNV, g_BSN, beta_BSN, use_qk_l2norm_in_kernel):
    """Key heads repeated over their value heads, everything float32 and head-major [B, N, S, ...],
    q and k l2-normalised when asked (before q is scaled)."""
    G, N = k_BSGD.shape[2], v_BSNV.shape[2]
    if G != N:
        q_BSGD = jnp.repeat(q_BSGD, N // G, axis=2)
        k_BSGD = jnp.repeat(k_BSGD, N // G, axis=2)
    q, k, v, beta, g = (jnp.swapaxes(t, 1, 2).astype(jnp.float32) for t in (q_BSGD, k_BSGD, v_BSNV, beta_BSN, g_BSN))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    return q, k, v, g, beta


def _triangular_solve(a_LL, b_LC):
    with jax.default_matmul_precision("highest"):
        return jax.lax.linalg.triangular_solve(a_LL, b_LC, left_side=True, lower=True, unit_diagonal=True)


def unit_lower_solve(a_LL, b_LC):
    """x with (I + strictly lower part of a) x = b over the last two axes (a [..., L, L], b [..., L,
    C]; a's diagonal and upper part are ignored), by forward substitution in plain XLA ops, a row
    at a time: x_i = b_i - a_i . x, the dot product over the rows already solved (the others still
    zero), accumulated by XLA's dot at full float32 precision. On DeltaNet-like systems (L = 64) it
    is closer to float64 than LAPACK's trsm (max relative error 0.9e-7 against 2.4e-7) and than a
    column-at-a-time substitution (3.6e-7). The chunked rule's solve where the program is lowered
    for CPU; elsewhere it is `jax.lax.linalg.triangular_solve` (cuBLAS / XLA's own).

    Not `triangular_solve` on CPU: there it is LAPACK's trsm custom call (`lapack_strsm_ffi`),
    which splits its batch over XLA:CPU's intra-op thread pool and blocks its thread until those
    tasks finish. The simulated devices of a mesh share that pool, and a collective that XLA runs
    on a pool thread blocks it until every device of its group arrives: with expert parallelism on
    a (2, 4) simulated mesh, pool threads all ended up waiting, either in the all-gather's
    rendezvous or in a trsm whose tasks could get no thread, and the forward stalled with the CPU
    idle."""
    L = a_LL.shape[-1]
    strict = jnp.where(jnp.tril(jnp.ones((L, L), bool), -1), a_LL, jnp.zeros((), a_LL.dtype))

    def step(i, x):
        a_i = jax.lax.dynamic_index_in_dim(strict, i, axis=-2)        # [..., 1, L], zero at columns >= i
        b_i = jax.lax.dynamic_index_in_dim(b_LC, i, axis=-2)          # [..., 1, C]
        x_i = b_i - jnp.matmul(a_i, x, precision=jax.lax.Precision.HIGHEST)
        return jax.lax.dynamic_update_index_in_dim(x, x_i, i, axis=-2)

    return jax.lax.fori_loop(0, L, step, jnp.zeros_like(b_LC))


def chunk_gated_delta_rule(q_BSGD, k_BSGD, v_BSNV, g_BSN, beta_BSN, chunk_size: int = 64, initial_state=None,
                           use_qk_l2norm_in_kernel: bool = False):
    """The gated delta rule over chunks of `chunk_size` tokens (transformers'
    `torch_chunk_gated_delta_rule`, same order of operations): within a chunk the delta updates are
    condensed by a unit lower-triangular solve, a scan carries the state across chunks. In float32;
    returns (out [B, S, N, V] in q's dtype, final state [B, N, D, V] float32). `initial_state` [B, N,
    D, V] or None (zeros). The sequence is padded at the end to a multiple of `chunk_size` with
    q = k = v = beta = g = 0, which leaves the state unchanged."""
    out_dtype = q_BSGD.dtype
    B, S = k_BSGD.shape[:2]
    D = k_BSGD.shape[-1]
    N, V = v_BSNV.shape[-2:]
    q, k, v, g, beta = _prepare(q_BSGD, k_BSGD, v_BSNV, g_BSN, beta_BSN, use_qk_l2norm_in_kernel)
    q = q * D ** -0.5
    L = chunk_size
    pad = (L - S % L) % L
    q, k, v = (jnp.pad(t, ((0, 0), (0, 0), (0, pad), (0, 0))) for t in (q, k, v))
    beta, g = (jnp.pad(t, ((0, 0), (0, 0), (0, pad))) for t in (beta, g))
    n = (S + pad) // L
    v_beta = v * beta[..., None]
    k_beta = k * beta[..., None]
    q, k, k_beta, v_beta = (t.reshape(B, N, n, L, t.shape[-1]) for t in (q, k, k_beta, v_beta))
    g = g.reshape(B, N, n, L)
    upper = jnp.triu(jnp.ones((L, L), bool), 1)
    cum = cumsum_f32(g, axis=-1)  # log of the decay from the chunk's start through each position
    pairwise = jnp.exp(jnp.where(upper, -jnp.inf, cum[..., :, None] - cum[..., None, :]))
    ut_system = jnp.einsum("...id,...jd->...ij", k_beta, k, precision=HIGHEST) * pairwise
    intra = jnp.einsum("...id,...jd->...ij", q, k, precision=HIGHEST) * pairwise
    decayed_k_beta = k_beta * jnp.exp(cum)[..., None]
    # (I + strictly lower part of ut_system)^-1 [v_beta | decayed_k_beta]: one solve for both
    solved = jax.lax.platform_dependent(ut_system, jnp.concatenate([v_beta, decayed_k_beta], axis=-1),
                                        cpu=unit_lower_solve, default=_triangular_solve)
    new_values, k_cumdecay = solved[..., :V], solved[..., V:]
    q = q * jnp.exp(cum)[..., None]
    k = k * jnp.exp(cum[..., -1:] - cum)[..., None]
    chunk_decay = jnp.exp(cum[..., -1])[..., None, None]

    state = (jnp.zeros((B, N, D, V), jnp.float32) if initial_state is None
             else jnp.asarray(initial_state).astype(jnp.float32))

    def step(state, xs):
        nv, kcd, qi, ki, attn, decay = xs
        v_new = nv - jnp.einsum("bnld,bndv->bnlv", kcd, state, precision=HIGHEST)
        out = (jnp.einsum("bnld,bndv->bnlv", qi, state, precision=HIGHEST)
               + jnp.einsum("bnlm,bnmv->bnlv", attn, v_new, precision=HIGHEST))
        state = state * decay + jnp.einsum("bnld,bnlv->bndv", ki, v_new, precision=HIGHEST)
        return state, out

    chunked = (new_values, k_cumdecay, q, k, intra, chunk_decay)
    state, out = jax.lax.scan(step, state, tuple(jnp.moveaxis(t, 2, 0) for t in chunked))
    out = jnp.moveaxis(out, 0, 2).reshape(B, N, n * L, V)[:, :, :S]
    return jnp.swapaxes(out, 1, 2).astype(out_dtype), state


def recurrent_gated_delta_rule(q_BSGD, k_BSGD, v_BSNV, g_BSN, beta_BSN, initial_state=None,
                               use_qk_l2norm_in_kernel: bool = False):
    """The gated delta rule token by token (transformers' `torch_recurrent_gated_delta_rule`, a
    `lax.scan` over the sequence): decay the state, read k's memory, write beta (v - memory) along k,
    read with q (scaled by dividing by sqrt(D), as transformers does here). In float32; returns (out
    [B, S, N, V] in q's dtype, final state [B, N, D, V] float32)."""
    out_dtype = q_BSGD.dtype
    B = k_BSGD.shape[0]
    D = k_BSGD.shape[-1]
    N, V = v_BSNV.shape[-2:]
    q, k, v, g, beta = _prepare(q_BSGD, k_BSGD, v_BSNV, g_BSN, beta_BSN, use_qk_l2norm_in_kernel)
    q = q / D ** 0.5
    state = (jnp.zeros((B, N, D, V), jnp.float32) if initial_state is None
             else jnp.asarray(initial_state).astype(jnp.float32))

    def step(state, xs):
        q_t, k_t, v_t, g_t, beta_t = xs
        state = state * jnp.exp(g_t)[..., None, None]
        kv_mem = jnp.sum(state * k_t[..., :, None], axis=-2)
        delta = (v_t - kv_mem) * beta_t[..., None]
        state = state + k_t[..., :, None] * delta[..., None, :]
        return state, jnp.sum(state * q_t[..., :, None], axis=-2)

    state, out = jax.lax.scan(step, state, tuple(jnp.moveaxis(t, 2, 0) for t in (q, k, v, g, beta)))
    return jnp.moveaxis(out, 0, 1).astype(out_dtype), state  # [S, B, N, V] -> [B, S, N, V]


def gated_rms_norm(x, gate, w, eps):
    """transformers' RMSNormGated: normalise x in float32, cast back, scale by w, multiply by
    silu(gate) in float32, cast back to x's dtype (norm before gate)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    h = w * xf.astype(x.dtype)
    return (h.astype(jnp.float32) * _silu_f32(gate)).astype(x.dtype)


class GatedRMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype):
        self.weight = ones((dim,), dtype)
        self.eps = eps

    def __call__(self, x, gate):
        return gated_rms_norm(x, gate, self.weight[...], self.eps)


def _roll_rows(x_BS, shift_B):
    """Row b's positions rotated left by shift_B[b]: out[b, s] = x[b, (s + shift[b]) % S]."""
    B, S = x_BS.shape[:2]
    idx = (jnp.arange(S)[None, :] + shift_B[:, None]) % S
    return jnp.take_along_axis(x_BS, idx.reshape(B, S, *([1] * (x_BS.ndim - 2))), axis=1)


class GatedDeltaNet(nnx.Module):
    """The linear-attention layer; `layout` "qwen3_next" (fused in_proj_qkvz / in_proj_ba, grouped
    per key head) or "qwen3_5" (separate in_proj_qkv / in_proj_z / in_proj_b / in_proj_a)."""

    def __init__(self, cfg, dtype, rngs: nnx.Rngs, layout: str):
        if layout not in LAYOUTS:
            raise ValueError(f"GatedDeltaNet layout {layout!r}: expected one of {LAYOUTS}")
        act = getattr(cfg, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"GatedDeltaNet: the conv activation is silu, the config says {act!r}")
        H = cfg.hidden_size
        G, N = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        D, V, K = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim
        if N % G:
            raise ValueError(f"GatedDeltaNet: {N} value heads are not a multiple of {G} key heads")
        self.layout = layout
        self.n_k_heads, self.n_v_heads, self.k_dim, self.v_dim, self.kernel = G, N, D, V, K
        C = 2 * G * D + N * V
        if layout == "qwen3_next":
            self.in_proj_qkvz = param(rngs, (H, 2 * G * D + 2 * N * V), dtype)
            self.in_proj_ba = param(rngs, (H, 2 * N), dtype)
        else:
            self.in_proj_qkv = param(rngs, (H, C), dtype)
            self.in_proj_z = param(rngs, (H, N * V), dtype)
            self.in_proj_b = param(rngs, (H, N), dtype)
            self.in_proj_a = param(rngs, (H, N), dtype)
        self.conv1d = param(rngs, (C, 1, K), dtype, std=K ** -0.5)
        self.dt_bias = ones((N,), dtype)
        A = jax.random.uniform(rngs.params(), (N,), jnp.float32, 0.01, 16.0)  # transformers' init
        self.A_log = nnx.Param(jnp.log(A).astype(dtype))
        self.norm = GatedRMSNorm(V, cfg.rms_norm_eps, dtype)
        self.out_proj = param(rngs, (N * V, H), dtype)

    @staticmethod
    def empty_cache(cfg, batch: int, length: int, dtype) -> DeltaNetCache:
        """Zero states (`length`, the other layers' cache length, does not apply)."""
        G, N = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        D, V, K = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim
        return DeltaNetCache(jnp.zeros((batch, 2 * G * D + N * V, K), dtype), jnp.zeros((batch, N, D, V), jnp.float32))

    def _project(self, x_BSH):
        """(mixed q|k|v [B, S, C], z [B, S, N, V], b [B, S, N], a [B, S, N]) in the model dtype."""
        B, S, _ = x_BSH.shape
        G, N, D, V = self.n_k_heads, self.n_v_heads, self.k_dim, self.v_dim
        if self.layout == "qwen3_next":
            r = N // G
            qkvz = linear(x_BSH, self.in_proj_qkvz[...]).reshape(B, S, G, 2 * D + 2 * r * V)
            q, k = qkvz[..., :D], qkvz[..., D:2 * D]
            v, z = qkvz[..., 2 * D:2 * D + r * V], qkvz[..., 2 * D + r * V:]
            mixed = jnp.concatenate([q.reshape(B, S, G * D), k.reshape(B, S, G * D), v.reshape(B, S, N * V)], -1)
            ba = linear(x_BSH, self.in_proj_ba[...]).reshape(B, S, G, 2 * r)
            b, a = ba[..., :r].reshape(B, S, N), ba[..., r:].reshape(B, S, N)
        else:
            mixed = linear(x_BSH, self.in_proj_qkv[...])
            z = linear(x_BSH, self.in_proj_z[...])
            b, a = linear(x_BSH, self.in_proj_b[...]), linear(x_BSH, self.in_proj_a[...])
        return mixed, z.reshape(B, S, N, V), b, a

    def _split(self, mixed_BSC):
        B, S, _ = mixed_BSC.shape
        kd = self.n_k_heads * self.k_dim
        q = mixed_BSC[..., :kd].reshape(B, S, self.n_k_heads, self.k_dim)
        k = mixed_BSC[..., kd:2 * kd].reshape(B, S, self.n_k_heads, self.k_dim)
        v = mixed_BSC[..., 2 * kd:].reshape(B, S, self.n_v_heads, self.v_dim)
        return q, k, v

    def _gates(self, a_BSN, b_BSN):
        """beta = sigmoid(b) (computed in float32, rounded once to the model dtype, as torch's
        sigmoid on bfloat16); g = -exp(A_log) softplus(a + dt_bias) in float32."""
        beta = jax.nn.sigmoid(b_BSN.astype(jnp.float32)).astype(b_BSN.dtype)
        g = -jnp.exp(self.A_log[...].astype(jnp.float32)) * _softplus(a_BSN.astype(jnp.float32) + self.dt_bias[...])
        return g, beta

    def _out(self, o_BSNV, z_BSNV):
        B, S = o_BSNV.shape[:2]
        o = self.norm(o_BSNV, z_BSNV)
        return linear(o.reshape(B, S, self.n_v_heads * self.v_dim), self.out_proj[...])

    def _forward(self, x_BSH, allowed_BSS):
        B, S, _ = x_BSH.shape
        if allowed_BSS is None:
            real_BS = jnp.ones((B, S), bool)
        else:
            real_BS = jnp.diagonal(allowed_BSS, axis1=1, axis2=2)
        x_BSH = jnp.where(real_BS[..., None], x_BSH, jnp.zeros((), x_BSH.dtype))
        mixed, z, b, a = self._project(x_BSH)
        mixed, conv_state = causal_conv1d(mixed, self.conv1d[...][:, 0], None)
        q, k, v = self._split(mixed)
        g, beta = self._gates(a, b)
        # padding neither decays nor writes the state
        zero = lambda t: jnp.where(real_BS.reshape(B, S, *([1] * (t.ndim - 2))), t, jnp.zeros((), t.dtype))
        q, k, v, g, beta = (zero(t) for t in (q, k, v, g, beta))
        # each row's real tokens first: chunks start at the sequence's first token, padding at the end
        # (a row's real tokens are consecutive: padding on the left, as generation lays rows out, or
        # on the right, as a batch of texts may be)
        first = jnp.argmax(real_BS, axis=1).astype(jnp.int32)
        o, state = chunk_gated_delta_rule(*(_roll_rows(t, first) for t in (q, k, v, g, beta)),
                                          use_qk_l2norm_in_kernel=True)
        o = _roll_rows(o, -first)
        return self._out(o, z), DeltaNetCache(conv_state, state)

    def __call__(self, x_BSH, cos, sin, allowed_BSS):
        """The layer on a padded batch (each row's real tokens consecutive); the padding is the False
        entries of allowed_BSS's diagonal. cos, sin: ignored."""
        return self._forward(x_BSH, allowed_BSS)[0]

    def prefill(self, x_BSH, cos, sin, allowed_BSS, cache: DeltaNetCache):
        """`__call__` on a left-padded prompt that also returns the states after each row's last
        token (the incoming cache's contents are replaced, its dtypes kept): (output, cache)."""
        y, new = self._forward(x_BSH, allowed_BSS)
        return y, DeltaNetCache(new.conv_BCK.astype(cache.conv_BCK.dtype), new.state_BNDV.astype(cache.state_BNDV.dtype))

    def decode(self, x_B1H, cos, sin, cache: DeltaNetCache, column=None, allowed_B1C=None):
        """New token(s) per row from the cached states (the recurrent form; `column` and
        `allowed_B1C` are not needed): (output, cache)."""
        mixed, z, b, a = self._project(x_B1H)
        mixed, conv_state = causal_conv1d(mixed, self.conv1d[...][:, 0], cache.conv_BCK)
        q, k, v = self._split(mixed)
        g, beta = self._gates(a, b)
        o, state = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=cache.state_BNDV,
                                              use_qk_l2norm_in_kernel=True)
        return self._out(o, z), DeltaNetCache(conv_state.astype(cache.conv_BCK.dtype),
                                              state.astype(cache.state_BNDV.dtype))

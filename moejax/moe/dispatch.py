"""Dispatch: run each token through its chosen experts and combine with the gates.

Every backend has one signature,

    dispatch(x_TD, expert_idx_TK, gate_TK, weights, expert_fn, backend=...) -> y_TD

and is built from `pair_outputs` (each routed pair's expert output `f_j(x)`, before the gate)
plus `combine` (the gate-weighted sum). Scores such as REAP need `f_j(x)` itself, which is why
the pair outputs are public.

Backends
- "dense":  every expert on every token, then pick the routed pairs. E/K times the work; the
            oracle the others are tested against.
- "sorted": only the routed pairs. Pairs are sorted by expert and laid out in fixed-size row
            blocks, each block belonging to one expert (groups padded to a multiple of the block),
            then a matmul per block (batched for small experts, a loop for large ones): a grouped
            matmul in plain XLA with static shapes.
            Exact (no token dropping), empty experts cost nothing, gradients flow through the
            gathers. Padding is at most E * (block_rows - 1) rows. With `forward_only` (no
            gradients) large experts skip the padding: a loop over experts runs each group in
            full chunks plus one remainder rounded up to 32 rows.
- "ragged": the same sorted pairs through `jax.lax.ragged_dot` (native on GPU/TPU; XLA:CPU
            expands it densely, so prefer "sorted" on CPU).
- "ep":     expert parallelism over the "expert" axis of the mesh set with `jax.set_mesh`
            (moejax/moe/expert_parallel.py): each device holds E/P experts and computes their pairs.

Experts are described by a pure `expert_fn(linear, w, x)` where `w` is one expert's weights and
`linear(x, W)` is the matmul to use. The same function then runs as a single expert (vmapped
over E for the oracle) and as a grouped matmul over blocks. See `relu_mlp` and `swiglu`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from moejax.moe.expert_parallel import ep_pair_outputs
from moejax.moe.grouped import (ExpertFn, Linear, dense_pair_outputs, exact_expert_loop_combined, joined,
                                large_experts, ragged_pair_outputs, sorted_pair_outputs)


BACKENDS = ("dense", "sorted", "ragged", "ep")


def relu_mlp(linear: Linear, w: dict, x: jax.Array) -> jax.Array:
    """The toy expert of SPEC section 4: W2 . relu(W1 . x); w1 [D, F], w2 [F, D]."""
    return linear(jax.nn.relu(linear(x, w["w1"])), w["w2"])


def swiglu(linear: Linear, w: dict, x: jax.Array) -> jax.Array:
    """The SwiGLU expert of every family: down(silu(gate(x)) * up(x)); gate/up [D, F], down [F, D]."""
    return linear(jax.nn.silu(linear(x, w["gate"])) * linear(x, w["up"]), w["down"])


@dataclasses.dataclass(frozen=True)
class ClampedSwiglu:
    """gpt-oss's expert (transformers' `GptOssExperts._apply_gate`): one [D, 2F] matrix whose even
    columns are the gate and odd the up projection, both biased; gate clamped above at `limit`, up
    to [-limit, limit]; down((up + 1) * gate * sigmoid(alpha * gate)) + down_bias. gate_up [D, 2F],
    gate_up_bias [2F], down [F, D], down_bias [D]."""

    alpha: float
    limit: float

    def __call__(self, linear: Linear, w: dict, x: jax.Array) -> jax.Array:
        gate_up = linear(x, w["gate_up"], w["gate_up_bias"])
        gate = jnp.minimum(gate_up[..., 0::2], self.limit)
        up = jnp.clip(gate_up[..., 1::2], -self.limit, self.limit)
        return linear((up + 1) * (gate * jax.nn.sigmoid(gate * self.alpha)), w["down"], w["down_bias"])


@dataclasses.dataclass(frozen=True)
class LimitedSwiglu:
    """DeepSeek-V4's expert, routed and shared (transformers' `DeepseekV4Experts._apply_gate` and
    `DeepseekV4MLP`): SwiGLU's weights, gate clamped above at `limit` and up to [-limit, limit]
    before silu(gate) * up (`swiglu_limit`; unlike gpt-oss's, no alpha, no biases, no up + 1).
    gate/up [D, F], down [F, D]: the "swiglu" kind's weights."""

    limit: float

    def __call__(self, linear: Linear, w: dict, x: jax.Array) -> jax.Array:
        gate = jnp.minimum(linear(x, w["gate"]), self.limit)
        up = jnp.clip(linear(x, w["up"]), -self.limit, self.limit)
        return linear(jax.nn.silu(gate) * up, w["down"])


# An expert kind's matrices and their shapes for hidden width D and inner width F (one expert; a
# layer stacks E of each): what the MoE block holds as `experts_<name>` and a variant's table holds.
EXPERT_SHAPES = {
    "swiglu": lambda D, F: {"gate": (D, F), "up": (D, F), "down": (F, D)},
    "clamped_swiglu": lambda D, F: {"gate_up": (D, 2 * F), "gate_up_bias": (2 * F,), "down": (F, D),
                                    "down_bias": (D,)},
}


def _expert_parallel(x_TD, expert_idx_TK, weights, expert_fn, forward_only=False):
    return ep_pair_outputs(x_TD, expert_idx_TK, weights, expert_fn, forward_only=forward_only)


def _sorted(x_TD, expert_idx_TK, weights, expert_fn, forward_only=False):
    return sorted_pair_outputs(x_TD, expert_idx_TK, weights, expert_fn, forward_only=forward_only)


def _skipping_absent(impl):
    """A backend without absent-pair support, given it: index E computes expert E-1, then zeros."""
    def wrapped(x_TD, expert_idx_TK, weights, expert_fn, forward_only=False):
        if not forward_only:
            return impl(x_TD, expert_idx_TK, weights, expert_fn)
        n_experts = jax.tree.leaves(weights)[0].shape[0]
        y = impl(x_TD, jnp.minimum(expert_idx_TK, n_experts - 1), weights, expert_fn)
        return jnp.where((expert_idx_TK < n_experts)[..., None], y, 0)
    return wrapped


_PAIR_OUTPUTS = {"dense": _skipping_absent(dense_pair_outputs), "sorted": _sorted,
                 "ragged": _skipping_absent(ragged_pair_outputs), "ep": _expert_parallel}


def pair_outputs(x_TD, expert_idx_TK, weights, expert_fn: ExpertFn, backend: str = "sorted",
                 forward_only: bool = False):
    """Expert output f_j(x_t) of every routed pair (before the gate), [T, K, D].

    forward_only: no gradients will be taken, and pairs with expert index E are absent (zeros);
    the sorted and expert-parallel backends then skip the blocks nobody uses."""
    try:
        impl = _PAIR_OUTPUTS[backend]
    except KeyError:
        raise ValueError(f"unknown dispatch backend {backend!r}; valid: {', '.join(BACKENDS)}") from None
    return impl(x_TD, expert_idx_TK, joined(weights), expert_fn, forward_only=forward_only)


def combine(gate_TK: jax.Array, f_TKD: jax.Array) -> jax.Array:
    """y_t = sum_k g_tk f_tk, summed in float32."""
    return jnp.einsum("tk,tkd->td", gate_TK.astype(jnp.float32), f_TKD.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)


def combine_from_table(gate_TK: jax.Array, expert_idx_TK: jax.Array, f_ETD: jax.Array) -> jax.Array:
    """y_t = sum_k g_tk f[idx_tk, t], reading the pair outputs from a table of every expert's output
    (`moejax.moe.grouped.expert_output_table`, [E, T, D]). Leading axes of gate/idx (e.g. pruning variants) share it."""
    n_experts, n_tokens, d = f_ETD.shape
    return combine_rows(gate_TK, table_rows(expert_idx_TK, n_tokens), f_ETD.reshape(n_experts * n_tokens, d))


def table_rows(expert_idx_TK: jax.Array, n_tokens: int) -> jax.Array:
    """The row of an expert table [E, T, D] flattened to [E * T, D] that holds f[idx_tk, t]."""
    return expert_idx_TK * n_tokens + jnp.arange(n_tokens, dtype=expert_idx_TK.dtype)[:, None]


def combine_rows(gate_TK: jax.Array, row_TK: jax.Array, rows_MD: jax.Array) -> jax.Array:
    """y_t = sum_k g_tk rows[row_tk, :]: each slot's output read from a flat table of pair outputs
    [M, D] by its row there (`combine_from_table`'s table flattened, or a table of selected pairs,
    `moejax.moe.grouped.sparse_output_table`).

    One gathered row per slot k, summed as it goes: XLA:CPU fuses each row gather into the sum,
    where gathering all K rows first ([..., T, K, D]) ran about 8x slower.
    """
    rows_MD = rows_MD.astype(jnp.float32)
    y_TD = 0.0
    for k in range(gate_TK.shape[-1]):
        y_TD = y_TD + gate_TK[..., k, None].astype(jnp.float32) * rows_MD.at[row_TK[..., k]].get(
            mode="promise_in_bounds")
    return y_TD


def dispatch(x_TD, expert_idx_TK, gate_TK, weights, expert_fn: ExpertFn, backend: str = "sorted",
             forward_only: bool = False):
    """Routed output y_TD = sum_k gate_tk * expert_{idx_tk}(x_t) (SPEC section 1).
    forward_only: no gradients will be taken (faster large experts, see `pair_outputs`); with the
    sorted backend, large experts' outputs are then added into y as they are computed
    (`exact_expert_loop_combined`: no [T, K, D] pair outputs held; summed in expert order).
    weights: an expert table, or a table in parts (`moejax.moe.grouped`), which only that loop reads
    in place (every other path joins the parts)."""
    if forward_only and backend == "sorted" and large_experts(weights):
        return exact_expert_loop_combined(x_TD, expert_idx_TK, gate_TK, weights, expert_fn).astype(x_TD.dtype)
    f_TKD = pair_outputs(x_TD, expert_idx_TK, weights, expert_fn, backend, forward_only=forward_only)
    return combine(gate_TK, f_TKD).astype(x_TD.dtype)

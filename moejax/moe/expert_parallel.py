"""Expert parallelism: routed experts split over the "expert" axis of a device mesh.

The "ep" dispatch backend (same signature as the others, `moejax.moe.dispatch`). Device s of the
expert axis (size P) holds experts [s E/P, (s+1) E/P) and computes exactly the routed pairs of
those experts; every other device contributes zeros for them, so the result is the single-device
result bit for bit up to the order of float additions (x + 0 = x). Tokens are split over all
devices ("data" x "expert"); the mesh comes from `jax.set_mesh(mesh)` (see `moejax.parallel`).

Two paths, chosen by the platform the program is lowered for:
- "collective" (runs everywhere, CPU included): all-gather the tokens of the expert group, run the
  local experts on the pairs routed to them, reduce-scatter the pair outputs back to the token
  owners (MaxText's "ring of experts").
- "a2a" (chosen on GPU/TPU): each device sends each pair to the device holding its expert with
  `jax.lax.all_to_all`, computes the pairs it received, and sends the outputs back. The send
  buffers are sized for the worst case (every pair to one device), so nothing is ever dropped;
  `ragged_all_to_all` would size them exactly but has no CPU implementation to test it against.
On CPU the collective path is used and the choice is logged once.

Local compute is the sorted backend's grouped matmul with pairs of other shards marked absent.
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from moejax.moe.grouped import sorted_pair_outputs

log = logging.getLogger(__name__)

EXPERT_AXIS = "expert"
DATA_AXIS = "data"
PATHS = ("auto", "collective", "a2a")
_logged = set()   # platforms whose path choice was logged (once each)


def current_mesh():
    """The mesh set by `jax.set_mesh`, checked to have an expert axis."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or EXPERT_AXIS not in mesh.axis_names:
        raise ValueError("the 'ep' dispatch backend needs a mesh with an 'expert' axis: "
                         "`with jax.set_mesh(moejax.parallel.make_mesh(MeshConfig(expert=8))): ...`")
    return mesh


def _log_collective_on_cpu() -> None:
    if jax.default_backend() == "cpu" and "cpu" not in _logged:
        _logged.add("cpu")
        log.info("expert parallelism on cpu: the all-to-all path is meant for GPU/TPU; using the "
                 "collective path (all-gather, local experts, reduce-scatter)")


def ep_pair_outputs(x_TD, expert_idx_TK, weights, expert_fn, forward_only: bool = False, path: str = "auto"):
    """Expert output of every routed pair [T, K, D], computed on the device holding its expert.
    Pairs with expert index E are absent (zeros), as in the sorted backend. path "auto": the
    collective path where the program is lowered for CPU, all-to-all elsewhere
    (`jax.lax.platform_dependent`, so a program exported for CUDA or TPU from a CPU machine holds
    the all-to-all path; tests/test_lowering.py)."""
    if path not in PATHS:
        raise ValueError(f"unknown expert-parallel path {path!r}; valid: {', '.join(PATHS)}")
    mesh = current_mesh()
    n_shards = mesh.shape[EXPERT_AXIS]
    n_experts = jax.tree.leaves(weights)[0].shape[0]
    if n_experts % n_shards:
        raise ValueError(f"{n_experts} experts do not split over an expert axis of {n_shards} devices")
    token_axes = tuple(a for a in (DATA_AXIS, EXPERT_AXIS) if a in mesh.axis_names)
    n_devices = 1
    for axis in token_axes:
        n_devices *= mesh.shape[axis]
    n_tokens = x_TD.shape[0]
    pad = -n_tokens % n_devices
    if pad:  # padding tokens route to the absent index: no device computes them
        x_TD = jnp.pad(x_TD, ((0, pad), (0, 0)))
        expert_idx_TK = jnp.pad(expert_idx_TK, ((0, pad), (0, 0)), constant_values=n_experts)
    def sharded(body):
        local = functools.partial(body, expert_fn=expert_fn, forward_only=forward_only,
                                  experts_per_shard=n_experts // n_shards, n_shards=n_shards)
        return jax.shard_map(local, mesh=mesh, in_specs=(P(token_axes), P(token_axes), P(EXPERT_AXIS)),
                             out_specs=P(token_axes), check_vma=False)

    if path == "auto":   # chosen by the platform the program is lowered for, not the one tracing it
        _log_collective_on_cpu()
        f_TKD = jax.lax.platform_dependent(x_TD, expert_idx_TK, weights, cpu=sharded(_collective),
                                           default=sharded(_all_to_all))
    else:
        f_TKD = sharded(_collective if path == "collective" else _all_to_all)(x_TD, expert_idx_TK, weights)
    return f_TKD[:n_tokens]


def _local_index(expert_idx, experts_per_shard):
    """Index among this shard's experts, or experts_per_shard (absent) for other shards' experts."""
    local = expert_idx - jax.lax.axis_index(EXPERT_AXIS) * experts_per_shard
    return jnp.where((local >= 0) & (local < experts_per_shard), local, experts_per_shard)


def _collective(x_TD, idx_TK, weights, *, expert_fn, forward_only, experts_per_shard, n_shards):
    x_group_TD = jax.lax.all_gather(x_TD, EXPERT_AXIS, tiled=True)  # the expert group's tokens
    idx_group_TK = jax.lax.all_gather(idx_TK, EXPERT_AXIS, tiled=True)
    f_group_TKD = sorted_pair_outputs(x_group_TD, _local_index(idx_group_TK, experts_per_shard), weights, expert_fn,
                                forward_only=forward_only, absent=True)
    return jax.lax.psum_scatter(f_group_TKD, EXPERT_AXIS, scatter_dimension=0, tiled=True)


def _all_to_all(x_TD, idx_TK, weights, *, expert_fn, forward_only, experts_per_shard, n_shards):
    n_tokens, top_k = idx_TK.shape
    n_pairs = n_tokens * top_k
    flat_M = idx_TK.reshape(-1)
    dest_M = flat_M // experts_per_shard  # n_shards for absent pairs
    # each pair's row in the buffer for its destination: its rank among the pairs going there
    order_M = jnp.argsort(dest_M, stable=True)
    count_X = jnp.zeros((n_shards + 1,), jnp.int32).at[dest_M].add(1)
    start_X = jnp.cumsum(count_X) - count_X
    rank_M = jnp.zeros((n_pairs,), jnp.int32).at[order_M].set(
        jnp.arange(n_pairs, dtype=jnp.int32) - start_X[dest_M[order_M]])
    x_MD = x_TD[jnp.arange(n_pairs) // top_k]
    send_XMD = jnp.zeros((n_shards + 1, n_pairs, x_TD.shape[-1]), x_TD.dtype).at[dest_M, rank_M].set(x_MD)[:n_shards]
    send_XM = jnp.full((n_shards + 1, n_pairs), experts_per_shard, jnp.int32).at[dest_M, rank_M].set(
        flat_M % experts_per_shard)[:n_shards]
    recv_XMD = jax.lax.all_to_all(send_XMD, EXPERT_AXIS, 0, 0, tiled=True)  # block s: pairs from device s
    recv_XM = jax.lax.all_to_all(send_XM, EXPERT_AXIS, 0, 0, tiled=True)
    f_M1D = sorted_pair_outputs(recv_XMD.reshape(n_shards * n_pairs, -1), recv_XM.reshape(-1, 1), weights,
                                expert_fn, forward_only=forward_only, absent=True)
    back_XMD = jax.lax.all_to_all(f_M1D.reshape(n_shards, n_pairs, -1), EXPERT_AXIS, 0, 0, tiled=True)
    f_MD = back_XMD[jnp.minimum(dest_M, n_shards - 1), rank_M]
    return jnp.where((dest_M < n_shards)[:, None], f_MD, 0).reshape(n_tokens, top_k, -1)

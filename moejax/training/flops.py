"""What training costs in arithmetic, and what the machine can do: the FLOPs a training step
needs (`step_flops`) and the dense float32 matmul rate measured now (`dense_matmul_gflops`), so a
run reports its achieved rate as a share of the machine's.

The count is the work the model needs, not what the compiled program does (block padding, the
router's top-k and the gathers are not counted):

    forward  = 2 * tokens * (W_dense + W_routed * K / E) + 2 * L * N * (d_qk + d_v) * B * S (S + 1) / 2
    training = 3 * forward          (the backward pass: twice the forward's matmuls)

W_dense: every weight matrix a token multiplies by (attention, dense MLPs, shared experts,
routers, the output head; not the embedding, a lookup); W_routed: every routed expert's (all E of
them, used K at a time); attention's q.k and p.v over the causal half of each [S, S] score matrix,
L layers, N heads, d_qk + d_v the per-head query-key and value widths.
"""

from __future__ import annotations

import time


def weight_counts(model) -> dict:
    """{"dense": weights multiplied per token outside the routed experts, "routed": all routed
    experts' weights} of a moejax model (or its abstract shape, `nnx.eval_shape`)."""
    from flax import nnx

    counts = {"dense": 0, "routed": 0}
    for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        shape = v.get_value().shape if hasattr(v, "get_value") else v.shape
        name = str(path[-1])
        if len(shape) < 2 or name == "embed_tokens":
            continue
        size = 1
        for n in shape:
            size *= n
        counts["routed" if name.startswith("experts") else "dense"] += size
    return counts


def attention_dims(cfg) -> tuple[int, int, int]:
    """(layers, heads, per-head query-key plus value width) of a moejax model config."""
    if getattr(cfg, "qk_nope_head_dim", None):
        width = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim
    else:
        width = 2 * (getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    return cfg.num_hidden_layers, cfg.num_attention_heads, width


def step_flops(cfg, counts: dict, batch: int, seq_len: int) -> float:
    """FLOPs of one training step over [batch, seq_len] tokens (module docstring)."""
    weights = counts["dense"] + counts["routed"] * cfg.num_experts_per_tok / cfg.n_experts
    L, N, width = attention_dims(cfg)
    forward = 2.0 * batch * seq_len * weights + 2.0 * L * N * width * batch * seq_len * (seq_len + 1) / 2
    return 3.0 * forward


def dense_matmul_gflops(n: int = 1024, repeats: int = 10) -> float:
    """The float32 [n, n] x [n, n] matmul rate of this process's devices now, best of `repeats`."""
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    f = jax.jit(lambda x, y: x @ y)
    f(a, a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(a, a).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n ** 3 / best / 1e9

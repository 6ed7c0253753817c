"""Expert-parallel overhead: one Moonlight-shaped MoE layer on one device vs split over a mesh.

    python scripts/bench_ep.py [--tokens 2048] [--expert 8] [--repeat 3]

On CPU the mesh is simulated (XLA_FLAGS=--xla_force_host_platform_device_count, set here before
JAX starts): its devices share this machine's cores, so the ratio measures what the expert-parallel
path costs in communication and bookkeeping, not a speed-up. On a GPU machine the same script
reports tokens per second at 1 and (if present) more devices, and the fraction of the measured
matmul rate the routed-expert work reaches.

Routed experts only (the layer's pair outputs combined with the gates), float32, forward:
- "inference": forward_only (large experts loop over the blocks in use only);
- "differentiable": the static-shape path that gradients go through.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

H, F, E, K = 2048, 1408, 64, 6  # Moonlight-16B-A3B


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--expert", type=int, default=8, help="expert-axis size of the mesh")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    from moejax.parallel.mesh import request_cpu_devices

    request_cpu_devices(args.expert)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from _timing import best_of
    from moejax.moe import dispatch as d
    from moejax.moe.expert_parallel import ep_pair_outputs
    from moejax.moe.routing import RouterConfig, route
    from moejax.parallel import MeshConfig, make_mesh

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((args.tokens, H)), jnp.float32)
    w = {k: jnp.asarray(rng.standard_normal(s) * 0.02, jnp.float32)
         for k, s in (("gate", (E, H, F)), ("up", (E, H, F)), ("down", (E, F, H)))}
    logits = jnp.asarray(rng.standard_normal((args.tokens, E)) * 2, jnp.float32)
    r = route(logits, RouterConfig(top_k=K, scoring_func="sigmoid", n_group=1, topk_group=1), jnp.zeros(E))
    idx, gate = r.expert_idx_TK, r.gate_TK
    platform = jax.default_backend()
    flops = 3 * 2 * args.tokens * K * H * F
    print(f"{platform}: {jax.device_count()} devices; layer H={H} F={F} E={E} K={K}, {args.tokens} tokens, "
          f"{flops / 1e9:.0f} GFLOP of routed-expert work")

    a = jnp.asarray(rng.standard_normal((4096, 4096)), jnp.float32)
    mm = jax.jit(lambda a: a @ a)
    jax.block_until_ready(mm(a))
    matmul_rate = 2 * 4096**3 / best_of(lambda: jax.block_until_ready(mm(a)), args.repeat)
    print(f"dense matmul rate {matmul_rate / 1e9:.0f} GFLOP/s (4096^3, float32)")

    def single(forward_only):
        return jax.jit(lambda x, w: d.combine(gate, d.sorted_pair_outputs(x, idx, w, d.swiglu,
                                                                           forward_only=forward_only)))

    def expert_parallel(forward_only, path):
        return jax.jit(lambda x, w: d.combine(gate, ep_pair_outputs(x, idx, w, d.swiglu, forward_only=forward_only,
                                                                    path=path)))

    def timed(fn, *operands):
        jax.block_until_ready(fn(*operands))
        return best_of(lambda: jax.block_until_ready(fn(*operands)), args.repeat)

    sizes = [1] + ([args.expert] if args.expert > 1 else [])
    for mode, forward_only in (("inference", True), ("differentiable", False)):
        base = timed(single(forward_only), x, w)
        print(f"{mode:>14}: one device {base:6.2f} s  {args.tokens / base:8.0f} tokens/s  "
              f"{flops / base / matmul_rate:.2f} of the matmul rate")
        for n in sizes[1:]:
            mesh = make_mesh(MeshConfig(expert=n))
            w_sharded = jax.device_put(w, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("expert")))
            for path in ("collective", "a2a"):
                with jax.set_mesh(mesh):
                    seconds = timed(expert_parallel(forward_only, path), x, w_sharded)
                print(f"{'':>14}  {n} expert shards, {path:>10}: {seconds:6.2f} s  {args.tokens / seconds:8.0f} "
                      f"tokens/s  overhead vs one device {seconds / base:.2f}x")


if __name__ == "__main__":
    main()

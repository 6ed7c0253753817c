"""Benchmark the scoring pass.

    python scripts/bench_score.py compute     # one Moonlight-shaped MoE layer, 4,096 tokens
    python scripts/bench_score.py memory      # `moejax score` on a synthetic 8-layer Moonlight checkpoint

compute: routed-expert FLOP rate of the scoring pass against a dense matmul rate, the whole
  pass for the layer against a dense observer that runs every expert on every token (what the
  public REAP code does), and the pass with the interventional scores' work against without it,
  all timed in this run.
memory: writes a bfloat16 Moonlight-shaped checkpoint cut to 8 decoder layers (about 9 GB) into
  a temporary folder, runs `moejax score` on 2,048 calibration tokens in a child process and
  reports its peak resident memory and the time per layer.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from _timing import best_of  # noqa: E402




def moonlight(layers: int) -> dict:
    from moejax.models.deepseek_v3.presets import PRESETS

    return {**PRESETS["moonlight-16b-a3b"], "num_hidden_layers": layers}


def compute(tokens: int) -> None:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from moejax.models.deepseek_v3 import DeepseekV3Config
    from moejax.models.moe_block import MoE
    from moejax.moe import dispatch, grouped
    from moejax.scoring.observe import _pairs

    cfg = DeepseekV3Config.from_dict(moonlight(2))
    moe = MoE(cfg, jnp.float32, nnx.Rngs(0))
    moe.router[...] = moe.router[...] * 2  # logits of std ~2: decisive routing, no saturated sigmoid
    moe.bias[...] = jax.random.normal(jax.random.key(4), moe.bias.shape) * 0.02  # partly negative, as trained
    x = jax.random.normal(jax.random.key(1), (tokens, cfg.hidden_size))
    graphdef, state = nnx.split(moe)
    jax.block_until_ready(_pairs(graphdef, state, x, True, False))
    t_pass = best_of(lambda: jax.block_until_ready(_pairs(graphdef, state, x, True, False)))
    # the interventional scores' extra work: leave-one-out columns (K + 1 routings, their union of
    # expert calls) and the preference orders, timed in the same run
    jax.block_until_ready(_pairs(graphdef, state, x, True, True))
    t_loo = best_of(lambda: jax.block_until_ready(_pairs(graphdef, state, x, True, True)))

    experts = {"gate": moe.experts_gate[...], "up": moe.experts_up[...], "down": moe.experts_down[...]}
    idx = moe.route(x).expert_idx_TK
    # the scoring pass's grouped matmul (forward only)
    routed = jax.jit(lambda x, i, w: grouped.sorted_pair_outputs(x, i, w, dispatch.swiglu, forward_only=True))
    jax.block_until_ready(routed(x, idx, experts))
    t_routed = best_of(lambda: jax.block_until_ready(routed(x, idx, experts)))
    flops_routed = 2 * 3 * idx.size * cfg.hidden_size * cfg.moe_intermediate_size

    a = jax.random.normal(jax.random.key(2), (tokens, cfg.hidden_size))
    b = jax.random.normal(jax.random.key(3), (cfg.hidden_size, cfg.moe_intermediate_size * 8))
    mm = jax.jit(lambda a, b: a @ b)
    jax.block_until_ready(mm(a, b))
    t_mm = best_of(lambda: jax.block_until_ready(mm(a, b)))
    rate_dense = 2 * a.shape[0] * a.shape[1] * b.shape[1] / t_mm / 1e9

    def dense_observer(x, w):  # every expert on every token (REAP code's observer), in token chunks
        def chunk(xc):
            return jnp.linalg.norm(grouped.all_expert_outputs(xc, w, dispatch.swiglu), axis=-1)
        return jax.lax.map(chunk, x.reshape(16, -1, x.shape[-1]))

    dense = jax.jit(dense_observer)
    jax.block_until_ready(dense(x, experts))
    t_dense = best_of(lambda: jax.block_until_ready(dense(x, experts)), repeat=1)
    print(f"Moonlight MoE layer (H {cfg.hidden_size}, Im {cfg.moe_intermediate_size}, E {cfg.n_routed_experts}, "
          f"K {cfg.num_experts_per_tok}), {tokens} tokens, float32, {os.cpu_count()} cores")
    print(f"routed experts {flops_routed / t_routed / 1e9:6.1f} GFLOP/s vs dense matmul {rate_dense:6.1f} GFLOP/s "
          f"-> {flops_routed / t_routed / 1e9 / rate_dense:.2f} of dense (target 0.50)")
    out = _pairs(graphdef, state, x)
    extra = 1 - float(jnp.mean(jnp.any(out["code_idx"][:, :, None] == out["idx"][:, None, :], axis=-1)))
    print(f"scoring pass {t_pass:6.2f} s (both routings; {extra:.0%} of REAP-code pairs not routed by the model) "
          f"vs dense observer {t_dense:6.2f} s -> {t_dense / t_pass:.1f}x (target 5x)")
    print(f"with the interventional scores (loo_reroute, ranked_vote): {t_loo:6.2f} s -> {t_loo / t_pass:.2f}x the pass")


def memory(tokens: int, layers: int) -> None:
    import ml_dtypes

    from moejax.hf.io.checkpoint_writer import write_checkpoint
    from moejax.hf.mapping import tensor_specs
    from moejax.models.deepseek_v3 import DeepseekV3Config

    raw = moonlight(layers)
    cfg = DeepseekV3Config.from_dict(raw)
    specs = tensor_specs(cfg)
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(dir=os.environ.get("MOEJAX_BENCH_DIR")) as tmp:
        ckpt = Path(tmp) / "moonlight-8l"
        t0 = time.perf_counter()

        def tensors():
            for s in specs:
                dtype = np.float32 if s.hf_name.endswith(("gate.weight", "e_score_correction_bias")) else ml_dtypes.bfloat16
                scale = 1.0 if "norm" in s.hf_name else 0.02
                yield s.hf_name, (rng.standard_normal(s.hf_shape, dtype=np.float32) * scale
                                  + (1.0 if "norm" in s.hf_name else 0.0)).astype(dtype)

        write_checkpoint(ckpt, tensors(), cfg.to_dict())
        size = sum(f.stat().st_size for f in ckpt.iterdir())
        print(f"synthetic checkpoint: {layers} layers, {size / 1e9:.1f} GB (bfloat16), written in "
              f"{time.perf_counter() - t0:.0f} s")
        ids = rng.integers(0, cfg.vocab_size, size=(tokens // 512, 512))
        np.save(Path(tmp) / "ids.npy", ids)
        # The child reports its own peak (VmHWM): getrusage(RUSAGE_CHILDREN) would count this
        # process's memory, which a forked child shares until it execs.
        code = ("import sys, moejax.cli as c; rc = c.main(sys.argv[1:]); "
                "print('VmHWM', open('/proc/self/status').read().split('VmHWM:')[1].split()[0]); sys.exit(rc)")
        t0 = time.perf_counter()
        run = subprocess.run([sys.executable, "-c", code, "score", str(ckpt), "--tokens", str(Path(tmp) / "ids.npy"),
                              "--batch-size", "1", "--dtype", "bfloat16", "--out", str(Path(tmp) / "scores.parquet")],
                             check=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True)
        seconds = time.perf_counter() - t0
        print(run.stdout.strip().splitlines()[0])
        peak_mb = int(run.stdout.split("VmHWM")[1].split()[0]) / 1024
        print(f"moejax score --dtype bfloat16: {tokens} tokens, peak resident {peak_mb:.0f} MB (target < 3000 MB), "
              f"{seconds:.1f} s in all, {seconds / layers:.1f} s per layer")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["compute", "memory"])
    ap.add_argument("--tokens", type=int, default=None)
    ap.add_argument("--layers", type=int, default=8)
    args = ap.parse_args()
    if args.what == "compute":
        compute(args.tokens or 4096)
    else:
        memory(args.tokens or 2048, args.layers)


if __name__ == "__main__":
    main()

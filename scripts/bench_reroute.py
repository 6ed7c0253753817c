"""`moejax reroute` on a Moonlight-16B-A3B-shaped checkpoint cut to a few decoder layers (full
163,840 vocabulary, bfloat16 on disk, 64 experts of width 1408), pruned to half its experts:
peak resident memory of the whole command (teacher pass, student training, write), its time per
training step, and the achieved rate of the step against the dense float32 matmul rate measured
in the same run.

    python scripts/bench_reroute.py [--layers 3] [--tokens 256] [--steps 3]

FLOPs a step needs (the student in float32): the forward (the active parameters' matmuls, attention
and the output head) and a backward that carries activation gradients through every layer down to
the first router, counted as the forward's FLOPs again (no weight gradient but the routers'): 2 x
the forward in all, a lower bound of the work.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_real import layer_flops, moonlight_checkpoint  # noqa: E402


def dense_rate(n: int = 2048, rounds: int = 5) -> float:
    """FLOP/s of a float32 [n, n] @ [n, n] matmul in JAX on this machine (best of `rounds`)."""
    import jax
    import jax.numpy as jnp

    a = jnp.ones((n, n), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = min(_timed(lambda: f(a).block_until_ready()) for _ in range(rounds))
    return 2 * n ** 3 / best


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=3, help="decoder layers (the first dense)")
    ap.add_argument("--tokens", type=int, default=256, help="tokens per training step (one sequence)")
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    from moejax.models.deepseek_v3 import DeepseekV3Config
    from moejax.models.deepseek_v3.presets import PRESETS

    raw = {**PRESETS["moonlight-16b-a3b"], "num_hidden_layers": args.layers}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        t0 = time.perf_counter()
        moonlight_checkpoint(tmp / "src", args.layers, raw["vocab_size"])
        keep = raw["n_routed_experts"] // 2
        subprocess.run([sys.executable, "-m", "moejax.cli", "prune", str(tmp / "src"), str(tmp / "pruned"),
                        "--score", "l1", "--keep", str(keep)], check=True, stdout=subprocess.DEVNULL)
        np.save(tmp / "ids.npy", np.random.default_rng(0).integers(0, raw["vocab_size"], (1, args.tokens)).astype(np.int32))
        made = time.perf_counter() - t0
        before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "moejax.cli", "reroute", str(tmp / "src"), str(tmp / "pruned"),
                        str(tmp / "out"), "--tokens", str(tmp / "ids.npy"), "--steps", str(args.steps),
                        "--batch-size", "1", "--warmup", "0"], check=True, stdout=subprocess.DEVNULL)
        wall = time.perf_counter() - t0
        peak_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
        record = json.loads((tmp / "out" / "reroute.json").read_text())
        disk = sum(f.stat().st_size for f in (tmp / "pruned").iterdir()) / 2 ** 20
    cfg = DeepseekV3Config.from_dict({**raw, "n_routed_experts": keep})
    forward = args.tokens * sum(layer_flops(cfg, args.tokens, cfg.is_moe_layer(l)) for l in range(args.layers))
    forward += 2 * args.tokens * cfg.vocab_size * cfg.hidden_size        # the output head
    per_step = record["train_seconds"] / args.steps                       # the first step includes compilation
    rate = dense_rate()
    need = 2 * forward
    print(f"Moonlight-shaped, {args.layers} decoder layers, vocabulary {cfg.vocab_size}, pruned to {keep} of "
          f"{raw['n_routed_experts']} experts ({disk:.0f} MB on disk; made in {made:.0f} s)")
    print(f"moejax reroute, {args.steps} steps of {args.tokens} tokens: {wall:.1f} s wall, teacher pass "
          f"{record['teacher_seconds']:.1f} s, training {record['train_seconds']:.1f} s ({per_step:.1f} s per step, "
          f"compilation included)")
    print(f"peak resident memory of the command: {max(peak_mb, before / 1024):.0f} MB")
    print(f"FLOPs a step needs (forward + a backward of the same size): {need / 1e9:.1f} GFLOP; achieved "
          f"{need / per_step / 1e9:.1f} GFLOP/s = {need / per_step / rate:.2f} of the dense float32 matmul rate "
          f"({rate / 1e9:.1f} GFLOP/s, 2048^3, this run)")


if __name__ == "__main__":
    main()

"""Pruning a multi-GB checkpoint against copying it with `cp` on the same disk, and prune's peak memory.

    python scripts/bench_prune.py [--layers 4] [--experts 48] [--repeat 2]

Writes a synthetic DeepSeek-V3-shaped checkpoint (Moonlight's expert shapes, bfloat16, one shard
per MoE layer) into a temporary folder (MOEJAX_BENCH_DIR to choose the disk), then times, in the
same run and alternating: `cp -r` of the checkpoint, `moejax prune` keeping every expert (every
byte rewritten: the like-for-like speed) and keeping half. Speed is reported as a ratio to cp
(target >= 0.5). Peak memory is the pruning child's own VmHWM (target < one shard + 100 MB).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import ml_dtypes
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moejax.hf.io.checkpoint_writer import write_safetensors_file  # noqa: E402
from moejax.hf.io.safetensors_format import INDEX_NAME  # noqa: E402

HIDDEN, FFN = 2048, 1408  # Moonlight-16B-A3B


def synthetic_checkpoint(path: Path, layers: int, experts: int) -> int:
    """One shard per MoE layer (its experts, router and bias); returns the largest shard's bytes."""
    rng = np.random.default_rng(0)
    path.mkdir(parents=True)
    weight_map, total, largest = {}, 0, 0
    for layer in range(1, layers + 1):
        shard = f"model-{layer:05d}-of-{layers:05d}.safetensors"
        stem = f"model.layers.{layer}.mlp."
        tensors = [(stem + "gate.weight", rng.standard_normal((experts, HIDDEN), dtype=np.float32)),
                   (stem + "gate.e_score_correction_bias", rng.standard_normal(experts, dtype=np.float32)),
                   (f"model.layers.{layer}.input_layernorm.weight", np.ones(HIDDEN, ml_dtypes.bfloat16))]
        for e in range(experts):
            for name, shape in (("gate_proj", (FFN, HIDDEN)), ("up_proj", (FFN, HIDDEN)), ("down_proj", (HIDDEN, FFN))):
                bits = rng.integers(0, 2**16, size=shape, dtype=np.uint16)
                tensors.append((f"{stem}experts.{e}.{name}.weight", bits.view(ml_dtypes.bfloat16)))
        size = write_safetensors_file(path / shard, tensors)
        del tensors
        weight_map.update(dict.fromkeys([n for n in _names(path / shard)], shard))
        total += size
        largest = max(largest, (path / shard).stat().st_size)
    (path / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    config = {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": HIDDEN,
              "moe_intermediate_size": FFN, "n_routed_experts": experts, "num_experts_per_tok": 6, "n_group": 1,
              "topk_group": 1, "num_hidden_layers": layers + 1, "first_k_dense_replace": 1}
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return largest


def _names(shard: Path) -> list[str]:
    from moejax.hf.io.safetensors_format import SafetensorsFile

    return SafetensorsFile(shard).keys()


def timed(cmd: list[str]) -> tuple[float, str]:
    t0 = time.perf_counter()
    run = subprocess.run(cmd, check=True, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return time.perf_counter() - t0, run.stdout


# The child reports its own peak resident memory (VmHWM); page cache is not part of it.
PRUNE = ("import sys, moejax.cli as c; rc = c.main(sys.argv[1:]); "
         "print('VmHWM', open('/proc/self/status').read().split('VmHWM:')[1].split()[0]); sys.exit(rc)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=48)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=os.environ.get("MOEJAX_BENCH_DIR")) as tmp:
        src = Path(tmp) / "src"
        t0 = time.perf_counter()
        largest = synthetic_checkpoint(src, args.layers, args.experts)
        size = sum(f.stat().st_size for f in src.iterdir())
        print(f"synthetic checkpoint: {args.layers} MoE layers x {args.experts} experts, {size / 1e9:.2f} GB, "
              f"largest shard {largest / 1e6:.0f} MB, written in {time.perf_counter() - t0:.0f} s")
        best = {"cp": float("inf"), "prune all": float("inf"), "prune half": float("inf")}
        peak_kb = 0
        for _ in range(args.repeat):
            for label in best:
                dst = Path(tmp) / "dst"
                shutil.rmtree(dst, ignore_errors=True)
                if label == "cp":
                    seconds, _ = timed(["cp", "-r", str(src), str(dst)])
                else:
                    keep = str(args.experts) if label == "prune all" else "0.5"
                    seconds, out = timed([sys.executable, "-c", PRUNE, "prune", str(src), str(dst),
                                          "--score", "l1", "--keep", keep])
                    peak_kb = max(peak_kb, int(out.split("VmHWM")[1].split()[0]))
                best[label] = min(best[label], seconds)
                shutil.rmtree(dst, ignore_errors=True)
        for label, seconds in best.items():
            ratio = best["cp"] / seconds
            print(f"{label:>10}: {seconds:6.2f} s  {size / seconds / 1e9:5.2f} GB/s of source  "
                  f"speed vs cp {ratio:.2f}x" + ("" if label == "cp" else "  (target >= 0.5x)"))
        print(f"prune peak resident memory {peak_kb / 1024:.0f} MB; one shard + 100 MB = "
              f"{largest / 2**20 + 100:.0f} MB (target: below)")


if __name__ == "__main__":
    main()

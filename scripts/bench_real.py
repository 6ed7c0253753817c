"""prune_real's one pass (every variant carried through the layers together) against running the
variants one after another (each re-reading every layer's weights), in the same run.

    python scripts/bench_real.py [--model tiny|moonlight|both] [--tokens 512]

8 scores x 2 keeps = 16 pruned variants plus the unpruned model. "tiny" is the model
`python -m moejax.run experiment=train_tiny` saved (skipped if absent); "moonlight" is a synthetic
Moonlight-16B-A3B-shaped checkpoint of 4 decoder layers (1 dense + 3 MoE, 64 experts of 1408,
bfloat16 on disk; the vocabulary cut to 32,768 to keep the embedding small), written to a
temporary folder (MOEJAX_BENCH_DIR chooses the disk). Each measurement runs in a child process,
which runs its mode twice (cold: compilation included; warm: compiled, as the persistent
compilation cache makes a repeated run) and reports both times and its peak resident memory
(VmHWM). Target: carried >= 4x faster.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SCORES = ["frequency", "reap", "ean", "w_mean", "bias", "signed", "l1", "random"]
KEEPS = [0.5, 0.25]

CHILD = r"""
import json, sys, time
import numpy as np
from moejax.evaluate import evaluate_pruning
from moejax.hf.model_io import open_checkpoint
path, calib, held, mode, scores, keeps = sys.argv[1], np.load(sys.argv[2]), np.load(sys.argv[3]), sys.argv[4], json.loads(sys.argv[5]), json.loads(sys.argv[6])
def once():
    t0 = time.perf_counter()
    if mode == "carried":
        evaluate_pruning(open_checkpoint(path), calib, {"heldout": held}, scores, keeps, progress=False)
    else:  # one variant at a time: every pass re-reads the weights, redoes calibration and the unpruned stream
        for s in scores:
            for k in keeps:
                evaluate_pruning(open_checkpoint(path), calib, {"heldout": held}, [s], [k], progress=False)
    return time.perf_counter() - t0
cold = once()   # compilation included
warm = once() if int(sys.argv[7]) > 1 else float("nan")  # compiled (a repeated run with the persistent cache)
hwm = int(open('/proc/self/status').read().split('VmHWM:')[1].split()[0])
print(json.dumps({"cold": cold, "warm": warm, "peak_mb": hwm / 1024}))
"""


def moonlight_checkpoint(path: Path) -> None:
    import ml_dtypes

    from moejax.hf.mapping import tensor_specs
    from moejax.hf.checkpoint_writer import write_checkpoint
    from moejax.models.deepseek_v3 import DeepseekV3Config
    from moejax.models.deepseek_v3.presets import PRESETS

    raw = {**PRESETS["moonlight-16b-a3b"], "num_hidden_layers": 4, "vocab_size": 32768}
    cfg = DeepseekV3Config.from_dict(raw)
    specs = tensor_specs(cfg)
    rng = np.random.default_rng(0)

    def tensors():
        for s in specs:
            f32 = s.hf_name.endswith(("gate.weight", "e_score_correction_bias"))
            norm = "norm" in s.hf_name
            value = rng.standard_normal(s.hf_shape, dtype=np.float32) * (0.3 if norm else 0.02) + (1.0 if norm else 0.0)
            if s.hf_name.endswith("e_score_correction_bias"):
                value = rng.standard_normal(s.hf_shape, dtype=np.float32) * 0.1
            yield s.hf_name, value.astype(np.float32 if f32 else ml_dtypes.bfloat16)

    write_checkpoint(path, tensors(), cfg.to_dict())


def measure(path: Path, tokens: int, seq_len: int, workdir: Path, rounds: int) -> None:
    import json as _json

    vocab = _json.loads((path / "config.json").read_text())["vocab_size"]
    rng = np.random.default_rng(1)
    np.save(workdir / "calib.npy", rng.integers(0, min(vocab, 256), size=(tokens // seq_len, seq_len)).astype(np.int32))
    np.save(workdir / "held.npy", rng.integers(0, min(vocab, 256), size=(max(1, tokens // (2 * seq_len)), seq_len)).astype(np.int32))
    results = {}
    for mode in ("carried", "one_after_another"):
        out = subprocess.run([sys.executable, "-c", CHILD, str(path), str(workdir / "calib.npy"), str(workdir / "held.npy"),
                              mode, json.dumps(SCORES), json.dumps(KEEPS), str(rounds)], check=True, capture_output=True, text=True,
                             env={**os.environ, "PYTHONPATH": str(ROOT), "MOEJAX_JAX_CACHE": ""})
        results[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    c, o = results["carried"], results["one_after_another"]
    for when in ("cold", "warm")[:rounds]:
        print(f"  {when} ({'compilation included' if when == 'cold' else 'compiled'}): carried together "
              f"{c[when]:7.1f} s, one after another {o[when]:7.1f} s, speed-up {o[when] / c[when]:.1f}x (target >= 4x)")
    print(f"  peak resident memory: carried {c['peak_mb']:.0f} MB, one after another {o['peak_mb']:.0f} MB")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["tiny", "moonlight", "both"], default="both")
    ap.add_argument("--tokens", type=int, default=512, help="calibration tokens (held-out: half)")
    ap.add_argument("--seq-len", type=int, default=128)
    args = ap.parse_args()
    print(f"{len(SCORES)} scores x {len(KEEPS)} keeps = {len(SCORES) * len(KEEPS)} variants + unpruned; "
          f"{args.tokens} calibration and {args.tokens // 2} held-out tokens")
    with tempfile.TemporaryDirectory(dir=os.environ.get("MOEJAX_BENCH_DIR")) as tmp:
        tmp = Path(tmp)
        if args.model in ("tiny", "both"):
            tiny = Path(os.environ.get("MOEJAX_HOME", Path.home() / ".cache" / "moejax")) / "models" / "tiny"
            if (tiny / "config.json").is_file():
                print(f"tiny model ({tiny}):")
                measure(tiny, args.tokens, args.seq_len, tmp, rounds=2)
            else:
                print(f"tiny model: not found at {tiny} (python -m moejax.run experiment=train_tiny); skipped")
        if args.model in ("moonlight", "both"):
            t0 = time.perf_counter()
            moonlight_checkpoint(tmp / "moonlight")
            size = sum(f.stat().st_size for f in (tmp / "moonlight").iterdir())
            print(f"synthetic Moonlight-shaped checkpoint, 4 layers, {size / 1e9:.1f} GB, written in "
                  f"{time.perf_counter() - t0:.0f} s:")
            measure(tmp / "moonlight", args.tokens, args.seq_len, tmp, rounds=1)  # compute-bound: cold only


if __name__ == "__main__":
    main()

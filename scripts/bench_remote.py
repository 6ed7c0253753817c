"""Remote checkpoints: what `moejax inspect`, data-free `score` and `diff` read over HTTP range
requests, against the checkpoint's size, and their time against the same commands on the local
folder, in the same run.

    python scripts/bench_remote.py [--layers 8] [--experts 256] [--hidden 1024] [--shard-mb 24]
                                   [--latency-ms 0,20] [--repeat 2]

Writes a synthetic DeepSeek-V3-shaped checkpoint into a temporary folder (MOEJAX_BENCH_DIR to
choose the disk): DeepSeek-V3's names, 256 routed experts in 8 groups, FP8 experts with their
128x128 block scales (so shard headers list as many tensors per byte as V3's do), BF16 routers and
F32 balance biases, a small hidden size so that it is a few hundred MB; and an l1-pruned copy
(group-aware, half the experts). Serves both on 127.0.0.1 with `tests/range_server.py` (optionally
with a delay before each answer, a stand-in for a WAN round trip) and reports, per command: body
bytes sent and requests (counted by the server), the share of the checkpoint that is, and the time
against the local run. Then the header prefetch, measured: bytes and requests of `inspect` for
each size the first header request could take.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import ml_dtypes
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # range_server: the tests' HTTP range server

from _timing import best_of  # noqa: E402
from range_server import serve  # noqa: E402

from moejax.hf.io import remote  # noqa: E402
from moejax.hf.io.checkpoint_writer import write_checkpoint  # noqa: E402
from moejax.hf.io.location import open_location  # noqa: E402
from moejax.hf.mapping import tensor_specs  # noqa: E402
from moejax.models.deepseek_v3.config import DeepseekV3Config  # noqa: E402
from moejax.scoring.score_checkpoint import score_data_free  # noqa: E402
from moejax.surgery.diff import diff_checkpoints  # noqa: E402
from moejax.surgery.inspect import inspect_checkpoint  # noqa: E402
from moejax.surgery.prune import prune_checkpoint  # noqa: E402

FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def deepseek_config(layers: int, experts: int, hidden: int) -> dict:
    return {
        "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 4096,
        "hidden_size": hidden, "intermediate_size": 2 * hidden, "moe_intermediate_size": 64,
        "num_hidden_layers": layers + 1, "first_k_dense_replace": 1, "num_attention_heads": 8,
        "num_key_value_heads": 8, "q_lora_rank": 128, "kv_lora_rank": 64, "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16, "v_head_dim": 32, "n_routed_experts": experts, "n_shared_experts": 1,
        "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5,
        "norm_topk_prob": True, "rms_norm_eps": 1e-6, "max_position_embeddings": 4096,
        "tie_word_embeddings": False, "num_nextn_predict_layers": 0, "quantization_config": FP8,
    }


def synthetic_checkpoint(path: Path, layers: int, experts: int, hidden: int, shard_mb: int) -> None:
    config = deepseek_config(layers, experts, hidden)
    rng = np.random.default_rng(0)

    def tensors():
        for spec in tensor_specs(DeepseekV3Config.from_dict(config)):
            name, shape = spec.hf_name, tuple(spec.hf_shape)
            if ".mlp.experts." in name:  # FP8 bytes (finite: no 0x7F/0xFF NaN codes) and block scales
                codes = rng.integers(0, 0x7F, size=shape, dtype=np.uint8)
                yield name, codes.view(ml_dtypes.float8_e4m3fn)
                scales = (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128))
                yield name[: -len("weight")] + "weight_scale_inv", rng.random(scales, dtype=np.float32)
            elif name.endswith("mlp.gate.e_score_correction_bias"):
                yield name, rng.standard_normal(shape, dtype=np.float32)
            else:
                yield name, rng.standard_normal(shape, dtype=np.float32).astype(ml_dtypes.bfloat16)

    write_checkpoint(path, tensors(), config, max_shard_bytes=shard_mb * 10**6)


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


def measure(server, run_local, run_remote, repeat: int) -> dict:
    """Bytes and requests of one remote run (a fresh storage: nothing cached), and the best
    times of local and remote runs."""
    server.clear_log()
    run_remote()
    sent, requests = server.sent(), len(server.log)
    local = best_of(run_local, repeat)
    there = best_of(run_remote, repeat)
    return {"bytes": sent, "requests": requests, "local_s": local, "remote_s": there}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8, help="MoE layers (plus one dense layer)")
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--shard-mb", type=int, default=24, help="shard size in MB")
    parser.add_argument("--latency-ms", default="0,20", help="delays before each answer, comma-separated")
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(dir=os.environ.get("MOEJAX_BENCH_DIR")) as tmp:
        tmp = Path(tmp)
        t0 = time.perf_counter()
        synthetic_checkpoint(tmp / "src", args.layers, args.experts, args.hidden, args.shard_mb)
        prune_checkpoint(tmp / "src", tmp / "pruned", score="l1", keep=args.experts // 2, group_aware=True)
        src_bytes, pruned_bytes = folder_bytes(tmp / "src"), folder_bytes(tmp / "pruned")
        shards = len(list((tmp / "src").glob("*.safetensors")))
        report = inspect_checkpoint(tmp / "src")
        print(f"synthetic checkpoint: {src_bytes / 1e6:.1f} MB in {shards} shards, {report['tensors']:,} tensors, "
              f"{len(report['moe_layers'])} MoE layers x {args.experts} experts (FP8, 128x128 scales); "
              f"pruned copy {pruned_bytes / 1e6:.1f} MB; written in {time.perf_counter() - t0:.1f} s")
        headers = [8 + int.from_bytes((tmp / "src" / f.name).read_bytes()[:8], "little")
                   for f in sorted((tmp / "src").glob("*.safetensors"))]
        print(f"shard headers: {min(headers) / 1024:.1f} to {max(headers) / 1024:.1f} KiB "
              f"(mean {sum(headers) / len(headers) / 1024:.1f} KiB)")

        names = ["bias", "signed", "l1"]
        with serve(tmp) as server:
            src, pruned = server.url("src"), server.url("pruned")
            for latency in [float(x) / 1000 for x in args.latency_ms.split(",")]:
                server.latency = latency
                print(f"\nlatency {latency * 1000:.0f} ms per request; header prefetch "
                      f"{remote.HEADER_PREFETCH // 1024} KiB")
                print(f"{'command':<34} {'bytes read':>12} {'of checkpoint':>14} {'requests':>9} "
                      f"{'local s':>8} {'remote s':>9} {'ratio':>6}")
                rows = [
                    ("inspect", src_bytes, lambda: inspect_checkpoint(tmp / "src"), lambda: inspect_checkpoint(src)),
                    ("score --scores bias,signed,l1", src_bytes,
                     lambda: score_data_free(tmp / "src", scores=names), lambda: score_data_free(src, scores=names)),
                    ("diff SRC PRUNED (both remote)", src_bytes + pruned_bytes,
                     lambda: diff_checkpoints(tmp / "src", tmp / "pruned"), lambda: diff_checkpoints(src, pruned)),
                ]
                for label, size, run_local, run_remote in rows:
                    m = measure(server, run_local, run_remote, args.repeat)
                    print(f"{label:<34} {m['bytes'] / 1e6:>9.2f} MB {100 * m['bytes'] / size:>13.2f}% "
                          f"{m['requests']:>9} {m['local_s']:>8.2f} {m['remote_s']:>9.2f} "
                          f"{m['remote_s'] / m['local_s']:>5.1f}x")
                print("\n`inspect` by header prefetch (the first request per shard; a longer header takes a second):")
                print(f"{'prefetch':>10} {'bytes read':>12} {'requests':>9} {'remote s':>9}")
                for prefetch in (8, 16 * 1024, 64 * 1024, 128 * 1024, 256 * 1024):
                    server.clear_log()
                    inspect_checkpoint(open_location(src, header_prefetch=prefetch))
                    sent, requests = server.sent(), len(server.log)
                    seconds = best_of(lambda: inspect_checkpoint(open_location(src, header_prefetch=prefetch)),
                                      args.repeat)
                    label = "8 B" if prefetch == 8 else f"{prefetch // 1024} KiB"
                    print(f"{label:>10} {sent / 1e6:>9.3f} MB {requests:>9} {seconds:>9.2f}")


if __name__ == "__main__":
    main()

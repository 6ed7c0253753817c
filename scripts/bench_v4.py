"""The streamed carried pass at DeepSeek-V4-Flash's shapes, as `bench_real.py --model moonlight-full`
runs it at Moonlight's: peak memory and FLOP rate against the dense matmul rate of the same run.

    python scripts/bench_v4.py [--layers 4 6] [--experts 256] [--vocab 129280] [--seq-len 128]
    python scripts/bench_v4.py --layers 2 --experts 8 --vocab 4096 --calib-seqs 2 --held-seqs 1 --seq-len 32   # smoke

A synthetic checkpoint of V4-Flash's published shapes (`moejax.models.deepseek_v4.presets`: hidden
4096, 64 heads of 512, 256 experts of width 2048, top 6, one shared expert, 4 hyper-connection
streams, the full 129,280-token vocabulary) cut to `--layers` decoder layers, stored as the release
is: routed experts FP4 (I8 pairs of e2m1 with an E8M0 scale per 32 inputs), the attention's and
shared experts' Linears FP8 (E4M3, an E8M0 scale per 128 x 128 block), hyper-connection, sink, ape
and balance-bias tensors float32, the rest bfloat16; random weights. The attention schedule is
V4-Flash's (`compress_ratios`: 2 sliding layers, then CSA / HCA alternating); of the release's 3
hash-routed layers the cut keeps the first only (`tid2eid` random), so that every later layer has a
learned router for the pass to decide. The pass is bench_real's (8 scores x 2 keeps, one
calibration text, two held-out texts), in a child process (`bench_real.FULL_CHILD`); reported:
total time, time per layer after the first, the output head, peak resident memory (VmHWM), and
the FLOPs the layers need (`v4_layer_flops`) against the dense float32 matmul rate measured in the
same run. `--experts`, `--vocab` and the token counts shrink it (the smoke setting above ran in
1.5 minutes on 2 busy cores, 26 s of it writing the checkpoint: hidden 4096's FP8 attention; at
full size each layer's 256 FP4 experts are 3.4 GB, quantised in numpy, so writing takes minutes a
layer); MOEJAX_BENCH_DIR chooses the disk. The pass computes in float32: a full-width layer's 256
experts are 25.8 GB there, so the full width needs a machine of about 32 GB; a 24 GB machine runs
`--experts 64` (peak 9.0 GB, docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_real import KEEPS, SCORES, dense_rate, full_run, write_ids  # noqa: E402

FP8 = re.compile(r"(\.attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|\.attn\.indexer\.wq_b|\.ffn\.shared_experts\.w[123])\.weight$")
F32 = re.compile(r"(hc_\w+|attn_sink|\.ape|\.gate\.bias)$")


def v4_config(layers: int, experts: int, vocab: int) -> dict:
    """V4-Flash's config.json cut to `layers` decoder layers (the first hash-routed, the rest
    learned; V4-Flash's attention schedule), `experts` routed experts (top 6, or a quarter of fewer
    than 24, so that the pass's keep of 0.25 still holds top_k), a `vocab`-token vocabulary; no MTP
    block."""
    from moejax.models.deepseek_v4.presets import FLASH_RATIOS, PRESETS

    raw = {k: v for k, v in PRESETS["deepseek-v4-flash"].items() if k != "num_hash_layers"}
    return {**raw, "num_hidden_layers": layers, "compress_ratios": FLASH_RATIOS[:layers],
            "mlp_layer_types": ["hash_moe"] + ["moe"] * (layers - 1), "n_routed_experts": experts,
            "num_experts_per_tok": min(6, experts // 4), "vocab_size": vocab, "num_nextn_predict_layers": 0}


def v4_checkpoint(path: Path, layers: int, experts: int, vocab: int) -> None:
    """The synthetic checkpoint (module docstring), written tensor by tensor."""
    import ml_dtypes

    from moejax.hf.io.checkpoint_writer import write_checkpoint
    from moejax.hf.mapping import tensor_specs
    from moejax.hf.quant.encode import quantize_deepseek_v4_fp4, quantize_deepseek_v4_fp8
    from moejax.models.deepseek_v4 import DeepseekV4Config

    config = v4_config(layers, experts, vocab)
    cfg = DeepseekV4Config.from_dict(config)
    rng = np.random.default_rng(0)

    def tensors():
        for s in tensor_specs(cfg):
            name, shape = s.hf_name, tuple(s.hf_shape)
            if name.endswith("tid2eid"):
                yield name, rng.integers(0, experts, size=shape).astype(np.int64)
                continue
            norm = "norm" in name
            value = rng.standard_normal(shape, dtype=np.float32) * (0.1 if norm else 0.02) + (1.0 if norm else 0.0)
            stem = name[:-len("weight")]
            if s.expert is not None:
                q, scale = quantize_deepseek_v4_fp4(value)
                yield name, q
                yield stem + "scale", scale
            elif FP8.search(name):
                q, scale = quantize_deepseek_v4_fp8(value)
                yield name, q
                yield stem + "scale", scale
            else:
                yield name, value if F32.search(name) else value.astype(ml_dtypes.bfloat16)

    write_checkpoint(path, tensors(), config)


def v4_layer_flops(cfg, layer: int, seq_len: int) -> float:
    """FLOPs of decoder layer `layer` per token (multiply-adds x 2), averaged over the positions of
    a `seq_len` sequence: every matrix the layer applies to a token (projections, compressors,
    indexer, hyper-connection mixes, router, shared expert; top_k of the routed experts), and the
    attention products over what a query sees: its window (up to `sliding_window` keys) and the
    compressed entries (CSA: the indexer's `index_topk` of the entries so far, plus the indexer's
    scores over all of them; HCA: every entry so far), each key `num_attention_heads` x
    `head_dim` x 2 (scores, values). What is computed and masked away is not counted."""
    from moejax.hf.mapping import tensor_specs

    matrices = 0.0
    for s in tensor_specs(cfg):
        name = s.hf_name
        if not name.startswith(f"layers.{layer}.") or len(s.hf_shape) != 2 or name.endswith(("tid2eid", "ape")):
            continue
        size = float(np.prod(s.hf_shape))
        matrices += size * cfg.num_experts_per_tok / cfg.n_experts if s.expert is not None else size
    kind = cfg.attention_types[layer]
    positions = np.arange(1, seq_len + 1)
    keys = np.minimum(positions, cfg.sliding_window).astype(float)
    if kind != "sliding_attention":
        entries = positions // cfg.compress_rate(layer)
        if kind == "compressed_sparse_attention":
            keys += np.minimum(entries, cfg.index_topk)
            matrices += entries.mean() * cfg.index_n_heads * cfg.index_head_dim
        else:
            keys += entries
    return 2.0 * (matrices + keys.mean() * cfg.num_attention_heads * cfg.head_dim * 2)


def bench(layer_counts, experts: int, vocab: int, calib_seqs: int, held_seqs: int, seq_len: int) -> None:
    from moejax.models.deepseek_v4 import DeepseekV4Config

    with tempfile.TemporaryDirectory(dir=os.environ.get("MOEJAX_BENCH_DIR")) as tmp:
        tmp = Path(tmp)
        ids = write_ids(tmp, vocab, calib_seqs, held_seqs, seq_len)
        dense = dense_rate()
        n_tokens = {"calib": calib_seqs * seq_len, "held": 2 * held_seqs * seq_len}
        n_streams = len(SCORES) * len(KEEPS) + 1
        print(f"the streamed carried pass at DeepSeek-V4-Flash's shapes ({experts} experts, vocabulary {vocab:,}; FP4 "
              f"experts, FP8 attention): {len(SCORES)} scores x {len(KEEPS)} keeps, {n_tokens['calib']} calibration "
              f"and "
              f"2 x {held_seqs * seq_len} held-out tokens of {seq_len}; {os.cpu_count()} CPUs, load average "
              f"{os.getloadavg()[0]:.1f}; dense float32 matmul {dense:.0f} GFLOP/s")
        runs = []
        for layers in layer_counts:
            ckpt = tmp / f"v4_{layers}"
            t0 = time.perf_counter()
            v4_checkpoint(ckpt, layers, experts, vocab)
            size = sum(f.stat().st_size for f in ckpt.iterdir())
            print(f"  {layers} decoder layers, {size / 1e9:.2f} GB, written in {time.perf_counter() - t0:.0f} s")
            r = full_run(ROOT, ckpt, ids, tmp / f"v4_{layers}.json", ())
            cfg = DeepseekV4Config.from_dict(json.loads((ckpt / "config.json").read_text()))
            per_token = [v4_layer_flops(cfg, l, seq_len) for l in range(layers)]
            stream_tokens = n_streams * n_tokens["held"] + n_tokens["calib"]
            layer_flops = [stream_tokens * f for f in per_token]
            head = 2.0 * n_streams * n_tokens["held"] * cfg.hidden_size * cfg.vocab_size
            steady = list(zip(r["layers"], layer_flops))[1:] or list(zip(r["layers"], layer_flops))
            rate = sum(f for _, f in steady) / sum(t for t, _ in steady) / 1e9
            whole = (sum(layer_flops) + head) / r["total"] / 1e9
            print(f"    total {r['total']:7.1f} s, layers {', '.join(f'{t:.1f}' for t in r['layers'])} s, output head "
                  f"{r['head']:.1f} s, peak {r['peak_mb']:,.0f} MB")
            print(f"    the layers after the first: {sum(f for _, f in steady) / 1e12:.3f} TFLOP at {rate:.0f} "
                  f"GFLOP/s = "
                  f"{rate / dense:.0%} of dense; the whole pass {(sum(layer_flops) + head) / 1e12:.3f} TFLOP "
                  f"(head {head / 1e12:.3f}) at {whole:.0f} GFLOP/s = {whole / dense:.0%} of dense")
            runs.append((layers, whole))
        again = dense_rate()
        best = max(dense, again)
        print(f"  dense float32 matmul again at the end: {again:.0f} GFLOP/s; the whole pass against the higher "
              f"({best:.0f}): " + ", ".join(f"{layers} layers {w / best:.0%}" for layers, w in runs))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[4, 6], help="decoder layer counts (peak memory must "
                    "not grow with depth)")
    ap.add_argument("--experts", type=int, default=256, help="routed experts per layer (V4-Flash: 256; at least 4)")
    ap.add_argument("--vocab", type=int, default=129280, help="vocabulary (V4-Flash: 129,280)")
    ap.add_argument("--calib-seqs", type=int, default=16)
    ap.add_argument("--held-seqs", type=int, default=8, help="sequences of each of the two held-out texts")
    ap.add_argument("--seq-len", type=int, default=128)
    args = ap.parse_args()
    if min(args.layers) < 2:
        ap.error("--layers: at least 2 (the first layer is hash-routed; the pass decides the others)")
    if args.experts < 4:
        ap.error("--experts: at least 4 (the pass keeps a quarter, at least top_k)")
    bench(args.layers, args.experts, args.vocab, args.calib_seqs, args.held_seqs, args.seq_len)


if __name__ == "__main__":
    main()

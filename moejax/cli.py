"""The `moejax` command for checkpoint tools (experiments go through `python -m moejax.run`).

    moejax score CKPT (--text PATH... | --tokens FILE.npy) [--seq-len 512] [--max-tokens N]
                 [--scores frequency,reap,...] [--batch-size B] [--dtype bfloat16] --out scores.parquet
"""

from __future__ import annotations

import argparse
import sys

from moejax.errors import MoejaxError


# XLA hoists the float32 conversion of a bfloat16 expert stack out of the per-block loop of the
# grouped matmul, making a float32 copy of every expert of the layer (2.2 GB for Moonlight) at
# once. For the streamed scoring pass, whose point is a small memory peak, that hoisting is turned
# off; it must be set before JAX initialises its backend.
LOW_MEMORY_XLA_FLAGS = "--xla_disable_hlo_passes=while-loop-invariant-code-motion"


def _score(args) -> None:
    import os

    if "jax" not in sys.modules:
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {LOW_MEMORY_XLA_FLAGS}".strip()
    from moejax.scoring.score_checkpoint import ALL_SCORES, score_checkpoint

    scores = args.scores.split(",") if args.scores else list(ALL_SCORES)
    df = score_checkpoint(args.checkpoint, text=args.text, tokens=args.tokens, seq_len=args.seq_len,
                          max_tokens=args.max_tokens, scores=scores, batch_size=args.batch_size, out=args.out,
                          dtype=args.dtype)
    print(f"{df.layer.nunique()} MoE layers x {df.expert.nunique()} experts x {df.score.nunique()} scores "
          f"-> {args.out} (+ {args.out.rsplit('.', 1)[0]}.json)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="moejax", description="moejax checkpoint tools")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("score", help="every expert score of every MoE layer from one calibration pass")
    p.add_argument("checkpoint")
    data = p.add_mutually_exclusive_group(required=True)
    data.add_argument("--text", nargs="+", help="text files, folders or globs")
    data.add_argument("--tokens", help="pre-tokenised ids, a .npy int array [n_seq, seq_len]")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--scores", default=None, help="comma-separated; default: all nine")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="compute dtype (bfloat16 halves a layer's memory)")
    p.add_argument("--out", required=True, help="scores.parquet")
    p.set_defaults(func=_score)
    args = parser.parse_args(argv)
    try:
        args.func(args)
    except MoejaxError as e:
        print(f"moejax {args.command}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

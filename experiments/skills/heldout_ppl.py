"""Held-out stdlib perplexity of a train_tiny checkpoint at a chosen window length, on exactly the
held-out bytes training evaluated (moejax_tiny.json: stdlib root, held-out files, eval_tokens), so
models trained at different `data.seq_len` compare on equal windows (the stdlib tiny model's 4.74
is at 128 bytes):

    python experiments/skills/heldout_ppl.py CKPT --seq-len 128
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np


def heldout_loss(ckpt, seq_len: int, batch: int = 32) -> float:
    import jax.numpy as jnp

    from moejax.data import byte_stream
    from moejax.hf.auto import AutoModelForCausalLM
    from moejax.inference.nll import next_token_nll

    record = json.loads((Path(ckpt) / "moejax_tiny.json").read_text())
    root = Path(record["stdlib_root"])
    held = byte_stream([root / n for n in record["heldout"]])[: record["config"]["data"]["eval_tokens"]]
    ids = held[: len(held) // seq_len * seq_len].reshape(-1, seq_len).astype(np.int32)
    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=jnp.float32)
    forward = model.jitted()
    total = 0.0
    for i in range(0, len(ids), batch):
        chunk = jnp.asarray(ids[i:i + batch])
        total += float(next_token_nll(forward(chunk).logits_BSV, chunk).sum())
    return total / (ids.shape[0] * (seq_len - 1))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--seq-len", type=int, default=128)
    args = parser.parse_args(argv)
    loss = heldout_loss(args.checkpoint, args.seq_len)
    print(f"{args.checkpoint}: held-out loss {loss:.4f} nats/byte, perplexity {math.exp(loss):.3f} "
          f"({args.seq_len}-byte windows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

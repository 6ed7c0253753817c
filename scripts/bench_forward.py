"""Benchmark the DeepSeek-V3 forward: moejax (jitted, float32) against transformers' eager forward.

    python scripts/bench_forward.py                  # Moonlight-16B-A3B shapes cut to 2 layers, 2,048 tokens
    python scripts/bench_forward.py --tokens 512     # quicker

Both run the same random weights (transformers makes them; moejax loads the saved checkpoint) on
the same tokens, timed in the same run; the logits are compared too. Needs the test extra
(torch, transformers).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _timing import best_of  # noqa: E402




def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import torch
    from transformers import DeepseekV3Config as HFConfig
    from transformers import DeepseekV3ForCausalLM as HFModel

    from moejax import DeepseekV3ForCausalLM
    from moejax.models.deepseek_v3.presets import PRESETS

    preset = {k: v for k, v in PRESETS["moonlight-16b-a3b"].items()
              if k not in ("architectures", "model_type", "scoring_func", "topk_method", "moe_layer_freq")}
    preset.update(num_hidden_layers=args.layers, initializer_range=0.02)
    torch.manual_seed(0)
    hf_cfg = HFConfig(**preset, attn_implementation="eager", experts_implementation="eager")
    hf = HFModel(hf_cfg).eval()
    with torch.no_grad():
        for m in hf.modules():
            if hasattr(m, "e_score_correction_bias"):
                m.e_score_correction_bias.normal_(0, 0.05)
            if hasattr(m, "e_score_correction_bias") and hasattr(m, "weight"):
                m.weight.normal_(0, 0.5)
    ids = np.random.default_rng(0).integers(0, hf_cfg.vocab_size, size=(1, args.tokens)).astype(np.int32)
    print(f"Moonlight-16B-A3B shapes, {args.layers} layers ({sum(p.numel() for p in hf.parameters()) / 1e9:.2f}B "
          f"parameters), {args.tokens} tokens, float32; {os.cpu_count()} CPU cores; torch {torch.__version__} "
          f"({torch.get_num_threads()} threads), jax {jax.__version__} on {jax.default_backend()}")

    with torch.no_grad():
        ids_t = torch.as_tensor(ids, dtype=torch.long)
        want = hf(ids_t).logits.numpy()
        t_hf = best_of(lambda: hf(ids_t), args.repeat)

    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        del hf
        model = DeepseekV3ForCausalLM.from_pretrained(tmp, dtype=jnp.float32)
    forward = model.jitted()
    ids_j = jnp.asarray(ids)
    t0 = time.perf_counter()
    got = np.asarray(forward(ids_j).block_until_ready())
    t_compile = time.perf_counter() - t0
    t_jax = best_of(lambda: forward(ids_j).block_until_ready(), args.repeat)
    print(f"max |logits difference| {np.abs(got - want).max():.2e} (max |logit| {np.abs(want).max():.2f})")
    print(f"forward    transformers eager {t_hf:6.2f} s | moejax jit {t_jax:6.2f} s -> {t_hf / t_jax:4.2f}x "
          f"(first call incl. compilation {t_compile:.2f} s)")


if __name__ == "__main__":
    main()

"""Benchmark KV-cached generation: moejax's `Generator` (latent cache, jitted prefill and
while-loop decode) against transformers' `generate` with its own cache, greedy, float32.

    python scripts/bench_generate.py                        # tiny and Moonlight-shaped (2 layers)
    python scripts/bench_generate.py --model tiny --repeat 3
    python scripts/bench_generate.py --batch 8 --prompt 512 --new 128

Models: `tiny` = train_tiny's architecture (4 layers, 32 experts top-4, hidden 128, vocab 256; its
max_position_embeddings raised to 1,024 so a 512-token prompt and 128 new tokens fit) and
`moonlight2` = Moonlight-16B-A3B's shapes cut to 2 layers (one dense, one MoE, vocab 163,840).
Random weights made by transformers, saved, loaded by moejax: both run the same weights on the
same prompts; the greedy tokens are compared. transformers 5.x caches MLA's compressed latent too (and re-expands every cached token's keys and
values at each step); the expanded per-head size is printed for comparison. Decode throughput = batch x (new - 1) tokens over
(time of `new` tokens - time of 1 token), so the prompt's prefill is excluded on both sides; the
two are timed alternately (best of --repeat). Needs the test extra (torch, transformers).
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

from _timing import best_alternating  # noqa: E402


def hf_config(name: str):
    from transformers import DeepseekV3Config as HFConfig

    from moejax.training.config import ArchConfig
    from moejax.models.deepseek_v3.presets import PRESETS

    if name == "tiny":
        d = {**ArchConfig().hf_dict(), "max_position_embeddings": 1024}
    else:
        d = {**PRESETS["moonlight-16b-a3b"], "num_hidden_layers": 2, "initializer_range": 0.02}
    d = {k: v for k, v in d.items() if k not in ("architectures", "model_type", "scoring_func", "topk_method",
                                                 "moe_layer_freq", "dtype")}
    return HFConfig(**d, attn_implementation="eager", experts_implementation="eager")


def hf_cache_bytes_per_token(hf, ids_t) -> float:
    """Bytes transformers' cache holds per token (all layers), measured on its own cache object."""
    import torch

    with torch.no_grad():
        cache = hf(ids_t[:1], use_cache=True).past_key_values
    total = 0
    for layer in cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if t is not None:
                total += t.numel() * t.element_size()
    return total / ids_t.shape[1]


def bench(name: str, batch: int, prompt: int, new: int, repeat: int):
    import jax
    import jax.numpy as jnp
    import torch
    from transformers import DeepseekV3ForCausalLM as HFModel

    from moejax import from_pretrained
    from moejax.inference.generate import Generator

    torch.manual_seed(0)
    cfg = hf_config(name)
    hf = HFModel(cfg).eval()
    with torch.no_grad():
        for m in hf.modules():
            if hasattr(m, "e_score_correction_bias"):
                m.e_score_correction_bias.normal_(0, 0.05)
    ids = np.random.default_rng(0).integers(1, cfg.vocab_size, size=(batch, prompt)).astype(np.int32)
    mask = np.ones_like(ids)
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        model = from_pretrained(tmp, dtype=jnp.float32)
    n_params = sum(p.numel() for p in hf.parameters()) / 1e9
    print(f"\n{name}: {cfg.num_hidden_layers} layers, {n_params:.3f}B parameters, batch {batch}, prompt {prompt}, "
          f"{new} new tokens, float32; torch {torch.__version__} ({torch.get_num_threads()} threads), "
          f"jax {jax.__version__} on {jax.default_backend()}")

    gen = Generator(model)
    ids_t, mask_t = torch.as_tensor(ids, dtype=torch.long), torch.as_tensor(mask)

    def hf_run(n):
        with torch.no_grad():
            return hf.generate(input_ids=ids_t, attention_mask=mask_t, max_new_tokens=n, min_new_tokens=n,
                               do_sample=False, pad_token_id=0).numpy()

    def mj_run(n):
        return gen(ids, mask, max_new_tokens=n)

    t0 = time.perf_counter()
    got = mj_run(new)
    t_cold = time.perf_counter() - t0
    mj_run(1)  # compiles the 1-token shape too
    want = hf_run(new)
    agree = float((got[:, prompt:] == want[:, prompt:]).mean())
    first_diff = [int(np.argmax(g != w)) if (g != w).any() else new for g, w in zip(got[:, prompt:], want[:, prompt:])]
    t_hf_1, t_mj_1, t_hf_n, t_mj_n = best_alternating(
        [lambda: hf_run(1), lambda: mj_run(1), lambda: hf_run(new), lambda: mj_run(new)], repeat)
    decoded = batch * (new - 1)
    hf_tps, mj_tps = decoded / (t_hf_n - t_hf_1), decoded / (t_mj_n - t_mj_1)
    mj_bytes = cfg.num_hidden_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4
    hf_bytes = hf_cache_bytes_per_token(hf, ids_t)
    expanded = cfg.num_hidden_layers * cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
                                                                  + cfg.v_head_dim) * 4
    print(f"greedy tokens equal to transformers: {agree:.1%} (first difference per row at {first_diff})")
    print(f"{'':34s} {'transformers':>14s} {'moejax':>10s}  ratio")
    print(f"{'decode throughput (tokens/s)':34s} {hf_tps:14.1f} {mj_tps:10.1f}  {mj_tps / hf_tps:5.2f}x")
    print(f"{'prefill + 1 token (s)':34s} {t_hf_1:14.3f} {t_mj_1:10.3f}  {t_hf_1 / t_mj_1:5.2f}x")
    print(f"{f'whole generate, {new} tokens (s)':34s} {t_hf_n:14.3f} {t_mj_n:10.3f}  {t_hf_n / t_mj_n:5.2f}x")
    print(f"{'first call incl. compilation (s)':34s} {'':>14s} {t_cold:10.2f}")
    print(f"{'cache per token, all layers (B)':34s} {hf_bytes:14.0f} {mj_bytes:10.0f}  {hf_bytes / mj_bytes:5.1f}x less")
    print(f"{'  per-head keys and values instead':34s} {expanded:14.0f} {'':>10s}  {expanded / mj_bytes:5.1f}x less "
          "(what transformers 4.x cached)")
    return mj_tps / hf_tps


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("tiny", "moonlight2", "both"), default="both")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    print(f"{os.cpu_count()} CPU cores")
    for name in (("tiny", "moonlight2") if args.model == "both" else (args.model,)):
        bench(name, args.batch, args.prompt, args.new, args.repeat)


if __name__ == "__main__":
    main()

"""Benchmark the DeepSeek-V3 forward: moejax (jitted, float32) against transformers' eager forward.

    python scripts/bench_forward.py                  # Moonlight-16B-A3B shapes cut to 2 layers, 2,048 tokens
    python scripts/bench_forward.py --tokens 512     # quicker
    python scripts/bench_forward.py --parts          # also each part alone: attention, dense MLP, MoE, head
    python scripts/bench_forward.py --floor          # also the forward's matmuls alone, XLA against torch
    python scripts/bench_forward.py --family gpt_oss --shape tiny   # any registered family with a TEST config:
    python scripts/bench_forward.py --family qwen3_next --shape mid  # its tiny test shape, or a mid-size one

Both run the same random weights (transformers makes them; moejax loads the saved checkpoint) on
the same tokens, timed alternately in the same run (best of --repeat each); the logits are
compared too. Needs the test extra (torch, transformers).
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




def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=4)
    ap.add_argument("--parts", action="store_true", help="also time each part of the forward alone")
    ap.add_argument("--floor", action="store_true",
                    help="also time the forward's matmuls alone (same shapes in XLA and in torch)")
    ap.add_argument("--family", help="another registered family (its TEST config scaled by --shape) instead of Moonlight")
    ap.add_argument("--shape", choices=("tiny", "mid"), default="mid")
    args = ap.parse_args()
    if args.family:
        return bench_family(args.family, args.shape, args.tokens, args.repeat)

    import jax
    import jax.numpy as jnp
    import torch
    from transformers import DeepseekV3Config as HFConfig
    from transformers import DeepseekV3ForCausalLM as HFModel

    from moejax import from_pretrained
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

    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        model = from_pretrained(tmp, dtype=jnp.float32)
    forward = model.jitted()
    ids_j = jnp.asarray(ids)
    t0 = time.perf_counter()
    got = np.asarray(forward(ids_j).logits_BSV.block_until_ready())
    t_compile = time.perf_counter() - t0
    # Alternating: this machine's speed drifts by 10-20% over minutes.
    with torch.no_grad():
        t_hf, t_jax = best_alternating([lambda: hf(ids_t), lambda: forward(ids_j).logits_BSV.block_until_ready()], args.repeat)
    print(f"max |logits difference| {np.abs(got - want).max():.2e} (max |logit| {np.abs(want).max():.2f})")
    print(f"forward    transformers eager {t_hf:6.2f} s | moejax jit {t_jax:6.2f} s -> {t_hf / t_jax:4.2f}x "
          f"(first call incl. compilation {t_compile:.2f} s)")
    if args.parts:
        compare_parts(hf, model, args.tokens, args.repeat)
    if args.floor:
        compare_matmuls(model.config, args.tokens, min(args.repeat, 3), t_hf)


# A mid-size shape for any family: its TEST config with these widths (DeltaNet, indexer and window sizes
# scaled alike); the layer schedule and routing settings stay the TEST config's.
MID = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=512, num_hidden_layers=4,
           num_attention_heads=8, num_key_value_heads=2, head_dim=128, num_experts_per_tok=4,
           shared_expert_intermediate_size=512, linear_key_head_dim=128, linear_value_head_dim=128,
           linear_num_key_heads=4, linear_num_value_heads=8, sliding_window=128)
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def family_config(name: str, shape: str) -> dict:
    """transformers' config arguments of a family's benchmark model (a wrapper's go in text_config)."""
    from moejax.models.registry import FAMILIES

    test = dict(FAMILIES[name].test_config)
    inner = dict(test.get("text_config", test))
    if shape == "mid":
        inner.update({k: v for k, v in MID.items() if k in inner or k in ("head_dim",)})
        inner.update({k: 32 for k in EXPERT_KEYS if k in inner})
        if "layer_types" in inner:  # the TEST schedule repeated over the mid-size depth
            inner["layer_types"] = [inner["layer_types"][l % len(inner["layer_types"])] for l in range(MID["num_hidden_layers"])]
        for key in ("indexer_types",):
            if key in inner:
                inner[key] = ["full"] * MID["num_hidden_layers"]
        if "kv_lora_rank" in inner:  # MLA: one key/value head per query head, its latent widths
            inner.update(num_key_value_heads=inner["num_attention_heads"], q_lora_rank=256, kv_lora_rank=128,
                         qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, index_n_heads=8, index_head_dim=64,
                         index_topk=128)
        inner["max_position_embeddings"] = 4096
    return {**test, "text_config": inner} if "text_config" in test else inner


def bench_family(name: str, shape: str, n_tokens: int, repeat: int) -> None:
    """One family's forward: moejax jitted (float32) against transformers' eager forward, on the
    same random weights and tokens, timed alternately; the logits compared."""
    import jax
    import jax.numpy as jnp
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from family_fixtures import hf_classes

    from moejax import from_pretrained

    config_cls, model_cls = hf_classes(name)
    kw = family_config(name, shape)
    torch.manual_seed(0)
    hf = model_cls(config_cls(**kw, attn_implementation="eager", experts_implementation="eager")).eval()
    vocab = kw.get("text_config", kw)["vocab_size"]
    ids = np.random.default_rng(0).integers(0, vocab, size=(1, n_tokens)).astype(np.int32)
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        model = from_pretrained(tmp, dtype=jnp.float32)
    forward, ids_j, ids_t = model.jitted(), jnp.asarray(ids), torch.as_tensor(ids, dtype=torch.long)
    t0 = time.perf_counter()
    got = np.asarray(forward(ids_j).logits_BSV.block_until_ready())
    t_compile = time.perf_counter() - t0
    with torch.no_grad():
        want = hf(input_ids=ids_t).logits.numpy()
        t_hf, t_jax = best_alternating([lambda: hf(input_ids=ids_t), lambda: forward(ids_j).logits_BSV.block_until_ready()],
                                       repeat)
    n_params = sum(p.numel() for n, p in hf.named_parameters() if "visual" not in n) / 1e6
    print(f"{name} {shape} ({n_params:.0f}M language-model parameters), {n_tokens} tokens, float32; "
          f"{os.cpu_count()} CPU cores; torch {torch.__version__}, jax {jax.__version__}")
    print(f"max |logits difference| {np.abs(got - want).max():.2e} (max |logit| {np.abs(want).max():.2f})")
    print(f"forward    transformers eager {t_hf:7.3f} s | moejax jit {t_jax:7.3f} s -> {t_hf / t_jax:4.2f}x "
          f"(first call incl. compilation {t_compile:.2f} s)")


# moejax's attention skips the causal upper triangle of these two (about half of each); the other
# matmuls it must do in full
ATTENTION_CORE = ("q k^T (per head)", "p v (per head)")


def forward_matmuls(cfg, n_tokens: int):
    """Every matmul of one forward over `n_tokens` tokens as (what, batch, M, K, N, how many).
    The routed experts are counted as one chain over all T*K pairs (the same FLOPs as the
    per-expert groups, at the best rate a kernel gets on them)."""
    T, H, nh = n_tokens, cfg.hidden_size, cfg.num_attention_heads
    L, n_dense = cfg.num_hidden_layers, min(cfg.first_k_dense_replace, cfg.num_hidden_layers)
    qk, dv = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    rows = [("kv_a_proj", 1, T, H, cfg.kv_lora_rank + cfg.qk_rope_head_dim, L),
            ("kv_b_proj", 1, T, cfg.kv_lora_rank, nh * (cfg.qk_nope_head_dim + dv), L),
            (ATTENTION_CORE[0], nh, T, qk, T, L), (ATTENTION_CORE[1], nh, T, T, dv, L),
            ("o_proj", 1, T, nh * dv, H, L)]
    if cfg.q_lora_rank is None:
        rows.append(("q_proj", 1, T, H, nh * qk, L))
    else:
        rows += [("q_a_proj", 1, T, H, cfg.q_lora_rank, L), ("q_b_proj", 1, T, cfg.q_lora_rank, nh * qk, L)]
    rows += [("dense gate/up", 1, T, H, cfg.intermediate_size, 2 * n_dense),
             ("dense down", 1, T, cfg.intermediate_size, H, n_dense)]
    n_moe, Im, TK = L - n_dense, cfg.moe_intermediate_size, T * cfg.num_experts_per_tok
    if n_moe:
        rows += [("router", 1, T, H, cfg.n_routed_experts, n_moe),
                 ("routed gate/up (all pairs)", 1, TK, H, Im, 2 * n_moe), ("routed down (all pairs)", 1, TK, Im, H, n_moe)]
        if cfg.n_shared_experts:
            Is = Im * cfg.n_shared_experts
            rows += [("shared gate/up", 1, T, H, Is, 2 * n_moe), ("shared down", 1, T, Is, H, n_moe)]
    rows.append(("output head", 1, T, H, cfg.vocab_size, 1))
    return rows


def compare_matmuls(cfg, n_tokens, repeat, t_hf_forward):
    """The forward's matmuls alone, each shape timed in XLA (jit, float32) and in torch, in turn.
    If XLA's sum (without the attention core, which moejax shortens) exceeds transformers' whole
    forward, no arrangement of the rest reaches 1x with these kernels."""
    import jax
    import jax.numpy as jnp
    import torch

    rng = np.random.default_rng(2)
    mm = jax.jit(lambda a, b: jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST))
    total_t = total_j = core_j = 0.0
    print(f"{'matmul':28s} {'shape (batch x M x K x N)':28s} {'count':>5s} {'torch':>8s} {'XLA':>8s}  ratio")
    for what, b, m, k, n, count in forward_matmuls(cfg, n_tokens):
        a_np = rng.standard_normal((b, m, k), np.float32)
        w_np = rng.standard_normal((b, k, n), np.float32) * 0.02
        a_t, w_t, a_j, w_j = torch.from_numpy(a_np), torch.from_numpy(w_np), jnp.asarray(a_np), jnp.asarray(w_np)
        mm(a_j, w_j).block_until_ready()
        with torch.no_grad():
            t_t, t_j = best_alternating([lambda: torch.matmul(a_t, w_t), lambda: mm(a_j, w_j).block_until_ready()],
                                        repeat)
        total_t, total_j = total_t + count * t_t, total_j + count * t_j
        core_j += count * t_j if what in ATTENTION_CORE else 0.0
        print(f"{what:28s} {f'{b} x {m} x {k} x {n}':28s} {count:5d} {t_t:7.3f}s {t_j:7.3f}s  {t_t / t_j:4.2f}x")
    print(f"{'all matmuls of the forward':62s} {total_t:7.2f}s {total_j:7.2f}s  {total_t / total_j:4.2f}x")
    rest_j = total_j - core_j
    print(f"transformers' whole forward {t_hf_forward:.2f} s; XLA's matmuls alone {total_j:.2f} s, "
          f"without the attention core {rest_j:.2f} s -> the most a jitted forward can reach with XLA's "
          f"matmul kernels: {t_hf_forward / total_j:4.2f}x with full attention, "
          f"{t_hf_forward / rest_j:4.2f}x if attention were free")


def compare_parts(hf, model, n_tokens, repeat):
    """Each part of layer 0 (attention, dense MLP) and layer 1 (MoE) and the output head alone, on
    the same random hidden states, timed alternately. Where the forward's time goes."""
    import jax
    import jax.numpy as jnp
    import torch
    from flax import nnx

    from moejax.models.deepseek_v3 import rope as rope_lib
    from moejax.models.layers import linear

    x_np = np.random.default_rng(1).standard_normal((1, n_tokens, model.config.hidden_size)).astype(np.float32)
    x_t, x_j = torch.from_numpy(x_np.copy()), jnp.asarray(x_np)
    cos, sin = rope_lib.cos_sin(model.config, jnp.arange(n_tokens), x_j.dtype)
    allowed = jnp.tril(jnp.ones((n_tokens, n_tokens), bool))[None]
    position_embeddings = hf.model.rotary_emb(x_t, torch.arange(n_tokens)[None])
    causal = torch.full((n_tokens, n_tokens), float("-inf")).triu(1)[None, None]

    def jitted(module, call):
        graphdef, state = nnx.split(module)
        fn = jax.jit(lambda st, x: call(nnx.merge(graphdef, st), x))
        return lambda: fn(state, x_j).block_until_ready()

    (hf0, hf1), (j0, j1) = hf.model.layers[:2], model.model.layers[:2]
    parts = {
        "attention (layer 0)": (lambda: hf0.self_attn(x_t, position_embeddings=position_embeddings,
                                                      attention_mask=causal),
                                jitted(j0.self_attn, lambda m, x: m(x, cos, sin, allowed))),
        "dense MLP (layer 0)": (lambda: hf0.mlp(x_t), jitted(j0.mlp, lambda m, x: m(x))),
        "MoE (layer 1)": (lambda: hf1.mlp(x_t), jitted(j1.mlp, lambda m, x: m(x, None, True)[0])),
        "output head": (lambda: hf.lm_head(x_t), jitted(model, lambda m, x: linear(x, m.lm_head[...]))),
    }
    with torch.no_grad():
        for name, (torch_fn, jax_fn) in parts.items():
            torch_fn(), jax_fn()  # compile, warm up
            t_hf, t_jax = best_alternating([torch_fn, jax_fn], repeat)
            print(f"{name:22s} transformers {t_hf:6.2f} s | moejax {t_jax:6.2f} s -> {t_hf / t_jax:4.2f}x")


if __name__ == "__main__":
    main()

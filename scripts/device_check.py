"""One command for a lent GPU (H100 or H200): moejax against transformers and against the GPU's own
matmul rate, written as one JSON file.

    python scripts/device_check.py                          # on the GPU: <= 8 minutes, device_check.json
    python scripts/device_check.py --out run.json --budget-s 400
    python scripts/device_check.py --cpu-smoke --out tmp/x.json   # tiny shapes on CPU (the test runs this)

Needs only JAX (with CUDA), flax, numpy, safetensors, torch and transformers (no Hydra, no pandas:
nothing here imports them). Every checkpoint is made in the run by transformers from a random
config (the machine has no network), saved, and loaded by `moejax.from_pretrained`.

Sections, each guarded (a failure records {"status": "error", "error": ...} and the run goes on;
one that would not fit the remaining time budget records {"status": "skipped", ...}); the JSON is
rewritten atomically (temporary sibling + rename) after every section, so a run killed part way
still leaves what it measured:

  environment               device kind, backend, versions (jax, jaxlib, flax, torch, transformers, ...)
  matmul_peak               the bf16 matmul rate of this device: a jitted chain of square
                            jnp.dot products, timed after warm-up (best of 3), the largest size's
                            rate is the reference every other rate is divided by
  forward_deepseek_v3       float32 and bfloat16 logits of a random DeepSeek-V3 checkpoint (q LoRA,
  forward_qwen3_moe         groups, YaRN) and a Qwen3-MoE one against transformers' eager model
                            (torch on the GPU when CUDA is available), chosen experts per layer,
                            stated tolerances and pass flags; both forwards timed
  dispatch_ragged_vs_dense  one Moonlight-shaped MoE layer (H 2048, 64 experts, top 6, Im 1408):
                            the `ragged` backend's output against the `dense` oracle (f32 at
                            highest precision, and bf16), and the time of dense, sorted and ragged
  scoring_pass              `moejax.scoring.observe.calibrate` on a Moonlight-shaped 3-layer
                            checkpoint written here (first layer dense, vocabulary cut): steady
                            tokens per second per backend, the forward alone beside it
  decode                    greedy decode tokens per second of moejax's `Generator` against
                            transformers' `generate` on that checkpoint, and the tokens' agreement
  summary                   every achieved FLOP rate and its fraction of the measured matmul rate

FLOPs are model FLOPs counted from the shapes (2 per multiply-add of every weight a token passes
through, routed experts at top-k of E, attention's causal half); a rate is those FLOPs over the
best measured time, and `fraction_of_bf16_peak` divides it by `matmul_peak` of the same run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

T_START = time.monotonic()
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "tests"))   # hf_fixtures: the hardened random checkpoints the tests use

from hf_fixtures import BASE as FIXTURE_BASE  # noqa: E402

# What each mode runs. "gpu": sized for one H100/H200 within the 8-minute budget; "smoke": tiny,
# for a CPU, so the whole script is known to run before a device is lent.
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 512,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
MOONLIGHT_KEYS_DROPPED = ("architectures", "model_type", "scoring_func", "topk_method", "moe_layer_freq")

QWEN3_COMMON = dict(norm_topk_prob=True, mlp_only_layers=[0], rms_norm_eps=1e-6, tie_word_embeddings=False,
                    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})

SHAPES = {
    "gpu": {
        "matmul": [(4096, 40), (8192, 20), (16384, 4)],       # (n, chained products)
        "deepseek_v3": dict(vocab_size=8192, hidden_size=1024, intermediate_size=2816, moe_intermediate_size=512,
                            num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=384,
                            kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
                            n_routed_experts=32, n_shared_experts=1, num_experts_per_tok=4, n_group=4, topk_group=2,
                            first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                            rms_norm_eps=1e-6, max_position_embeddings=4096, tie_word_embeddings=False,
                            num_nextn_predict_layers=0, rope_parameters={**YARN, "original_max_position_embeddings": 1024}),
        "qwen3_moe": dict(QWEN3_COMMON, vocab_size=8192, hidden_size=1024, intermediate_size=2816,
                          moe_intermediate_size=512, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4,
                          head_dim=128, num_experts=32, num_experts_per_tok=4, max_position_embeddings=4096),
        "forward_batch": (4, 512),
        "dispatch_tokens": 8192,
        "moonlight": dict(num_hidden_layers=3, vocab_size=32768),
        "scoring": dict(batches=4, batch=4, seq=512),
        "decode": dict(batch=8, prompt=128, new=64),
        "repeat": 3,
        "dtype": "bfloat16",           # the scoring pass and decode run in this dtype
        "backends": ("ragged", "sorted"),
        # seconds a section is expected to take at most (a section starts only if it fits)
        "need_s": dict(matmul_peak=30, forward_deepseek_v3=70, forward_qwen3_moe=60, dispatch_ragged_vs_dense=45,
                       scoring_pass=150, decode=90),
    },
    "smoke": {
        "matmul": [(128, 4), (256, 2)],
        # the tests' tiny DeepSeek-V3 (tests/hf_fixtures.py BASE)
        "deepseek_v3": {**{k: v for k, v in FIXTURE_BASE.items() if k != "initializer_range"},   # set by the run
                        "rope_parameters": {**YARN, "original_max_position_embeddings": 64}},
        "qwen3_moe": dict(QWEN3_COMMON, vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                          num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                          num_experts=8, num_experts_per_tok=2, max_position_embeddings=256),
        "forward_batch": (3, 14),
        "dispatch_tokens": 64,
        # Moonlight's structure (plain q_proj, MLA, one group, 2 shared experts, first layer dense) at tiny widths
        "moonlight": dict(num_hidden_layers=3, vocab_size=96, hidden_size=64, intermediate_size=96,
                          moe_intermediate_size=32, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
                          qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8,
                          num_experts_per_tok=2, max_position_embeddings=256),
        "dispatch_layer": dict(hidden=64, experts=8, top_k=2, intermediate=32),
        "scoring": dict(batches=4, batch=2, seq=16),
        "decode": dict(batch=2, prompt=6, new=16),
        "repeat": 2,
        "dtype": "float32",
        "backends": ("ragged", "sorted"),
        "need_s": dict(matmul_peak=5, forward_deepseek_v3=10, forward_qwen3_moe=10, dispatch_ragged_vs_dense=5,
                       scoring_pass=10, decode=10),
    },
}
MOONLIGHT_LAYER = dict(hidden=2048, experts=64, top_k=6, intermediate=1408)   # Moonlight-16B-A3B's MoE layer

# Stated tolerances. float32: at most one token in 1,000 routed differently, and logits within
# 1e-4 of max(1, max |logit|) on the tokens routed identically. bfloat16 (the tests' rule,
# tests/test_deepseek_v3.py): at least 90% of tokens route identically in every layer, and their
# logits are within 3% of the largest transformers logit.
TOL = {"float32": dict(routing_agreement_min=0.999, logits_rel=1e-4),
       "bfloat16": dict(routing_agreement_min=0.9, logits_rel=0.03)}
DISPATCH_TOL = {"float32": 1e-5, "bfloat16": 2e-2}   # max |ragged - dense| / max |dense|


class SectionTimeout(Exception):
    pass


class Report:
    """The JSON being built: one entry per section, rewritten atomically after each."""

    def __init__(self, path: Path, budget_s: float, mode: str):
        self.path, self.budget_s = path, budget_s
        self.data = {"script": "scripts/device_check.py", "mode": mode, "budget_s": budget_s,
                     "started_unix": time.time(), "sections": {}, "complete": False}

    def remaining(self) -> float:
        return self.budget_s - (time.monotonic() - T_START)

    def write(self) -> None:
        self.data["elapsed_s"] = round(time.monotonic() - T_START, 2)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(_jsonable(self.data), indent=1, allow_nan=False) + "\n")
        os.replace(tmp, self.path)

    def run(self, name: str, fn, need_s: float = 0.0) -> dict | None:
        left = self.remaining()
        if left < need_s:
            entry = {"status": "skipped", "reason": f"{left:.0f} s of the {self.budget_s:.0f} s budget left, "
                                                   f"the section needs about {need_s:.0f} s"}
            self.data["sections"][name] = entry
            self.write()
            print(f"[device_check] {name}: skipped ({entry['reason']})", flush=True)
            return None
        t0 = time.monotonic()
        print(f"[device_check] {name} ...", flush=True)
        try:
            with _alarm(max(1.0, left - 5.0)):
                result = fn()
            entry = {"status": "ok", **result}
        except BaseException as e:  # noqa: BLE001 - a failed section is recorded, the others still run
            if isinstance(e, KeyboardInterrupt):
                raise
            entry = {"status": "error", "error": f"{type(e).__name__}: {e}"[:2000],
                     "traceback": traceback.format_exc()[-4000:]}
        entry["seconds"] = round(time.monotonic() - t0, 2)
        self.data["sections"][name] = entry
        self.write()
        print(f"[device_check] {name}: {entry['status']} in {entry['seconds']:.1f} s"
              + (f" ({entry['error']})" if entry["status"] == "error" else ""), flush=True)
        return entry


@contextlib.contextmanager
def _alarm(seconds: float):
    """Raise SectionTimeout in this (main) thread after `seconds`: keeps the run within its budget
    (a compilation in progress finishes first). No-op where SIGALRM does not exist."""
    if not hasattr(signal, "setitimer"):
        yield
        return

    def fire(signum, frame):
        raise SectionTimeout(f"the time budget ran out after {seconds:.0f} s in this section")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if hasattr(x, "item") and getattr(x, "ndim", 1) == 0:   # numpy scalars
        x = x.item()
    if isinstance(x, float):
        return x if math.isfinite(x) else repr(x)
    return x


# --------------------------------------------------------------------------- helpers


class Context:
    """What sections share: the device, the torch device, the measured peak, the checkpoints."""

    def __init__(self, args, shapes, tmp: Path):
        self.args, self.shapes, self.tmp = args, shapes, tmp
        self.peak_bf16 = None          # FLOP/s, from matmul_peak
        self.torch_device = "cpu"
        self.moonlight = None          # (path, parameter counts, config) once written
        self.rates = []                # every rate, for the summary


def best_of(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(max(1, repeat)):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def rate(ctx: Context, what: str, flops: float, seconds: float, **extra) -> dict:
    """The achieved FLOP rate of `what` and its fraction of the measured bf16 matmul rate."""
    achieved = flops / seconds
    out = {"seconds": seconds, "flops": flops, "tflops_per_s": achieved / 1e12,
           "fraction_of_bf16_peak": None if not ctx.peak_bf16 else achieved / ctx.peak_bf16, **extra}
    ctx.rates.append({"what": what, **out})
    return out


def difference(t_small: float, t_big: float, n_small: float, n_big: float):
    """(seconds, units, how) of the steady rate: the big run's extra units over its extra time,
    which leaves out what both runs pay once (prefill, compilation, transfers); the big run whole
    when the difference is within noise (under 10% of it: tiny shapes)."""
    if t_big - t_small > 0.1 * t_big:
        return t_big - t_small, n_big - n_small, "difference"
    return t_big, n_big, "whole run (the difference was within timing noise)"


def highest_precision():
    """float32 matmuls in full float32 (no TF32 on the GPU) while tracing inside this context."""
    import jax

    if hasattr(jax, "default_matmul_precision"):
        return jax.default_matmul_precision("highest")

    @contextlib.contextmanager
    def via_config():
        old = getattr(jax.config, "jax_default_matmul_precision", None)
        jax.config.update("jax_default_matmul_precision", "highest")
        try:
            yield
        finally:
            jax.config.update("jax_default_matmul_precision", old)
    return via_config()


def torch_sync(ctx: Context) -> None:
    import torch

    if ctx.torch_device == "cuda":
        torch.cuda.synchronize()


def release_torch(ctx: Context) -> None:
    import gc

    import torch

    if ctx.torch_device == "cuda":   # (a collection costs ~0.5 s with JAX and torch loaded: GPU only)
        gc.collect()
        torch.cuda.empty_cache()


def init_range(hidden: int) -> float:
    """Weights large enough to matter, small enough that activations do not grow layer by layer."""
    return min(0.15, 1.0 / math.sqrt(hidden))


def harden(model, hidden: int):
    """tests/hf_fixtures.py's hardening (norms random around 1, biases random and partly negative),
    router rows of standard deviation 8 / sqrt(hidden): logits of standard deviation ~8 whatever
    the width, so routing is decisive and comparable in bfloat16."""
    from hf_fixtures import harden as harden_fixture

    return harden_fixture(model, router_std=8.0 / math.sqrt(hidden))


def hf_classes(family: str):
    import transformers

    prefix = {"deepseek_v3": "DeepseekV3", "qwen3_moe": "Qwen3Moe"}[family]
    return getattr(transformers, prefix + "Config"), getattr(transformers, prefix + "ForCausalLM")


def make_checkpoint(ctx: Context, family: str, kw: dict, path: Path, seed: int, save_dtype: str):
    """A random transformers model of `family` (eager attention and experts: the reference), made on
    the torch device, hardened, saved to `path` in `save_dtype`; returns it (eval, float32)."""
    import torch

    config_cls, model_cls = hf_classes(family)
    torch.manual_seed(seed)
    cfg = config_cls(**kw, initializer_range=init_range(kw["hidden_size"]), bos_token_id=None, eos_token_id=None,
                     pad_token_id=0, attn_implementation="eager", experts_implementation="eager")
    with torch.device(ctx.torch_device):
        model = harden(model_cls(cfg).eval(), kw["hidden_size"])
    saved = model if save_dtype == "float32" else model.to(getattr(torch, save_dtype))
    saved.save_pretrained(path)
    return saved


def load_hf(ctx: Context, family: str, path: Path, dtype: str, eager: bool = True):
    """transformers' model from `path` on the torch device; eager attention and experts (the
    reference) or transformers' defaults (sdpa, grouped_mm where it can: what its users run)."""
    import torch

    _, model_cls = hf_classes(family)
    impl = dict(attn_implementation="eager", experts_implementation="eager") if eager else {}
    return model_cls.from_pretrained(path, dtype=getattr(torch, dtype), **impl).to(ctx.torch_device).eval()


def implementations(hf) -> dict:
    """The attention and experts implementations transformers resolved for `hf`."""
    return {"attention": getattr(hf.config, "_attn_implementation", None),
            "experts": getattr(hf.config, "_experts_implementation", None)}


def param_counts(hf) -> dict:
    """Weights a token's forward multiplies by: `dense` (attention, dense MLPs, shared experts,
    routers, output head; not the embedding) and `routed` (every routed expert's, all E)."""
    dense = routed = 0
    for name, p in hf.named_parameters():
        if p.ndim < 2 or "embed_tokens" in name:
            continue
        if ".mlp.experts." in name:
            routed += p.numel()
        else:
            dense += p.numel()
    return {"dense": dense, "routed": routed}


def attention_dims(cfg) -> tuple[int, int, int]:
    """(layers, heads, per-head query-key width + value width) of a transformers config."""
    if hasattr(cfg, "qk_nope_head_dim"):
        return cfg.num_hidden_layers, cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim
    head = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return cfg.num_hidden_layers, cfg.num_attention_heads, 2 * head


def top_k_of(cfg) -> tuple[int, int]:
    return getattr(cfg, "n_routed_experts", None) or cfg.num_experts, cfg.num_experts_per_tok


def forward_flops(cfg, counts: dict, batch: int, seq: int) -> float:
    """Model FLOPs of one forward over [batch, seq] tokens: every weight matmul (routed experts at
    K of E) plus attention's causal half (q.k and p.v over seq*(seq+1)/2 pairs per row)."""
    E, K = top_k_of(cfg)
    weights = counts["dense"] + counts["routed"] * K / E
    L, N, width = attention_dims(cfg)
    return 2.0 * batch * seq * weights + 2.0 * L * N * width * batch * seq * (seq + 1) / 2


def decode_flops_per_token(cfg, counts: dict, context: float) -> float:
    E, K = top_k_of(cfg)
    L, N, width = attention_dims(cfg)
    return 2.0 * (counts["dense"] + counts["routed"] * K / E) + 2.0 * L * N * width * context


def padded_batch(vocab: int, B: int, S: int, seed: int):
    """Token ids and a mask: row 1 right-padded, row 2 left-padded (by S // 4)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, size=(B, S)).astype(np.int32)
    mask = np.ones((B, S), np.int32)
    if B > 1:
        mask[1, S - S // 4:] = 0
    if B > 2:
        mask[2, :S // 4] = 0
    return ids, mask


def hf_reference(ctx: Context, hf, ids, mask):
    """transformers' logits [B, S, V] (float32 numpy) and each MoE layer's chosen experts [B*S, K]."""
    import torch

    chosen, hooks = {}, []
    for l, layer in enumerate(hf.model.layers):
        if hasattr(layer.mlp, "gate"):
            hooks.append(layer.mlp.gate.register_forward_hook(
                lambda mod, inp, out, l=l: chosen.__setitem__(l, out[2].detach().cpu().numpy().copy())))
    try:
        with torch.inference_mode():
            out = hf(torch.as_tensor(ids, dtype=torch.long, device=ctx.torch_device),
                     attention_mask=torch.as_tensor(mask, device=ctx.torch_device))
            logits = out.logits.float().cpu().numpy()
    finally:
        for h in hooks:
            h.remove()
    return logits, chosen


# --------------------------------------------------------------------------- sections


def section_environment(ctx: Context) -> dict:
    import importlib.metadata as md
    import platform

    import jax
    import torch

    versions = {}
    for pkg in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy", "safetensors", "torch",
                "transformers", "ml_dtypes"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            versions[pkg] = None
    versions["python"] = platform.python_version()
    devices = jax.devices()
    ctx.torch_device = "cuda" if (torch.cuda.is_available() and not ctx.args.cpu_smoke) else "cpu"
    if ctx.torch_device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False   # float32 references in float32
        torch.backends.cudnn.allow_tf32 = False
    out = {"jax_backend": jax.default_backend(), "jax_device_kind": devices[0].device_kind,
           "jax_device_count": len(devices), "jax_platform": devices[0].platform,
           "torch_device": ctx.torch_device, "torch_cuda": torch.version.cuda,
           "torch_device_name": torch.cuda.get_device_name(0) if ctx.torch_device == "cuda" else platform.processor(),
           "cpu_count": os.cpu_count(), "versions": versions,
           "xla_python_client_preallocate": os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE")}
    if jax.default_backend() == "cpu" and not ctx.args.cpu_smoke:
        out["warning"] = "no accelerator: JAX runs on CPU, the GPU shapes will mostly not fit the budget"
    return out


def section_matmul_peak(ctx: Context) -> dict:
    """bf16 matmul rate: x <- x @ b, `iters` times inside one jit (a chain XLA cannot shorten),
    timed after a warm-up call, best of 3; the largest size's rate is the run's reference."""
    import jax
    import jax.numpy as jnp

    sizes = []
    for n, iters in ctx.shapes["matmul"]:
        ka, kb = jax.random.split(jax.random.key(n))
        a = jax.random.normal(ka, (n, n), jnp.bfloat16)
        b = (jax.random.normal(kb, (n, n), jnp.float32) / math.sqrt(n)).astype(jnp.bfloat16)

        @jax.jit
        def chain(a, b, iters=iters):
            return jax.lax.fori_loop(0, iters, lambda i, x: jnp.dot(x, b), a)

        chain(a, b).block_until_ready()
        t = best_of(lambda: chain(a, b).block_until_ready(), 3)
        flops = 2.0 * n ** 3 * iters
        sizes.append({"n": n, "products": iters, "seconds": t, "tflops_per_s": flops / t / 1e12})
    ctx.peak_bf16 = max(s["tflops_per_s"] for s in sizes) * 1e12
    return {"dtype": "bfloat16", "sizes": sizes, "peak_tflops_per_s": ctx.peak_bf16 / 1e12}


def compare(got_logits, got_chosen, want_logits, want_chosen, mask, dtype: str) -> dict:
    """Routing agreement and logit differences on the valid tokens, against the stated tolerance."""
    import numpy as np

    valid = mask.reshape(-1).astype(bool)
    same = np.ones(valid.size, bool)
    per_layer, topk_agree = {}, {}
    for layer in sorted(want_chosen):
        g = np.sort(np.asarray(got_chosen[layer]).reshape(valid.size, -1), 1)
        w = np.sort(np.asarray(want_chosen[layer]).reshape(valid.size, -1), 1)
        row_same = (g == w).all(1)
        same &= row_same
        per_layer[layer] = float(row_same[valid].mean())
    got = np.asarray(got_logits, np.float32).reshape(valid.size, -1)
    want = np.asarray(want_logits, np.float32).reshape(valid.size, -1)
    diff = np.abs(got - want)
    scale = float(np.abs(want[valid]).max())
    both = valid & same
    max_same = float(diff[both].max()) if both.any() else float("inf")
    tol = TOL[dtype]
    limit = tol["logits_rel"] * (max(1.0, scale) if dtype == "float32" else scale)
    agreement = float(same[valid].mean())
    return {"routing_agreement_all_layers": agreement, "routing_agreement_per_layer": per_layer,
            "max_abs_logit": scale, "max_abs_diff_all_tokens": float(diff[valid].max()),
            "max_abs_diff_same_routing": max_same, "tolerance": {**tol, "logits_abs": limit},
            "routing_pass": agreement >= tol["routing_agreement_min"], "logits_pass": max_same <= limit,
            "pass": bool(agreement >= tol["routing_agreement_min"] and max_same <= limit and scale > 0.1)}


def bf16_errors(got, chosen, hf16, hf16_chosen, hf32, hf32_chosen, mask) -> dict:
    """How far moejax's and transformers' bfloat16 logits each are from transformers' float32 ones,
    on the valid tokens all three route identically: moejax in bfloat16 passes this check when its
    error is at most 1.25x transformers' own (the 3% rule of `compare` is the other way to pass)."""
    import numpy as np

    valid = mask.reshape(-1).astype(bool)
    same = valid.copy()
    for layer in hf32_chosen:
        ref = np.sort(np.asarray(hf32_chosen[layer]).reshape(valid.size, -1), 1)
        for other in (chosen, hf16_chosen):
            same &= (np.sort(np.asarray(other[layer]).reshape(valid.size, -1), 1) == ref).all(1)
    ref = np.asarray(hf32, np.float32).reshape(valid.size, -1)[same]
    err = {name: np.abs(np.asarray(x, np.float32).reshape(valid.size, -1)[same] - ref)
           for name, x in (("moejax", got), ("transformers", hf16))}
    if not same.any():
        return {"tokens": 0, "pass": False}
    out = {"tokens": int(same.sum()), "ratio_allowed": 1.25}
    for name, e in err.items():
        out[f"{name}_bf16_max_err"], out[f"{name}_bf16_mean_err"] = float(e.max()), float(e.mean())
    out["pass"] = bool(out["moejax_bf16_max_err"] <= 1.25 * out["transformers_bf16_max_err"])
    return out


def section_forward(ctx: Context, family: str, seed: int) -> dict:
    """float32 and bfloat16 forward of one random checkpoint against transformers' eager model:
    chosen experts and logits; moejax (jitted) and transformers (its defaults) timed."""
    import jax.numpy as jnp
    import numpy as np
    import torch

    from moejax import from_pretrained

    kw = ctx.shapes[family]
    path = ctx.tmp / family
    B, S = ctx.shapes["forward_batch"]
    repeat = ctx.shapes["repeat"]
    hf32 = make_checkpoint(ctx, family, kw, path, seed, "float32")
    cfg, counts = hf32.config, param_counts(hf32)
    ids, mask = padded_batch(kw["vocab_size"], B, S, seed)
    flops = forward_flops(cfg, counts, B, S)
    out = {"family": family, "config": kw, "batch": [B, S], "parameters": counts, "forward_flops": flops,
           "transformers_reference": "eager attention and experts, on " + ctx.torch_device}
    ids_j, mask_j = jnp.asarray(ids), jnp.asarray(mask)
    for dtype in ("float32", "bfloat16"):
        hf = hf32 if dtype == "float32" else load_hf(ctx, family, path, dtype)
        want, want_chosen = hf_reference(ctx, hf, ids, mask)
        if dtype == "bfloat16":
            del hf
            release_torch(ctx)
        model = from_pretrained(path, dtype=getattr(jnp, dtype))
        forward = model.jitted()
        precision = highest_precision if dtype == "float32" else contextlib.nullcontext

        def run(routing=False, forward=forward, precision=precision):
            with precision():
                return forward(ids_j, mask_j, return_routing=routing)

        t0 = time.perf_counter()
        res = run(True)
        got = np.asarray(res.logits_BSV.astype(jnp.float32))
        t_first = time.perf_counter() - t0
        chosen = {l: np.asarray(r.expert_idx_TK) for l, r in res.routing.items()}
        entry = compare(got, chosen, want, want_chosen, mask, dtype)
        if dtype == "float32":
            ref32 = (want, want_chosen)
        else:
            entry["against_float32_reference"] = bf16_errors(got, chosen, want, want_chosen, *ref32, mask)
            entry["logits_pass"] = bool(entry["logits_pass"] or entry["against_float32_reference"]["pass"])
            entry["pass"] = bool(entry["routing_pass"] and entry["logits_pass"] and entry["max_abs_logit"] > 0.1)
        entry["moe_layers_compared"] = sorted(want_chosen)
        entry["moe_layers_match"] = sorted(chosen) == sorted(want_chosen)
        entry["pass"] = bool(entry["pass"] and entry["moe_layers_match"] and len(chosen) > 0)
        t = best_of(lambda: run(True).logits_BSV.block_until_ready(), repeat)   # the program compiled above
        entry["moejax"] = rate(ctx, f"{family} forward moejax {dtype}", flops, t, first_call_s=t_first,
                               tokens_per_s=B * S / t,
                               **({"matmul_precision": "highest"} if dtype == "float32" else {}))
        out[dtype] = entry
        del model, forward, res
    # transformers as its users run it (default attention and experts implementations), bf16
    del hf32
    release_torch(ctx)
    hf = load_hf(ctx, family, path, "bfloat16", eager=False)
    ids_t = torch.as_tensor(ids, dtype=torch.long, device=ctx.torch_device)
    mask_t = torch.as_tensor(mask, device=ctx.torch_device)

    def hf_run():
        with torch.inference_mode():
            hf(ids_t, attention_mask=mask_t)
        torch_sync(ctx)

    hf_run()
    t_hf = best_of(hf_run, repeat)
    out["bfloat16"]["transformers"] = rate(
        ctx, f"{family} forward transformers bfloat16", flops, t_hf, tokens_per_s=B * S / t_hf,
        implementation=implementations(hf))
    out["bfloat16"]["moejax_speedup"] = t_hf / out["bfloat16"]["moejax"]["seconds"]
    del hf
    release_torch(ctx)
    out["pass"] = bool(out["float32"]["pass"] and out["bfloat16"]["pass"])
    return out


def dispatch_inputs(T: int, H: int, E: int, K: int, F: int, dtype):
    """One MoE layer's inputs (tokens, softmax top-k routing, expert weights [E, H, F] / [E, F, H]),
    made in one compiled program."""
    import jax

    return jax.jit(_dispatch_inputs, static_argnums=range(6))(T, H, E, K, F, dtype)


def _dispatch_inputs(T, H, E, K, F, dtype):
    import jax
    import jax.numpy as jnp

    k = jax.random.split(jax.random.key(7), 5)
    x = jax.random.normal(k[0], (T, H), jnp.float32)
    logits = x @ (jax.random.normal(k[1], (H, E)) * (2.0 / math.sqrt(H)))
    gate_all, idx = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), K)
    gate = gate_all / gate_all.sum(-1, keepdims=True)
    w = {"gate": jax.random.normal(k[2], (E, H, F)) / math.sqrt(H),
         "up": jax.random.normal(k[3], (E, H, F)) / math.sqrt(H),
         "down": jax.random.normal(k[4], (E, F, H)) / math.sqrt(F)}
    return x.astype(dtype), idx, gate, {n: v.astype(dtype) for n, v in w.items()}


def section_dispatch(ctx: Context) -> dict:
    """The `ragged` backend against the `dense` oracle on one Moonlight-shaped MoE layer: values in
    float32 (highest precision) and bfloat16, and the time of dense, sorted and ragged (bf16)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from moejax.moe import dispatch

    layer = ctx.shapes.get("dispatch_layer", MOONLIGHT_LAYER)
    H, E, K, F = layer["hidden"], layer["experts"], layer["top_k"], layer["intermediate"]
    T = ctx.shapes["dispatch_tokens"]
    fns = {b: jax.jit(lambda x, i, g, w, b=b: dispatch.dispatch(x, i, g, w, dispatch.swiglu, backend=b,
                                                                forward_only=True))
           for b in ("dense", "sorted", "ragged")}
    out = {"layer": {**layer, "tokens": T}}
    for dtype in ("float32", "bfloat16"):
        x, idx, gate, w = dispatch_inputs(T, H, E, K, F, getattr(jnp, dtype))
        with highest_precision() if dtype == "float32" else contextlib.nullcontext():
            dense = np.asarray(fns["dense"](x, idx, gate, w).astype(jnp.float32))
            ragged = np.asarray(fns["ragged"](x, idx, gate, w).astype(jnp.float32))
        rel = float(np.abs(ragged - dense).max() / np.abs(dense).max())
        out[f"values_{dtype}"] = {"max_abs_diff_rel_to_max": rel, "max_abs_dense": float(np.abs(dense).max()),
                                  "tolerance": DISPATCH_TOL[dtype], "pass": rel <= DISPATCH_TOL[dtype]}
    x, idx, gate, w = dispatch_inputs(T, H, E, K, F, jnp.bfloat16)
    routed_flops = 2.0 * 3 * T * K * H * F
    timings = {}
    for b, fn in fns.items():
        fn(x, idx, gate, w).block_until_ready()
        t = best_of(lambda fn=fn: fn(x, idx, gate, w).block_until_ready(), ctx.shapes["repeat"])
        timings[b] = rate(ctx, f"dispatch {b} bfloat16 (routed FLOPs)", routed_flops, t,
                          tokens_per_s=T / t, **({"flops_done": routed_flops * E / K} if b == "dense" else {}))
    out["time_bfloat16"] = timings
    out["ragged_speedup_over_dense"] = timings["dense"]["seconds"] / timings["ragged"]["seconds"]
    out["ragged_speedup_over_sorted"] = timings["sorted"]["seconds"] / timings["ragged"]["seconds"]
    out["pass"] = bool(out["values_float32"]["pass"] and out["values_bfloat16"]["pass"])
    return out


def moonlight_checkpoint(ctx: Context):
    """(path, parameter counts, transformers config) of the Moonlight-shaped checkpoint: Moonlight-
    16B-A3B's per-layer shapes and routing (DeepSeek-V3 architecture: plain q_proj, MLA, 64 experts
    top 6, 2 shared, first layer dense), 3 layers, vocabulary cut; written once in the run."""
    if ctx.moonlight is None:
        from moejax.models.deepseek_v3.presets import PRESETS

        kw = {k: v for k, v in PRESETS["moonlight-16b-a3b"].items() if k not in MOONLIGHT_KEYS_DROPPED}
        kw.update(ctx.shapes["moonlight"])
        path = ctx.tmp / "moonlight3"
        t0 = time.perf_counter()
        hf = make_checkpoint(ctx, "deepseek_v3", kw, path, 3, ctx.shapes["dtype"])
        counts, cfg = param_counts(hf), hf.config
        del hf
        release_torch(ctx)
        ctx.moonlight = (path, counts, cfg, {"config": kw, "parameters": counts, "dtype": ctx.shapes["dtype"],
                                             "written_s": time.perf_counter() - t0})
    return ctx.moonlight


def section_scoring(ctx: Context) -> dict:
    """calibrate() on the Moonlight-shaped checkpoint, per dispatch backend: the steady rate is
    (N - 1) batches of tokens over t(N batches) - t(1 batch) (each call compiles its forward
    again: the difference leaves compilation and fixed costs out); the forward alone beside it."""
    import jax.numpy as jnp
    import numpy as np

    from moejax import from_pretrained
    from moejax.scoring.observe import calibrate

    path, counts, cfg, info = moonlight_checkpoint(ctx)
    sc = ctx.shapes["scoring"]
    n, B, S = sc["batches"], sc["batch"], sc["seq"]
    rng = np.random.default_rng(11)
    batches = [(rng.integers(0, cfg.vocab_size, size=(B, S)).astype(np.int32), np.ones((B, S), np.int32))
               for _ in range(n)]
    per_batch_tokens = B * S
    E, K = top_k_of(cfg)
    n_moe = cfg.num_hidden_layers - cfg.first_k_dense_replace
    # the forward, then the scoring pass's own expert calls: each routed pair's output again per MoE layer
    flops_batch = (forward_flops(cfg, counts, B, S)
                   + n_moe * 2.0 * 3 * per_batch_tokens * K * cfg.hidden_size * cfg.moe_intermediate_size)
    out = {"checkpoint": info, "tokens_per_batch": per_batch_tokens, "batches": n, "dtype": ctx.shapes["dtype"],
           "flops_per_batch_counted": flops_batch, "backends": {}}
    counts_seen = {}
    for backend in ctx.shapes["backends"]:
        model = from_pretrained(path, dtype=getattr(jnp, ctx.shapes["dtype"]), backend=backend)
        t0 = time.perf_counter()
        calibrate(model, batches[:1])   # compiles the per-layer statistics kernels (kept) and a forward
        t_cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        calibrate(model, batches[:1])
        t1 = time.perf_counter() - t0
        t0 = time.perf_counter()
        stats = calibrate(model, batches)
        tn = time.perf_counter() - t0
        steady, n_timed, method = difference(t1, tn, 1, n)
        expect = n * per_batch_tokens * K
        counted = {l: int(np.asarray(s.counts_E).sum()) for l, s in stats.items()}
        counts_seen[backend] = {l: np.asarray(s.norm_sum_E, np.float64) for l, s in stats.items()}
        forward = model.jitted()
        ids_j, mask_j = jnp.asarray(batches[0][0]), jnp.asarray(batches[0][1])
        forward(ids_j, mask_j).logits_BSV.block_until_ready()
        t_fwd = best_of(lambda: forward(ids_j, mask_j).logits_BSV.block_until_ready(), ctx.shapes["repeat"])
        out["backends"][backend] = {
            "first_call_s": t_cold, "one_batch_s": t1, "all_batches_s": tn,
            "steady": rate(ctx, f"scoring pass {backend} {ctx.shapes['dtype']}", flops_batch * n_timed, steady,
                           tokens_per_s=n_timed * per_batch_tokens / steady, method=method),
            "whole_call_tokens_per_s": n * per_batch_tokens / tn,
            "forward_alone": rate(ctx, f"Moonlight-3L forward {backend} {ctx.shapes['dtype']}",
                                  forward_flops(cfg, counts, B, S), t_fwd, tokens_per_s=per_batch_tokens / t_fwd),
            "moe_layers": sorted(stats), "routed_pairs_counted": counted,
            "counts_pass": all(c == expect for c in counted.values()) and len(counted) == n_moe}
        del model, forward, stats
    if len(counts_seen) > 1:
        a, b = (counts_seen[k] for k in ctx.shapes["backends"][:2])
        out["norm_sums_max_rel_diff_between_backends"] = max(
            float(np.abs(a[l] - b[l]).max() / max(np.abs(b[l]).max(), 1e-30)) for l in a)
    out["pass"] = all(v["counts_pass"] for v in out["backends"].values())
    return out


def section_decode(ctx: Context) -> dict:
    """Greedy decode on the Moonlight-shaped checkpoint: moejax's Generator against transformers'
    generate (its default implementations), both in the run's dtype. Decode tokens per second =
    batch x (new - 1) over t(new tokens) - t(1 token), so the prompt's prefill is left out."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    from moejax import from_pretrained
    from moejax.inference.generate import Generator

    path, counts, cfg, info = moonlight_checkpoint(ctx)
    d = ctx.shapes["decode"]
    B, P, new = d["batch"], d["prompt"], d["new"]
    dtype = ctx.shapes["dtype"]
    backend = "sorted" if jax.default_backend() == "cpu" else "ragged"   # ragged_dot is dense on XLA:CPU
    rng = np.random.default_rng(5)
    ids = rng.integers(1, cfg.vocab_size, size=(B, P)).astype(np.int32)
    mask = np.ones_like(ids)
    if B > 1:
        mask[1, :P // 4] = 0   # left padding, as generation batches are laid out

    model = from_pretrained(path, dtype=getattr(jnp, dtype), backend=backend)
    gen = Generator(model)

    def mj(n):
        return gen(ids, mask, max_new_tokens=n)

    t0 = time.perf_counter()
    got = mj(new)
    t_cold = time.perf_counter() - t0
    mj(1)
    hf = load_hf(ctx, "deepseek_v3", path, dtype, eager=False)
    ids_t = torch.as_tensor(ids, dtype=torch.long, device=ctx.torch_device)
    mask_t = torch.as_tensor(mask, device=ctx.torch_device)

    def hfg(n):
        with torch.inference_mode():
            r = hf.generate(input_ids=ids_t, attention_mask=mask_t, max_new_tokens=n, min_new_tokens=n,
                            do_sample=False, eos_token_id=None, pad_token_id=0)
        return r.cpu().numpy()

    want = hfg(new)
    hfg(1)
    repeat = ctx.shapes["repeat"]
    t_mj = [best_of(lambda: mj(1), repeat), best_of(lambda: mj(new), repeat)]
    t_hf = [best_of(lambda: hfg(1), repeat), best_of(lambda: hfg(new), repeat)]
    mj_s, mj_n, mj_method = difference(t_mj[0], t_mj[1], B, B * new)
    hf_s, hf_n, hf_method = difference(t_hf[0], t_hf[1], B, B * new)
    per_token = decode_flops_per_token(cfg, counts, P + new / 2)
    equal = (np.asarray(got)[:, P:] == want[:, P:])
    out = {"checkpoint": info, "dtype": dtype, "batch": B, "prompt": P, "new_tokens": new, "moejax_backend": backend,
           "moejax": rate(ctx, f"decode moejax {dtype}", per_token * mj_n, mj_s, tokens_per_s=mj_n / mj_s,
                          method=mj_method, prefill_plus_one_s=t_mj[0], all_tokens_s=t_mj[1], first_call_s=t_cold),
           "transformers": rate(ctx, f"decode transformers {dtype}", per_token * hf_n, hf_s,
                                tokens_per_s=hf_n / hf_s, method=hf_method, prefill_plus_one_s=t_hf[0],
                                all_tokens_s=t_hf[1],
                                implementation=implementations(hf)),
           "flops_per_token_counted": per_token,
           "tokens_equal_fraction": float(equal.mean()),
           "first_difference_per_row": [int(np.argmax(~r)) if (~r).any() else new for r in equal],
           "shapes_match": list(np.asarray(got).shape) == list(want.shape)}
    out["moejax_speedup"] = hf_s / mj_s
    out["pass"] = bool(out["shapes_match"])
    del hf, model, gen
    release_torch(ctx)
    return out


def summary(report: Report, ctx: Context) -> dict:
    sections = report.data["sections"]
    return {"sections_ok": [k for k, v in sections.items() if v.get("status") == "ok"],
            "sections_failed": [k for k, v in sections.items() if v.get("status") == "error"],
            "sections_skipped": [k for k, v in sections.items() if v.get("status") == "skipped"],
            "checks_passed": {k: v.get("pass") for k, v in sections.items() if "pass" in v},
            "peak_bf16_tflops_per_s": None if not ctx.peak_bf16 else ctx.peak_bf16 / 1e12,
            "rates": [{k: r[k] for k in ("what", "seconds", "tflops_per_s", "fraction_of_bf16_peak")}
                      | ({"tokens_per_s": r["tokens_per_s"]} if "tokens_per_s" in r else {}) for r in ctx.rates]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="device_check.json", help="the JSON written (atomically, after every section)")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU (JAX_PLATFORMS=cpu)")
    ap.add_argument("--budget-s", type=float, default=450.0,
                    help="stop starting sections once this many seconds have passed (default 450: the whole run "
                         "within 8 minutes)")
    ap.add_argument("--tmp", default=None, help="where the checkpoints are written (default: the system's temp)")
    args = ap.parse_args(argv)
    if args.cpu_smoke:
        os.environ["JAX_PLATFORMS"] = "cpu"
    # JAX allocates what it needs (not 75% of the GPU up front): torch shares the device.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    mode = "smoke" if args.cpu_smoke else "gpu"
    shapes = SHAPES[mode]
    report = Report(Path(args.out), args.budget_s, mode)
    report.write()
    # JAX first: it initialises its backend (and loads its CUDA libraries) before torch loads its own.
    import jax

    jax.devices()
    with tempfile.TemporaryDirectory(prefix="moejax-device-check-", dir=args.tmp) as tmp:
        # A persistent compilation cache for this run only: `calibrate` builds a new jitted forward
        # per call, which then loads the program compiled for the same shapes instead of compiling it.
        jax.config.update("jax_compilation_cache_dir", str(Path(tmp) / "xla-cache"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        report.data["persistent_compilation_cache"] = "this run's temporary folder"
        ctx = Context(args, shapes, Path(tmp))
        need = shapes["need_s"]
        report.run("environment", lambda: section_environment(ctx))
        report.run("matmul_peak", lambda: section_matmul_peak(ctx), need["matmul_peak"])
        report.run("forward_deepseek_v3", lambda: section_forward(ctx, "deepseek_v3", 0), need["forward_deepseek_v3"])
        report.run("forward_qwen3_moe", lambda: section_forward(ctx, "qwen3_moe", 1), need["forward_qwen3_moe"])
        report.run("dispatch_ragged_vs_dense", lambda: section_dispatch(ctx), need["dispatch_ragged_vs_dense"])
        report.run("scoring_pass", lambda: section_scoring(ctx), need["scoring_pass"])
        report.run("decode", lambda: section_decode(ctx), need["decode"])
        report.data["summary"] = summary(report, ctx)
    report.data["hydra_imported"] = "hydra" in sys.modules
    report.data["pandas_imported"] = "pandas" in sys.modules
    report.data["complete"] = True
    report.write()
    s = report.data["summary"]
    print(f"[device_check] wrote {args.out} in {report.data['elapsed_s']:.0f} s: ok {s['sections_ok']}, "
          f"failed {s['sections_failed']}, skipped {s['sections_skipped']}, checks {s['checks_passed']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

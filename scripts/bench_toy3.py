"""Benchmark toy3: moejax (JAX) against a plain numpy implementation of the same experiment.

    python scripts/bench_toy3.py                 # the full run: seeds=8, 6,000 + 6,000 tokens, 300 steps
    python scripts/bench_toy3.py --seeds 2       # quicker

Prints, all measured in this run on this machine:
  - numpy baseline (per-expert loop over routed tokens) vs moejax compiled, and vs moejax with
    compilation included (cold: the persistent compilation cache is off for that run);
  - the balancing loop alone (the hot spot), numpy vs JAX;
  - achieved FLOP/s of the routed-expert work (sorted grouped-matmul backend) against a dense
    matmul rate measured in the same run.
The numpy implementation is also what tests/test_toy3.py checks the experiment against. Both sides
run the pruning scores only (merges=(), eq6_pairs=0): the merging baselines are checked against
numpy in tests/test_toy3_merging.py.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _timing import best_of  # noqa: E402


# --------------------------------------------------------------------------------------------
# The plain numpy implementation (SPEC sections 1-4), written from the definitions.

def np_route(sel_TE, scores_TE, top_k):
    """Top-k of `sel` (stable: ties to the lower index), gates from the unbiased scores, renormalised."""
    idx = np.argsort(-sel_TE, axis=1, kind="stable")[:, :top_k]
    gate = np.take_along_axis(scores_TE, idx, axis=1)
    return idx, gate / (gate.sum(axis=1, keepdims=True) + 1e-20)


def np_balance(scores_TE, steps, rate, top_k):
    bias = np.zeros(scores_TE.shape[1], np.float32)
    for _ in range(steps):
        idx, _ = np_route(scores_TE + bias, scores_TE, top_k)
        load = np.bincount(idx.ravel(), minlength=scores_TE.shape[1])
        bias = (bias - np.float32(rate) * np.sign(load - load.mean())).astype(np.float32)
    return bias


def np_routed_output(x_TD, idx_TK, gate_TK, w1, w2):
    """Per-expert loop over routed tokens: y = sum_k g f_idx(x); also each pair's ||f||."""
    y = np.zeros_like(x_TD)
    norms = np.zeros(idx_TK.shape, np.float32)
    for j in range(w1.shape[0]):
        tok, slot = np.nonzero(idx_TK == j)
        if tok.size == 0:
            continue
        f = np.maximum(x_TD[tok] @ w1[j], 0) @ w2[j]
        norms[tok, slot] = np.linalg.norm(f, axis=1)
        np.add.at(y, tok, gate_TK[tok, slot, None] * f)
    return y, norms


def np_scores(name, counts, gate_norm_sum, norm_sum, router, bias, mean_input, seed):
    router = router.astype(np.float64)
    return {
        "frequency": lambda: counts,
        "reap": lambda: np.where(counts > 0, gate_norm_sum / np.maximum(counts, 1), 0.0),
        "ean": lambda: norm_sum,
        "w_mean": lambda: router @ mean_input,
        "bias": lambda: -bias.astype(np.float64),
        "signed": lambda: router.sum(axis=1),
        "l1": lambda: np.abs(router).sum(axis=1),
        "random": lambda: np.random.default_rng([seed, 0]).random(router.shape[0]),
    }[name]()


def np_keep_mask(score, keep):
    mask = np.zeros(score.shape[0], bool)
    mask[np.argsort(-score, kind="stable")[:keep]] = True
    return mask


def numpy_toy3(cfg, inputs, seeds):
    """The toy3 experiment in numpy on the given drawn inputs; returns the same tidy rows as moejax."""
    import pandas as pd

    keeps = cfg.keep_counts()
    rows = []
    for seed, inp in zip(seeds, inputs):
        router, w1, w2 = inp["router"], inp["w1"], inp["w2"]
        for o, offset in enumerate(cfg.offsets):
            x_cal, x_held = inp["x_cal"][o], inp["x_held"][o]
            s_cal = 1 / (1 + np.exp(-(x_cal @ router.T)))
            s_held = 1 / (1 + np.exp(-(x_held @ router.T)))
            balanced = np_balance(s_cal, cfg.balance_steps, cfg.balance_rate, cfg.top_k)
            for load in cfg.loads:
                bias = balanced if load == "balanced" else np.zeros_like(balanced)
                base = dict(offset=offset, load=load, seed=int(seed))
                idx, gate = np_route(s_cal + bias, s_cal, cfg.top_k)
                _, norms = np_routed_output(x_cal, idx, gate, w1, w2)
                counts = np.bincount(idx.ravel(), minlength=router.shape[0]).astype(np.float64)
                gns = np.bincount(idx.ravel(), weights=(gate * norms).ravel().astype(np.float64),
                                  minlength=router.shape[0])
                ns = np.bincount(idx.ravel(), weights=norms.ravel().astype(np.float64), minlength=router.shape[0])
                usage = np.sort(counts)[::-1]
                rows.append({**base, "score": None, "keep": None, "metric": "top16_share",
                             "value": usage[:16].sum() / usage.sum()})
                idx_h, gate_h = np_route(s_held + bias, s_held, cfg.top_k)
                y, _ = np_routed_output(x_held, idx_h, gate_h, w1, w2)
                for name in cfg.scores:
                    score = np_scores(name, counts, gns, ns, router, bias, x_cal.mean(0, dtype=np.float64), seed)
                    for keep in keeps:
                        kept = np_keep_mask(score, keep)
                        sel = np.where(kept, s_held + bias, -np.inf)
                        y_p, _ = np_routed_output(x_held, *np_route(sel, s_held, cfg.top_k), w1, w2)
                        err = ((y_p - y) ** 2).sum(1)
                        ref = (y ** 2).sum(1)
                        row = {**base, "score": name, "keep": keep}
                        rows.append({**row, "metric": "overlap_frequency",
                                     "value": float((kept & np_keep_mask(counts, keep)).sum())})
                        rows.append({**row, "metric": "rel_error", "value": err.sum() / ref.sum()})
                        rows.append({**row, "metric": "rel_error_median", "value": float(np.median(err / ref))})
    return pd.DataFrame(rows)


# --------------------------------------------------------------------------------------------
# Timing


def _cold_run_seconds(seeds: int) -> float:
    """moejax's toy3 in a fresh process with the persistent cache off: compilation included."""
    code = ("import time; t=time.perf_counter(); from moejax.experiments import toy3; "
            f"toy3.run(toy3.Toy3Config(seeds={seeds}, merges=(), eq6_pairs=0)); print(time.perf_counter()-t)")
    env = {**os.environ, "MOEJAX_JAX_CACHE": "", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=8)
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from moejax.experiments import toy3
    from moejax.models.toy import ToyMoE
    from moejax.moe import dispatch
    from moejax.moe.balancing import balance_bias

    cfg = toy3.Toy3Config(seeds=args.seeds, merges=(), eq6_pairs=0)  # as the numpy baseline: pruning only
    seeds = list(range(args.seeds))
    print(f"toy3 benchmark: seeds={cfg.seeds}, {cfg.n_calib}+{cfg.n_heldout} tokens, {cfg.balance_steps} "
          f"balancing steps, keeps {cfg.keep_counts()}, scores {list(cfg.scores)}; "
          f"{os.cpu_count()} CPU cores, jax {jax.__version__} on {jax.default_backend()}")

    cold = _cold_run_seconds(args.seeds)
    toy3.run(cfg)  # compile in this process
    warm = best_of(lambda: toy3.run(cfg), repeat=2)
    inputs = toy3.draw_inputs(cfg, seeds)
    t_np = best_of(lambda: numpy_toy3(cfg, inputs, seeds), repeat=1)
    print(f"\nfull run   numpy {t_np:7.2f} s | moejax compiled {warm:6.2f} s  -> {t_np / warm:5.1f}x"
          f" | moejax incl. compilation {cold:6.2f} s -> {t_np / cold:5.1f}x")

    # The balancing loop alone: every (seed, offset) balanced, 300 steps.
    s_all = [1 / (1 + np.exp(-(inp["x_cal"][o] @ inp["router"].T))) for inp in inputs for o in range(2)]
    t_bal_np = best_of(lambda: [np_balance(s, cfg.balance_steps, cfg.balance_rate, cfg.top_k) for s in s_all],
                       repeat=1)
    logits = jnp.asarray(np.stack([np.log(s / (1 - s)) for s in s_all]))
    bal = jax.jit(lambda lg: balance_bias(lg, ToyMoE.router_cfg_for(cfg.top_k), cfg.balance_steps, cfg.balance_rate))
    bal(logits).block_until_ready()
    t_bal = best_of(lambda: bal(logits).block_until_ready(), repeat=2)
    print(f"balancing  numpy {t_bal_np:7.2f} s | moejax {t_bal:6.2f} s  -> {t_bal_np / t_bal:5.1f}x"
          f"   ({len(s_all)} loops x {cfg.balance_steps} steps x {cfg.n_calib} tokens)")

    # Routed-expert FLOP/s: the sorted grouped-matmul backend on one calibration pass per condition.
    model = ToyMoE(cfg.d_model, cfg.d_hidden, cfg.n_experts, cfg.top_k, rngs=nnx.Rngs(0))
    x = jnp.asarray(inputs[0]["x_cal"][0])
    w = model.expert_weights()
    idx = model.route(x).expert_idx_TK
    routed = jax.jit(lambda x, i, w: dispatch.pair_outputs(x, i, w, dispatch.relu_mlp, "sorted"))
    routed(x, idx, w).block_until_ready()
    t_routed = best_of(lambda: routed(x, idx, w).block_until_ready(), repeat=5)
    flops = 2 * 2 * idx.size * cfg.d_model * cfg.d_hidden
    a = jax.random.normal(jax.random.key(0), (1024, 1024))
    mm = jax.jit(lambda a: a @ a)
    mm(a).block_until_ready()
    t_mm = best_of(lambda: mm(a).block_until_ready(), repeat=5)
    rate_routed, rate_dense = flops / t_routed / 1e9, 2 * 1024 ** 3 / t_mm / 1e9
    print(f"routed experts {rate_routed:6.1f} GFLOP/s (sorted backend, {idx.size} pairs) vs dense matmul "
          f"{rate_dense:6.1f} GFLOP/s -> {rate_routed / rate_dense:.2f} of dense")


if __name__ == "__main__":
    main()

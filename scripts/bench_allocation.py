"""EvoESAP's fitness and search (`allocation=evo_esap`): a generation's candidates scored in one walk
over the layers against the same candidates scored one at a time (each its own walk, every layer
read again, the unpruned stream recomputed), in the same run; then a whole default search.

    python scripts/bench_allocation.py [--model moonlight|skills|both] [--skills PATH] [--tokens 1024]

"moonlight": a synthetic Moonlight-16B-A3B-shaped checkpoint of 4 decoder layers (1 dense + 3
MoE, 64 experts of 1408, bfloat16 on disk, the vocabulary cut to 32,768; `bench_real`'s);
"skills": the trained skills model (`experiment=train_skills`, DeepSeek-V3 family; default
$MOEJAX_HOME/models/skills-deepseek_v3, skipped if absent). Reported: candidates per second each
way and their ratio; the FLOPs a candidate needs (its stream through every decoder layer, as
computed: attention over the whole sequence, router, top-k and shared experts; and the output
head over the vocabulary, twice: log-sum-exp and ESAP) against the dense float32 matmul rate of
the same run; the whole search's time with EvoESAP's default settings (12 candidates, then 4
generations of 8 mutations, a candidate scored once).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_real import dense_rate, layer_flops, moonlight_checkpoint  # noqa: E402


def candidate_flops(cfg, tokens: int, seq_len: int) -> tuple[float, float]:
    """(layers, head): the FLOPs one candidate stream needs over `tokens` fitness tokens through
    every decoder layer, and through the head twice (the log-sum-exp pass and the ESAP pass)."""
    layers = sum(layer_flops(cfg, seq_len, moe=cfg.is_moe_layer(l)) for l in range(cfg.num_hidden_layers))
    return tokens * layers, tokens * 2 * 2.0 * cfg.hidden_size * cfg.vocab_size


def measure(path: Path, tokens: int, seq_len: int, keep: float, dense: float, label: str,
            search_only: bool = False) -> None:
    import jax.numpy as jnp

    from moejax.allocation import ALLOCATIONS, Budget
    from moejax.evaluation.esap_fitness import EsapFitness
    from moejax.hf.model_io import open_checkpoint
    from moejax.scoring.select import resolve_keep

    ckpt = open_checkpoint(path)
    cfg = ckpt.config
    rng = np.random.default_rng(1)
    ids = rng.integers(0, min(cfg.vocab_size, 256), size=(max(1, tokens // seq_len), seq_len)).astype(np.int32)
    layers = list(cfg.moe_layers)
    ranking = {l: rng.standard_normal(cfg.n_experts) for l in layers}
    k = resolve_keep(keep, cfg.n_experts, cfg.num_experts_per_tok)
    budget = Budget.of(k, {l: cfg.n_experts for l in layers}, cfg.num_experts_per_tok)
    method = ALLOCATIONS.parse("evo_esap")
    generation = []   # the first generation's candidates: the 12 patterns
    method.search(budget, lambda kept: (generation.extend(kept.tolist()), np.zeros(len(kept)))[1])
    candidates = np.asarray(generation[:12])
    print(f"{label}: {len(layers)} MoE layers of {cfg.n_experts} experts, keep {k}, {ids.size} fitness tokens, "
          f"vocabulary {cfg.vocab_size}")
    if not search_only:
        one_generation(ckpt, ids, ranking, layers, candidates, seq_len, dense)
    search = ALLOCATIONS.parse("evo_esap")
    scorer = EsapFitness(ckpt, ids, ranking, layers, batch_size=max(1, 2048 // seq_len), dtype=jnp.float32)
    t0 = time.perf_counter()
    run = search.search(budget, scorer)
    total = time.perf_counter() - t0
    print(f"  the default search: {run['evaluated']} candidates in {total:6.1f} s ({run['evaluated'] / total:.2f} "
          f"candidates/s, compilation of each new generation size included), best ESAP {run['best_score']:.4f}, "
          f"counts {run['counts']}")


def one_generation(ckpt, ids, ranking, layers, candidates, seq_len: int, dense: float) -> None:
    """A generation's candidates in one walk against one walk each, and the walk's FLOP rate."""
    import jax.numpy as jnp

    from moejax.evaluation.esap_fitness import EsapFitness

    cfg = ckpt.config
    fitness = EsapFitness(ckpt, ids, ranking, layers, batch_size=max(1, 2048 // seq_len), dtype=jnp.float32)
    fitness(candidates[:1])   # compile (one candidate) and warm the page cache
    fitness(candidates)       # compile (the generation's size)
    t0 = time.perf_counter()
    together = fitness(candidates)
    t_together = time.perf_counter() - t0
    t0 = time.perf_counter()
    apart = np.concatenate([fitness(candidates[i:i + 1]) for i in range(len(candidates))])
    t_apart = time.perf_counter() - t0
    assert np.allclose(together, apart, atol=1e-5), (together, apart)
    flops = candidate_flops(cfg, ids.size, seq_len)
    n = len(candidates)
    print(f"  a generation of {n} candidates in one walk: {t_together:6.2f} s = {n / t_together:6.2f} candidates/s; "
          f"one walk each: {t_apart:6.2f} s = {n / t_apart:6.2f} candidates/s ({t_apart / t_together:.2f}x)")
    rate = (n * sum(flops) + flops[1]) / t_together / 1e9   # the head also reads the unpruned stream
    print(f"  {sum(flops) / 1e9:.1f} GFLOP per candidate stream; one walk: {rate:.1f} GFLOP/s = {rate / dense:.0%} of "
          f"the dense float32 matmul rate ({dense:.1f} GFLOP/s, same run)")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["moonlight", "skills", "both"], default="both")
    parser.add_argument("--skills", default=None)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--search-only", action="store_true", help="only the default search (not the generation's two ways)")
    args = parser.parse_args()
    dense = dense_rate()
    if args.model in ("skills", "both"):
        home = Path(os.environ.get("MOEJAX_HOME", Path.home() / ".cache" / "moejax"))
        path = Path(args.skills) if args.skills else home / "models" / "skills-deepseek_v3"
        if (path / "config.json").is_file():
            measure(path, args.tokens, 256, 0.5, dense, f"skills model {path}", args.search_only)
        else:
            print(f"skills model: {path} absent (python -m moejax.run experiment=train_skills)")
    if args.model in ("moonlight", "both"):
        with tempfile.TemporaryDirectory(dir=os.environ.get("MOEJAX_BENCH_DIR")) as tmp:
            path = Path(tmp) / "moonlight"
            moonlight_checkpoint(path, layers=4)
            measure(path, args.tokens, 256, 0.5, dense, "Moonlight shapes, 4 layers", args.search_only)


if __name__ == "__main__":
    main()

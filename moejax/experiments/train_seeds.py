"""Several seeds of one training in one job: `python -m moejax.run experiment=train_skills seeds=4`
trains seeds seed .. seed + 3 and saves seed k's model at <model.path>/seed-<k>, each exactly the
model a single-seed run of that seed gives (each seed's run is `train_tiny.train_one`, unchanged).

How: `workers` processes at once (default: one per core this process may use), each pinned to its
own core before JAX starts, taking the next seed when it finishes one. This is what measured
fastest for the skills models on 2 CPU cores (docs/benchmarks.md, "Training several seeds"):

- one process, the seeds vectorised (`jax.vmap` over a stacked state, as toy3 does): 1.05x four
  sequential steps; the step's matmuls are small (hidden 128, experts 64 wide) and a batch of them
  runs no faster per matrix than one;
- one process per core, a seed each: 1.6x (0.66 s per step per core against 0.53 s for one
  process on both cores): two cores shared by one small program leave each idle much of the time.

Each seed's resume, checks and record are its own (train_tiny's); the job's results are every
seed's rows with a `seed` column, and its timings every seed's plus the wall time, the FLOPs of
all seeds, the achieved rate and the dense matmul rate of this machine measured at the end.
"""

from __future__ import annotations

import concurrent.futures
import io
import logging
import time
from pathlib import Path

from moejax.errors import ConfigError
from moejax.parallel import cores
from moejax.training.config import TrainTinyConfig

log = logging.getLogger(__name__)


def check_parent(cfg: TrainTinyConfig) -> None:
    """model.path holds the seed-<k> folders: it may be absent or a folder, never a file, a link
    or a checkpoint (a config.json there: a model someone reads)."""
    out = Path(cfg.path).expanduser()
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise ConfigError(f"{out}: model.path must be a folder (seeds={cfg.seeds} writes seed-<k> folders in it)")
    if (out / "config.json").exists():
        raise ConfigError(f"{out}: model.path holds a checkpoint (config.json); seeds={cfg.seeds} writes seed-<k> "
                          "folders beside it: choose another model.path")


def run_seeds(cfg: TrainTinyConfig, progress=None):
    """Every seed's training (module docstring); returns (tidy results with a seed column, timings)."""
    import pandas as pd

    from moejax.experiments import train_tiny

    check_parent(cfg)
    runs = cfg.seed_configs()
    for one in runs:   # every seed's output checked before any training
        train_tiny.check_output(one)
    n_workers = cfg.workers or min(len(runs), len(cores.available_cores()))
    t0 = time.perf_counter()
    results = {}
    if n_workers == 1:
        for one in runs:
            results[one.seed] = train_tiny.train_one(one)
            if progress:
                progress(1)
    else:
        results = _in_workers(runs, n_workers, progress)
    wall = time.perf_counter() - t0
    frames = []
    for seed, (df, _) in sorted(results.items()):
        frames.append(df.assign(seed=seed))
    return pd.concat(frames, ignore_index=True), _timings(results, wall, n_workers)


def _in_workers(runs: list, n_workers: int, progress) -> dict:
    """{seed: train_one's result} from `n_workers` processes, each pinned to its own core."""
    results = {}
    with cores.pool(n_workers) as executor:
        futures = {executor.submit(_train_seed, one): one.seed for one in runs}
        try:
            for done in concurrent.futures.as_completed(futures):
                seed = futures[done]
                try:
                    results[seed] = done.result()
                except Exception as exc:
                    raise RuntimeError(f"train_tiny: seed {seed} failed: {type(exc).__name__}: {exc}") from exc
                log.info("train_tiny: seed %d done (%d of %d)", seed, len(results), len(runs))
                if progress:
                    progress(1)
        except BaseException:
            cores.stop(executor, futures)
            raise
    return results


def _train_seed(cfg: TrainTinyConfig):
    from moejax.experiments import train_tiny
    from moejax.experiments.runner import enable_compilation_cache

    enable_compilation_cache()
    return train_tiny.train_one(cfg, progress_stream=io.StringIO())   # no progress line: workers share a terminal


def _timings(results: dict, wall: float, n_workers: int) -> dict:
    """Every seed's timings (seed_<k>.*), the wall time, the FLOPs of all seeds, the achieved rate
    over the wall time, and the dense matmul rate of this machine now (all its cores)."""
    from moejax.training.flops import dense_matmul_gflops

    out = {"workers": n_workers, "seeds_wall_s": wall}
    for seed, (_, t) in sorted(results.items()):
        out.update({f"seed_{seed}.{k}": v for k, v in t.items()})
    flops = sum(t["train_flops"] for _, t in results.values())
    dense = dense_matmul_gflops()
    out.update({"train_flops": flops, "wall_gflops": flops / wall / 1e9, "dense_gflops": dense,
                "share_of_dense": flops / wall / 1e9 / dense})
    return out

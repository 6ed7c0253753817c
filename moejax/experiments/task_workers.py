"""eval_tasks' variants on the tasks in several processes at once, each pinned to its own core
(`moejax.parallel.cores`): on two cores 1.6x one process, whose small programs leave the second
core idle much of the time (docs/benchmarks.md). Each worker loads the model, the lm-eval backend
and the tasks once, then evaluates the variants it is given (their expert maps, sent as numpy)
through `eval_tasks.evaluate_variant`; the rows come back in the variants' order."""

from __future__ import annotations

import concurrent.futures
from pathlib import Path

from moejax.parallel import cores

_WORKER: dict = {}   # the worker process's backend, tasks and settings (set by _load)


def evaluate_in_workers(cfg, task_dir, cache: Path, variants: list, n_workers: int, progress=None) -> list[dict]:
    """Every (spec, expert maps) of `variants` on the tasks: their rows, in the variants' order."""
    import jax
    import numpy as np
    from tqdm import tqdm

    as_numpy = [(spec.row(), None if maps is None else jax.tree.map(np.asarray, maps)) for spec, maps in variants]
    done: dict = {}
    with cores.pool(n_workers, _load, (cfg, task_dir, str(cache))) as executor:
        futures = {executor.submit(_evaluate, row, maps): i for i, (row, maps) in enumerate(as_numpy)}
        try:
            for future in tqdm(concurrent.futures.as_completed(futures), total=len(futures),
                               desc="eval_tasks variants", disable=progress is None):
                done[futures[future]] = future.result()
        except BaseException:
            cores.stop(executor, futures)
            raise
    return [row for i in range(len(variants)) for row in done[i]]


def _load(index: int, cfg, task_dir, cache: str) -> None:
    import lm_eval.caching.cache as request_cache

    from moejax.experiments import eval_tasks
    from moejax.experiments.runner import enable_compilation_cache

    enable_compilation_cache()   # (the environment, HF_DATASETS_OFFLINE included, is the parent's)
    request_cache.PATH = str(Path(cache) / f"worker-{index}")   # each worker builds its requests once
    _WORKER.update(cfg=cfg, lm=eval_tasks.new_lm(cfg), loaded=eval_tasks.load_tasks(cfg, task_dir))


def _evaluate(spec_row: dict, maps) -> list[dict]:
    from moejax.experiments import eval_tasks

    return eval_tasks.evaluate_variant(_WORKER["cfg"], _WORKER["lm"], _WORKER["loaded"], spec_row, maps)

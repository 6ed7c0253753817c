"""One toy3 job, `run`: the seeds in batches of `seed_batch` (vectorised within a batch), each batch
through four steps:

  `_calibrate`             draw the batch's layers and tokens (host), run stage one (jit)
  `host.decide_variants`   statistics, scores and every variant's masks and rows (host, numpy)
  `_measure`               stage two: every variant's errors on the held-out tokens (jit)
  `results.*_rows`         the tidy rows (host)

A cold job overlaps what it can on a second thread (`_compile_ahead`, `_import_in_background`):
stage two compiles, and pandas imports, while stage one is traced, compiled and run; and the
held-out table is computed while the host decides the variants (`_calibrate`).
"""

from __future__ import annotations

import importlib
import logging
import sys
import threading
import time

import numpy as np

from moejax.experiments.toy3.config import Toy3Config
from moejax.experiments.toy3.draw import draw_inputs
from moejax.experiments.toy3.host import BatchVariants, decide_variants
from moejax.experiments.toy3.results import Measured, error_rows, host_rows, to_frame
from moejax.experiments.toy3.stage_one import held_table, merges_read_table, stage_one
from moejax.experiments.toy3.stage_two import kth_values, stage_merges, stage_substitutes, stage_two
from moejax.experiments.toy3.variants import Layout, layout
from moejax.parallel.distributed import to_host  # jax.device_get, gathering across processes
from moejax.parallel.mesh import MeshConfig, mesh_context

log = logging.getLogger(__name__)


def run(cfg: Toy3Config, progress=None, job_dir=None):
    """Run toy3; returns (tidy pandas DataFrame, timings dict)."""
    cfg.validate()
    with mesh_context(MeshConfig(cfg.mesh_data, cfg.mesh_expert)):
        return _run_batches(cfg, progress)


def _run_batches(cfg: Toy3Config, progress=None):
    lay = layout(cfg)
    import jax  # noqa: F401  before the background imports: see _import_in_background

    # scipy's clustering and assignment for the host step's merges, pandas and pyarrow for the results
    _import_in_background("scipy.cluster.hierarchy", "scipy.optimize", "pandas", "pyarrow.parquet")
    all_seeds = np.arange(cfg.seed, cfg.seed + cfg.seeds)
    batches = [all_seeds[i:i + cfg.seed_batch] for i in range(0, len(all_seeds), cfg.seed_batch)]
    rows, timings = [], {"stage_one_s": 0.0, "host_s": 0.0, "stage_two_s": 0.0, "merged_pairs": 0}
    ahead = _compile_ahead(cfg, [len(b) for b in batches])
    for batch in batches:
        t0 = time.perf_counter()
        stacked, one, host = _calibrate(cfg, batch)
        t1 = time.perf_counter()
        variants = decide_variants(cfg, lay, batch, stacked, host)
        rows += host_rows(cfg, lay, batch, variants)
        t2 = time.perf_counter()
        if ahead is not None:
            ahead.join()
        measured = _measure(cfg, lay, one, stacked, variants)
        t3 = time.perf_counter()
        f_held = to_host(one["f_held"]) if cfg.eq6_pairs else None  # no copy on CPU (Eq. 6's prediction)
        rows += error_rows(cfg, lay, batch, variants.pairs, measured, f_held)
        timings["stage_one_s"] += t1 - t0
        timings["host_s"] += t2 - t1 + time.perf_counter() - t3
        timings["stage_two_s"] += t3 - t2
        timings["merged_pairs"] += measured.merged_pairs
        if progress is not None:
            progress(len(batch))
    return to_frame(rows), timings


def _calibrate(cfg: Toy3Config, seeds) -> tuple[dict, dict, dict]:
    """(the batch's draw stacked over seeds, stage one's results on the device, and on the host:
    all but the held-out logits, which stay for stage two, plus the router weights). The held-out
    table (`held_table`, when `merges_read_table`) is started last and not waited for: it runs
    while the host decides the variants, and stage two's calls wait for it."""
    import jax

    drawn = draw_inputs(cfg, seeds)
    stacked = {k: np.stack([d[k] for d in drawn]) for k in ("router", "w1", "w2", "x_cal", "x_held")}
    one = jax.block_until_ready(stage_one(cfg)(*stacked.values()))
    host = to_host({k: v for k, v in one.items() if k != "logits_held"})
    host["router"] = stacked["router"]
    if merges_read_table(cfg):
        one["f_held"] = held_table(cfg)(stacked["w1"], stacked["w2"], stacked["x_held"])
    return stacked, one, host


def _measure(cfg: Toy3Config, lay: Layout, one: dict, stacked: dict, variants: BatchVariants) -> Measured:
    """Stage two's programs on the batch: the pruning variants (`stage_two`), the merges' variants
    (`stage_merges`) and MoNE's (`stage_substitutes`); medians over the tokens on the host."""
    import jax

    n_pruned, n_merged = len(lay.pruned), len(lay.merged)
    masks = variants.masks_ZOWAE   # every masked variant's: the pruning variants, then the merges' shrunk forms
    kth = kth_values(cfg)(one["logits_held"], one["bias"], masks)
    rel_all, rel_per_token = to_host(jax.block_until_ready(stage_two(cfg)(
        one["logits_held"], one["bias"], masks, kth, f_held=one.get("f_held"),
        w1=stacked["w1"], w2=stacked["w2"], x_held=stacked["x_held"])))
    rel_median = np.median(rel_per_token, axis=-1)
    merge_per_token = y_sq = idx_held = gate_held = None
    merged_pairs = 0
    if lay.n_mapped:
        err_sum, merge_per_token, y_sq, idx_held, gate_held, n_pairs = to_host(jax.block_until_ready(
            stage_merges(cfg)(one["f_held"], one["logits_held"], one["bias"], masks, kth, variants.rows_ZOWAE,
                              None if variants.merged is None else stacked["x_held"], variants.merged)))
        rel_all = np.concatenate([rel_all, err_sum[..., :2 * n_merged] / y_sq.sum(axis=-1)[..., None]], axis=-1)
        merge_median = np.median(merge_per_token[..., :2 * n_merged, :], axis=-1)
        rel_median = np.concatenate([rel_median, merge_median], axis=-1)
        merged_pairs = int(np.sum(n_pairs))
    sub_rel = sub_median = None
    if lay.substituted:
        err_sub, sub_per_token, sub_y_sq = to_host(jax.block_until_ready(stage_substitutes(cfg)(
            one["f_held"], one["logits_held"], one["bias"], variants.novice_ZOWAE, variants.constants_ZOWED)))
        sub_rel, sub_median = err_sub / sub_y_sq.sum(axis=-1)[..., None], np.median(sub_per_token, axis=-1)
    return Measured(rel_all, rel_median, merge_per_token, y_sq, idx_held, gate_held, sub_rel, sub_median, merged_pairs)


def _import_in_background(*names: str) -> None:
    """Import modules that the job needs only after stage one on a second thread (about 0.8 s in
    all): they load while XLA compiles and runs stage one, which release the GIL, instead of before
    the job starts or on the host step's path. Only third-party modules that neither import JAX nor
    are imported by stage one's path, and only once JAX is imported: two threads importing into
    the same circular imports (jax.numpy and jax._src.numpy) deadlock, which Python raises in one
    of them (tests/test_toy3.py runs a job in a fresh interpreter). A failed import is left for
    the main thread's own import to raise."""
    missing = [name for name in names if name not in sys.modules]

    def work():
        try:
            for name in missing:
                importlib.import_module(name)
        except Exception:
            log.debug("toy3: importing %s in the background failed", missing, exc_info=True)

    if missing:
        threading.Thread(target=work, name="toy3-imports").start()  # not a daemon: see _compile_ahead


def _compile_ahead(cfg: Toy3Config, batch_sizes) -> threading.Thread | None:
    """Compile the held-out table's program and stage two (the pruning program, then the merges')
    on a second thread while the main thread traces, compiles and runs stage one and decides the
    variants (XLA's compilation releases the GIL and keeps about one core busy, so on two cores
    most of the second compilation overlaps; only tracing contends). JAX's cache hands the compiled
    programs to the job's calls. One device only (a mesh's programs are compiled under its context).
    Returns the thread to join before stage two, or None."""
    if MeshConfig(cfg.mesh_data, cfg.mesh_expert).n_devices > 1:
        return None

    merges, table = layout(cfg).n_mapped > 0, merges_read_table(cfg)

    def work():
        try:
            for n_seeds in sorted(set(batch_sizes)):
                if table:  # first: the job calls it right after stage one
                    held_table(cfg).compile_for(n_seeds)
                stage_two(cfg).compile_for(n_seeds)
                if merges:
                    stage_merges(cfg).compile_for(n_seeds)
        except Exception:  # the main thread's call compiles (and raises) as usual
            log.debug("toy3: compiling stage two ahead failed", exc_info=True)

    # not a daemon: the interpreter waits for it at exit (a job killed by a signal included), since
    # a thread still inside XLA while Python finalises aborts the process
    thread = threading.Thread(target=work, name="toy3-compile-ahead")
    thread.start()
    return thread

"""eval_tasks' variants on the lm-eval tasks: the tasks loaded once (`load_tasks`), one variant's
rows (`evaluate_variant`, lm-eval building the requests once per job: `requests_built_once`), and
the calibration pass with the tasks in several processes at once, each pinned to its own core
(`pass_and_tasks_in_workers`, `moejax.parallel.cores`): on two cores 1.6x one process, whose small
programs leave the second core idle much of the time (docs/benchmarks.md). Each worker loads the
model, the lm-eval backend and the tasks once, carries its share of the variants through the pass,
then evaluates the same variants on the tasks; the rows come back in the variants' order. `cfg`
is an `eval_tasks.EvalTasksConfig`."""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

from moejax.errors import ConfigError
from moejax.parallel import cores


def task_manager(cfg, task_dir: Path | None):
    """lm-eval's TaskManager over task_dir (and lm-eval's own tasks), with every requested name
    checked: unknown names are refused listing what it knows and where it looked."""
    from lm_eval.tasks import TaskManager

    tm = TaskManager(include_path=str(task_dir) if task_dir else None, include_defaults=cfg.include_defaults)
    known = set(tm.all_tasks)
    unknown = [t for t in cfg.tasks if t not in known]
    if unknown:
        where = ([str(task_dir)] if task_dir else []) + (["lm-eval's own tasks"] if cfg.include_defaults else [])
        local = sorted(n for n in known if task_dir and n.startswith(("stdlib_", "skills_")))[:8]
        raise ConfigError(f"eval_tasks: unknown task(s) {unknown}; looked in {' and '.join(where)} "
                          f"({len(known)} tasks known{', e.g. ' + ', '.join(local) if local else ''}; "
                          "`lm_eval ls tasks` lists lm-eval's own)")
    return tm


def _datasets_offline_hint(error: Exception, task: str) -> ConfigError:
    return ConfigError(f"eval_tasks: task {task!r}: its dataset could not be loaded ({type(error).__name__}: "
                       f"{error}). Tasks whose data lives on the Hugging Face hub need the network (or a local "
                       "datasets cache; HF_DATASETS_OFFLINE=1 uses only the cache)")


def task_rows(results: dict, variant: dict) -> list[dict]:
    """Tidy rows from lm-eval's results dict: one per (task, metric[,filter])."""
    rows = []
    for task, metrics in results["results"].items():
        for key, value in metrics.items():
            if "," not in key or "_stderr," in key or not isinstance(value, (int, float)):
                continue
            metric, filt = key.split(",", 1)
            stderr = metrics.get(f"{metric}_stderr,{filt}")
            rows.append(dict(variant, task=task, metric=metric if filt == "none" else f"{metric},{filt}",
                             value=float(value), stderr=float(stderr) if isinstance(stderr, (int, float)) else math.nan))
    return rows


def load_tasks(cfg, task_dir: Path | None) -> dict:
    """Every task and its data, loaded once for every variant (TaskManager.load's dicts, merged),
    few-shot seeded as simple_evaluate seeds them."""
    tm = task_manager(cfg, task_dir)
    loaded = {"tasks": {}, "groups": {}, "group_map": {}}
    for name in cfg.tasks:
        try:
            one = tm.load([name])
        except (ConnectionError, OSError) as e:  # named: which task needs the network
            raise _datasets_offline_hint(e, name) from None
        for key, value in one.items():
            loaded.setdefault(key, {}).update(value)
    for task in loaded["tasks"].values():
        task.set_fewshot_seed(seed=cfg.prune_real.seed)
    return loaded


def evaluate_variant(cfg, lm, loaded: dict, spec_row: dict, maps) -> list[dict]:
    """One variant (its expert maps) on every task: tidy rows. lm-eval builds the requests of the
    first call and reads them back afterwards (`requests_built_once`)."""
    from lm_eval import evaluator

    results = evaluator.evaluate(lm=lm.variant(maps), task_dict=loaded, limit=cfg.limit,
                                 bootstrap_iters=cfg.bootstrap_iters, log_samples=False, verbosity="WARNING",
                                 cache_requests=True)
    return task_rows(results, spec_row)


def new_lm(cfg):
    """The lm-eval backend every variant is evaluated through (loaded and compiled once)."""
    from moejax.evaluation.lm_eval import MoejaxLM

    return MoejaxLM(pretrained=cfg.prune_real.path, dtype=cfg.prune_real.dtype, batch_size=cfg.eval_batch_size,
                    seed=cfg.prune_real.seed)


@contextlib.contextmanager
def requests_built_once(job_dir: Path):
    """Every variant asks the same requests: lm-eval builds them for the first (rendering every
    document's templates, a second of each variant's six) and reads them back for the others
    (`cache_requests`), from a folder in the job folder that is removed afterwards."""
    import shutil

    import lm_eval.caching.cache as request_cache

    before, folder = request_cache.PATH, Path(job_dir) / "lm_eval_requests"
    request_cache.PATH = str(folder)
    try:
        yield folder
    finally:
        request_cache.PATH = before
        shutil.rmtree(folder, ignore_errors=True)



_WORKER: dict = {}   # the worker process's backend, tasks and settings (set by _load)


def pass_and_tasks_in_workers(cfg, task_dir, cache: Path, n_workers: int, progress=None):
    """The calibration pass and the tasks in `n_workers` processes, each on its own core: worker i
    carries the i-th share of the variants through the pass (`prune_real.evaluate(share=(i, n))`,
    rerouting included), then evaluates the same variants on the tasks (worker 0 also the unpruned
    model), with its model and tasks loaded once for both. Returns (the pass's DataFrame, info and
    timings, joined as one pass's by `prune_real.join_shares`; the task rows in the variants' order:
    the unpruned model, the plans, the rerouted variants)."""
    from moejax.experiments.prune_real import join_shares

    parts = cores.each_share(n_workers, _pass_and_tasks, f"calibration pass and tasks ({n_workers} workers)", progress,
                             _load, (cfg, task_dir, str(cache)))
    df, info, timings = join_shares([p[:3] for p in parts], max(p[2]["pass_s"] for p in parts),
                                    cfg.prune_real.reroute)
    timings["tasks_s"] = max(p[2]["tasks_s"] for p in parts)
    for i, p in enumerate(parts):
        timings[f"worker_{i}.tasks_s"] = p[2]["tasks_s"]
    by_place = {place: rows for p in parts for place, rows in p[3].items()}
    return df, info, timings, [row for place in sorted(by_place) for row in by_place[place]]


def _pass_and_tasks(share: tuple[int, int]):
    """In a worker: its share of the pass, then its variants on the tasks, each variant's rows keyed
    by its place in the joined order ((0, 0) the unpruned model, (1, at) a plan, (2, at) its
    rerouted variant)."""
    import dataclasses
    import time

    from moejax.experiments import prune_real
    from moejax.variants import VariantSpec

    cfg = _WORKER["cfg"]
    df, info, timings = prune_real.evaluate(cfg.prune_real, None, True, share)
    t0 = time.perf_counter()
    variants = [((0, 0), VariantSpec.unpruned(), None)] if share[0] == 0 else []
    variants += [((1, at), plan.spec, plan.expert_maps()) for at, plan in zip(info["at"], info["plans"])]
    place = {dataclasses.replace(plan.spec, rerouted=True): at for at, plan in zip(info["at"], info["plans"])}
    variants += [((2, place[spec]), spec, maps) for spec, maps in info.get("rerouted", {}).items()]
    rows = {key: evaluate_variant(cfg, _WORKER["lm"], _WORKER["loaded"], spec.row(), maps)
            for key, spec, maps in variants}
    timings["tasks_s"] = time.perf_counter() - t0
    return df, info, timings, rows


def _load(index: int, cfg, task_dir, cache: str) -> None:
    import lm_eval.caching.cache as request_cache

    # (the environment is the parent's: HF_DATASETS_OFFLINE, the compilation cache's settings)
    request_cache.PATH = str(Path(cache) / f"worker-{index}")   # each worker builds its requests once
    _WORKER.update(cfg=cfg, lm=new_lm(cfg), loaded=load_tasks(cfg, task_dir))

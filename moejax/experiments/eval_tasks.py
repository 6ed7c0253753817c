"""`python -m moejax.run experiment=eval_tasks model=tiny` (or `model.path=CKPT`): every pruned
variant on downstream tasks, in one job, without writing a checkpoint per variant.

1. One calibration pass (prune_real's, `moejax.evaluation.carried.evaluate_pruning`) decides every
   variant, one `moejax.variants.VariantPlan` each: (score, keep) pruned one-shot and, with
   `prune.sequential=true`, greedy; with `merges=[hc_smoe,m_smoe]` merged (clusters and merged
   experts, router forms tied and shrunk; with `prune.sequential_merges=true` also merged layer by
   layer on the model merged so far; with `prune.reroute=true` each also with its routers
   distilled, `rerouted` True); and beside them each variant's held-out perplexity and
   mean layer-local error (task `heldout`).
2. Each plan (and the unpruned model) is evaluated on every task through the lm-eval backend
   `moejax` (`moejax.evaluation.lm_eval.MoejaxLM`), handed over as its expert maps
   (`plan.expert_maps()`): the model is loaded and compiled once, nothing is decided or merged twice.

Tasks: any lm-eval task name, looked up in `task_dir` (YAML files) and in lm-eval's own tasks
(`include_defaults`). The default tasks are the offline ones built from the model's held-out
files (`moejax.evaluation.tasks`: stdlib_nextline, stdlib_mc, stdlib_ppl): with `task_dir` empty they
are written into the job folder from the checkpoint's `moejax_tiny.json`.

Results: results.parquet with columns method, form, keep (a `moejax.variants.VariantSpec`), task,
metric, value, stderr, layer, expert (form none = the unpruned model); `moejax.results.load` reads it; experiments/eval_tasks/ has the notebook.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
from pathlib import Path

from tqdm import tqdm

from moejax.data import read_text
from moejax.errors import ConfigError
from moejax.evaluation.routing_table import routing_rows, routing_shares
from moejax.evaluation.skills_tasks import (DEGEN_BYTES, DEGEN_TASK, default_sources, skill_of, task_names,
                                            write_skills_tasks)
from moejax.evaluation.tasks import heldout_files, position_budget, write_stdlib_tasks
from moejax.experiments import prune_real
from moejax.experiments.prune_real import PruneRealConfig, rerouted_as_form
from moejax.experiments.settings import BLOCKS, typed_settings
from moejax.experiments.task_workers import evaluate_variant, load_tasks, new_lm, requests_built_once
from moejax.parallel.cores import available_cores
from moejax.settings_check import refuse_repeats
from moejax.training.skills import documents, longest_document, text
from moejax.variants import VariantPlan, VariantSpec, is_rerouted

COLUMNS = ["method", "form", "keep", "task", "metric", "value", "stderr", "layer", "expert"]   # + rerouted (reroute=true)
DEFAULT_TASKS = ("stdlib_nextline", "stdlib_mc", "stdlib_ppl")
HELDOUT_METRICS = ("perplexity", "esap", "kl", "top1_agreement")   # the carried pass's, in task "heldout"
SKILL_TASKS = tuple(task_names())  # the skills tasks (moejax.evaluation.skills_tasks), built into the job folder when named


DEFAULT_SCORES = ("frequency", "reap", "ean", "signed", "l1", "random")   # scores=null: every score the model has


@dataclasses.dataclass(frozen=True)
class EvalTasksConfig:
    """eval_tasks' settings: prune_real's (its calibration pass decides every variant; one
    `PruneRealConfig`, composed, not copied) and the tasks'. In the Hydra config both sit side by
    side (`keep`, `merges`, `prune.*`, `data.*` are prune_real's; `tasks`, `lm_eval.*` the tasks')."""

    prune_real: PruneRealConfig = dataclasses.field(default_factory=lambda: PruneRealConfig(scores=DEFAULT_SCORES, workers=0))
    tasks: tuple = DEFAULT_TASKS
    task_dir: str = ""             # folder of lm-eval YAML tasks; "" = build the stdlib tasks in the job folder
    include_defaults: bool = True  # also look tasks up among lm-eval's own
    limit: int | None = None       # documents per task (None = all)
    eval_batch_size: int = 8       # lm-eval requests per forward
    n_nextline: int = 200          # sizes of the built stdlib tasks
    n_mc: int = 200
    n_ppl: int | None = None       # None: about 64 KB of held-out text in pieces the model can take
    n_skill: int = 100             # sizes of the built skills tasks (moejax.evaluation.skills_tasks), per skill
    n_skill_mc: int = 50
    n_skill_ll: int = 50
    n_degen: int = 48
    routing_docs: int = 100        # held-out documents per skill for the routing table (skills tasks only)
    bootstrap_iters: int = 1000    # lm-eval's stderr bootstrap for non-mean metrics

    @classmethod
    def from_mapping(cls, d: dict) -> "EvalTasksConfig":
        """prune_real's settings (its fields and the `merge` block) into the composed PruneRealConfig,
        the rest into the tasks'; a key neither has is refused, naming both's."""
        inner = {f.name for f in dataclasses.fields(PruneRealConfig)} | set(BLOCKS)
        own = {f.name for f in dataclasses.fields(cls)} - {"prune_real"}
        unknown = sorted(set(d) - inner - own)
        if unknown:
            raise ConfigError(f"eval_tasks: unknown setting(s) {unknown}; valid: {sorted((inner | own) - set(BLOCKS))}")
        nested = {k: v for k, v in d.items() if k in inner}
        if "scores" not in nested:
            nested["scores"] = DEFAULT_SCORES
        nested.setdefault("workers", 0)   # the pass's variants, then the tasks', a process per core
        with prune_real_as_eval_tasks():
            prune = PruneRealConfig(**typed_settings(PruneRealConfig, nested, "prune_real", nullable=("scores",)))
        mine = typed_settings(cls, {k: v for k, v in d.items() if k in own}, "eval_tasks",
                              nullable=("limit", "n_ppl"))
        cfg = cls(prune_real=prune, **mine)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Everything checkable before a model is loaded: the checkpoint and its tokenizer, the
        scores and keeps (prune_real's checks, keeps resolved against E and top-k), the task names."""
        with prune_real_as_eval_tasks():
            self.prune_real.validate()
        if not self.tasks:
            raise ConfigError("eval_tasks: tasks is empty; name lm-eval tasks, e.g. tasks=[stdlib_mc]")
        refuse_repeats("eval_tasks", "tasks", self.tasks)
        for name in ("eval_batch_size", "n_nextline", "n_mc", "n_ppl", "n_skill", "n_skill_mc", "n_skill_ll",
                     "n_degen", "routing_docs"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"eval_tasks: {name}={getattr(self, name)} must be >= 1")
        if self.limit is not None and (isinstance(self.limit, bool) or not isinstance(self.limit, int)
                                       or self.limit < 1):
            raise ConfigError(f"eval_tasks: limit={self.limit!r}; expected null or an integer >= 1")
        path = self.prune_real.path
        if not (Path(path) / "tokenizer.json").is_file():
            raise ConfigError(f"eval_tasks: {path} has no tokenizer.json (lm-eval tasks are text; for a "
                              f"byte-level train_tiny model: python -m moejax.data write-tokenizer {path})")
        if self.task_dir and not Path(self.task_dir).is_dir():
            raise ConfigError(f"eval_tasks: task_dir={self.task_dir}: no such folder")
        built = set(DEFAULT_TASKS) | set(SKILL_TASKS)
        if not self.task_dir and not set(self.tasks) <= built and not self.include_defaults:
            raise ConfigError(f"eval_tasks: tasks {sorted(set(self.tasks) - built)} need task_dir=... "
                              "or include_defaults=true")
        if not self.task_dir and set(self.tasks) & set(SKILL_TASKS):
            budget, source = position_budget(path)
            longest = DEGEN_BYTES if DEGEN_TASK in self.tasks else longest_document(
                {skill_of(t) for t in self.tasks} - {None})
            if longest > budget:
                raise ConfigError(f"eval_tasks: the skills tasks need documents of {longest} bytes, longer than the "
                                  f"model's {budget} positions ({source})")


Config = EvalTasksConfig


@contextlib.contextmanager
def prune_real_as_eval_tasks():
    """prune_real's checks and pass, run for eval_tasks, report under the name of the experiment
    that was run: its 'prune_real: ...' messages become 'eval_tasks: ...'."""
    try:
        yield
    except ConfigError as error:
        text = str(error)
        if not text.startswith("prune_real: "):
            raise
        raise ConfigError("eval_tasks: " + text[len("prune_real: "):]) from None


def settings_from(cfg: dict) -> dict:
    """prune_real's settings (`prune_real.settings_from`: model, data, prune and the top-level ones)
    plus the tasks' (`tasks`, the `lm_eval` block)."""
    settings = {**prune_real.settings_from(cfg), **(cfg.get("lm_eval") or {})}
    if "scores" in cfg:   # null: every score the model supports
        settings["scores"] = cfg["scores"]
    if cfg.get("tasks") is not None:
        settings["tasks"] = cfg["tasks"]
    return settings


def build_tasks(cfg: EvalTasksConfig, job_dir: Path) -> Path | None:
    """The folder of task YAML files: task_dir, or the stdlib and skills tasks named, built into the
    job folder (tasks/ and tasks/skills/)."""
    if cfg.task_dir:
        return Path(cfg.task_dir)
    stdlib, skills = set(cfg.tasks) & set(DEFAULT_TASKS), set(cfg.tasks) & set(SKILL_TASKS)
    if not stdlib and not skills:
        return None

    out = job_dir / "tasks"
    if stdlib:
        write_stdlib_tasks(out, checkpoint=cfg.prune_real.path, n_nextline=cfg.n_nextline, n_mc=cfg.n_mc,
                           n_ppl=cfg.n_ppl, seed=cfg.prune_real.seed)
    if skills:
        code, prose = default_sources(cfg.prune_real.path)
        write_skills_tasks(out / "skills", n=cfg.n_skill, n_mc=cfg.n_skill_mc, n_ll=cfg.n_skill_ll,
                           n_degen=cfg.n_degen, code_files=code, prose_file=prose, seed=cfg.prune_real.seed)
    return out


def run(cfg: EvalTasksConfig, progress=None, job_dir: Path | None = None):
    import pandas as pd

    job_dir = Path(job_dir or ".")
    task_dir = build_tasks(cfg, job_dir)
    if set(cfg.tasks) <= set(DEFAULT_TASKS) | set(SKILL_TASKS):
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local JSON: never ask the hub
    loaded = load_tasks(cfg, task_dir)  # unknown names fail here, before the calibration pass

    n_workers = cfg.prune_real.workers or len(available_cores())
    with requests_built_once(job_dir) as cache:
        if n_workers > 1:   # the pass and the tasks in one process per core (docs/benchmarks.md: 1.6x on two)
            from moejax.experiments.task_workers import pass_and_tasks_in_workers
            from moejax.hf.model_io import load_pretrained

            import jax.numpy as jnp

            with prune_real_as_eval_tasks():
                ppl_df, info, timings, variant_rows = pass_and_tasks_in_workers(cfg, task_dir, cache, n_workers,
                                                                                progress)
            routing = skill_routing_rows(cfg, load_pretrained(cfg.prune_real.path, dtype=jnp.dtype(cfg.prune_real.dtype)))
        else:
            with prune_real_as_eval_tasks():
                ppl_df, info, timings = prune_real.evaluate(cfg.prune_real, progress, merged_weights=True)
            t0 = time.perf_counter()
            base = new_lm(cfg)
            routing = skill_routing_rows(cfg, base.model)
            # every plan, then (reroute=true) every rerouted variant, as the pass left them: nothing trained twice
            plans = [VariantPlan(VariantSpec.unpruned()), *info["plans"]]
            variants = [(plan.spec, plan.expert_maps()) for plan in plans] + list(info.get("rerouted", {}).items())
            variant_rows = [row for spec, maps in tqdm(variants, desc="eval_tasks variants", disable=progress is None)
                            for row in evaluate_variant(cfg, base, loaded, spec.row(), maps)]
            timings["tasks_s"] = time.perf_counter() - t0

    rows = []
    # over all held-out texts: perplexity, and each variant's agreement with the unpruned model (ESAP, KL, top-1)
    all_ppl = ppl_df[ppl_df.metric.isin(HELDOUT_METRICS) & (ppl_df.text == "all")]
    reroute_kl = ppl_df[ppl_df.metric.str.startswith("reroute_kl_")]
    for _, r in reroute_kl.iterrows():
        rows.append(dict(VariantSpec.from_row(r).row(), task="heldout", metric=r.metric, value=float(r.value),
                         stderr=math.nan))
    for _, r in all_ppl.iterrows():
        rows.append(dict(VariantSpec.from_row(r).row(), task="heldout", metric=r.metric, value=float(r.value),
                         stderr=math.nan))
    err = ppl_df[ppl_df.metric == "rel_error"].groupby(["method", "form", "keep"]).value.mean()   # the pass's
    for (method, form, keep), value in err.items():
        rows.append(dict(method=method, form=form, keep=int(keep), task="heldout", metric="rel_error_mean",
                         value=float(value), stderr=math.nan))
    rows += routing + variant_rows
    df = pd.DataFrame(rows, columns=COLUMNS[:3] + ["rerouted"] + COLUMNS[3:] if cfg.prune_real.reroute else COLUMNS)
    for col in ("keep", "layer", "expert"):
        df[col] = df[col].astype("Int64")
    if cfg.prune_real.reroute:
        df["rerouted"] = df["rerouted"].map(is_rerouted)
    timings["variants"], timings["task_workers"] = 1 + info["variants"] + len(info.get("rerouted", {})), n_workers
    return df, timings


def skill_routing_rows(cfg: EvalTasksConfig, model) -> list[dict]:
    """The routing table of the unpruned model (moejax.evaluation.routing_table) on each named skill's
    held-out documents and on held-out code, when skills tasks are evaluated (else [])."""
    skills = sorted({skill_of(t) for t in cfg.tasks} - {None})
    if not skills:
        return []
    texts = {s: "".join(text(*d) for d in documents(s, cfg.routing_docs, cfg.prune_real.seed, "heldout"))
             for s in skills}
    code = "".join(read_text(p) for _, p in heldout_files(cfg.prune_real.path)[:4])
    texts["code"] = code[:16384]
    shares = routing_shares(model, texts, position_budget(cfg.prune_real.path)[0])
    return [dict(r, **VariantSpec.unpruned().row(), stderr=math.nan)
            for r in routing_rows(shares, model.config.moe_layers)]


def summary_title(cfg: EvalTasksConfig) -> str:
    return f"{cfg.prune_real.path}: task metrics and held-out perplexity by variant (rows) and keep (columns):"


def summary_table(df):
    df = rerouted_as_form(df[~df.metric.isin(["routing_share"]) & ~df.metric.str.startswith("experts_for_")])
    unpruned = df[df["form"] == "none"].set_index(["task", "metric"]).value
    wide = df[df["form"] != "none"].pivot_table(index=["form", "method"], columns=["task", "metric", "keep"],
                                                values="value")
    wide.columns = [f"{t} {m} keep={k}" for t, m, k in wide.columns]
    for col in wide.columns:
        task, metric = col.split(" ")[:2]
        if (task, metric) in unpruned.index:
            wide.loc[("none", "unpruned"), col] = unpruned[(task, metric)]
    return wide.round(4)

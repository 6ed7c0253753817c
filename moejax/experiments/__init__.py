"""Experiments by name. Each is a module with `Config` (a dataclass with `from_mapping`),
`settings_from(resolved_hydra_config) -> dict`, `run(cfg, progress, job_dir) -> (tidy DataFrame, timings)`
(job_dir: the job's folder, for files an experiment keeps beside its results),
`summary_title(cfg)` and `summary_table(df)`; `moejax.experiments.runner` does validation and files.
To add one: write `moejax/experiments/NAME.py` (or a package `NAME/`, as `toy3`) and `conf/experiment/NAME.yaml`, and list NAME here
and in `_DEFAULTS` below.

Defaults have one source, the dataclass. `register_configs` (called once, when
`moejax.experiments.runner` is imported, which `moejax.run` does before Hydra composes) stores
each experiment's dataclass defaults in Hydra's ConfigStore as `experiment_defaults/NAME`, laid
out as the composed config has them (`hydra_defaults`, the inverse of the module's
`settings_from`); `conf/experiment/NAME.yaml` lists it first in its defaults list and says only
what YAML alone can say (name, a mandatory `model.path: ???`, other groups, a Hydra-only value).
The nodes are plain dicts, not typed structured configs: values are checked by the dataclass's
`from_mapping`, whose errors name the setting."""

import dataclasses
import importlib

from hydra.core.config_store import ConfigStore

from moejax.errors import ConfigError
from moejax.experiments.settings import ALLOCATION_BLOCK, MERGE_BLOCK, allocation_block, merge_block
from moejax.registry import Registered

EXPERIMENTS = ("toy3", "score", "train_tiny", "prune_real", "eval_tasks")


def get(name: str):
    """The experiment module for `name`, or a ConfigError listing the valid names."""
    if name not in EXPERIMENTS:
        raise ConfigError(f"unknown experiment {name!r}; valid experiments: {', '.join(EXPERIMENTS)}")
    return importlib.import_module(f"moejax.experiments.{name}")


# Where each experiment's dataclass is, and where its fields sit in the composed Hydra config
# (block -> fields; "" = top level, "*" = every field not placed elsewhere). The fields of
# _ELSEWHERE come from other config groups (model.path, the mesh group), not from the experiment.
# train_tiny's dataclass lives in moejax.training.config (its experiment module imports JAX).
# prune_real's settings, in its Hydra config and in eval_tasks' (which composes its PruneRealConfig)
_PRUNE_REAL = {"": ("keep", "scores", "merges", "substitutes", "allocation", "calibration", "dtype", "seed",
                    "router_distillation", "workers"),
               "prune": ("sequential", "sequential_merges", "reroute"), "data": "*"}
_DEFAULTS = {
    "toy3": ("moejax.experiments.toy3:Toy3Config", {"": ("seed", "seeds", "keep"), "toy": "*"}),
    "score": ("moejax.experiments.score:ScoreConfig", {"": ("scores",), "data": "*"}),
    "train_tiny": ("moejax.training.config:TrainTinyConfig", {"": "*"}),
    "prune_real": ("moejax.experiments.prune_real:PruneRealConfig", _PRUNE_REAL),
    "eval_tasks": ("moejax.experiments.eval_tasks:EvalTasksConfig",
                   {**_PRUNE_REAL, "": (*_PRUNE_REAL[""], "tasks"),
                    "lm_eval": ("task_dir", "include_defaults", "limit", "eval_batch_size", "n_nextline", "n_mc",
                                "n_ppl", "n_skill", "n_skill_mc", "n_skill_ll", "n_degen", "routing_docs",
                                "bootstrap_iters")}),
}
COMPOSED = ("prune_real",)   # a field holding another experiment's whole config: its fields sit beside the others
_ELSEWHERE = ("path", "mesh_data", "mesh_expert")
DEFAULTS_GROUP = "experiment_defaults"


def _plain(value):
    """A default as the composed config holds it: a registered method as its name (its settings sit
    in the `merge` block), a nested dataclass as its mapping (its own `as_dict` where it has one:
    train_tiny's open `arch` mapping), tuples as lists."""
    if isinstance(value, Registered):
        return value.name
    if dataclasses.is_dataclass(value):
        if hasattr(value, "as_dict"):
            return value.as_dict()
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value


def hydra_defaults(name: str) -> dict:
    """Experiment `name`'s defaults, read from its dataclass, in the shape of the composed config
    (`settings_from` of the composed config gives them back). JAX-free."""
    where, layout = _DEFAULTS[name]
    module, cls = where.split(":")
    values = _flat_values(getattr(importlib.import_module(module), cls)())
    fields = [f for f in values if f not in _ELSEWHERE]
    placed = {f for block in layout.values() if block != "*" for f in block}
    out: dict = {}
    for block, names in layout.items():
        names = [f for f in fields if f not in placed] if names == "*" else names
        node = {f: _plain(values[f]) for f in names}
        if block:
            out[block] = node
        else:
            out.update(node)
    if "merges" in values:   # every merge method's settings, so `merge.ream.group_size=8` overrides a key that exists
        out[MERGE_BLOCK] = merge_block()
    if "allocation" in values:   # every allocation's settings: `allocations.evo_esap.population=16`
        out[ALLOCATION_BLOCK] = allocation_block()
    return out


def _flat_values(config) -> dict:
    """{field: default} of an experiment's dataclass, a COMPOSED field's own fields in its place."""
    out = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        out.update(_flat_values(value) if f.name in COMPOSED else {f.name: value})
    return out


def register_configs() -> None:
    """Store every experiment's dataclass defaults in Hydra's ConfigStore (`experiment_defaults/NAME`,
    package _global_), for conf/experiment/NAME.yaml's defaults list. Idempotent; Hydra is imported
    here only, so the rest of the library stays free of it."""
    store = ConfigStore.instance()
    for name in EXPERIMENTS:
        store.store(group=DEFAULTS_GROUP, name=name, node=hydra_defaults(name), package="_global_")

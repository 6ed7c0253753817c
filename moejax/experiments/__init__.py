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

EXPERIMENTS = ("toy3", "score", "train_tiny", "prune_real", "eval_tasks")


def refuse_unknown_settings(cls, settings: dict, experiment: str) -> None:
    """Every experiment's typed config refuses keys it does not have, naming the valid ones."""
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(settings) - fields)
    if unknown:
        raise ConfigError(f"{experiment}: unknown setting(s) {unknown}; valid: {sorted(fields)}")


def refuse_repeats(experiment: str, name: str, values, given=None) -> None:
    """Every experiment's list settings (scores, merges, keeps, tasks) name each thing at most once:
    a repeat would run the same variant again and write its result rows twice. values: what is
    compared (keeps as expert counts); given: the setting as written, for the message."""
    values = list(values)
    repeated = [v for i, v in enumerate(values) if v in values[:i] and v not in values[i + 1:]]
    if repeated:
        shown = list(values if given is None else given)
        counted = "" if given is None else " (as expert counts)"
        raise ConfigError(f"{experiment}: {name}={shown} names {repeated}{counted} more than once; give each at "
                          "most once")


def get(name: str):
    """The experiment module for `name`, or a ConfigError listing the valid names."""
    if name not in EXPERIMENTS:
        raise ConfigError(f"unknown experiment {name!r}; valid experiments: {', '.join(EXPERIMENTS)}")
    return importlib.import_module(f"moejax.experiments.{name}")


# Where each experiment's dataclass is, and where its fields sit in the composed Hydra config
# (block -> fields; "" = top level, "*" = every field not placed elsewhere). The fields of
# _ELSEWHERE come from other config groups (model.path, the mesh group), not from the experiment.
# train_tiny's dataclass lives in moejax.training.config (its experiment module imports JAX).
_DEFAULTS = {
    "toy3": ("moejax.experiments.toy3:Toy3Config", {"": ("seed", "seeds", "keep"), "toy": "*"}),
    "score": ("moejax.experiments.score:ScoreConfig", {"": ("scores",), "data": "*"}),
    "train_tiny": ("moejax.training.config:TrainTinyConfig", {"": "*"}),
    "prune_real": ("moejax.experiments.prune_real:PruneRealConfig",
                   {"": ("keep", "scores", "merges", "substitutes", "allocation", "calibration", "dtype", "seed"),
                    "prune": ("sequential", "sequential_merges", "group_size", "merge_score", "reroute", "reroute_steps",
                              "reroute_lr"), "data": "*"}),
    "eval_tasks": ("moejax.experiments.eval_tasks:EvalTasksConfig",
                   {"": ("keep", "scores", "merges", "substitutes", "tasks", "calibration", "dtype", "seed"),
                    "prune": ("sequential", "sequential_merges", "group_size", "merge_score", "reroute", "reroute_steps",
                              "reroute_lr"),
                    "lm_eval": ("task_dir", "include_defaults", "limit", "eval_batch_size", "n_nextline", "n_mc",
                                "n_ppl", "n_skill", "n_skill_mc", "n_skill_ll", "n_degen", "routing_docs",
                                "bootstrap_iters"),
                    "data": "*"}),
}
_ELSEWHERE = ("path", "mesh_data", "mesh_expert")
DEFAULTS_GROUP = "experiment_defaults"


def _plain(value):
    """A default as the composed config holds it: a nested dataclass as its mapping (its own
    `as_dict` where it has one: train_tiny's open `arch` mapping), tuples as lists."""
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
    defaults = getattr(importlib.import_module(module), cls)()
    fields = [f.name for f in dataclasses.fields(defaults) if f.name not in _ELSEWHERE]
    placed = {f for block in layout.values() if block != "*" for f in block}
    out: dict = {}
    for block, names in layout.items():
        names = [f for f in fields if f not in placed] if names == "*" else names
        node = {f: _plain(getattr(defaults, f)) for f in names}
        if block:
            out[block] = node
        else:
            out.update(node)
    return out


def register_configs() -> None:
    """Store every experiment's dataclass defaults in Hydra's ConfigStore (`experiment_defaults/NAME`,
    package _global_), for conf/experiment/NAME.yaml's defaults list. Idempotent; Hydra is imported
    here only, so the rest of the library stays free of it."""
    store = ConfigStore.instance()
    for name in EXPERIMENTS:
        store.store(group=DEFAULTS_GROUP, name=name, node=hydra_defaults(name), package="_global_")

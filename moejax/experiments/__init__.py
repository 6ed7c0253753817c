"""Experiments by name. Each is a module with `Config` (a dataclass with `from_mapping`),
`settings_from(resolved_hydra_config) -> dict`, `run(cfg, progress, job_dir) -> (tidy DataFrame, timings)`
(job_dir: the job's folder, for files an experiment keeps beside its results),
`summary_title(cfg)` and `summary_table(df)`; `moejax.experiments.runner` does validation and files.
To add one: write `moejax/experiments/NAME.py` and `conf/experiment/NAME.yaml`, and list NAME here."""

import importlib

from moejax.errors import ConfigError

EXPERIMENTS = ("toy3", "score", "train_tiny", "prune_real", "eval_tasks")


def refuse_unknown_settings(cls, settings: dict, experiment: str) -> None:
    """Every experiment's typed config refuses keys it does not have, naming the valid ones."""
    import dataclasses

    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(settings) - fields)
    if unknown:
        raise ConfigError(f"{experiment}: unknown setting(s) {unknown}; valid: {sorted(fields)}")


def get(name: str):
    """The experiment module for `name`, or a ConfigError listing the valid names."""
    if name not in EXPERIMENTS:
        raise ConfigError(f"unknown experiment {name!r}; valid experiments: {', '.join(EXPERIMENTS)}")
    return importlib.import_module(f"moejax.experiments.{name}")

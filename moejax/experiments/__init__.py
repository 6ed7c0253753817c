"""Experiments by name. Each is a module with `Config` (a dataclass with `from_mapping`),
`SETTINGS_KEY` (its block in the Hydra config), `run(cfg, progress) -> (tidy DataFrame, timings)`
and `summary_table(df)`; `moejax.experiments.runner` does validation and the files."""

from moejax.errors import ConfigError

EXPERIMENTS = ("toy3",)


def get(name: str):
    """The experiment module for `name`, or a ConfigError listing the valid names."""
    if name == "toy3":
        from moejax.experiments import toy3
        return toy3
    raise ConfigError(f"unknown experiment {name!r}; valid experiments: {', '.join(EXPERIMENTS)}")

"""Experiments by name. Each is a module with a config dataclass (`Config.from_mapping`) and
`run(cfg) -> (tidy DataFrame, timings)`; `moejax.experiments.runner` does the files."""

from moejax.errors import ConfigError

EXPERIMENTS = ("toy3",)


def get(name: str):
    """The experiment module for `name`, or a ConfigError listing the valid names."""
    if name == "toy3":
        from moejax.experiments import toy3
        return toy3
    raise ConfigError(f"unknown experiment {name!r}; valid experiments: {', '.join(EXPERIMENTS)}")

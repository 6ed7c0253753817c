"""Experiments by name. Each is a module with `Config` (a dataclass with `from_mapping`),
`settings_from(resolved_hydra_config) -> dict`, `run(cfg, progress) -> (tidy DataFrame, timings)`,
`summary_title(cfg)` and `summary_table(df)`; `moejax.experiments.runner` does validation and files."""

from moejax.errors import ConfigError

EXPERIMENTS = ("toy3", "score")


def get(name: str):
    """The experiment module for `name`, or a ConfigError listing the valid names."""
    if name == "toy3":
        from moejax.experiments import toy3
        return toy3
    if name == "score":
        from moejax.experiments import score
        return score
    raise ConfigError(f"unknown experiment {name!r}; valid experiments: {', '.join(EXPERIMENTS)}")

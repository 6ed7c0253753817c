"""The checks every typed settings dataclass makes on what it is given (the experiments' configs and
train_tiny's): refuse a key it has no field for, naming the valid ones, and refuse a list setting
that names a thing twice. JAX-free and Hydra-free; imports only `moejax.errors`, so any room may
use it (`tests/test_import_graph.py:FLOORS` puts it on the lowest floor)."""

import dataclasses

from moejax.errors import ConfigError


def refuse_unknown_settings(cls, settings, experiment: str, message=None) -> dict:
    """Every typed settings dataclass refuses keys it does not have, naming the valid ones; returns
    {name: dataclasses.Field}. message(unknown, valid) -> str: the error's text (default
    "EXPERIMENT: unknown setting(s) [...]; valid: [...]")."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(settings) - set(fields))
    if unknown:
        raise ConfigError(message(unknown, sorted(fields)) if message else
                          f"{experiment}: unknown setting(s) {unknown}; valid: {sorted(fields)}")
    return fields


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

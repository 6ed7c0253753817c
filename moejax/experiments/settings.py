"""An experiment's settings made typed, from the flat mapping `settings_from` reads out of the Hydra
config: the one place that turns lists into tuples, names of merge methods plus their `merge`
block (`merges=[ream]`, `merge.ream.group_size=8`) into `MergeMethod` objects, the name of an
allocation plus its `allocations` block (`allocation=evo_esap`, `allocations.evo_esap.population=16`)
into an `Allocation` object, and a nested settings block (`router_distillation: {lr: ...}`) into
its dataclass. JAX-free."""

from __future__ import annotations

import dataclasses

from moejax.allocation import ALLOCATIONS
from moejax.errors import ConfigError
from moejax.merging.method import MERGE_METHODS
from moejax.settings_check import refuse_unknown_settings

MERGE_BLOCK = "merge"   # {method name: {setting: value}}: the merge methods' settings in the Hydra config
ALLOCATION_BLOCK = "allocations"   # {allocation name: {setting: value}}: the allocations' settings
BLOCKS = (MERGE_BLOCK, ALLOCATION_BLOCK)


def merge_block() -> dict:
    """The `merge` block of an experiment's Hydra defaults: every registered method's default settings
    (so `merge.ream.group_size=8` overrides a key that exists)."""
    return MERGE_METHODS.defaults()


def allocation_block() -> dict:
    """The `allocations` block of an experiment's Hydra defaults: every allocation's default settings."""
    return ALLOCATIONS.defaults()


def _as_tuple(value) -> tuple:
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)


def typed_settings(cls, settings: dict, experiment: str, nullable: tuple = ()) -> dict:
    """The keyword arguments of `cls` for `settings`: unknown keys refused naming the valid ones; a
    None dropped (the field's default) unless the key is in `nullable`; a list made a tuple, and a
    single value of a field whose default is a tuple made a 1-tuple; `merges` (names)
    with the `merge` block made merge method objects (`MERGE_METHODS.parse_all`); a dataclass field
    given as a mapping made that dataclass."""
    settings = dict(settings)
    block = settings.pop(MERGE_BLOCK, None)
    allocations = settings.pop(ALLOCATION_BLOCK, None)
    refuse_unknown_settings(cls, settings, experiment)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    out = {}
    for key, value in settings.items():
        if value is None and key not in nullable:
            continue
        default = fields[key].default
        factory = fields[key].default_factory
        if isinstance(value, list) or value is not None and isinstance(default, tuple):
            value = _as_tuple(value)
        elif factory is not dataclasses.MISSING and dataclasses.is_dataclass(factory) and isinstance(value, dict):
            try:
                value = factory(**value)
            except TypeError as e:
                valid = sorted(f.name for f in dataclasses.fields(factory))
                raise ConfigError(f"{experiment}: {key}: {e}; its settings: {valid}") from None
        out[key] = value
    if "merges" in fields and ("merges" in out or block):
        try:
            out["merges"] = MERGE_METHODS.parse_all(out.get("merges", fields["merges"].default), block, "merges")
        except ConfigError as e:
            raise ConfigError(f"{experiment}: {e}") from None
    elif block:
        raise ConfigError(f"{experiment}: has no merges, so its `{MERGE_BLOCK}` settings apply to nothing")
    if "allocation" in fields:
        out["allocation"] = _allocation(out.get("allocation", fields["allocation"].default), allocations, experiment)
    elif allocations:
        raise ConfigError(f"{experiment}: has no allocation, so its `{ALLOCATION_BLOCK}` settings apply to nothing")
    return out


def _allocation(name, block: dict | None, experiment: str):
    """The allocation `name` with its settings from the `allocations` block ({name: {setting: value}};
    settings of other allocations are checked as names and otherwise left alone)."""
    block = dict(block or {})
    try:
        unknown = sorted(set(block) - set(ALLOCATIONS.names()))
        if unknown:
            raise ConfigError(f"settings for unknown allocation(s) {unknown}; valid: {list(ALLOCATIONS.names())}")
        if not isinstance(name, str):
            return ALLOCATIONS.parse(name)
        return ALLOCATIONS.parse(name, **dict(block.get(name) or {}))
    except ConfigError as e:
        raise ConfigError(f"{experiment}: {e}") from None

"""Registered settings objects: a compression method is one frozen dataclass registered by name, which
holds its settings (each default declared once, as the field's default), checks them and carries
its algorithm. `Registry.parse(name, **overrides)` is the only place a method's name is checked;
the CLI's choices and the experiments' lists are the registry's names. JAX-free.

    registry = Registry("merge method", MergeMethod, modules=("moejax.merging.clusters", ...))

    @registry.register("ream")
    class Ream(MergeMethod):
        score: str = "reap"
        group_size: int = 16

    registry.parse("ream", group_size=8)   -> Ream(score='reap', group_size=8)

`modules` are the modules that define the methods (imported on first use, so that the registry's
own module stays light): adding a method is its module, that line and its tests.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import ClassVar

from moejax.errors import ConfigError
from moejax.settings_check import refuse_unknown_settings


class Registered:
    """What every registered settings object has: its `name` (set by `Registry.register`), its
    settings as a mapping, and a record of both. Subclasses check their own settings in
    `check_settings`, run when the object is made."""

    name: ClassVar[str] = ""

    def __post_init__(self):
        self.check_settings()

    def check_settings(self) -> None:
        """Refuse a setting out of its range (ConfigError naming it), before any work."""

    def settings(self) -> dict:
        return dataclasses.asdict(self)

    def record(self) -> dict:
        """{"method": name, "settings": {...}}: what a record or a results table keeps of it."""
        return {"method": self.name, "settings": self.settings()}

    def __str__(self) -> str:
        changed = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                   if getattr(self, f.name) != f.default}
        return self.name + (f"({', '.join(f'{k}={v!r}' for k, v in changed.items())})" if changed else "")


def _check_type(kind: str, name: str, field: dataclasses.Field, value) -> None:
    """An override has the type of the field's default (an int is a float; a bool is not an int)."""
    default = field.default
    expected = type(default)
    ok = (isinstance(value, bool) if expected is bool
          else isinstance(value, (int, float)) and not isinstance(value, bool) if expected is float
          else isinstance(value, int) and not isinstance(value, bool) if expected is int
          else isinstance(value, expected))
    if not ok:
        what = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(expected, expected.__name__)
        raise ConfigError(f"{kind} {name}: {field.name}={value!r}; expected {what} (default {default!r})")


class Registry:
    """Name -> registered class, for one kind of method (`kind`, said in messages), each a subclass
    of `base` (itself a subclass of `Registered`)."""

    def __init__(self, kind: str, base: type, modules: tuple = ()):
        self.kind, self.base, self.modules = kind, base, tuple(modules)
        self._classes: dict = {}

    def register(self, name: str):
        """Class decorator: the class becomes a frozen dataclass registered as `name`."""
        def decorate(cls):
            if not issubclass(cls, self.base):
                raise TypeError(f"{cls.__name__} is not a {self.base.__name__}")
            missing = sorted(getattr(cls, "__abstractmethods__", ()))
            if missing:
                raise TypeError(f"{self.kind} {name!r} ({cls.__name__}) does not define {missing}")
            if name in self._classes:
                raise TypeError(f"{self.kind} {name!r} is registered twice ({self._classes[name].__name__}, "
                                f"{cls.__name__})")
            cls = dataclasses.dataclass(frozen=True)(cls)
            cls.name = name
            self._classes[name] = cls
            return cls
        return decorate

    def _load(self) -> dict:
        for module in self.modules:
            importlib.import_module(module)
        return self._classes

    def names(self) -> tuple:
        """Every registered name, in registration order (the modules' order)."""
        return tuple(self._load())

    def __contains__(self, name) -> bool:
        return name in self._load()

    def __iter__(self):
        return iter(self.names())

    def defaults(self) -> dict:
        """{name: its default settings}, for every registered method."""
        return {name: cls().settings() for name, cls in self._load().items()}

    def parse(self, name, **overrides):
        """The method `name` with its settings `overrides` (the others at their defaults): an unknown
        name or setting, a setting of the wrong type or out of range is refused, naming it. A method
        object is returned as it is (with overrides: refused)."""
        if isinstance(name, self.base):
            if overrides:
                raise ConfigError(f"{self.kind} {name}: already made; its settings cannot be overridden again")
            return name
        classes = self._load()
        cls = classes.get(name)
        if cls is None:
            raise ConfigError(f"unknown {self.kind} {name!r}; valid: {list(classes)}")
        fields = refuse_unknown_settings(cls, overrides, name, lambda unknown, valid: (
            f"{self.kind} {name}: unknown setting(s) {unknown}; its settings: {valid or 'none'}"))
        for key, value in overrides.items():
            _check_type(self.kind, name, fields[key], value)
        return cls(**overrides)

    def parse_all(self, names, settings: dict | None = None, where: str = "merges") -> tuple:
        """(method, ...) for a list of names, each with its settings from `settings` ({name:
        {setting: value}}: the experiments' `merge.NAME.SETTING=...`); a name given twice is refused."""
        names = (names,) if isinstance(names, str) else tuple(names)
        settings = dict(settings or {})
        unknown = sorted(set(settings) - set(self._load()))
        if unknown:
            raise ConfigError(f"settings for unknown {self.kind}(s) {unknown}; valid: {list(self._classes)}")
        out = []
        for name in names:
            if isinstance(name, self.base):   # a method already made: the settings given for it override its own
                out.append(self.parse(name.name, **{**name.settings(), **dict(settings.get(name.name) or {})}))
                continue
            if name not in self._classes:
                raise ConfigError(f"{where}: unknown {self.kind} {name!r}; valid: {list(self._classes)}")
            out.append(self.parse(name, **dict(settings.get(name) or {})))
        seen = [m.name for m in out]
        repeated = sorted({n for n in seen if seen.count(n) > 1})
        if repeated:
            raise ConfigError(f"{where}={seen} names {repeated} more than once; give each at most once")
        return tuple(out)

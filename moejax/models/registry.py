"""The registry of model families: one line per family. Everything outside `moejax/models/` finds
a checkpoint's family here (by config.json's model_type, then architectures) and never names one.

Adding a family: a folder `moejax/models/<name>/` (config, names, model, presets with PRESETS, TINY
and TEST; follow `qwen3_moe/`) whose `__init__.py` defines its `FAMILY`, and its line below (imported
and listed). setuptools ships the folder; the family tests (`tests/test_families.py`) run on it
from its TEST config."""

from __future__ import annotations

from moejax.errors import ConfigError
from moejax.models import deepseek_v3, glm4_moe, gpt_oss, mixtral, olmoe, qwen2_moe, qwen3_5_moe, qwen3_moe, qwen3_next
from moejax.models import deepseek_v32, deepseek_v4, glm_moe_dsa, kimi_k25
from moejax.models.config_base import read_json_object
from moejax.models.family import Family

FAMILIES: dict[str, Family] = {f.name: f for f in (
    deepseek_v3.FAMILY,
    qwen3_moe.FAMILY,
    mixtral.FAMILY,
    olmoe.FAMILY,
    glm4_moe.FAMILY,
    qwen2_moe.FAMILY,
    gpt_oss.FAMILY,
    qwen3_next.FAMILY,
    qwen3_5_moe.FAMILY,
    deepseek_v32.FAMILY,
    glm_moe_dsa.FAMILY,
    kimi_k25.FAMILY,
    deepseek_v4.FAMILY,
)}


def family_for(d, source: str = "config") -> Family:
    """The family of a config.json dictionary: by model_type, else by architectures."""
    if isinstance(d, dict):
        model_type, archs = d.get("model_type"), d.get("architectures")
        for family in FAMILIES.values():
            if model_type in family.model_types:
                return family
        if isinstance(archs, list):
            for family in FAMILIES.values():
                if {family.architecture, *family.config_class.ARCHITECTURE_SPELLINGS} & set(archs):
                    return family
        supported = ", ".join(f"{f.title} ({'/'.join(f.model_types)}, {f.architecture})" for f in FAMILIES.values())
        raise ConfigError(f"{source}: model_type={model_type!r}, architectures={archs!r} is not a supported family; "
                          f"supported: {supported}")
    raise ConfigError(f"{source}: expected a JSON object (a model config), got {type(d).__name__}")


def family_of(cfg) -> Family:
    """The family of a typed config."""
    for family in FAMILIES.values():   # a family's config class may derive from another's (Kimi-K2.5's)
        if type(cfg) is family.config_class:
            return family
    raise ConfigError(f"{type(cfg).__name__} is not the config of a registered family")


def config_from_dict(d, source: str = "config", *, uniform_experts: bool = True):
    return family_for(d, source).config_class.from_dict(d, source=source, uniform_experts=uniform_experts)


def read_config(path, *, uniform_experts: bool = True):
    """config.json of any registered family, strictly checked (one ConfigError naming every problem)."""
    return config_from_dict(read_json_object(path), str(path), uniform_experts=uniform_experts)

"""Rotary-embedding settings as transformers resolves them from config.json (JAX-free): the default
rope and YaRN (`rope_type: "yarn"`), read from `rope_scaling` or `rope_parameters`. DeepSeek-V3 and
gpt-oss read theirs here; the tables are computed in `moejax.models.rope`."""

from __future__ import annotations

import dataclasses
import math

from moejax.models.config_base import (BOOL, NONNEG_NUMBER_OR_NULL, POS_INT_OR_NULL, POS_NUMBER, POS_NUMBER_OR_NULL,
                                       STRING, check, show)


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    rope_type: str = "default"          # "default" or "yarn"
    theta: float = 10000.0
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True


ROPE_RULES = {
    "rope_type": STRING, "type": STRING, "rope_theta": POS_NUMBER, "factor": POS_NUMBER_OR_NULL,
    "original_max_position_embeddings": POS_INT_OR_NULL, "beta_fast": POS_NUMBER_OR_NULL,
    "beta_slow": POS_NUMBER_OR_NULL, "mscale": NONNEG_NUMBER_OR_NULL, "mscale_all_dim": NONNEG_NUMBER_OR_NULL,
    "attention_factor": POS_NUMBER_OR_NULL, "truncate": BOOL,
}


def rope_from_dict(d: dict, v: dict, problems: list, unimplemented: list) -> RopeConfig:
    """transformers' resolution: `rope_scaling` wins over `rope_parameters`; a `rope_theta` inside the
    dict wins over the top-level one; `type` is the legacy key of `rope_type`. `v`: the top-level
    fields that passed their checks. Returns a placeholder when something is wrong (and noted)."""
    n_problems = len(problems)
    where, rp = None, {}
    for key in ("rope_scaling", "rope_parameters"):
        value = d.get(key)
        if value is not None and not isinstance(value, dict):
            problems.append(f"{key}={show(value)}, expected an object (or null)")
        elif value and not rp:
            where, rp = key, dict(value)
    for name, rule in ROPE_RULES.items():
        if name in rp:
            check(f"{where}.{name}", rp[name], rule, problems)
    for name in ("rope_theta", "original_max_position_embeddings"):
        if d.get(name) is not None:
            check(name, d[name], ROPE_RULES[name], problems)
    theta_key = f"{where}.rope_theta" if "rope_theta" in rp else "rope_theta"
    theta = rp.get("rope_theta", d.get("rope_theta", 10000.0))
    if theta is None and "rope_theta" not in rp:
        problems.append(f"{theta_key}=null, expected {POS_NUMBER[1]}")
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    if len(problems) > n_problems:
        return RopeConfig()
    if rope_type == "default":
        return RopeConfig(theta=float(theta))
    if rope_type != "yarn":
        unimplemented.append(f"rope_type={rope_type!r} (only 'default' and 'yarn' are implemented)")
        return RopeConfig()
    max_pos = v.get("max_position_embeddings")
    omp = d.get("original_max_position_embeddings") or rp.get("original_max_position_embeddings") or max_pos
    factor = rp.get("factor")
    if omp is None or (factor is None and max_pos is None):
        return RopeConfig()             # max_position_embeddings was wrong (and noted)
    if factor is None:
        factor = max_pos / omp
    optional = {k: None if rp.get(k) is None else float(rp[k]) for k in ("mscale", "mscale_all_dim",
                                                                          "attention_factor")}
    return RopeConfig(
        rope_type="yarn", theta=float(theta), factor=float(factor), original_max_position_embeddings=int(omp),
        beta_fast=float(rp.get("beta_fast") or 32), beta_slow=float(rp.get("beta_slow") or 1),
        truncate=rp.get("truncate", True), **optional)



def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

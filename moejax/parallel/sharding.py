"""Which parameter is split over which mesh axis: one small rule table, read top to bottom."""

from __future__ import annotations

import re

import jax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

# (pattern on the dotted parameter path, partition spec); the first match wins.
SHARDING_RULES = (
    # [E, ...]: E/X routed experts per device (every expert kind's arrays: `experts_<name>`, gpt-oss's biases too)
    (r"\.mlp\.experts_[a-z_]+$", P("expert")),
    (r"^experts_[a-z_]+$", P("expert")),                # a bare MoE layer (streaming, scoring)
    (r"^(w1|w2)$", P("expert")),                        # the toy layer's experts [E, ...]
    (r".*", P()),                                       # everything else replicated
)


def spec_for(path: str) -> P:
    for pattern, spec in SHARDING_RULES:
        if re.search(pattern, path):
            return spec
    raise AssertionError("the last rule matches everything")


def partition_specs(module) -> dict[str, P]:
    """Dotted parameter path -> PartitionSpec for every variable of an NNX module."""
    return {".".join(str(p) for p in path): spec_for(".".join(str(p) for p in path))
            for path, _ in nnx.to_flat_state(nnx.state(module))}


def shard_model(module, mesh):
    """Place every variable of `module` on `mesh` by the rule table (in place; returns module)."""
    state = nnx.state(module)
    flat = nnx.to_flat_state(state)
    for path, var in flat:
        spec = spec_for(".".join(str(p) for p in path))
        var.set_value(jax.device_put(var.get_value(), NamedSharding(mesh, spec)))
    nnx.update(module, nnx.from_flat_state(flat))
    return module

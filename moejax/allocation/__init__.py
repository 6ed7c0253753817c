"""How many experts (or clusters) each MoE layer keeps under one total: the allocations (issue 45).

- `method`: what an allocation is (`Allocation`: a registered settings object with its rule;
  `Budget`: the request; `ALLOCATIONS`: the registry, `parse(name, **settings)` the only check of a
  name; `layer_counts`: the counts of an allocation that needs no search).
- `threshold`: `uniform` (every layer keeps `keep`) and `global` (one threshold over the layers'
  normalised scores, M-SMoE's rule).

JAX-free.
"""

from moejax.allocation.method import (ALLOCATIONS, RANKING, Allocation, Budget, allocation_record, layer_counts, parse,
                                     statistic_of)

UNIFORM = ALLOCATIONS.parse("uniform")   # the default of every command and experiment

__all__ = ["UNIFORM", "ALLOCATIONS", "RANKING", "Allocation", "Budget", "allocation_record", "layer_counts", "parse", "statistic_of"]

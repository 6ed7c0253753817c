"""How many experts (or clusters) each MoE layer keeps under one total: the allocations (issue 45).

- `method`: what an allocation is (`Allocation`: a registered settings object with its rule;
  `Budget`: the request; `ALLOCATIONS`: the registry, `parse(name, **settings)` the only check of a
  name; `layer_counts`: the counts of an allocation that needs no search).
- `threshold`: `uniform` (every layer keeps `keep`) and `global` (one threshold over the layers'
  normalised scores, M-SMoE's rule).
- `shape`: SHAPE's coverage of each layer's Shapley mass (`moejax.scoring.scores.shapley`), one
  alpha bisected to hit the total.
- `evo_esap`: EvoESAP's mutation-only evolutionary search, by a fitness the caller builds (ESAP of
  each candidate on calibration tokens held apart: `moejax.evaluation.esap_fitness`).

JAX-free.
"""

from moejax.allocation.method import (ALLOCATIONS, RANKING, Allocation, Budget, allocate, allocation_record, layer_counts,
                                     parse, statistic_of)

UNIFORM = ALLOCATIONS.parse("uniform")   # the default of every command and experiment

__all__ = ["UNIFORM", "ALLOCATIONS", "RANKING", "Allocation", "Budget", "allocate", "allocation_record", "layer_counts", "parse", "statistic_of"]

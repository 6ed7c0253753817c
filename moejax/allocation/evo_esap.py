"""EvoESAP's search for the per-layer counts (arXiv 2603.06003, code ZongfangLiu/EvoESAP,
`src/reap/search_utils.py`, `evolutionary_search` and `mutate_plan`): mutation-only evolution of
how many experts each MoE layer prunes, at a fixed total, by a fitness to maximise (ESAP: the
expected speculative-decoding acceptance of the candidate against the unpruned model, teacher
forced on calibration tokens held apart from the scoring ones; `moejax.evaluation.esap_fitness`).
Within a layer, the variant's own ranking chooses which experts go.

    genome       pruned_l, experts pruned per layer (the budget's layers in order), in
                 [0, E_l - top_k], summing to sum_l (E_l - keep_l) (the uniform request's total)
    population   max(population, 12) candidates: one per initial pattern (uniform, random, up,
                 down, mid, mid-neg, front-heavy, back-heavy, block-early, block-late, alt,
                 deep-flat: layer weights, the budget spread in proportion, largest fractional
                 part first, then round robin, within each layer's capacity), the rest random
    mutation     n = min(randint(1, mutations), randint(1, mutations)) moves, each of delta =
                 randint(1, max_delta) pruned experts from a layer that has them to another with
                 room (a move that does not fit is retried; `attempts` tries in all)
    selection    the `survivors` best (ties: earlier in the population) pass on unchanged; each
                 other place is a mutation of a survivor drawn uniformly
    generations  the initial population is scored, then `generations` rounds of selection and
                 mutation, each round's new candidates scored; a candidate already scored is not
                 scored again; the best is replaced only on a strict improvement

Its random draws are Python's `random.Random(seed)`, as EvoESAP's, in the same order, so a seed
gives the same search. The defaults are EvoESAP's code defaults (`SearchArgs`: population 8, which
its 12 patterns raise to 12; topk 4 survivors; 4 generations; max delta 2; 1 mutation; 32
attempts); its README's example run uses population 32, 50 generations, max delta 4, 3 mutations.
"""

from __future__ import annotations

import random
from typing import Callable

import numpy as np

from moejax.allocation.method import RANKING, Allocation, Budget, register
from moejax.errors import ConfigError

PATTERNS = ("uniform", "random", "up", "down", "mid", "mid-neg", "front-heavy", "back-heavy", "block-early",
            "block-late", "alt", "deep-flat")


def pattern_weights(pattern: str, n: int, rng: random.Random) -> list[float]:
    """EvoESAP's `_pattern_weights`: how an initial candidate spreads the pruning over n layers."""
    mid = (n - 1) / 2
    cutoff = max(1, n // 4)
    if pattern == "random":
        return [rng.random() + 1e-4 for _ in range(n)]
    return {
        "up": lambda: [i + 1 for i in range(n)],
        "down": lambda: [n - i for i in range(n)],
        "mid": lambda: [mid - abs(i - mid) + 1 for i in range(n)],
        "mid-neg": lambda: [abs(i - mid) + 1 for i in range(n)],
        "front-heavy": lambda: [pow(0.7, i) + 1e-4 for i in range(n)],
        "back-heavy": lambda: [pow(1.3, i) for i in range(n)],
        "block-early": lambda: [2.0 if i < cutoff else 1.0 for i in range(n)],
        "block-late": lambda: [2.0 if i >= n - cutoff else 1.0 for i in range(n)],
        "alt": lambda: [2.0 if i % 2 == 0 else 1.0 for i in range(n)],
        "deep-flat": lambda: [0.5 + 0.5 * (1 - abs((2 * i / max(n - 1, 1)) - 1)) for i in range(n)],
    }.get(pattern, lambda: [1.0] * n)()


def allocate_budget(weights, capacities, budget: int) -> list[int]:
    """EvoESAP's `_allocate_budget`: `budget` spread over the layers in proportion to `weights`,
    floored, each within its capacity; the rest by largest fractional part, then round robin."""
    n = len(capacities)
    total = float(sum(weights)) or float(n)
    desired = [budget * (w / total) for w in weights]
    alloc = [min(int(d), capacities[i]) for i, d in enumerate(desired)]
    remaining = budget - sum(alloc)
    fractional = sorted(((i, desired[i] - alloc[i]) for i in range(n) if alloc[i] < capacities[i]),
                        key=lambda x: x[1], reverse=True)
    for i, _ in fractional:
        if remaining <= 0:
            break
        alloc[i] += 1
        remaining -= 1
    while remaining > 0:
        progressed = False
        for i in range(n):
            if remaining > 0 and alloc[i] < capacities[i]:
                alloc[i] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ConfigError(f"evo_esap: cannot place a pruning budget of {budget} within the layers' "
                              f"capacities {list(capacities)}")
    return alloc


def mutate(plan, capacities, rng: random.Random, max_delta: int, mutations: int, attempts: int) -> list[int]:
    """EvoESAP's `mutate_plan` (its odd-even option aside): moves of pruned experts between layers."""
    child = list(plan)
    successes = tried = 0
    desired = max(mutations, 1)
    target = min(rng.randint(1, desired), rng.randint(1, desired))
    while successes < target and tried < attempts:
        tried += 1
        decrease = [i for i, v in enumerate(child) if v > 0]
        increase = [i for i, cap in enumerate(capacities) if child[i] < cap]
        if not decrease or not increase:
            break
        src, dst = rng.choice(decrease), rng.choice(increase)
        if src == dst and len(increase) > 1:
            continue
        delta = rng.randint(1, max(max_delta, 1))
        if child[src] - delta < 0 or child[dst] + delta > capacities[dst]:
            continue
        child[src] -= delta
        child[dst] += delta
        successes += 1
    return child


def evolutionary_search(capacities, budget: int, fitness: Callable, *, population: int, survivors: int,
                        generations: int, max_delta: int, mutations: int, attempts: int, seed: int) -> dict:
    """{"best": pruned per layer, "best_score", "history": per generation its candidates and
    scores, "evaluated": candidates scored}; fitness(candidates [P, L] of pruned counts) -> [P]."""
    rng = random.Random(seed)
    size = max(population, len(PATTERNS), 1)
    keep_n = max(1, min(survivors, size))
    patterns = list(PATTERNS) + ["random"] * (size - len(PATTERNS))
    pop = [allocate_budget(pattern_weights(p, len(capacities), rng), capacities, budget) for p in patterns]
    cache: dict = {}
    best, best_score, history = None, -np.inf, []
    for generation in range(generations + 1):
        new = list(dict.fromkeys(tuple(p) for p in pop if tuple(p) not in cache))
        if new:
            for plan, score in zip(new, np.asarray(fitness(np.asarray(new, np.int64)), np.float64)):
                cache[plan] = float(score)
        scored = sorted(((cache[tuple(p)], i, p) for i, p in enumerate(pop)), key=lambda s: (-s[0], s[1]))
        if scored[0][0] > best_score:
            best_score, best = scored[0][0], list(scored[0][2])
        history.append({"generation": generation, "candidates": [list(p) for p in pop],
                        "scores": [cache[tuple(p)] for p in pop], "new": len(new)})
        if generation == generations:
            break
        elites = [list(s[2]) for s in scored[:keep_n]]
        pop = [list(e) for e in elites]
        while len(pop) < size:
            pop.append(mutate(rng.choice(elites), capacities, rng, max_delta, mutations, attempts))
    return {"best": best, "best_score": best_score, "history": history, "evaluated": len(cache)}


@register("evo_esap")
class EvoEsap(Allocation):
    """EvoESAP's search (module doc); `fitness_sequences`: the calibration sequences held apart for
    the fitness (the last ones), never used for the scores."""

    population: int = 8
    survivors: int = 4
    generations: int = 4
    max_delta: int = 2
    mutations: int = 1
    attempts: int = 32
    seed: int = 42
    fitness_sequences: int = 8

    reads = RANKING
    searches = True

    def check_settings(self) -> None:
        for name in ("population", "survivors", "max_delta", "mutations", "attempts", "fitness_sequences"):
            if getattr(self, name) < 1:
                raise ConfigError(f"allocation evo_esap: {name}={getattr(self, name)} must be >= 1")
        if self.generations < 0:
            raise ConfigError(f"allocation evo_esap: generations={self.generations} must be >= 0")
        if self.seed < 0:
            raise ConfigError(f"allocation evo_esap: seed={self.seed} must be >= 0")
        if self.survivors > max(self.population, len(PATTERNS)):
            raise ConfigError(f"allocation evo_esap: survivors={self.survivors} exceeds the population "
                              f"(max(population={self.population}, {len(PATTERNS)} patterns))")

    def held_apart(self, n_sequences: int, where: str = "calibration") -> int:
        """How many of `n_sequences` calibration sequences the fitness takes (the last ones), refused
        when none would be left to score by."""
        if self.fitness_sequences >= n_sequences:
            raise ConfigError(f"allocation evo_esap: fitness_sequences={self.fitness_sequences} holds apart every "
                              f"one of the {n_sequences} {where} sequences; give more calibration tokens or fewer "
                              "fitness sequences (allocations.evo_esap.fitness_sequences / --allocation-setting)")
        return self.fitness_sequences

    def split(self, ids):
        """(scoring sequences, fitness sequences) of calibration ids [N, S]: the last
        `fitness_sequences` held apart (`held_apart`)."""
        n = self.held_apart(len(ids))
        return ids[:-n], ids[-n:]

    def searched(self, budget: Budget, fitness: Callable) -> tuple[dict, dict]:
        """({layer: count} of the search's best, checked against the budget; its record: best ESAP,
        candidates scored and seconds spent by `fitness` (an `EsapFitness`) in this search,
        generations). Refused when no candidate scored finitely (every one unroutable)."""
        before = (fitness.evaluated, fitness.seconds)
        run = self.search(budget, fitness)
        if not np.isfinite(run["best_score"]):
            raise ConfigError(f"allocation {self.name}: no candidate it scored keeps every token routable under the "
                              "model's routing groups")
        return budget.check(run["counts"], self.name), {
            "best_esap": run["best_score"], "candidates": fitness.evaluated - before[0],
            "seconds": fitness.seconds - before[1], "generations": len(run["history"]) - 1}

    def search(self, budget: Budget, fitness: Callable) -> dict:
        """The search's record (`evolutionary_search`) over the budget and its best as kept `counts`
        {layer: count}; fitness takes kept counts [P, L]."""
        layers = budget.layers
        capacities = [budget.n_experts[l] - budget.minimum for l in layers]
        pruned = sum(budget.n_experts[l] - budget.keep[l] for l in layers)
        full = np.asarray([budget.n_experts[l] for l in layers], np.int64)
        run = evolutionary_search(capacities, pruned, lambda p: fitness(full[None] - p), population=self.population,
                                  survivors=self.survivors, generations=self.generations, max_delta=self.max_delta,
                                  mutations=self.mutations, attempts=self.attempts, seed=self.seed)
        best = run["best"]   # None when no candidate scored finitely
        return {**run, "counts": None if best is None else {l: budget.n_experts[l] - int(p) for l, p in zip(layers, best)}}

    def counts(self, budget: Budget, statistic=None, fitness=None) -> dict[int, int]:
        if fitness is None:
            raise ConfigError("allocation evo_esap: it needs a fitness of candidate allocations (ESAP on calibration "
                              "tokens held apart), which only a calibration pass builds")
        return self.search(budget, fitness)["counts"]

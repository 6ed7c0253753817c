"""Shared by the benchmark scripts: the best of several timed runs (the machine is noisy)."""

import time


def best_of(fn, repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def best_alternating(fns, repeat: int = 3) -> list[float]:
    """The best of `repeat` runs of each function, run in turn (a, b, a, b, ...), so that a slow
    spell of the machine lands on all of them rather than on whichever ran during it."""
    best = [float("inf")] * len(fns)
    for _ in range(repeat):
        for i, fn in enumerate(fns):
            best[i] = min(best[i], best_of(fn, 1))
    return best

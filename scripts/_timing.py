"""Shared by the benchmark scripts: the best of several timed runs (the machine is noisy)."""

import time


def best_of(fn, repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best

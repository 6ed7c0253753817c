"""Shared by the benchmark scripts: the best of several timed runs (the machine is noisy), and an
older commit's code to run beside this checkout's."""

import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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


def old_source(ref: str, into: Path) -> Path:
    """The package and Hydra configs of git ref `ref` (`git archive`), extracted under `into`/old: put
    it first on a child process's PYTHONPATH to run that code in this environment."""
    old = Path(into) / "old"
    old.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "moejax", "conf"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(old)], input=archive, check=True)
    return old

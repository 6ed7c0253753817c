"""Several processes, each on its own core: what measured fastest on CPUs for the small programs of
the skills experiments (a width-128 model leaves two cores shared by one program idle much of the
time; `docs/benchmarks.md`). `pool` starts them with the spawn method (JAX starts after the
pinning, in a fresh interpreter), each pinned to the next core, round robin."""

from __future__ import annotations

import concurrent.futures
import logging
import multiprocessing
import os


def available_cores() -> list[int]:
    """The cores this process may run on."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def pool(n_workers: int, initializer=None, initargs=()) -> concurrent.futures.ProcessPoolExecutor:
    """A pool of n_workers spawned processes, worker i pinned to core i (round robin) before
    `initializer(i, *initargs)` runs in it."""
    context = multiprocessing.get_context("spawn")
    counter = context.Value("i", 0)
    return concurrent.futures.ProcessPoolExecutor(n_workers, mp_context=context, initializer=_start,
                                                  initargs=(counter, available_cores(), initializer, initargs))


def _start(counter, available: list[int], initializer, initargs) -> None:
    with counter.get_lock():
        index = counter.value
        counter.value += 1
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {available[index % len(available)]})
    logging.basicConfig(level=logging.WARNING, format=f"[worker {index}] %(message)s")
    logging.getLogger("moejax").setLevel(logging.INFO)   # moejax's own lines, not its libraries'
    if initializer is not None:
        initializer(index, *initargs)


def each_share(n_workers: int, task, desc: str, progress=None, initializer=None, initargs=()) -> list:
    """[task((i, n_workers)) for i in range(n_workers)], each call in a process of its own (`pool`),
    in share order; a failure in one stops the others."""
    from tqdm import tqdm

    done = {}
    with pool(n_workers, initializer, initargs) as executor:
        futures = {executor.submit(task, (i, n_workers)): i for i in range(n_workers)}
        try:
            for future in tqdm(concurrent.futures.as_completed(futures), total=n_workers, desc=desc,
                               disable=progress is None):
                done[futures[future]] = future.result()
        except BaseException:
            stop(executor, futures)
            raise
    return [done[i] for i in range(n_workers)]


def stop(executor: concurrent.futures.ProcessPoolExecutor, futures) -> None:
    """Cancel what has not started and end the running workers now (not at their task's end)."""
    for f in futures:
        f.cancel()
    for p in list(getattr(executor, "_processes", {}).values()):
        p.terminate()

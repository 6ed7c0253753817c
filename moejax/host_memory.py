"""Host memory for the streamed passes, which hold one layer's weights at a time and must stay
within a laptop's memory (3 GB for Moonlight-16B-A3B, `docs/benchmarks.md`):

    aligned_empty(shape, dtype)   an uninitialised numpy array whose data starts on a 64-byte
                                  boundary: `jax.device_put` on the CPU then uses it in place
                                  instead of copying it (numpy's large arrays start 16 bytes past
                                  a page, which JAX copies; `jnp.asarray` always copies)
    release_free_memory()         hands the C heap's free pages back to the system (glibc's
                                  `malloc_trim`); a streamed pass frees a layer's weights, a merge's
                                  experts and the streams' buffers, whose pages would otherwise stay
                                  resident for later allocations (0.4 GB at Moonlight's shape)

    limit_malloc_arenas()         at most 2 glibc malloc arenas (its default on 2 cores is 16: every
                                  XLA thread's allocations then fragment a heap of their own); run
                                  when this module is imported, before JAX starts its threads.
                                  The article's pass with both merges at Moonlight's shape: 2,968
                                  -> 2,638 MB. MOEJAX_MALLOC_ARENAS=0 leaves glibc's default.

An array from `aligned_empty` handed to `jax.device_put` is the JAX array's memory: it must not be
written after that.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import os

import numpy as np

from moejax.errors import ConfigError

ALIGNMENT = 64   # bytes: what XLA's CPU client needs to use a host buffer in place


def aligned_empty(shape, dtype) -> np.ndarray:
    """np.empty(shape, dtype), its data 64-byte aligned."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % ALIGNMENT
    return raw[start:start + nbytes].view(dtype).reshape(shape)


@functools.cache
def _libc_function(name: str):
    """glibc's function `name`, or None where the C library has none (musl, macOS)."""
    lib = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(lib), name) if lib else None
    except (OSError, AttributeError):
        return None


M_ARENA_MAX = -8   # glibc's mallopt parameter


def limit_malloc_arenas(n: int | None = None) -> bool:
    """At most `n` glibc malloc arenas (default MOEJAX_MALLOC_ARENAS, else 2; 0: leave glibc's
    default). Threads that have no arena yet share these. glibc fixes its arena limit when it
    first needs one beyond the first few, so this acts only if called before then (this module
    calls it when imported). Returns whether the C library took it."""
    if n is None:
        value = os.environ.get("MOEJAX_MALLOC_ARENAS", "2")
        try:
            n = int(value or 0)
        except ValueError:
            raise ConfigError(f"MOEJAX_MALLOC_ARENAS={value!r}: expected a whole number of glibc malloc arenas "
                              "(0: glibc's default)") from None
    mallopt = _libc_function("mallopt")
    return bool(n > 0 and mallopt is not None and mallopt(M_ARENA_MAX, n) == 1)


def release_free_memory() -> None:
    """Free what JAX still holds for nothing, then return the C heap's free pages to the system where
    the C library can (glibc). A youngest-generation garbage collection runs Python's gc callbacks,
    jaxlib's among them, which drops the Python references XLA's threads let go of (they cannot
    drop them without the GIL): a `device_put`-aliased numpy buffer, such as a layer's weights
    (1.2 GB at Moonlight's shape), stays allocated after its JAX array is gone until then."""
    gc.collect(0)
    trim = _libc_function("malloc_trim")
    if trim is not None:
        trim(0)


limit_malloc_arenas()

"""moejax.host_memory: aligned host buffers are used in place by JAX; release_free_memory runs the
gc callbacks in which jaxlib frees what XLA's threads let go of."""

import gc

import jax
import numpy as np

from moejax.host_memory import ALIGNMENT, aligned_empty, release_free_memory


def test_aligned_buffer_is_used_in_place():
    host = aligned_empty((257, 33), np.float32)
    assert host.ctypes.data % ALIGNMENT == 0
    host[...] = 1.0
    on_device = jax.device_put(host)
    assert on_device.unsafe_buffer_pointer() == host.ctypes.data


def test_release_runs_the_gc_callbacks_jaxlib_frees_buffers_in():
    """jaxlib queues the Python references XLA's threads let go of (a device_put-aliased numpy
    buffer: a layer's weights) and drops them in its gc callback; release_free_memory must run the
    callbacks (a pass at Moonlight's shape kept 1.2 GB resident between layers without it). Whether
    a given reference is queued depends on XLA's threads, so this checks the callbacks run."""
    assert any("xla" in getattr(cb, "__name__", "") for cb in gc.callbacks), "jaxlib's gc callback is not registered"
    seen = []

    def callback(phase, info):
        seen.append(phase)

    gc.callbacks.append(callback)
    try:
        release_free_memory()
    finally:
        gc.callbacks.remove(callback)
    assert "start" in seen and "stop" in seen


ARENAS_CHILD = r"""
import ctypes, ctypes.util, sys, tempfile, threading
import moejax.host_memory   # noqa: F401  (limits the arenas when imported)
import numpy as np
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.fopen.restype = ctypes.c_void_p
libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
libc.fclose.argtypes = [ctypes.c_void_p]
n = 8
barrier, kept = threading.Barrier(n + 1), []
def work():   # each thread allocates while all of them are alive: each would get an arena of its own
    kept.append([np.ones(4096) for _ in range(64)])
    barrier.wait()
    barrier.wait()
threads = [threading.Thread(target=work) for _ in range(n)]
for t in threads:
    t.start()
barrier.wait()
path = tempfile.mktemp()
fp = libc.fopen(path.encode(), b"w")
libc.malloc_info(0, fp)
libc.fclose(fp)
barrier.wait()
for t in threads:
    t.join()
print(open(path).read().count("<heap nr="))
"""


def test_importing_host_memory_limits_glibc_to_two_malloc_arenas():
    """Eight threads allocating at once get at most two arenas once moejax.host_memory is imported
    (glibc's default on this machine gives them one each: the fragmentation that held 330 MB in the
    article's pass); MOEJAX_MALLOC_ARENAS=0 leaves the default, which the test also runs, to show
    it can tell."""
    import ctypes.util
    import os
    import subprocess
    import sys

    import pytest

    if ctypes.util.find_library("c") is None or not hasattr(ctypes.CDLL(ctypes.util.find_library("c")), "malloc_info"):
        pytest.skip("not glibc")

    def heaps(value):
        env = {**os.environ, "MOEJAX_MALLOC_ARENAS": value}
        out = subprocess.run([sys.executable, "-c", ARENAS_CHILD], env=env, check=True, capture_output=True, text=True)
        return int(out.stdout.strip().splitlines()[-1])

    assert heaps("2") <= 2
    assert heaps("0") > 2


def test_a_bad_malloc_arenas_value_is_a_clear_error():
    """MOEJAX_MALLOC_ARENAS that is not a whole number stops the import with an error naming the
    variable and its value (not a silent default)."""
    import os
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", "import moejax.host_memory"], capture_output=True, text=True,
                         env={**os.environ, "MOEJAX_MALLOC_ARENAS": "two"})
    assert out.returncode != 0
    assert "ConfigError: MOEJAX_MALLOC_ARENAS='two'" in out.stderr

import os

import pytest

# Before JAX is imported anywhere: eight simulated CPU devices for mesh tests, and no persistent
# compilation cache writes from the test suite into the user's home.
#
# XLA:CPU compiles at -O0 unless MOEJAX_TEST_OPTIMIZED=1: the default set is mostly compilation, and
# at -O0 it ran in 10 min 32 s against 15 min 19 s (2 cores, 2026-12-03), every test passing. CI
# (.ci/run) sets MOEJAX_TEST_OPTIMIZED=1, so every test also runs on the programs users run.
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    _flags += " --xla_force_host_platform_device_count=8"
if os.environ.get("MOEJAX_TEST_OPTIMIZED", "") in ("", "0") and "xla_backend_optimization_level" not in _flags:
    _flags += " " + FAST_COMPILE
os.environ["XLA_FLAGS"] = _flags.strip()
os.environ.setdefault("MOEJAX_JAX_CACHE", "")


def pytest_configure(config):
    """One persistent XLA compilation cache for the whole test session, in a fresh temporary folder
    (every xdist worker inherits the controller's): a test that rebuilds a jitted function of a
    program another test (or itself) already compiled loads it instead of compiling it again.
    Numerics are unchanged (the same executable); nothing is written outside the session's folder."""
    import tempfile

    if "MOEJAX_TEST_XLA_CACHE" not in os.environ:
        os.environ["MOEJAX_TEST_XLA_CACHE"] = config._moejax_xla_cache = tempfile.mkdtemp(prefix="moejax-test-xla-")
    import jax

    jax.config.update("jax_compilation_cache_dir", os.environ["MOEJAX_TEST_XLA_CACHE"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)


def pytest_unconfigure(config):
    """The session's compilation cache removed by the process that made it."""
    import shutil

    made = getattr(config, "_moejax_xla_cache", None)
    if made:
        shutil.rmtree(made, ignore_errors=True)



def _memory_maps() -> int:
    """How many memory mappings this process holds (0 where /proc is not there)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


MAPS_CLEARED_ABOVE = 40_000   # mappings: JAX's caches cleared within a file past this (the limit is 65,530)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After a test file's last test (its module fixtures torn down), or any test that leaves the
    process holding more than MAPS_CLEARED_ABOVE memory mappings: JAX's caches cleared and garbage
    collected, so compiled executables no test still uses are freed. Each XLA:CPU executable holds
    memory mappings; a worker that ran half the suite without freeing them reached the kernel's
    limit (vm.max_map_count, 65,530), and the next compile or cache load failed to map and
    segfaulted (CI and local runs; tests/test_families.py alone leaves 26,700, and clearing after it
    leaves under 4,000). A fixture's model stays; its jitted functions compile again when called."""
    yield
    if nextitem is None or nextitem.module is not item.module or _memory_maps() > MAPS_CLEARED_ABOVE:
        import gc

        import jax

        jax.clear_caches()
        gc.collect()

import os

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

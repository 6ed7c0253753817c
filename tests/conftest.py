import os

# Before JAX is imported anywhere: eight simulated CPU devices for mesh tests, and no persistent
# compilation cache writes from the test suite into the user's home.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("MOEJAX_JAX_CACHE", "")


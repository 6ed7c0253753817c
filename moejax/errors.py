"""One exception family, so callers can catch moejax's own errors and nothing else."""


class MoejaxError(Exception):
    """Base of every error moejax raises on purpose."""


class ConfigError(MoejaxError, ValueError):
    """A setting is missing, unknown or out of range. The message names the key and what was expected."""

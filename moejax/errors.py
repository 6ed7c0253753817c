"""One exception family, so callers can catch moejax's own errors and nothing else."""


class MoejaxError(Exception):
    """Base of every error moejax raises on purpose."""


class ConfigError(MoejaxError, ValueError):
    """A setting is missing, unknown or out of range. The message names the key and what was expected."""


class CheckpointError(MoejaxError):
    """A checkpoint on disk is missing, corrupt, or disagrees with what was expected. The message
    names the file and tensor, and what was expected."""

"""One exception family, so callers can catch moejax's own errors and nothing else."""


class MoejaxError(Exception):
    """Base of every error moejax raises on purpose."""


class ConfigError(MoejaxError, ValueError):
    """A setting is missing, unknown or out of range. The message names the key and what was expected."""


class CheckpointError(MoejaxError):
    """A checkpoint on disk is missing, corrupt, or disagrees with what was expected. The message
    names the file and tensor, and what was expected."""


class WriteError(MoejaxError, OSError):
    """An output could not be written (disk full, quota, read-only, I/O error). Still an OSError
    with the OS's errno (a command exits 1, as for any OS error), but its message names the
    destination, which the OS's own error often does not (a failed write() names no file)."""


def write_error(destination, error: OSError) -> WriteError:
    """`error` (raised while writing `destination`) as a WriteError naming the destination (and
    the file the OS named, when it named one)."""
    what = error.strerror or str(error)
    if error.filename is not None and str(error.filename) != str(destination):
        what += f": {error.filename}"
    message = f"{destination}: could not be written ({what}); nothing was written there"
    return WriteError(error.errno, message) if error.errno is not None else WriteError(message)

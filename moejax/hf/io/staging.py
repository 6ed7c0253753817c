"""Publishing an output folder atomically: it is written into a hidden, marked staging folder beside
its destination and renamed into place only when complete (`staged_directory`), so a destination
is either the complete new folder or untouched. Also the checks on a destination made before any
work (`check_destination`) and the removal of staging folders a killed run left behind
(`remove_stale_staging`, `moejax clean`).
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import secrets
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path

from moejax.errors import CheckpointError, MoejaxError, write_error
from moejax.signals import KillSwitch

STAGING_MARKER = ".moejax-staging"  # inside every staging folder: who made it, so a later run may remove it


@contextlib.contextmanager
def staged_directory(out_dir: Path, overwrite: bool) -> Iterator[Path]:
    """A hidden sibling folder to write into; renamed to out_dir when the block completes, removed
    when it raises, is interrupted (Ctrl-C) or terminated (SIGTERM: `moejax.signals.KillSwitch`
    turns both into `Killed`), so out_dir is either complete or untouched. A SIGKILL cannot be caught: the folder's marker file lets the next run for the same
    out_dir (or `moejax clean`) remove it once its process is gone. An OSError inside (disk full)
    is raised as a `moejax.errors.WriteError` naming out_dir (errno kept)."""
    out_dir = Path(out_dir)
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise CheckpointError(f"{out_dir.parent}: cannot create the output's parent folder: {error}") from error
    remove_stale_staging(out_dir.parent, out_dir.name)
    staging = out_dir.parent / f".{out_dir.name}.tmp-{secrets.token_hex(6)}"
    with KillSwitch() as switch:
        try:
            staging.mkdir()
            (staging / STAGING_MARKER).write_text(json.dumps(
                {"pid": os.getpid(), "host": socket.gethostname(), "destination": out_dir.name}) + "\n")
            yield staging
            switch.check()
            (staging / STAGING_MARKER).unlink()
            _move_into_place(staging, out_dir, overwrite)
        except BaseException as error:
            switch.stopped = True  # a second signal must not interrupt the clean-up
            shutil.rmtree(staging, ignore_errors=True)
            if isinstance(error, OSError) and not isinstance(error, MoejaxError):  # disk full: name the output
                raise write_error(out_dir, error) from error
            raise


def remove_stale_staging(folder: Path, destination: str | None = None) -> list[Path]:
    """Remove the staging folders in `folder` (those for `destination` only, when given) that
    moejax made (marker file inside) and whose process is gone (same host, pid not running).
    Nothing else is touched: no marker, another host, or a live process means leave it. Returns
    the folders removed."""
    removed = []
    pattern = f".{destination}.tmp-*" if destination else ".*.tmp-*"
    for candidate in sorted(Path(folder).glob(pattern)):
        marker = candidate / STAGING_MARKER
        if candidate.is_symlink() or not candidate.is_dir() or not marker.is_file():
            continue
        try:
            owner = json.loads(marker.read_text(encoding="utf-8"))
            pid, host = int(owner["pid"]), owner["host"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if host != socket.gethostname() or _process_alive(pid):
            continue
        shutil.rmtree(candidate, ignore_errors=True)
        removed.append(candidate)
    return removed


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def check_apart(output, inputs, what: str = "the output") -> None:
    """The one check that an output never harms an input: refuse an `output` path equal to, inside,
    or holding any of `inputs` (writing it would write into an input, or delete one by replacing a
    folder that holds it). Inputs are paths (nested lists flattened, None skipped), taken literally:
    text given as globs goes through `text_inputs` first. Symbolic links are followed, so a link to
    an input is the input. Every command and experiment that writes runs it before any work."""
    target = Path(output).expanduser().resolve()
    for given in _input_paths(inputs):
        source = Path(given).expanduser().resolve()
        if target == source:
            relation = "is"
        elif target.is_relative_to(source):
            relation = "is inside"
        elif source.is_relative_to(target):
            relation = "holds"
        else:
            continue
        raise CheckpointError(f"{output}: {what} {relation} the input {given}; refusing to write "
                              f"{'into' if relation != 'holds' else 'over'} an input: choose another destination")


def _input_paths(inputs) -> list:
    if inputs is None or isinstance(inputs, (str, os.PathLike)):
        inputs = [inputs]
    paths = []
    for given in inputs:
        if isinstance(given, (list, tuple)):
            paths += _input_paths(given)
        elif given is not None:
            paths.append(given)
    return paths


def text_inputs(text) -> list:
    """Text inputs as `moejax.data.text_files` reads them (files, folders, or globs standing for
    every path they match), as the paths `check_apart` protects; None for none."""
    paths = []
    for given in [] if text is None else [text] if isinstance(text, (str, os.PathLike)) else text:
        given = str(given)
        paths += sorted(glob.glob(os.path.expanduser(given), recursive=True)) if any(c in given for c in "*?[") \
            else [given]
    return paths


def check_destination(out_dir: Path, overwrite: bool, inputs=()) -> None:
    """Refuse before any work: a path equal to, inside or holding any of the command's inputs
    (`check_apart`), an existing folder without overwrite, a symbolic link (replacing it would
    delete or write through a folder elsewhere), or a parent that cannot be written."""
    out_dir = Path(out_dir)
    check_apart(out_dir, inputs, "DST")
    if out_dir.is_symlink():
        raise CheckpointError(f"{out_dir}: is a symbolic link (to {os.readlink(out_dir)}); refusing to replace "
                              "it or write through it: remove the link or choose another destination")
    if out_dir.exists() and not overwrite:
        raise CheckpointError(f"{out_dir}: already exists; pass --overwrite (overwrite=True) to replace it")
    if out_dir.exists() and not out_dir.is_dir():
        raise CheckpointError(f"{out_dir}: exists and is not a directory")
    parent = next((p for p in out_dir.absolute().parents if p.exists()), None)
    if parent is not None and (not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK)):
        raise CheckpointError(f"{out_dir}: cannot be created: {parent} is not a writable folder")


def _move_into_place(staging: Path, out_dir: Path, overwrite: bool) -> None:
    """Rename the finished folder to out_dir; an old out_dir (overwrite) is moved aside first and
    deleted only once the new one is in place, and restored if the rename fails."""
    if not out_dir.exists():
        staging.rename(out_dir)
        return
    if not overwrite:  # appeared while we were writing
        raise CheckpointError(f"{out_dir}: already exists; pass --overwrite (overwrite=True) to replace it")
    if (out_dir / STAGING_MARKER).is_file():  # out_dir is an outer write's staging folder: keep it marked
        shutil.copyfile(out_dir / STAGING_MARKER, staging / STAGING_MARKER)
    retired = out_dir.parent / f".{out_dir.name}.old-{secrets.token_hex(6)}"
    out_dir.rename(retired)
    try:
        staging.rename(out_dir)
    except BaseException:
        retired.rename(out_dir)
        raise
    shutil.rmtree(retired)

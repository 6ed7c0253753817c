"""Results on disk: atomic writers, and `load`, which turns a run or sweep folder into one pandas
DataFrame. Never imports JAX, so a notebook can load results without it."""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
import signal
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from moejax.errors import MoejaxError, write_error

if TYPE_CHECKING:  # pandas is imported where it is used: a job imports it while its JAX compiles
    import pandas as pd


class ResultsWarning(UserWarning):
    """`load` skipped a job folder (or part of one) and says which and why."""


@contextlib.contextmanager
def _signals_held():
    """Hold SIGINT/SIGTERM back (they are delivered on exit) so that creating a temporary file and
    remembering its name cannot be torn apart by a kill: otherwise the file would be left behind."""
    held = {signal.SIGINT, signal.SIGTERM}
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _atomic_write(path: Path, write) -> None:
    """`write(tmp)` into a new hidden sibling `.NAME.<random>.tmp`, then rename it over `path`.

    The sibling is created with mode 0o666 so that the umask (and a default ACL) set its
    permissions as for any new file: a shared $MOEJAX_OUT stays readable by colleagues (mkstemp's
    0o600 did not). It is removed on any exception, a signal's included."""
    path = Path(path)
    tmp = None
    try:
        candidate = path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp"  # 48 random bits: no retry
        with _signals_held():
            os.close(os.open(candidate, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            tmp = candidate
        write(tmp)
        os.replace(tmp, path)
        tmp = None
    except OSError as error:
        if isinstance(error, MoejaxError):
            raise
        raise write_error(path, error) from error  # disk full: name the output, not (or not only) the temporary
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def check_output_file(path) -> Path:
    """Make sure a result file can be written before the work that produces it: its folder is
    created and a probe file written and removed there. Raises a one-line MoejaxError naming
    the path and the OS error (read-only, missing permission, disk full, a file in the way)."""
    path = Path(path)
    if path.is_dir():
        raise MoejaxError(f"{path}: is a folder; expected a file path for the output")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        probe = path.parent / f".{path.name}.probe-{secrets.token_hex(4)}"
        probe.write_bytes(b"0" * 4096)
        probe.unlink()
    except OSError as error:
        raise MoejaxError(f"{path}: cannot write the output here: {error}") from error
    return path


def write_json_atomic(path: Path, obj: dict) -> None:
    _atomic_write(path, lambda tmp: Path(tmp).write_text(json.dumps(obj, indent=1, default=str)))


def write_text_atomic(path: Path, text: str) -> None:
    _atomic_write(path, lambda tmp: Path(tmp).write_text(text))


def write_parquet_atomic(df: pd.DataFrame, path: Path) -> None:
    _atomic_write(path, lambda tmp: df.to_parquet(tmp, index=False))


def job_dirs(root: Path) -> list[Path]:
    """Every job folder (one holding results.parquet or status.json) under `root`, itself included."""
    root = Path(root)
    found = {p.parent for name in ("results.parquet", "status.json") for p in root.rglob(name)}
    return sorted(found, key=lambda d: (_job_num(d), str(d)))


def _job_num(d: Path) -> int:
    try:
        return int(d.name)
    except ValueError:
        return -1


def _overrides(d: Path) -> dict:
    """The job's command-line overrides (from Hydra's .hydra/overrides.yaml), typed by Hydra's parser."""
    path = d / ".hydra" / "overrides.yaml"
    if not path.is_file():
        return {}
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    lines = OmegaConf.to_container(OmegaConf.load(path))
    out = {}
    for ov in OverridesParser.create().parse_overrides(lines):
        if ov.is_delete() or ov.key_or_group.startswith("hydra"):
            continue
        value = ov.value()
        out[ov.key_or_group] = value if value is None or isinstance(value, (str, int, float, bool)) else str(value)
    return out


class _Skip(Exception):
    """This job folder gives no rows; the message says why."""


def _read_status(d: Path) -> dict | None:
    """The job's status.json as a dict, None when there is none; _Skip when it cannot be read."""
    path = d / "status.json"
    try:
        status = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _Skip(f"status.json is unreadable ({type(exc).__name__}: {exc})") from None
    if not isinstance(status, dict) or not isinstance(status.get("status"), str):
        raise _Skip(f"status.json is not a status record (no \"status\" string): {str(status)[:80]!r}")
    return status


def _not_completed(status: dict | None) -> str:
    """Why a job did not complete, from its status record."""
    if status is None:
        return "no status.json (still running, or ended without notice, e.g. SIGKILL or out of memory)"
    kind = status["status"]
    if kind == "failed":
        return f"failed: {status.get('error', '?')}"
    if kind == "killed":
        seconds = status.get("seconds")
        return f"killed by {status.get('signal', '?')}" + (f" after {seconds} s" if seconds is not None else "")
    return f"status {kind!r}"


def _float_values(values: pd.Series, d: Path, problems: list[str]) -> pd.Series:
    """The `value` column as float64 (so that jobs of different schemas concatenate to a numeric
    column). A value that is not a number becomes NaN and is reported, never dropped silently."""
    import pandas as pd

    if pd.api.types.is_numeric_dtype(values) and not pd.api.types.is_complex_dtype(values):
        return values.astype("float64")  # int, bool, Int64/Float64 (pd.NA -> NaN)

    bad = []

    def number(v):
        if v is None or v is pd.NA or (isinstance(v, float) and math.isnan(v)):
            return math.nan
        try:
            return float(v)  # numbers, numpy scalars, Decimal, numeric strings
        except (TypeError, ValueError):
            bad.append(v)
            return math.nan

    out = pd.Series([number(v) for v in values], index=values.index, dtype="float64")
    if bad:
        examples = ", ".join(repr(v) for v in list(dict.fromkeys(map(str, bad)))[:3])
        problems.append(f"{d}: {len(bad)} non-numeric 'value'(s) read as NaN (e.g. {examples})")
    return out


# The variants table's column names before `moejax.variants.VariantSpec` (old name -> today's).
LEGACY_COLUMNS = {"score": "method", "mode": "form"}


def legacy_variant_columns(df: pd.DataFrame) -> pd.DataFrame:
    """A variants table written before `moejax.variants.VariantSpec` (prune_real and eval_tasks jobs
    whose columns were `mode` for the form and `score` for the method) with today's names, so old
    job folders load beside new ones; any other table unchanged."""
    if "mode" not in df.columns or "form" in df.columns:
        return df
    return df.rename(columns=LEGACY_COLUMNS)


def load(path, status: str | None = "completed") -> pd.DataFrame:
    """One tidy DataFrame from a run folder or a multirun sweep folder.

    Rows come from each job's results.parquet; columns added: `job` (Hydra job number, -1 for a
    single run), `job_dir`, and every override of the job. An override whose name is already a
    results column (e.g. `keep`, whose results column holds the resolved count) is added as
    `override.<name>`. Jobs whose status is not `status` are skipped (status=None keeps all that
    have results). `value` is always float64.

    What is readable is loaded; one `ResultsWarning` lists every job folder that was skipped or
    repaired and why (a corrupt results.parquet or status.json, a failed, killed or unfinished
    job, non-numeric values). Raises MoejaxError when no job gives any rows.
    """
    import pandas as pd

    root = Path(path)
    if not root.exists():
        raise MoejaxError(f"results folder {root} does not exist")
    frames, problems = [], []
    dirs = job_dirs(root)
    for d in dirs:
        try:
            df = _load_job(d, status, problems)
        except _Skip as exc:
            problems.append(f"{d}: {exc}")
            continue
        if df is not None:
            frames.append(df)
    if not frames:
        why = "".join(f"\n  {p}" for p in problems[:20]) + ("\n  ..." if len(problems) > 20 else "")
        wanted = "job" if status is None else f"{status} job"
        raise MoejaxError(f"no {wanted} with a readable results.parquet under {root}"
                          f" ({len(dirs)} job folder(s) found){why}")
    if problems:
        warnings.warn(f"moejax.results.load({str(root)!r}): {len(problems)} problem(s), loaded "
                      f"{len(frames)} of {len(dirs)} job folder(s):" + "".join(f"\n  {p}" for p in problems),
                      ResultsWarning, stacklevel=2)
    out = pd.concat(frames, ignore_index=True)
    if "value" in out.columns:
        out["value"] = out["value"].astype("float64")  # NaN where a job had no value column
    return out


def _load_job(d: Path, status: str | None, problems: list[str]) -> pd.DataFrame | None:
    """The rows of one job folder, None when it is (silently) filtered out; _Skip with the reason
    when it should have given rows and did not."""
    import pandas as pd

    try:
        record = _read_status(d)
    except _Skip as exc:
        if status is not None:
            raise
        problems.append(f"{d}: {exc}; its results are loaded anyway (status=None)")
        record = None
    job_status = record["status"] if record else None
    if status is not None and job_status != status:
        if job_status == "completed":
            return None  # asked for another status: not a problem
        raise _Skip(_not_completed(record))
    results = d / "results.parquet"
    if not results.is_file():
        if job_status == "completed":
            raise _Skip("status.json says completed but results.parquet is missing")
        raise _Skip(_not_completed(record) + "; no results.parquet")
    try:
        df = pd.read_parquet(results)
    except Exception as exc:  # pyarrow raises its own types for a truncated or foreign file
        raise _Skip(f"results.parquet is unreadable ({type(exc).__name__}: {exc})") from None
    try:
        overrides = _overrides(d)
    except Exception as exc:  # without them its rows could not be told apart from other jobs'
        raise _Skip(f".hydra/overrides.yaml is unreadable ({type(exc).__name__}: {exc})") from None
    if "value" in df.columns:
        df["value"] = _float_values(df["value"], d, problems)
    df = legacy_variant_columns(df)
    extra = {"job": _job_num(d), "job_dir": str(d)}
    for key, value in overrides.items():
        extra[f"override.{key}" if key in df.columns else key] = value
    for key, value in extra.items():
        df[key] = value
    return df

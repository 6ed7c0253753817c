"""Results on disk: atomic writers, and `load`, which turns a run or sweep folder into one pandas
DataFrame. Never imports JAX, so a notebook can load results without it."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pandas as pd

from moejax.errors import MoejaxError


def _atomic_write(path: Path, write) -> None:
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json_atomic(path: Path, obj: dict) -> None:
    _atomic_write(path, lambda tmp: Path(tmp).write_text(json.dumps(obj, indent=1, default=str)))


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


def load(path, status: str = "completed") -> pd.DataFrame:
    """One tidy DataFrame from a run folder or a multirun sweep folder.

    Rows come from each job's results.parquet; columns added: `job` (Hydra job number, -1 for a
    single run), `job_dir`, and every override of the job. An override whose name is already a
    results column (e.g. `keep`, whose results column holds the resolved count) is added as
    `override.<name>`. Jobs whose status is not `status` are skipped (status=None keeps all that
    have results).
    """
    root = Path(path)
    if not root.exists():
        raise MoejaxError(f"results folder {root} does not exist")
    frames = []
    for d in job_dirs(root):
        results = d / "results.parquet"
        if not results.is_file():
            continue
        if status is not None:
            try:
                job_status = json.loads((d / "status.json").read_text()).get("status")
            except (FileNotFoundError, json.JSONDecodeError):
                job_status = None
            if job_status != status:
                continue
        df = pd.read_parquet(results)
        extra = {"job": _job_num(d), "job_dir": str(d)}
        for key, value in _overrides(d).items():
            extra[f"override.{key}" if key in df.columns else key] = value
        for key, value in extra.items():
            df[key] = value
        frames.append(df)
    if not frames:
        raise MoejaxError(f"no completed job with results.parquet under {root}")
    return pd.concat(frames, ignore_index=True)

"""Run one experiment job into a folder: validate, compute, write results atomically.

Files in the job folder (beside Hydra's .hydra/):
  resolved_config.yaml   the config as the job saw it, interpolations resolved
  results.parquet        the tidy table (written atomically)
  timings.json           seconds per stage
  status.json            written last: {"status": "completed", ...}; its presence means success
  error.txt              only on failure (with status.json saying "failed")
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import traceback
from pathlib import Path

from moejax.errors import ConfigError
from moejax.experiments import EXPERIMENTS, get
from moejax.parallel.mesh import MeshConfig, request_cpu_devices
from moejax.results import write_json_atomic, write_parquet_atomic

log = logging.getLogger(__name__)


def experiment_config(cfg: dict):
    """(experiment module, typed config) from a resolved config dict; raises ConfigError early."""
    name = cfg.get("name")
    if not name:
        raise ConfigError(f"no experiment chosen; add experiment=NAME with NAME one of: {', '.join(EXPERIMENTS)}")
    module = get(name)
    return module, module.Config.from_mapping(module.settings_from(cfg))


def enable_compilation_cache() -> None:
    """Persistent XLA cache so repeated runs skip compilation. MOEJAX_JAX_CACHE='' turns it off."""
    import jax

    path = os.environ.get("MOEJAX_JAX_CACHE", str(Path.home() / ".cache" / "moejax" / "jax"))
    if path:
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def run_job(cfg: dict, out_dir: Path, overrides: list[str] | None = None):
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        module, typed = experiment_config(cfg)  # before any compute
        request_cpu_devices(MeshConfig.from_dict(cfg.get("mesh")).n_devices)  # before JAX starts
        import yaml

        (out_dir / "resolved_config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
        enable_compilation_cache()
        t0 = time.perf_counter()
        df, timings = module.run(typed, progress=_progress(cfg["name"], getattr(typed, "seeds", 1)), job_dir=out_dir)
        timings["total_s"] = time.perf_counter() - t0
        write_parquet_atomic(df, out_dir / "results.parquet")
        write_json_atomic(out_dir / "timings.json", timings)
        print(f"\n{module.summary_title(typed)}\n{module.summary_table(df).to_string()}\n\n"
              f"results: {out_dir / 'results.parquet'}")
        write_json_atomic(out_dir / "status.json", {"status": "completed", "experiment": cfg["name"],
                                                    "overrides": overrides or [], "rows": len(df),
                                                    "seconds": round(timings["total_s"], 3)})
        return df
    except BaseException as exc:
        (out_dir / "error.txt").write_text("".join(traceback.format_exception(exc)))
        write_json_atomic(out_dir / "status.json", {"status": "failed", "error": f"{type(exc).__name__}: {exc}",
                                                    "overrides": overrides or []})
        raise


def _progress(name: str, total: int):
    """A seeds progress line on a terminal, silent otherwise."""
    if not sys.stderr.isatty():
        return None
    done = [0]

    def update(n: int) -> None:
        done[0] += n
        sys.stderr.write(f"\r{name}: {done[0]}/{total} seeds")
        if done[0] >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()

    return update

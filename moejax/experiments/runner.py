"""Run one experiment job into a folder: validate, compute, write results atomically.

Files in the job folder (beside Hydra's .hydra/):
  resolved_config.yaml   the config as the job saw it, interpolations resolved
  results.parquet        the tidy table (written atomically)
  timings.json           seconds per stage
  status.json            written last: {"status": "completed", ...}; its presence means success
                         (the loader reads only completed jobs); otherwise "failed" (an exception:
                         "error" holds it) or "killed" (SIGTERM/SIGINT: "signal", "seconds", "stage"
                         and "progress" say how far it got)
  error.txt              only on failure: the traceback (with status.json saying "failed")

SIGTERM (Slurm at the time limit, `timeout`, `kill`) and SIGINT (Ctrl-C) raise `Killed` in the
job (see KillSwitch), which unwinds it (temporary files are removed, no results.parquet is
written) and then writes status.json. Python runs signal handlers between bytecodes, so a job
inside one long XLA call notices the signal when the call returns (Slurm's KillWait, 30 s by
default, is the time it has before SIGKILL, which nothing can catch: such a job has no status.json).
"""

from __future__ import annotations

import logging
import os
import sys
import time
import traceback
from pathlib import Path

from tqdm import tqdm

from moejax.errors import ConfigError
from moejax.experiments import EXPERIMENTS, get, register_configs
from moejax.hf.io.staging import check_apart, text_inputs
from moejax.parallel.distributed import DistributedConfig, initialize
from moejax.parallel.mesh import MeshConfig, request_cpu_devices
from moejax.results import write_json_atomic, write_parquet_atomic, write_text_atomic
from moejax.signals import KillSwitch, Killed

log = logging.getLogger(__name__)

# The one place the experiments' dataclass defaults enter Hydra's ConfigStore: conf/experiment/*.yaml
# name them (experiment_defaults/NAME), so anything that composes imports this module first
# (moejax.run does at import; so does code calling hydra.compose, for experiment_config).
register_configs()

MISSING = "???"  # OmegaConf's mark of a mandatory value; OmegaConf.to_container keeps it as this string

# How to set a mandatory key, where more can be said than KEY=VALUE.
_HOW_TO_SET = {
    "model.path": "model.path=/path/to/checkpoint (a local Hugging Face checkpoint folder), "
                  "or model=tiny (the small model that experiment=train_tiny trains)",
}


def missing_keys(cfg, prefix: str = "") -> list[str]:
    """Dotted names of the mandatory values (`???`) nobody set, in a resolved config dict."""
    if isinstance(cfg, dict):
        items = cfg.items()
    elif isinstance(cfg, list):
        items = enumerate(cfg)
    else:
        return [prefix] if cfg == MISSING else []
    return [k for key, value in items for k in missing_keys(value, f"{prefix}.{key}" if prefix else str(key))]


def experiment_config(cfg: dict):
    """(experiment module, typed config) from a resolved config dict; raises ConfigError early."""
    name = cfg.get("name")
    if not name:
        raise ConfigError(f"no experiment chosen; add experiment=NAME with NAME one of: {', '.join(EXPERIMENTS)}")
    unset = missing_keys(cfg)
    if unset:
        raise ConfigError("; ".join(f"{key} is not set: add {_HOW_TO_SET.get(key, f'{key}=VALUE')}"
                                    for key in unset))
    module = get(name)
    return module, module.Config.from_mapping(module.settings_from(cfg))


def enable_compilation_cache() -> None:
    """Persistent XLA cache so repeated runs skip compilation. MOEJAX_JAX_CACHE='' turns it off. Also
    set in the environment (JAX reads its settings from there), so the worker processes a job
    starts (`moejax.parallel.cores`) use it too."""
    import jax

    path = os.environ.get("MOEJAX_JAX_CACHE", str(Path.home() / ".cache" / "moejax" / "jax"))
    if path:
        for name, value in (("jax_compilation_cache_dir", path), ("jax_persistent_cache_min_compile_time_secs", 0.5)):
            jax.config.update(name, value)
            os.environ[name.upper()] = str(value)


class _Progress:
    """Where a job is: its stage, and the units (seeds) the experiment reported through the
    progress callback. The callback draws a line on a terminal; experiments take a non-None
    callback to mean "show progress bars", so off a terminal it is not passed (and not counted)."""

    def __init__(self, name: str, total: int):
        self.name, self.total, self.done, self.stage = name, total, 0, "validate"
        self.t0 = time.perf_counter()

    def callback(self):
        return self.update if sys.stderr.isatty() else None

    def update(self, n: int) -> None:
        if self.done == 0:
            self.bar = tqdm(total=self.total, desc=self.name, unit="seed")
        self.done += n
        self.bar.update(n)
        if self.done >= self.total:
            self.bar.close()

    def record(self, counted: bool) -> dict:
        out = {"seconds": round(time.perf_counter() - self.t0, 3), "stage": self.stage}
        if counted:
            out["progress"] = {"seeds_done": self.done, "seeds_total": self.total}
        return out


def job_inputs(cfg: dict) -> list[str]:
    """The paths a job reads that its folder must stay apart from: the model (model.path: read by
    prune_real, eval_tasks, eval_skills and score, replaced by train_tiny) and the training text
    (data.text). A job folder inside a model folder would write results into it, or be deleted with
    it when training replaces it."""
    model, data = cfg.get("model") or {}, cfg.get("data") or {}
    path = model.get("path")
    text = data.get("text") if isinstance(data, dict) else None
    return ([path] if isinstance(path, str) and path and path != "???" else []) + text_inputs(text or None)


def run_job(cfg: dict, out_dir: Path, overrides: list[str] | None = None):
    """Validate, compute and write one job. In a multi-process job (the `distributed` settings, or
    several Slurm tasks: moejax.parallel.distributed) every process computes and process 0 alone
    writes the job folder; the others return the same table and write nothing."""
    out_dir = Path(out_dir)
    check_apart(out_dir, job_inputs(cfg), "the job folder (hydra.run.dir / hydra.sweep.dir)")
    out_dir.mkdir(parents=True, exist_ok=True)
    progress = _Progress(cfg.get("name") or "job", 1)
    counted, primary = False, True
    with KillSwitch() as switch:
        try:
            distributed = DistributedConfig.from_dict(cfg.get("distributed"))
            primary = distributed.process_index() == 0
            module, typed = experiment_config(cfg)  # before any compute
            mesh_devices = MeshConfig.from_dict(cfg.get("mesh")).n_devices
            request_cpu_devices(distributed.local_device_count(mesh_devices))  # before JAX starts
            import yaml

            if primary:
                write_text_atomic(out_dir / "resolved_config.yaml", yaml.safe_dump(cfg, sort_keys=False))
            progress.stage, progress.total = "start", getattr(typed, "seeds", 1)
            enable_compilation_cache()
            initialize(distributed)  # one process: nothing
            progress.stage = "compute"
            t0 = time.perf_counter()
            callback = progress.callback()
            counted = callback is not None
            df, timings = module.run(typed, progress=callback, job_dir=out_dir)
            timings["total_s"] = time.perf_counter() - t0
            if not primary:
                switch.stopped = True
                return df
            progress.stage = "write"
            switch.check()
            write_parquet_atomic(df, out_dir / "results.parquet")
            write_json_atomic(out_dir / "timings.json", timings)
            print(f"\n{module.summary_title(typed)}\n{module.summary_table(df).to_string()}\n\n"
                  f"results: {out_dir / 'results.parquet'}")
            switch.check()
            write_json_atomic(out_dir / "status.json", {"status": "completed", "experiment": cfg["name"],
                                                        "overrides": overrides or [], "rows": len(df),
                                                        "seconds": round(timings["total_s"], 3)})
            switch.stopped = True  # completed is the truth now; a signal from here on changes nothing
            return df
        except BaseException as exc:
            switch.stopped = True  # first, and not a call (a handler may run on entering one): a
            switch.acknowledge()   # second signal must not tear the status apart
            if switch.signum is None and isinstance(exc, Killed):  # an inner switch (a staging folder) took it
                switch.signum = exc.signum
            if switch.signum is None:
                if primary:  # process 0 reports the job (the others' errors are on their stderr)
                    record_failure(out_dir, exc, overrides)
                raise
            killed = exc if isinstance(exc, Killed) else Killed(switch.signum)
            if killed is not exc:  # the experiment turned Killed into another exception
                killed.__traceback__ = exc.__traceback__
            if primary:
                record_killed(out_dir, killed, overrides, {**progress.record(counted), "experiment": cfg.get("name")})
            if killed is exc:
                raise
            raise killed from exc


def record_failure(out_dir: Path, exc: BaseException, overrides: list[str] | None = None) -> None:
    """error.txt (the traceback) and status.json = failed, for a job that raised `exc`."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out_dir / "error.txt", "".join(traceback.format_exception(exc)))
    write_json_atomic(out_dir / "status.json", {"status": "failed", "error": f"{type(exc).__name__}: {exc}",
                                                "overrides": overrides or []})


def record_killed(out_dir: Path, exc: Killed, overrides: list[str] | None, how_far: dict) -> None:
    """status.json = killed, with the signal and how far the job got (no results.parquet: a
    killed job never reaches it, and a half-written one is a removed temporary file)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename != __file__]
    where = f"{frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}" if frames else None
    write_json_atomic(Path(out_dir) / "status.json", {"status": "killed", "signal": exc.signal_name,
                                                      **how_far, "where": where, "overrides": overrides or []})

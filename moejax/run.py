"""Hydra entry point: python -m moejax.run experiment=toy3 seeds=8   (add -m for sweeps).

Thin on purpose: compose the config, hand a plain dict to `moejax.experiments.runner`, which
imports JAX only inside the job (the sweep controller, --cfg and --help never touch it). Importing
the runner registers every experiment's dataclass defaults with Hydra's ConfigStore
(`moejax.experiments.register_configs`), which conf/experiment/*.yaml compose from.

How a job ends (the job folder's status.json says the same):
  completed          exit status 0.
  MoejaxError        (a ConfigError, a bad checkpoint, ...: the user's to fix) one line on stderr,
                     `moejax.run: error: <message>`, exit status 2, status.json "failed" and the
                     traceback in error.txt. HYDRA_FULL_ERROR=1 shows the traceback on stderr instead.
  any other error    a bug: Hydra prints its traceback, exit status 1, status.json "failed".
  SIGTERM / SIGINT   status.json "killed" (signal, seconds, stage), exit status 128 + signal number
                     (143 / 130), as a shell reports a process that a signal ended.

In a sweep (-m) a job's MoejaxError prints the same one line, prefixed with the job's number and
overrides, and the job is marked failed for Hydra (no traceback). Hydra runs every job of the
current batch (the basic sweeper's one batch is the whole sweep, unless hydra.sweeper.max_batch_size
is set; a launcher's jobs run in parallel), then stops: later batches are not launched, and the
sweep exits with status 1 after "Error executing job with overrides: [...]" and one line
repeating the first failed job's error and naming its status.json (with a remote launcher such
as submitit the per-job lines are in the jobs' logs; this one reaches the terminal). The other
jobs' folders are complete and `moejax.results.load` reads them, warning about the failed ones.
SIGTERM/SIGINT to a sweep run by the basic launcher (one process) ends the current job as
"killed" and the whole sweep with 128 + signal number; jobs not yet started have no folder.

The clean line is printed here, inside the task function, because Hydra's own handler
(hydra._internal.utils.run_and_report) prints a traceback for every exception except its
CompactHydraException, and exits 1. A single run leaves Hydra with SystemExit(2), which Hydra
does not catch; a sweep job raises a CompactHydraException so that Hydra records the job as
failed, lets the batch's other jobs run, and reports it without a traceback.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import CompactHydraException, HydraException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

import moejax.experiments.runner  # noqa: F401  registers the experiments' defaults before Hydra composes

# conf/ sits at the top of a source checkout and inside the wheel as the package moejax.conf.
_SOURCE_CONF = Path(__file__).resolve().parent.parent / "conf"
CONFIG_PATH = str(_SOURCE_CONF) if (_SOURCE_CONF / "config.yaml").is_file() else "pkg://moejax.conf"

USAGE_ERROR = 2  # exit status of a MoejaxError: the command line or the inputs need fixing


# Settings that are one value, replaced whole by a command-line override. Hydra merges a mapping
# given on the command line into the default one, so in train_skills data.mix={code: 1.0} kept the
# other shares (sum 1.38) and data.mix={} changed nothing; a mix is one setting whose shares sum to
# one. data.mix.add=0.12 still changes one share.
REPLACED_WHOLE = ("data.mix",)


def replace_whole(plain: dict, overrides: list[str]) -> dict:
    """`plain` with each REPLACED_WHOLE key set to exactly the value its override gave (the last one
    wins, as in Hydra); other overrides are Hydra's as composed."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    for text in overrides:
        override = parser.parse_override(text)
        if override.key_or_group in REPLACED_WHOLE and not override.is_delete():
            *parents, leaf = override.key_or_group.split(".")
            node = plain
            for key in parents:
                node = node.setdefault(key, {})
            node[leaf] = override.value()
    return plain


def unquoted_value(argv: list[str]) -> str | None:
    """The refusal of an override Hydra's grammar rejects because its value holds an unquoted '='
    (calibration=code=0.5,kv=0.5: Hydra says 'mismatched input' and no word of quoting); None when
    every argument parses."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep or "=" not in value or arg.startswith("-"):
            continue
        try:
            parser.parse_override(arg)
        except HydraException:   # the grammar's error (OverrideParseException is one too)
            return (f"{arg}: a value holding '=' must be quoted for Hydra (and ',' would start a sweep): write "
                    f"'{key}=\"{value}\"' (single quotes for the shell, double quotes for Hydra)")
    return None


class SweepJobFailed(CompactHydraException):
    """A sweep job ended with a MoejaxError (already printed in one line); Hydra prints this
    message without a traceback at the end of the batch."""


@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="config")
def main(cfg: DictConfig) -> None:
    from moejax.errors import ConfigError, MoejaxError
    from moejax.experiments.runner import record_failure, run_job
    from moejax.signals import Killed

    hc = HydraConfig.get()
    out_dir = Path(hc.runtime.output_dir)
    overrides = OmegaConf.to_container(hc.overrides.task, resolve=False)  # as typed: 'x=${...}' stays text
    try:
        try:
            plain = replace_whole(OmegaConf.to_container(cfg, resolve=True), overrides)
        except OmegaConfBaseException as exc:  # e.g. an interpolation that cannot be resolved
            where = f" at {exc.full_key}" if getattr(exc, "full_key", None) else ""
            error = ConfigError(f"the config does not resolve{where}: {str(exc).splitlines()[0]}")
            record_failure(out_dir, error, overrides)
            raise error from exc
        run_job(plain, out_dir, overrides=overrides)
    except MoejaxError as exc:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        if hc.mode == RunMode.MULTIRUN:
            job = f"job {hc.job.num} ({' '.join(overrides)})"
            sys.stderr.write(f"moejax.run: error: {job}: {exc}\n")
            sys.stderr.flush()
            # repeated at the end: with a remote launcher (submitit) the line above went to the job's log
            raise SweepJobFailed(f"moejax.run: job {hc.job.num} failed: {exc} ({out_dir / 'status.json'})") from None
        sys.stderr.write(f"moejax.run: error: {exc}\n")
        sys.stderr.flush()
        raise SystemExit(USAGE_ERROR) from None
    except Killed as exc:
        sys.stderr.write(f"moejax.run: {exc}; see {out_dir / 'status.json'}\n")
        sys.stderr.flush()
        raise SystemExit(128 + exc.signum) from None


if __name__ == "__main__":
    if (refusal := unquoted_value(sys.argv[1:])) is not None:
        sys.stderr.write(f"moejax.run: error: {refusal}\n")
        raise SystemExit(USAGE_ERROR)
    main()

"""Hydra entry point: python -m moejax.run experiment=toy3 seeds=8   (add -m for sweeps).

Thin on purpose: compose the config, hand a plain dict to `moejax.experiments.runner`, which
imports JAX only inside the job (the sweep controller, --cfg and --help never touch it).
"""

from __future__ import annotations

from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

# conf/ sits at the top of a source checkout and inside the wheel as the package moejax.conf.
_SOURCE_CONF = Path(__file__).resolve().parent.parent / "conf"
CONFIG_PATH = str(_SOURCE_CONF) if (_SOURCE_CONF / "config.yaml").is_file() else "pkg://moejax.conf"


@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="config")
def main(cfg: DictConfig) -> None:
    from moejax.experiments.runner import run_job

    hc = HydraConfig.get()
    run_job(OmegaConf.to_container(cfg, resolve=True), Path(hc.runtime.output_dir),
            overrides=list(hc.overrides.task))


if __name__ == "__main__":
    main()

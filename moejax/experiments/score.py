"""`python -m moejax.run experiment=score model.path=CKPT data.text=[...]`: the scoring pass of
`moejax score` as a Hydra job (results.parquet = the scores table)."""

from __future__ import annotations

import dataclasses
import time

from moejax.errors import ConfigError
from moejax.hf.mtp_names import MTP_DEFAULT
from moejax.parallel.mesh import MeshConfig
from moejax.settings_check import refuse_repeats, refuse_unknown_settings


@dataclasses.dataclass(frozen=True)
class ScoreConfig:
    path: str = ""                # model.path
    text: tuple = ()              # calibration text: files/folders/globs
    tokens: str | None = None     # or a .npy file of token ids (instead of text)
    seq_len: int = 512
    max_tokens: int | None = None  # None: no cap
    batch_size: int = 8
    scores: tuple | None = None  # None: every score the model supports
    mesh_data: int = 1
    mesh_expert: int = 1
    mtp: str = MTP_DEFAULT       # MTP layers scored (prune) or not (keep, drop): `moejax score --mtp`

    @classmethod
    def from_mapping(cls, d: dict) -> "ScoreConfig":
        refuse_unknown_settings(cls, d, "score")
        d = {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}
        cfg = cls(**d)
        if not cfg.path:
            raise ConfigError("score: set model.path=CHECKPOINT_FOLDER")
        if cfg.scores is not None:
            refuse_repeats("score", "scores", cfg.scores)
        return cfg


Config = ScoreConfig


def settings_from(cfg: dict) -> dict:
    model, data = cfg.get("model") or {}, cfg.get("data") or {}
    mesh = MeshConfig.from_dict(cfg.get("mesh"))
    return {"path": model.get("path") or "", **data, "scores": cfg.get("scores"),
            "mesh_data": mesh.data, "mesh_expert": mesh.expert, **({"mtp": cfg["mtp"]} if cfg.get("mtp") else {})}


def run(cfg: ScoreConfig, progress=None, job_dir=None):
    t0 = time.perf_counter()
    from moejax.scoring.score_checkpoint import score_checkpoint   # the scoring stack, when a job runs

    df = score_checkpoint(cfg.path, text=list(cfg.text) or None, tokens=cfg.tokens, seq_len=cfg.seq_len,
                          max_tokens=cfg.max_tokens, scores=None if cfg.scores is None else list(cfg.scores),
                          batch_size=cfg.batch_size, mtp=cfg.mtp,
                          mesh=MeshConfig(cfg.mesh_data, cfg.mesh_expert))
    return df, {"scoring_s": time.perf_counter() - t0}


def summary_title(cfg: ScoreConfig) -> str:
    return f"Spearman correlation of each score with frequency, mean over MoE layers ({cfg.path}):"


def summary_table(df):
    import pandas as pd

    ranks = df.assign(rank=df.groupby(["layer", "score"])["value"].rank())
    wide = ranks.pivot_table(index=["layer", "expert"], columns="score", values="rank")
    if "frequency" not in wide:
        return wide.describe()
    corr = {l: g.corr()["frequency"] for l, g in wide.groupby(level="layer")}
    return pd.DataFrame(corr).mean(axis=1).rename("spearman_vs_frequency").to_frame()

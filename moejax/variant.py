"""A pruned variant as expert masks (bool [num_hidden_layers, E], True = kept), built from what a
researcher has on disk, checked against the checkpoint's config.json before any model is loaded:

- a `pruning.json` written by `moejax prune` (its kept source experts per layer);
- a scores file written by `moejax score` (parquet: layer, expert, score, value) + a score name
  + a keep (count or ratio of E), ranked as SPEC section 2 says (`moejax.scoring.select`);
- kept sets in memory ({layer: [expert, ...]}), as the eval_tasks experiment gets them.

Rows of dense layers are all True (they are ignored by the forward).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from moejax.errors import ConfigError
from moejax.scoring.select import resolve_keep, select_kept


def masks_from_kept(kept: dict, config, where: str = "kept sets") -> np.ndarray:
    """bool [L, E] from {MoE layer: kept expert indices}; every MoE layer must be named.
    config: the model's typed config (any family)."""
    n_layers, E, top_k = config.num_hidden_layers, config.n_experts, config.num_experts_per_tok
    moe = config.moe_layers
    kept = {int(l): v for l, v in kept.items()}
    missing, extra = sorted(set(moe) - set(kept)), sorted(set(kept) - set(moe))
    if missing or extra:
        raise ConfigError(f"{where}: MoE layers {moe} need kept sets; missing {missing}, not MoE layers {extra}")
    masks = np.ones((n_layers, E), bool)
    for l, experts in kept.items():
        idx = np.asarray(experts)
        if idx.ndim != 1 or not np.issubdtype(idx.dtype, np.integer) or len(set(idx.tolist())) != idx.size \
                or (idx.size and (idx.min() < 0 or idx.max() >= E)):
            raise ConfigError(f"{where}: layer {l}: kept experts must be distinct integers in [0, {E}), got "
                              f"{list(experts)[:8]}")
        if idx.size < top_k:
            raise ConfigError(f"{where}: layer {l} keeps {idx.size} experts, below num_experts_per_tok={top_k}")
        masks[l] = False
        masks[l, idx] = True
    return masks


def masks_from_pruning_record(path, config) -> np.ndarray:
    """bool [L, E] from a `pruning.json` of `moejax prune` made from this checkpoint."""
    path = Path(path)
    if path.is_dir():
        path = path / "pruning.json"
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        layers = record["layers"]
        kept = {int(l): layer["kept"] for l, layer in layers.items()}
        sizes = {int(l): layer.get("n_experts") for l, layer in layers.items()}
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such pruning record (written by `moejax prune` beside its output)") from None
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(f"{path}: not a pruning record (expected {{'layers': {{layer: {{'kept': [...]}}}}}}): "
                          f"{type(e).__name__}: {e}") from None
    wrong = {l: n for l, n in sizes.items() if n is not None and n != config.n_experts}
    if wrong:
        raise ConfigError(f"{path}: made from a checkpoint with {wrong} experts per layer, but this one has "
                          f"{config.experts_key}={config.n_experts}")
    return masks_from_kept(kept, config, str(path))


def masks_from_scores(path, score: str, keep, config) -> np.ndarray:
    """bool [L, E] keeping, in every MoE layer, the `keep` experts with the highest `score` in a
    scores file of `moejax score` (float64 ranking, ties to the lower index)."""
    import pandas as pd

    E, top_k = config.n_experts, config.num_experts_per_tok
    count = resolve_keep(keep, E, top_k)
    path = Path(path)
    try:
        df = pd.read_parquet(path)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such scores file (written by `moejax score`)") from None
    except Exception as e:  # pyarrow raises several types for a file that is not parquet
        raise ConfigError(f"{path}: cannot be read as a scores parquet ({type(e).__name__}: {e})") from None
    if not {"layer", "expert", "score", "value"} <= set(df.columns):
        raise ConfigError(f"{path}: expected columns layer, expert, score, value; got {list(df.columns)}")
    names = sorted(df.score.unique())
    if score not in names:
        raise ConfigError(f"{path}: no score {score!r}; it holds {names}")
    kept = {}
    for l, rows in df[df.score == score].groupby("layer"):
        rows = rows.sort_values("expert")
        if rows.expert.tolist() != list(range(E)):
            raise ConfigError(f"{path}: layer {l}, score {score}: expected experts 0..{E - 1}, got "
                              f"{len(rows)} rows")
        values = rows.value.to_numpy(np.float64)
        kept[int(l)] = np.flatnonzero(select_kept(values, count, f"{path}: layer {l}: score {score!r}")).tolist()
    return masks_from_kept(kept, config, f"{path} ({score}, keep={keep})")

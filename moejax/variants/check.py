"""Variants built from what a researcher has on disk, as expert masks checked against the
checkpoint's config.json before any model is loaded:

- a `pruning.json` written by `moejax prune` (its kept source experts per layer);
- a scores file written by `moejax score` (parquet: layer, expert, score, value) + a score name
  + a keep (count or ratio of E), ranked as SPEC section 2 says (`moejax.scoring.select`);
- kept sets in memory ({layer: [expert, ...]}).

Rows of dense layers are all True (they are ignored by the forward). Every MoE layer's mask meets
`check_routable`; the forward checks and converts what it is given with `check_variant` (both in
`moejax.models.variant`).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from moejax.errors import ConfigError
from moejax.hf.check import check_checkpoint
from moejax.hf.provenance import check_made_from, checkpoint_fingerprint, scores_sidecar
from moejax.models.variant import check_routable
from moejax.scoring.select import resolve_keep, select_kept
from moejax.variants.spec import VariantSpec


def masks_from_kept(kept: dict, config, where: str = "kept sets") -> np.ndarray:
    """bool [L, E] from {MoE layer: kept expert indices}; every MoE layer must be named.
    config: the model's typed config (any family)."""
    n_layers, E = config.num_hidden_layers, config.n_experts
    moe = config.moe_layers
    kept = {int(l): v for l, v in kept.items()}
    missing, extra = sorted(set(moe) - set(kept)), sorted(set(kept) - set(moe))
    if missing or extra:
        raise ConfigError(f"{where}: MoE layers {moe} need kept sets; missing {missing}, not MoE layers {extra}")
    masks = np.ones((n_layers, E), bool)
    for l, experts in kept.items():
        idx, E_l = np.asarray(experts), config.experts_in_layer(l)  # the layer's own count (pruned per layer)
        if idx.ndim != 1 or not np.issubdtype(idx.dtype, np.integer) or len(set(idx.tolist())) != idx.size \
                or (idx.size and (idx.min() < 0 or idx.max() >= E_l)):
            raise ConfigError(f"{where}: layer {l}: kept experts must be distinct integers in [0, {E_l}), got "
                              f"{list(experts)[:8]}")
        masks[l] = False
        masks[l, idx] = True
        check_routable(masks[l], l, config, where)
    return masks


def masks_from_pruning_record(path, config, checkpoint=None) -> np.ndarray:
    """bool [L, E] from a `pruning.json` of `moejax prune` made from this checkpoint (the folder
    `checkpoint`, when given, is checked to be the one the record names: `moejax.hf.provenance`).
    A merge's record is refused: its merged experts are in the checkpoint written beside it, and
    the kept (leader) experts alone would evaluate a pruning, not the merge."""
    path = Path(path)
    if path.is_dir():
        path = path / "pruning.json"
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        layers = record["layers"]
        merged = ("form" in record or "router" in record) and VariantSpec.from_record(record).merged \
            or any(isinstance(layer, dict) and "clusters" in layer for layer in layers.values())
        kept = {int(l): layer["kept"] for l, layer in layers.items()}
        sizes = {int(l): layer.get("n_experts") for l, layer in layers.items()}
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such pruning record (written by `moejax prune` beside its output)") from None
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(f"{path}: not a pruning record (expected {{'layers': {{layer: {{'kept': [...]}}}}}}): "
                          f"{type(e).__name__}: {e}") from None
    if merged:
        raise ConfigError(f"{path}: the record of a merge (`moejax merge --method {record.get('method')}`), not of a "
                          "pruning: its merged experts are in the checkpoint it was written with, and applying its "
                          "kept (leader) experts to the source would evaluate a pruning. Evaluate the merged "
                          f"checkpoint itself: pretrained={path.parent} without pruning=")
    if checkpoint is not None:
        check_source(record, path, "source", checkpoint, "pruning record")
    wrong = {l: n for l, n in sizes.items()
             if n is not None and l in config.moe_layers and n != config.experts_in_layer(l)}
    if wrong:
        raise ConfigError(f"{path}: made from a checkpoint with {wrong} experts per layer, but this one has "
                          f"{ {l: config.experts_in_layer(l) for l in wrong} } ({config.experts_key}="
                          f"{config.n_experts})")
    return masks_from_kept(kept, config, str(path))


def check_source(record: dict, record_path, source_key: str, checkpoint, what: str) -> None:
    """`moejax.hf.provenance.check_made_from` against the local checkpoint folder `checkpoint`
    (its router fingerprint read only when the record has one to compare)."""
    check_made_from(record, record_path, source_key, checkpoint,
                    lambda: checkpoint_fingerprint(check_checkpoint(checkpoint, uniform_experts=False)), what)


def masks_from_scores(path, score: str, keep, config, checkpoint=None) -> np.ndarray:
    """bool [L, E] keeping, in every MoE layer, the `keep` experts with the highest `score` in a
    scores file of `moejax score` (float64 ranking, ties to the lower index). The folder
    `checkpoint`, when given, is checked to be the one the file's sidecar names."""
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
    if checkpoint is not None:
        sidecar, where = scores_sidecar(path)
        check_source(sidecar or {}, where, "checkpoint", checkpoint, "scores file")
    names = sorted(df.score.unique())
    if score not in names:
        raise ConfigError(f"{path}: no score {score!r}; it holds {names}")
    kept = {}
    for l, rows in df[df.score == score].groupby("layer"):
        rows = rows.sort_values("expert")
        E_l = config.experts_in_layer(int(l)) if int(l) in config.moe_layers else E  # own count (pruned per layer)
        if rows.expert.tolist() != list(range(E_l)):
            raise ConfigError(f"{path}: layer {l}, score {score}: expected experts 0..{E_l - 1}, got "
                              f"{len(rows)} rows")
        values = rows.value.to_numpy(np.float64)
        count_l = count if E_l == E else resolve_keep(keep, E_l, top_k)
        kept[int(l)] = np.flatnonzero(select_kept(values, count_l, f"{path}: layer {l}: score {score!r}")).tolist()
    return masks_from_kept(kept, config, f"{path} ({score}, keep={keep})")

"""Variants a model runs under, checked against the checkpoint's config.json before any model is loaded.

A variant given from outside is None (the unpruned model), a pruning as expert masks (bool
[num_hidden_layers, E], True = kept), or {MoE layer: ExpertMap} (`moejax.moe.expert_map`: pruned,
merged or substituted experts per layer); `check_variant` checks either kind and returns expert
maps, the only form the forward takes (`maps_from_masks`). Masks are built from what a researcher
has on disk:

- a `pruning.json` written by `moejax prune` (its kept source experts per layer);
- a scores file written by `moejax score` (parquet: layer, expert, score, value) + a score name
  + a keep (count or ratio of E), ranked as SPEC section 2 says (`moejax.scoring.select`);
- kept sets in memory ({layer: [expert, ...]}).

Rows of dense layers are all True (they are ignored by the forward).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from moejax.errors import ConfigError
from moejax.scoring.select import resolve_keep, select_kept


def check_variant(variant, config):
    """The variant as {MoE layer: ExpertMap} of JAX arrays (masks converted by `maps_from_masks`:
    the forward takes expert maps only), or a ConfigError naming what is wrong: masks must be bool
    [num_hidden_layers, E]; an expert map must name MoE layers only, with a bool mask [E], int rows
    [E] inside its table (or none), a table of the layer's expert shapes (gate/up [R, H, F],
    down [R, F, H]), novices (substituted slots) bool [E] with finite constants [E, H] (or
    neither), and router weights finite [E, H] (or none); every MoE layer's mask must let each token be routed to top_k kept experts
    (`check_routable`). None stays None. The forward, `generate` and the lm-eval backend call it
    before any compute."""
    import jax.numpy as jnp

    from moejax.moe.expert_map import ExpertMap

    n_layers, E = config.num_hidden_layers, config.n_experts
    if variant is None:
        return None
    if not isinstance(variant, dict):
        masks = np.asarray(variant)
        if masks.shape != (n_layers, E) or masks.dtype != bool:
            raise ConfigError(f"expert masks: expected bool [{n_layers}, {E}] (layers x routed experts, "
                              f"True = kept), got {masks.dtype} {list(masks.shape)}")
        for l, n in ((l, config.experts_in_layer(l)) for l in config.moe_layers):
            if masks[l, n:].any():  # a checkpoint pruned per layer: no expert there to keep
                raise ConfigError(f"expert masks: layer {l} holds {n} experts (moe_sparsity_config.num_experts) "
                                  f"but the mask keeps experts {(np.flatnonzero(masks[l, n:]) + n).tolist()[:8]}")
        for layer in config.moe_layers:
            check_routable(masks[layer], layer, config, "expert masks")
        return maps_from_masks(masks, config)
    H, F = config.hidden_size, config.moe_intermediate_size
    out = {}
    for layer, em in variant.items():
        where = f"variant: layer {layer}"
        if layer not in config.moe_layers:
            raise ConfigError(f"{where} is not a MoE layer (MoE layers: {config.moe_layers})")
        if not isinstance(em, ExpertMap):
            raise ConfigError(f"{where}: expected an ExpertMap, got {type(em).__name__}")
        E = config.experts_in_layer(layer)  # the layer's own count (a checkpoint pruned per layer)
        mask = np.asarray(em.mask_E)
        if mask.shape != (E,) or mask.dtype != bool:
            raise ConfigError(f"{where}: mask must be bool [{E}] (router slots, True = kept), got {mask.dtype} "
                              f"{list(mask.shape)}")
        check_routable(mask, layer, config, "variant")
        table = em.weights
        if table is not None:
            R = np.shape(table.get("gate"))[0] if "gate" in table else -1
            want = {"gate": (R, H, F), "up": (R, H, F), "down": (R, F, H)}
            if set(table) != set(want) or any(tuple(np.shape(table[k])) != s for k, s in want.items()):
                raise ConfigError(f"{where}: expert table must hold gate/up [R, {H}, {F}] and down [R, {F}, {H}], "
                                  f"got {({k: list(np.shape(v)) for k, v in table.items()})}")
        rows = None if em.rows_E is None else np.asarray(em.rows_E)
        limit = E if table is None else R
        if rows is not None and (rows.shape != (E,) or not np.issubdtype(rows.dtype, np.integer)
                                 or rows.min() < 0 or rows.max() >= limit):
            raise ConfigError(f"{where}: rows must be int [{E}] in [0, {limit}), got {rows.dtype} {list(rows.shape)}")
        novice, constants = _check_novices(em, E, H, where)
        router = None if em.router_EH is None else np.asarray(em.router_EH)
        if router is not None and (router.shape != (E, H) or not np.issubdtype(router.dtype, np.floating)
                                   or not np.isfinite(router).all()):
            raise ConfigError(f"{where}: router_EH must be finite floats [{E}, {H}] (the variant's router weights), "
                              f"got {router.dtype} {list(router.shape)}")
        out[layer] = ExpertMap(jnp.asarray(mask), None if rows is None else jnp.asarray(rows, jnp.int32),
                               None if table is None else {k: jnp.asarray(v) for k, v in table.items()},
                               novice, constants, None if router is None else jnp.asarray(router, jnp.float32))
    return out


def _check_novices(em, E: int, H: int, where: str):
    """(novice_E, constants_EH) of an expert map as JAX arrays, (None, None) without novices, or a
    ConfigError: both given or neither, novices bool [E], constants finite [E, H]."""
    import jax.numpy as jnp

    if em.novice_E is None and em.constants_EH is None:
        return None, None
    if em.novice_E is None or em.constants_EH is None:
        raise ConfigError(f"{where}: novice_E and constants_EH go together (substituted slots and what they return)")
    novice, constants = np.asarray(em.novice_E), np.asarray(em.constants_EH)
    if novice.shape != (E,) or novice.dtype != bool:
        raise ConfigError(f"{where}: novice_E must be bool [{E}] (router slots returning a constant), got "
                          f"{novice.dtype} {list(novice.shape)}")
    if constants.shape != (E, H) or not np.issubdtype(constants.dtype, np.floating) or not np.isfinite(constants).all():
        raise ConfigError(f"{where}: constants_EH must be finite floats [{E}, {H}] (each slot's constant output), got "
                          f"{constants.dtype} {list(constants.shape)}")
    return jnp.asarray(novice), jnp.asarray(constants)


def maps_from_masks(masks_LE, config) -> dict:
    """{MoE layer: ExpertMap(mask)} from expert masks [num_hidden_layers, n_experts] (numpy, or JAX
    arrays traced inside a caller's jit), each layer's row cut to its own experts_in_layer(layer)
    first columns: the one conversion of a pruning given as masks into the form the forward takes."""
    import jax.numpy as jnp

    from moejax.moe.expert_map import ExpertMap

    return {l: ExpertMap(jnp.asarray(masks_LE[l][..., :config.experts_in_layer(l)])) for l in config.moe_layers}


def check_routable(mask_E, layer: int, config, where: str) -> None:
    """The one rule every form of variant meets at each MoE layer (expert masks, expert maps, kept
    sets, the experiments' own selections): routing under the mask gives every token top_k kept
    experts (`moejax.moe.routing.RouterConfig.check_mask`: at least num_experts_per_tok kept, and
    under group-limited routing enough in whichever groups a token can be given). The mask is
    n_experts wide; the layer reads its own first experts_in_layer(layer) columns."""
    from moejax.moe.routing import RouterConfig

    n = config.experts_in_layer(layer)
    RouterConfig(**config.router_settings()).check_mask(np.asarray(mask_E)[:n], f"{where}: layer {layer}")


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
        merged = "method" in record or any(isinstance(layer, dict) and "clusters" in layer for layer in layers.values())
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
    from moejax.hf.check import check_checkpoint
    from moejax.hf.provenance import check_made_from, checkpoint_fingerprint

    check_made_from(record, record_path, source_key, checkpoint,
                    lambda: checkpoint_fingerprint(check_checkpoint(checkpoint, uniform_experts=False)), what)


def masks_from_scores(path, score: str, keep, config, checkpoint=None) -> np.ndarray:
    """bool [L, E] keeping, in every MoE layer, the `keep` experts with the highest `score` in a
    scores file of `moejax score` (float64 ranking, ties to the lower index). The folder
    `checkpoint`, when given, is checked to be the one the file's sidecar names."""
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
    if checkpoint is not None:
        from moejax.hf.provenance import scores_sidecar

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

"""The variant a model's forward runs under, checked against the model's config before any compute.

A variant is None (the unpruned model), a pruning as expert masks (bool [num_hidden_layers, E],
True = kept), or {MoE layer: ExpertMap} (`moejax.moe.expert_map`: pruned, merged or substituted
experts per layer). `check_variant` checks either kind and returns expert maps, the only form the
forward takes (`maps_from_masks`); `check_routable` is the one rule every MoE layer's mask meets.
The forward, prefill and decode (`moejax.models.causal_lm`), generation and the lm-eval backend
call it. Masks built from files on disk (a `pruning.json`, a scores file, kept sets) are in
`moejax.variants.check`.
"""

from __future__ import annotations

import numpy as np

from moejax.errors import ConfigError


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

    from moejax.moe.dispatch import EXPERT_SHAPES
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
            if config.is_kept_whole(layer):
                if not masks[layer, :config.experts_in_layer(layer)].all():
                    raise ConfigError(_kept_whole(config, layer, "expert masks"))
                continue
            check_routable(masks[layer], layer, config, "expert masks")
        return maps_from_masks(masks, config)
    H, F = config.hidden_size, config.moe_intermediate_size
    out = {}
    for layer, em in variant.items():
        where = f"variant: layer {layer}"
        if layer not in config.moe_layers:
            raise ConfigError(f"{where} is not a MoE layer (MoE layers: {config.moe_layers})")
        if config.is_kept_whole(layer):
            raise ConfigError(_kept_whole(config, layer, where))
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
            R = np.shape(next(iter(table.values())))[0] if table else -1
            want = {k: (R, *s) for k, s in EXPERT_SHAPES[config.EXPERT_KIND](H, F).items()}
            if set(table) != set(want) or any(tuple(np.shape(table[k])) != s for k, s in want.items()):
                raise ConfigError(f"{where}: expert table must hold {config.EXPERT_KIND} experts "
                                  f"{ {k: ['R', *s[1:]] for k, s in want.items()} }, "
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


def _kept_whole(config, layer: int, where: str) -> str:
    return (f"{where}: layer {layer} is a {config.TITLE} layer kept whole (a hash layer: its experts are "
            "tid2eid[token id], no router chooses among them); pruning, merging or substituting its experts is "
            "not implemented (docs/families.md)")


def maps_from_masks(masks_LE, config) -> dict:
    """{MoE layer: ExpertMap(mask)} from expert masks [num_hidden_layers, n_experts] (numpy, or JAX
    arrays traced inside a caller's jit), each layer's row cut to its own experts_in_layer(layer)
    first columns: the one conversion of a pruning given as masks into the form the forward takes.
    Layers kept whole (`is_kept_whole`, whose rows `check_variant` requires all True) get none."""
    import jax.numpy as jnp

    from moejax.moe.expert_map import ExpertMap

    return {l: ExpertMap(jnp.asarray(masks_LE[l][..., :config.experts_in_layer(l)])) for l in config.scored_layers}


def check_routable(mask_E, layer: int, config, where: str) -> None:
    """The one rule every form of variant meets at each MoE layer (expert masks, expert maps, kept
    sets, the experiments' own selections): routing under the mask gives every token top_k kept
    experts (`moejax.moe.routing.RouterConfig.check_mask`: at least num_experts_per_tok kept, and
    under group-limited routing enough in whichever groups a token can be given). The mask is
    n_experts wide; the layer reads its own first experts_in_layer(layer) columns."""
    from moejax.moe.routing import RouterConfig

    n = config.experts_in_layer(layer)
    RouterConfig(**config.router_settings()).check_mask(np.asarray(mask_E)[:n], f"{where}: layer {layer}")

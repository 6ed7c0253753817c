"""`moejax prune`'s first step, `plan_pruning`: which experts every MoE layer keeps, and what the
pruned checkpoint's config.json says (SPEC section 2: keep counts or ratios, the routing floor,
ties to the lower index, routing groups, a global allocation). No expert data is read, except by
the `aimer` score, which reads each MoE layer's expert matrices one tensor at a time.

Scores come from the router tensors (data-free scores, from the weights-only statistics
`moejax.scoring.data_free`, which `moejax diff` and `moejax score` read too), from a
`moejax score` parquet file, or in memory (`moejax merge`'s cluster leaders). The plan is a
`PrunePlan`; `moejax.surgery.prune` writes it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pandas as pd

from moejax.errors import CheckpointError, ConfigError
from moejax.hf.fused_experts import FusedExpertsReader
from moejax.hf.io.checkpoint_reader import CheckpointReader
from moejax.hf.layout import CheckpointLayout, MoeLayer
from moejax.hf.mtp_names import MTP_DEFAULT, carried_mtp_block, check_mtp_policy
from moejax.allocation import ALLOCATIONS, Budget, layer_counts, statistic_of
from moejax.scoring.data_free import data_free_stats
from moejax.scoring.scores import DATA_FREE_SCORES, SCORES, compute_scores
from moejax.scoring.select import group_counts, resolve_keep, select_kept, select_kept_grouped


@dataclasses.dataclass(frozen=True)
class PrunePlan:
    """What `plan_pruning` decided, all that writing the pruned checkpoint needs."""

    kept: dict[int, list[int]]       # MoE layer -> kept source expert indices, ascending
    n_experts: dict[int, int]        # MoE layer -> source expert count
    dropped_layers: tuple[int, ...]  # MTP layers removed entirely (--mtp drop)
    config: dict                     # the pruned checkpoint's config.json
    groups: str                      # "none" | "preserved" | "collapsed"
    notes: tuple[str, ...]
    # MoE layer -> source experts written but made unreachable (balance bias UNREACHABLE_BIAS): a
    # family with layers kept whole (`MoeConfig.is_kept_whole`, DeepSeek-V4's hash layers) keeps every
    # layer's count, so that transformers loads it; `kept` then lists every written expert
    unreachable: dict = dataclasses.field(default_factory=dict)
    # stored-name prefixes of an MTP block moejax carries and --mtp drop removes (DeepSeek-V4's `mtp.`)
    dropped_prefixes: tuple = ()


# The balance bias of an unreachable slot: below any score (sigmoid, sqrtsoftplus: at most ~1e2) plus bias
UNREACHABLE_BIAS = -1e4


def _scores_from_file(path: Path, score: str, layers: dict[int, MoeLayer]) -> dict[int, np.ndarray]:
    """One score per layer from a `moejax score` parquet (columns layer, expert, score, value),
    checked to cover exactly the experts of every layer being pruned."""
    try:
        df = pd.read_parquet(path)
    except (OSError, ValueError) as error:
        raise ConfigError(f"{path}: cannot read scores file: {error}") from error
    missing_columns = {"layer", "expert", "score", "value"} - set(df.columns)
    if missing_columns:
        raise ConfigError(f"{path}: scores file lacks columns {sorted(missing_columns)}; expected the table "
                          "`moejax score` writes (layer, expert, score, value)")
    available = sorted(df["score"].unique())
    if score not in available:
        raise ConfigError(f"{path}: has no score {score!r}; it has {available}")
    df = df[df["score"] == score]
    out, problems = {}, []
    for layer, ml in layers.items():
        rows = df[df["layer"] == layer].sort_values("expert")
        if rows.empty:
            problems.append(f"no rows for MoE layer {layer}")
        elif rows["expert"].tolist() != list(range(ml.n_experts)):
            problems.append(f"layer {layer}: experts {rows['expert'].tolist()[:8]}..., expected 0..{ml.n_experts - 1}")
        elif not np.isfinite(values := rows["value"].to_numpy(np.float64)).all():
            problems.append(f"layer {layer}: non-finite values at experts {np.flatnonzero(~np.isfinite(values)).tolist()[:16]}")
        else:
            out[layer] = values
    extra = sorted(set(df["layer"].unique()) - set(layers))
    if extra:
        problems.append(f"rows for layers {extra}, which are not MoE layers of the checkpoint being pruned")
    if problems:
        raise ConfigError(f"{path}: score {score!r} does not fit the checkpoint: " + "; ".join(problems))
    return out


def _layer_scores(reader, layers, score, scores_file, seed, layer_scores=None, cfg=None) -> dict[int, np.ndarray]:
    if layer_scores is not None:  # given in memory (`moejax merge`: its cluster leaders)
        missing = sorted(set(layers) - set(layer_scores))
        if missing:
            raise ConfigError(f"score {score!r}: no values for MoE layers {missing}")
        return {l: np.asarray(layer_scores[l], np.float64) for l in layers}
    if scores_file is not None:
        return _scores_from_file(Path(scores_file), score, layers)
    if score not in SCORES:
        raise ConfigError(f"unknown score {score!r}; valid scores: {', '.join(sorted(SCORES))}")
    if score not in DATA_FREE_SCORES:
        raise ConfigError(f"score {score!r} needs a calibration pass: run `moejax score SRC --text ... --out "
                          f"scores.parquet` and pass --scores-file scores.parquet --score {score}; "
                          f"without one, use a data-free score ({', '.join(DATA_FREE_SCORES)})")
    if score == "bias":
        no_bias = [ml.router for ml in layers.values() if ml.bias is None]
        if no_bias:
            raise CheckpointError(f"score 'bias' needs e_score_correction_bias, missing beside {no_bias[:3]}")
    return {l: compute_scores(data_free_stats(reader, ml, cfg, [score], seed), [score])[score]
            for l, ml in layers.items()}


def _keep_counts(layers, keep, layers_keep, top_k) -> dict[int, int]:
    """Per-layer keep counts: --layers-keep entries, else --keep; each resolved against the
    layer's E and refused below the routing floor."""
    layers_keep = dict(layers_keep or {})
    counts, problems = {}, []
    for key in layers_keep:
        if not (isinstance(key, int) or (isinstance(key, str) and key.isdigit())) or int(key) not in layers:
            problems.append(f"--layers-keep names layer {key!r}, which is not a MoE layer "
                            f"(MoE layers: {sorted(layers)})")
    by_layer = {int(k): v for k, v in layers_keep.items() if str(k).isdigit()}
    for layer, ml in layers.items():
        value = by_layer.get(layer, keep)
        if value is None:
            problems.append(f"layer {layer}: no keep (give --keep, or list every MoE layer in --layers-keep)")
            continue
        try:
            counts[layer] = resolve_keep(value, ml.n_experts, top_k)
        except ConfigError as error:
            problems.append(f"layer {layer}: {error}")
    if problems:
        raise ConfigError("; ".join(problems))
    return counts


def plan_pruning(reader: FusedExpertsReader | CheckpointReader, layout: CheckpointLayout, cfg, *, score: str, keep=None,
                 scores_file=None, layers_keep: dict | None = None, group_aware: bool = False,
                 collapse_groups: bool = False, mtp: str = MTP_DEFAULT, seed: int = 0,
                 layer_scores: dict | None = None, allocation="uniform", leaders: bool = False,
                 counts: dict | None = None, fitness_of=None, search: dict | None = None) -> PrunePlan:
    """Decide the kept experts of every MoE layer and the pruned config; raises before any
    writing when the request is not well defined (SPEC section 2). layer_scores: {layer: [E]}
    given in memory instead of a data-free score or a scores file. allocation (`moejax.allocation`,
    a name or object): the per-layer counts, `keep` x layers in all (global: one threshold over
    the layers' normalised scores; shape: SHAPE's coverage of the scores file's `shapley`; evo_esap:
    a search by the fitness `fitness_of(rankings {layer: [E]}, layers)` builds, over the decoder
    layers (an MTP layer keeps `keep`), its record into `search`); counts: {layer: count} already
    allocated. leaders: layer_scores mark a merge's cluster leaders (refusals
    are worded for `moejax merge`). mtp: what becomes of MTP layers (`MTP_POLICIES`)."""
    # cfg: the family's typed config, checked with the checkpoint (moejax.hf.check); the pruned
    # config.json is the source's dictionary with the family's expert-count key updated.
    new_config, notes = cfg.settings_dict(), []  # the settings' level (a wrapper's text_config)
    layers, dropped, whole = _layers_to_prune(reader, layout, cfg, mtp)
    dropped_prefixes = carried_mtp_block(cfg, mtp, layout.other)
    allocation = ALLOCATIONS.parse(allocation)
    scores = _layer_scores(reader, layers, score, scores_file, seed, layer_scores, cfg)
    if counts is None:
        counts = _keep_counts(layers, keep, layers_keep, cfg.num_experts_per_tok)
        statistic = _allocation_statistic(reader, layers, score, scores, scores_file, seed, cfg, allocation)
        counts = _allocated_counts(statistic, counts, layers_keep, cfg.num_experts_per_tok, allocation,
                                   cfg.num_hidden_layers, fitness_of, search, cfg.router_settings().get("n_group", 1),
                                   collapse_groups)
    kept = _choose_kept(scores, counts, cfg, score, group_aware, allocation)
    fixed = [l for l in layout.moe_layers if cfg.is_kept_whole(l)]
    unreachable = _as_unreachable(kept, cfg, fixed, notes) if fixed else {}
    kept.update({l: np.ones(layout.moe_layers[l].n_experts, bool) for l in (*whole, *fixed)})  # --mtp keep
    if whole:
        notes.append(f"MTP layer(s) {list(whole)} kept whole (--mtp keep): {cfg.experts_key} is the decoder layers' "
                     "count and moe_sparsity_config.num_experts lists the MTP layer's; moejax and transformers' main "
                     "model load it, servers that build the MTP layer with the config's one count do not")
    groups = _groups_rule(kept, cfg, collapse_groups, group_aware, leaders, new_config, notes)
    _rewrite_expert_counts(cfg, kept, dropped, new_config, notes)
    rewrite_mtp(cfg, dropped, new_config, notes, dropped_prefixes)
    return PrunePlan(kept={l: np.flatnonzero(m).tolist() for l, m in sorted(kept.items())},
                     n_experts={l: layout.moe_layers[l].n_experts for l in sorted(kept)}, dropped_layers=dropped,
                     config=cfg.with_settings(new_config), groups=groups, notes=tuple(notes),
                     unreachable=unreachable, dropped_prefixes=dropped_prefixes)


def _as_unreachable(kept: dict, cfg, fixed: list, notes: list) -> dict:
    """A family with MoE layers kept whole (`is_kept_whole`): the other layers' dropped experts stay
    as unreachable slots ({layer: dropped experts}; `kept` becomes every expert), their balance bias
    UNREACHABLE_BIAS, since config.json has one expert count for both kinds of layer and transformers
    reads no per-layer counts. No memory is saved; the pruned model computes what the masked one does."""
    if not cfg.HAS_BALANCE_BIAS:
        raise ConfigError(f"{cfg.TITLE}: layers {fixed} are kept whole and the others' dropped experts would have to "
                          "stay as unreachable slots, which needs a balance bias this family lacks")
    out = {l: np.flatnonzero(~m).tolist() for l, m in kept.items()}
    for l, m in kept.items():
        kept[l] = np.ones_like(m)
    notes.append(f"layers {fixed} kept whole ({cfg.TITLE}'s hash layers: their experts are tid2eid[token id], no "
                 f"router chooses them); the other layers' dropped experts stay as unreachable slots (balance bias "
                 f"{UNREACHABLE_BIAS:g}), so every layer keeps {cfg.experts_key}={cfg.n_experts} and transformers and "
                 "moejax load it; no memory is saved (docs/families.md)")
    return out


def _layers_to_prune(reader, layout: CheckpointLayout, cfg, mtp: str) -> tuple[dict[int, MoeLayer], tuple, tuple]:
    """({MoE layer: MoeLayer} to prune, the MTP layers dropped (--mtp drop), the MTP layers kept
    whole (--mtp keep)); refused when the checkpoint has no MoE layer, when a layer's expert count
    differs from config.json's, or when --mtp drop or keep would leave no layer to prune."""
    E_cfg, n_layers = cfg.n_experts, cfg.num_hidden_layers
    if not layout.moe_layers:
        raise CheckpointError(f"{reader.directory}: no MoE layers (no routed-expert tensors `layers.N.*.experts.E.*`)")
    wrong_E = {l: ml.n_experts for l, ml in layout.moe_layers.items() if ml.n_experts != cfg.experts_in_layer(l)}
    if wrong_E:  # (check_checkpoint refuses these; a layout from elsewhere might not agree)
        raise CheckpointError(f"{reader.directory}: layers have {wrong_E} experts, but config.json gives them "
                              f"{ {l: cfg.experts_in_layer(l) for l in wrong_E} } ({cfg.experts_key}={E_cfg}"
                              f"{', moe_sparsity_config.num_experts' if cfg.layer_num_experts else ''})")
    check_mtp_policy(mtp)
    aside = tuple(l for l in layout.moe_layers if l >= n_layers) if mtp != "prune" else ()
    layers = {l: ml for l, ml in layout.moe_layers.items() if l not in aside and not cfg.is_kept_whole(l)}
    if not layers:
        raise ConfigError(f"--mtp {mtp} would leave no MoE layer to prune: the only MoE layers {list(aside)} are "
                          f"MTP layers (num_hidden_layers={n_layers}); prune with --mtp prune")
    return layers, (aside if mtp == "drop" else ()), (aside if mtp == "keep" else ())


def _allocation_statistic(reader, layers, score: str, scores: dict, scores_file, seed, cfg, allocation) -> dict | None:
    """{layer: [E]} of what the allocation reads: the ranking's own scores, another score of the
    scores file (shape: `shapley`), or None (uniform)."""
    name = statistic_of(allocation, score)
    if name is None or name == score:
        return scores if name else None
    return _layer_scores(reader, layers, name, scores_file, seed, None, cfg)


def _allocated_counts(statistic: dict | None, counts: dict, layers_keep, top_k: int, allocation, n_layers: int,
                      fitness_of=None, search: dict | None = None, n_group: int = 1,
                      collapse_groups: bool = False) -> dict[int, int]:
    """The per-layer keep counts: `counts` as resolved (uniform), else spread over the layers by the
    allocation over its statistic (`layer_counts`), `keep` per layer in all; a searching allocation
    over the decoder layers by `fitness_of`'s fitness (MTP layers, which the fitness does not see,
    keep their counts)."""
    if allocation.reads is None:
        return counts
    if layers_keep:
        raise ConfigError(f"--allocation {allocation.name} spreads one --keep over the layers; it takes no --layers-keep")
    if allocation.searches:
        if n_group > 1 and not collapse_groups:
            raise ConfigError(f"--allocation {allocation.name} on group-limited routing (n_group={n_group}): a searched "
                              "count need not divide into the groups; give --collapse-groups (a candidate whose kept "
                              "sets break the groups is evaluated routing over all kept experts, as it is then written)")
        if fitness_of is None:
            raise ConfigError(f"--allocation {allocation.name} searches by the ESAP of candidates on calibration "
                              "tokens: give them with --text or --tokens (tokens apart from those the scores came from)")
        trunk = [l for l in sorted(statistic) if l < n_layers]
        ranking = {l: statistic[l] for l in trunk}
        budget = Budget.of({l: counts[l] for l in trunk}, {l: len(statistic[l]) for l in trunk}, top_k)
        fitness = fitness_of(ranking, trunk)
        searched, record = allocation.searched(budget, fitness)
        if search is not None:
            search.update(record, counts={str(l): c for l, c in searched.items()})
        return {**counts, **searched}
    # the budget: `keep` per layer (resolved against each layer's own count when they differ)
    budget = next(iter(counts.values())) if len(set(counts.values())) == 1 else counts
    return layer_counts(statistic, budget, top_k, allocation, {l: len(s) for l, s in statistic.items()})


def _choose_kept(scores: dict, counts: dict, cfg, score: str, group_aware: bool, allocation) -> dict:
    """{layer: bool mask [E] of the kept experts}: the top counts[l] by score, ties to the lower index;
    with --group-aware (and routing groups) an equal number in every group."""
    n_group = cfg.router_settings().get("n_group", 1)
    if not (group_aware and n_group > 1):
        return {l: select_kept(scores[l], counts[l], f"layer {l}: score {score!r}") for l in scores}
    kept = {}
    for l in scores:
        try:
            kept[l] = select_kept_grouped(scores[l], counts[l], n_group)
        except ConfigError as error:
            hint = ("" if allocation.reads is None and not allocation.searches else f" (keep={counts[l]} is the count --allocation "
                    f"{allocation} gave layer {l}; it does not allocate whole groups: prune with "
                    "--collapse-groups instead of --group-aware, or with a uniform allocation)")
            raise ConfigError(f"layer {l}: {error}{hint}") from None
    return kept


def keeps_groups(kept: dict, cfg) -> bool:
    """Whether kept sets {layer: bool [E]} keep group-limited routing as `_groups_rule` writes it
    ("preserved": every layer an equal count per group, enough for top_k); True without groups."""
    routing = cfg.router_settings()
    n_group, topk_group = routing.get("n_group", 1), routing.get("topk_group", 1)
    if n_group <= 1:
        return True
    need = per_group_needed(cfg.num_experts_per_tok, topk_group)
    counts = [group_counts(m, n_group).tolist() for m in kept.values()]
    return all(len(set(c)) == 1 and c[0] >= need for c in counts)


def _groups_rule(kept: dict, cfg, collapse_groups: bool, group_aware: bool, leaders: bool, new_config: dict,
                 notes: list) -> str:
    """What becomes of group-limited routing: "none" (no groups), "preserved" (every layer keeps
    an equal, routable count per group), "collapsed" (--collapse-groups: new_config gets
    n_group=1, topk_group=1, and notes say why); otherwise refused (`_broken_groups`)."""
    routing, top_k = cfg.router_settings(), cfg.num_experts_per_tok
    n_group, topk_group = routing.get("n_group", 1), routing.get("topk_group", 1)
    if n_group <= 1:
        return "none"
    per_group = {l: group_counts(m, n_group).tolist() for l, m in kept.items()}
    need = per_group_needed(top_k, topk_group)
    unusable = {l: c for l, c in per_group.items() if len(set(c)) > 1 or c[0] < need}
    if not unusable:
        return "preserved"
    if not collapse_groups:
        raise ConfigError(_broken_groups(unusable, n_group, topk_group, top_k, group_aware, leaders))
    new_config.update(n_group=1, topk_group=1)
    notes.append(f"routing groups collapsed: kept experts per group {next(iter(unusable.values()))} "
                 f"(layer {next(iter(unusable))}) cannot keep n_group={n_group}, so the pruned config has "
                 f"n_group=1, topk_group=1: each token picks its {top_k} experts by top-k over all kept "
                 "experts (bias included), without the group limit")
    return "collapsed"


def _rewrite_expert_counts(cfg, kept: dict, dropped: tuple, new_config: dict, notes: list) -> None:
    """new_config's expert count: the largest kept, under every spelling the source has; counts
    that differ between layers listed in moe_sparsity_config.num_experts (with a note)."""
    kept_counts = {l: int(m.sum()) for l, m in kept.items()}
    largest = _trunk_largest(kept_counts, cfg.num_hidden_layers)
    for key in cfg.keys_of(cfg.EXPERTS_FIELD):  # every spelling the source has (they must agree)
        new_config[key] = largest
    new_config.pop("moe_sparsity_config", None)  # a source pruned per layer: its counts are the source's
    if len(set(kept_counts.values())) > 1:
        new_config["moe_sparsity_config"] = {
            "method": "prune", "num_experts": [kept_counts.get(l) for l in _listed_layers(cfg, kept_counts, dropped)]}
        notes.append(f"expert counts differ between layers: {cfg.experts_key} is the largest and "
                     "moe_sparsity_config.num_experts lists each layer's count; moejax loads, scores, evaluates "
                     f"and prunes it (stock transformers and vLLM build every layer with {cfg.experts_key} experts "
                     "and will not load it)")


def _trunk_largest(kept_counts: dict, n_layers: int) -> int:
    """The largest kept count of the decoder layers: config.json's one count (an MTP layer kept
    whole, --mtp keep, may hold more and is listed in moe_sparsity_config)."""
    return max(c for l, c in kept_counts.items() if l < n_layers)


def rewrite_mtp(cfg, dropped: tuple, new_config: dict, notes: list, carried: tuple = ()) -> None:
    """With MTP layers dropped (`dropped`, decoder layers) or a carried MTP block dropped (`carried`,
    its stored-name prefixes from `carried_mtp_block`; --mtp drop): num_nextn_predict_layers=0
    (every spelling), and a note."""
    if dropped or carried:
        for key in cfg.keys_of("num_nextn_predict_layers"):
            new_config[key] = 0
    if dropped:
        notes.append(f"MTP layer(s) {list(dropped)} dropped (num_nextn_predict_layers=0)")
    if carried:
        notes.append(f"MTP block {[p + '*' for p in carried]} dropped (num_nextn_predict_layers=0)")


def per_group_needed(top_k: int, topk_group: int) -> int:
    """The experts every routing group of a written checkpoint keeps at least (all groups keeping one
    count): 2, as transformers scores a group by the sum of its top 2, and enough that the
    topk_group groups a token is given hold top_k (topk_group x per-group >= top_k)."""
    return max(2, -(-top_k // topk_group))


def _broken_groups(unusable: dict, n_group: int, topk_group: int, top_k: int, group_aware: bool,
                   leaders: bool) -> str:
    """The refusal of kept experts that group-limited routing cannot route, worded for the command
    that prints it: `moejax prune` (which can spread the keep over the groups with --group-aware),
    `moejax prune --group-aware` (which did, with too few per group) and `moejax merge` (whose
    cluster leaders fall where the clustering puts them)."""
    layer, c = next(iter(unusable.items()))
    need = per_group_needed(top_k, topk_group)
    rule = (f"group-limited routing (n_group={n_group}, topk_group={topk_group}, top_k={top_k}) needs equal counts of "
            f"at least {need} per group (transformers sums each group's top 2, and topk_group x per-group >= top_k)")
    collapse = "--collapse-groups to route over all kept experts without groups"
    affected = f"{len(unusable)} layer(s) affected"
    if leaders:
        return (f"the merge's cluster leaders in layer {layer} fall {c} per routing group, which {rule}; merge cannot "
                f"place its clusters per group: pass {collapse}, or another --keep ({affected})")
    if group_aware:
        return (f"--group-aware keeps {c[0]} experts in each of the {n_group} groups (layer {layer}), and {rule}: pass "
                f"a --keep of at least {need * n_group}, or {collapse} ({affected})")
    return (f"pruning would break group-limited routing: layer {layer} keeps {c} experts per group, and {rule}. Pass "
            f"--group-aware to keep an equal number per group, or {collapse} ({affected})")


def _listed_layers(cfg, kept_counts: dict, dropped: tuple) -> range:
    """The layers moe_sparsity_config.num_experts lists: the decoder layers, and the MTP layers
    when they are kept (an unlisted layer is read with the largest count, so an MTP layer kept with
    fewer experts must be listed: all of them, as the config reader expects)."""
    n_layers = cfg.num_hidden_layers
    mtp = range(n_layers, n_layers + (0 if dropped else cfg.num_nextn_predict_layers))
    if mtp and all(l in kept_counts for l in mtp):
        return range(mtp.stop)
    largest = _trunk_largest(kept_counts, n_layers)
    unlisted = {l: c for l, c in kept_counts.items() if l >= n_layers and c != largest}
    if unlisted:
        raise ConfigError(f"MTP layer(s) {sorted(unlisted)} would keep {unlisted} experts, which config.json cannot "
                          f"record while other MTP layers are absent from the checkpoint; prune with --mtp drop")
    return range(n_layers)

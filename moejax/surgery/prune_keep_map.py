"""`moejax prune SRC DST --keep-map MAP`: prune SRC to exactly the kept sets of a keep-map (a
keep_map.json, a compressed checkpoint folder holding one, or any format of
`moejax.hf.keep_map_formats`), planned by `plan_pruning` itself, so that the routing-group rule,
per-layer counts, MTP policy and config.json are exactly `moejax prune`'s.

How: every layer's keep count is the map's, and its score vector is 1 at the map's kept experts and 0
elsewhere, so the top count by score (ties to the lower index) is the map's set; the plan is then
checked to hold exactly those sets. Experts are written in ascending source order, as `moejax prune`
writes every checkpoint (a map listing another order, ascend-jsonl's or hipfire's, is noted:
the order is not kept). The MTP policy is what the map holds: its MTP layers absent (drop), whole
(keep, unless the map says it pruned them) or pruned (prune).

Checked before any writing: a map with a router fingerprint is refused unless it is SRC's; a foreign
format carries none, and is checked only to fit SRC (its layers are SRC's MoE layers with SRC's
expert counts, no layer below top_k), which a note says.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from moejax.errors import CheckpointError, ConfigError
from moejax.hf.keep_map import check_made_from, kept_of
from moejax.hf.keep_map_formats import fit_problems, read_keep_map_file
from moejax.hf.mtp_names import MTP_DEFAULT
from moejax.hf.provenance import FINGERPRINT_KEY
from moejax.surgery.prune_plan import PrunePlan, plan_pruning

SCORE = "keep_map"   # the method a keep-map prune records (VariantSpec.method)


def keep_map_request(keep_map: dict, fmt: str, where, checked, fingerprint: str,
                     mtp: str = MTP_DEFAULT) -> tuple[dict, dict, str, list[str]]:
    """({layer: keep count}, {layer: score [E], 1 at the kept experts}, the MTP policy, notes) that
    make `plan_pruning` choose the map's kept sets on the checked checkpoint `checked` (router
    fingerprint `fingerprint`); refused when the map was made from another checkpoint or does not
    fit this one. mtp: --mtp as given (refused when not the default and not the map's policy)."""
    cfg, counts = checked.config, {l: ml.n_experts for l, ml in checked.layout.moe_layers.items()}
    check_made_from(keep_map, where, checked.path, fingerprint)
    notes = []
    if keep_map[FINGERPRINT_KEY] is None:
        notes.append(f"{where} ({fmt}) carries no router fingerprint: it was checked only to fit {checked.path}'s MoE "
                     "layers and expert counts, not to have been made from it")
    kept, n_layers, top_k = kept_of(keep_map), cfg.num_hidden_layers, cfg.num_experts_per_tok
    problems = fit_problems(keep_map, counts)
    missing = sorted(l for l in counts if l < n_layers and l not in kept)
    if missing:
        problems.append(f"the checkpoint's MoE layers {missing} are not in the map")
    few = {l: len(k) for l, k in kept.items() if len(k) < top_k}
    if few:
        problems.append(f"layers {sorted(few)} keep {sorted(set(few.values()))} experts, fewer than top_k {top_k}")
    mtp_layers = sorted(l for l in counts if l >= n_layers)
    listed = [l for l in mtp_layers if l in kept]
    if listed and listed != mtp_layers:
        problems.append(f"the map lists MTP layers {listed} but not {sorted(set(mtp_layers) - set(listed))}")
    if problems:
        raise ConfigError(f"{where}: does not fit {checked.path}:\n  - " + "\n  - ".join(problems))
    whole = all(kept[l] == list(range(counts[l])) for l in listed)
    policy = ("drop" if mtp_layers and not listed else
              "keep" if listed and whole and keep_map["mtp"] != "prune" else
              "prune" if mtp_layers else mtp)   # no MTP layer for the map to decide: --mtp as given
    if mtp != MTP_DEFAULT and mtp != policy:
        raise ConfigError(f"--mtp {mtp}: the keep-map {where} decides the MTP layers {mtp_layers}: --mtp {policy}")
    layers = [l for l in kept if policy == "prune" or l < n_layers]
    if any(kept[l] != sorted(kept[l]) for l in layers):
        notes.append(f"{where} lists kept experts in another order than ascending; moejax prune writes them in "
                     "ascending source order, so the map's order is not kept")
    scores = {l: np.isin(np.arange(counts[l]), kept[l]).astype(np.float64) for l in layers}
    return {l: len(kept[l]) for l in layers}, scores, policy, notes


def plan_from_keep_map(path, checked, fingerprint: str, *, fmt: str | None = None, settings: dict | None = None,
                       collapse_groups: bool = False, mtp: str = MTP_DEFAULT) -> tuple[PrunePlan, dict, str]:
    """(the plan pruning `checked` to the keep-map at `path`, what the record says of the map, the MTP
    policy applied).
    fmt: the map's format (None: detected); settings: what its format needs (ascend-jsonl's ratio)."""
    counts = {l: ml.n_experts for l, ml in checked.layout.moe_layers.items()}
    keep_map, fmt = read_keep_map_file(path, fmt, counts, settings)
    layers_keep, scores, policy, notes = keep_map_request(keep_map, fmt, path, checked, fingerprint, mtp)
    plan = plan_pruning(checked.reader, checked.layout, checked.config, score=SCORE, layers_keep=layers_keep,
                        collapse_groups=collapse_groups, mtp=policy, layer_scores=scores)
    wrong = {l: k for l, k in plan.kept.items() if l in layers_keep and k != sorted(kept_of(keep_map)[l])}
    if wrong:   # (plan_pruning chose otherwise: a bug, never a checkpoint written from it)
        raise CheckpointError(f"{path}: the plan keeps {wrong}, not the map's sets")
    plan = dataclasses.replace(plan, notes=plan.notes + tuple(notes))   # unreachable slots, dropped prefixes kept
    about = {"path": str(Path(path).resolve()), "format": fmt, "source": keep_map["source"],
             FINGERPRINT_KEY: keep_map[FINGERPRINT_KEY], "method": keep_map.get("method"), "form": keep_map.get("form")}
    return plan, about, policy

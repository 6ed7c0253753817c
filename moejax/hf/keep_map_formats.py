"""The public formats a keep-map converts to and from (`moejax keep-map`, `moejax prune --keep-map`):
one table, `FORMATS`, of pairs of pure functions (canonical -> files, files -> canonical), whose
names are the CLI's choices. Each entry says where its layout is defined and what moejax assumes
where that source leaves a choice.

moejax (`moejax.hf.keep_map`): keep_map.json itself.

riy (vLLM PR #37824, "RIY: Runtime expert pruning", `--riy-expert-profile profile.json`; its parser
`vllm/model_executor/layers/fused_moe/riy.py`): `{"version": 1, "model": "...", "pruned_experts":
[[layer, expert], ...]}`, the PRUNED source experts as [decoder layer, expert] pairs; version 2 adds
`routing_mode` ("pre_topk_mask" | "post_topk_drop") and an optional `model_revision`, which version
1 must not carry; `workload` is free text. Kept experts are compacted in ascending id order. Its
docs' example: `{"version": 1, "model": "Qwen3.5-397B-A17B", "workload": "municipal German
administrative", "pruned_experts": [[0, 3], [0, 11], [4, 7], [12, 2]]}`. moejax writes version 1,
the pairs sorted, `model` the source folder's name; reading back needs each layer's expert count
(a keep-map's, or a checkpoint's), and a MoE layer absent from the list keeps every expert.

evoesap (ZongfangLiu/EvoESAP, `src/reap/non_uni_prune.py`): two files in a folder.
`nonuniform_plan.json` = `{"plan": [{"layer": l, "total_experts": E, "pruned_experts": p,
"kept_experts": E - p, "prune_ratio": p / E}, ...], "best_score": ...}`, one entry per MoE layer
(zero-pruned ones included), counts only; `pruned_experts.json` = `{"<layer>": [pruned ids]}`,
layers with nothing pruned left out. EvoESAP orders each list least salient first; a keep-map holds
no saliency, so moejax writes them ascending, and `best_score` null. Reading back needs
pruned_experts.json (the plan has no ids); the plan, when present, gives the counts (else a
keep-map's or checkpoint's) and is checked against it.

ascend-jsonl (vllm-ascend PR #12525, `vllm_ascend/patch/worker/patch_qwen3_moe_pruning.py`,
`--additional-config '{"expert_list_file": FILE, "expert_prune_ratio": R}'`): one single-key object
per line, `{"<layer>": [source ids, most important first]}`; the loader keeps the first
`int(num_experts * (1 - R))` ids of each list, in list order (its compact slot order). The PR's
example lines: `{"0":[106,65,113,84,104,53,127,11]}`, `{"1":[86,48,18,3,117,9,32,72]}`. One ratio
for the model: every layer must keep the same count of the same E. moejax writes each layer's kept
ids in the keep-map's order followed by its pruned ids ascending, and gives the ratio R to pass (one
for which `int(E * (1 - R))` is the kept count in Python's float arithmetic, checked). Reading back
needs R (`expert_prune_ratio`) and each layer's E; every MoE layer must be present.

hipfire (warpfront/hipfire PR #445, `crates/hipfire-reap/src/plan.rs`; `HIPFIRE_REAP_PLAN=<dir>`
reads `<dir>/reap_plan.json`): `{"original_experts": E, "num_layers": L, "keep": {"per_layer":
[[kept ids in compact slot order] for every decoder layer 0..L-1]}}`, every row the same length;
its test's example: `{"original_experts":4,"num_layers":2,"keep":{"per_layer":[[0,2,3],[1,2,3]]}}`.
Refused when a decoder layer is not a MoE layer or the counts differ between layers; MTP layers
(>= num_hidden_layers) have no row: left out when kept whole, else refused.

Only riy, evoesap and ascend-jsonl lose something: riy and evoesap the kept order (both compact in
ascending id order), all three a merge's clusters and a substitution's constants (they describe
pruning the source: a merged keep-map converts to pruning to its cluster leaders, with a note).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Callable

from moejax.errors import ConfigError
from moejax.hf.check import check_checkpoint
from moejax.hf.io.safetensors_format import refuse_duplicate_keys
from moejax.hf.io.staging import check_apart, check_destination, staged_directory
from moejax.hf.keep_map import (FORMAT, KEEP_MAP, check_made_from, checked_ids, keep_map_problems, layer_index,
                                n_experts_of, new_keep_map, parse_keep_map)
from moejax.hf.provenance import FINGERPRINT_KEY, checkpoint_fingerprint
from moejax.results import write_text_atomic


@dataclasses.dataclass(frozen=True)
class Converted:
    """A keep-map in a format: its files (name -> text; one file, or a folder's), notes on what the
    format could not hold, and the settings a runtime needs beside them (ascend-jsonl's ratio)."""

    files: dict[str, str]
    notes: tuple[str, ...] = ()
    settings: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class KeepMapFormat:
    name: str
    source: str                # where the layout is defined
    files: tuple[str, ...]     # the file names it reads and writes (several: written as a folder)
    keeps_order: bool          # whether a layer's kept order survives the format
    to: Callable[[dict], Converted]
    read: Callable[..., dict]  # read(files {path: bytes}, n_experts {layer: E} | None, settings) -> keep-map
    settings: tuple[str, ...] = ()   # what reading it needs beside the files

    @property
    def folder(self) -> bool:
        return len(self.files) > 1


# --- shared helpers ----------------------------------------------------------------------------

def _json(data: bytes, where: str):
    try:
        return json.loads(data.decode("utf-8"), object_pairs_hook=refuse_duplicate_keys)
    except (UnicodeDecodeError, ValueError) as e:
        raise ConfigError(f"{where}: not valid UTF-8 JSON: {e}") from None


def _int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _one(files: dict) -> tuple[str, bytes]:
    if len(files) != 1:
        raise ConfigError(f"expected one file, got {sorted(files)}")
    return next(iter(files.items()))


def _needs_counts(n_experts, where: str, name: str) -> dict:
    if not n_experts:
        raise ConfigError(f"{where}: a {name} file lists experts without each layer's expert count; give the "
                          "checkpoint it was made for (--checkpoint SRC; `moejax prune --keep-map` uses SRC's)")
    return dict(n_experts)


def _pruned(n: int, kept: list) -> list[int]:
    return sorted(set(range(n)) - set(kept))


def _loss_notes(keep_map: dict, name: str, keeps_order: bool) -> list[str]:
    """What a format that describes pruning the source cannot hold of this keep-map."""
    notes, layers = [], keep_map["layers"]
    if any("clusters" in e for e in layers.values()):
        notes.append(f"the keep-map is a merge's ({keep_map.get('method')}): {name} describes pruning the source, so "
                     "it holds the cluster leaders as pruned experts, not the merged experts the checkpoint holds")
    if any("substituted" in e for e in layers.values()):
        notes.append(f"the keep-map is a substitution's: {name} removes the substituted experts, where the "
                     "checkpoint keeps their router slots returning constants")
    if not keeps_order and any(e["kept"] != sorted(e["kept"]) for e in layers.values()):
        notes.append(f"{name} compacts kept experts in ascending id order: the keep-map's order is not kept")
    return notes


def _problems(where: str, what: str, problems: list) -> None:
    if problems:
        raise ConfigError(f"{where}: not a valid {what}:\n  - " + "\n  - ".join(problems))


def _layer(key, where: str, problems: list) -> int | None:
    layer = layer_index(key)
    if layer is None:
        problems.append(f"{where}: {key!r} is not a decoder-layer index")
    return layer


# --- moejax ------------------------------------------------------------------------------------

def to_moejax(keep_map: dict) -> Converted:
    return Converted({KEEP_MAP: json.dumps(keep_map, indent=2) + "\n"})


def read_moejax(files: dict, n_experts=None, settings=None) -> dict:
    where, data = _one(files)
    return parse_keep_map(data, where)


# --- riy ---------------------------------------------------------------------------------------

RIY_ROUTING_MODES = ("pre_topk_mask", "post_topk_drop")


def to_riy(keep_map: dict) -> Converted:
    pairs = [[layer, e] for layer, entry in sorted((int(l), e) for l, e in keep_map["layers"].items())
             for e in _pruned(entry["n_experts"], entry["kept"])]
    model = Path(keep_map["source"]).name if keep_map.get("source") else "unknown"
    profile = {"version": 1, "model": model, "pruned_experts": pairs}
    notes = _loss_notes(keep_map, "riy", False)
    n_layers = keep_map.get("num_hidden_layers")
    if n_layers is not None and any(int(l) >= n_layers for l in keep_map["layers"]):
        notes.append(f"MTP layers (>= {n_layers}) are written under moejax's indices; whether vLLM's MTP model "
                     "reads them under the same numbers is not checked")
    return Converted({"riy_profile.json": json.dumps(profile, indent=1) + "\n"}, tuple(notes))


def read_riy(files: dict, n_experts=None, settings=None) -> dict:
    where, data = _one(files)
    profile, problems = _json(data, where), []
    if not isinstance(profile, dict):
        raise ConfigError(f"{where}: a riy profile is a JSON object, got {type(profile).__name__}")
    version = profile.get("version")
    if version not in (1, 2) or not _int(version):
        problems.append(f"version: {version!r}, expected 1 or 2")
    if not isinstance(profile.get("model"), str):
        problems.append(f"model: expected a string, got {profile.get('model')!r}")
    if version == 1 and ("routing_mode" in profile or "model_revision" in profile):
        problems.append("routing_mode / model_revision: version 2 keys in a version 1 profile")
    if "routing_mode" in profile and profile["routing_mode"] not in RIY_ROUTING_MODES:
        problems.append(f"routing_mode: {profile['routing_mode']!r}, expected one of {list(RIY_ROUTING_MODES)}")
    pairs = profile.get("pruned_experts")
    if not isinstance(pairs, list) or not all(isinstance(p, list) and len(p) == 2 and all(map(_int, p)) for p in pairs):
        problems.append("pruned_experts: expected a list of [decoder layer, expert] integer pairs")
        pairs = []
    _problems(where, "riy expert profile", problems)
    counts = _needs_counts(n_experts, where, "riy")
    pruned = {}
    for layer, e in pairs:
        if layer not in counts:
            problems.append(f"pruned_experts: [{layer}, {e}]: layer {layer} is not a MoE layer (MoE layers: "
                            f"{sorted(counts)})")
        elif not 0 <= e < counts[layer]:
            problems.append(f"pruned_experts: [{layer}, {e}]: expert outside [0, {counts[layer]})")
        elif e in pruned.setdefault(layer, set()):
            problems.append(f"pruned_experts: [{layer}, {e}] given twice")
        else:
            pruned[layer].add(e)
    kept = {l: [e for e in range(n) if e not in pruned.get(l, ())] for l, n in counts.items()}
    problems += [f"pruned_experts: layer {l} prunes every expert" for l, k in kept.items() if not k]
    _problems(where, "riy expert profile", problems)
    return new_keep_map(kept, n_experts=counts)


# --- evoesap -----------------------------------------------------------------------------------

EVOESAP_PLAN, EVOESAP_PRUNED = "nonuniform_plan.json", "pruned_experts.json"


def to_evoesap(keep_map: dict) -> Converted:
    plan, pruned = [], {}
    for layer, entry in sorted((int(l), e) for l, e in keep_map["layers"].items()):
        n, ids = entry["n_experts"], _pruned(entry["n_experts"], entry["kept"])
        plan.append({"layer": layer, "total_experts": n, "pruned_experts": len(ids), "kept_experts": n - len(ids),
                     "prune_ratio": len(ids) / n})
        if ids:
            pruned[str(layer)] = ids
    notes = _loss_notes(keep_map, "evoesap", False) + [
        "pruned ids written ascending (EvoESAP lists them least salient first; a keep-map holds no saliency); "
        "best_score null"]
    return Converted({EVOESAP_PLAN: json.dumps({"plan": plan, "best_score": None}, indent=2) + "\n",
                      EVOESAP_PRUNED: json.dumps(pruned, indent=2) + "\n"}, tuple(notes))


def read_evoesap(files: dict, n_experts=None, settings=None) -> dict:
    by_name = {Path(p).name: (p, data) for p, data in files.items()}
    if EVOESAP_PRUNED not in by_name:
        raise ConfigError(f"{', '.join(files) or 'the folder'}: no {EVOESAP_PRUNED}; EvoESAP's {EVOESAP_PLAN} holds "
                          "counts only, the pruned ids are in pruned_experts.json beside it")
    where, data = by_name[EVOESAP_PRUNED]
    pruned, problems = _json(data, where), []
    if not isinstance(pruned, dict):
        raise ConfigError(f"{where}: expected a JSON object of layer -> pruned expert ids")
    counts = dict(n_experts or {})
    if EVOESAP_PLAN in by_name:
        counts = _evoesap_plan_counts(*by_name[EVOESAP_PLAN], counts, pruned)
    counts = _needs_counts(counts, where, "EvoESAP pruned_experts.json (without its nonuniform_plan.json)")
    kept = {}
    for key, ids in pruned.items():
        layer = _layer(key, where, problems)
        if layer is None:
            continue
        if layer not in counts:
            problems.append(f"{key}: not a MoE layer (MoE layers: {sorted(counts)})")
        elif checked_ids(ids, counts[layer], key, problems, empty_ok=True) is not None:
            kept[layer] = [e for e in range(counts[layer]) if e not in ids]
            if not kept[layer]:
                problems.append(f"{key}: prunes every expert")
    _problems(where, "EvoESAP pruned_experts.json", problems)
    return new_keep_map({l: kept.get(l, list(range(n))) for l, n in counts.items()}, n_experts=counts)


def _evoesap_plan_counts(where: str, data: bytes, counts: dict, pruned: dict) -> dict:
    """{layer: total_experts} of a nonuniform_plan.json, each entry checked (its counts, its ratio, the
    pruned ids' count in pruned_experts.json, and any expert count known otherwise)."""
    value, problems, out = _json(data, where), [], {}
    if not isinstance(value, dict) or not isinstance(value.get("plan"), list):
        raise ConfigError(f"{where}: expected {{\"plan\": [...], \"best_score\": ...}}")
    for i, item in enumerate(value["plan"]):
        keys = ("layer", "total_experts", "pruned_experts", "kept_experts")
        if not isinstance(item, dict) or not all(_int(item.get(k)) for k in keys):
            problems.append(f"plan[{i}]: expected integer {', '.join(keys)} and prune_ratio")
            continue
        layer, n, p = item["layer"], item["total_experts"], item["pruned_experts"]
        if layer in out:
            problems.append(f"plan[{i}]: layer {layer} listed twice")
        if n < 1 or not 0 <= p < n or item["kept_experts"] != n - p:
            problems.append(f"plan[{i}]: total {n}, pruned {p}, kept {item['kept_experts']} do not add up")
        ratio = item.get("prune_ratio")
        if not isinstance(ratio, (int, float)) or isinstance(ratio, bool) or not math.isclose(ratio, p / max(n, 1),
                                                                                               abs_tol=1e-12):
            problems.append(f"plan[{i}]: prune_ratio {ratio!r}, expected {p}/{n}")
        listed = pruned.get(str(layer), [])
        if isinstance(listed, list) and len(listed) != p:
            problems.append(f"plan[{i}]: layer {layer} prunes {p}, but {EVOESAP_PRUNED} lists {len(listed)}")
        if layer in counts and counts[layer] != n:
            problems.append(f"plan[{i}]: layer {layer} has total_experts {n}, but the checkpoint's layer has "
                            f"{counts[layer]}")
        out[layer] = n
    _problems(where, "EvoESAP nonuniform_plan.json", problems)
    return out


# --- ascend-jsonl ------------------------------------------------------------------------------

ASCEND_RATIO = "expert_prune_ratio"


def ascend_ratio(n: int, k: int) -> float:
    """A ratio R in [0, 1) for which `int(n * (1 - R))` is k in Python float arithmetic (the loader's
    count): (n - k) / n when it rounds right, else the nearest floats below it, else the midpoint
    (n - k - 0.5) / n; each candidate checked. Refused when none is found."""
    exact = (n - k) / n
    candidates, r = [exact], exact
    for _ in range(16):
        r = math.nextafter(r, -math.inf)
        candidates.append(r)
    candidates.append((n - k - 0.5) / n)
    for r in candidates:
        if 0.0 <= r < 1.0 and int(n * (1 - r)) == k:
            return r
    raise ConfigError(f"ascend-jsonl: no expert_prune_ratio R in [0, 1) gives int({n} * (1 - R)) == {k}")


def to_ascend(keep_map: dict) -> Converted:
    layers = {int(l): e for l, e in keep_map["layers"].items()}
    kept_counts = {l: len(e["kept"]) for l, e in sorted(layers.items())}
    counts = {l: e["n_experts"] for l, e in sorted(layers.items())}
    if len(set(kept_counts.values())) > 1 or len(set(counts.values())) > 1:
        raise ConfigError(f"ascend-jsonl keeps int(num_experts * (1 - expert_prune_ratio)) experts in every layer, "
                          f"one count for the model; this keep-map keeps {kept_counts} of {counts} experts per layer")
    n, k = next(iter(counts.values())), next(iter(kept_counts.values()))
    ratio = ascend_ratio(n, k)
    lines = [json.dumps({str(l): e["kept"] + _pruned(e["n_experts"], e["kept"])}, separators=(",", ":"))
             for l, e in sorted(layers.items())]
    notes = _loss_notes(keep_map, "ascend-jsonl", True) + [
        f"pass --additional-config '{{\"expert_list_file\": \"<this file>\", \"{ASCEND_RATIO}\": {ratio!r}}}' "
        f"(int({n} * (1 - {ratio!r})) = {k} experts kept per layer)"]
    return Converted({"expert_list.jsonl": "\n".join(lines) + "\n"}, tuple(notes), {ASCEND_RATIO: ratio})


def read_ascend(files: dict, n_experts=None, settings=None) -> dict:
    where, data = _one(files)
    ratio = (settings or {}).get(ASCEND_RATIO)
    if not isinstance(ratio, (int, float)) or isinstance(ratio, bool) or not 0 <= ratio < 1:
        raise ConfigError(f"{where}: an ascend-jsonl expert list keeps the first int(num_experts * (1 - "
                          f"{ASCEND_RATIO})) ids of each line; give {ASCEND_RATIO} in [0, 1) (--expert-prune-ratio), "
                          f"got {ratio!r}")
    counts = _needs_counts(n_experts, where, "ascend-jsonl")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{where}: not UTF-8: {e}") from None
    orders, problems = {}, []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        value = _json(line.encode(), f"{where}:{number}")
        if not isinstance(value, dict) or len(value) != 1:
            problems.append(f"line {number}: expected one object with one key, {{\"<layer>\": [ids]}}")
            continue
        (key, ids), = value.items()
        layer = _layer(key, f"line {number}", problems)
        if layer is None:
            continue
        if layer not in counts:
            problems.append(f"line {number}: layer {layer} is not a MoE layer (MoE layers: {sorted(counts)})")
        elif layer in orders:
            problems.append(f"line {number}: layer {layer} listed again")
        elif checked_ids(ids, counts[layer], f"line {number} (layer {layer})", problems) is not None:
            orders[layer] = ids
    missing = sorted(set(counts) - set(orders))
    if missing and not problems:
        problems.append(f"MoE layers {missing} have no line (the loader needs every MoE layer)")
    kept = {}
    for layer, ids in orders.items():
        k = int(counts[layer] * (1 - ratio))
        if k < 1 or len(ids) < k:
            problems.append(f"layer {layer}: keeps int({counts[layer]} * (1 - {ratio})) = {k} experts, but its line "
                            f"lists {len(ids)}")
        kept[layer] = ids[:k]
    _problems(where, "ascend-jsonl expert list", problems)
    return new_keep_map(kept, n_experts=counts)


# --- hipfire -----------------------------------------------------------------------------------

HIPFIRE_PLAN = "reap_plan.json"


def to_hipfire(keep_map: dict) -> Converted:
    layers = {int(l): e for l, e in keep_map["layers"].items()}
    n_layers = keep_map.get("num_hidden_layers") or max(layers) + 1
    beyond = {l: e for l, e in layers.items() if l >= n_layers}
    pruned_mtp = sorted(l for l, e in beyond.items() if e["kept"] != list(range(e["n_experts"])))
    if pruned_mtp:
        raise ConfigError(f"hipfire's per_layer rows are the decoder layers 0..{n_layers - 1}; MTP layers "
                          f"{pruned_mtp} are pruned and have no row (prune with --mtp keep or drop)")
    dense = [l for l in range(n_layers) if l not in layers]
    if dense:
        raise ConfigError(f"hipfire gives every decoder layer 0..{n_layers - 1} a row of kept experts; layers "
                          f"{dense} are not MoE layers of this keep-map")
    kept_counts = {l: len(layers[l]["kept"]) for l in range(n_layers)}
    counts = {l: layers[l]["n_experts"] for l in range(n_layers)}
    if len(set(kept_counts.values())) > 1 or len(set(counts.values())) > 1:
        raise ConfigError(f"hipfire's plan has one original_experts and rows of one length; this keep-map keeps "
                          f"{kept_counts} of {counts} experts per layer")
    plan = {"original_experts": counts[0], "num_layers": n_layers,
            "keep": {"per_layer": [layers[l]["kept"] for l in range(n_layers)]}}
    notes = _loss_notes(keep_map, "hipfire", True)
    if beyond:
        notes.append(f"MTP layers {sorted(beyond)} kept whole are left out (hipfire rows are decoder layers only)")
    return Converted({HIPFIRE_PLAN: json.dumps(plan, indent=1) + "\n"}, tuple(notes))


def read_hipfire(files: dict, n_experts=None, settings=None) -> dict:
    where, data = _one(files)
    plan, problems = _json(data, where), []
    if not isinstance(plan, dict):
        raise ConfigError(f"{where}: a hipfire reap_plan.json is a JSON object")
    n, n_layers = plan.get("original_experts"), plan.get("num_layers")
    rows = plan.get("keep", {}).get("per_layer") if isinstance(plan.get("keep"), dict) else None
    if not _int(n) or n < 1:
        problems.append(f"original_experts: expected an integer >= 1, got {n!r}")
    if not _int(n_layers) or n_layers < 1:
        problems.append(f"num_layers: expected an integer >= 1, got {n_layers!r}")
    if not isinstance(rows, list):
        problems.append("keep.per_layer: expected a list of rows of kept expert ids, one per decoder layer")
    _problems(where, "hipfire reap plan", problems)
    if len(rows) != n_layers:
        problems.append(f"keep.per_layer: {len(rows)} rows for num_layers {n_layers}")
    for l, row in enumerate(rows):
        checked_ids(row, n, f"keep.per_layer[{l}]", problems)
    if len({len(r) for r in rows if isinstance(r, list)}) > 1:
        problems.append(f"keep.per_layer: rows of different lengths {[len(r) for r in rows]}")
    _problems(where, "hipfire reap plan", problems)
    return new_keep_map(dict(enumerate(rows)), n_experts={l: n for l in range(n_layers)}, num_hidden_layers=n_layers)


# --- the table ---------------------------------------------------------------------------------

FORMATS: dict[str, KeepMapFormat] = {f.name: f for f in (
    KeepMapFormat("moejax", "moejax.hf.keep_map (keep_map.json)", (KEEP_MAP,), True, to_moejax, read_moejax),
    KeepMapFormat("riy", "vLLM PR #37824, vllm/model_executor/layers/fused_moe/riy.py (--riy-expert-profile)",
                  ("riy_profile.json",), False, to_riy, read_riy),
    KeepMapFormat("evoesap", "ZongfangLiu/EvoESAP, src/reap/non_uni_prune.py", (EVOESAP_PLAN, EVOESAP_PRUNED),
                  False, to_evoesap, read_evoesap),
    KeepMapFormat("ascend-jsonl", "vllm-ascend PR #12525, vllm_ascend/patch/worker/patch_qwen3_moe_pruning.py",
                  ("expert_list.jsonl",), True, to_ascend, read_ascend, (ASCEND_RATIO,)),
    KeepMapFormat("hipfire", "warpfront/hipfire PR #445, crates/hipfire-reap/src/plan.rs (HIPFIRE_REAP_PLAN)",
                  (HIPFIRE_PLAN,), True, to_hipfire, read_hipfire),
)}


def format_named(name: str) -> KeepMapFormat:
    """The format called `name`; an unknown name is refused listing the known ones."""
    if name not in FORMATS:
        raise ConfigError(f"unknown keep-map format {name!r}; valid formats: {', '.join(FORMATS)}")
    return FORMATS[name]


def convert(keep_map: dict, name: str) -> Converted:
    """The keep-map (checked first) in the format `name`."""
    problems = keep_map_problems(keep_map)
    if problems:
        raise ConfigError("not a valid moejax keep-map:\n  - " + "\n  - ".join(problems))
    return format_named(name).to(keep_map)


def detect_format(path: Path) -> str:
    """The format of a keep-map file or folder, from its names and content; refused (listing the
    formats, for --from) when it cannot be told."""
    path = Path(path)
    if path.is_dir():
        for name, fmt in ((KEEP_MAP, "moejax"), (EVOESAP_PRUNED, "evoesap"), (EVOESAP_PLAN, "evoesap"),
                          (HIPFIRE_PLAN, "hipfire")):
            if (path / name).is_file():
                return fmt
    elif path.name in (EVOESAP_PRUNED, EVOESAP_PLAN):
        return "evoesap"
    elif path.suffix == ".jsonl":
        return "ascend-jsonl"
    elif path.is_file():
        try:
            text = path.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            text = ""
        try:
            value = json.loads(text)
        except ValueError:
            value = None
            if _json_lines(text):
                return "ascend-jsonl"
        if isinstance(value, dict):
            if value.get("format") == FORMAT:
                return "moejax"
            if "pruned_experts" in value and "version" in value:
                return "riy"
            if "original_experts" in value and "keep" in value:
                return "hipfire"
            if _json_lines(text):   # one line of ascend-jsonl
                return "ascend-jsonl"
    elif not path.exists():
        raise ConfigError(f"{path}: no such keep-map file or folder")
    raise ConfigError(f"{path}: cannot tell which keep-map format this is; name it with --from "
                      f"({', '.join(FORMATS)})")


def _json_lines(text: str) -> bool:
    """Whether every non-blank line of `text` (there being one) is `{"<layer>": [ids]}`."""
    lines = [line for line in text.splitlines() if line.strip()]
    try:
        values = [json.loads(line) for line in lines]
    except ValueError:
        return False
    return bool(values) and all(isinstance(v, dict) and len(v) == 1 and layer_index(next(iter(v))) is not None
                                and isinstance(next(iter(v.values())), list) for v in values)


def read_files(path: Path, fmt: KeepMapFormat) -> dict:
    """{path: bytes} of the format's files at `path` (a file; a folder holding them; for a folder
    format, also one of its files)."""
    path = Path(path)
    if fmt.folder:
        folder = path if path.is_dir() else path.parent
        found = {str(folder / name): (folder / name).read_bytes() for name in fmt.files if (folder / name).is_file()}
        if not found:
            raise ConfigError(f"{folder}: none of {list(fmt.files)} ({fmt.name})")
        return found
    if path.is_dir():
        path = path / fmt.files[0]
    try:
        return {str(path): path.read_bytes()}
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the {fmt.name} keep-map: {e.strerror or e}") from None


def read_keep_map_file(path, fmt: str | None = None, n_experts: dict | None = None,
                       settings: dict | None = None) -> tuple[dict, str]:
    """(the canonical keep-map, its format's name) of a keep-map in any format at `path` (`fmt`
    None: detected). n_experts {layer: E}: the counts a format without them needs (riy, evoesap
    without its plan, ascend-jsonl); settings: what else it needs (ascend-jsonl's ratio). A
    checkpoint folder holding keep_map.json is read through the checkpoint check (the keep-map
    checked against the checkpoint)."""
    path = Path(path)
    name = fmt or detect_format(path)
    entry = format_named(name)
    given = {k: v for k, v in (settings or {}).items() if v is not None}
    unused = sorted(set(given) - set(entry.settings))
    if unused:
        raise ConfigError(f"{path}: {unused} are not read by the {name} format (it reads {list(entry.settings) or 'none'})")
    if name == "moejax" and path.is_dir() and (path / "config.json").is_file():
        checked = check_checkpoint(path, uniform_experts=False, substituted=True)
        if checked.keep_map is None:
            raise ConfigError(f"{path}: a checkpoint folder without {KEEP_MAP}")
        return checked.keep_map, name
    return entry.read(read_files(path, entry), n_experts, given), name


def read_for_checkpoint(path, fmt: str | None = None, checkpoint=None, settings: dict | None = None) -> tuple[dict, str]:
    """`read_keep_map_file`, with `checkpoint` (None, or the checkpoint the map was made for) giving
    each layer's expert count, and the map checked against it: made from it (its fingerprint, when
    the map has one), fitting its MoE layers' counts and its top_k."""
    if checkpoint is None:
        return read_keep_map_file(path, fmt, None, settings)
    checked = check_checkpoint(checkpoint, uniform_experts=False)
    counts = {l: ml.n_experts for l, ml in checked.layout.moe_layers.items()}
    keep_map, name = read_keep_map_file(path, fmt, counts, settings)
    if keep_map[FINGERPRINT_KEY] is not None:
        check_made_from(keep_map, path, checked.path, checkpoint_fingerprint(checked))
    problems = fit_problems(keep_map, counts) + keep_map_problems(keep_map, checked.config.num_experts_per_tok)
    if problems:
        raise ConfigError(f"{path}: does not fit {checked.path}:\n  - " + "\n  - ".join(problems))
    return keep_map, name


def fit_problems(keep_map: dict, counts: dict) -> list[str]:
    """How a keep-map does not fit a checkpoint whose MoE layers hold `counts` {layer: E}: a layer
    that is not one of them, or another expert count."""
    problems, n_experts = [], n_experts_of(keep_map)
    extra = sorted(set(n_experts) - set(counts))
    if extra:
        problems.append(f"layers {extra} are not MoE layers of the checkpoint (its MoE layers: {sorted(counts)})")
    wrong = {l: (n, counts[l]) for l, n in n_experts.items() if l in counts and n != counts[l]}
    problems += [f"layer {l}: the map's n_experts {n}, the checkpoint's {c}" for l, (n, c) in wrong.items()]
    return problems


def write_converted(converted: Converted, fmt: KeepMapFormat, out, overwrite: bool = False, inputs=()) -> list[Path]:
    """Write a conversion to `out` atomically: a folder format's files into the folder `out` (a staging
    folder renamed into place), a one-file format's file at `out` (a hidden sibling renamed over
    it). An existing `out` is replaced only with overwrite; `out` may not be or hold an input."""
    out = Path(out)
    if fmt.folder:
        check_destination(out, overwrite, inputs)
        with staged_directory(out, overwrite) as staging:
            for name, text in converted.files.items():
                (staging / name).write_text(text, encoding="utf-8")
        return [out / name for name in converted.files]
    check_apart(out, inputs, "--out")
    if out.is_dir():
        raise ConfigError(f"{out}: is a folder; the {fmt.name} format is one file (--out FILE)")
    if out.exists() and not overwrite:
        raise ConfigError(f"{out}: already exists; pass --overwrite to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out, next(iter(converted.files.values())))
    return [out]


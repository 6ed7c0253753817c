"""`keep_map.json`: the one canonical record of which source experts a compressed checkpoint holds.

`moejax prune`, `moejax merge` and `moejax prune --substitute` write it beside `pruning.json`
(`moejax reroute` carries it over), every command that checks a checkpoint folder reads it
(`moejax.hf.check`), and `moejax keep-map` converts it to and from the public formats
(`moejax.hf.keep_map_formats`). Unlike `pruning.json`, whose fields vary with the command that
wrote it, it has one schema:

    {"format": "moejax-keep-map", "version": 1,
     "source": "/abs/path/of/source",          # null: read from a foreign format
     "fingerprint": "routers-sha256:...",      # the source's router fingerprint (moejax.hf.provenance)
     "mtp": "prune" | "keep" | "drop",         # the MTP policy (null: a foreign format)
     "dropped_layers": [..],                   # MTP layers removed (--mtp drop)
     "num_hidden_layers": 61,                  # the source's decoder layers (MTP layers are >= it); optional
     "method": .., "form": .., "allocation": ..,   # the variant (VariantSpec.record), when known
     "layers": {"3": {"n_experts": 64, "kept": [ids in the order written]}, ...}}

Layer keys are absolute decoder-layer indices as strings. Row i of the written layer holds the
source's expert `kept[i]` (pruning: ascending; merging: each cluster's leader, ascending, and
`clusters[i]` is cluster i, leader first). A substituted layer (MoNE) keeps every router slot at
its own index: `kept` lists the experts still computing and `substituted` those returning
constants (their slots stay). A layer the command left whole lists every expert.

Reads and writes no tensors; imports neither JAX nor torch.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

from moejax.errors import CheckpointError, ConfigError
from moejax.hf.io.safetensors_format import refuse_duplicate_keys
from moejax.hf.mtp_names import MTP_POLICIES
from moejax.hf.provenance import FINGERPRINT_KEY, PRUNING_RECORD

KEEP_MAP = "keep_map.json"
FORMAT = "moejax-keep-map"
VERSION = 1
REQUIRED = ("format", "version", "source", FINGERPRINT_KEY, "mtp", "dropped_layers", "layers")
OPTIONAL = ("num_hidden_layers", "method", "form", "allocation")
LAYER_KEYS = ("n_experts", "kept", "clusters", "substituted")
_FINGERPRINT = re.compile(r"^routers-sha256:[0-9a-f]{64}$")


def keep_map_of(record: dict, kept: dict, n_experts: dict, whole: dict | None = None,
                num_hidden_layers: int | None = None) -> dict:
    """The keep-map of a checkpoint a command is about to write: `record` (its pruning.json: source,
    fingerprint, mtp, dropped layers, the variant, and per layer any `clusters` or `substituted`),
    `kept` {layer: source experts in written order} and `n_experts` {layer: source count} (the
    plan's), and `whole` {layer: count} for source MoE layers written unchanged (an MTP layer
    --mtp keep left out of the plan)."""
    layers, extra = {}, record.get("layers") or {}
    whole = {l: c for l, c in (whole or {}).items() if l not in kept}
    for layer in sorted(set(kept) | set(whole)):
        if layer in kept:
            entry = {"n_experts": int(n_experts[layer]), "kept": [int(e) for e in kept[layer]]}
        else:
            entry = {"n_experts": int(whole[layer]), "kept": list(range(int(whole[layer])))}
        recorded = extra.get(str(layer), {})
        for key in ("clusters", "substituted"):
            # a layer written with unreachable slots (beside layers kept whole: DeepSeek-V4) keeps every
            # slot, so its rows are not one per cluster: its clusters stay in pruning.json only
            if key in recorded and "unreachable" not in recorded:
                entry[key] = recorded[key]
        layers[str(layer)] = entry
    return {"format": FORMAT, "version": VERSION, "source": record.get("source"),
            FINGERPRINT_KEY: record.get(FINGERPRINT_KEY), "mtp": record.get("mtp"),
            "dropped_layers": [int(l) for l in record.get("dropped_layers") or []],
            "num_hidden_layers": num_hidden_layers, "method": record.get("method"), "form": record.get("form"),
            "allocation": record.get("allocation"), "layers": layers}


def new_keep_map(layers: dict, *, n_experts: dict, source=None, fingerprint=None, mtp=None, dropped_layers=(),
                 num_hidden_layers=None, method=None, form=None, allocation=None, extra: dict | None = None) -> dict:
    """A keep-map from {layer: kept ids in order} and {layer: source count} (a foreign format's
    reader: no source, fingerprint or MTP policy). extra: {layer: {"clusters": ..} or {"substituted": ..}}."""
    out = {}
    for layer in sorted(layers):
        out[str(layer)] = {"n_experts": int(n_experts[layer]), "kept": [int(e) for e in layers[layer]],
                           **(extra or {}).get(layer, {})}
    return {"format": FORMAT, "version": VERSION, "source": source, FINGERPRINT_KEY: fingerprint, "mtp": mtp,
            "dropped_layers": sorted(int(l) for l in dropped_layers), "num_hidden_layers": num_hidden_layers,
            "method": method, "form": form, "allocation": allocation, "layers": out}


def _int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def checked_ids(value, n: int | None, key: str, problems: list, empty_ok: bool = False,
                what: str = "expert ids") -> list[int] | None:
    """`value` as a list of unique ints in [0, n), else None with the problems named by key."""
    if not isinstance(value, list) or not all(_int(e) for e in value):
        problems.append(f"{key}: expected a list of integer {what}, got {json.dumps(value)[:80]}")
        return None
    if not value and not empty_ok:
        problems.append(f"{key}: empty; a layer keeps at least one expert")
        return None
    repeated = sorted(e for e, c in Counter(value).items() if c > 1)
    if repeated:
        problems.append(f"{key}: {what} {repeated} given more than once")
    if n is not None:
        outside = [e for e in value if not 0 <= e < n]
        if outside:
            problems.append(f"{key}: expert ids {outside[:8]} outside [0, {n}) (n_experts {n})")
    return None if repeated or (n is not None and outside) else value


def layer_index(key) -> int | None:
    """A layer key ('3') as its index; None unless a decimal string without leading zeros."""
    return int(key) if isinstance(key, str) and key.isdigit() and str(int(key)) == key else None


def _check_layer(layer: str, entry, top_k: int | None, problems: list) -> None:
    where = f"layers.{layer}"
    if not isinstance(entry, dict):
        problems.append(f"{where}: expected an object with n_experts and kept, got {type(entry).__name__}")
        return
    unknown = sorted(set(entry) - set(LAYER_KEYS))
    if unknown:
        problems.append(f"{where}: unknown keys {unknown} (a layer has {', '.join(LAYER_KEYS)})")
    missing = [k for k in ("n_experts", "kept") if k not in entry]
    if missing:
        problems.append(f"{where}: missing {missing}")
        return
    n = entry["n_experts"]
    if not _int(n) or n < 1:
        problems.append(f"{where}.n_experts: expected an integer >= 1, got {n!r}")
        return
    kept = checked_ids(entry["kept"], n, f"{where}.kept", problems)
    if kept is not None and top_k is not None and len(kept) < top_k:
        problems.append(f"{where}.kept: {len(kept)} experts, fewer than the model's top_k "
                        f"(num_experts_per_tok {top_k}): a token could not be routed")
    if "clusters" in entry and "substituted" in entry:
        problems.append(f"{where}: both clusters (a merge) and substituted (a substitution)")
    if "clusters" in entry and kept is not None:
        _check_clusters(entry["clusters"], kept, n, f"{where}.clusters", problems)
    if "substituted" in entry and kept is not None:
        substituted = checked_ids(entry["substituted"], n, f"{where}.substituted", problems, empty_ok=True)
        if substituted is not None:
            both = sorted(set(kept) & set(substituted))
            if both:
                problems.append(f"{where}.substituted: experts {both} are also in kept")
            elif sorted(kept + substituted) != list(range(n)):
                problems.append(f"{where}: kept and substituted together must be every expert 0..{n - 1} "
                                "(a substituted layer keeps every router slot)")


def _check_clusters(clusters, kept: list, n: int, where: str, problems: list) -> None:
    """clusters[i] is row i's cluster, leader (kept[i]) first; together they are every expert once."""
    if not isinstance(clusters, list) or not all(isinstance(c, list) and c for c in clusters):
        problems.append(f"{where}: expected a list of non-empty lists of expert ids")
        return
    if len(clusters) != len(kept):
        problems.append(f"{where}: {len(clusters)} clusters for {len(kept)} kept experts (one cluster per row)")
        return
    members = checked_ids([e for c in clusters for e in c], n, where, problems)
    if members is None:
        return
    if sorted(members) != list(range(n)):
        problems.append(f"{where}: the clusters hold experts {sorted(members)[:8]}..., not every expert 0..{n - 1} once")
    wrong = [i for i, c in enumerate(clusters) if c[0] != kept[i]]
    if wrong:
        problems.append(f"{where}[{wrong[0]}]: starts with {clusters[wrong[0]][0]}, but row {wrong[0]} keeps "
                        f"expert {kept[wrong[0]]} (each cluster's leader comes first, in kept's order)")


def keep_map_problems(value, top_k: int | None = None) -> list[str]:
    """Every way `value` is not a canonical keep-map, each naming its key (empty: it is one).
    top_k: the model's num_experts_per_tok, when known (no layer may keep fewer)."""
    if not isinstance(value, dict):
        return [f"expected a JSON object, got {type(value).__name__}"]
    problems = []
    missing = [k for k in REQUIRED if k not in value]
    if missing:
        problems.append(f"missing keys {missing}")
    unknown = sorted(set(value) - set(REQUIRED) - set(OPTIONAL))
    if unknown:
        problems.append(f"unknown keys {unknown} (a keep-map has {', '.join(REQUIRED + OPTIONAL)})")
    if value.get("format", FORMAT) != FORMAT:
        problems.append(f"format: {value['format']!r}, expected {FORMAT!r}")
    if "version" in value and (not _int(value["version"]) or value["version"] != VERSION):
        problems.append(f"version: {value['version']!r}, expected {VERSION}")
    for key in ("source", "method", "form", "allocation"):
        if value.get(key) is not None and not isinstance(value[key], str):
            problems.append(f"{key}: expected a string or null, got {value[key]!r}")
    fingerprint = value.get(FINGERPRINT_KEY)
    if fingerprint is not None and not (isinstance(fingerprint, str) and _FINGERPRINT.match(fingerprint)):
        problems.append(f"{FINGERPRINT_KEY}: {fingerprint!r} is not a router fingerprint ('routers-sha256:' and 64 "
                        "hex digits, moejax.hf.provenance) nor null")
    if value.get("mtp") is not None and value["mtp"] not in MTP_POLICIES:
        problems.append(f"mtp: {value['mtp']!r}, expected one of {list(MTP_POLICIES)} or null")
    n_layers = value.get("num_hidden_layers")
    if n_layers is not None and (not _int(n_layers) or n_layers < 1):
        problems.append(f"num_hidden_layers: expected an integer >= 1 or null, got {n_layers!r}")
        n_layers = None
    dropped = checked_ids(value.get("dropped_layers", []), None, "dropped_layers", problems, True, "layer indices") or []
    if any(l < 0 for l in dropped):
        problems.append(f"dropped_layers: negative layer indices {[l for l in dropped if l < 0]}")
    if n_layers is not None and any(l < n_layers for l in dropped):
        problems.append(f"dropped_layers: {[l for l in dropped if l < n_layers]} are decoder layers "
                        f"(num_hidden_layers {n_layers}); only MTP layers are dropped")
    layers = value.get("layers")
    if "layers" in value and (not isinstance(layers, dict) or not layers):
        problems.append("layers: expected a non-empty object of decoder layer -> {n_experts, kept}")
    elif isinstance(layers, dict):
        for key, entry in layers.items():
            layer = layer_index(key)
            if layer is None:
                problems.append(f"layers: key {key!r} is not a decoder-layer index written as a decimal string")
                continue
            if layer in dropped:
                problems.append(f"layers.{key}: listed, and also in dropped_layers")
            _check_layer(key, entry, top_k, problems)
    return problems


def check_keep_map(value, where, top_k: int | None = None, error=ConfigError) -> dict:
    """`value` if it is a canonical keep-map, else `error` naming `where` (its file) and every
    key at fault."""
    problems = keep_map_problems(value, top_k)
    if problems:
        raise error(f"{where}: not a valid moejax keep-map:\n  - " + "\n  - ".join(problems))
    return value


def parse_keep_map(data: bytes, where, top_k: int | None = None, error=ConfigError) -> dict:
    """A keep_map.json's bytes, parsed (no key given twice) and checked."""
    try:
        value = json.loads(data.decode("utf-8"), object_pairs_hook=refuse_duplicate_keys)
    except (UnicodeDecodeError, ValueError) as e:
        raise error(f"{where}: not valid UTF-8 JSON: {e}") from None
    return check_keep_map(value, where, top_k, error)


def check_made_from(keep_map: dict, where, target, fingerprint: str) -> None:
    """Refuse a keep-map made from another checkpoint than `target` (router fingerprint
    `fingerprint`), naming both fingerprints; a map without one (a foreign format's) passes."""
    recorded = keep_map[FINGERPRINT_KEY]
    if recorded is not None and recorded != fingerprint:
        raise ConfigError(f"{where}: this keep-map was made from {keep_map['source'] or 'another checkpoint'} (router "
                          f"fingerprint {recorded}), not from {target} ({fingerprint}): its expert ids would select "
                          "another model's experts; use it with the checkpoint it was made from")


def kept_of(keep_map: dict) -> dict[int, list[int]]:
    """{layer: kept source experts in written order} of a checked keep-map."""
    return {int(l): list(entry["kept"]) for l, entry in keep_map["layers"].items()}


def n_experts_of(keep_map: dict) -> dict[int, int]:
    """{layer: the source's expert count} of a checked keep-map."""
    return {int(l): entry["n_experts"] for l, entry in keep_map["layers"].items()}


def written_count(entry: dict) -> int:
    """How many experts the checkpoint's layer holds: every slot when substituted, else the kept."""
    return entry["n_experts"] if "substituted" in entry else len(entry["kept"])


def write_keep_map(folder, keep_map: dict) -> None:
    """keep_map.json into `folder` (a staging folder: published with it, atomically)."""
    (Path(folder) / KEEP_MAP).write_text(json.dumps(keep_map, indent=2) + "\n", encoding="utf-8")


def against_checkpoint(keep_map: dict, counts: dict, *, substituted: dict | None = None,
                       pruning: dict | None = None) -> list[str]:
    """How a checked keep-map disagrees with the checkpoint folder holding it, each naming its key:
    counts {MoE layer: experts the checkpoint's layer holds}; substituted {layer: [experts the
    checkpoint substitutes]} (None: not a substituted checkpoint); pruning: its pruning.json, if
    any (the record the keep-map was derived from: the same source, fingerprint, MTP policy, dropped
    layers and, per layer it lists, the same n_experts, kept, clusters and substituted)."""
    problems, layers = [], keep_map["layers"]
    listed = {int(l) for l in layers}
    if listed - set(counts):
        problems.append(f"layers: {sorted(listed - set(counts))} are not MoE layers of the checkpoint "
                        f"(its MoE layers: {sorted(counts)})")
    if set(counts) - listed:
        problems.append(f"layers: the checkpoint's MoE layers {sorted(set(counts) - listed)} are not listed")
    present = sorted(set(keep_map["dropped_layers"]) & set(counts))
    if present:
        problems.append(f"dropped_layers: {present} are MoE layers the checkpoint still holds")
    for key, entry in layers.items():
        layer = int(key)
        if layer in counts and written_count(entry) != counts[layer]:
            what = "n_experts (every slot of a substituted layer)" if "substituted" in entry else "kept"
            problems.append(f"layers.{key}.{what.split()[0]}: {written_count(entry)} experts, but the checkpoint's "
                            f"layer {layer} holds {counts[layer]}")
        declared = None if substituted is None else substituted.get(layer, [])
        if declared is not None and sorted(entry.get("substituted", [])) != sorted(declared):
            problems.append(f"layers.{key}.substituted: {entry.get('substituted')}, but config.json substitutes "
                            f"{sorted(declared)} in layer {layer}")
        if substituted is None and "substituted" in entry:
            problems.append(f"layers.{key}.substituted: listed, but the checkpoint declares no expert substitution")
    return problems + (_against_record(keep_map, pruning) if pruning is not None else [])


def _against_record(keep_map: dict, record) -> list[str]:
    """keep-map keys that disagree with the pruning.json beside it."""
    if not isinstance(record, dict) or not isinstance(record.get("layers"), dict):
        return [f"{PRUNING_RECORD} beside it is not a record with per-layer kept experts; cannot agree with it"]
    problems = []
    for key in ("source", FINGERPRINT_KEY, "mtp", "dropped_layers"):
        if key in record and record[key] != keep_map[key]:
            problems.append(f"{key}: {keep_map[key]!r}, but {PRUNING_RECORD} has {record[key]!r}")
    layers = keep_map["layers"]
    for key, entry in record["layers"].items():
        if key not in layers:
            problems.append(f"layers.{key}: missing, but {PRUNING_RECORD} lists layer {key}")
            continue
        # (a layer with unreachable slots records its clusters in pruning.json only: `keep_map_of`)
        for field in ("n_experts", "kept") + (("clusters", "substituted") if "unreachable" not in entry else ()):
            if field in entry and entry[field] != layers[key].get(field):
                problems.append(f"layers.{key}.{field}: {json.dumps(layers[key].get(field))[:60]}, but "
                                f"{PRUNING_RECORD} has {json.dumps(entry[field])[:60]}")
    for key, entry in layers.items():
        if key not in record["layers"] and entry["kept"] != list(range(entry["n_experts"])):
            problems.append(f"layers.{key}: not in {PRUNING_RECORD}, yet not kept whole")
    return problems


def checkpoint_keep_map(storage, counts: dict, top_k: int | None, substituted: dict | None) -> dict | None:
    """The keep_map.json of a local checkpoint folder, checked against it (`against_checkpoint`:
    its layers' counts, its substitution, its pruning.json); None when there is none. A malformed
    or inconsistent one is a `CheckpointError` naming the file and every key at fault. A remote
    checkpoint's is not read (one more request per command; not yet)."""
    if storage.remote:
        return None
    path = storage.root / KEEP_MAP
    data = storage.read_file(path)
    if data is None:
        return None
    keep_map = parse_keep_map(data, path, top_k, CheckpointError)
    record_bytes = storage.read_file(storage.root / PRUNING_RECORD)
    record = None
    if record_bytes is not None:
        try:
            record = json.loads(record_bytes.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            raise CheckpointError(f"{storage.root / PRUNING_RECORD}: not valid UTF-8 JSON ({e}); the keep-map "
                                  f"{path} cannot be checked against it") from None
    problems = against_checkpoint(keep_map, counts, substituted=substituted, pruning=record)
    if problems:
        raise CheckpointError(f"{path}: does not agree with the checkpoint it is in:\n  - " + "\n  - ".join(problems))
    return keep_map

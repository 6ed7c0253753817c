"""`moejax diff SRC PRUNED`: recover a pruned checkpoint's selection from the files and audit it.

A pruned checkpoint written honestly keeps every kept router row byte-identical (SPEC section 6),
so hashing the router rows of both checkpoints and matching them per layer recovers which source
experts survived, in which order, without any record from the tool that pruned it. With the
selection known, every other tensor can be checked for name, shape and (with `--hash`) bytes,
and the data-free scores (`signed`, `l1`, `bias`) can be asked whether they explain the choice.

Only headers, router tensors and balance biases are read unless `hash_tensors` asks for more, so
either checkpoint may be remote (an https:// base URL or hf://org/name[@revision]): the audit then
costs one or two range requests per shard header and one per router and bias tensor.
"""

from __future__ import annotations

import hashlib
import itertools

import numpy as np

from moejax.surgery.prune_plan import UNREACHABLE_BIAS
from moejax.hf.check import audit_checkpoint, check_checkpoint
from moejax.hf.io.checkpoint_reader import CheckpointReader
from moejax.hf.io.location import open_location
from moejax.hf.io.safetensors_format import TensorInfo, numpy_dtype
from moejax.hf.layout import CheckpointLayout, MoeLayer, checkpoint_layout, layer_of
from moejax.scoring.data_free import router_stats
from moejax.scoring.scores import DATA_FREE_SCORES, EXPERT_WEIGHT_SCORES, compute_scores, rank_correlation
from moejax.scoring.select import select_kept

# The data-free scores a selection is audited against (random explains nothing; aimer would read
# every expert tensor of the source, and diff reads routers and headers only).
DATA_FREE = tuple(n for n in DATA_FREE_SCORES if n != "random" and n not in EXPERT_WEIGHT_SCORES)


class _ReadOnce:
    """A reader that keeps the tensors read through it, so one layer's router and bias are read
    once (a remote checkpoint: one range request each) for both the row matching and the scores."""

    def __init__(self, reader: CheckpointReader):
        self.reader, self._bytes = reader, {}

    def read_bytes(self, name: str) -> bytes:
        if name not in self._bytes:
            self._bytes[name] = self.reader.read_bytes(name)
        return self._bytes[name]

    def read(self, name: str) -> np.ndarray:
        info = self.reader.info(name)
        dtype = numpy_dtype(info.dtype, f"{info.file}: tensor {name!r}")
        return np.frombuffer(bytearray(self.read_bytes(name)), dtype=dtype).reshape(info.shape)

    def __getattr__(self, attribute):  # info, shard_of, ...: the reader's
        return getattr(self.reader, attribute)


def _rows(reader: CheckpointReader, name: str) -> tuple[str, list[bytes]]:
    info = reader.info(name)
    data = reader.read_bytes(name)
    row = len(data) // info.shape[0] if info.shape and info.shape[0] else 0
    return info.dtype, [data[i * row:(i + 1) * row] for i in range(info.shape[0])]


def _as_bytes(value: float, dtype: str) -> bytes | None:
    """`value` as one entry of a safetensors dtype (F32, F64, BF16, F16), or None for another dtype."""
    import ml_dtypes

    types = {"F32": np.float32, "F64": np.float64, "F16": np.float16, "BF16": ml_dtypes.bfloat16}
    return np.asarray(value, types[dtype]).tobytes() if dtype in types else None


def match_rows(source_rows: list[bytes], pruned_rows: list[bytes]) -> list[int | None]:
    """For each pruned row, the source row it is a byte-identical copy of (None if none). Rows are
    matched by SHA-256; among identical source rows the first unused one after the previous match is
    taken, so duplicated rows still give an order-preserving answer when one exists."""
    by_hash: dict[bytes, list[int]] = {}
    for i, row in enumerate(source_rows):
        by_hash.setdefault(hashlib.sha256(row).digest(), []).append(i)
    used, previous, matched = set(), -1, []
    for row in pruned_rows:
        candidates = [i for i in by_hash.get(hashlib.sha256(row).digest(), []) if i not in used]
        after = [i for i in candidates if i > previous]
        choice = after[0] if after else (candidates[0] if candidates else None)
        matched.append(choice)
        if choice is not None:
            used.add(choice)
            previous = choice
    return matched


def data_free_scores(reader: CheckpointReader, ml: MoeLayer) -> dict[str, np.ndarray]:
    """SPEC section 2's weights-only scores of one source layer (the registry's functions on the
    router and bias, in float64); `bias` only where the layer has one."""
    names = [n for n in DATA_FREE if n != "bias" or ml.bias]
    return compute_scores(router_stats(reader, ml), names)


def _none_if_nan(value: float) -> float | None:
    return None if np.isnan(value) else value


def _score_report(scores: dict[str, np.ndarray], kept: list[int]) -> dict:
    """Does each score reproduce the kept set? Its overlap, the gap at its cut, the overlap between
    scores' own choices, and each score's Spearman correlation with the bias score."""
    n, E = len(kept), len(next(iter(scores.values())))
    chosen = {name: np.flatnonzero(select_kept(s, n)).tolist() for name, s in scores.items()}
    out = {}
    for name, s in scores.items():
        ranked = np.sort(s)[::-1]
        out[name] = {
            "reproduces": chosen[name] == kept,
            "overlap": len(set(chosen[name]) & set(kept)),
            "gap_at_cut": float(ranked[n - 1] - ranked[n]) if n < E else None,
            "spearman_with_bias": _none_if_nan(rank_correlation(s, scores["bias"])) if "bias" in scores else None,
        }
    pairs = {f"{a}~{b}": len(set(chosen[a]) & set(chosen[b])) for a, b in itertools.combinations(scores, 2)}
    return {"scores": out, "overlap_between_scores": pairs}


def _tensor_digest(reader: CheckpointReader, info: TensorInfo) -> str:
    """SHA-256 of one tensor's bytes, read in 64 MiB pieces (range requests when remote)."""
    digest = hashlib.sha256()
    step = 64 * 2**20
    for start in range(info.begin, info.end, step):
        chunk = reader.storage.read_range(info.file, start, min(step, info.end - start))
        if not chunk:
            break
        digest.update(chunk)
    return digest.hexdigest()


def _expected_names(src_layout: CheckpointLayout, pruned_layout: CheckpointLayout,
                    kept: dict[int, list[int | None]]) -> dict[str, str]:
    """Pruned tensor name -> the source tensor it should be a copy of (routers and biases aside)."""
    expected = {}
    src_layers = set(src_layout.decoder_layers)
    kept_layers = set(pruned_layout.decoder_layers)
    for name in src_layout.other:
        layer = layer_of(name)
        if layer is None or layer in kept_layers or layer not in src_layers:
            expected[name] = name
    for layer, pml in pruned_layout.moe_layers.items():
        sml = src_layout.moe_layers.get(layer)
        if sml is None:
            continue
        for j, source_index in enumerate(kept[layer]):
            if source_index is None or j not in pml.experts:
                continue
            for rest in sml.rests():
                expected[pml.expert_tensor(j, rest)] = sml.expert_tensor(source_index, rest)
    return expected



def diff_checkpoints(src, pruned, hash_tensors: bool = False) -> dict:
    """The audit of `pruned` against `src` as a JSON-serialisable dict (see module docstring)."""
    src, pruned = open_location(src), open_location(pruned)  # either may be remote (https://, hf://)
    checked = check_checkpoint(src, uniform_experts=False)  # the source must be sound, as for prune
    src_reader, src_layout = checked.reader, checked.layout  # per-expert views: fused experts read as per-expert
    pruned_problems, pruned_reader = audit_checkpoint(pruned)  # the pruned one is audited: its problems reported
    pruned_layout = checkpoint_layout(pruned_reader, checked.family)  # read as the source's family
    layers, kept_by_layer = {}, {}
    for layer, pml in pruned_layout.moe_layers.items():
        sml = src_layout.moe_layers.get(layer)
        if sml is None:
            layers[str(layer)] = {"error": "MoE layer in the pruned checkpoint but not in the source"}
            kept_by_layer[layer] = [None] * pml.n_experts
            continue
        src_layer = _ReadOnce(src_reader)
        src_dtype, src_rows = _rows(src_layer, sml.router)
        pruned_dtype, pruned_rows = _rows(pruned_reader, pml.router)
        kept = match_rows(src_rows, pruned_rows) if src_dtype == pruned_dtype else [None] * len(pruned_rows)
        kept_by_layer[layer] = kept
        entry = {
            "n_experts_source": sml.n_experts, "n_experts_pruned": pml.n_experts, "kept": kept,
            "router_dtype": [src_dtype, pruned_dtype],
            "rows_identical": all(k is not None for k in kept),
            "order_preserved": all(k is not None for k in kept) and all(a < b for a, b in zip(kept, kept[1:])),
            "bias_identical": None,
        }
        if sml.bias and pml.bias:
            _, src_bias = _rows(src_layer, sml.bias)
            bias_dtype, pruned_bias = _rows(pruned_reader, pml.bias)
            sentinel = _as_bytes(UNREACHABLE_BIAS, bias_dtype)
            # an unreachable slot (`moejax.surgery.prune_plan.UNREACHABLE_BIAS`: a layer pruned beside layers kept
            # whole, DeepSeek-V4's) is the source's expert with its bias set so: the one bias entry allowed to differ
            unreachable = [j for j, k in enumerate(kept) if k is not None and pruned_bias[j] == sentinel
                           and src_bias[k] != sentinel]
            entry["bias_identical"] = all(k is not None and (pruned_bias[j] == src_bias[k] or j in unreachable)
                                          for j, k in enumerate(kept))
            if unreachable:
                entry["unreachable"] = unreachable
        if entry["rows_identical"]:
            entry.update(_score_report(data_free_scores(src_layer, sml), sorted(kept)))
        layers[str(layer)] = entry
    expected = _expected_names(src_layout, pruned_layout, kept_by_layer)
    pruned_names = set(pruned_reader.keys()) - pruned_layout.router_names()
    missing = sorted(set(expected) - pruned_names)
    unexpected = sorted(pruned_names - set(expected))
    mismatched, differing_bytes = [], []
    for name in sorted(pruned_names & set(expected)):
        a, b = src_reader.info(expected[name]), pruned_reader.info(name)
        if (a.dtype, a.shape) != (b.dtype, b.shape):
            mismatched.append(f"{name}: {b.dtype}{list(b.shape)}, source {expected[name]} is {a.dtype}{list(a.shape)}")
        elif hash_tensors and _tensor_digest(src_reader, a) != _tensor_digest(pruned_reader, b):
            differing_bytes.append(name)
    dropped_layers = sorted(set(src_layout.decoder_layers) - set(pruned_layout.decoder_layers))
    report = {
        "source": src.describe(), "pruned": pruned.describe(),
        "layers": layers,
        "dropped_layers": dropped_layers,
        "pruned_config_problems": pruned_problems,
        "tensors": {
            "compared": len(pruned_names & set(expected)), "missing": missing, "unexpected": unexpected,
            "shape_or_dtype_mismatch": mismatched,
            "bytes_compared": hash_tensors, "bytes_differ": differing_bytes if hash_tensors else None,
        },
    }
    report["summary"] = _summary(report)
    return report


def _summary(report: dict) -> dict:
    entries = [e for e in report["layers"].values() if "error" not in e]
    t = report["tensors"]
    summary = {
        "moe_layers": len(report["layers"]),
        "all_rows_identical": all(e["rows_identical"] for e in entries) and len(entries) == len(report["layers"]),
        "all_bias_identical": all(e["bias_identical"] in (True, None) for e in entries),
        "order_preserved": all(e["order_preserved"] for e in entries),
        "other_tensors_identical": not (t["missing"] or t["unexpected"] or t["shape_or_dtype_mismatch"]
                                        or t["bytes_differ"]),
        "pruned_matches_its_config": not report["pruned_config_problems"],
    }
    for name in DATA_FREE:
        layers = [e["scores"][name] for e in entries if "scores" in e and name in e["scores"]]
        summary[f"{name}_reproduces_layers"] = f"{sum(s['reproduces'] for s in layers)}/{len(layers)}"
    return summary


CHECKS = ("all_rows_identical", "all_bias_identical", "order_preserved", "other_tensors_identical",
          "pruned_matches_its_config")  # `moejax diff` exits 1 when any of these is false


def failed_checks(report: dict) -> list[str]:
    """The audit's checks that failed (the data-free scores' reproduction is information, not a check)."""
    return [name for name in CHECKS if not report["summary"][name]]


def format_diff(report: dict) -> str:
    """The audit for people: a verdict per check, then one line per layer and score."""
    s, t = report["summary"], report["tensors"]
    yes = {True: "yes", False: "NO", None: "n/a"}
    lines = [f"source  {report['source']}", f"pruned  {report['pruned']}", "",
             f"router rows byte-identical copies   {yes[s['all_rows_identical']]}",
             f"bias entries byte-identical         {yes[s['all_bias_identical']]}",
             f"source order preserved              {yes[s['order_preserved']]}",
             f"other tensors same name and shape   {yes[not (t['missing'] or t['unexpected'] or t['shape_or_dtype_mismatch'])]}"
             f" ({t['compared']} compared)",
             f"other tensors same bytes            "
             f"{yes[not t['bytes_differ']] if t['bytes_compared'] else 'not checked (--hash)'}"]
    lines.append(f"pruned checkpoint matches its config {yes[s['pruned_matches_its_config']]}")
    for problem in report["pruned_config_problems"][:5]:
        lines.append(f"  {problem}")
    if report["dropped_layers"]:
        lines.append(f"layers absent from the pruned checkpoint: {report['dropped_layers']}")
    for key in ("missing", "unexpected", "shape_or_dtype_mismatch", "bytes_differ"):
        if t[key]:
            lines.append(f"{key.replace('_', ' ')}: {len(t[key])}, e.g. {t[key][:3]}")
    lines += ["", f"{'layer':>5} {'kept':>9}  " + "  ".join(f"{n:>26}" for n in DATA_FREE)]
    lines.append(f"{'':>5} {'':>9}  " + "  ".join(f"{'same  overlap  gap  rho':>26}" for _ in DATA_FREE))
    for layer, e in report["layers"].items():
        if "error" in e:
            lines.append(f"{layer:>5}  {e['error']}")
            continue
        cells = []
        for name in DATA_FREE:
            sc = e.get("scores", {}).get(name)
            if sc is None:
                cells.append(f"{'-':>26}")
                continue
            gap = "-" if sc["gap_at_cut"] is None else f"{sc['gap_at_cut']:.3g}"
            rho = "-" if sc["spearman_with_bias"] is None else f"{sc['spearman_with_bias']:+.2f}"
            cells.append(f"{yes[sc['reproduces']]:>4} {sc['overlap']:>8} {gap:>8} {rho:>5}")
        lines.append(f"{layer:>5} {e['n_experts_pruned']:>4}/{e['n_experts_source']:<4}  " + "  ".join(cells))
    lines += ["", "same: the score's own top-k is exactly the kept set; overlap: how many kept experts it "
              "shares; gap: its score margin at the cut; rho: Spearman with the bias score (-bias)"]
    return "\n".join(lines)

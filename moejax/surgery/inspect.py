"""`moejax inspect`: what a checkpoint holds, from the safetensors headers and config.json alone;
also the per-tensor header facts and the text tables that `moejax plan` (`moejax.surgery.plan`)
builds on.

No tensor data is read (only each shard's header), so inspect and plan answer in seconds for a
700 GB checkpoint and work on a checkpoint whose shards are still being downloaded as sparse files,
or on one that is not downloaded at all (`moejax inspect https://host/ckpt` or `hf://org/name@rev`:
one or two range requests per shard, `moejax.hf.io.remote`).
The module imports neither JAX nor torch, so the commands start fast.

Parameter counting follows Hugging Face (SPEC section 6): every tensor in the checkpoint counts its
number of elements, quantisation companions (``weight_scale_inv``, ``weight_scale``,
``weight_shape``, ``weight_zero_point``) included, except packed 4-bit tensors (``*.weight_packed``
of the ``int4_pack`` and ``mxfp4`` formats, DeepSeek-V4's I8 FP4 experts), which count in logical
4-bit values: two per byte, i.e. eight per int32 element for INT4 and two per uint8 element for
MXFP4 and DeepSeek-V4's FP4.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from moejax.errors import CheckpointError
from moejax.hf.check import PACKED_DTYPES, check_checkpoint
from moejax.hf.io.location import open_location
from moejax.hf.io.safetensors_format import DTYPE_BITS, TensorInfo
from moejax.hf.layout import CheckpointLayout
from moejax.hf.quant.decode import QUANT_FORMATS


_LAYER = re.compile(r"^(?:.*\.)?layers\.(?P<layer>\d+)\.")
_EMBEDDING = re.compile(r"^(?:.*\.)?embed_tokens\.weight$")
_LM_HEAD = re.compile(r"^(?:.*\.)?lm_head\.weight$")


# --------------------------------------------------------------------------------------------
# Per-tensor facts (header only)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorFacts:
    """What inspect and plan need to know about one tensor, all from its header entry.

    `kind` is "packed" (a 4-bit ``weight_packed``), "companion" (a quantisation scale or shape that
    a re-pricing replaces), "matrix" (any other tensor of 2 or more dimensions) or "vector" (norms,
    biases: 0 or 1 dimensions). `logical_shape` is the shape in logical values (a packed tensor's
    last dimension multiplied out; an INT4 row's padding to a multiple of 8 included, as in HF's
    count)."""

    name: str
    dtype: str
    nbytes: int
    parameters: int
    kind: str
    logical_shape: tuple[int, ...]
    layer: int | None
    routed: bool


def companion_suffixes(fmt: str | None) -> frozenset[str]:
    """Tensor-name endings that are a quantised weight's scales or shape in format `fmt` (not its
    packed values); none for an unquantised checkpoint."""
    if fmt is None:
        return frozenset()
    spec = QUANT_FORMATS[fmt]
    return frozenset(spec.tensor_suffixes + spec.optional_suffixes) - {"weight", spec.packed_suffix}


def _is_companion(name: str, fmt: str | None) -> bool:
    """A quantised weight's scale or shape in `fmt`; DeepSeek-V4's are `<x>.scale` (not its float32
    `hc_*_scale` vectors)."""
    if fmt == "deepseek_v4_fp8":
        return name.endswith(".scale")
    return name.endswith(tuple(companion_suffixes(fmt)))


def values_per_element(info: TensorInfo, fmt: str | None) -> int:
    """How many logical values one stored element holds: 8 for an INT4 ``weight_packed`` (I32), 2
    for an MXFP4 one or gpt-oss's ``*_blocks`` (U8) and for DeepSeek-V4's FP4 experts (an I8
    ``<x>.weight``: two e2m1 per byte), else 1 (element types checked by `moejax.hf.check`)."""
    if fmt == "deepseek_v4_fp8":
        return 2 if info.dtype == "I8" and info.name.endswith(".weight") else 1
    if fmt not in PACKED_DTYPES or not info.name.endswith(QUANT_FORMATS[fmt].packed_suffix):
        return 1
    return DTYPE_BITS[info.dtype] // 4


def tensor_facts(info: TensorInfo, fmt: str | None, routed: bool) -> TensorFacts:
    per_element = values_per_element(info, fmt)
    shape = tuple(info.shape)
    if per_element > 1:
        if not shape:
            raise CheckpointError(f"{info.file}: tensor {info.name!r} is packed but has no dimensions")
        kind, logical_shape = "packed", shape[:-1] + (shape[-1] * per_element,)
    elif _is_companion(info.name, fmt):
        kind, logical_shape = "companion", shape
    else:
        kind, logical_shape = ("matrix" if len(shape) >= 2 else "vector"), shape
    layer = _LAYER.match(info.name)
    return TensorFacts(info.name, info.dtype, info.nbytes, math.prod(logical_shape), kind, logical_shape,
                       int(layer["layer"]) if layer else None, routed)


@dataclass
class CheckpointFacts:
    """A checkpoint as headers, config and layout: everything inspect and plan look at."""

    path: Path  # a remote checkpoint: its RemotePath (prints as its URL)
    config: object  # the family's config, types and ranges checked (moejax.hf.check)
    fmt: str | None
    layout: CheckpointLayout
    tensors: dict[str, TensorFacts]  # per-expert view: transformers-5 fused experts as per-expert tensors
    stored_tensors: int              # tensors on disk (a fused expert tensor counts once)
    keep_map: dict | None = None     # its keep_map.json (checked against it by moejax.hf.check), if any


def checkpoint_facts(path) -> CheckpointFacts:
    """`path`: a local folder or a remote location (https://, hf://; `moejax.hf.io.storage`)."""
    storage = open_location(path)
    checked = check_checkpoint(storage, uniform_experts=False)  # the check every command runs first
    reader, layout, fmt = checked.reader, checked.layout, checked.fmt  # the per-expert view, as the layout's
    routed = layout.routed_names()
    tensors = {name: tensor_facts(reader.info(name), fmt, name in routed) for name in reader.keys()}
    return CheckpointFacts(storage.root, checked.config, fmt, layout, tensors, len(reader.reader.keys()),
                           checked.keep_map)


# --------------------------------------------------------------------------------------------
# inspect
# --------------------------------------------------------------------------------------------


def inspect_checkpoint(path) -> dict:
    """A JSON-serialisable summary of a checkpoint (keys are strings throughout, so the report
    survives a JSON round trip unchanged).

    * ``parameters.total``: as Hugging Face counts it (module docstring): numel of every tensor,
      companions included, packed 4-bit tensors in logical values. MTP layers are included.
    * ``parameters.routed_experts`` / ``other``: tensors under ``mlp.experts.{e}.`` (their
      companions included; transformers 5's fused ``mlp.experts.gate_up_proj`` / ``down_proj``
      counted as the per-expert tensors they hold, so the numbers equal the per-expert
      checkpoint's) against everything else; router rows and balance biases are "other".
    * ``tensors``: the tensors stored (a fused expert tensor counts once).
    * ``parameters.active_per_token`` (SPEC section 6): per MoE layer of the main model,
      ``num_experts_per_tok`` times one expert's parameters, plus every non-routed tensor of the
      main model, except that the input embedding counts as one row (``hidden_size`` values): a
      token looks up one row. With tied embeddings (no ``lm_head.weight`` on disk) the table is
      also the output projection and counts in full. MTP layers (index >= ``num_hidden_layers``)
      are left out; ``parameters.mtp`` reports them.
    * ``bytes``: stored bytes, split the same way and by safetensors dtype code.
    * ``keep_map``: from a compressed checkpoint's keep_map.json (`moejax.hf.keep_map`), its source,
      the source's router fingerprint, the variant, and per MoE layer the experts kept of the
      source's; None when the folder has none.
    """
    checkpoint = checkpoint_facts(path)
    num_layers = checkpoint.config.num_hidden_layers
    tensors = checkpoint.tensors.values()
    decoder = [l for l in checkpoint.layout.decoder_layers if l < num_layers]
    mtp = [l for l in checkpoint.layout.decoder_layers if l >= num_layers]
    moe = checkpoint.layout.moe_layers
    experts_per_token = checkpoint.config.num_experts_per_tok
    by_dtype = Counter()
    for facts in tensors:
        by_dtype[facts.dtype] += facts.nbytes
    routed_parameters = sum(f.parameters for f in tensors if f.routed)
    routed_bytes = sum(f.nbytes for f in tensors if f.routed)
    total_parameters = sum(f.parameters for f in tensors)
    total_bytes = sum(f.nbytes for f in tensors)
    return {
        "checkpoint": str(checkpoint.path),
        "quantization": checkpoint.fmt,
        "tensors": checkpoint.stored_tensors,
        "decoder_layers": {"count": len(decoder), "indices": decoder},
        "mtp_layers": {"count": len(mtp), "indices": mtp},
        "moe_layers": list(moe),
        "routed_experts": {str(l): layer.n_experts for l, layer in moe.items()},
        "experts_per_token": experts_per_token,
        "parameters": {
            "total": total_parameters,
            "routed_experts": routed_parameters,
            "other": total_parameters - routed_parameters,
            "active_per_token": active_parameters(checkpoint, num_layers, experts_per_token),
            "mtp": sum(f.parameters for f in tensors if f.layer is not None and f.layer >= num_layers),
        },
        "bytes": {
            "total": total_bytes,
            "routed_experts": routed_bytes,
            "other": total_bytes - routed_bytes,
            "by_dtype": dict(sorted(by_dtype.items())),
        },
        "keep_map": keep_map_summary(checkpoint.keep_map),
    }


def keep_map_summary(keep_map: dict | None) -> dict | None:
    """What inspect reports of a keep-map: source, fingerprint, variant, {layer: [kept, of]}."""
    if keep_map is None:
        return None
    return {"source": keep_map["source"], "fingerprint": keep_map["fingerprint"], "method": keep_map.get("method"),
            "form": keep_map.get("form"), "mtp": keep_map["mtp"], "dropped_layers": keep_map["dropped_layers"],
            "kept": {l: [len(e["kept"]), e["n_experts"]] for l, e in keep_map["layers"].items()}}


def expert_parameters(checkpoint: CheckpointFacts, layer: int) -> int:
    """Parameters of one routed expert of `layer`; every expert must have the same count, else
    "K experts' parameters" has no single value."""
    moe_layer = checkpoint.layout.moe_layers[layer]
    counts = {e: sum(checkpoint.tensors[n].parameters for n in names) for e, names in moe_layer.experts.items()}
    if len(set(counts.values())) > 1:
        raise CheckpointError(
            f"{checkpoint.path}: layer {layer}: routed experts differ in parameter count "
            f"({min(counts.values())} to {max(counts.values())}); expected one shape for all experts")
    return next(iter(counts.values()))


def active_parameters(checkpoint: CheckpointFacts, num_layers: int, experts_per_token: int | None) -> int:
    """Parameters one token of the main model touches (see inspect_checkpoint)."""
    main = [f for f in checkpoint.tensors.values() if f.layer is None or f.layer < num_layers]
    tied = not any(_LM_HEAD.match(f.name) for f in main)
    active = 0
    for facts in main:
        if facts.routed:
            continue
        if _EMBEDDING.match(facts.name) and facts.layer is None and not tied:
            active += facts.logical_shape[-1]
        else:
            active += facts.parameters
    for layer in checkpoint.layout.moe_layers:
        if layer < num_layers:
            active += experts_per_token * expert_parameters(checkpoint, layer)
    return active


def format_inspect(report: dict) -> str:
    """inspect_checkpoint's report as an aligned table for people."""
    p, b = report["parameters"], report["bytes"]
    experts = sorted(set(report["routed_experts"].values()))
    moe_line = f"{len(report['moe_layers'])} ({_ranges(report['moe_layers'])})"
    if report["moe_layers"]:
        moe_line += (f", {'/'.join(map(str, experts))} routed experts each, "
                     f"{report['experts_per_token']} per token")
    header = [
        ("checkpoint", report["checkpoint"]),
        ("quantization", report["quantization"] or "none"),
        ("tensors", f"{report['tensors']:,}"),
        ("decoder layers", f"{report['decoder_layers']['count']} ({_ranges(report['decoder_layers']['indices'])})"),
        ("MTP layers", f"{report['mtp_layers']['count']} ({_ranges(report['mtp_layers']['indices'])})"),
        ("MoE layers", moe_line),
    ]
    if report.get("keep_map"):
        km = report["keep_map"]
        kept = ", ".join(f"{l}: {k}/{n}" for l, (k, n) in km["kept"].items())
        header += [("keep map", f"{km['method'] or '?'} ({km['form'] or '?'}) from {km['source'] or 'unknown source'}"),
                   ("  fingerprint", km["fingerprint"] or "none (converted from a foreign format)"),
                   ("  kept per layer", kept)]
    lines = _align(header)
    lines += [""] + text_table(
        ["", "parameters", "bytes"],
        [["routed experts", human_count(p["routed_experts"]), human_bytes(b["routed_experts"])],
         ["everything else", human_count(p["other"]), human_bytes(b["other"])],
         ["total", human_count(p["total"]), human_bytes(b["total"])],
         ["active per token", human_count(p["active_per_token"]), ""],
         ["MTP layers (in total)", human_count(p["mtp"]), ""]])
    lines += [""] + text_table(["dtype", "bytes", "share"],
                           [[dtype, human_bytes(n), f"{100 * n / max(b['total'], 1):.1f}%"]
                            for dtype, n in b["by_dtype"].items()])
    lines += ["", "parameters as Hugging Face counts them (packed 4-bit in logical values, scales "
                  "included); GB = 1e9 bytes"]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Text helpers
# --------------------------------------------------------------------------------------------


def human_count(n: int) -> str:
    """1234567890 -> '1.23 B' (K, M, B, T: thousands, millions, billions, trillions)."""
    for scale, unit in ((10**12, "T"), (10**9, "B"), (10**6, "M"), (10**3, "K")):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return str(n)


def human_bytes(n: int) -> str:
    """4560000000 -> '4.56 GB' (decimal units: 1 GB = 1e9 bytes)."""
    for scale, unit in ((10**12, "TB"), (10**9, "GB"), (10**6, "MB"), (10**3, "KB")):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _ranges(indices: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2, 5, 7-8'; '-' when empty."""
    runs: list[list[int]] = []
    for index in indices:
        if runs and index == runs[-1][-1] + 1:
            runs[-1].append(index)
        else:
            runs.append([index])
    return ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs) or "-"


def _align(pairs: list[tuple[str, str]]) -> list[str]:
    width = max(len(key) for key, _ in pairs)
    return [f"{key:<{width}}  {value}" for key, value in pairs]


def text_table(headers: list[str], rows: list[list[str]]) -> list[str]:
    """First column left-aligned, the rest right-aligned (numbers)."""
    widths = [max(len(str(row[i])) for row in [headers, *rows]) for i in range(len(headers))]

    def line(cells):
        return "  ".join(f"{c:<{w}}" if i == 0 else f"{c:>{w}}" for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return [line(headers), *map(line, rows)]


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def _run_inspect(args) -> None:
    report = inspect_checkpoint(args.checkpoint)
    print(json.dumps(report, indent=2) if args.json else format_inspect(report))


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    """Add `inspect CKPT [--json]` to an argparse subparsers object; it sets `func(args)`, which
    prints the report. `moejax.surgery.plan.register_cli` adds `plan`."""
    p = subparsers.add_parser("inspect", help="parameters, bytes and MoE structure of a checkpoint (headers only)")
    p.add_argument("checkpoint", help="a local folder, an https:// base URL or hf://org/name[@revision]")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=_run_inspect)


__all__ = [
    "CheckpointFacts", "TensorFacts", "checkpoint_facts", "format_inspect", "human_bytes", "human_count",
    "inspect_checkpoint", "register_cli", "tensor_facts", "text_table",
]

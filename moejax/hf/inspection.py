"""`moejax inspect` and `moejax plan`: what a checkpoint holds, and how many accelerators its weights
need, from the safetensors headers and config.json alone.

No tensor data is read (only each shard's header), so both answer in seconds for a 700 GB
checkpoint and work on a checkpoint whose shards are still being downloaded as sparse files. The
module imports neither JAX nor torch, so the commands start fast.

Parameter counting follows Hugging Face (SPEC section 6): every tensor in the checkpoint counts its
number of elements, quantisation companions (``weight_scale_inv``, ``weight_scale``,
``weight_shape``, ``weight_zero_point``) included, except packed 4-bit tensors (``*.weight_packed``
of the ``int4_pack`` and ``mxfp4`` formats), which count in logical 4-bit values: two per byte, i.e.
eight per int32 element for INT4 and two per uint8 element for MXFP4.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from moejax.errors import CheckpointError, ConfigError
from moejax.hf.check import PACKED_DTYPES, check_checkpoint
from moejax.hf.layout import CheckpointLayout
from moejax.hf.quant import FP8_BLOCK, MXFP4_GROUP_SIZE, QUANT_FORMATS
from moejax.hf.safetensors_io import DTYPE_BITS, TensorInfo

GB = 10**9  # decimal, as accelerator vendors quote memory

# Memory per device in GB (1e9 bytes) as the vendors quote it.
ACCELERATORS_GB: dict[str, float] = {
    "H100": 80.0, "H200": 141.0, "B200": 180.0, "B300": 288.0, "TPU v5p": 95.0,
}
DEFAULT_HEADROOM = 0.9
MAX_DEVICES = 1024

PACKED_SUFFIX = "weight_packed"

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
    """Tensor-name suffixes (after the last dot) that are a quantised weight's scales or shape in
    format `fmt`; none for an unquantised checkpoint."""
    if fmt is None:
        return frozenset()
    spec = QUANT_FORMATS[fmt]
    return frozenset(spec.tensor_suffixes + spec.optional_suffixes) - {"weight", PACKED_SUFFIX}


def values_per_element(info: TensorInfo, fmt: str | None) -> int:
    """How many logical values one stored element holds: 8 for an INT4 ``weight_packed`` (I32), 2
    for an MXFP4 one (U8), else 1 (element types checked by `moejax.hf.check`)."""
    if fmt not in PACKED_DTYPES or _suffix(info.name) != PACKED_SUFFIX:
        return 1
    return DTYPE_BITS[info.dtype] // 4


def tensor_facts(info: TensorInfo, fmt: str | None, routed: bool) -> TensorFacts:
    per_element = values_per_element(info, fmt)
    shape = tuple(info.shape)
    if per_element > 1:
        if not shape:
            raise CheckpointError(f"{info.file}: tensor {info.name!r} is packed but has no dimensions")
        kind, logical_shape = "packed", shape[:-1] + (shape[-1] * per_element,)
    elif _suffix(info.name) in companion_suffixes(fmt):
        kind, logical_shape = "companion", shape
    else:
        kind, logical_shape = ("matrix" if len(shape) >= 2 else "vector"), shape
    layer = _LAYER.match(info.name)
    return TensorFacts(info.name, info.dtype, info.nbytes, math.prod(logical_shape), kind, logical_shape,
                       int(layer["layer"]) if layer else None, routed)


def _suffix(name: str) -> str:
    return name.rsplit(".", 1)[-1]


@dataclass
class _Checkpoint:
    """A checkpoint as headers, config and layout: everything inspect and plan look at."""

    path: Path
    config: object  # the family's config, types and ranges checked (moejax.hf.check)
    fmt: str | None
    layout: CheckpointLayout
    tensors: dict[str, TensorFacts]


def _load(path) -> _Checkpoint:
    checked = check_checkpoint(path, uniform_experts=False)  # the check every command runs first
    reader, layout, fmt = checked.reader.reader, checked.layout, checked.fmt
    routed = layout.routed_names()
    tensors = {name: tensor_facts(reader.info(name), fmt, name in routed) for name in reader.keys()}
    return _Checkpoint(Path(path), checked.config, fmt, layout, tensors)


# --------------------------------------------------------------------------------------------
# inspect
# --------------------------------------------------------------------------------------------


def inspect_checkpoint(path) -> dict:
    """A JSON-serialisable summary of a checkpoint (keys are strings throughout, so the report
    survives a JSON round trip unchanged).

    * ``parameters.total``: as Hugging Face counts it (module docstring): numel of every tensor,
      companions included, packed 4-bit tensors in logical values. MTP layers are included.
    * ``parameters.routed_experts`` / ``other``: tensors under ``mlp.experts.{e}.`` (their
      companions included) against everything else; router rows and balance biases are "other".
    * ``parameters.active_per_token`` (SPEC section 6): per MoE layer of the main model,
      ``num_experts_per_tok`` times one expert's parameters, plus every non-routed tensor of the
      main model, except that the input embedding counts as one row (``hidden_size`` values): a
      token looks up one row. With tied embeddings (no ``lm_head.weight`` on disk) the table is
      also the output projection and counts in full. MTP layers (index >= ``num_hidden_layers``)
      are left out; ``parameters.mtp`` reports them.
    * ``bytes``: stored bytes, split the same way and by safetensors dtype code.
    """
    checkpoint = _load(path)
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
        "tensors": len(checkpoint.tensors),
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
    }


def expert_parameters(checkpoint: _Checkpoint, layer: int) -> int:
    """Parameters of one routed expert of `layer`; every expert must have the same count, else
    "K experts' parameters" has no single value."""
    moe_layer = checkpoint.layout.moe_layers[layer]
    counts = {e: sum(checkpoint.tensors[n].parameters for n in names) for e, names in moe_layer.experts.items()}
    if len(set(counts.values())) > 1:
        raise CheckpointError(
            f"{checkpoint.path}: layer {layer}: routed experts differ in parameter count "
            f"({min(counts.values())} to {max(counts.values())}); expected one shape for all experts")
    return next(iter(counts.values()))


def active_parameters(checkpoint: _Checkpoint, num_layers: int, experts_per_token: int | None) -> int:
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
    lines = _align(header)
    lines += [""] + _table(
        ["", "parameters", "bytes"],
        [["routed experts", human_count(p["routed_experts"]), human_bytes(b["routed_experts"])],
         ["everything else", human_count(p["other"]), human_bytes(b["other"])],
         ["total", human_count(p["total"]), human_bytes(b["total"])],
         ["active per token", human_count(p["active_per_token"]), ""],
         ["MTP layers (in total)", human_count(p["mtp"]), ""]])
    lines += [""] + _table(["dtype", "bytes", "share"],
                           [[dtype, human_bytes(n), f"{100 * n / max(b['total'], 1):.1f}%"]
                            for dtype, n in b["by_dtype"].items()])
    lines += ["", "parameters as Hugging Face counts them (packed 4-bit in logical values, scales "
                  "included); GB = 1e9 bytes"]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# plan
# --------------------------------------------------------------------------------------------

# Storage formats a pricing can re-price a group of tensors in (see matrix_bytes).
_FORMAT_LABELS = {"bf16": "BF16", "fp8": "FP8", "mxfp4": "MXFP4"}


@dataclass(frozen=True)
class Pricing:
    """How expert weights and everything else are stored: a format name from _FORMAT_LABELS, or
    None for the bytes as stored."""

    experts: str | None
    rest: str | None

    @property
    def name(self) -> str:
        if self.experts is None and self.rest is None:
            return "as stored"
        return f"experts {_FORMAT_LABELS[self.experts]} / rest {_FORMAT_LABELS[self.rest]}"


PRICINGS = (
    Pricing(None, None),
    Pricing("bf16", "bf16"),
    Pricing("fp8", "bf16"),
    Pricing("fp8", "fp8"),
    Pricing("mxfp4", "bf16"),
    Pricing("mxfp4", "fp8"),
)


def matrix_bytes(logical_shape: tuple[int, ...], fmt: str) -> int:
    """Bytes of a [..., M, N] weight in `fmt`, scales included: BF16 2 per value; FP8 1 per value
    plus a float32 scale per 128x128 block (DeepSeek-V3); MXFP4 half a byte per value plus one E8M0
    byte per 32 values of a row. Leading dimensions (fused expert stacks) are separate matrices."""
    *batch, rows, cols = logical_shape
    matrices = math.prod(batch)
    if fmt == "bf16":
        return matrices * rows * cols * 2
    if fmt == "fp8":
        blocks = _ceil_div(rows, FP8_BLOCK[0]) * _ceil_div(cols, FP8_BLOCK[1])
        return matrices * (rows * cols + 4 * blocks)
    if fmt == "mxfp4":
        return matrices * rows * (_ceil_div(cols, 2) + _ceil_div(cols, MXFP4_GROUP_SIZE))
    raise ConfigError(f"unknown storage format {fmt!r}; expected one of {sorted(_FORMAT_LABELS)}")


def priced_bytes(facts: TensorFacts, fmt: str | None) -> int:
    """A tensor's bytes when its group is re-priced in `fmt` (None: as stored). Matrices, packed
    ones in their logical shape, take the format's bytes; the old scales and shapes are dropped
    (the new format's scales are in matrix_bytes); vectors (norms, biases) keep their bytes."""
    if fmt is None or facts.kind == "vector":
        return facts.nbytes
    if facts.kind == "companion":
        return 0
    return matrix_bytes(facts.logical_shape, fmt)


def smallest_device_count(total_bytes: int, device_gb: float, headroom: float,
                          must_divide: list[int], max_devices: int = MAX_DEVICES) -> int | None:
    """The smallest power of two n <= max_devices with total_bytes / n <= headroom * device memory
    and n dividing each of `must_divide` (routed experts and attention heads, which expert and
    tensor parallelism split evenly); None when there is none."""
    n = 1
    while n <= max_devices:
        if any(count % n for count in must_divide):
            return None  # a larger power of two cannot divide what this one does not
        if total_bytes <= headroom * device_gb * GB * n:
            return n
        n *= 2
    return None


def parse_gpu_specs(specs: list[str] | None) -> dict[str, float]:
    """``["MI300X=192", ...]`` (``--gpu NAME=GB``, GB = 1e9 bytes) -> ``{"MI300X": 192.0}``."""
    result: dict[str, float] = {}
    for spec in specs or []:
        name, sep, gb_text = str(spec).partition("=")
        name = name.strip()
        if not sep or not name or not gb_text.strip():
            raise ConfigError(f"--gpu {spec!r}: expected NAME=GB, e.g. --gpu MI300X=192")
        try:
            gb = float(gb_text)
        except ValueError:
            raise ConfigError(
                f"--gpu {spec!r}: memory {gb_text.strip()!r} is not a number of GB, e.g. --gpu MI300X=192") from None
        _check_capacity(name, gb, f"--gpu {spec!r}")
        if name in result:
            raise ConfigError(f"--gpu {spec!r}: {name!r} is given twice")
        result[name] = gb
    return result


def _check_capacity(name: str, gb, where: str) -> None:
    if isinstance(gb, bool) or not isinstance(gb, (int, float)) or not math.isfinite(gb) or gb <= 0:
        raise ConfigError(f"{where}: memory of {name!r} must be a positive number of GB (1e9 bytes), got {gb!r}")


def plan_checkpoint(path, extra_gpus: dict[str, float] | None = None, headroom: float = DEFAULT_HEADROOM) -> dict:
    """Weights-only memory plan: for each pricing (PRICINGS) the bytes of the weights, and per
    accelerator the fewest devices (a power of two dividing the routed expert count and the attention
    head count, at most MAX_DEVICES) whose memory times `headroom` holds an equal share; None when
    none does. KV cache, activations and runtime overhead are not counted: that is what the
    headroom leaves room for. Every tensor on disk is priced, MTP layers included.

    Re-pricing is an estimate: every matrix of the group (embedding, lm_head and routers included)
    takes the format, while real FP8 releases keep a few of those in BF16.

    `extra_gpus` ({"NAME": GB}) adds or overrides accelerators; GB = 1e9 bytes."""
    if isinstance(headroom, bool) or not isinstance(headroom, (int, float)) or not 0 < headroom <= 1:
        raise ConfigError(f"headroom must be in (0, 1], got {headroom!r}")
    for name, gb in (extra_gpus or {}).items():
        _check_capacity(name, gb, "extra_gpus")
    accelerators = {**ACCELERATORS_GB, **{name: float(gb) for name, gb in (extra_gpus or {}).items()}}
    checkpoint = _load(path)
    constraints = device_constraints(checkpoint)
    must_divide = constraints["routed_experts"] + ([constraints["num_attention_heads"]]
                                                   if constraints["num_attention_heads"] else [])
    pricings = []
    for pricing in PRICINGS:
        expert_bytes = sum(priced_bytes(f, pricing.experts) for f in checkpoint.tensors.values() if f.routed)
        other_bytes = sum(priced_bytes(f, pricing.rest) for f in checkpoint.tensors.values() if not f.routed)
        total = expert_bytes + other_bytes
        pricings.append({
            "name": pricing.name,
            "experts": pricing.experts or "stored",
            "rest": pricing.rest or "stored",
            "bytes": {"routed_experts": expert_bytes, "other": other_bytes, "total": total},
            "devices": {name: smallest_device_count(total, gb, headroom, must_divide)
                        for name, gb in accelerators.items()},
        })
    return {
        "checkpoint": str(checkpoint.path),
        "quantization": checkpoint.fmt,
        "headroom": headroom,
        "units": "GB = 1e9 bytes",
        "scope": "weights only: no KV cache, activations or runtime overhead",
        "constraints": {**constraints, "max_devices": MAX_DEVICES},
        "accelerators": accelerators,
        "pricings": pricings,
    }


def device_constraints(checkpoint: _Checkpoint) -> dict:
    """What a device count must divide: each MoE layer's routed expert count (config
    expert count when the checkpoint has no routed experts) and num_attention_heads."""
    experts = sorted({layer.n_experts for layer in checkpoint.layout.moe_layers.values()})
    if not experts:
        experts = [checkpoint.config.n_experts]
    return {"routed_experts": experts, "num_attention_heads": checkpoint.config.num_attention_heads}


def format_plan(report: dict) -> str:
    """plan_checkpoint's report as an aligned table for people."""
    constraints = report["constraints"]
    rule = [f"n a power of two <= {constraints['max_devices']}"]
    if constraints["routed_experts"]:
        rule.append(f"dividing {'/'.join(map(str, constraints['routed_experts']))} routed experts")
    if constraints["num_attention_heads"]:
        rule.append(f"dividing {constraints['num_attention_heads']} attention heads")
    columns = list(report["accelerators"])
    rows = [[p["name"], human_bytes(p["bytes"]["total"])]
            + [str(p["devices"][name]) if p["devices"][name] else "no fit" for name in columns]
            for p in report["pricings"]]
    headers = ["pricing", "weights"] + [f"{name} {gb:g} GB" for name, gb in report["accelerators"].items()]
    return "\n".join([
        f"plan for {report['checkpoint']} (quantization: {report['quantization'] or 'none'})",
        f"{report['scope']}; {report['units']}",
        f"devices needed: the smallest n with weights / n <= {report['headroom']:g} x device memory, "
        + ", ".join(rule),
        "",
        *_table(headers, rows),
    ])


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


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    """First column left-aligned, the rest right-aligned (numbers)."""
    widths = [max(len(str(row[i])) for row in [headers, *rows]) for i in range(len(headers))]

    def line(cells):
        return "  ".join(f"{c:<{w}}" if i == 0 else f"{c:>{w}}" for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return [line(headers), *map(line, rows)]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def _run_inspect(args) -> None:
    report = inspect_checkpoint(args.checkpoint)
    print(json.dumps(report, indent=2) if args.json else format_inspect(report))


def _run_plan(args) -> None:
    report = plan_checkpoint(args.checkpoint, extra_gpus=parse_gpu_specs(args.gpu), headroom=args.headroom)
    print(json.dumps(report, indent=2) if args.json else format_plan(report))


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    """Add `inspect CKPT [--json]` and `plan CKPT [--gpu NAME=GB ...] [--headroom F] [--json]` to an
    argparse subparsers object; each sets `func(args)`, which prints the report."""
    p = subparsers.add_parser("inspect", help="parameters, bytes and MoE structure of a checkpoint (headers only)")
    p.add_argument("checkpoint")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=_run_inspect)

    p = subparsers.add_parser("plan", help="accelerators needed for a checkpoint's weights, per storage format")
    p.add_argument("checkpoint")
    p.add_argument("--gpu", action="append", default=[], metavar="NAME=GB",
                   help="an extra accelerator and its memory in GB (1e9 bytes); repeatable")
    p.add_argument("--headroom", type=float, default=DEFAULT_HEADROOM,
                   help="fraction of device memory the weights may use (default 0.9)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=_run_plan)


__all__ = [
    "ACCELERATORS_GB", "PRICINGS", "Pricing", "TensorFacts", "format_inspect", "format_plan",
    "inspect_checkpoint", "matrix_bytes", "parse_gpu_specs", "plan_checkpoint", "priced_bytes",
    "register_cli", "smallest_device_count",
]

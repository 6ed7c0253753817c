"""`moejax plan`: how many accelerators a checkpoint's weights need, as stored and re-priced in
other storage formats (BF16, FP8, MXFP4), from the header facts of `moejax.surgery.inspect` alone;
also the accelerator memory table and the pricings.

No tensor data is read, so the plan of a 700 GB checkpoint takes seconds. The module imports
neither JAX nor torch, so the command starts fast.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass

from moejax.errors import ConfigError
from moejax.hf.quant.decode import FP8_BLOCK, MXFP4_GROUP_SIZE, ceil_div
from moejax.surgery.inspect import CheckpointFacts, TensorFacts, checkpoint_facts, human_bytes, text_table

GB = 10**9  # decimal, as accelerator vendors quote memory

# Memory per device in GB (1e9 bytes) as the vendors quote it.
ACCELERATORS_GB: dict[str, float] = {
    "H100": 80.0, "H200": 141.0, "B200": 180.0, "B300": 288.0, "TPU v5p": 95.0,
}
DEFAULT_HEADROOM = 0.9
MAX_DEVICES = 1024

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
        blocks = ceil_div(rows, FP8_BLOCK[0]) * ceil_div(cols, FP8_BLOCK[1])
        return matrices * (rows * cols + 4 * blocks)
    if fmt == "mxfp4":
        return matrices * rows * (ceil_div(cols, 2) + ceil_div(cols, MXFP4_GROUP_SIZE))
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
    checkpoint = checkpoint_facts(path)
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


def device_constraints(checkpoint: CheckpointFacts) -> dict:
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
        *text_table(headers, rows),
    ])


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def _run_plan(args) -> None:
    report = plan_checkpoint(args.checkpoint, extra_gpus=parse_gpu_specs(args.gpu), headroom=args.headroom)
    print(json.dumps(report, indent=2) if args.json else format_plan(report))


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    """Add `plan CKPT [--gpu NAME=GB ...] [--headroom F] [--json]` to an argparse subparsers object;
    it sets `func(args)`, which prints the report."""
    p = subparsers.add_parser("plan", help="accelerators needed for a checkpoint's weights, per storage format")
    p.add_argument("checkpoint", help="a local folder, an https:// base URL or hf://org/name[@revision]")
    p.add_argument("--gpu", action="append", default=[], metavar="NAME=GB",
                   help="an extra accelerator and its memory in GB (1e9 bytes); repeatable")
    p.add_argument("--headroom", type=float, default=DEFAULT_HEADROOM,
                   help="fraction of device memory the weights may use (default 0.9)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=_run_plan)


__all__ = [
    "ACCELERATORS_GB", "PRICINGS", "Pricing", "format_plan", "matrix_bytes", "parse_gpu_specs", "plan_checkpoint",
    "priced_bytes", "register_cli", "smallest_device_count",
]

"""The one check of a checkpoint folder against its config.json, run by every command before work.

`check_checkpoint(path)` (a local folder, or a remote location for the read-only tools: see
`moejax.hf.io.storage`) is what `from_pretrained`, `moejax score`, `prune`, `inspect`, `plan` and
`diff` all call first, so each refuses exactly what the others refuse:

* files: the index's shard paths are relative and stay inside the folder (a Hugging Face cache
  snapshot's symlinks into its `blobs/` are fine), every shard is a regular file, every tensor of
  a shard is listed in the index (`CheckpointReader`);
* the config: its family (`moejax.models.registry`), types and ranges of every key (the family's
  config class);
* the tensors: every tensor the config implies is present with the shape the config gives and a
  dtype moejax reads as what it claims to be (a router stored as I32 is refused, not ranked by
  its bit patterns); transformers 5's fused expert tensors are checked as the per-expert tensors
  they hold (`moejax.hf.fused_experts`, whose view every command then reads through, the layout
  included); a quantised weight has its companions; every other tensor is accounted for:
  decoder layers beyond `num_hidden_layers + num_nextn_predict_layers` are an error, not
  silently taken for MTP layers.

A compressed checkpoint's `keep_map.json` (`moejax.hf.keep_map`), when the folder holds one, is
checked too: its schema, each listed layer's expert count against the checkpoint's, and agreement
with the `pruning.json` beside it; a malformed or inconsistent one is refused naming the key.

A checkpoint whose MoE layers substitute experts by constants (MoNE, vLLM's `constant-v1`:
`moejax.hf.substitution`) is refused by name, except by `check_checkpoint(..., substituted=True)`
(`moejax.surgery.substitute.load_substituted`), which checks it through its complete view.

Only headers and config.json are read. The module imports neither JAX nor torch.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from moejax.errors import CheckpointError
from moejax.hf.fused_experts import FusedExpertsReader
from moejax.hf.io.checkpoint_reader import CheckpointReader, parse_json_object
from moejax.hf.io.location import open_location
from moejax.hf.io.safetensors_format import CONFIG_NAME
from moejax.hf.io.storage import MissingFile, Storage
from moejax.hf.keep_map import checkpoint_keep_map
from moejax.hf.layout import CheckpointLayout, checkpoint_layout
from moejax.hf.mapping import TensorSpec, layer_specs, tensor_specs
from moejax.hf.mtp_names import mtp_renames
from moejax.hf.quant import decode as quant
from moejax.hf.substitution import SubstitutedExpertsView, describe, parse_substitution
from moejax.models.family import Family
from moejax.models.names import MTP_PREDICTOR
from moejax.models.registry import config_from_dict, family_of, read_config

DENSE_DTYPES = ("BF16", "F16", "F32")  # stored unquantised; converted to the model dtype on load
INDEX_DTYPES = ("I32", "I64")  # integer ids (a rule with `index`: DeepSeek-V4's tid2eid), held as int32
PACKED_DTYPES = {"int4_pack": "I32", "mxfp4": "U8", "gpt_oss_mxfp4": "U8"}  # a packed 4-bit tensor's element type
_STRAY = re.compile(r"\.rotary_emb\.inv_freq$")
_LAYER = re.compile(r"^model\.(?:language_model\.)?layers\.(\d+)\.")  # a wrapper's language model too


@dataclasses.dataclass
class CheckedCheckpoint:
    """A checkpoint folder whose headers agree with its config.json."""

    path: Path                 # resolved (a remote checkpoint: its RemotePath, printed as its URL)
    config: object             # the family's config class
    family: Family
    reader: FusedExpertsReader  # the per-expert view: transformers-5 fused expert tensors under per-expert names too
    #                             (a substituted checkpoint's: `SubstitutedExpertsView` of it)
    fmt: str | None             # quantisation format, or None
    specs: list[TensorSpec]     # every HF tensor the config implies, in file order
    stored: dict                # hf name -> the on-disk tensors holding it
    carried: list[str]          # tensors with no parameter: MTP layers, stray rotary buffers
    layout: CheckpointLayout    # the MoE structure by tensor name in `reader`'s per-expert view
    keep_map: dict | None = None  # its keep_map.json (moejax.hf.keep_map), checked against it; None: none


def stored_as(reader, name: str, fmt: str | None) -> tuple[str, ...] | None:
    """The on-disk tensors holding `name`: (name,) when dense, its quantised set, or None if absent."""
    stem = None if fmt is None else quant.quant_stem(name, fmt)
    if stem is not None:
        quantized = quant.companion_tensor_names(name, fmt)
        optional = [stem + sfx for sfx in quant.QUANT_FORMATS[fmt].optional_suffixes]
        if all(n in reader for n in quantized):
            return quantized + tuple(n for n in optional if n in reader)
    return (name,) if name in reader else None


def mtp_layers(cfg) -> range:
    """Decoder-layer indices of the multi-token-prediction layers the config allows for."""
    return range(cfg.num_hidden_layers, cfg.num_hidden_layers + cfg.num_nextn_predict_layers)


def split_extra_tensors(cfg, names, expected: set) -> tuple[list, list]:
    """The checkpoint's names the model has no parameter for, split into (carried, unexpected):
    carried are MTP-layer tensors (layers the config's num_nextn_predict_layers allows), stray
    rotary buffers and the family's CARRIED_PREFIXES (a vision tower, a separate MTP block);
    anything else is unexpected."""
    carried, unexpected = [], []
    mtp = mtp_layers(cfg)
    for name in names:
        if name in expected:
            continue
        layer = _LAYER.match(name)
        if _STRAY.search(name) or (layer and int(layer.group(1)) in mtp) or name.startswith(cfg.CARRIED_PREFIXES):
            carried.append(name)
        else:
            unexpected.append(name)
    return carried, unexpected


def _check_tensor(s: TensorSpec, on_disk: tuple, reader, fmt: str | None, qcfg: dict | None = None) -> list[str]:
    where = f"{s.hf_name} in {reader.shard_of(on_disk[0]).name}"
    info = reader.info(on_disk[0])
    if on_disk == (s.hf_name,) and fmt == "fp8_block" and info.dtype == "F8_E4M3":
        scale = s.hf_name[: -len("weight")] + "weight_scale_inv"
        return [f"{where}: FP8 weight without its scale tensor {scale!r} (missing)"]
    if on_disk == (s.hf_name,) and fmt == "deepseek_v4_fp8" and info.dtype in ("F8_E4M3", "I8"):
        scale = s.hf_name[: -len("weight")] + "scale"
        return [f"{where}: quantised weight ({info.dtype}) without its scale tensor {scale!r} (missing)"]
    if on_disk != (s.hf_name,) and fmt == "deepseek_v4_fp8":
        return _check_deepseek_v4(s, on_disk, reader, qcfg or {})
    if on_disk == (s.hf_name,) or fmt == "fp8_block":  # dense, or FP8 (same name, same shape)
        problems = []
        if tuple(info.shape) != tuple(s.hf_shape):
            problems.append(f"{where}: shape {list(info.shape)}, expected {list(s.hf_shape)} from config.json")
        allowed = {"F8_E4M3"} if on_disk != (s.hf_name,) else set(INDEX_DTYPES if s.index else DENSE_DTYPES)
        if info.dtype not in allowed:
            problems.append(f"{where}: dtype {info.dtype}, expected one of {sorted(allowed)}")
        return problems
    if fmt == "gpt_oss_mxfp4":
        return _check_gpt_oss_mxfp4(s, on_disk, reader)
    packed = f"{s.hf_name[:-len('weight')]}weight_packed in {reader.shard_of(on_disk[0]).name}"
    if len(info.shape) != 2 or info.shape[0] != s.hf_shape[0]:  # packed: rows are output features
        return [f"{packed}: shape {list(info.shape)}, expected {s.hf_shape[0]} rows from config.json"]
    return []


def _check_deepseek_v4(s: TensorSpec, on_disk: tuple, reader, qcfg: dict) -> list[str]:
    """A DeepSeek-V4 quantised Linear (`moejax.hf.quant.decode.dequant_deepseek_v4`): `<x>.weight`
    F8_E4M3 [out, in] with `<x>.scale` [ceil(out/bm), ceil(in/bn)], or, for a routed expert of an
    `expert_dtype: "fp4"` checkpoint (and only there), I8 [out, in/2] with `<x>.scale` [out, in/32],
    in a multiple of 32; scales F8_E8M0 or F32."""
    weight, scale = (reader.info(n) for n in on_disk)
    where = f"{s.hf_name} in {reader.shard_of(on_disk[0]).name}"
    where_scale = f"{on_disk[1]} in {reader.shard_of(on_disk[1]).name}"
    out_f, in_f = s.hf_shape
    fp4 = s.expert is not None and qcfg.get("expert_dtype") == "fp4"
    want_dtype = "I8" if fp4 else "F8_E4M3"
    if weight.dtype != want_dtype:
        kind = "an FP4 routed expert (expert_dtype fp4)" if fp4 else (
            "a routed expert (expert_dtype fp8)" if s.expert is not None else "an FP8 Linear")
        return [f"{where}: dtype {weight.dtype}, expected {want_dtype} for {kind}"]
    problems = []
    if fp4:
        group = quant.DSV4_FP4_GROUP
        if in_f % group:
            return [f"{where}: {in_f} input features are not a multiple of {group} (FP4 scale groups)"]
        want_w, want_s = (out_f, in_f // 2), (out_f, in_f // group)
        grid = f"one per {group} input values"
    else:
        bm, bn = qcfg.get("weight_block_size") or quant.FP8_BLOCK
        want_w, want_s = (out_f, in_f), (quant.ceil_div(out_f, bm), quant.ceil_div(in_f, bn))
        grid = f"one per {bm}x{bn} block"
    if tuple(weight.shape) != want_w:
        problems.append(f"{where}: shape {list(weight.shape)}, expected {list(want_w)} from config.json "
                        f"({'[out, in/2]: 2 FP4 values per byte' if fp4 else '[out, in]'})")
    if tuple(scale.shape) != want_s:
        problems.append(f"{where_scale}: shape {list(scale.shape)}, expected {list(want_s)} ({grid} of "
                        f"{s.hf_name}'s [{out_f}, {in_f}])")
    if scale.dtype not in ("F8_E8M0", "F32"):
        problems.append(f"{where_scale}: dtype {scale.dtype}, expected F8_E8M0 or F32")
    return problems


def _check_mtp_blocks(cfg, reader, fmt: str | None, missing: list) -> list[str]:
    """An MTP layer on disk holds a whole decoder block (which prune prunes, and whose router a
    data-free score ranks): checked like a main-model layer. Its predictor (enorm, hnorm, eh_proj,
    shared_head.norm; `moejax.names.mtp_rules`), which the MTP calibration pass runs, is checked
    where present (the pass refuses a layer without it, naming the tensors); shared_head.head and
    embed_tokens are carried unread. A checkpoint may leave MTP layers out entirely."""
    problems = []
    present = {int(m.group(1)) for name in reader.keys() if (m := _LAYER.match(name))}
    for layer in mtp_layers(cfg):
        if layer not in present:
            continue
        for s in layer_specs(cfg, layer):
            on_disk = stored_as(reader, s.hf_name, fmt)
            if on_disk is None:
                if s.rule not in MTP_PREDICTOR:
                    missing.append(s.hf_name)
            else:
                problems += _check_tensor(s, on_disk, reader, fmt, cfg.quantization_config)
    return problems


def _check_gpt_oss_mxfp4(s: TensorSpec, on_disk: tuple, reader) -> list[str]:
    """gpt-oss's MXFP4 expert matrix [in, out] (dense) as *_blocks [out, in/32, 16] and *_scales
    [out, in/32], uint8, in a multiple of 32 (each problem named once per fused tensor: `check_tensors`)."""
    n_in, n_out = s.hf_shape
    groups = n_in // quant.MXFP4_GROUP_SIZE
    if n_in % quant.MXFP4_GROUP_SIZE:
        return [f"{s.hf_name}: {n_in} input features are not a multiple of {quant.MXFP4_GROUP_SIZE} (gpt-oss MXFP4 blocks)"]
    problems = []
    for name, want in zip(on_disk, ((n_out, groups, quant.GPT_OSS_BLOCK_BYTES), (n_out, groups))):
        info = reader.info(name)
        where = f"{reader.holder(name)} in {reader.shard_of(name).name}"   # the fused tensor: one message for all experts
        if tuple(info.shape) != want:
            problems.append(f"{where}: shape {list(info.shape)} per expert, expected {list(want)} from config.json")
        if info.dtype != "U8":
            problems.append(f"{where}: dtype {info.dtype}, expected U8 (gpt-oss MXFP4)")
    return problems


def _check_packed_dtypes(reader, fmt: str | None) -> list[str]:
    """Every packed 4-bit tensor (MTP-only ones included) must have its format's element type, or
    its 4-bit values would be unpacked from the wrong element size."""
    if fmt not in PACKED_DTYPES:
        return []
    return [f"{name} in {reader.shard_of(name).name}: dtype {reader.info(name).dtype}, expected "
            f"{PACKED_DTYPES[fmt]} for {fmt} (quantization_config)"
            for name in reader.keys() if name.endswith(".weight_packed") and reader.info(name).dtype != PACKED_DTYPES[fmt]]


def check_tensors(cfg, reader, specs: list[TensorSpec],
                  fmt: str | None) -> tuple[list[str], dict, list[str]]:
    """Every mismatch between the checkpoint's headers and the config, as messages (empty = fine);
    the on-disk tensors of each expected tensor; the tensors carried without a parameter."""
    problems, stored, missing = _check_packed_dtypes(reader, fmt), {}, []
    for s in specs:
        on_disk = stored_as(reader, s.hf_name, fmt)
        if on_disk is None:
            missing.append(s.hf_name)
            continue
        stored[s.hf_name] = on_disk
        problems += _check_tensor(s, on_disk, reader, fmt, cfg.quantization_config)
    problems += _check_mtp_blocks(cfg, reader, fmt, missing)
    problems = list(dict.fromkeys(problems))   # a fused tensor's problem is every expert's slab's
    if missing:
        hint = f" (quantised as {fmt})" if fmt else ""
        problems.append(f"{len(missing)} tensor(s) missing{hint}, e.g. {missing[:5]}")
    carried, unexpected = split_extra_tensors(cfg, reader.keys(), {n for names in stored.values() for n in names})
    if unexpected:
        layers = sorted({int(m.group(1)) for n in unexpected if (m := _LAYER.match(n))})
        beyond = [l for l in layers if l >= cfg.num_hidden_layers]
        if beyond:
            problems.append(
                f"tensors of decoder layer(s) {beyond} that config.json does not account for: num_hidden_layers="
                f"{cfg.num_hidden_layers} and num_nextn_predict_layers={cfg.num_nextn_predict_layers} allow layers "
                f"0..{cfg.num_hidden_layers + cfg.num_nextn_predict_layers - 1}")
        problems.append(f"{len(unexpected)} unexpected tensor(s), e.g. {sorted(unexpected)[:5]}")
    return problems, stored, carried


def check_checkpoint(path, *, uniform_experts: bool = True, substituted: bool = False) -> CheckedCheckpoint:
    """Read config.json and every safetensors header of the folder `path`; raise every mismatch at
    once as a `CheckpointError` (or the config's `ConfigError`), before any tensor data is read.

    uniform_experts=False accepts a checkpoint pruned to different expert counts per layer
    (`moe_sparsity_config.num_experts`), which the loader, scoring and prune read layer by layer;
    the default refuses it by name, for a command that needs one count in every layer.
    substituted=True accepts a MoNE-substituted checkpoint (`moejax.hf.substitution`), checked
    through `SubstitutedExpertsView` (its substituted experts presented as zeros); by default one is
    refused naming the format."""
    problems, checked = _checked(path, uniform_experts, substituted)
    if problems:
        where = path.describe() if isinstance(path, Storage) else path
        raise CheckpointError(f"{where}: checkpoint does not match its config.json:\n  - " + "\n  - ".join(problems))
    return checked


def checkpoint_problems(path, *, uniform_experts: bool = False) -> list[str]:
    """The mismatches `check_checkpoint` would raise, as a list, for a tool that reports them
    (`moejax diff` auditing a pruned checkpoint). Unreadable files and configs still raise."""
    return audit_checkpoint(path, uniform_experts=uniform_experts)[0]


def audit_checkpoint(path, *, uniform_experts: bool = False) -> tuple[list[str], FusedExpertsReader]:
    """checkpoint_problems and the checkpoint's reader (its per-expert view), so that an audit
    reads (a remote checkpoint: fetches) the headers once."""
    problems, checked = _checked(path, uniform_experts)
    return problems, checked.reader


def _checked(path, uniform_experts: bool, substituted: bool = False) -> tuple[list[str], CheckedCheckpoint]:
    storage = open_location(path)
    config_path = storage.root / CONFIG_NAME
    # config.json first: a location that is not a checkpoint folder is named by it, not by its weights
    if storage.remote:  # the same strict config parsing, on the bytes fetched
        data = storage.read_file(config_path)
        if data is None:
            raise MissingFile(f"{config_path}: file is missing; a checkpoint location is the folder that holds "
                              "config.json (and the weights)")
        cfg = config_from_dict(parse_json_object(data, config_path), str(config_path), uniform_experts=uniform_experts)
    else:
        cfg = read_config(config_path, uniform_experts=uniform_experts)
    raw = CheckpointReader(storage)
    family = family_of(cfg)
    fmt = quant.detect_format(cfg.quantization_config)
    reader = FusedExpertsReader(raw, quant.fused_companions(family.fused_layout(cfg), fmt), family.rule("router").hf,
                                mtp_renames(cfg, family, raw.keys()))
    substitution = parse_substitution(cfg.to_dict(), config_path)
    if substitution is not None:
        if not substituted:
            raise CheckpointError(
                f"{storage.describe() if storage.remote else storage.root}: a MoNE expert-substitution checkpoint "
                f"(config.json compression_config.transform_config.expert_substitution, constant-v1: "
                f"{describe(substitution)}, which have no weights); moejax reads it only as a model, through "
                "moejax.surgery.substitute.load_substituted (vLLM with expert substitution serves it); score, "
                "prune, merge, inspect, plan and diff take checkpoints whose every expert has weights")
        reader = SubstitutedExpertsView(reader, substitution, cfg.hidden_size, fmt)
    specs = tensor_specs(cfg)
    problems, stored, carried = check_tensors(cfg, reader, specs, fmt)
    layout = checkpoint_layout(reader, family) if not problems else None  # fused experts as per-expert
    keep_map = None
    if layout is not None:  # a compressed checkpoint's keep_map.json, against its layers and pruning.json
        keep_map = checkpoint_keep_map(
            storage, {l: ml.n_experts for l, ml in layout.moe_layers.items()}, cfg.num_experts_per_tok,
            None if substitution is None else {l: sorted(v) for l, v in substitution.values.items()})
    where = storage.root if storage.remote else storage.root.resolve()
    return problems, CheckedCheckpoint(where, cfg, family, reader, fmt, specs, stored, carried, layout, keep_map)

"""`moejax prune SRC DST`: a pruned Hugging Face checkpoint, written shard by shard.

Two steps, both explicit so each can be read and tested alone:

1. `plan_pruning` (moejax.surgery.prune_plan) decides, from the router tensors (data-free scores)
   or a scores file, which experts every MoE layer keeps, and what the new config.json says.
2. `write_pruned` streams every source shard into a shard of the same name: dropped experts'
   tensors are left out, kept experts are renamed to their new index in ascending source order
   (quantisation companions travel with them, since they are `experts.{e}.*` tensors too), router
   rows and bias entries are sliced as bytes, and every other tensor is copied by byte range. So
   every surviving byte is the source's byte, and memory stays at about one router tensor.
   A checkpoint in transformers 5's fused form (`mlp.experts.gate_up_proj` [E, 2 F, H],
   `down_proj` [E, H, F]) is planned through its per-expert view (`moejax.hf.fused_experts`)
   and written back fused: each fused tensor under its own name, the kept experts' slabs copied
   in order along the expert axis.

The output is written to a hidden sibling folder and renamed at the end (never a half-written
DST), beside a `pruning.json` recording the source, the variant (`VariantSpec.record`: method the
score, form one_shot, the keep asked) and the kept source indices per layer, which `moejax diff` can check against the files,
and a `keep_map.json` (`moejax.hf.keep_map`: the same kept sets in the one schema every compressed
checkpoint shares). `--keep-map MAP` plans from a keep-map instead of a score (`moejax.surgery.prune_keep_map`). `write_folder` and the shard
writers here are shared by the other surgeries (`moejax merge`, `--substitute`, `reroute`).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from pathlib import Path

from tqdm import tqdm

from moejax import __version__
from moejax.allocation import ALLOCATIONS, allocation_record
from moejax.errors import CheckpointError, ConfigError
from moejax.hf.check import check_checkpoint
from moejax.hf.fused_experts import FusedExpertsReader
from moejax.hf.io.checkpoint_reader import CheckpointReader, allowed_root, check_regular_file
from moejax.hf.io.checkpoint_writer import JoinedTensor, write_safetensors_file
from moejax.hf.io.safetensors_format import CONFIG_NAME, INDEX_NAME, RawTensor
from moejax.hf.io.staging import check_destination, staged_directory, text_inputs
from moejax.hf.keep_map import KEEP_MAP, check_keep_map, keep_map_of, write_keep_map
from moejax.hf.layout import CheckpointLayout, layer_of
from moejax.hf.provenance import (FINGERPRINT_KEY, PRUNING_RECORD, check_made_from, checkpoint_fingerprint,
                                  scores_sidecar)
from moejax.hf.mtp_names import MTP_DEFAULT
from moejax.scoring.score_checkpoint import calibration_ids
from moejax.surgery.prune_keep_map import SCORE as KEEP_MAP_SCORE, plan_from_keep_map
from moejax.surgery.prune_plan import UNREACHABLE_BIAS, PrunePlan, keeps_groups, plan_pruning
from moejax.variants.spec import VariantSpec


def _renames(layout: CheckpointLayout, plan: PrunePlan) -> dict[str, str | None]:
    """Source tensor name -> pruned name (None = dropped) for every routed-expert tensor and every
    tensor of a dropped MTP layer; names not in the map are copied under their own name."""
    renames: dict[str, str | None] = {}
    for l, ml in layout.moe_layers.items():
        new_index = {old: new for new, old in enumerate(plan.kept.get(l, []))}
        for e, names in ml.experts.items():
            for name in names:
                renames[name] = (ml.expert_tensor(new_index[e], name[len(ml.expert_tensor(e, "")):])
                                 if e in new_index and l not in plan.dropped_layers else None)
    for name in layout.other + sorted(layout.router_names()):
        layer = layer_of(name)
        if layer is not None and layer in plan.dropped_layers:
            renames[name] = None
    return renames


def _row_slice(reader: CheckpointReader, name: str, kept: list[int]) -> RawTensor:
    """Rows `kept` of a [E, ...] tensor as bytes: each row is the source's bytes."""
    info = reader.info(name)
    data = reader.read_bytes(name)
    row = len(data) // info.shape[0]
    return RawTensor(info.dtype, (len(kept),) + tuple(info.shape[1:]),
                     b"".join(data[i * row:(i + 1) * row] for i in kept))


def fused_rows(reader: FusedExpertsReader, name: str, slabs: list[list[str]], kept: list[int],
                replaced) -> JoinedTensor:
    """The stored fused expert tensor `name` [E, ...] cut to the experts `kept`, in that order:
    each kept expert's slab is the byte ranges of its per-expert tensors (`slabs`, in row order),
    or what `replaced` gives for one of them (a merged expert, in the tensor's dtype and shape)."""
    info = reader.reader.info(name)
    pieces = []
    for e in kept:
        for part in slabs[e]:
            value = None if replaced is None else replaced(part)
            if value is not None and tuple(value.shape) != tuple(reader.info(part).shape):
                raise CheckpointError(f"{part} (rows of {name}): replacement of shape {list(value.shape)}, "
                                      f"expected {list(reader.info(part).shape)}")
            pieces.append(reader.info(part) if value is None else value)
    return JoinedTensor(info.dtype, (len(kept),) + tuple(info.shape[1:]), tuple(pieces))


def write_pruned(reader: FusedExpertsReader, layout: CheckpointLayout, plan: PrunePlan, staging: Path,
                 progress: bool = False, replaced=None) -> dict[str, str]:
    """Write the pruned shards into `staging`; returns the new weight map (name -> shard file).
    reader: the checkpoint's per-expert view, whose names `layout` uses; every stored tensor is
    written under its stored name (a fused expert tensor cut to the kept experts) or, for a
    per-expert tensor, its pruned name. replaced: None, or a function of a per-expert view name
    giving the array to write in its place (under its pruned name), or None to keep the source's
    bytes (`moejax merge`'s merged experts)."""
    renames = _renames(layout, plan)
    sliced = {}
    for l, ml in layout.moe_layers.items():
        if l not in plan.dropped_layers:
            sliced.update({name: l for name in ml.per_expert_rows})
    stored = reader.reader
    weight_map, total = {}, 0
    files = stored.files()
    for path in tqdm(files, desc="shards", unit="shard", disable=not progress):
        tensors = []
        for name in stored.names_in(path):
            slabs = reader.expert_slabs(name)
            if slabs is not None:  # fused experts: written back fused, under the stored name
                layer = layer_of(name)
                if layer not in plan.dropped_layers:
                    tensors.append((name, fused_rows(reader, name, slabs, plan.kept[layer], replaced)))
                continue
            if plan.dropped_prefixes and name.startswith(plan.dropped_prefixes):
                continue  # a carried MTP block removed (--mtp drop)
            view = reader.view_name(name)  # a router beside fused experts goes by the family's name
            new_name = renames.get(view, view)
            if new_name is None:
                continue
            new_name = reader.stored_name(new_name)  # a renamed tensor (an MTP block's) under its stored spelling
            value = None if replaced is None else replaced(view)
            if value is not None:
                tensors.append((new_name, value))
            elif view in sliced:
                tensors.append((new_name, _row_slice(stored, name, plan.kept[sliced[view]])))
            else:
                tensors.append((new_name, stored.info(name)))
        if tensors:
            total += write_shard(staging, stored, path, tensors, weight_map)
    write_index(staging, stored, weight_map, total)
    return weight_map


def write_shard(staging: Path, stored, path: Path, tensors: list, weight_map: dict) -> int:
    """One output shard at the source shard's relative path (shards in subfolders may share a file
    name), with the source shard's metadata; its tensors are recorded in weight_map. Bytes written."""
    relative = path.relative_to(stored.directory)
    (staging / relative).parent.mkdir(parents=True, exist_ok=True)
    size = write_safetensors_file(staging / relative, tensors, stored.shard(path).metadata)
    weight_map.update({name: relative.as_posix() for name, _ in tensors})
    return size


def write_index(staging: Path, stored, weight_map: dict, total: int) -> None:
    """The output's index, when the source has one or the output spans several shards."""
    if stored.has_index() or len(set(weight_map.values())) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (staging / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")


def other_files(reader: CheckpointReader) -> tuple[list[Path], list[str]]:
    """The source's files that are not weights (tokenizer, generation config, code, ...), as paths
    relative to the folder, each checked to be a regular file inside it (or inside the Hugging Face
    cache repository it is a snapshot of) before anything is written; and notes on what is left
    out. Hidden files, config.json, the index, pruning.json, keep_map.json (a pruned source's: the
    output's own is written) and the indexed shards are not copied."""
    src = reader.directory
    root = allowed_root(src)
    shards = {path.resolve() for path in reader.files()}
    files, notes = [], []

    def visit(folder: Path) -> None:
        for item in sorted(folder.iterdir()):
            relative = item.relative_to(src)
            if item.name.startswith(".") or relative.as_posix() in (INDEX_NAME, CONFIG_NAME, PRUNING_RECORD, KEEP_MAP):
                continue
            if item.is_dir() and not item.is_symlink():
                visit(item)
                continue
            if item.is_symlink() and item.is_dir():  # is_dir follows the link; False for loops
                target = item.resolve()
                if not target.is_relative_to(root):
                    raise CheckpointError(f"{src}: {relative} is a link to the folder {target}, outside the "
                                          f"checkpoint folder {root}; refusing to copy files from elsewhere")
                visit(item)
                continue
            resolved = check_regular_file(item, root, f"{src}: {relative}")
            if resolved in shards:
                continue
            if item.suffix == ".safetensors":
                notes.append(f"{relative} is not in the checkpoint's index and was not copied")
                continue
            files.append(relative)

    visit(src)
    return files, notes


def prune_checkpoint(src, dst, *, score: str | None = None, keep=None, scores_file=None,
                     layers_keep: dict | None = None, group_aware: bool = False, collapse_groups: bool = False,
                     mtp: str = MTP_DEFAULT, seed: int = 0, allocation="uniform", overwrite: bool = False,
                     progress: bool | None = None, text=None, tokens=None, seq_len: int | None = None,
                     max_tokens: int | None = None, batch_size: int = 8, dtype: str = "float32", keep_map=None,
                     keep_map_format: str | None = None, keep_map_settings: dict | None = None) -> dict:
    """Write the pruned checkpoint of `src` to `dst` and return the pruning record (also written
    to dst/pruning.json). Everything is checked (destination, headers, scores, keep, groups)
    before the first byte is written. mtp: MTP layers pruned with the trunk's keep by their own
    scores, kept whole, or removed (`moejax.hf.mtp_names.check_mtp_policy`). allocation: per-layer
    counts (`moejax.allocation`); evo_esap searches by the ESAP of candidates on the calibration
    tokens text / tokens (seq_len, max_tokens, batch_size, dtype as `moejax score`), tokens apart
    from those the scores file was made from. keep_map: prune to exactly a keep-map's kept sets
    instead of a score (`moejax.surgery.prune_keep_map`: any format of `moejax.hf.keep_map_formats`,
    `keep_map_format` None to detect it, `keep_map_settings` what it needs), refused when made from
    another checkpoint."""
    _check_request(score, keep, scores_file, layers_keep, group_aware, allocation, keep_map)
    src, dst = Path(src), Path(dst)
    allocation = ALLOCATIONS.parse(allocation)
    check_destination(dst, overwrite, inputs=(src, scores_file, scores_file and Path(scores_file).with_suffix(".json"),
                                              keep_map, text_inputs(text), tokens))
    checked = check_checkpoint(src, uniform_experts=False)  # the loader's check: headers against config.json
    reader, layout = checked.reader, checked.layout  # the per-expert view (fused experts too) and its layout
    copied, file_notes = other_files(reader.reader)
    fingerprint = checkpoint_fingerprint(checked)  # recorded, and the scores file's (the keep-map's) checked against it
    if scores_file is not None:
        sidecar, where = scores_sidecar(scores_file)
        check_made_from(sidecar or {}, where, "checkpoint", src, lambda: fingerprint, "scores file")
    fitness_of, search, fitness_record = None, {}, None   # (evo_esap's)
    if allocation.searches:
        if text is None and tokens is None:
            raise ConfigError(f"--allocation {allocation.name} searches by the ESAP of candidates on calibration tokens: "
                              "give them with --text or --tokens (apart from those the scores came from)")
        ids, tokenizer = calibration_ids(src, checked.config, text, tokens, seq_len, max_tokens)
        fitness_record = {"tokens": int(ids.size), "sequences": int(len(ids)), "seq_len": int(ids.shape[1]),
                          "tokenizer": tokenizer, "dtype": dtype}

        def esap_of(ranking, layers):   # JAX only now, for the search
            import jax.numpy as jnp

            from moejax.evaluation.esap_fitness import EsapFitness
            from moejax.hf.model_io import opened

            return EsapFitness(opened(checked), ids, ranking, layers, batch_size=batch_size, dtype=jnp.dtype(dtype),
                               keeps_groups=lambda kept: keeps_groups(kept, checked.config))
        fitness_of = esap_of
    elif text is not None or tokens is not None:
        raise ConfigError(f"--text/--tokens: --allocation {allocation.name} reads no calibration tokens (evo_esap's "
                          "search does; to prune by a calibration score, run `moejax score` and pass --scores-file)")
    if keep_map is not None:
        if checked.config.scored_layers != checked.config.moe_layers:
            raise ConfigError(f"{checked.config.TITLE}: --keep-map is not implemented for a family with layers kept "
                              "whole (hash layers); prune with --score")
        plan, about, mtp = plan_from_keep_map(keep_map, checked, fingerprint, fmt=keep_map_format,
                                              settings=keep_map_settings, collapse_groups=collapse_groups, mtp=mtp)
        counts = {len(kept) for kept in plan.kept.values()}
        score, keep = KEEP_MAP_SCORE, (counts.pop() if len(counts) == 1 else None)   # None: per-layer counts
    else:
        plan = plan_pruning(reader, layout, checked.config, score=score, keep=keep, scores_file=scores_file,
                            layers_keep=layers_keep, group_aware=group_aware, collapse_groups=collapse_groups,
                            mtp=mtp, seed=seed, allocation=allocation, fitness_of=fitness_of, search=search)
    plan = dataclasses.replace(plan, notes=plan.notes + tuple(file_notes))
    chosen = ({"keep_map": about} if keep_map is not None else
              {"scores_file": str(Path(scores_file).resolve()) if scores_file else None, "layers_keep": layers_keep,
               **allocation_record(allocation), **({"allocation_search": {**search, "fitness": fitness_record}}
                                                   if allocation.searches else {}),
               "seed": seed, "group_aware": group_aware})
    record = {
        "moejax_version": __version__, "source": str(src.resolve()), FINGERPRINT_KEY: fingerprint,
        **VariantSpec(score, keep, "one_shot").record(), **chosen, "groups": plan.groups, "mtp": mtp,
        "dropped_layers": list(plan.dropped_layers), "notes": list(plan.notes),
        "layers": {str(l): {"n_experts": plan.n_experts[l], "kept": kept} for l, kept in plan.kept.items()},
    }
    for l, dropped in plan.unreachable.items():
        record["layers"][str(l)]["unreachable"] = dropped
    write_folder(reader, layout, plan, src, dst, copied, record, overwrite=overwrite, progress=progress,
                 replaced=unreachable_biases(reader, layout, plan) if plan.unreachable else None,
                 num_hidden_layers=checked.config.num_hidden_layers)
    return record


def unreachable_biases(reader, layout: CheckpointLayout, plan: PrunePlan):
    """`write_pruned`'s `replaced` for a plan with unreachable slots (`PrunePlan.unreachable`): each
    such layer's balance bias with those experts' entries UNREACHABLE_BIAS, in its stored dtype."""
    import numpy as np

    biases = {layout.moe_layers[l].bias: dropped for l, dropped in plan.unreachable.items()}

    def replaced(name):
        if name not in biases:
            return None
        value = np.array(reader.read(name))
        value[biases[name]] = UNREACHABLE_BIAS
        return value
    return replaced


def _check_request(score, keep, scores_file, layers_keep, group_aware, allocation, keep_map) -> None:
    """A score chooses, or a keep-map does (and then nothing else that chooses is given)."""
    if keep_map is None:
        if score is None:
            raise ConfigError("prune needs --score (a data-free score, or one of --scores-file) or --keep-map")
        return
    given = [flag for flag, value in (("--score", score), ("--keep", keep), ("--scores-file", scores_file),
                                      ("--layers-keep", layers_keep), ("--group-aware", group_aware),
                                      ("--allocation", ALLOCATIONS.parse(allocation).name != "uniform")) if value]
    if given:
        raise ConfigError(f"--keep-map {keep_map} decides every layer's kept experts; it takes no {', '.join(given)}")


def write_folder(reader: FusedExpertsReader, layout: CheckpointLayout, plan: PrunePlan, src: Path, dst: Path,
                 copied: list[Path], record: dict, *, overwrite: bool, progress: bool | None, replaced=None,
                 shards=None, num_hidden_layers: int | None = None) -> None:
    """DST written atomically (a staging folder renamed at the end, removed on any failure): the
    streamed shards (`write_pruned`; or `shards(staging, progress)`, which writes them another way:
    `moejax prune --substitute`), the source's other files, config.json, pruning.json and
    keep_map.json (`moejax.hf.keep_map`: the plan's kept experts in written order, the record's
    source, fingerprint, MTP policy, clusters or substituted experts; checked before the first byte)."""
    show = sys.stderr.isatty() if progress is None else progress
    whole = {l: ml.n_experts for l, ml in layout.moe_layers.items() if l not in plan.dropped_layers}
    keep_map = check_keep_map(keep_map_of(record, plan.kept, plan.n_experts, whole, num_hidden_layers),
                              dst / KEEP_MAP, error=CheckpointError)
    with staged_directory(dst, overwrite) as staging:
        if shards is None:
            write_pruned(reader, layout, plan, staging, progress=show, replaced=replaced)
        else:
            shards(staging, show)
        for relative in copied:
            (staging / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src / relative, staging / relative)
        (staging / CONFIG_NAME).write_text(json.dumps(plan.config, indent=2) + "\n", encoding="utf-8")
        (staging / PRUNING_RECORD).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
        write_keep_map(staging, keep_map)

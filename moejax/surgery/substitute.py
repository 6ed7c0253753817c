"""`moejax prune SRC DST --substitute --score mone --keep K --text ...`: MoNE expert substitution
(arXiv 2507.00390), written as vLLM's `constant-v1` expert-substitution checkpoint
(`moejax.hf.substitution`), and read back as a moejax model with its `{layer: ExpertMap}`.

MoNE keeps the `keep` experts of each MoE layer that rank highest by a calibration score (`mone`,
its routing-score x output-variance metric, by default) and replaces every other one by a
"novice": a constant vector, the expert's mean output over the calibration tokens routed to it
(`LayerStats.mean_output_EH`). The router is untouched: a novice keeps its router row and balance
bias and is chosen exactly as before; when chosen with gate g it returns g * constant.

Three steps, as `moejax merge` does them:

1. Checks before the pass: destination, checkpoint (a quantised source is refused, and a fused one
   of a family that has a per-expert spelling: the format names retained experts' tensors by their
   logical index; gpt-oss, stored only fused, keeps its fused tensors compacted to the retained
   experts; an already substituted one is refused by the
   check), the score (any registered score ranks: a calibration score, or a data-free one such as
   l1, read from the same pass that gives the constants; the one rule of toy3 and the experiments'
   `substitutes`), the keep (per layer, never below top_k), the calibration data (tokenised now).
2. A streamed calibration pass (`moejax.scoring.observe.calibrate_streamed`, one decoder layer's
   weights at a time) gives every MoE layer's statistics; `plan_substitution` ranks and chooses
   (float64, ties to the lower index: exactly `keep` per layer, where mode-pd keeps those above
   the (keep+1)-th score and so fewer on a tie).
3. Writing, streamed shard by shard into a hidden sibling folder renamed at the end (the source is
   never modified): every source tensor is copied by byte range under its own name except the
   substituted experts' weight tensors, which are left out (retained experts keep their logical
   names, as the format requires: `moejax prune` renumbers, this does not); every router row and
   bias entry stays; each substituted expert's constant is written in float32 as
   `{experts prefix}.{e}.approx_value` [H] into the shard holding its layer's router; config.json
   gains `compression_config.transform_config.expert_substitution` (expert counts unchanged);
   `pruning.json` records the variant (`VariantSpec.record`: method = the ranking score, form
   substituted, the keep asked), the format, calibration and, per layer, the kept and substituted
   experts.

MTP layers (`--mtp`): substituted like the trunk's on their own statistics (the calibration pass runs
them as inference does: `moejax.models.mtp`), written whole, or removed.

`load_substituted(DST)` gives the model with every router slot (a substituted expert's weights are
zeros and never used) and the `{layer: ExpertMap}` whose novice slots return the stored constants:
its logits equal the source model's under `substitution_maps(stats, kept)` (the same map computed in
memory from the calibration statistics).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from tqdm import tqdm

from moejax import __version__
from moejax.errors import CheckpointError, ConfigError
from moejax.hf import substitution as fmt
from moejax.hf.check import check_checkpoint
from moejax.hf.io.staging import check_destination, text_inputs
from moejax.hf.io.storage import require_local
from moejax.hf.layout import layer_of
from moejax.hf.mtp_names import MTP_DEFAULT, carried_mtp_block, check_mtp_policy
from moejax.hf.provenance import FINGERPRINT_KEY, checkpoint_fingerprint
from moejax.scoring.score_checkpoint import calibration_ids
from moejax.scoring.scores import LayerStats, check_score_names, compute_scores, pass_needs, scores_for
from moejax.scoring.select import resolve_keep, select_kept
from moejax.surgery.prune import fused_rows, other_files, write_folder, write_index, write_shard
from moejax.surgery.prune_plan import PrunePlan, rewrite_mtp
from moejax.variants.spec import VariantSpec

METHOD = "mone"


def plan_substitution(stats: dict[int, LayerStats], score: str, keep, top_k: int) -> dict[int, list[int]]:
    """{MoE layer: the kept (computing) experts, ascending}: the `keep` highest by `score` (a count
    or a ratio of the layer's E, never below top_k; float64, ties to the lower index); every other
    expert of the layer is substituted."""
    kept = {}
    for layer, st in sorted(stats.items()):
        count = resolve_keep(keep, st.n_experts, top_k)
        values = compute_scores(st, [score])[score]
        kept[layer] = np.flatnonzero(select_kept(values, count, f"layer {layer}: score {score!r}")).tolist()
    return kept


def substitution_maps(stats: dict[int, LayerStats], kept: dict[int, list[int]]) -> dict:
    """{MoE layer: ExpertMap} of the substitution in memory: every slot routable, the experts not in
    `kept` novices returning their mean output over the calibration tokens routed to them, rounded
    to float32 as the checkpoint stores it (0 for one no token chose; 0 at the kept slots)."""
    import jax.numpy as jnp

    from moejax.moe.expert_map import ExpertMap

    maps = {}
    for layer, experts in kept.items():
        E = stats[layer].n_experts
        novice = np.ones(E, bool)
        novice[experts] = False
        constants = np.where(novice[:, None], stats[layer].mean_output_EH, 0.0).astype(np.float32)
        maps[layer] = ExpertMap(jnp.ones(E, bool), novice_E=jnp.asarray(novice), constants_EH=jnp.asarray(constants))
    return maps


def load_substituted(path, dtype=None, backend: str | None = None, mesh=None):
    """(model, {MoE layer: ExpertMap}) of a substituted checkpoint folder (`moejax.hf.substitution`):
    the family's model with every router slot, a substituted expert's weights zeros (its pairs are
    never computed: absent in a forward-only dispatch, gate 0 otherwise), and per substituted layer
    ExpertMap(all slots, novice_E = the substituted experts, constants_EH = their stored constants
    as float32, 0 elsewhere). Run the model with the maps as its variant. A folder without a
    substitution is refused (load it with `load_pretrained`)."""
    import jax.numpy as jnp

    from moejax.hf.model_io import check_compute_dtype, load_opened, opened
    from moejax.moe.expert_map import ExpertMap

    dtype = jnp.float32 if dtype is None else dtype
    check_compute_dtype(dtype)
    require_local(path, "loading a substituted model")
    checked = check_checkpoint(path, uniform_experts=False, substituted=True)
    view = checked.reader
    if not isinstance(view, fmt.SubstitutedExpertsView):
        raise CheckpointError(f"{checked.path}: config.json declares no expert substitution ({fmt.WHERE}); "
                              "load it with moejax.hf.model_io.load_pretrained")
    cfg = checked.config
    maps = {}
    for layer, values in view.substitution.values.items():
        if layer not in cfg.moe_layers:
            raise CheckpointError(f"{checked.path}: {fmt.WHERE} names layer {layer}, which is not a MoE decoder "
                                  f"layer (MoE layers: {cfg.moe_layers})")
        E = cfg.experts_in_layer(layer)
        if view.substitution.n_experts[layer] != E:
            raise CheckpointError(f"{checked.path}: {fmt.WHERE} gives layer {layer} "
                                  f"{view.substitution.n_experts[layer]} experts; config.json gives it {E}")
        novice, constants = np.zeros(E, bool), np.zeros((E, cfg.hidden_size), np.float32)
        for e, name in values.items():
            novice[e], constants[e] = True, view.constant(name)
        maps[layer] = ExpertMap(jnp.ones(E, bool), novice_E=jnp.asarray(novice), constants_EH=jnp.asarray(constants))
    return load_opened(opened(checked), dtype, backend, mesh=mesh), maps


def write_substituted(reader, layout, substituted: dict[int, list[int]], constants: dict[int, np.ndarray],
                      staging: Path, progress: bool = False, dropped_layers: tuple = (),
                      dropped_prefixes: tuple = ()) -> dict[str, str]:
    """The shards of the substituted checkpoint into `staging`, each under its source name: every
    tensor copied by byte range except the substituted experts' (left out); each substituted
    expert's constant (`constants[layer]` [n_substituted, H], in the order of `substituted[layer]`)
    added as float32 `{experts prefix}.{e}.approx_value` to the shard of its layer's router.
    Returns the weight map (name -> shard file); the index is written when the source has one or
    there are several shards. Names are the stored ones (an MTP block stored apart keeps its own);
    a family stored only fused (gpt-oss) keeps its fused tensors, cut to the retained experts'
    slabs in ascending order (the format's compact_retained_experts; `SubstitutedExpertsView` reads
    row i as the i-th retained expert). dropped_layers: MTP layers left out whole (--mtp drop);
    dropped_prefixes: a carried MTP block's stored-name prefixes, left out (--mtp drop)."""
    stored = reader.reader
    dropped, added, retained = set(), {}, {}
    for layer, experts in substituted.items():
        ml = layout.moe_layers[layer]
        retained[layer] = [e for e in range(ml.n_experts) if e not in set(experts)]
        prefix = reader.stored_name(ml.stem + "experts.")[:-1]
        for i, e in enumerate(experts):
            dropped.update(reader.stored_name(n) for n in ml.experts[e])
            value = np.ascontiguousarray(constants[layer][i], np.float32)
            added.setdefault(reader.shard_of(ml.router), []).append((fmt.value_name(prefix, e), value))
    dropped.update(reader.stored_name(n) for n in reader.keys() if layer_of(n) in dropped_layers)
    weight_map, total = {}, 0
    for path in tqdm(stored.files(), desc="shards", unit="shard", disable=not progress):
        tensors = []
        for name in stored.names_in(path):
            slabs, layer = reader.expert_slabs(name), layer_of(name)
            if name in dropped or (slabs is not None and layer in dropped_layers) or name.startswith(dropped_prefixes):
                continue
            if slabs is not None and layer in retained:   # fused experts: the retained experts' slabs
                tensors.append((name, fused_rows(reader, name, slabs, retained[layer], None)))
            else:
                tensors.append((name, stored.info(name)))
        tensors += added.get(path, [])
        if tensors:
            total += write_shard(staging, stored, path, tensors, weight_map)
    write_index(staging, stored, weight_map, total)
    return weight_map


def check_substitute_request(checked, score: str, keep) -> None:
    """Everything decided by the settings and the checkpoint's headers, before the pass: a float
    source, per expert unless the family is stored only fused (gpt-oss); a calibration score the model supports; the keep per MoE layer
    (never below top_k)."""
    if checked.fmt is not None:
        raise CheckpointError(f"{checked.path}: quantised ({checked.fmt}); expert substitution ({fmt.FORMAT}) holds "
                              "unquantised expert tensors (vLLM's loader refuses quantised MoE weights with it)")
    if checked.reader.fused_names and not checked.family.stores_fused:
        raise CheckpointError(f"{checked.path}: expert tensors in transformers 5's fused form (mlp.experts."
                              f"gate_up_proj); {fmt.FORMAT} names each retained expert's tensors by its logical "
                              "index, so save the source per expert (save_original_format=True) first")
    check_score_names([score])   # any score ranks (data-free ones too), as in toy3 and the experiments' substitutes
    cfg = checked.config
    scores_for([score], cfg.HAS_BALANCE_BIAS, str(checked.path))
    problems = []
    for layer in cfg.moe_layers:
        try:
            resolve_keep(keep, cfg.experts_in_layer(layer), cfg.num_experts_per_tok)
        except ConfigError as error:
            problems.append(f"layer {layer}: {error}")
    if problems:
        raise ConfigError("--keep: " + "; ".join(problems))


def substitute_checkpoint(src, dst, *, score: str = METHOD, keep=None, text=None, tokens=None,
                          seq_len: int | None = None, max_tokens: int | None = None, batch_size: int = 8,
                          dtype: str = "float32", mtp: str = MTP_DEFAULT, overwrite: bool = False,
                          progress: bool | None = None) -> dict:
    """Write the MoNE-substituted checkpoint of `src` to `dst` and return its record (also
    dst/pruning.json). Every setting, the checkpoint and the calibration data are checked before
    the calibration pass; nothing is written before the plan is made. mtp: MTP layers substituted
    like the trunk's on the statistics of the pass, which runs them as inference does ("prune"),
    written whole ("keep") or removed ("drop", num_nextn_predict_layers 0)."""
    import jax.numpy as jnp

    from moejax.hf.model_io import opened
    from moejax.scoring.observe import calibrate_streamed

    if keep is None:
        raise ConfigError("--substitute needs --keep (experts kept computing per MoE layer: a count or a ratio of E)")
    if dtype not in ("float32", "bfloat16"):
        raise ConfigError(f"dtype={dtype!r}; expected 'float32' or 'bfloat16'")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"batch_size={batch_size!r} must be an integer >= 1 (--batch-size)")
    src, dst = Path(src), Path(dst)
    check_destination(dst, overwrite, inputs=(src, text_inputs(text), tokens))
    checked = check_checkpoint(src, uniform_experts=False)  # a substituted source is refused here, by name
    checked.config.require_passes("substituting a checkpoint's experts")
    check_substitute_request(checked, score, keep)
    cfg, reader, layout = checked.config, checked.reader, checked.layout
    dropped_prefixes = carried_mtp_block(cfg, mtp, layout.other)   # an MTP block moejax does not run: prune refused now
    mtp_layers = sorted(l for l in layout.moe_layers if l >= cfg.num_hidden_layers)
    prefixes = {l: reader.stored_name(ml.stem + "experts.")[:-1] for l, ml in layout.moe_layers.items()
                if check_mtp_policy(mtp) == "prune" or l not in mtp_layers}   # the layers the pass substitutes
    fmt.check_targets(prefixes, checked.path)
    copied, file_notes = other_files(reader.reader)
    ids, tokenizer = calibration_ids(src, cfg, text, tokens, seq_len, max_tokens)
    batches = [(ids[i:i + batch_size], None) for i in range(0, len(ids), batch_size)]
    show = sys.stderr.isatty() if progress is None else progress
    stats = calibrate_streamed(opened(checked), batches, dtype=jnp.dtype(dtype), progress=show, mtp=mtp == "prune",
                               interventions=pass_needs([score])["interventions"])   # (outputs: always, the constants)
    kept = plan_substitution(stats, score, keep, cfg.num_experts_per_tok)
    substituted = {l: [e for e in range(stats[l].n_experts) if e not in set(k)] for l, k in kept.items()}
    constants = {l: stats[l].mean_output_EH[experts] for l, experts in substituted.items()}
    notes = list(file_notes)
    dropped = tuple(mtp_layers) if mtp == "drop" else ()
    config = cfg.to_dict()
    if mtp_layers and mtp == "keep":
        notes.append(f"MTP layer(s) {mtp_layers} written whole (--mtp keep)")
    if dropped or dropped_prefixes:
        settings = cfg.settings_dict()
        rewrite_mtp(cfg, dropped, settings, notes, dropped_prefixes)
        config = cfg.with_settings(settings)
    unrouted = {l: [e for e in experts if stats[l].counts_E[e] == 0] for l, experts in substituted.items()}
    if any(unrouted.values()):
        notes.append("substituted experts no calibration token chose return 0: "
                     + ", ".join(f"layer {l}: {e}" for l, e in unrouted.items() if e))
    entry = fmt.declaration(substituted, prefixes, {l: stats[l].n_experts for l in substituted})
    config = fmt.with_declaration(config, entry) if entry["targets"] else config
    plan = PrunePlan(kept=kept, n_experts={l: st.n_experts for l, st in stats.items()}, dropped_layers=dropped,
                     config=config, groups="unchanged", notes=tuple(notes), dropped_prefixes=dropped_prefixes)
    record = {
        "moejax_version": __version__, "source": str(src.resolve()), FINGERPRINT_KEY: checkpoint_fingerprint(checked),
        **VariantSpec(score, keep, "substituted").record(), "format": fmt.FORMAT,
        "calibration": {"tokens": int(ids.size), "sequences": int(len(ids)), "seq_len": int(ids.shape[1]),
                        "tokenizer": tokenizer, "dtype": dtype},
        "groups": "unchanged", "mtp": mtp, "dropped_layers": list(dropped), "notes": notes,
        "layers": {str(l): {"n_experts": stats[l].n_experts, "kept": kept[l], "substituted": substituted[l],
                            "counts": stats[l].counts_E.tolist()} for l in kept},
    }
    write_folder(reader, layout, plan, src, dst, copied, record, overwrite=overwrite, progress=show,
                 shards=lambda staging, show: write_substituted(reader, layout, substituted, constants, staging, show,
                                                                dropped, dropped_prefixes),
                 num_hidden_layers=cfg.num_hidden_layers)
    return record

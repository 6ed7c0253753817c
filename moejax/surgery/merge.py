"""`moejax merge SRC DST --method hc_smoe|m_smoe|ream --keep K --text ...`: a merged Hugging Face
checkpoint in the `shrunk` router form (SPEC section 8), which transformers and vLLM load as a pruned one.

Three steps:

1. A streamed calibration pass (one decoder layer's weights at a time, `moejax.inference.stream`) gathers
   each MoE layer's merging statistics (`moejax.merging.calibration.MergeStats`); for `--method ream`
   also REAM's (`merge_stats(..., ream=True)`) and the centroid score (`--score`, REAP by default:
   `moejax.scoring.observe.accumulate_layer` and `moejax.scoring.scores.compute_scores` on the same
   router inputs). With `--sequential` each MoE layer is merged as soon as its statistics are
   gathered, and the calibration tokens go on to the next layer through the merged layer (shrunk,
   as written), so every layer is clustered on the model merged up to the layer before (REAM's
   sequential mode; the stream computes the merged experts in the pass's dtype).
2. Planning, before anything is written: per-layer cluster counts (`--keep`, uniform or
   `--allocation global`), clusters (the method's `clusters`) and each cluster's
   leader (its most frequent member; REAM: its centroid). The leaders are the kept experts of a pruning plan
   (`moejax.surgery.prune_plan.plan_pruning`: the new config, routing groups, per-layer counts), so the
   router keeps one row (and bias entry) per cluster: the leader's, byte-identical to the source.
3. Writing, streamed shard by shard like `moejax prune` (`write_pruned`): every tensor of a
   singleton cluster's expert, every router row kept and every other tensor is the source's
   bytes; a merged cluster's leader tensors are replaced by the merged expert (computed one layer
   at a time from the source tensors, in float64, written in the source dtype). A source with
   transformers 5's fused expert tensors is written back fused (the merged expert's gate, up and
   down as its slab of `gate_up_proj` and `down_proj`).

Quantised sources are refused: merging dequantised experts and writing them beside quantised
ones would need a re-quantisation this command does not do. `pruning.json` records the variant
(`VariantSpec.record`: the method, form shrunk or sequential_shrunk, the keep asked and the method's
settings), the per-layer counts and every cluster (leader first, in the merged checkpoint's expert
order), and for a method that reads a score (REAM) each layer's scores.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from moejax import __version__
from moejax.allocation import ALLOCATIONS, RANKING, Allocation, Budget, allocation_record, layer_counts
from moejax.errors import CheckpointError, ConfigError
from moejax.evaluation.esap_fitness import EsapFitness
from moejax.hf.check import check_checkpoint
from moejax.hf.io.staging import check_destination, text_inputs
from moejax.hf.model_io import opened
from moejax.hf.mtp_names import MTP_DEFAULT, carried_mtp_block, check_mtp_policy
from moejax.hf.provenance import FINGERPRINT_KEY, checkpoint_fingerprint
from moejax.moe.neurons import check_mergeable
from moejax.merging.calibration import merge_stats
from moejax.merging.layer import LayerMerge, leader_first_clusters, merge_clusters, merge_layer
from moejax.merging.method import MergeContext, MergeMethod
from moejax.scoring.observe import accumulate_layer
from moejax.scoring.score_checkpoint import calibration_ids
from moejax.scoring.scores import StatsAccumulator, compute_scores, pass_needs, scores_for
from moejax.scoring.select import resolve_keep
from moejax.surgery.prune import other_files, unreachable_biases, write_folder
from moejax.surgery.prune_plan import keeps_groups, per_group_needed, plan_pruning
from moejax.variants.spec import VariantSpec

PLAIN_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


@dataclasses.dataclass(frozen=True)
class MergePlan:
    method: MergeMethod
    counts: dict[int, int]           # MoE layer -> number of clusters
    labels: dict[int, np.ndarray]    # MoE layer -> int [E], each expert's cluster (numbered by lowest member)
    leaders: dict[int, np.ndarray]   # MoE layer -> int [C], each cluster's most frequent member
    freq: dict[int, np.ndarray]      # MoE layer -> routing decisions per expert on the calibration tokens
    scores: dict | None = None       # a method reading a score (REAM): MoE layer -> its score per expert
    act_inputs: dict | None = None   # REAM: MoE layer -> router inputs of the sampled tokens [N, H]
    seed: int = 0                    # REAM: seeds the randomised PCA of large layers
    expert_fn: object = None         # REAM: the model's expert, whose hidden activations it compares (`cfg.expert_fn()`)

    def context(self, layer: int) -> MergeContext:
        """What the method's leaders and averaging read at `layer` (no statistics: the plan's)."""
        return MergeContext(None, self.freq[layer], None if self.scores is None else self.scores[layer], self.seed,
                            None if self.act_inputs is None else self.act_inputs[layer], expert_fn=self.expert_fn)

    def record_layers(self) -> dict:
        """Per layer: the kept (leader) experts ascending and each cluster with its leader first,
        in that order (the merged checkpoint's expert order)."""
        out = {}
        for l, labels in self.labels.items():
            clusters = sorted(leader_first_clusters(labels, self.leaders[l]))  # by leader: the new expert order
            out[str(l)] = {"n_experts": int(len(labels)), "kept": sorted(int(e) for e in self.leaders[l]),
                           "clusters": clusters, "counts": self.freq[l].tolist()}
            if self.scores is not None:
                out[str(l)]["scores"] = np.asarray(self.scores[l], np.float64).tolist()
        return out


def _refuse_quantised(checked) -> None:
    if checked.fmt is not None:
        raise CheckpointError(f"{checked.path}: quantised ({checked.fmt}); moejax merge averages expert weights and "
                              "does not re-quantise them, so it takes float checkpoints only (F32, BF16, F16)")
    for ml in checked.layout.moe_layers.values():
        for name in ml.experts[0]:
            dtype = checked.reader.info(name).dtype
            if dtype not in PLAIN_DTYPES:
                raise CheckpointError(f"{checked.path}: {name} is {dtype}; moejax merge takes float expert "
                                      f"tensors only ({', '.join(PLAIN_DTYPES)})")


def cluster_counts(stats: dict, keep, top_k: int, allocation="uniform", statistic: dict | None = None,
                   fitness_of=None, n_layers: int | None = None, search: dict | None = None) -> dict[int, int]:
    """Clusters per MoE layer: `keep` (a count or ratio of E) in every layer, or the same total
    spread by the allocation (`moejax.allocation`) over its statistic {layer: [E]}; an allocation
    that reads the ranking (global: M-SMoE's rule) reads a merge's routing frequency. A searching
    allocation (evo_esap) searches over the decoder layers (< n_layers; an MTP layer keeps `keep`)
    by `fitness_of(ranking, layers)`'s fitness, its candidates pruned by routing frequency (the
    leaders M-SMoE keeps), not merged: merging every layer at every count a candidate names would
    cost a merge per candidate; its record into `search`."""
    E = next(iter(stats.values())).counts_E.shape[0]
    count = resolve_keep(keep, E, top_k)
    allocation = ALLOCATIONS.parse(allocation)
    if allocation.reads == RANKING:
        statistic = {l: st.counts_E for l, st in stats.items()}
    if not allocation.searches:
        return layer_counts(statistic, count, top_k, allocation, {l: len(st.counts_E) for l, st in stats.items()})
    trunk = [l for l in sorted(stats) if n_layers is None or l < n_layers]
    budget = Budget.of(count, {l: len(stats[l].counts_E) for l in trunk}, top_k)
    fitness = fitness_of({l: statistic[l] for l in trunk}, trunk)
    searched, record = allocation.searched(budget, fitness)
    if search is not None:
        search.update(record)
    return {**dict.fromkeys(stats, count), **searched}


def plan_merge(stats: dict, method: MergeMethod, keep, top_k: int, allocation="uniform", seed: int = 0,
               scores: dict | None = None, expert_fn=None, statistic: dict | None = None, **search) -> MergePlan:
    """Clusters and leaders of every MoE layer from its MergeStats (and, for a method that reads a
    score, its scores {layer: [E]}); expert_fn: the model's expert (`cfg.expert_fn()`; None: SwiGLU);
    statistic: what the allocation reads ({layer: [E]}, when it reads a score); search: a searching
    allocation's fitness_of, n_layers and search record (`cluster_counts`)."""
    counts = cluster_counts(stats, keep, top_k, allocation, statistic, **search)
    scores = scores or None
    ctx = {l: MergeContext.of(st, None if scores is None else scores[l], seed, expert_fn=expert_fn)
           for l, st in stats.items()}
    labels = {l: method.clusters(counts[l], ctx[l]) for l in stats}
    leaders = {l: method.leaders(labels[l], ctx[l]) for l in stats}
    return MergePlan(method, counts, labels, leaders, {l: st.counts_E.copy() for l, st in stats.items()},
                     scores=None if scores is None else {l: np.asarray(scores[l], np.float64).copy() for l in stats},
                     act_inputs={l: st.act_inputs_NH for l, st in stats.items()}, seed=seed, expert_fn=expert_fn)


class MergedTensors:
    """Source tensor name -> the merged expert's tensor (HF layout, source dtype) for the tensors
    of every merged cluster's leader; None for every other tensor. One layer's merge is computed
    at a time, from that layer's source experts, when its first tensor is asked for."""

    def __init__(self, ckpt, plan: MergePlan):
        self.ckpt, self.plan = ckpt, plan
        self.targets = {}   # hf name -> (layer, cluster, weights key, transpose)
        for l, labels in plan.labels.items():
            merged = {int(plan.leaders[l][c]): c for c in range(len(plan.leaders[l])) if np.sum(labels == c) > 1}
            for spec in ckpt.layer_specs(l):
                if not spec.param.startswith(f"model.layers.{l}.mlp."):
                    continue
                if spec.expert in merged and spec.param.rsplit(".", 1)[-1].startswith("experts_"):
                    key = spec.param.rsplit(".", 1)[-1][len("experts_"):]
                    self.targets[spec.hf_name] = (l, merged[spec.expert], key, spec.transpose)
        self._layer, self._merge = None, None

    def _layer_merge(self, layer: int) -> LayerMerge:
        if self._layer != layer:
            name = next(n for n, t in self.targets.items() if t[0] == layer)
            dtype = jnp.dtype(PLAIN_DTYPES[self.ckpt.reader.info(name).dtype])
            weights = self.ckpt.decoder_layer(layer, dtype).mlp.expert_weights()
            self._merge = merge_clusters(self.plan.method, self.plan.labels[layer], self.plan.context(layer), weights)
            self._layer = layer
        return self._merge

    def __call__(self, name: str):
        target = self.targets.get(name)
        if target is None:
            return None
        layer, cluster, key, transpose = target
        value = np.asarray(self._layer_merge(layer).weights[key][cluster])
        return np.ascontiguousarray(value.T if transpose else value)


def _check_before_pass(checked, ckpt, count: int, keep, allocation: Allocation, collapse_groups: bool, mtp: str) -> None:
    """What the plan would refuse after the calibration pass, when the settings alone decide it:
    an MTP layer --mtp prune would merge that the pass cannot run (no predictor), and a uniform cluster
    count that no choice of leaders can spread over the routing groups as group-limited routing
    needs (equal counts per group, at least 2, topk_group x per-group >= top_k) without
    collapse_groups. Whether the leaders actually fall evenly into the groups is known only after."""
    cfg = checked.config
    carried_mtp_block(cfg, mtp, checked.layout.other)  # an MTP block moejax does not run: prune refused now
    if check_mtp_policy(mtp) == "prune":  # the pass runs each MTP layer: refused now if it cannot
        for layer in (l for l in checked.layout.moe_layers if l >= cfg.num_hidden_layers):
            ckpt.mtp_specs(layer)
    routing = cfg.router_settings()
    n_group, topk_group, top_k = routing.get("n_group", 1), routing.get("topk_group", 1), cfg.num_experts_per_tok
    if allocation.searches and n_group > 1 and not collapse_groups:
        raise ConfigError(f"--allocation {allocation.name} on group-limited routing (n_group={n_group}): a searched "
                          "count need not divide into the groups; give --collapse-groups")
    if n_group > 1 and not collapse_groups and allocation.reads is None and (
            count % n_group or count // n_group < per_group_needed(top_k, topk_group)):
        raise ConfigError(f"--keep {keep} ({count} clusters per MoE layer) cannot keep group-limited routing "
                          f"(n_group={n_group}, topk_group={topk_group}, top_k={top_k}): the groups must keep equal "
                          "counts of at least 2 with topk_group x per-group >= top_k. Pass --collapse-groups to route "
                          "over all kept experts without groups, or a keep that divides into the groups")


def _check_settings(method: MergeMethod, allocation: Allocation, dtype: str, batch_size: int, sequential: bool,
                    seed) -> None:
    """The command's own settings, refused before any work (the method checked its own when made)."""
    if not isinstance(method, MergeMethod):
        raise ConfigError(f"method={method!r}: expected a merge method object (moejax.merging.method.parse(name, "
                          "**settings))")
    if dtype not in ("float32", "bfloat16"):
        raise ConfigError(f"dtype={dtype!r}; expected 'float32' or 'bfloat16'")
    if batch_size < 1:
        raise ConfigError(f"batch_size={batch_size} must be >= 1 (--batch-size)")
    if sequential and allocation.reads is not None:
        raise ConfigError(f"--sequential with --allocation {allocation}: it spreads the counts by every "
                          "layer's statistics, which a sequential pass knows only after the layers it merges; "
                          "use --allocation uniform")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ConfigError(f"seed={seed!r} (--seed): expected an integer >= 0 ({method.seed_use})")


def _check_checkpoint(checked, ckpt, method: MergeMethod, keep, allocation: Allocation, collapse_groups: bool, mtp: str,
                      sequential: bool) -> int:
    """The checkpoint (checked, and opened: `ckpt`) against the settings, before the pass; returns the
    uniform cluster count."""
    cfg = checked.config
    _refuse_quantised(checked)
    check_mergeable(cfg.EXPERT_KIND, f"{checked.path}: {cfg.TITLE}")
    count = resolve_keep(keep, cfg.n_experts, cfg.num_experts_per_tok)  # a bad --keep fails before the pass
    _check_before_pass(checked, ckpt, count, keep, allocation, collapse_groups, mtp)
    if sequential and collapse_groups and cfg.router_settings().get("n_group", 1) > 1:
        raise ConfigError(f"{checked.path}: --sequential with --collapse-groups: the written checkpoint would route "
                          "without the routing groups the sequential pass routes its calibration stream with; keep "
                          "the groups (a --keep that divides into them) or merge one-shot")
    if method.scores:
        scores_for(list(method.scores), cfg.HAS_BALANCE_BIAS, f"{checked.path}: --score")
    method.check(count if allocation.reads is None else None, cfg.n_experts)  # else each layer's count is known later
    return count


def _merge_pass(ckpt, method: MergeMethod, batches, dtype: str, seed: int, count: int, sequential: bool,
                show: bool, mtp: bool = True, statistic: str | None = None) -> tuple[dict, dict, dict]:
    """({layer: MergeStats}, {layer: the method's score per expert}, {layer: the score `statistic`
    an allocation reads}) from one streamed calibration pass; sequential: each layer merged (shrunk)
    as soon as its statistics are in, for the stream to pass through it as the checkpoint will hold
    it. mtp: the MTP layers too (run on the trunk as merged)."""
    from moejax.inference.stream import stream_layers  # at call time: tests patch it to refuse a pass

    stats, layer_scores, merged_layers, allocated = {}, {}, {}, {}
    wanted = [*method.scores, *([statistic] if statistic else [])]
    carry = (lambda layer: merged_layers.pop(layer)) if sequential else None
    for layer, moe, router_inputs in stream_layers(ckpt, batches, jnp.dtype(dtype), show, variant_of=carry, mtp=mtp):
        masks = [None] * len(router_inputs)
        stats[layer] = merge_stats(moe, router_inputs, masks, **method.stats_options(), seed=seed)
        if wanted:
            acc = StatsAccumulator(moe.router.shape[0], moe.router.shape[1])
            accumulate_layer(moe, router_inputs, masks, acc, **pass_needs(wanted))
            layer_stats = acc.stats(jax.device_get(moe.router[...]), jax.device_get(moe.balance_bias()), seed=seed,
                                    layer=layer)
            computed = compute_scores(layer_stats, wanted)
            if method.scores:
                layer_scores[layer] = computed[method.scores[0]]
            if statistic:
                allocated[layer] = computed[statistic]
        if sequential:
            ctx = MergeContext.of(stats[layer], layer_scores.get(layer), seed, expert_fn=ckpt.config.expert_fn())
            merged_layers[layer] = merge_layer(method, count, ctx, moe.expert_weights()).expert_map("shrunk")
    return stats, layer_scores, allocated


def merge_checkpoint(src, dst, *, method: MergeMethod, keep, text=None, tokens=None, seq_len: int | None = None,
                     max_tokens: int | None = None, batch_size: int = 8, allocation="uniform",
                     collapse_groups: bool = False, mtp: str = MTP_DEFAULT, dtype: str = "float32", seed: int = 0,
                     overwrite: bool = False, progress: bool | None = None, sequential: bool = False) -> dict:
    """Write the merged checkpoint of `src` to `dst` (shrunk router form) and return its record
    (also dst/pruning.json). method: a merge method object with its settings
    (`moejax.merging.method.parse("ream", group_size=8)`). The destination, the checkpoint, the
    settings and the calibration data are checked before the pass; the plan (groups, counts)
    before the first byte is written. mtp: MTP layers merged with the trunk's keep on the statistics
    of the pass, which runs them as inference does ("prune"), kept whole ("keep") or removed
    ("drop"), as `moejax prune --mtp` (`check_mtp_policy`). seed: k-means' and REAM's sample and PCA (`method.seed_use`). sequential: each
    layer merged on the calibration stream of the model merged up to the layer before (uniform
    allocation only; group-limited routing kept, not collapsed, so the stream routes as the
    written checkpoint does)."""
    allocation = ALLOCATIONS.parse(allocation)
    _check_settings(method, allocation, dtype, batch_size, sequential, seed)
    src, dst = Path(src), Path(dst)
    check_destination(dst, overwrite, inputs=(src, text_inputs(text), tokens))
    checked = check_checkpoint(src)
    checked.config.require_passes("merging a checkpoint's experts")
    ckpt, cfg = opened(checked), checked.config
    count = _check_checkpoint(checked, ckpt, method, keep, allocation, collapse_groups, mtp, sequential)
    reader, layout = checked.reader, checked.layout  # the per-expert view (fused experts too) and its layout
    copied, file_notes = other_files(reader.reader)
    ids, tokenizer = calibration_ids(src, cfg, text, tokens, seq_len, max_tokens)
    search, fitness = {}, {}
    if allocation.searches:   # the fitness's sequences held apart (the last ones): not in the statistics
        ids, fitness_ids = allocation.split(ids)
        fitness = {"fitness_of": lambda ranking, layers: EsapFitness(
            ckpt, fitness_ids, ranking, layers, batch_size=batch_size, dtype=jnp.dtype(dtype),
            keeps_groups=lambda kept: keeps_groups(kept, cfg)),
                   "n_layers": cfg.num_hidden_layers, "search": search}
    batches = [(ids[i:i + batch_size], None) for i in range(0, len(ids), batch_size)]
    show = sys.stderr.isatty() if progress is None else progress
    reads = None if allocation.reads in (None, RANKING) else allocation.reads   # a score (shape: shapley)
    stats, layer_scores, statistic = _merge_pass(ckpt, method, batches, dtype, seed, count, sequential, show,
                                                 mtp == "prune", reads)
    plan = plan_merge(stats, method, keep, cfg.num_experts_per_tok, allocation, seed, scores=layer_scores,
                      expert_fn=cfg.expert_fn(), statistic=statistic or None, **fitness)
    leader_scores = {l: np.isin(np.arange(len(lab)), plan.leaders[l]).astype(np.float64)
                     for l, lab in plan.labels.items()}
    prune_plan = plan_pruning(reader, layout, cfg, score=f"{method.name} cluster leaders", layers_keep=plan.counts,
                              collapse_groups=collapse_groups, mtp=mtp, layer_scores=leader_scores,
                              leaders=True)
    prune_plan = dataclasses.replace(prune_plan, notes=prune_plan.notes + tuple(file_notes))
    spec = VariantSpec(method.name, keep, "sequential_shrunk" if sequential else "shrunk")
    record = {
        "moejax_version": __version__, "source": str(src.resolve()), FINGERPRINT_KEY: checkpoint_fingerprint(checked),
        **spec.record(method.settings()), **allocation_record(allocation),
        **({"allocation_search": {**search, "fitness_sequences": allocation.fitness_sequences}} if search else {}),
        "calibration": {"tokens": int(ids.size), "sequences": int(len(ids)), "seq_len": int(ids.shape[1]),
                        "tokenizer": tokenizer, "dtype": dtype},
        "seed": seed, "groups": prune_plan.groups, "mtp": mtp, "dropped_layers": list(prune_plan.dropped_layers),
        "notes": list(prune_plan.notes),
        "layers": plan.record_layers(),
    }
    merged = MergedTensors(ckpt, plan)
    if prune_plan.unreachable:   # layers kept whole beside (DeepSeek-V4): every slot written ("kept", as `moejax
        for l, dropped in prune_plan.unreachable.items():   # prune` records it), the non-leaders "unreachable"
            record["layers"][str(l)].update(kept=prune_plan.kept[l], unreachable=dropped)   # (bias UNREACHABLE_BIAS)
        biases = unreachable_biases(reader, layout, prune_plan)

        def replaced(name):
            value = merged(name)
            return biases(name) if value is None else value
    else:
        replaced = merged
    write_folder(reader, layout, prune_plan, src, dst, copied, record, overwrite=overwrite, progress=show,
                 replaced=replaced, num_hidden_layers=cfg.num_hidden_layers)
    return record

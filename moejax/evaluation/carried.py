"""What pruning costs on a real checkpoint (SPEC sections 3 and 5), every variant in one pass.

`evaluate_pruning` reads each decoder layer's weights once and carries, layer by layer:
- the calibration stream of the unpruned model, whose statistics at a MoE layer give every score
  of that layer (moejax.scoring), hence every variant's kept set for it (one-shot pruning);
- the held-out streams of the unpruned model, on whose router inputs each variant's layer-local
  error is measured (routed output only, shared experts excluded: SPEC section 3);
- one held-out stream per variant (score, keep), pruned at every MoE layer, for its end-to-end
  perplexity;
- with `merges` also, per merge method and keep, the layer merged (moejax.merging: clusters from the
  unpruned calibration stream, merged experts) under both router forms, `tied` and `shrunk`, as
  held-out streams of their own, measured like the pruned ones;
- with `substitutes` also, per score and keep, the layer with that score's removed experts
  substituted (MoNE: each returns its mean output over the calibration tokens routed to it),
  measured like the pruned ones;
- with `sequential=True` also, per variant, a calibration stream of the model already pruned up to
  the layer before, on which that variant's score for the next layer is computed (what
  llm-compressor does), and its own held-out stream;
- with `sequential_merges=True` also, per merge method, keep and router form, a calibration stream
  of the model already merged up to the layer before, on which that variant's next layer is
  clustered and merged (REAM's sequential mode), and its own held-out stream.
At the end the final norm and head turn each held-out stream into a perplexity per text.

Results are tidy rows: method, form, keep, layer, text, metric, value (see `METRICS`); a variant is
a `moejax.variants.VariantSpec`: one_shot or sequential pruning by the score `method`, or merging
by the merge `method` under the router form tied or shrunk, one-shot or sequential (form "none":
the unpruned model). Each
variant's decisions come back as a `moejax.variants.VariantPlan`.

Every variant of a layer is an `ExpertMap` (moejax.moe.expert_map): stream n routed over its
remaining router slots and computing with its rows of an expert table. The held-out streams run
by table group (`moejax.evaluation.carried_heldout`): those computing with the layer's own experts
stacked into one batch, then each merge's router forms with that merge's experts, made when its
group runs and dropped after, so beside the layer's experts at most one merge's are held.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import time
from typing import Callable

import jax.numpy as jnp
import numpy as np
from tqdm import tqdm
from flax import nnx

from moejax.hf.model_io import OpenCheckpoint
from moejax.host_memory import release_free_memory
from moejax.errors import ConfigError
from moejax.allocation import ALLOCATIONS, RANKING, UNIFORM, Budget, allocate, statistic_of
from moejax.merging.calibration import merge_stats
from moejax.merging.average import averaged_rows
from moejax.moe.neurons import check_mergeable
from moejax.merging.layer import LayerMerge, merge_averaging, merge_stats_options, merged_rows
from moejax.merging.method import MergeContext, MergeMethod
from moejax.scoring.observe import accumulate_layer, expert_weight_sums
from moejax.scoring.scores import StatsAccumulator, compute_scores, pass_needs
from moejax.scoring.select import resolve_keep, select_kept
from moejax.inference.stream import batch_geometry, embed, head_pass
from moejax.variants import ROUTER_FORMS, Kept, Merged, Substituted, VariantPlan, VariantSpec
from moejax.variants.plan import stacked_expert_map
from moejax.models.variant import check_routable
from moejax.evaluation.carried_heldout import TableGroup, carry_heldout
from moejax.evaluation.carried_layer import attention, mlp
from moejax.evaluation.esap_fitness import EsapFitness
from moejax.evaluation.carried_rows import METRICS, ErrorSums, analysis_rows, ppl_row  # noqa: F401 (METRICS: the rows' legend)

# Held-out tokens a decoder layer runs in one call (all streams of a batch together would hold
# several [streams x tokens, width] intermediates: 17 streams of 1,024 Moonlight tokens need 0.9 GB
# for each expert-width one). 2,048 keeps a Moonlight-shaped layer's intermediates near 0.2 GB.
STREAM_TOKENS = 2048



# --- the pass ------------------------------------------------------------------------------------


def _geometry(ckpt: OpenCheckpoint, batches, dtype):
    return [batch_geometry(ckpt, ids, None, dtype) for ids in batches]


def evaluate_pruning(ckpt: OpenCheckpoint, calib: np.ndarray, heldout: dict[str, np.ndarray], scores: list[str],
                     keeps: list, *, merges: tuple[MergeMethod, ...] = (), substitutes: tuple = (),
                     sequential: bool = False, sequential_merges: bool = False,
                     allocation=UNIFORM,
                     batch_size: int = 8, dtype=jnp.float32, seed: int = 0, merged_weights: bool = False,
                     progress: bool | None = None, share: tuple[int, int] = (0, 1)) -> tuple[list[dict], dict]:
    """(tidy rows, info) for every (score, keep) variant and every (merge method, keep, router
    form); calib and each held-out text are token ids [n_seq, seq_len]. Each decoder layer's
    weights are read once. info["plans"] is every variant's `VariantPlan` (its decisions per MoE
    layer), in the order of the held-out streams; with merged_weights=True a merge's plan keeps its
    merged experts (so `plan.expert_maps()` evaluates it: eval_tasks), else only its clusters (a
    model's worth of merged experts per merge and keep is not held). info["kept"][layer] maps
    "score@keep" (one-shot) and
    "sequential:score@keep" to that variant's kept experts; info["clusters"][layer] maps
    "method@keep" to its clusters (lists of experts, the leader first), each sequential merge's
    name ("sequential_tied:method@keep") to its own, and "counts" to the routing decisions per
    expert the one-shot merges weighed by (with merges).

    share (index, count): carry only the index-th of `count` shares of the variants (`share_of`), for
    a pass split over processes (`moejax.experiments.prune_real`); each share computes what every
    variant's decisions need (the unpruned streams, the one-shot scores), and only share 0 returns
    the rows that are the same in every share (the analyses, the unpruned model's perplexity).
    info["at"]: the share's variants' places among all the variants (info["plans"]'s order unsplit).

    sequential: also every score's sequential variant (layer l+1 scored on the model pruned up to
    layer l); sequential_merges: also every merge's, per router form (layer l+1 clustered and
    merged on the model merged up to layer l under that form), each with a calibration stream of
    its own.

    allocation (`moejax.allocation`, a name or object): "uniform" (every MoE layer keeps `keep`) or
    per-layer counts under the same total (global: one threshold over the layers' normalised
    scores; shape: SHAPE's coverage of the Shapley values). One that reads a statistic needs every
    layer's before the first layer is pruned, so it costs a statistics pass over the calibration
    tokens first (each layer's weights are then read twice); info["layer_counts"][variant
    name][layer] and the `experts` rows record the counts."""
    cfg = ckpt.config
    cfg.require_passes("the carried pass (evaluate_pruning)")   # (no family refuses it now; the hook stays)
    if cfg.per_layer_experts:  # the carried pass sizes every layer's statistics and masks by n_experts
        raise ConfigError(f"{ckpt.path}: MoE layers hold different expert counts (moe_sparsity_config.num_experts "
                          f"{list(cfg.layer_num_experts)}); evaluate_pruning (the prune_real experiment) needs one "
                          "count in every layer: evaluate it with the model's forward, generate or the lm-eval backend")
    keeps = sorted({resolve_keep(k, cfg.n_experts, cfg.num_experts_per_tok) for k in keeps}, reverse=True)
    one_shot = [VariantSpec(s, k, "one_shot") for s in scores for k in keeps]
    merged = [VariantSpec(m.name, k, form) for m in merges for k in keeps for form in ROUTER_FORMS]
    substituted = [VariantSpec(s, k, "substituted") for s in substitutes for k in keeps]
    selecting = list(dict.fromkeys([*scores, *substitutes]))   # the scores kept sets are chosen by
    seq_variants = [VariantSpec(s, k, "sequential") for s in scores for k in keeps] if sequential else []
    if merges:
        check_mergeable(ckpt.config.EXPERT_KIND, f"evaluate_pruning: {ckpt.config.TITLE}")
    if sequential_merges:
        if not merges:
            raise ConfigError("sequential_merges=True: no merge method to run sequentially (merges is empty)")
        seq_variants += [VariantSpec(m.name, k, f"sequential_{form}") for m in merges for k in keeps
                         for form in ROUTER_FORMS]
    every = one_shot + merged + substituted + seq_variants
    mine = share_of(every, *share)
    one_shot, merged, substituted, seq_variants = ([v for v in vs if v in mine]
                                                   for vs in (one_shot, merged, substituted, seq_variants))
    show = sys.stderr.isatty() if progress is None else progress
    allocation = ALLOCATIONS.parse(allocation)
    searches = {}
    if allocation.searches:   # the fitness's tokens, held apart: neither scored nor decided on
        calib, fitness_ids = allocation.split(calib)
    if allocation.reads is not None:
        counts = _allocated_counts(ckpt, calib, allocation, selecting, [m.name for m in merges], keeps, batch_size,
                                   dtype, seed, show, fitness_ids if allocation.searches else None, searches)
    else:
        counts = {(name, k): dict.fromkeys(cfg.scored_layers, k) for name in [*selecting, *(m.name for m in merges)]
                  for k in keeps}   # (a layer kept whole, DeepSeek-V4's hash layers, is run whole: no count)
    streams = _Streams.embedded(ckpt, calib, heldout, one_shot + merged + substituted, seq_variants, batch_size,
                                dtype)
    methods = _Methods(tuple(scores), tuple(substitutes), tuple(merges))
    errors, rows, kept_by_layer, clusters_by_layer = ErrorSums(), [], {}, {}
    plans = {v: VariantPlan(v) for v in streams.order[1:]}
    t0 = time.perf_counter()
    for layer_idx in tqdm(range(cfg.num_hidden_layers), desc=f"layers ({len(streams.order)} held-out streams)",
                          unit="layer", disable=not show):
        layer_rows, layer_plans, clusters = _layer_pass(ckpt, layer_idx, streams, methods, keeps, counts, errors,
                                                        seed, dtype, merged_weights, shared_rows=share[0] == 0)
        rows += layer_rows
        release_free_memory()   # the layer's weights' pages, before the next layer's are read
        if layer_plans is not None:
            for v, layer_plan in layer_plans.items():
                plans[v].layers[layer_idx] = layer_plan
            kept_by_layer[layer_idx] = {v.name: p.experts() for v, p in layer_plans.items() if not v.merged}
            clusters_by_layer[layer_idx] = clusters
    rows += _perplexity_rows(ckpt, streams, dtype, unpruned=share[0] == 0)
    rows += errors.rows()
    info = {"seconds": time.perf_counter() - t0, "variants": len(streams.order) - 1, "keeps": keeps,
            "plans": list(plans.values()), "at": [every.index(v) for v in streams.order[1:]],
            "kept": kept_by_layer, "clusters": clusters_by_layer, "allocation": allocation.name,
            "layer_counts": {f"{name}@{k}": c for (name, k), c in counts.items()}, "calib_tokens": int(calib.size),
            "allocation_search": searches,
            "heldout_tokens": {t: int(ids.size) for t, ids in heldout.items()}}
    return rows, info


def share_of(variants: list, index: int, count: int) -> list:
    """The index-th of `count` shares of `variants`, in their order: whole units round robin, a unit
    being the variants one decision serves (a one-shot merge's router forms share their clusters;
    every other variant is a unit of its own), so no decision is made in two shares."""
    if not (isinstance(count, int) and count >= 1 and isinstance(index, int) and 0 <= index < count):
        raise ConfigError(f"evaluate_pruning: share=({index!r}, {count!r}); expected (index, count) with "
                          "0 <= index < count")

    def unit(v):
        return (v.method, v.keep, "merged") if v.merged and not v.sequential else v

    mine = set(list(dict.fromkeys(map(unit, variants)))[index::count])
    return [v for v in variants if unit(v) in mine]


@dataclasses.dataclass
class _Streams:
    """The hidden states carried from layer to layer, each a list over batches.

    Calibration streams, one per stream key (None: the unpruned model; with `sequential`, one per
    sequential variant), are held once per *group*: the streams that are still the same arrays.
    Every stream starts in the unpruned stream's group (key None); a stream leaves its group at the
    first layer that prunes it (a variant at its first MoE layer, by its own mask) for a group of its
    own, keyed by itself. So through the dense layers at the bottom every calibration stream is the
    unpruned one, and each layer computes attention, statistics and the MLP once per group.

    Held-out streams are stacked, [A, B, S, H] per batch, in the order of `order`; until the first
    MoE layer every one of them is the unpruned stream, held once ([1, B, S, H]). A layer runs on
    `chunk` streams at a time (STREAM_TOKENS tokens per call), which bounds its intermediates, and
    writes its output over its input (`carried_heldout.carry_heldout`)."""

    order: list        # the held-out streams: None (unpruned), then the variants measured on the unpruned
                       # model's inputs (one-shot and merged), then the sequential variants
    n_unpruned_inputs: int  # how many variants after None are measured on the unpruned inputs
    cal_geo: list      # per calibration batch: (cos, sin, allowed)
    held_geo: dict     # text -> per batch: (cos, sin, allowed)
    held_ids: dict     # text -> per batch: ids [B, S]
    cal_ids: list      # per calibration batch: ids [B, S] (a hash-routed layer's choice: DeepSeek-V4)
    group: dict        # calibration stream key -> the key of its group
    cal: dict          # group key -> per calibration batch: x [B, S, H] (the residual as the family's
                       # `CausalLM.entry` makes it: DeepSeek-V4's hyper-connection streams [B, S, W, H])
    cal_carry: dict    # group key -> per calibration batch: what the attentions so far hand on, or None
    held: dict         # text -> per batch: x [A, B, S, H] (or [1, B, S, H]: every stream still the same)
    held_carry: dict   # text -> per batch: what the attentions so far hand on, [A or 1, B, ...], or None
                       # (`DecoderLayer.attend`: GLM-5.2's indexer selection; None for most families)
    chunk: int         # held-out streams per call

    @classmethod
    def embedded(cls, ckpt: OpenCheckpoint, calib, heldout, one_shot, seq_variants, batch_size, dtype) -> "_Streams":
        """Every stream at the embeddings, before the first decoder layer (one group; the held-out
        streams held once). one_shot: the variants decided on the unpruned model (pruned one-shot,
        merged)."""
        def batched(ids):
            return [ids[i:i + batch_size] for i in range(0, len(ids), batch_size)]

        cal_batches = batched(calib)
        held_ids = {text: batched(ids) for text, ids in heldout.items()}
        order = [None, *one_shot, *seq_variants]
        held_batches = [b for text in held_ids for b in held_ids[text]]
        xs = embed(ckpt, cal_batches + held_batches, dtype)   # the table read once for all of them
        held, at = {}, len(cal_batches)
        for text, bs in held_ids.items():
            held[text] = [x[None] for x in xs[at:at + len(bs)]]
            at += len(bs)
        tokens = max([b.size for b in held_batches], default=1)
        return cls(order=order, n_unpruned_inputs=len(one_shot), cal_geo=_geometry(ckpt, cal_batches, dtype),
                   held_geo={text: _geometry(ckpt, b, dtype) for text, b in held_ids.items()}, held_ids=held_ids,
                   cal_ids=cal_batches,
                   group={key: None for key in [None, *seq_variants]}, cal={None: xs[:len(cal_batches)]},
                   cal_carry={None: [None] * len(cal_batches)}, held=held,
                   held_carry={text: [None] * len(bs) for text, bs in held_ids.items()},
                   chunk=max(1, STREAM_TOKENS // tokens))


def _allocated_counts(ckpt: OpenCheckpoint, calib, allocation, scores, merges, keeps, batch_size, dtype, seed,
                      show, fitness_ids=None, searches: dict | None = None) -> dict:
    """{(score or merge method, keep): {MoE layer: count}} under the allocation, from a statistics
    pass over the calibration tokens (the unpruned model's scores; an allocation that reads the
    ranking allocates a merge by its routing frequency: M-SMoE's rule). A searching allocation
    (evo_esap) searches per ranking and keep with the ESAP of candidates on `fitness_ids`
    (`moejax.evaluation.esap_fitness`; a merge's candidates pruned by frequency, its leaders' rule),
    each search's record into `searches` ("name@keep": best fitness, candidates, seconds)."""
    from moejax.inference.stream import stream_layers  # at call time: tests patch it to refuse a pass

    cfg = ckpt.config
    statistic = {name: statistic_of(allocation, name) for name in scores}
    statistic.update({m: m if allocation.reads == RANKING else allocation.reads for m in merges})
    needed = list(dict.fromkeys(v for k, v in statistic.items() if k not in merges or v not in merges))
    batches = [(calib[i:i + batch_size], None) for i in range(0, len(calib), batch_size)]
    by_layer = {}
    for layer, moe, router_inputs in stream_layers(ckpt, batches, dtype, show):
        acc = StatsAccumulator(cfg.n_experts, cfg.hidden_size)
        accumulate_layer(moe, router_inputs, [None] * len(router_inputs), acc, **pass_needs(needed))
        stats = acc.stats(np.asarray(moe.router[...]), moe.balance_bias(), seed=seed, layer=layer)
        by_layer[layer] = {**compute_scores(stats, needed), **{m: stats.counts_E for m in merges}}
    top_k, layers = cfg.num_experts_per_tok, list(by_layer)
    counts = {}
    for name in [*scores, *merges]:
        ranking = {l: sc[statistic[name]] for l, sc in by_layer.items()}
        fitness = None if fitness_ids is None else EsapFitness(ckpt, fitness_ids, ranking, layers,
                                                               batch_size=batch_size, dtype=dtype, collapse=False)
        for k in keeps:
            budget = Budget.of(k, {l: len(ranking[l]) for l in layers}, top_k)
            if fitness is None:
                counts[name, k] = allocate(allocation, budget, ranking)
                continue
            counts[name, k], searches[f"{name}@{k}"] = allocation.searched(budget, fitness)
    return counts


@dataclasses.dataclass(frozen=True)
class _Methods:
    """What a layer decides variants by: scores (pruning), substitutes (scores whose selections are
    also substituted), merges (`MergeMethod` objects, each with its settings)."""
    scores: tuple
    substitutes: tuple = ()
    merges: tuple = ()

    def merge(self, name: str) -> MergeMethod:
        """The merge method a variant names (its spec holds the name)."""
        return next(m for m in self.merges if m.name == name)

    def deciding(self, variant) -> list:
        """The scores a sequential variant decides by on its own stream: its score, or its merge's."""
        return list(self.merge(variant.method).scores) if variant.merged else [variant.method]

    @property
    def needs_outputs(self) -> bool:
        """Whether the layer's statistics need the routed outputs' sums (mone, substitutes' constants):
        they bring every routed pair's output to the host, which no other score needs."""
        return bool(self.substitutes) or pass_needs(self.computed)["outputs"]

    @property
    def computed(self) -> list:
        """Every score the layer computes: the pruning scores, the substitutes' and the merges' (REAM's)."""
        return list(dict.fromkeys([*self.scores, *self.substitutes, *(s for m in self.merges for s in m.scores)]))


def _layer_pass(ckpt: OpenCheckpoint, layer_idx: int, streams: _Streams, methods: _Methods, keeps, counts: dict,
                errors: ErrorSums, seed: int, dtype, merged_weights: bool = False, shared_rows: bool = True
                ) -> tuple[list[dict], dict | None, dict | None]:
    """Decoder layer `layer_idx` (its weights read once) on every stream, which it moves on to the
    layer's output, in three steps: decide (at a MoE layer, every variant's plan: one-shot pruning
    and merging from the unpruned calibration stream, sequential ones from the variant's own,
    `_decide_layer`), carry the calibration streams (`_carry_calibration`), carry the held-out
    streams (their layer-local errors into `errors`). Returns (analysis rows, {VariantSpec: its
    LayerPlan here}, {merge name: clusters}), the last two None at a dense layer (the kept experts
    of info["kept"] are the plans'); merged plans keep their merged experts only with `merged_weights`;
    shared_rows False: not the analysis rows (the unpruned model's, the same in every share)."""
    layer = ckpt.decoder_layer(layer_idx, dtype, expert_dtype=ckpt.stored_expert_dtype(dtype))
    graphdef, state = nnx.split(layer)
    # per calibration group and batch: `Attended` (h, the residual after attention; z, the MLP's (router's)
    # input; the attention's carry)
    cal_hz = {group: [attention(graphdef, state, x, *geometry, carry)
                      for x, geometry, carry in zip(xs, streams.cal_geo, streams.cal_carry[group])]
              for group, xs in streams.cal.items()}
    # a MoE layer kept whole (DeepSeek-V4's hash layers: tid2eid gives their experts) is run like a dense one
    decided = layer.is_moe and not ckpt.config.is_kept_whole(layer_idx)
    decision = _decide_layer(ckpt.config, layer, layer_idx, cal_hz, streams, methods, keeps, counts, seed) \
        if decided else None
    _carry_calibration(graphdef, state, streams, cal_hz, {} if decision is None else decision.carry_maps)
    groups, kept_experts = None, ({} if merged_weights else None)   # merges made with their experts, for the plans
    if decision is not None:
        plans = [None if v is None else decision.plans[v] for v in streams.order]
        groups = _table_groups(plans, layer.mlp.expert_weights(), ckpt.config.n_experts, decision.merged_experts,
                               kept_experts)
        decision.carry_maps = decision.merged_experts = plans = None   # (sequential merges' experts: carried above)
    first_seq = 1 + streams.n_unpruned_inputs
    energy_pos0 = carry_heldout(graphdef, state, streams.held, streams.held_carry, streams.held_geo, groups,
                                streams.chunk, first_seq,
                                lambda a, norm, err: errors.add((streams.order[a], layer_idx), norm, err,
                                                                np.ones(norm.shape, bool)), streams.held_ids)
    groups = None
    if decision is None:
        return [], None, None
    layer_plans = _recorded_plans(decision.plans, kept_experts)
    rows = [dict(form="one_shot", **r) for r in analysis_rows(layer_idx, decision.stats,
                                                                {s: decision.scores[s] for s in methods.scores},
                                                                decision.kept, keeps, energy_pos0)] \
        if shared_rows and decision.stats is not None else []   # (no score asked: merges alone, no analyses)
    rows += [dict(v.row(), layer=layer_idx, metric="experts", value=float(counts[v.method, v.keep][layer_idx]))
             for v in streams.order[1:]]
    return rows, layer_plans, decision.clusters


@dataclasses.dataclass
class _LayerDecision:
    """What a MoE layer decided for every variant (`_decide_layer`)."""
    plans: dict                 # VariantSpec -> its LayerPlan (Kept, Merged, Substituted)
    carry_maps: dict            # variant -> what its calibration stream runs under here: its kept experts [E]
                                # (one-shot and sequential pruning) or its ExpertMap (a sequential merge)
    clusters: dict | None       # {"counts": [...], merge name: clusters} (with merges)
    stats: object               # the unpruned calibration stream's LayerStats
    scores: dict                # {score: [E]} on it
    kept: dict                  # (score, keep) -> bool [E]
    merged_experts: Callable | None   # `_layer_merges`' experts(merge, rows_only)


def _decide_layer(cfg, layer, layer_idx: int, cal_hz: dict, streams: _Streams, methods: _Methods, keeps,
                  counts: dict, seed: int) -> _LayerDecision:
    """Every variant's plan at this MoE layer, each checked routable before the layer computes under it."""
    router, bias = np.asarray(layer.mlp.router[...]), layer.mlp.balance_bias()
    group_scores = {}   # calibration group -> (statistics, {score: [E]}), computed once per group
    weight_sums = expert_weight_sums(layer.mlp)  # the same for every group: the weights do not change

    def scores_of(group):
        """(statistics, {score: [E]}) of a calibration group: on the unpruned stream (None) every score
        the layer computes; on a sequential variant's own stream only the score it decides by."""
        if group not in group_scores:
            names = methods.computed if group is None else methods.deciding(group)
            if not names:   # a sequential merge that clusters by its statistics alone (`stats_of`)
                group_scores[group] = None, {}
                return group_scores[group]
            needs = pass_needs(names)
            acc = StatsAccumulator(cfg.n_experts, cfg.hidden_size)
            zs = [a.z_BSH.reshape(-1, a.z_BSH.shape[-1]) for a in cal_hz[group]]
            accumulate_layer(layer.mlp, zs, [None] * len(zs), acc, weight_sums,
                             outputs=methods.needs_outputs if group is None else needs["outputs"],
                             interventions=needs["interventions"])
            stats = acc.stats(router, bias, seed=seed, layer=layer_idx)
            group_scores[group] = stats, compute_scores(stats, names)
        return group_scores[group]

    stats, layer_sc = scores_of(None)
    kept = {(s, k): select_kept(layer_sc[s], counts[s, k][layer_idx], f"layer {layer_idx}: score {s!r}")
            for s in dict.fromkeys([*methods.scores, *methods.substitutes]) for k in keeps}
    carry_maps = {}
    for v in streams.order[1:]:
        if v.form == "one_shot":
            carry_maps[v] = jnp.asarray(kept[v.method, v.keep])
        elif v.form == "sequential":
            _, own = scores_of(streams.group[v])
            carry_maps[v] = jnp.asarray(select_kept(own[v.method], counts[v.method, v.keep][layer_idx],
                                                    f"layer {layer_idx}: score {v.method!r} (sequential)"))
    merge_of, merged_experts, clusters = {}, None, None   # merged variant -> its LayerMerge here
    if methods.merges:
        merge_of, merge_counts, merged_experts = _layer_merges(layer, layer_idx, cal_hz, streams, methods, counts,
                                                               scores_of, seed)
        one_shot = {(v.method, v.keep): lm for v, lm in merge_of.items() if not v.sequential}
        clusters = {"counts": merge_counts.tolist(),
                    **{f"{m}@{k}": lm.clusters() for (m, k), lm in one_shot.items()},
                    **{v.name: lm.clusters() for v, lm in merge_of.items() if v.sequential}}
        for v, lm in merge_of.items():
            if v.sequential:   # its calibration stream runs on under its own merge
                carry_maps[v] = Merged(lm, v.router).expert_map()
    plans = {v: Merged(merge_of[v], v.router) if v.merged
             else Substituted(kept[v.method, v.keep], _novice_constants(stats)) if v.form == "substituted"
             else Kept(np.asarray(carry_maps[v])) for v in streams.order[1:]}
    for v, layer_plan in plans.items():  # the rule every variant meets, before this layer computes under it
        check_routable(layer_plan.routable_E, layer_idx, cfg, v.name)
    return _LayerDecision(plans, carry_maps, clusters, stats, layer_sc, kept, merged_experts)


def _carry_calibration(graphdef, state, streams: _Streams, cal_hz: dict, carry_maps: dict) -> None:
    """The MLP on the calibration streams, once per group: a stream this layer prunes (a variant at a
    MoE layer, by its own mask) leaves its group for one of its own, keyed by itself; the streams
    it does not prune move on together. (A group keyed by a variant holds that variant alone, so
    the two kinds of key never meet.)"""
    carried, carries = {}, {}
    for key, group in streams.group.items():
        variant = carry_maps.get(key)
        new_group = group if variant is None else key
        if new_group not in carried:
            carried[new_group] = [mlp(graphdef, state, a.h_BSH, a.z_BSH, variant, ids)
                                  for a, ids in zip(cal_hz[group], streams.cal_ids)]
            carries[new_group] = [a.carry for a in cal_hz[group]]
        streams.group[key] = new_group
    streams.cal, streams.cal_carry = carried, carries


def _recorded_plans(plans: dict, kept_experts: dict | None) -> dict:
    """The plans as the pass records them: a merge's plans (one LayerMerge for both router forms)
    keep its clusters, and with `kept_experts` ({id(merge): the merge with all its experts},
    filled by `_table_groups`) all its merged experts."""
    recorded, out = {}, dict(plans)
    for v, p in plans.items():
        if v.merged:
            if id(p.merge) not in recorded:
                recorded[id(p.merge)] = kept_experts.get(id(p.merge), p.merge) if kept_experts is not None else (
                    p.merge if p.merge.weights is None else dataclasses.replace(p.merge, weights=None))
            out[v] = Merged(recorded[id(p.merge)], v.router)
    return out


def _layer_merges(layer, layer_idx, cal_hz, streams: _Streams, methods: _Methods, counts, scores_of, seed
                  ) -> tuple[dict, np.ndarray, Callable]:
    """({merged variant: its LayerMerge at this layer}, the routing decisions per expert on the
    unpruned calibration stream, experts(merge, rows_only): its merged experts, as `AveragedRows`
    of its clusters of two or more over the layer's experts (rows_only; made when read) or as every
    cluster's rows): one-shot merges from the unpruned calibration stream, sequential ones from
    their own (a sequential variant whose stream is still the unpruned one shares the one-shot
    merge). Statistics and clusters are computed once per calibration group. A merge comes with
    its merged experts only when a sequential variant's calibration stream runs under it here; the
    others' are made by `experts` when their held-out streams run (`_table_groups`: one merge's at
    a time)."""
    # the experts as held (their stored dtype where it is exact: `stored_expert_dtype`), no copy: the
    # merge code casts one expert at a time, and returns the merged experts in this dtype, as
    # `moejax merge` writes them (a bfloat16 checkpoint's merged experts are bfloat16)
    host = {k: np.asarray(v) for k, v in layer.mlp.expert_weights().items()}
    options = merge_stats_options(methods.merges)
    group_stats, done, source = {}, {}, {}
    alignments = {}   # M-SMoE's (leader, member) alignments of these weights, shared by every keep and stream
    n_experts = len(next(iter(host.values())))

    def experts(lm: LayerMerge, rows_only: bool = True):
        """The merge's `AveragedRows` (rows_only: its clusters of two or more, in n_experts rows so
        every merge of the layer's shape shares one compiled program), or its merged experts
        {name: [C, ...]} (bitwise the same rows: `averaged_rows`)."""
        ctx = source[id(lm)]
        if not rows_only:
            return merged_rows(lm.method, lm.labels_E, lm.leaders, ctx, host)
        a = merge_averaging(lm.method, lm.labels_E, lm.leaders, ctx, host)
        return averaged_rows(host, lm.labels_E, a, lm.shared_clusters(), n_experts)

    def stats_of(group):
        if group not in group_stats:
            zs = [a.z_BSH.reshape(-1, a.z_BSH.shape[-1]) for a in cal_hz[group]]
            group_stats[group] = merge_stats(layer.mlp, zs, [None] * len(zs), **options)
        return group_stats[group]

    def merged(method, keep, group, with_experts):
        if (method, keep, group) not in done:
            _, layer_sc = scores_of(group)
            scores_E = layer_sc[method.scores[0]] if method.scores else None   # REAM's centroid score
            ctx = MergeContext.of(stats_of(group), scores_E, seed, alignments, layer.mlp.expert_fn)
            labels = method.clusters(counts[method.name, keep][layer_idx], ctx)
            lm = LayerMerge(method, labels, method.leaders(labels, ctx), None)
            source[id(lm)] = ctx
            if with_experts:
                lm = dataclasses.replace(lm, weights=experts(lm, rows_only=False))
                source[id(lm)] = ctx
            done[method, keep, group] = lm
        return done[method, keep, group]

    variants = [v for v in streams.order[1:] if v.merged]
    for v in sorted(variants, key=lambda v: not v.sequential):   # the merges a calibration stream runs under first
        merged(methods.merge(v.method), v.keep, streams.group[v] if v.sequential else None, v.sequential)
    merge_of = {v: done[methods.merge(v.method), v.keep, streams.group[v] if v.sequential else None] for v in variants}
    return merge_of, stats_of(None).counts_E, experts   # (the unpruned stream's, with or without a one-shot merge)


def _table_groups(plans: list, own: dict, n_experts: int, experts: Callable | None,
                  kept_experts: dict | None) -> list[TableGroup]:
    """A MoE layer's held-out streams by the expert table they compute with (plans[a]: stream a's
    LayerPlan, None for the unpruned stream): the layer's own experts first, then one group per
    merge, whose merged experts `experts(merge)` gives when the group runs, as rows made when read
    (kept_experts: {id(merge): the merge with all its experts}, filled for the plans when given)."""
    own_streams = [a for a, p in enumerate(plans) if not isinstance(p, Merged)]
    groups = [TableGroup(own_streams, lambda: stacked_expert_map([plans[a] for a in own_streams], own, n_experts))]
    by_merge = {}
    for a, p in enumerate(plans):
        if isinstance(p, Merged):
            by_merge.setdefault(id(p.merge), []).append(a)

    def merge_map(streams):
        lm = plans[streams[0]].merge
        if kept_experts is not None or lm.weights is not None:   # the whole merge: kept for the plans
            whole = lm if lm.weights is not None else dataclasses.replace(lm, weights=experts(lm, rows_only=False))
            if kept_experts is not None:
                kept_experts[id(lm)] = whole
            return stacked_expert_map([Merged(whole, plans[a].form) for a in streams], own, n_experts)
        # only the merged experts of clusters of two or more (a singleton computes with its own expert)
        return stacked_expert_map([plans[a] for a in streams], own, n_experts, experts(lm))

    return groups + [TableGroup(streams, functools.partial(merge_map, streams), own=False)
                     for streams in by_merge.values()]


def _novice_constants(stats) -> np.ndarray:
    """[E, H]: what a substituted expert returns, its mean output over the calibration tokens routed
    to it (MoNE's novice; 0 for an expert no token chose)."""
    return np.asarray(stats.mean_output_EH, np.float32)


def _perplexity_rows(ckpt: OpenCheckpoint, streams: _Streams, dtype, unpruned: bool = True) -> list[dict]:
    """The final norm and head on every held-out stream (`moejax.inference.stream.head_pass`): a
    perplexity row per stream and text, and over all texts ("all"); for every variant also its
    agreement with the unpruned stream (`moejax.inference.agreement`: ESAP, KL, top-1), the mean
    over the same positions. unpruned False: no rows for the unpruned stream."""
    out = head_pass(ckpt, streams.held, streams.held_ids, dtype, agreement=len(streams.order) > 1)
    per_metric = {"perplexity": out.nll, **({} if out.esap is None else
                                           {"esap": out.esap, "kl": out.kl, "top1_agreement": out.top1})}
    rows, totals = [], {}
    for metric, values in per_metric.items():
        for text, per_batch in values.items():   # [A or 1, B, S - 1] per batch
            for i, v in enumerate(streams.order):
                if v is None and (metric != "perplexity" or not unpruned):
                    continue   # the unpruned stream against itself
                total = sum(float(b[i if b.shape[0] > 1 else 0].sum(dtype=np.float64)) for b in per_batch)
                count = sum(b[0].size for b in per_batch)
                totals.setdefault((metric, v), [0.0, 0])
                totals[metric, v][0] += total
                totals[metric, v][1] += count
                rows.append(_head_row(metric, v, text, total, count))
    return rows + [_head_row(metric, v, "all", s, n) for (metric, v), (s, n) in totals.items()]


def _head_row(metric: str, v, text: str, total: float, count: int) -> dict:
    """A perplexity row (`ppl_row`: exp of the mean NLL), or an agreement metric's mean."""
    if metric == "perplexity":
        return ppl_row(v, text, total, count)
    return dict(v.row(), text=text, metric=metric, value=total / count)
